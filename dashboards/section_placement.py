"""Placement section, from ``moetrace compare`` results (docs/placement.md, core paper Fig. 9).

Figures (files and columns as written by ``moetrace.placement.compare.write_results``):

- Predicted time per step, normalized, a box per strategy over the simulated global batches (results
  written with the cost model, ``placement/cost.py``): ``batches.parquet`` ``a2a_time_normalized``
  (decode all-to-all, dispatch + combine, all MoE layers, the busiest GPU of each collective
  charged) and ``moe_time_normalized`` (the MoE layer: dispatch + experts + combine; drawn when the
  model's expert size was known), each a batch's seconds / the reference's median.
- Predicted all-to-all time per layer: median over batches of ``layers.parquet``
  ``dispatch_seconds + combine_seconds``.
- Normalized inter-node volume per strategy, a box per strategy over the simulated global batches:
  ``batches.parquet`` ``inter_node_normalized`` = a batch's inter-node bytes (dispatch + combine,
  all MoE layers) / the median of the reference strategy's (linear). Lower is better; the dotted
  line is the reference median (1).
- Per-layer inter-node share, a line per strategy: for each layer, Σ over batches of inter-node
  bytes / Σ of all bytes (intra + inter, dispatch + combine), from ``layers.parquet``.
- Per-layer normalized inter-node volume: median over batches of ``layers.parquet``
  ``inter_node_normalized`` (per layer, to the reference's median of that layer).
- Placement map, layer × GPU: the logical expert in every physical slot, slots grouped by GPU
  (``placements.parquet``: strategy, layer, model_layer, slot, gpu, node, expert), a dropdown per
  strategy; node boundaries drawn as lines.
- The summary table (``summary.parquet``) above the figures: predicted time per step first (when
  the results have it), then bytes, node and GPU load; bound rows (not deployable) in a table of
  their own below it. Results written before the cost model have no time columns: the table and
  figures show bytes alone, as they always did.

Measured all-to-all (replayed through real collectives by ``moetrace a2a``) against these predictions
is drawn by ``section_a2a`` from that command's results directory.

Shape legend (docs/architecture.md): V strategies, B global batches, L MoE layers, P physical
slots, W GPUs (EP ranks).

Out of scope: placing or simulating (``moetrace.placement``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from moetrace.dashboards.figures import lines_by_layer
from moetrace.dashboards.page import Figure, Section, Table
from moetrace.dashboards.results import Results, layer_order
from moetrace.dashboards.theme import (
    DIVERGING,
    REFERENCE_LINE,
    category_colour,
    dropdown,
    finish,
    plotly_go,
)
from moetrace.placement.compare_manifest import CompareManifest
from moetrace.placement.strategies import BOUNDS, LABELS, RECOMMENDED
from moetrace.placement.strategies import STRATEGY_NAMES as REGISTERED
from moetrace.results import (
    COMPARE_BATCHES,
    COMPARE_LAYERS,
    COMPARE_PLACEMENTS,
    COMPARE_SUMMARY,
    EXPERT_LOAD,
)

#: strategy -> its label in figures, in registry order (which also fixes each strategy's colour)
STRATEGY_NAMES = LABELS  # strategies and the bounds compare reports


#: the legend group and table caption of the rows that are bounds, not strategies
BOUNDS_GROUP = "bounds, not deployable"
#: the recommended strategy's colour: black, which no other strategy has (categories skip it)
RECOMMENDED_COLOUR = "#000000"
#: bounds are drawn in greys (dotted lines), apart from the strategies' colours
_BOUND_COLOURS = ("#7a7a7a", "#a9a9a9", "#5a5a5a")


def is_bound(name: str) -> bool:
    """A row of compare's results that no deployment reaches (any name outside the strategy registry)."""
    return name not in REGISTERED


def recommended_of(strategies: list[str]) -> str | None:
    """The strategy the page emphasises: the recommended one (ours), else, in results without it, joint."""
    return next((s for s in (RECOMMENDED, "joint") if s in strategies), None)


def strategy_colours(strategies: list[str]) -> dict[str, str]:
    """Fixed colours per known strategy so every figure and report agrees; unknown ones after;
    the recommended strategy black; bounds in greys."""
    known = list(REGISTERED)
    bounds = [s for s in strategies if is_bound(s)]
    return {
        s: _BOUND_COLOURS[bounds.index(s) % len(_BOUND_COLOURS)]
        if is_bound(s)
        else RECOMMENDED_COLOUR
        if s == recommended_of(strategies)
        else category_colour(known.index(s) if s in known else len(known) + i)
        for i, s in enumerate(strategies)
    }


def _strategies(res: Results, df: pl.DataFrame) -> list[str]:
    """The rows of ``df`` in page order: the reference, the recommended strategy, the other strategies
    as compare.json lists them, then the bounds."""
    order, ref = res.compare.strategies, res.compare.reference
    have = df["strategy"].unique().to_list()
    rec = recommended_of(have)
    out = ([ref] if ref in have else []) + ([rec] if rec is not None and rec != ref else [])
    out += [s for s in order if s in have and s not in out and not is_bound(s)]
    out += sorted(s for s in have if s not in out and not is_bound(s))
    return out + [s for s in dict.fromkeys([*res.compare.bounds, *sorted(have)]) if s in have and is_bound(s)]


