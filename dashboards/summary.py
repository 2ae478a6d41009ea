"""The summary card's headline numbers, each read from one result file of one results directory.

- **Routing imbalance** (``moetrace analyze`` results, ``imbalance.parquet``): the imbalance factor
  of the whole trace (dataset ``all``), averaged over MoE layers, for prefill (or the first stage
  there is), the other stage's mean, and the worst layer; with ``batch_imbalance.parquet`` also the
  median IF of random serving-sized batches (over batches and layers), the number ``analyze``
  prints as ``batch_if``. Layers without recorded routing (NaN: a partial capture) are left out of
  every mean, median and the worst layer, and the label says how many of the layers had routing;
  what ``analyze`` skipped (its manifest's ``skipped``) is listed by ``analysis_skipped_notes``.
- **Best deployable placement vs linear** (``moetrace compare`` results, ``summary.parquet``): the
  registered strategy other than the reference (``compare.json`` ``reference``, i.e. linear) with
  the lowest time in compare's verdict measure (``compare.json`` ``verdict``: MoE-layer time,
  ``moe_time_normalized_median``, with the all-to-all time beside it; results without a MoE-layer
  verdict: ``a2a_time_normalized_median``, a held-out decode step's predicted all-to-all seconds /
  the reference's median) among rows not ``over_node_load_limit``, with its
  ``inter_node_normalized_median`` and ``busiest_node_load``; the copy models and links the time
  was predicted for are named with it. A row over the node-load limit is never best; when one
  has the lowest time, one more line names it and its load. Bounds no deployment can reach
  (``oracle``, ``perfect_routing``) are never named best; their value is quoted. Results written
  before the cost model (no time columns): the strategy with the lowest
  ``inter_node_normalized_median`` (bytes), as then. Under it, one line per simulated stage
  (decode, then prefill) names that stage's fastest deployable strategy with the copy model the
  stage was simulated with (``stage_winners``): the winner depends on it.
- **Measured vs predicted all-to-all** (``moetrace a2a`` results, ``a2a.json`` ``summary`` and
  ``collectives.parquet``): for the strategy with the lowest measured normalized inter-node bytes,
  measured and simulated, and whether every collective sent exactly the predicted bytes.

A headline exists only when its file does; it links to the section drawn from the same file.

Out of scope: computing any of these (the producers do; this module only reduces their tables to
one number each), the card's HTML (``page``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl

import moetrace.results as rf
from moetrace.dashboards.page import Headline
from moetrace.dashboards.results import Results
from moetrace.dashboards.section_imbalance import _stages
from moetrace.placement.compare_row import Measure
from moetrace.placement.decision import StageChoice
from moetrace.stats import mean_skip_nan


def _x(v: float) -> str:
    """A ratio as shown on the card: ``1.34×``."""
    return f"{v:.2f}×"


def _mean_x(if_N: pl.Series) -> str:
    """The mean of the defined (non-NaN) IFs as ``1.34×``; ``no recorded routing`` when none is."""
    v, _ = mean_skip_nan(if_N.to_numpy())
    return "no recorded routing" if np.isnan(v) else _x(v)


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
    every = pooled.filter(pl.col("stage") == stage)
    sub = every.filter(pl.col("imbalance_factor").is_not_nan())  # layers with recorded routing
    if sub.height == 0:
        return None
    mean = float(sub["imbalance_factor"].mean())  # type: ignore[arg-type]  # polars types Series.mean() as any Python literal
    worst = sub.sort("imbalance_factor", descending=True).row(0, named=True)
    facts = [f"{s} {_mean_x(pooled.filter(pl.col('stage') == s)['imbalance_factor'])}" for s in stages[1:]]
    facts.append(f"worst layer {worst['model_layer']}: {_x(worst['imbalance_factor'])}")
    bt = res.table(rf.BATCH_IMBALANCE)
    if bt is not None:
        bsub = bt.filter(
            (pl.col("dataset") == "all") & (pl.col("stage") == stage) & pl.col("imbalance_factor").is_not_nan()
        )
        if bsub.height:
            size = ((res.json(rf.ANALYSIS_SUMMARY) or {}).get("imbalance") or {}).get("batch_size")
            batches = f"{size}-request batches" if size else "serving-sized batches"
            facts.append(f"random {batches}: median {_x(float(bsub['imbalance_factor'].median()))}")  # type: ignore[arg-type]  # polars types Series.median() as any Python literal
    return Headline(
        key=f"{key_prefix}imbalance",
        title="Routing imbalance" + suffix,
        value=_x(mean),
        label=f"{stage}, mean over {sub.height} MoE layers"
        + (
            f" ({every.height - sub.height} of {every.height} without recorded routing)"
            if sub.height < every.height
            else ""
        ),
        detail="Busiest expert's tokens / the mean expert's (1 = balanced), all datasets pooled; "
        + "; ".join(facts)
        + ".",
        href=f"{key_prefix}imbalance",
        link="Load imbalance",
        source=res.source(rf.IMBALANCE),
    )


def analysis_skipped_notes(res: Results) -> list[str]:
    """One line per analysis (or part) ``moetrace analyze`` skipped, with its reason (its manifest's ``skipped``)."""
    return [f"{part} ({res.path}): skipped, {why}" for part, why in (res.manifest.get("skipped") or {}).items()]


def _change(v: float) -> str:
    """A value normalized to the reference as a signed change: 0.88 -> ``−12%``, 1.031 -> ``+3.1%``
    (one decimal below 10%)."""
    d = 100.0 * (v - 1.0)
    text = f"{abs(d):.0f}" if abs(d) >= 9.95 else f"{abs(d):.1f}"
    if float(text) == 0.0:
        return "±0%"
    return f"{'−' if d < 0 else '+'}{text}%"


def placement_headline(res: Results, *, key_prefix: str = "", suffix: str = "") -> Headline | None:
    """The best deployable strategy by compare's verdict measure per step (MoE-layer time; all-to-all time
    for results without a MoE-layer verdict), from ``summary.parquet``;
    by inter-node bytes for results written before the cost model (None when absent, or when it
    holds no strategy besides the reference)."""
    from moetrace.dashboards.section_placement import has_time

    summary = res.table(rf.COMPARE_SUMMARY)
    if summary is None:
        return None
    if has_time(summary):
        return _time_headline(res, summary, key_prefix=key_prefix, suffix=suffix)
    return _bytes_headline(res, summary, key_prefix=key_prefix, suffix=suffix)


def _time_headline(res: Results, summary: pl.DataFrame, *, key_prefix: str, suffix: str) -> Headline | None:
    from moetrace.dashboards.section_placement import STRATEGY_NAMES, copy_models, finite, held_out, links_text
    from moetrace.dashboards.section_placement_text import summary_rows
    from moetrace.placement.strategies import STRATEGY_NAMES as REGISTERED

    m = res.compare
    ref = m.reference
    moe_verdict = _moe_verdict(res)
    measure: Measure = "moe" if moe_verdict else "a2a"
    what = "MoE-layer time" if moe_verdict else "all-to-all time"
    typed = summary_rows(summary, where=res.source(rf.COMPARE_SUMMARY))
    rows = {s: r for s, r in typed.items() if finite(r.time_normalized(measure)) is not None}
    candidates = {s: r for s, r in rows.items() if s != ref and s in REGISTERED}
    if not candidates:
        return None

    def name(s: str) -> str:
        return STRATEGY_NAMES.get(s, s)

    def facts(s: str) -> str:
        r = candidates[s]
        load = finite(r.busiest_node_load)
        inter = finite(r.inter_node_normalized_median)
        return (
            f"{_change(r.time_normalized(measure))} predicted {what} per step ({'-' if inter is None else _change(inter)} "
            f"inter-node bytes), node load {'-' if load is None else f'{load:.2f}'}"
        )

    within = {s: r.time_normalized(measure) for s, r in candidates.items() if not r.over_node_load_limit}
    best_v = min(within.values()) if within else None
    best = [s for s, v in within.items() if v == best_v]
    fastest = min(candidates, key=lambda s: candidates[s].time_normalized(measure))
    fv = candidates[fastest].time_normalized(measure)
    note = ""
    if candidates[fastest].over_node_load_limit and fv < min(1.0, best_v if best_v is not None else 1.0):
        load = finite(candidates[fastest].busiest_node_load)
        limit = "" if m.max_node_load is None else f" (the limit is {m.max_node_load:.2f}×)"
        note = (
            f"{name(fastest)} would be {_change(fv)[1:]} faster but sends "
            f"{'-' if load is None else f'{load:.2f}'}× an even share to one node{limit}"
        )
    winners = stage_winners(res)
    dec = next((w.choice for w in winners if w.stage == "decode" and w.choice is not None), None)
    keep = False
    if dec is not None and dec.strategy in within:  # the one rule (decision.choose): ties, the 3 % floor
        best, best_v = [dec.strategy], within[dec.strategy]
        keep = dec.decision == dec.reference
    if keep and best and best[0] != ref:
        value = f"keep {ref}"
        label = f"{dec.why if dec is not None else ''}; closest: {name(best[0])}: {facts(best[0])}"
    elif best_v is not None and best_v < 1.0 and not keep:
        value = _change(best_v)
        label = f"{' = '.join(name(s) for s in best)}: {facts(best[0])}"
    else:
        value = "none"
        label = f"no {'deployable ' if note else ''}placement beats {ref} on predicted {what}" + (
            f"; closest: {name(best[0])}: {facts(best[0])}" if best else ""
        )
    r = candidates[best[0]] if best else None
    moe = None if r is None else finite(r.moe_time_normalized_median)
    a2a = None if r is None else finite(r.a2a_time_normalized_median)
    prefill = None if r is None else finite(r.prefill_time_normalized(measure))
    also = []
    if r is not None:
        if moe_verdict:
            also.append(f"its all-to-all (dispatch + combine) {'-' if a2a is None else _change(a2a)}")
        else:
            also.append(
                f"its MoE layers (dispatch + experts + combine) {_change(moe)}"
                if moe is not None
                else "MoE-layer time not predicted: the model's expert size is unknown"
            )
        kinds: tuple[tuple[str, Measure], ...] = (("MoE layers", "moe"), ("all-to-all", "a2a"))  # the verdict's first
        pre = {what_: finite(r.prefill_time_normalized(c)) for what_, c in (kinds if moe_verdict else kinds[::-1])} | {
            "inter-node bytes": finite(r.prefill_inter_node_normalized_median)
        }
        if prefill is not None:
            also.append("its prefill " + ", ".join(f"{w} {_change(v)}" for w, v in pre.items() if v is not None))
        costs = {
            "decode MoE layers": moe,
            "decode all-to-all": a2a,
            "decode inter-node bytes": finite(r.inter_node_normalized_median),
            **{f"prefill {w}": v for w, v in pre.items()},
        }
        worse = [f"{w} {_change(v)}" for w, v in costs.items() if v is not None and round(v, 3) > 1.0]
        if worse and not note and best[0] != ref and value not in ("none", f"keep {ref}"):
            note = f"{name(best[0])} is worse than {ref} in: {', '.join(worse)}"
    bounds = [
        f"{name(s)} {_change(b.time_normalized(measure))}" for s, b in rows.items() if s != ref and s not in REGISTERED
    ]
    links = links_text(m)
    limit = (
        ""
        if m.max_node_load is None
        else f"; deployable: a router sends no node more than {m.max_node_load:.2f}× an even share"
    )
    head = (
        "Decode MoE layers (dispatch + the slowest GPU's experts + combine; the verdict compare ranks by)"
        if moe_verdict
        else "Decode all-to-all (dispatch + combine)"
    )
    detail = (
        f"{head} predicted per step, all MoE layers, the busiest GPU of each "
        f"collective charged: median over {m.num_batches} {held_out(m)} batches vs {ref}'s median (lower is better)"
        + (f"; {'; '.join(also)}" if also else "")
        + f". Copies: {copy_models(m)}"
        + (f". Links: {links}" if links else "")
        + f". {m.deployment} on {m.num_nodes} node(s){limit}"
        + (f"; bounds, not deployable: {', '.join(bounds)}" if bounds else "")
        + "."
    )
    return Headline(
        key=f"{key_prefix}placement",
        title=f"Best deployable placement vs {ref}" + suffix,
        value=value,
        label=label,
        detail=detail,
        href=f"{key_prefix}placement",
        link="Placement and all-to-all volume",
        source=res.source(rf.COMPARE_SUMMARY),
        note=note,
        lines=tuple(w.text() for w in winners),
    )


@dataclass(frozen=True, kw_only=True)
class StageWinner:
    """The decision of one simulated stage (``stage_winners``)."""

    stage: str  # "decode" or "prefill"
    copies: str  # the stage's copy model in words (``section_placement.COPY_MODELS``)
    strategy: str | None  # registry name of the fastest deployable strategy; None when none has a time
    ratio: float | None  # its predicted time per step in ``what`` / the reference's median (< 1: faster)
    reference: str  # the strategy it is compared with (``compare.json`` ``reference``)
    what: str = "all-to-all time"  # the measure: compare's verdict's (MoE-layer time), or all-to-all time
    choice: StageChoice | None = None  # compare.json's ``verdict.stages`` (the one rule, every cost)

    def text(self) -> str:
        """``decode (one copy per ...): joint: MoE-layer time −17 %, all-to-all −20 %, inter-node bytes
        −21 %`` (``decision.StageChoice.text``); results written before it: the fastest strategy in
        ``what``, or that none beats the reference."""
        from moetrace.dashboards.section_placement import STRATEGY_NAMES

        head = f"{self.stage} ({self.copies})"
        if self.choice is not None:
            return f"{head}{self.choice.text().removeprefix(self.stage)}"
        if self.strategy is None or self.ratio is None:
            return f"{head}: no strategy with a predicted time"
        name = STRATEGY_NAMES.get(self.strategy, self.strategy)
        if self.ratio >= 1.0:
            return f"{head}: none beats {self.reference} (closest: {name} {_change(self.ratio)})"
        return f"{head}: {name} {_change(self.ratio)} predicted {self.what} per step vs {self.reference}"


#: (stage, its summary.parquet column) in the order the stages are named
_STAGE_COLUMNS = (("decode", "a2a_time_normalized_median"), ("prefill", "prefill_a2a_time_normalized_median"))
#: the same in MoE-layer time (compare's verdict since issue #34)
_MOE_STAGE_COLUMNS = (("decode", "moe_time_normalized_median"), ("prefill", "prefill_moe_time_normalized_median"))


def stage_winners(res: Results) -> list[StageWinner]:
    """Per simulated stage (decode, then prefill when prefill steps were simulated), its decision:
    compare.json's ``verdict.stages`` (``decision.choose``, the rule ``advise`` applies too: MoE-layer
    time, under 3 % saved keep the reference, with every cost of the best option); for results written
    before it, the deployable strategy with the lowest predicted time per step from ``summary.parquet``:
    registered strategies other than the reference and within ``max_node_load`` (bounds are never
    winners). Each stage names the copy model it was simulated with (decode: ``dedup``, prefill:
    ``prefill_dedup``). Empty for results written before the cost model."""
    from moetrace.dashboards.section_placement import finite, has_time, stage_copy_model
    from moetrace.dashboards.section_placement_text import summary_rows
    from moetrace.placement.strategies import STRATEGY_NAMES as REGISTERED

    summary = res.table(rf.COMPARE_SUMMARY)
    if summary is None or not has_time(summary):
        return []
    m = res.compare
    stages = m.verdict.stages if m.verdict is not None else {}
    if stages:
        out = []
        for stage, ch in stages.items():
            out.append(
                StageWinner(
                    stage=stage,
                    copies=stage_copy_model(m, stage),
                    strategy=ch.strategy,
                    ratio=None if ch.best is None else ch.time,
                    reference=m.reference,
                    what=ch.measure,
                    choice=ch,
                )
            )
        return out
    out = []
    moe_verdict = _moe_verdict(res)
    measure: Measure = "moe" if moe_verdict else "a2a"
    typed = summary_rows(summary, where=res.source(rf.COMPARE_SUMMARY))
    for stage, col in _MOE_STAGE_COLUMNS if moe_verdict else _STAGE_COLUMNS:
        if col not in summary.columns or (stage == "prefill" and not m.num_prefill_batches):
            continue
        times = {
            s: v
            for s, r in typed.items()
            if s in REGISTERED and s != m.reference and not r.over_node_load_limit
            and (v := finite(r.time_normalized(measure) if stage == "decode" else r.prefill_time_normalized(measure)))
            is not None
        }  # fmt: skip
        best = min(times, key=lambda s: times[s]) if times else None
        out.append(
            StageWinner(
                stage=stage,
                copies=stage_copy_model(m, stage),
                strategy=best,
                ratio=None if best is None else times[best],
                reference=m.reference,
                what="MoE-layer time" if moe_verdict else "all-to-all time",
            )
        )
    return out


def _moe_verdict(res: Results) -> bool:
    """Whether compare ranked by MoE-layer time (``compare.json`` ``verdict``; results written before it
    ranked by all-to-all time)."""
    v = res.compare.verdict
    return v is not None and v.by_moe_time


def _bytes_headline(res: Results, summary: pl.DataFrame, *, key_prefix: str, suffix: str) -> Headline | None:
    """Results written before the cost model: the best strategy's normalized inter-node volume."""
    from moetrace.dashboards.section_placement import STRATEGY_NAMES
    from moetrace.dashboards.section_placement_text import summary_rows
    from moetrace.placement.strategies import STRATEGY_NAMES as REGISTERED

    deployable = set(REGISTERED)  # registered strategies; any other row is a bound (strategies.BOUNDS)
    m = res.compare
    ref = m.reference
    typed = summary_rows(summary, where=res.source(rf.COMPARE_SUMMARY))
    rows = {
        s: r.inter_node_normalized_median for s, r in typed.items() if not math.isnan(r.inter_node_normalized_median)
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

    m = res.a2a
    df = res.table(rf.A2A_COLLECTIVES)
    if not m.summary or df is None or df.height == 0:
        return None
    ref = m.reference
    finite = [r for r in m.summary if math.isfinite(r.measured_inter_node_normalized_median)]
    others = [r for r in finite if r.strategy != ref] or finite
    if not others:
        return None
    best = min(others, key=lambda r: r.measured_inter_node_normalized_median)
    name = STRATEGY_NAMES.get(best.strategy, best.strategy)
    bad = mismatches(df)
    flagged = not m.bytes_match
    if bad:
        check = f"WARNING: {bad} of {df.height:,} (collective, rank) pairs sent other bytes than predicted"
    elif flagged:
        check = f"WARNING: the replay reported a mismatch ({m.first_mismatch})"
    else:
        check = f"all {df.height:,} (collective, rank) pairs sent exactly the predicted bytes"
    backend = f"{m.backend} on {m.device}"
    return Headline(
        key=f"{key_prefix}a2a",
        title="Measured vs predicted all-to-all" + suffix,
        value=f"{_x(best.measured_inter_node_normalized_median)} / {_x(best.simulated_inter_node_normalized_median)}",
        label=f"{name}: measured / predicted, vs {ref}",
        detail=f"Median inter-node bytes per batch / {ref}'s, sent by real collectives ({backend}) / by the simulator; "
        f"{check}.",
        href=f"{key_prefix}a2a",
        link="Measured all-to-all vs predictions",
        source=res.source(rf.A2A_MANIFEST),
        warning=bool(bad) or flagged,
    )
