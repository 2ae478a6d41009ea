"""``moetrace.data``: bundled model presets (``models/``), prompt sets (``prompts/``), synth
calibrations (``synth/``) and the sample inputs of the README's import lines (``samples/``, written by
``benchmarks/make_samples.py``), read with ``importlib.resources``. No code.
"""

if __name__ != "moetrace.data":  # pragma: no cover - only when a checkout's folder is put on sys.path by hand
    raise ImportError(
        f"this folder is the package moetrace.data (repository folder data/, linked as moetrace/data); "
        f"import it as moetrace.data, not {__name__} (docs/architecture.md)"
    )
