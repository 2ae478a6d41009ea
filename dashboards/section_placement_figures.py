"""The placement section's figures of batches and layers, from compare's ``batches.parquet`` and ``layers.parquet``.

A box per strategy over the simulated global batches of a column normalized to the reference's median
(predicted all-to-all time, MoE-layer time, inter-node bytes), its y range chosen from the data
(``ratio_range``); per layer and strategy, the predicted all-to-all time, the inter-node share of the
bytes and the normalized inter-node volume.

Shape legend (docs/architecture.md): L MoE layers.

Out of scope: the table (``section_placement_table``); what the nodes hold (``section_placement_nodes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from moetrace.dashboards.figures import lines_by_layer
from moetrace.dashboards.page import Figure
from moetrace.dashboards.results import Results, layer_order
from moetrace.dashboards.section_placement_strategies import (
    BOUNDS_GROUP,
    STRATEGY_NAMES,
    is_bound,
    line_style,
    recommended_of,
    strategies_in_order,
    strategy_colours,
)
from moetrace.dashboards.theme import REFERENCE_LINE, finish, plotly_go
from moetrace.results import COMPARE_BATCHES, COMPARE_LAYERS

__all__ = [
    "ratio_range",
    "BoxView",
    "BYTES_BOX",
    "A2A_TIME_BOX",
    "MOE_TIME_BOX",
    "box_by_strategy",
    "time_per_layer",
    "per_layer",
]


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
class BoxView:
    """One box figure of ``batches.parquet``: a column normalized to the reference's median."""

    column: str  # the batches.parquet column, one value per global batch
    y_title: str  # the y axis's title
    what: str  # the figure's title
    hover: str  # the value's name in the hover text
    definition: str  # what one value is, for the caption


BYTES_BOX = BoxView(
    column="inter_node_normalized",
    y_title="inter-node bytes / reference median",
    what="Normalized inter-node all-to-all volume per strategy (lower is better)",
    hover="normalized inter-node volume",
    definition="inter-node bytes of dispatch and combine summed over MoE layers",
)
A2A_TIME_BOX = BoxView(
    column="a2a_time_normalized",
    y_title="all-to-all time / reference median",
    what="Predicted all-to-all time per decode step, per strategy (lower is better)",
    hover="normalized all-to-all time",
    definition="predicted seconds of dispatch and combine summed over MoE layers, the busiest GPU of each "
    "collective charged",
)
MOE_TIME_BOX = BoxView(
    column="moe_time_normalized",
    y_title="MoE-layer time / reference median",
    what="Predicted MoE-layer time per decode step, per strategy (lower is better)",
    hover="normalized MoE-layer time",
    definition="predicted seconds of dispatch, expert computation and combine summed over MoE layers",
)


def box_by_strategy(batches: pl.DataFrame, res: Results, *, view: BoxView, ref: str, key: str) -> Figure:
    """A box per strategy of ``batches.parquet`` ``view.column`` (one value per global batch, already
    normalized to the reference's median), the reference median drawn at 1."""
    go = plotly_go()
    strategies = strategies_in_order(res, batches)
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


def time_per_layer(layers: pl.DataFrame, res: Results, *, key: str) -> Figure:
    """Median over batches of each layer's predicted all-to-all seconds (dispatch + combine), in µs."""
    strategies = strategies_in_order(res, layers)
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
        **line_style(res, strategies),
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


def per_layer(layers: pl.DataFrame, res: Results, *, ref: str, key: str) -> list[Figure]:
    strategies = strategies_in_order(res, layers)
    style = line_style(res, strategies)
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
