"""Correlations section, from ``moetrace analyze`` results.

Figures (files and columns as written by ``moetrace.analysis.run``):

- Dataset × dataset Pearson matrix per stage, with a slider whose first step is the mean over
  layers (``dataset_correlation_mean.parquet``) and the others one layer each
  (``dataset_correlation.parquet``: stage, layer, model_layer, dataset_a, dataset_b, pearson).
- Prefill↔decode correlation by layer: one line per dataset for the *pooled* aggregation (each
  dataset's prefill count vector against its decode count vector, ``prefill_decode_pooled.parquet``)
  and one for the *per-request* aggregation (r per request, averaged over requests,
  ``prefill_decode_per_request_layers.parquet``, dataset ``all``).
- Recall@k of a request's decode hot experts from its prefill counts, by layer, against the
  popularity baseline (``prefill_decode_recall.parquet``, dataset ``all``).

Shape legend (docs/architecture.md): L MoE layers.

Out of scope: computing any of it (``moetrace.analysis.correlation``).
"""

from __future__ import annotations

import numpy as np
import polars as pl

import moetrace.results as rf
from moetrace.dashboards.figures import lines_by_layer
from moetrace.dashboards.page import Figure, Section
from moetrace.dashboards.results import Results, datasets_all_last, layer_order
from moetrace.dashboards.theme import (
    DIVERGING,
    OKABE_ITO,
    category_colours,
    layer_slider,
    plotly_go,
    square_matrix,
)


def correlation_section(res: Results, *, key_prefix: str = "") -> tuple[Section | None, list[str]]:
    figures: list[Figure] = []
    notes: list[str] = []
    kp = f"{key_prefix}correlation"

    per_layer = res.table(rf.DATASET_CORRELATION)
    mean = res.table(rf.DATASET_CORRELATION_MEAN)
    ref = per_layer if per_layer is not None else mean
    if ref is not None:
        for stage in [s for s in ("prefill", "decode") if s in ref["stage"].unique().to_list()]:
            figures.append(_matrix_figure(per_layer, mean, res, stage=stage, key=f"{kp}-datasets-{stage}"))
    else:
        notes.append("dataset_correlation*.parquet absent: no dataset matrices")

    pooled = res.table(rf.PREFILL_DECODE_POOLED)
    per_req = res.table(rf.PREFILL_DECODE_PER_REQUEST_LAYERS)
    if pooled is not None or per_req is not None:
        figures.append(_prefill_decode_figure(pooled, per_req, res, key=f"{kp}-prefill-decode"))
    else:
        why = (res.manifest.get("skipped") or {}).get("prefill_decode")  # analyze records why it skipped a step
        notes.append(
            f"prefill↔decode: skipped ({why})"
            if why
            else "prefill_decode_*.parquet absent (trace without both stages?): no prefill↔decode figure"
        )
    if per_req is None and (why := (res.manifest.get("skipped") or {}).get("prefill_decode_per_request")):
        notes.append(f"prefill↔decode per request: skipped, {why}")  # a load profile: pooled r only

    rec = res.table(rf.PREFILL_DECODE_RECALL)
    if rec is not None:
        allr = rec.filter(pl.col("dataset") == "all").sort("layer")
        k = int(allr["k"][0])
        fig = lines_by_layer(
            {
                f"recall@{k} from prefill counts": allr["recall"].to_numpy(),
                f"popularity baseline (top-{k} overall)": allr["recall_popularity"].to_numpy(),
            },
            layers=allr["model_layer"].to_list(),
            y_title=f"recall@{k}",
            y_range=(0.0, 1.02),
            what=f"How well prefill predicts a request's decode hot experts (recall@{k}), by layer",
            source=res.label,
            colours={
                f"recall@{k} from prefill counts": OKABE_ITO[4],
                f"popularity baseline (top-{k} overall)": OKABE_ITO[7],
            },
            dash={f"popularity baseline (top-{k} overall)": "dash"},
        )
        figures.append(
            res.figure(
                f"{kp}-recall",
                fig,
                file=rf.PREFILL_DECODE_RECALL,
                caption=f"Per request: the share of its {k} most-used decode experts found among its {k} most-used "
                "prefill experts, averaged over requests; the baseline guesses the globally most-used experts.",
            )
        )

    if not figures:
        return None, ["correlations: no correlation results in " + str(res.path)]
    return (
        Section(
            key=kp,
            title="Correlations",
            intro="Which datasets use the same experts"
            + (
                ", and how well a request's prefill predicts its decode"
                if per_req is not None or rec is not None
                else ""
            )
            + " (docs/analysis.md).",
            figures=tuple(figures),
            notes=tuple(notes),
        ),
        [],
    )