def _line_style(res: Results, strategies: list[str]) -> dict[str, Any]:
    """``lines_by_layer``'s keyword arguments for these strategies: colours, the recommended strategy
    emphasised (on top, thicker, first in the legend), bounds dotted in their own legend group."""
    label = {s: STRATEGY_NAMES.get(s, s) for s in strategies}
    return {
        "colours": {label[s]: c for s, c in strategy_colours(strategies).items()},
        "emphasis": label[rec] if (rec := recommended_of(strategies)) is not None else None,
        "groups": {label[s]: BOUNDS_GROUP for s in strategies if is_bound(s)},
        "dash": {label[s]: "dot" for s in strategies if is_bound(s)},
    }


def placement_section(
    res: Results, *, key_prefix: str = "", analyses: Sequence[Results] = ()
) -> tuple[Section | None, list[str]]:
    """The placement section of one compare results directory; ``analyses``: analyze results, of which
    one of the same trace (if any) tells which datasets each node serves."""
    kp = f"{key_prefix}placement"
    figures: list[Figure] = []
    notes: list[str] = []
    tables: list[Table] = []
    m = res.compare
    ref = m.reference
    summary = res.table(COMPARE_SUMMARY)
    timed = summary is not None and has_time(summary)
    placed = f"{m.deployment} on {m.num_nodes} node(s) of {m.gpus_per_node} GPUs; " + (
        f"{m.num_train_requests} requests placed, {m.num_test_requests} held out for evaluation; "
        if m.tokens_from is None
        else f"{m.tokens_from}; "
    )
    steps = "" if m.tokens_from is not None else f" (global batches of {m.batch_requests} requests)"
    if timed:
        prefill = f" and {m.num_prefill_batches} prefill steps" if m.num_prefill_batches else ""
        setup = (
            f"{placed}{m.num_batches} decode steps{steps}{prefill}; "
            f"copies: {copy_models(m)}; links: {links_text(m, latency=True)}; "
            f"replica policy {m.replica_policy}, {m.num_redundant} redundant slot(s) per layer."
        )
    else:
        setup = (
            f"{placed}{m.num_batches} global batches of {m.batch_requests} requests; "
            f"dedup per {m.dedup}, replica policy {m.replica_policy}, "
            f"{m.num_redundant} redundant slot(s) per layer."
        )
    if summary is not None:
        tables.extend(_summary_tables(res, summary, key=f"{kp}-summary"))

    batches = res.table(COMPARE_BATCHES)
    if batches is not None:
        if "a2a_time_normalized" in batches.columns:
            figures.append(_box_by_strategy(batches, res, ref=ref, key=f"{kp}-time", view=_A2A_TIME_BOX))
        if "moe_time_normalized" in batches.columns and _any_finite(batches["moe_time_normalized"]):
            figures.append(_box_by_strategy(batches, res, ref=ref, key=f"{kp}-moe-time", view=_MOE_TIME_BOX))
        figures.append(_box_by_strategy(batches, res, ref=ref, key=f"{kp}-normalized", view=_BYTES_BOX))
    else:
        notes.append("batches.parquet absent: no normalized-volume figure")

    layers = res.table(COMPARE_LAYERS)
    if layers is not None:
        if {"dispatch_seconds", "combine_seconds"} <= set(layers.columns):
            figures.append(_time_per_layer(layers, res, key=f"{kp}-layers-time"))
        figures.extend(_per_layer(layers, res, ref=ref, key=f"{kp}-layers"))
    else:
        notes.append("layers.parquet absent: no per-layer figures")

    places = res.table(COMPARE_PLACEMENTS)
    if places is not None:
        node_tables, node_figures, node_notes = _holdings_section(places, res, analyses, key=kp)
        tables.extend(node_tables)
        figures[1:1] = node_figures  # after the time per step: what the winner's nodes hold
        notes.extend(node_notes)
    else:
        notes.append("placements.parquet absent: no table of what each node holds")

    if not figures and not tables:
        return None, [f"placement: no compare results in {res.path}"]
    return (
        Section(
            key=kp,
            title="Placement and all-to-all volume",
            intro=(_TIMED_INTRO if timed else _BYTES_INTRO).replace(
                "on requests it never saw",
                "on the load profile's tokens" if m.tokens_from is not None else "on requests it never saw",
            )
            + setup,
            tables=tuple(tables),
            figures=tuple(figures),
            notes=tuple(notes),
        ),
        [],
    )


_BYTES_INTRO = (
    "Which experts live on which GPU, and how much all-to-all traffic each placement causes on requests it never saw. "
)
_TIMED_INTRO = (
    "Which experts live on which GPU, and what each placement costs per step on requests it never saw: predicted "
    "all-to-all and MoE-layer time first, then the bytes they come from. "
)

#: a dedup unit of compare.json (``dedup``: the decode stage's, ``prefill_dedup``: the prefill
#: stage's) -> the copies of a token the all-to-all sends, as the page words it
COPY_MODELS: dict[str, str] = {
    "expert": "one copy per (token, expert), as DeepEP's low-latency kernels send",
    "node": "one copy per node, as DeepEP's normal kernels send",
    "rank": "one copy per GPU",
}

#: the summary column only results written with the cost model (placement/cost.py) have
TIME_COLUMN = "a2a_time_normalized_median"


def has_time(summary: pl.DataFrame) -> bool:
    """The compare results predict time per step (``summary.parquet`` has the time columns);
    results written before the cost model hold bytes alone."""
    return TIME_COLUMN in summary.columns


def _copy_model(dedup: str) -> str:
    return COPY_MODELS.get(dedup, f"one copy per distinct {dedup}")


