"""The summary card's headline numbers, each read from one result file of one results directory.

- **Routing imbalance** (``moetrace analyze`` results, ``imbalance.parquet``): the imbalance factor
  of the whole trace (dataset ``all``), averaged over MoE layers, for prefill (or the first stage
  there is), the other stage's mean, and the worst layer; with ``batch_imbalance.parquet`` also the
  median IF of random serving-sized batches (over batches and layers), the number ``analyze``
  prints as ``batch_if``.
- **Best placement vs linear** (``moetrace compare`` results, ``summary.parquet``): the strategy
  with the lowest ``inter_node_normalized_median`` (a held-out batch's inter-node bytes / the
  reference's median, reference = ``compare.json`` ``reference``, i.e. linear). Bounds that no
  deployment can reach (strategy ``oracle``) are never named best; their value is quoted.
- **Measured vs predicted all-to-all** (``moetrace a2a`` results, ``a2a.json`` ``summary`` and
  ``collectives.parquet``): for the strategy with the lowest measured normalized inter-node bytes,
  measured and simulated, and whether every collective sent exactly the predicted bytes.

A headline exists only when its file does; it links to the section drawn from the same file.

Out of scope: computing any of these (the producers do; this module only reduces their tables to
one number each), the card's HTML (``page``).
"""

from __future__ import annotations

import polars as pl

import moetrace.results as rf
from moetrace.dashboards.page import Headline
from moetrace.dashboards.results import Results
from moetrace.dashboards.section_imbalance import _stages


def _x(v: float) -> str:
    """A ratio as shown on the card: ``1.34×``."""
    return f"{v:.2f}×"


def imbalance_headline(res: Results, *, key_prefix: str = "", suffix: str = "") -> Headline | None:
    """Mean IF over layers of the whole trace, from ``imbalance.parquet`` (None when absent or it has no ``all`` rows)."""
    imb = res.table(rf.IMBALANCE)
    if imb is None:
        return None
    pooled = imb.filter(pl.col("dataset") == "all")
    if pooled.height == 0:
        return None
    stages = _stages(pooled)
    stage = stages[0]
    sub = pooled.filter(pl.col("stage") == stage)
    mean = float(sub["imbalance_factor"].mean())  # type: ignore[arg-type]  # polars types Series.mean() as any Python literal
    worst = sub.sort("imbalance_factor", descending=True).row(0, named=True)
    facts = [f"{s} {_x(float(pooled.filter(pl.col('stage') == s)['imbalance_factor'].mean()))}" for s in stages[1:]]  # type: ignore[arg-type]  # polars types Series.mean() as any Python literal
    facts.append(f"worst layer {worst['model_layer']}: {_x(worst['imbalance_factor'])}")
    bt = res.table(rf.BATCH_IMBALANCE)
    if bt is not None:
        bsub = bt.filter((pl.col("dataset") == "all") & (pl.col("stage") == stage))
        if bsub.height:
            size = ((res.json(rf.ANALYSIS_SUMMARY) or {}).get("imbalance") or {}).get("batch_size")
            batches = f"{size}-request batches" if size else "serving-sized batches"
            facts.append(f"random {batches}: median {_x(float(bsub['imbalance_factor'].median()))}")  # type: ignore[arg-type]  # polars types Series.median() as any Python literal
    return Headline(
        key=f"{key_prefix}imbalance",
        title="Routing imbalance" + suffix,
        value=_x(mean),
        label=f"{stage}, mean over {sub.height} MoE layers",
        detail="Busiest expert's tokens / the mean expert's (1 = balanced), all datasets pooled; "
        + "; ".join(facts)
        + ".",
        href=f"{key_prefix}imbalance",
        link="Load imbalance",
        source=res.source(rf.IMBALANCE),
    )


