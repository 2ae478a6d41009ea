"""``moetrace.dashboards``: one self-contained interactive Plotly report from traces and results.

Out of scope: computing results (``moetrace.analysis``, ``moetrace.placement``).
"""

if __name__ != "moetrace.dashboards":  # pragma: no cover - only when a checkout's folder is put on sys.path by hand
    raise ImportError(
        f"this folder is the package moetrace.dashboards (repository folder dashboards/, linked as moetrace/dashboards); "
        f"import it as moetrace.dashboards, not {__name__} (docs/architecture.md)"
    )