def stage_copy_model(m: CompareManifest, stage: str) -> str:
    """The copy model a stage (``decode``, ``prefill``) was simulated with, in words."""
    return _copy_model(m.dedup if stage == "decode" else (m.prefill_dedup or "?"))


def held_out(m: CompareManifest) -> str:
    """What the simulated batches were drawn from, as an adjective: ``held-out`` (a trace's requests the
    placement never saw), ``in-sample`` (tokens drawn from the load profile the placement was made on)."""
    return "held-out" if m.tokens_from is None else "in-sample"


def copy_models(m: CompareManifest) -> str:
    """The copy model of each simulated stage, e.g. ``decode one copy per (token, expert), ...;
    prefill one copy per node, ...`` (prefill only when prefill steps were simulated)."""
    decode = f"decode {_copy_model(m.dedup)}"
    if m.prefill_dedup is None or not m.num_prefill_batches:
        return decode
    return f"{decode}; prefill {_copy_model(m.prefill_dedup)}"


def links_text(m: CompareManifest, *, latency: bool = False) -> str:
    """The links the time was predicted for, e.g. ``NVLink 155 GB/s, RDMA 50 GB/s per GPU`` (with
    ``latency``: each class's cost per message too); "" when the results have no cost model."""
    if m.cost is None:
        return ""
    links = m.cost["links"]

    def one(name: str, cls: str) -> str:
        lat = f" ({links[f'{cls}_latency_s'] * 1e6:.3g} µs per message)" if latency else ""
        return f"{name} {links[f'{cls}_bytes_per_s'] / 1e9:.3g} GB/s{lat}"

    per = "per GPU" if links["inter_nic"] == "gpu" else "per node, shared by its GPUs"
    hw = f"{m.hardware['name']}: " if m.hardware else ""
    return f"{hw}{one('NVLink', 'intra')}, {one('RDMA', 'inter')} {per}"


def finite(v: object) -> float | None:
    """A table cell ``v`` as a float, or None when it is missing (null), NaN or not a number."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) else None


def _any_finite(col: pl.Series) -> bool:
    return bool(np.isfinite(col.cast(pl.Float64).fill_null(np.nan).to_numpy()).any())


def _ratio(v: object) -> str:
    f = finite(v)
    return "-" if f is None else f"{f:.3f}"


def _ratio_of(column: str) -> Callable[[dict[str, Any]], str]:
    """A column's cell: its ratio (3 decimals)."""
    return lambda r: _ratio(r[column])


def _span(lo: object, hi: object) -> str:
    """A p10–p90 range of ratios: ``0.912–1.034``."""
    a, b = finite(lo), finite(hi)
    return "-" if a is None or b is None else f"{a:.3f}–{b:.3f}"


def _seconds(v: object) -> str:
    """Seconds as shown in tables: ``412 µs``, ``1.23 ms``, ``2.5 s``."""
    f = finite(v)
    if f is None:
        return "-"
    if f >= 1.0:
        return f"{f:.3g} s"
    return f"{f * 1e3:.3g} ms" if f >= 1e-3 else f"{f * 1e6:.3g} µs"


def node_load_text(row: dict[str, Any], m: CompareManifest) -> str:
    """``busiest_node_load`` to 2 decimals, flagged when the row is over compare.json's ``max_node_load``."""
    load = finite(row.get("busiest_node_load"))
    if load is None:
        return "-"
    if not row.get("over_node_load_limit"):
        return f"{load:.2f}"
    limit = "" if m.max_node_load is None else f" {m.max_node_load:.2f}"
    return f"{load:.2f} ⚠ over{limit or ' the limit'}"


_Column = tuple[str, Callable[[dict[str, Any]], object]]


def _bytes_columns() -> list[_Column]:
    """The table of results written before the cost model, column by column (as it always was)."""
    return [
        ("strategy", lambda r: STRATEGY_NAMES.get(r["strategy"], r["strategy"])),
        ("inter-node (normalized median)", lambda r: r["inter_node_normalized_median"]),
        ("p10", lambda r: r["inter_node_normalized_p10"]),
        ("p90", lambda r: r["inter_node_normalized_p90"]),
        ("inter-node / batch", lambda r: _kib(r["inter_node_bytes_per_batch_median"])),
        ("intra-node / batch", lambda r: _kib(r["intra_node_bytes_per_batch_median"])),
        ("largest rank send / layer", lambda r: _kib(r["max_rank_dispatch_send_bytes_mean"])),
        ("max tokens per rank", lambda r: r["tokens_per_rank_max_mean"]),
        ("max activated experts per rank", lambda r: r["activated_experts_per_rank_max_mean"]),
        ("router match", _router_match),
        ("busiest node's requests / even share", lambda r: _load2(r.get("busiest_node_load"))),
    ]


