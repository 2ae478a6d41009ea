"""moetrace: expert-activation traces for Mixture-of-Experts serving.

Stages (each a sub-package, one folder at the repository's top level, linked into this folder so
the import names are the same from a checkout, an editable install and a wheel):

- ``moetrace.tracer.trace`` the trace format v1: schema, file layout, writer, reader, validator
- ``moetrace.tracer``     what produces traces: collect (HF transformers, vLLM), import, synth
- ``moetrace.analysis``   imbalance, correlations, embeddings, classifiers
- ``moetrace.placement``  micro-batch grouping, expert placement, all-to-all volume, exports
- ``moetrace.dashboards`` interactive Plotly reports
- ``moetrace.data``       bundled model presets and prompt sets

Core modules here import no stage: ``errors``, ``atomic``, ``results``, ``sizes``, ``_deps``; the
CLI is ``moetrace.cli``. docs/architecture.md says what each package owns and may import.

Importing ``moetrace`` imports nothing heavy.
"""

__version__ = "0.1.0"
