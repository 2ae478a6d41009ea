"""``moetrace.placement``: deployments, request grouping, expert placers (pure functions of
arrays) and their registry (``strategies``), the all-to-all volume model, the printed reports,
and exports for serving engines.

Out of scope: reading raw traces beyond what ``moetrace.analysis.counts`` gives; drawing.
"""

if __name__ != "moetrace.placement":  # pragma: no cover - only when a checkout's folder is put on sys.path by hand
    raise ImportError(
        f"this folder is the package moetrace.placement (repository folder placement/, linked as moetrace/placement); "
        f"import it as moetrace.placement, not {__name__} (docs/architecture.md)"
    )