def _time_columns(m: CompareManifest, summary: pl.DataFrame) -> list[_Column]:
    """The table of results written with the cost model: predicted time first, then bytes and load."""
    cols: list[_Column] = [
        ("strategy", lambda r: STRATEGY_NAMES.get(r["strategy"], r["strategy"])),
        ("all-to-all / step", lambda r: _seconds(r["a2a_seconds_per_step_median"])),
        ("all-to-all vs median (p10–p90)", _with_span("a2a_time_normalized")),
        ("MoE layers / step", lambda r: _seconds(r["moe_seconds_per_step_median"])),
        ("MoE vs median (p10–p90)", _with_span("moe_time_normalized")),
        ("inter-node bytes vs median (p10–p90)", _with_span("inter_node_normalized")),
        ("inter-node / batch", lambda r: _kib(r["inter_node_bytes_per_batch_median"])),
        ("intra-node / batch", lambda r: _kib(r["intra_node_bytes_per_batch_median"])),
        ("largest rank send / layer", lambda r: _kib(r["max_rank_dispatch_send_bytes_mean"])),
        ("busiest node's requests / even share", lambda r: node_load_text(r, m)),
        ("busiest GPU's tokens / mean GPU's", lambda r: _load2(r.get("busiest_gpu_load"))),
        ("max activated experts per rank", lambda r: r["activated_experts_per_rank_max_mean"]),
        ("router match", _router_match),
    ]
    prefill = [
        ("prefill all-to-all (normalized median)", "prefill_a2a_time_normalized_median"),
        ("prefill MoE (normalized median)", "prefill_moe_time_normalized_median"),
        ("prefill inter-node bytes (normalized median)", "prefill_inter_node_normalized_median"),
    ]
    for header, col in prefill:  # a decode-only trace has no prefill step: no empty columns
        if col in summary.columns and _any_finite(summary[col]):
            cols.append((header, _ratio_of(col)))
    return cols


def _with_span(column: str) -> Callable[[dict[str, Any]], str]:
    """A normalized column's cell: its median and p10–p90 in one, ``0.912 (0.880–0.950)``."""

    def cell(r: dict[str, Any]) -> str:
        med, span = _ratio(r[f"{column}_median"]), _span(r[f"{column}_p10"], r[f"{column}_p90"])
        return med if span == "-" else f"{med} ({span})"

    return cell


def _router_match(r: dict[str, Any]) -> str:
    return "-" if r.get("router_match_rate") is None else f"{100 * r['router_match_rate']:.0f}%"


def _load2(v: object) -> str:
    f = finite(v)
    return "-" if f is None else f"{f:.2f}"


def _summary_tables(res: Results, summary: pl.DataFrame, *, key: str) -> list[Table]:
    """The summary table (the reference, then the strategies) and, when there are bound rows, a
    table of those below it under the same columns."""
    m = res.compare
    ref = STRATEGY_NAMES.get(m.reference, m.reference)
    timed = has_time(summary)
    columns = _time_columns(m, summary) if timed else _bytes_columns()
    by = {r["strategy"]: r for r in summary.iter_rows(named=True)}
    strategies = _strategies(res, summary)
    deployable = [s for s in strategies if not is_bound(s)]
    bounds = [s for s in strategies if is_bound(s)]

    def rows(names: list[str], cols: list[_Column]) -> tuple[tuple[object, ...], ...]:
        return tuple(tuple(f(by[s]) for _, f in cols) for s in names)

    if timed:
        limit = (
            "" if m.max_node_load is None else f" (deployable up to {m.max_node_load:.2f}; ⚠ marks a router over it)"
        )
        caption = (
            f"Predicted per decode step, all MoE layers: all-to-all = dispatch + combine, the busiest GPU of each "
            f"collective charged; MoE = dispatch + experts + combine (- when the model's expert size is unknown). "
            f"Medians over {m.num_batches} {held_out(m)} batches; vs median = / {ref}'s median, lower is better, with "
            f"p10–p90 over batches in brackets. Inter-node bytes are what the time comes from, not the verdict. Busiest node: held-out "
            f"requests its router sends the busiest node / an even share{limit}. Busiest GPU: its tokens / the mean "
            f"GPU's, mean over batches and layers."
        )
    else:
        caption = (
            f"Normalized to the median of {ref}; lower is better. Byte columns are medians (per batch) or means "
            "(per layer and batch)."
        )
    shown, dropped = _varying_columns(columns, [by[s] for s in strategies])
    header = tuple(h for h, _ in shown)
    if dropped:
        caption += " The same in every row, so not a column: " + "; ".join(f"{h} {v}" for h, v in dropped) + "."
    tables = [Table(key=key, header=header, rows=rows(deployable, shown), caption=caption, nowrap=timed)]
    if bounds:
        described = {b.name: b.description for b in BOUNDS}
        what = "; ".join(f"{STRATEGY_NAMES.get(s, s)}: {described[s]}" for s in bounds if s in described)
        tables.append(
            Table(
                key=f"{key}-bounds",
                header=header,
                rows=rows(bounds, shown),
                caption=f"{BOUNDS_GROUP.capitalize()} (same columns): " + (what or ", ".join(bounds)) + ".",
                nowrap=timed,
            )
        )
    return tables


def _varying_columns(
    columns: list[_Column], rows: list[dict[str, Any]]
) -> tuple[list[_Column], list[tuple[str, object]]]:
    """The columns whose cells differ between ``rows`` (the first, the row's name, always), and the
    (header, value) of each column that holds one value in every row (none dropped for one row)."""
    if len(rows) < 2:
        return columns, []
    shown: list[_Column] = [columns[0]]
    dropped: list[tuple[str, object]] = []
    for header, f in columns[1:]:
        cells = [f(r) for r in rows]
        if all(c == cells[0] for c in cells):
            dropped.append((header, cells[0]))
        else:
            shown.append((header, f))
    return shown, dropped


def _kib(v: float | None) -> str:
    from moetrace.sizes import human_bytes

    return "-" if v is None else human_bytes(float(v))


