"""Load-imbalance section, from ``moetrace analyze`` results.

Figures (files and columns as written by ``moetrace.analysis.run``):

- IF heatmap layer × dataset, one per stage: ``imbalance.parquet`` (dataset, stage, layer,
  model_layer, imbalance_factor); the ``all`` column pools every dataset.
- Expert-load heatmap layer × expert, a dropdown over (dataset, stage): ``expert_load.parquet``
  (load = tokens routed to the expert / (T·k/E); 1 = balanced). Colour on a log scale by default,
  buttons switch to linear or to per-layer (÷ the layer's busiest expert); the cells hold uint8
  colour levels of the chosen view, the exact load is in ``customdata`` (hover). Per-layer *share*
  (÷ the layer's tokens) is not offered: a layer's loads sum to E, so it is the linear view / E.
- IF distribution over random serving-sized batches, a box per layer and stage, a dropdown over
  the batch scope (``all`` = mixed batches, or single-dataset batches): ``batch_imbalance.parquet``.
  Boxes are drawn from exact statistics of every batch (quartiles by linear interpolation,
  whiskers from min to max, the mean dashed), so no batch is dropped and the page stays small.

Shape legend (docs/architecture.md): L MoE layers, D datasets (+ ``all``), E logical experts per layer.

Out of scope: computing any of it (``moetrace.analysis.imbalance``).
"""

from __future__ import annotations

import numpy as np
import polars as pl

import moetrace.results as rf
from moetrace.dashboards.figures import heatmap
from moetrace.dashboards.page import Figure, Section
from moetrace.dashboards.results import (
    Results,
    box_stats,
    datasets_all_last,
    layer_order,
    pivot_LZ,
)
from moetrace.dashboards.theme import (
    LEVELS,
    OKABE_ITO,
    REFERENCE_LINE,
    SEQUENTIAL,
    dropdown,
    finish,
    height_for_rows,
    level_colorscale,
    level_of,
    nice_linear_ticks,
    nice_log_ticks,
    plotly_go,
    title_at_top,
    to_levels,
    typed_array,
)

STAGE_COLOURS = {"prefill": OKABE_ITO[4], "decode": OKABE_ITO[5]}  # blue, vermillion


def imbalance_section(res: Results, *, key_prefix: str = "") -> tuple[Section | None, list[str]]:
    """The section (None when no imbalance results exist) and notes on figures left out."""
    figures: list[Figure] = []
    notes: list[str] = []
    kp = f"{key_prefix}imbalance"

    imb = res.table(rf.IMBALANCE)
    if imb is not None:
        layers_L, model_L = layer_order(imb)
        ds = datasets_all_last(imb["dataset"].unique().to_list())
        for stage in _stages(imb):
            sub = imb.filter(pl.col("stage") == stage)
            z_LD = pivot_LZ(sub, x="dataset", x_order=ds, value="imbalance_factor", layers_L=layers_L)
            fig = heatmap(
                z_LD,
                x=ds,
                y=model_L,
                x_title="dataset",
                y_title="layer",
                value_title="imbalance factor (max load, 1 = balanced)",
                what=f"Imbalance factor by layer and dataset: {stage}",
                source=res.label,
                colorscale=SEQUENTIAL,
                zmin=1.0,
                value_format=".2f",
                show_values=len(model_L) <= 24 and len(ds) <= 10,
                height=height_for_rows(len(model_L)),
            )
            figures.append(
                res.figure(
                    f"{kp}-if-{stage}",
                    fig,
                    file=rf.IMBALANCE,
                    caption=f"IF of a layer = max over experts of (tokens routed to the expert) / (T·k/E), over all "
                    f"{stage} tokens of the dataset; 'all' pools every dataset. The slowest expert bounds the layer.",
                )
            )
    else:
        notes.append("imbalance.parquet absent: no IF heatmap")

    load = res.table(rf.EXPERT_LOAD)
    if load is not None:
        figures.append(_expert_load_figure(load, res, key=f"{kp}-expert-load"))
    else:
        notes.append("expert_load.parquet absent: no expert-load heatmap")

    bt = res.table(rf.BATCH_IMBALANCE)
    if bt is not None:
        figures.append(_batch_figure(bt, res, key=f"{kp}-batches"))
    elif why := (res.manifest.get("skipped") or {}).get("batch_imbalance"):  # analyze says why (a load profile)
        notes.append(f"IF distribution over random batches: skipped, {why}")
    else:
        notes.append("batch_imbalance.parquet absent: no IF distribution over batches")

    if not figures:
        return None, ["load imbalance: no imbalance results in " + str(res.path)]
    summary = res.json(rf.ANALYSIS_SUMMARY) or {}
    bs = (summary.get("imbalance") or {}).get("batch_size")
    intro = "How unevenly tokens spread over experts, per layer, dataset and stage (docs/analysis.md). " + (
        f"Batches hold {bs} requests each. " if bs else ""
    )
    return Section(key=kp, title="Load imbalance", intro=intro, figures=tuple(figures), notes=tuple(notes)), []


