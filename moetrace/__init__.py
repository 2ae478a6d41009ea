"""moetrace: expert-activation traces for Mixture-of-Experts serving.

Stages (each a sub-package, one folder at the repository's top level):

- ``moetrace.tracer``     collect traces (HF transformers, vLLM, import) and the trace store
- ``moetrace.analysis``   imbalance, correlations, embeddings, classifiers
- ``moetrace.placement``  micro-batch grouping, expert placement, all-to-all volume, exports
- ``moetrace.dashboards`` interactive Plotly reports
- ``moetrace.data``       bundled model presets and prompt sets

Importing ``moetrace`` imports nothing heavy.
"""

__version__ = "0.1.0"