def ratio_range(values: list[np.ndarray], *, margin: float = 0.15, min_span: float = 0.02) -> tuple[float, float]:
    """A y range for ratios near 1 chosen from the data: the 1st..99th percentile of every plotted
    value and the reference 1.0, widened by ``margin`` of its span (at least ``min_span`` wide), so
    differences of a few percent fill the axis instead of sitting on a 0-based one."""
    v = np.concatenate([np.asarray(x, dtype=np.float64).ravel() for x in values] or [np.array([1.0])])
    v = v[np.isfinite(v)]
    lo, hi = (float(np.percentile(v, 1)), float(np.percentile(v, 99))) if v.size else (1.0, 1.0)
    lo, hi = min(lo, 1.0), max(hi, 1.0)
    pad = max((hi - lo) * margin, (min_span - (hi - lo)) / 2, 0.0)
    floor = 0.0 if not v.size or v.min() >= 0 else -np.inf  # byte ratios are never negative
    return max(lo - pad, floor), hi + pad


@dataclass(frozen=True, kw_only=True)
class _BoxView:
    """One box figure of ``batches.parquet``: a column normalized to the reference's median."""

    column: str  # the batches.parquet column, one value per global batch
    y_title: str  # the y axis's title
    what: str  # the figure's title
    hover: str  # the value's name in the hover text
    definition: str  # what one value is, for the caption


_BYTES_BOX = _BoxView(
    column="inter_node_normalized",
    y_title="inter-node bytes / reference median",
    what="Normalized inter-node all-to-all volume per strategy (lower is better)",
    hover="normalized inter-node volume",
    definition="inter-node bytes of dispatch and combine summed over MoE layers",
)
_A2A_TIME_BOX = _BoxView(
    column="a2a_time_normalized",
    y_title="all-to-all time / reference median",
    what="Predicted all-to-all time per decode step, per strategy (lower is better)",
    hover="normalized all-to-all time",
    definition="predicted seconds of dispatch and combine summed over MoE layers, the busiest GPU of each "
    "collective charged",
)
_MOE_TIME_BOX = _BoxView(
    column="moe_time_normalized",
    y_title="MoE-layer time / reference median",
    what="Predicted MoE-layer time per decode step, per strategy (lower is better)",
    hover="normalized MoE-layer time",
    definition="predicted seconds of dispatch, expert computation and combine summed over MoE layers",
)


def _box_by_strategy(batches: pl.DataFrame, res: Results, *, view: _BoxView, ref: str, key: str) -> Figure:
    """A box per strategy of ``batches.parquet`` ``view.column`` (one value per global batch, already
    normalized to the reference's median), the reference median drawn at 1."""
    go = plotly_go()
    strategies = _strategies(res, batches)
    colours = strategy_colours(strategies)
    fig = go.Figure()
    all_y: list[np.ndarray] = []
    for s in strategies:
        sub = batches.filter(pl.col("strategy") == s).sort("batch")
        y = sub[view.column].cast(pl.Float64).fill_null(np.nan).to_numpy()
        all_y.append(y)
        fig.add_trace(
            go.Box(
                y=y,
                name=STRATEGY_NAMES.get(s, s),
                marker_color=colours[s],
                line={"width": 3.5 if s == recommended_of(strategies) else 1.5},
                boxpoints="outliers",
                boxmean=True,
                hovertemplate=f"{STRATEGY_NAMES.get(s, s)}<br>{view.hover} %{{y:.3f}}<extra></extra>",
            )
        )
    first_bound = next((i for i, s in enumerate(strategies) if is_bound(s)), None)
    if first_bound:  # bounds to the right of a line, under their own label
        fig.add_vline(x=first_bound - 0.5, line={"color": REFERENCE_LINE, "width": 1.5})
        fig.add_annotation(
            x=first_bound - 0.5, y=1.0, xref="x", yref="paper", xanchor="left", yanchor="bottom", showarrow=False,
            text=f" {BOUNDS_GROUP}", font={"size": 11, "color": REFERENCE_LINE},
        )  # fmt: skip
    fig.add_hline(
        y=1.0,
        line={"color": REFERENCE_LINE, "dash": "dot", "width": 1.5},
        annotation={"text": f"median of {STRATEGY_NAMES.get(ref, ref)}", "font": {"size": 11, "color": REFERENCE_LINE}},
        annotation_position="top left",
    )
    fig.update_layout(
        showlegend=False,
        xaxis={"title": {"text": "placement strategy"}},
        yaxis={"title": {"text": view.y_title}, "range": list(ratio_range(all_y))},
    )
    finish(fig, what=view.what, source=res.label, height=460)
    return res.figure(
        key,
        fig,
        file=COMPARE_BATCHES,
        caption=f"One value per simulated global batch (a decode step of every node's micro-batch): {view.definition}, "
        f"divided by the median of {STRATEGY_NAMES.get(ref, ref)}. Box = quartiles, whiskers = 1.5 IQR, dashed = mean. "
        + (
            f"{STRATEGY_NAMES.get(rec, rec)}, the recommended strategy, is drawn thick. "
            if (rec := recommended_of(strategies)) is not None
            else ""
        )
        + ("Bounds (grey, right of the line) are not deployable. " if first_bound else "")
        + "The y axis spans the 1st to 99th percentile of the values (and 1), not 0: the differences are a few percent. "
        + (
            "Evaluated on held-out requests."
            if res.compare.tokens_from is None
            else "Evaluated on tokens drawn from the load profile's loads, the ones it was placed on (in-sample)."
        ),
    )