def _stages(df: pl.DataFrame) -> list[str]:
    have = df["stage"].unique().to_list()
    return [s for s in ("prefill", "decode") if s in have] + sorted(s for s in have if s not in ("prefill", "decode"))


#: colour views of the expert-load heatmap: (button label, colour-bar title)
LOAD_VIEWS = {
    "log": ("log scale", "expert load, × balanced (log scale)"),
    "linear": ("linear", "expert load, × balanced"),
    "layer": ("per layer", "load / the layer's busiest expert"),
}


def load_views(z_SLE: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, tuple[list[float], list[str]]]]:
    """The expert loads ``z_SLE`` (scopes × layers × experts, NaN = no value) as uint8 colour levels
    (``theme.to_levels``) per view, and each view's colour-bar ticks (levels, labels).

    - ``log``: log10 of the load between the smallest positive load and the largest of every scope
      (a load of 0 gets the lowest colour), so a few hot experts do not darken all the others;
    - ``linear``: the load from 0 to the largest of every scope;
    - ``layer``: the load / the largest load of its own layer (and scope), 0..100 %.

    ``log`` and ``linear`` share one range over every scope, so scopes compare directly.
    """
    z = np.asarray(z_SLE, dtype=np.float64)
    finite = z[np.isfinite(z)]
    hi = float(finite.max()) if finite.size else 1.0
    hi = hi if hi > 0 else 1.0
    pos = finite[finite > 0]
    lo = max(float(pos.min()) if pos.size else hi, hi * 1e-4)
    span = np.log10(hi / lo) if hi > lo else 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        log_f = (np.log10(np.maximum(z, lo)) - np.log10(lo)) / span
        row_max = np.nanmax(np.where(np.isfinite(z), z, -np.inf), axis=-1, keepdims=True)
        layer_f = np.where(row_max > 0, z / np.where(row_max > 0, row_max, 1.0), np.nan)
    log_f = np.where(np.isfinite(z), log_f, np.nan)
    views = {"log": to_levels(log_f), "linear": to_levels(z / hi), "layer": to_levels(layer_f)}
    log_ticks = nice_log_ticks(lo, hi)
    lin_ticks = nice_linear_ticks(hi)
    ticks = {
        "log": ([level_of(np.log10(t / lo) / span) for t in log_ticks], [f"{t:g}×" for t in log_ticks]),
        "linear": ([level_of(t / hi) for t in lin_ticks], [f"{t:g}×" for t in lin_ticks]),
        "layer": ([level_of(f) for f in (0, 0.25, 0.5, 0.75, 1.0)], ["0%", "25%", "50%", "75%", "100%"]),
    }
    return views, ticks