def _square(df: pl.DataFrame, names: list[str]) -> np.ndarray:
    idx = {n: i for i, n in enumerate(names)}
    out = np.full((len(names), len(names)), np.nan)
    for a, b, r in df.select("dataset_a", "dataset_b", "pearson").iter_rows():
        if a in idx and b in idx:
            out[idx[a], idx[b]] = np.nan if r is None else r
    return out


def _matrix_figure(
    per_layer: pl.DataFrame | None, mean: pl.DataFrame | None, res: Results, *, stage: str, key: str
) -> Figure:
    go = plotly_go()
    frames = [f for f in (per_layer, mean) if f is not None]
    names = datasets_all_last(pl.concat([f.select("dataset_a") for f in frames])["dataset_a"].unique().to_list())
    mats, labels = [], []
    if mean is not None:
        mats.append(_square(mean.filter(pl.col("stage") == stage), names))
        labels.append("mean")
    if per_layer is not None:
        sub = per_layer.filter(pl.col("stage") == stage)
        layers_L, model_L = layer_order(sub)
        for lay, ml in zip(layers_L, model_L):
            mats.append(_square(sub.filter(pl.col("layer") == int(lay)), names))
            labels.append(str(ml))
    fig = go.Figure()
    show_text = len(names) <= 10
    for i, (z, lab) in enumerate(zip(mats, labels)):
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=names,
                y=names,
                zmin=-1.0,
                zmax=1.0,
                zmid=0.0,
                colorscale=DIVERGING,
                reversescale=True,
                visible=i == 0,
                name="mean over layers" if lab == "mean" else f"layer {lab}",
                colorbar={"title": {"text": "Pearson r", "side": "right"}, "thickness": 14},
                texttemplate="%{z:.2f}" if show_text else None,
                hovertemplate=("mean over layers" if lab == "mean" else f"layer {lab}")
                + "<br>%{y} vs %{x}<br>r = %{z:.3f}<extra></extra>",
            )
        )
    fig.update_layout(sliders=layer_slider(len(mats), traces_per_layer=1, layer_labels=labels))
    _, width = square_matrix(fig, names, x_title="dataset", y_title="dataset", slider=True,
                             what=f"Dataset × dataset correlation of expert usage: {stage}", source=res.label)  # fmt: skip
    return res.figure(
        key,
        fig,
        file=rf.DATASET_CORRELATION_MEAN if mean is not None else rf.DATASET_CORRELATION,
        caption=f"Pearson r between two datasets' per-expert {stage} token-count vectors of a layer. Slider: first "
        "step the mean over layers, then each layer (model index).",
        max_width=width,
    )


def _prefill_decode_figure(
    pooled: pl.DataFrame | None, per_req: pl.DataFrame | None, res: Results, *, key: str
) -> Figure:
    series: dict[str, np.ndarray] = {}
    dash: dict[str, str] = {}
    layers = None
    if pooled is not None:
        ds = datasets_all_last(pooled["dataset"].unique().to_list())
        for d in ds:
            sub = pooled.filter(pl.col("dataset") == d).sort("layer")
            layers = sub["model_layer"].to_list()
            series[f"pooled: {d}"] = sub["pearson"].to_numpy()
    if per_req is not None:
        sub = per_req.filter(pl.col("dataset") == "all").sort("layer")
        layers = layers or sub["model_layer"].to_list()
        name = "per request (mean r over requests)"
        series[name] = sub["pearson_mean"].to_numpy()
        dash[name] = "dash"
    colours = category_colours([n for n in series if not n.startswith("per request") and n != "pooled: all"])
    colours["pooled: all"] = OKABE_ITO[7]
    colours["per request (mean r over requests)"] = OKABE_ITO[7]
    fig = lines_by_layer(
        series,
        layers=layers or [],
        y_title="Pearson r (prefill vs decode)",
        y_range=(min(-0.05, float(np.nanmin(np.concatenate(list(series.values())))) - 0.05), 1.02),
        what="Prefill↔decode correlation of expert usage, by layer",
        source=res.label,
        colours=colours,
        dash=dash,
    )
    return res.figure(
        key,
        fig,
        file=rf.PREFILL_DECODE_POOLED if pooled is not None else rf.PREFILL_DECODE_PER_REQUEST_LAYERS,
        caption="Pooled: per dataset, Pearson r between the layer's prefill and decode per-expert count vectors ('all' pools "
        "every dataset)."
        + (
            " Per request: r of each request's own prefill and decode vectors, averaged over requests (dashed)."
            if per_req is not None
            else ""
        ),
    )