def _time_per_layer(layers: pl.DataFrame, res: Results, *, key: str) -> Figure:
    """Median over batches of each layer's predicted all-to-all seconds (dispatch + combine), in µs."""
    strategies = _strategies(res, layers)
    agg = layers.group_by("strategy", "layer").agg(
        ((pl.col("dispatch_seconds") + pl.col("combine_seconds")) * 1e6).median().alias("us")
    )
    _, model_L = layer_order(layers)
    per = {
        STRATEGY_NAMES.get(s, s): agg.filter(pl.col("strategy") == s).sort("layer")["us"].to_numpy() for s in strategies
    }
    fig = lines_by_layer(
        per,
        layers=model_L.tolist(),
        y_title="predicted all-to-all time per layer (µs)",
        what="Predicted all-to-all time per layer and strategy (median over batches)",
        source=res.label,
        **_line_style(res, strategies),
    )
    fig.update_yaxes(rangemode="tozero")
    return Figure(
        key=key,
        figure=fig,
        source=res.source(COMPARE_LAYERS),
        caption="Per layer: median over batches of the predicted dispatch + combine seconds (the busiest GPU of each "
        "collective charged). A layer whose experts a placement gathers on few nodes costs less; one that piles "
        "tokens on a GPU costs more.",
    )


def _per_layer(layers: pl.DataFrame, res: Results, *, ref: str, key: str) -> list[Figure]:
    strategies = _strategies(res, layers)
    style = _line_style(res, strategies)
    agg = (
        layers.group_by("strategy", "layer", "model_layer")
        .agg(
            (pl.col("dispatch_inter_bytes") + pl.col("combine_inter_bytes")).sum().alias("inter"),
            (
                pl.col("dispatch_inter_bytes")
                + pl.col("combine_inter_bytes")
                + pl.col("dispatch_intra_bytes")
                + pl.col("combine_intra_bytes")
            )
            .sum()
            .alias("total"),
            pl.col("inter_node_normalized").median().alias("normalized_median"),
        )
        .sort("strategy", "layer")
    )
    _, model_L = layer_order(layers)
    share, norm = {}, {}
    for s in strategies:
        sub = agg.filter(pl.col("strategy") == s).sort("layer")
        tot = sub["total"].to_numpy()
        share[STRATEGY_NAMES.get(s, s)] = np.where(tot > 0, sub["inter"].to_numpy() / np.where(tot > 0, tot, 1), np.nan)
        norm[STRATEGY_NAMES.get(s, s)] = sub["normalized_median"].to_numpy()
    f1 = lines_by_layer(
        share,
        layers=model_L.tolist(),
        y_title="inter-node share of all-to-all bytes",
        y_range=(0.0, 1.02),
        what="Share of all-to-all bytes that cross nodes, per layer and strategy",
        source=res.label,
        **style,
    )
    f2 = lines_by_layer(
        norm,
        layers=model_L.tolist(),
        y_title="inter-node bytes / reference median (per layer)",
        reference={f"median of {STRATEGY_NAMES.get(ref, ref)}": 1.0},
        what="Normalized inter-node volume per layer (median over batches)",
        source=res.label,
        **style,
    )
    f2.update_yaxes(rangemode="tozero")
    return [
        Figure(
            key=f"{key}-share",
            figure=f1,
            source=res.source(COMPARE_LAYERS),
            caption="Per layer: Σ over batches of inter-node bytes / Σ of all bytes (intra- and inter-node, dispatch and "
            "combine). Tokens whose experts sit on their own node cost no inter-node traffic.",
        ),
        Figure(
            key=f"{key}-normalized",
            figure=f2,
            source=res.source(COMPARE_LAYERS),
            caption=f"Per layer: median over batches of the layer's inter-node bytes divided by the median of "
            f"{STRATEGY_NAMES.get(ref, ref)} at that layer.",
        ),
    ]


@dataclass(frozen=True, kw_only=True)
class NodeHoldings:
    """What each node of one strategy's placement holds (``node_holdings``). Shape legend: G nodes,
    W GPUs, D datasets."""

    strategy: str  # compare's name of the strategy
    gpus_G: tuple[tuple[int, ...], ...]  # [G] the GPUs (EP ranks) of each node
    moved_G: (
        np.ndarray
    )  # float64 [G] experts per layer on the node that linear places on another node (mean over layers)
    tokens_W: np.ndarray | None  # float64 [W] expected decode tokens per GPU / an even share (None: no analysis)
    datasets: tuple[str, ...]  # [D] the datasets of the analysis (empty: no analysis)
    share_GD: np.ndarray | None  # float64 [G, D] share of dataset d's decode expert activations on node g's experts