def placement_headline(res: Results, *, key_prefix: str = "", suffix: str = "") -> Headline | None:
    """The best strategy's normalized inter-node volume, from ``summary.parquet`` (None when absent, or
    when it holds no strategy besides the reference)."""
    from moetrace.dashboards.section_placement import STRATEGY_NAMES
    from moetrace.placement.strategies import STRATEGY_NAMES as REGISTERED

    deployable = set(REGISTERED)  # registered strategies; any other row is a bound (strategies.BOUNDS)
    summary = res.table(rf.COMPARE_SUMMARY)
    if summary is None:
        return None
    m = res.compare
    ref = m.reference
    col = "inter_node_normalized_median"
    rows = {
        r["strategy"]: float(r[col])
        for r in summary.select("strategy", col).iter_rows(named=True)
        if r[col] is not None
    }
    candidates = {s: v for s, v in rows.items() if s != ref and s in deployable}
    if not candidates:
        return None
    best_v = min(candidates.values())
    best = [s for s, v in candidates.items() if v == best_v]
    names = " = ".join(STRATEGY_NAMES.get(s, s) for s in best)
    change = f"{100 * (1 - best_v):.0f}% fewer" if best_v < 1.0 else f"{100 * (best_v - 1):.0f}% more"
    bounds = [f"{STRATEGY_NAMES.get(s, s)} {_x(v)}" for s, v in rows.items() if s != ref and s not in deployable]
    detail = (
        f"Inter-node all-to-all bytes of a held-out global batch / {ref}'s median, median over "
        f"{m.num_batches} batches (lower is better); {m.deployment} on {m.num_nodes} node(s)"
        + (f"; bounds, not deployable: {', '.join(bounds)}" if bounds else "")
        + "."
    )
    return Headline(
        key=f"{key_prefix}placement",
        title=f"Best placement vs {ref}" + suffix,
        value=_x(best_v),
        label=f"{names}: {change} inter-node bytes",
        detail=detail,
        href=f"{key_prefix}placement",
        link="Placement and all-to-all volume",
        source=res.source(rf.COMPARE_SUMMARY),
    )


def a2a_headline(res: Results, *, key_prefix: str = "", suffix: str = "") -> Headline | None:
    """Measured vs simulated normalized inter-node bytes of the best measured strategy (``a2a.json``
    ``summary``) and the byte check over ``collectives.parquet`` (None when either is absent)."""
    from moetrace.dashboards.section_a2a import mismatches
    from moetrace.dashboards.section_placement import STRATEGY_NAMES

    rows = [r for r in res.manifest.get("summary") or [] if isinstance(r, dict)]
    df = res.table(rf.A2A_COLLECTIVES)
    if not rows or df is None or df.height == 0:
        return None
    ref = str(rows[0].get("reference", "linear"))
    measured = "measured_inter_node_normalized_median"
    others = [r for r in rows if r.get("strategy") != ref and r.get(measured) is not None] or [
        r for r in rows if r.get(measured) is not None
    ]
    if not others:
        return None
    best = min(others, key=lambda r: float(r[measured]))
    name = STRATEGY_NAMES.get(str(best["strategy"]), str(best["strategy"]))
    bad = mismatches(df)
    flagged = res.manifest.get("bytes_match") is False
    if bad:
        check = f"WARNING: {bad} of {df.height:,} (collective, rank) pairs sent other bytes than predicted"
    elif flagged:
        check = f"WARNING: the replay reported a mismatch ({res.manifest.get('first_mismatch')})"
    else:
        check = f"all {df.height:,} (collective, rank) pairs sent exactly the predicted bytes"
    backend = f"{res.manifest.get('backend', '?')} on {res.manifest.get('device', '?')}"
    return Headline(
        key=f"{key_prefix}a2a",
        title="Measured vs predicted all-to-all" + suffix,
        value=f"{_x(float(best[measured]))} / {_x(float(best['simulated_inter_node_normalized_median']))}",
        label=f"{name}: measured / predicted, vs {ref}",
        detail=f"Median inter-node bytes per batch / {ref}'s, sent by real collectives ({backend}) / by the simulator; "
        f"{check}.",
        href=f"{key_prefix}a2a",
        link="Measured all-to-all vs predictions",
        source=res.source(rf.A2A_MANIFEST),
        warning=bool(bad) or flagged,
    )
