"""Placement section, from ``moetrace compare`` results (SPEC §5–6, core paper Fig. 9).

Figures (files and columns as written by ``moetrace.placement.compare.write_results``):

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
- The summary table (``summary.parquet``) above the figures.

Measured all-to-all (replayed through real collectives by ``moetrace a2a``) against these predictions
is drawn by ``section_a2a`` from that command's results directory.

Shape legend (docs/architecture.md): V strategies, B global batches, L MoE layers, P physical
slots, W GPUs (EP ranks).

Out of scope: placing or simulating (``moetrace.placement``).
"""

from __future__ import annotations

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
from moetrace.placement.strategies import LABELS
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
    setup = (
        f"{m.deployment} on {m.num_nodes} node(s) of {m.gpus_per_node} GPUs; "
        f"{m.num_train_requests} requests placed, {m.num_test_requests} held out for evaluation; "
        f"{m.num_batches} global batches of {m.batch_requests} requests; "
        f"dedup per {m.dedup}, replica policy {m.replica_policy}, "
        f"{m.num_redundant} redundant slot(s) per layer."
    )

    summary = res.table(COMPARE_SUMMARY)
    if summary is not None:
        strategies = _strategies(res, summary)
        by = {r["strategy"]: r for r in summary.iter_rows(named=True)}
        rows = []
        for s in strategies:
            r = by[s]
            rows.append(
                (
                    STRATEGY_NAMES.get(s, s),
                    r["inter_node_normalized_median"],
                    r["inter_node_normalized_p10"],
                    r["inter_node_normalized_p90"],
                    _kib(r["inter_node_bytes_per_batch_median"]),
                    _kib(r["intra_node_bytes_per_batch_median"]),
                    _kib(r["max_rank_dispatch_send_bytes_mean"]),
                    r["tokens_per_rank_max_mean"],
                    r["activated_experts_per_rank_max_mean"],
                    "-" if r.get("router_match_rate") is None else f"{100 * r['router_match_rate']:.0f}%",
                    "-" if r.get("busiest_node_load") is None else f"{r['busiest_node_load']:.2f}",
                )
            )
        tables.append(
            Table(
                key=f"{kp}-summary",
                header=(
                    "strategy",
                    "inter-node (normalized median)",
                    "p10",
                    "p90",
                    "inter-node / batch",
                    "intra-node / batch",
                    "largest rank send / layer",
                    "max tokens per rank",
                    "max activated experts per rank",
                    "router match",
                    "busiest node's requests / even share",
                ),
                rows=tuple(rows),
                caption=f"Normalized to the median of {STRATEGY_NAMES.get(ref, ref)}; lower is better. Byte columns are "
                "medians (per batch) or means (per layer and batch).",
            )
        )

    batches = res.table(COMPARE_BATCHES)
    if batches is not None:
        figures.append(_fig9(batches, res, ref=ref, key=f"{kp}-normalized"))
    else:
        notes.append("batches.parquet absent: no normalized-volume figure")

    layers = res.table(COMPARE_LAYERS)
    if layers is not None:
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
            intro="Which experts live on which GPU, and how much all-to-all traffic each placement causes on requests "
            f"it never saw. {setup}",
            tables=tuple(tables),
            figures=tuple(figures),
            notes=tuple(notes),
        ),
        [],
    )


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


def _fig9(batches: pl.DataFrame, res: Results, *, ref: str, key: str) -> Figure:
    go = plotly_go()
    strategies = _strategies(res, batches)
    colours = strategy_colours(strategies)
    fig = go.Figure()
    all_y: list[np.ndarray] = []
    for s in strategies:
        sub = batches.filter(pl.col("strategy") == s).sort("batch")
        all_y.append(sub["inter_node_normalized"].to_numpy())
        fig.add_trace(
            go.Box(
                y=sub["inter_node_normalized"].to_numpy(),
                name=STRATEGY_NAMES.get(s, s),
                marker_color=colours[s],
                boxpoints="outliers",
                boxmean=True,
                hovertemplate=f"{STRATEGY_NAMES.get(s, s)}<br>normalized inter-node volume %{{y:.3f}}<extra></extra>",
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
        yaxis={"title": {"text": "inter-node all-to-all bytes / reference median"}, "range": list(ratio_range(all_y))},
    )
    finish(
        fig, what="Normalized inter-node all-to-all volume per strategy (lower is better)", source=res.label, height=460
    )
    return res.figure(
        key,
        fig,
        file=COMPARE_BATCHES,
        caption="One value per simulated global batch (a decode step of every node's micro-batch): inter-node bytes of "
        f"dispatch and combine summed over MoE layers, divided by the median of {STRATEGY_NAMES.get(ref, ref)}. Box = "
        "quartiles, whiskers = 1.5 IQR, dashed = mean. The y axis spans the 1st to 99th percentile of the values (and 1), "
        "not 0: the differences are a few percent. Evaluated on held-out requests.",
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
