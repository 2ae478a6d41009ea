"""Placement section, from ``moetrace compare`` results (SPEC §5–6, core paper Fig. 9).

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from moetrace.dashboards.figures import lines_by_layer
from moetrace.dashboards.page import Figure, Section, Table
from moetrace.dashboards.results import Results, layer_order
from moetrace.dashboards.theme import (
    REFERENCE_LINE,
    SEQUENTIAL_ALT,
    category_colour,
    dropdown,
    finish,
    height_for_rows,
    plotly_go,
)
from moetrace.placement.compare_manifest import CompareManifest
from moetrace.placement.strategies import BOUNDS, LABELS
from moetrace.placement.strategies import STRATEGY_NAMES as REGISTERED
from moetrace.results import (
    COMPARE_BATCHES,
    COMPARE_LAYERS,
    COMPARE_PLACEMENTS,
    COMPARE_SUMMARY,
)

#: strategy -> its label in figures, in registry order (which also fixes each strategy's colour)
STRATEGY_NAMES = LABELS  # strategies and the bounds compare reports


def strategy_colours(strategies: list[str]) -> dict[str, str]:
    """Fixed colours per known strategy so every figure and report agrees; unknown ones after."""
    known = list(STRATEGY_NAMES)
    return {s: category_colour(known.index(s) if s in known else len(known) + i) for i, s in enumerate(strategies)}


def _strategies(res: Results, df: pl.DataFrame) -> list[str]:
    order, ref = res.compare.strategies, res.compare.reference
    have = df["strategy"].unique().to_list()
    out = ([ref] if ref in have else []) + [s for s in order if s in have and s != ref]
    return out + sorted(s for s in have if s not in out)


def placement_section(res: Results, *, key_prefix: str = "") -> tuple[Section | None, list[str]]:
    kp = f"{key_prefix}placement"
    figures: list[Figure] = []
    notes: list[str] = []
    tables: list[Table] = []
    m = res.compare
    ref = m.reference
    summary = res.table(COMPARE_SUMMARY)
    timed = summary is not None and has_time(summary)
    placed = (
        f"{m.deployment} on {m.num_nodes} node(s) of {m.gpus_per_node} GPUs; "
        f"{m.num_train_requests} requests placed, {m.num_test_requests} held out for evaluation; "
    )
    if timed:
        prefill = f" and {m.num_prefill_batches} prefill steps" if m.num_prefill_batches else ""
        setup = (
            f"{placed}{m.num_batches} decode steps (global batches of {m.batch_requests} requests){prefill}; "
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
        figures.append(_placement_map(places, res, key=f"{kp}-map"))
    else:
        notes.append("placements.parquet absent: no placement map")

    if not figures and not tables:
        return None, [f"placement: no compare results in {res.path}"]
    return (
        Section(
            key=kp,
            title="Placement and all-to-all volume",
            intro=(_TIMED_INTRO if timed else _BYTES_INTRO) + setup,
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
        lat = f" ({links[f'{cls}_latency_s'] * 1e6:g} µs per message)" if latency else ""
        return f"{name} {links[f'{cls}_bytes_per_s'] / 1e9:g} GB/s{lat}"

    per = "per GPU" if links["inter_nic"] == "gpu" else "per node, shared by its GPUs"
    return f"{one('NVLink', 'intra')}, {one('RDMA', 'inter')} {per}"


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
        ("all-to-all (normalized median)", lambda r: _ratio(r["a2a_time_normalized_median"])),
        ("p10–p90", lambda r: _span(r["a2a_time_normalized_p10"], r["a2a_time_normalized_p90"])),
        ("MoE layers / step", lambda r: _seconds(r["moe_seconds_per_step_median"])),
        ("MoE (normalized median)", lambda r: _ratio(r["moe_time_normalized_median"])),
        ("p10–p90", lambda r: _span(r["moe_time_normalized_p10"], r["moe_time_normalized_p90"])),
        ("inter-node bytes (normalized median)", lambda r: _ratio(r["inter_node_normalized_median"])),
        ("p10–p90", lambda r: _span(r["inter_node_normalized_p10"], r["inter_node_normalized_p90"])),
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
    deployable = [s for s in strategies if s in REGISTERED]
    bounds = [s for s in strategies if s not in REGISTERED]
    header = tuple(h for h, _ in columns)

    def rows(names: list[str]) -> tuple[tuple[object, ...], ...]:
        return tuple(tuple(f(by[s]) for _, f in columns) for s in names)

    if timed:
        limit = (
            "" if m.max_node_load is None else f" (deployable up to {m.max_node_load:.2f}; ⚠ marks a router over it)"
        )
        caption = (
            f"Predicted per decode step, all MoE layers: all-to-all = dispatch + combine, the busiest GPU of each "
            f"collective charged; MoE = dispatch + experts + combine (- when the model's expert size is unknown). "
            f"Medians over {m.num_batches} held-out batches; normalized = / {ref}'s median, lower is better; p10–p90 "
            f"over batches. Inter-node bytes are what the time comes from, not the verdict. Busiest node: held-out "
            f"requests its router sends the busiest node / an even share{limit}. Busiest GPU: its tokens / the mean "
            f"GPU's, mean over batches and layers."
        )
    else:
        caption = (
            f"Normalized to the median of {ref}; lower is better. Byte columns are medians (per batch) or means "
            "(per layer and batch)."
        )
    tables = [Table(key=key, header=header, rows=rows(deployable), caption=caption, nowrap=timed)]
    if bounds:
        described = {b.name: b.description for b in BOUNDS}
        what = "; ".join(f"{STRATEGY_NAMES.get(s, s)}: {described[s]}" for s in bounds if s in described)
        tables.append(
            Table(
                key=f"{key}-bounds",
                header=header,
                rows=rows(bounds),
                caption="Bounds, not deployable (same columns): " + (what or ", ".join(bounds)) + ".",
                nowrap=timed,
            )
        )
    return tables


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
    y_title="inter-node all-to-all bytes / reference median",
    what="Normalized inter-node all-to-all volume per strategy (lower is better)",
    hover="normalized inter-node volume",
    definition="inter-node bytes of dispatch and combine summed over MoE layers",
)
_A2A_TIME_BOX = _BoxView(
    column="a2a_time_normalized",
    y_title="predicted all-to-all time per step / reference median",
    what="Predicted all-to-all time per decode step, per strategy (lower is better)",
    hover="normalized all-to-all time",
    definition="predicted seconds of dispatch and combine summed over MoE layers, the busiest GPU of each "
    "collective charged",
)
_MOE_TIME_BOX = _BoxView(
    column="moe_time_normalized",
    y_title="predicted MoE-layer time per step / reference median",
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
                boxpoints="outliers",
                boxmean=True,
                hovertemplate=f"{STRATEGY_NAMES.get(s, s)}<br>{view.hover} %{{y:.3f}}<extra></extra>",
            )
        )
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
        "The y axis spans the 1st to 99th percentile of the values (and 1), not 0: the differences are a few percent. "
        "Evaluated on held-out requests.",
    )


def _time_per_layer(layers: pl.DataFrame, res: Results, *, key: str) -> Figure:
    """Median over batches of each layer's predicted all-to-all seconds (dispatch + combine), in µs."""
    strategies = _strategies(res, layers)
    colours = {STRATEGY_NAMES.get(s, s): c for s, c in strategy_colours(strategies).items()}
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
        colours=colours,
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
    colours = {STRATEGY_NAMES.get(s, s): c for s, c in strategy_colours(strategies).items()}
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
        colours=colours,
    )
    f2 = lines_by_layer(
        norm,
        layers=model_L.tolist(),
        y_title="inter-node bytes / reference median (per layer)",
        reference={f"median of {STRATEGY_NAMES.get(ref, ref)}": 1.0},
        what="Normalized inter-node volume per layer (median over batches)",
        source=res.label,
        colours=colours,
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


def _placement_map(places: pl.DataFrame, res: Results, *, key: str) -> Figure:
    go = plotly_go()
    strategies = _strategies(res, places)
    layers_L, model_L = layer_order(places)
    P = int(places["slot"].max()) + 1  # type: ignore[arg-type]  # polars types Series.max() as any Python literal
    num_experts = int(places["expert"].max()) + 1  # type: ignore[arg-type]  # polars types Series.max() as any Python literal
    fig = go.Figure()
    gpu_of_P = node_of_P = None
    for i, s in enumerate(strategies):
        sub = places.filter(pl.col("strategy") == s).sort("layer", "slot")
        z_LP = sub["expert"].to_numpy().reshape(len(layers_L), P)
        gpu_of_P = sub["gpu"].to_numpy()[:P]
        node_of_P = sub["node"].to_numpy()[:P]
        custom = np.broadcast_to(np.stack([gpu_of_P, node_of_P], axis=1), (len(layers_L), P, 2))
        fig.add_trace(
            go.Heatmap(
                z=z_LP.astype(np.int32),
                x=np.arange(P),
                y=[str(v) for v in model_L],
                customdata=custom,
                colorscale=SEQUENTIAL_ALT,
                zmin=0,
                zmax=num_experts - 1,
                visible=i == 0,
                name=STRATEGY_NAMES.get(s, s),
                colorbar={"title": {"text": "logical expert id", "side": "right"}, "thickness": 14},
                hovertemplate=f"{STRATEGY_NAMES.get(s, s)}<br>layer %{{y}}<br>slot %{{x}} on GPU %{{customdata[0]}} "
                "(node %{customdata[1]})<br>expert %{z}<extra></extra>",
            )
        )
    vis = [[j == i for j in range(len(strategies))] for i in range(len(strategies))]
    # GPU tick at the middle of its slots; a line at every node boundary
    assert gpu_of_P is not None and node_of_P is not None
    gpus = np.unique(gpu_of_P)
    mids = [float(np.flatnonzero(gpu_of_P == g).mean()) for g in gpus]
    every = max(1, len(gpus) // 32)
    for p in range(1, P):
        if node_of_P[p] != node_of_P[p - 1]:
            fig.add_vline(x=p - 0.5, line={"color": "black", "width": 2.5})
        elif gpu_of_P[p] != gpu_of_P[p - 1] and len(gpus) <= 128:
            fig.add_vline(x=p - 0.5, line={"color": "white", "width": 1})
    fig.update_layout(
        updatemenus=dropdown([STRATEGY_NAMES.get(s, s) for s in strategies], vis, prefix=""),
        xaxis={
            "title": {"text": "GPU (EP rank): its physical slots, white lines between GPUs, black between nodes"},
            "tickvals": mids[::every],
            "ticktext": [str(int(g)) for g in gpus[::every]],
        },
        yaxis={"title": {"text": "layer"}, "type": "category", "autorange": "reversed"},
    )
    finish(fig, what="Placement map: the expert in every slot, by layer and GPU (pick a strategy)", source=res.label,
           height=height_for_rows(len(model_L)))  # fmt: skip
    return res.figure(
        key,
        fig,
        file=COMPARE_PLACEMENTS,
        caption="Each cell is one physical expert slot; its colour is the logical expert it holds (hover for the id, GPU "
        "and node). A linear placement reads as a smooth gradient; a data-based one gathers each node's experts.",
    )