def node_holdings(places: pl.DataFrame, strategy: str, *, load: pl.DataFrame | None) -> NodeHoldings:
    """What each node of ``strategy``'s placement holds, from ``placements.parquet`` (one row per
    strategy, layer and physical slot: its GPU, node and logical expert) and, when given, the
    analysis's ``expert_load.parquet`` rows of one stage (dataset, layer, expert, tokens).

    - moved: per layer, the experts on the node that linear's placement (``p mod E``) keeps on
      another node, mean over layers;
    - tokens per GPU: Σ over the GPU's slots of the slot's expert's tokens (dataset ``all``) split
      evenly over that expert's replicas, summed over layers, / an even share (all tokens / W): what
      the placement would give each GPU if traffic were the analysed trace's;
    - share: for each dataset, the tokens of its requests whose expert is on the node (replicas
      split evenly) / all its tokens, over every layer."""
    sub = places.filter(pl.col("strategy") == strategy).sort("layer", "slot")
    L = sub["layer"].n_unique()
    P = sub.height // L
    expert_LP = sub["expert"].to_numpy().reshape(L, P).astype(np.int64)
    gpu_P = sub["gpu"].to_numpy()[:P].astype(np.int64)
    node_P = sub["node"].to_numpy()[:P].astype(np.int64)
    G, W = int(node_P.max()) + 1, int(gpu_P.max()) + 1
    E = int(places["expert"].max()) + 1  # type: ignore[arg-type]  # polars types Series.max() as any Python literal
    # linear: slot p holds expert p mod E, on the same slots' nodes
    linear_nodes_E = [set(node_P[np.arange(P) % E == e].tolist()) for e in range(E)]
    moved_G = np.zeros(G)
    for g in range(G):
        on_g = expert_LP[:, node_P == g]
        moved_G[g] = np.mean([len({int(e) for e in row if g not in linear_nodes_E[int(e)]}) for row in on_g])
    tokens_W = share_GD = None
    datasets: tuple[str, ...] = ()
    if load is not None:
        replicas_LE = np.zeros((L, E))
        np.add.at(replicas_LE, (np.repeat(np.arange(L), P), expert_LP.ravel()), 1.0)
        names = sorted(set(load["dataset"].unique().to_list()) - {"all"})

        def tokens_LE(ds: str) -> np.ndarray:
            rows = load.filter(pl.col("dataset") == ds)
            out = np.zeros((L, E))
            np.add.at(out, (rows["layer"].to_numpy(), rows["expert"].to_numpy()), rows["tokens"].to_numpy())
            return out

        def per_slot(t_LE: np.ndarray) -> np.ndarray:  # [L, P] the slot's expert's tokens / its replicas
            return np.take_along_axis(t_LE / np.maximum(replicas_LE, 1.0), expert_LP, axis=1)

        every = per_slot(tokens_LE("all")).sum(axis=0)
        tokens_W = np.bincount(gpu_P, weights=every, minlength=W) / max(every.sum() / W, 1e-12)
        share_GD = np.zeros((G, len(names)))
        for d, ds in enumerate(names):
            s_P = per_slot(tokens_LE(ds)).sum(axis=0)
            share_GD[:, d] = np.bincount(node_P, weights=s_P, minlength=G) / max(s_P.sum(), 1e-12)
        datasets = tuple(names)
    gpus_G = tuple(tuple(sorted(set(gpu_P[node_P == g].tolist()))) for g in range(G))
    return NodeHoldings(
        strategy=strategy, gpus_G=gpus_G, moved_G=moved_G, tokens_W=tokens_W, datasets=datasets, share_GD=share_GD
    )


def _stage_load(res: Results, analyses: Sequence[Results]) -> tuple[pl.DataFrame | None, str]:
    """The decode rows (else prefill) of ``expert_load.parquet`` of an analysis of the same trace as
    these compare results, and the stage; (None, why) when none is given or matches."""
    tp = res.trace_path
    same = [
        a for a in analyses if tp is not None and a.trace_path is not None and a.trace_path.resolve() == tp.resolve()
    ]
    for a in same:
        load = a.table(EXPERT_LOAD)
        if load is None:
            continue
        for stage in ("decode", "prefill"):
            rows = load.filter(pl.col("stage") == stage)
            if rows.height and int(rows["expert"].max()) + 1 == res.compare.model.num_experts:  # type: ignore[arg-type]
                return rows, stage
    what = "load profile" if res.profile_path is not None else "trace"
    return (
        None,
        f"give `moetrace analyze` results of the same {what} to see the datasets each node serves and its tokens per GPU",
    )


def _holdings_section(
    places: pl.DataFrame, res: Results, analyses: Sequence[Results], *, key: str
) -> tuple[list[Table], list[Figure], list[str]]:
    """A table of what each node of the recommended strategy holds, and, with an analysis of the same
    trace, two figures over every deployable strategy (a dropdown): the datasets each node serves
    and the expected tokens per GPU."""
    strategies = [s for s in _strategies(res, places) if not is_bound(s)]
    if not strategies:
        return [], [], []
    load, stage_or_why = _stage_load(res, analyses)
    notes = [] if load is not None else [f"What each node holds: {stage_or_why}."]
    rec = recommended_of(strategies)
    first = [s for s in strategies if s == rec] + [s for s in strategies if s != rec]
    held = {s: node_holdings(places, s, load=load) for s in first}  # the recommended first: the dropdowns open on it
    shown = first[0]
    h = held[shown]
    header = ["node", "GPUs", "experts moved from linear (per layer)"]
    if h.share_GD is not None:
        header[2:2] = ["datasets it serves (share of each one's activations)", "tokens per GPU / even share"]

    def serves(g: int) -> str:
        assert h.share_GD is not None
        order = np.argsort(-h.share_GD[g])
        return ", ".join(f"{h.datasets[d]} {100 * h.share_GD[g, d]:.0f}%" for d in order[:3])

    rows = []
    for g, gpus in enumerate(h.gpus_G):
        row: list[object] = [g, f"{gpus[0]}–{gpus[-1]}" if len(gpus) > 1 else str(gpus[0])]
        if h.share_GD is not None and h.tokens_W is not None:
            t = h.tokens_W[list(gpus)]
            row += [serves(g), f"{t.mean():.2f} (busiest {t.max():.2f})"]
        row.append(f"{h.moved_G[g]:.1f} of {res.compare.model.num_experts}")
        rows.append(tuple(row))
    name = STRATEGY_NAMES.get(shown, shown)
    even = 100 / len(h.gpus_G)
    caption = (
        f"What each node of {name} holds. Experts moved: per layer, the experts on the node that linear keeps on "
        "another node (mean over layers)."
        + (
            f" From the analysis's {stage_or_why} expert load: a dataset's share is the part of its tokens' expert "
            f"activations whose expert sits on the node (top three; {even:.0f}% each is no specialisation); tokens per "
            "GPU: the tokens its experts would receive / an even share (mean over the node's GPUs, and its busiest)."
            if load is not None
            else ""
        )
    )
    tables = [Table(key=f"{key}-nodes", header=tuple(header), rows=tuple(rows), caption=caption)]
    figures = (
        []
        if load is None
        else [_share_figure(held, res, key=f"{key}-serves"), _tokens_figure(held, res, key=f"{key}-tokens")]
    )
    return tables, figures, notes


