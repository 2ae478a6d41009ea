"""``moetrace.analysis``: the structure in a trace (load, imbalance, correlations, embeddings,
classifiers, cross-layer affinity). Reads traces through ``moetrace.tracer.trace`` only.

Out of scope: decisions (``moetrace.placement``), drawing (``moetrace.dashboards``).
"""

if __name__ != "moetrace.analysis":  # pragma: no cover - only when a checkout's folder is put on sys.path by hand
    raise ImportError(
        f"this folder is the package moetrace.analysis (repository folder analysis/, linked as moetrace/analysis); "
        f"import it as moetrace.analysis, not {__name__} (docs/architecture.md)"
    )
