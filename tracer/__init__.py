"""``moetrace.tracer``: traces and everything that produces them.

- ``moetrace.tracer.trace``: the trace format v1 and nothing else (schema, file layout, writer,
  reader, validator, shard merge, summary). It imports no producer.
- ``moetrace.tracer.backends``: the engines that record routing (HF transformers, vLLM) and the
  pure conversion of vLLM's routed-experts arrays.
- producers around them: ``collect`` (prompts → backend → writer), ``sharding`` (several engines,
  one trace; the entry point ``run_collection``), ``datasets`` (prompt sources), ``presets`` (what
  a model name means: ``resolve``), ``importers`` (SGLang and JSONL), ``synth`` and ``synth_stats``
  (synthetic traces with planted structure).

Out of scope: what the routing means (``moetrace.analysis``).
"""

if __name__ != "moetrace.tracer":  # pragma: no cover - only when a checkout's folder is put on sys.path by hand
    raise ImportError(
        f"this folder is the package moetrace.tracer (repository folder tracer/, linked as moetrace/tracer); "
        f"import it as moetrace.tracer, not {__name__} (docs/architecture.md)"
    )