def _share_figure(held: dict[str, NodeHoldings], res: Results, *, key: str) -> Figure:
    """Node × dataset heatmap of the share of each dataset's activations on the node's experts, a
    strategy per dropdown entry (the recommended one first)."""
    go = plotly_go()
    names = list(held)
    first = held[names[0]]
    assert first.share_GD is not None
    G = len(first.gpus_G)
    fig = go.Figure()
    for i, s in enumerate(names):
        share = held[s].share_GD
        assert share is not None
        fig.add_trace(
            go.Heatmap(
                z=share,
                x=list(first.datasets),
                y=[f"node {g}" for g in range(G)],
                zmin=0.0,
                zmax=min(1.0, 2.0 / G),  # white at an even share (1/G), red above, blue below
                colorscale=DIVERGING,
                reversescale=True,
                texttemplate="%{z:.0%}",
                visible=i == 0,
                name=STRATEGY_NAMES.get(s, s),
                colorbar={
                    "title": {"text": f"share (even: {100 / G:.0f}%)", "side": "right"},
                    "thickness": 14,
                    "tickformat": ".0%",  # the cells' unit
                },
                hovertemplate=f"{STRATEGY_NAMES.get(s, s)}<br>%{{y}} holds the experts of %{{z:.1%}} of %{{x}}'s "
                "activations<extra></extra>",
            )
        )
    vis = [[j == i for j in range(len(names))] for i in range(len(names))]
    fig.update_layout(
        updatemenus=dropdown([STRATEGY_NAMES.get(s, s) for s in names], vis, prefix=""),
        xaxis={"title": {"text": "dataset"}, "type": "category"},
        yaxis={"title": {"text": "node"}, "type": "category", "autorange": "reversed"},
    )
    finish(fig, what="Datasets each node serves", source=res.label,
           height=max(380, 160 + 40 * G))  # fmt: skip
    return res.figure(
        key,
        fig,
        file=COMPARE_PLACEMENTS,
        caption=f"Each cell: the share of a dataset's expert activations (analysis of the same trace or profile) whose expert "
        f"this node holds, replicas split evenly; a column sums to 100%. An even spread ({100 / G:.0f}% each) "
        "means the node serves no dataset in particular; a data-based placement gathers a dataset's experts on its "
        "node, so its requests stay there.",
    )


def _tokens_figure(held: dict[str, NodeHoldings], res: Results, *, key: str) -> Figure:
    """Expected tokens per GPU / an even share, bars coloured by node, a strategy per dropdown entry."""
    go = plotly_go()
    names = list(held)
    fig = go.Figure()
    for i, s in enumerate(names):
        h = held[s]
        assert h.tokens_W is not None
        node_W = np.zeros(h.tokens_W.size, dtype=np.int64)
        for g, gpus in enumerate(h.gpus_G):
            node_W[list(gpus)] = g
        fig.add_trace(
            go.Bar(
                x=np.arange(h.tokens_W.size),
                y=h.tokens_W,
                marker_color=[category_colour(int(g)) for g in node_W],
                customdata=node_W,
                visible=i == 0,
                name=STRATEGY_NAMES.get(s, s),
                hovertemplate=f"{STRATEGY_NAMES.get(s, s)}<br>GPU %{{x}} (node %{{customdata}})<br>"
                "tokens / even share %{y:.2f}<extra></extra>",
            )
        )
    vis = [[j == i for j in range(len(names))] for i in range(len(names))]
    fig.add_hline(y=1.0, line={"color": REFERENCE_LINE, "dash": "dot", "width": 1.5})
    fig.update_layout(
        updatemenus=dropdown([STRATEGY_NAMES.get(s, s) for s in names], vis, prefix=""),
        showlegend=False,
        xaxis={"title": {"text": "GPU (EP rank), coloured by node"}},
        yaxis={"title": {"text": "expected tokens / even share"}, "rangemode": "tozero"},
    )
    finish(fig, what="Expected tokens per GPU", source=res.label, height=400)
    return res.figure(
        key,
        fig,
        file=COMPARE_PLACEMENTS,
        caption="Per GPU: the tokens its experts would receive if traffic were the analysed input's (each expert's "
        "tokens split evenly over its replicas, summed over layers) / an even share; 1 (dotted) is balanced. The "
        "busiest GPU sets the step's expert time.",
    )