def _expert_load_figure(load: pl.DataFrame, res: Results, *, key: str) -> Figure:
    go = plotly_go()
    layers_L, model_L = layer_order(load)
    experts = np.sort(load["expert"].unique().to_numpy())
    ds = datasets_all_last(load["dataset"].unique().to_list())
    stages = _stages(load)
    scopes = [(d, s) for d in ds for s in stages]
    # the pooled scope first: it is what a placement sees
    scopes.sort(key=lambda ds_s: (ds_s[0] != "all", ds.index(ds_s[0]), stages.index(ds_s[1])))
    z_SLE = np.stack([
        pivot_LZ(load.filter((pl.col("dataset") == d) & (pl.col("stage") == s)), x="expert", x_order=experts.tolist(),
                 value="load", layers_L=layers_L)
        for d, s in scopes
    ])  # fmt: skip
    views, ticks = load_views(z_SLE)
    fig = go.Figure()
    for i, (d, s) in enumerate(scopes):
        fig.add_trace(
            go.Heatmap(
                z=views["log"][i],
                customdata=z_SLE[i].astype(np.float32),
                x=experts,
                y=[str(v) for v in model_L],
                coloraxis="coloraxis",
                visible=i == 0,
                name=f"{d} · {s}",
                hovertemplate=f"{d} · {s}<br>layer %{{y}}<br>expert %{{x}}<br>load %{{customdata:.3f}}× balanced"
                "<extra></extra>",
            )
        )

    def colour_axis(view: str) -> dict:
        vals, text = ticks[view]
        return {"colorbar.title.text": LOAD_VIEWS[view][1], "colorbar.tickvals": vals, "colorbar.ticktext": text}

    view_buttons = [
        {
            "label": label,
            "method": "update",
            "args": [
                {"z": [typed_array(v) for v in views[view]]},
                {f"coloraxis.{k}": v for k, v in colour_axis(view).items()},
            ],
        }
        for view, (label, _) in LOAD_VIEWS.items()
    ]
    vis = [[j == i for j in range(len(scopes))] for i in range(len(scopes))]
    vals, text = ticks["log"]
    fig.update_layout(
        coloraxis={
            "colorscale": level_colorscale(SEQUENTIAL),
            "cmin": 0,
            "cmax": LEVELS,
            "colorbar": {
                "title": {"text": LOAD_VIEWS["log"][1], "side": "right"},
                "thickness": 14,
                "tickvals": vals,
                "ticktext": text,
            },
        },  # fmt: skip
        updatemenus=[
            {
                "type": "buttons",
                "direction": "right",
                "active": 0,
                "showactive": True,
                "buttons": view_buttons,
                "x": 0.0,
                "xanchor": "left",
                "y": 1.0,
                "yanchor": "bottom",
                "pad": {"b": 8},
            },
            *dropdown([f"{d} · {s}" for d, s in scopes], vis, prefix="", y=1.0),
        ],  # fmt: skip
        xaxis={"title": {"text": "expert id"}},
        yaxis={"title": {"text": "layer"}, "type": "category", "autorange": "reversed"},
    )
    height = height_for_rows(len(model_L)) + 30
    finish(fig, what="Expert load by layer and expert (pick colour scale, dataset · stage)", source=res.label,
           height=height)  # fmt: skip
    fig.update_layout(margin={"t": 110})  # the title, then the buttons above the plot
    title_at_top(fig, height)
    fig.layout.updatemenus[1].pad = {"b": 8}
    return res.figure(
        key,
        fig,
        file=rf.EXPERT_LOAD,
        caption="Expert load = tokens routed to the expert / (T·k/E) in the chosen dataset and stage (1 = balanced; hover "
        "for the value). Colour: log scale by default, so a few hot experts do not turn every other cell dark; "
        "'linear' shows the load itself; 'per layer' divides by the busiest expert of each layer. Log and linear use one "
        "range for every dataset · stage, so scopes compare directly. Grey: nothing routed.",
    )


def _batch_figure(bt: pl.DataFrame, res: Results, *, key: str) -> Figure:
    go = plotly_go()
    layers_L, model_L = layer_order(bt)
    scopes = datasets_all_last(bt["dataset"].unique().to_list())
    scopes = (["all"] if "all" in scopes else []) + [s for s in scopes if s != "all"]
    stages = _stages(bt)
    fig = go.Figure()
    n_batches = {}
    for scope in scopes:
        for stage in stages:
            sub = bt.filter((pl.col("dataset") == scope) & (pl.col("stage") == stage))
            n_batches[scope] = int(sub["batch"].n_unique())
            stats = [
                box_stats(sub.filter(pl.col("layer") == int(lay))["imbalance_factor"].to_numpy()) for lay in layers_L
            ]
            fig.add_trace(
                go.Box(
                    x=[str(v) for v in model_L],
                    q1=[s["q1"] for s in stats],
                    median=[s["median"] for s in stats],
                    q3=[s["q3"] for s in stats],
                    lowerfence=[s["lowerfence"] for s in stats],
                    upperfence=[s["upperfence"] for s in stats],
                    mean=[s["mean"] for s in stats],
                    boxmean=True,
                    name=stage,
                    legendgroup=stage,
                    marker_color=STAGE_COLOURS.get(stage, OKABE_ITO[2]),
                    visible=scope == scopes[0],
                    hoverinfo="x+y",
                )
            )
    vis = [[sc == scope for sc in scopes for _ in stages] for scope in scopes]
    labels = [f"mixed batches ({n_batches[s]})" if s == "all" else f"{s} batches ({n_batches[s]})" for s in scopes]
    fig.add_hline(y=1.0, line={"color": REFERENCE_LINE, "dash": "dot", "width": 1})
    fig.update_layout(
        boxmode="group",
        updatemenus=dropdown(labels, vis, prefix=""),
        xaxis={"title": {"text": "layer"}, "type": "category"},
        yaxis={"title": {"text": "imbalance factor of a batch (1 = balanced)"}},
        legend={"title": {"text": "stage"}},
    )
    finish(fig, what="Imbalance factor over random serving-sized batches, per layer", source=res.label, height=460)
    return res.figure(
        key,
        fig,
        file=rf.BATCH_IMBALANCE,
        caption="Each box summarizes the IF of every batch (requests shuffled and cut into batches): box = quartiles, "
        "line = median, dashed = mean, whiskers = min to max. The dotted line is perfect balance.",
    )
