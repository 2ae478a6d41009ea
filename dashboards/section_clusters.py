"""Clusters and classifiers sections, from ``moetrace analyze`` results.

Clusters: one WebGL scatter per (method, stage) of ``embedding.parquet`` (request_id, dataset,
stage, method, layer, x, y; layer -1 = all analysed layers concatenated), coloured by dataset;
hovering a point shows its request id, dataset and, when the trace is at hand, its prompt and
output lengths (joined from the trace's requests table by request id). Titles carry the cluster
scores of ``embedding_scores.parquet`` (silhouette of the normalized vectors and of the 2-D
projection, adjusted Rand index of K-means against datasets). Scatters above the report's
``max_points`` are sampled down and say so on the figure.

Classifiers: accuracy by layer with the chance level and the shuffled-label control
(``classify_accuracy.parquet``), and the confusion matrix per layer behind a slider
(``classify_confusion.parquet``: layer, model_layer, true_dataset, predicted_dataset, count).

Shape legend (docs/architecture.md): N rows of anything else (points of a scatter, one per embedded request), L MoE layers.

Out of scope: computing any of it (``moetrace.analysis.embedding`` / ``classify``).
"""

from __future__ import annotations

import numpy as np
import polars as pl

import moetrace.results as rf
from moetrace.dashboards.figures import (
    heatmaps_by_layer,
    lines_by_layer,
    scatter_by_category,
)
from moetrace.dashboards.page import Section
from moetrace.dashboards.results import Results, datasets_all_last, layer_order
from moetrace.dashboards.theme import OKABE_ITO, SEQUENTIAL

METHOD_NAMES = {"tsne": "t-SNE", "umap": "UMAP"}


def _requests_of_trace(res: Results) -> pl.DataFrame | None:
    from moetrace.errors import TraceFormatError
    from moetrace.tracer.trace.reader import open_trace

    tp = res.trace_path
    if tp is None or not tp.is_dir():
        return None
    try:
        t = open_trace(tp, require_complete=False)
    except TraceFormatError:
        return None
    return t.requests().select("request_id", "prompt_tokens", "output_tokens").collect()


def clusters_section(
    res: Results, *, max_points: int, seed: int, key_prefix: str = ""
) -> tuple[Section | None, list[str]]:
    emb = res.table(rf.EMBEDDING)
    kp = f"{key_prefix}clusters"
    if emb is None:
        return None, ["clusters: no embedding.parquet in " + str(res.path)]
    scores = res.table(rf.EMBEDDING_SCORES)
    req = _requests_of_trace(res)
    notes = []
    if req is not None:
        emb = emb.join(req, on="request_id", how="left")
    else:
        notes.append(f"trace {res.trace_path} not found: hover shows request ids without lengths")
    figures = []
    methods = [m for m in ("tsne", "umap") if m in emb["method"].unique().to_list()]
    for method in methods:
        for stage in [s for s in ("prefill", "decode") if s in emb["stage"].unique().to_list()]:
            sub = emb.filter((pl.col("method") == method) & (pl.col("stage") == stage)).sort("request_id")
            layer = int(sub["layer"][0])
            scope = "all layers concatenated" if layer < 0 else f"MoE layer {layer}"
            hover = {"request": sub["request_id"].to_numpy()}
            if req is not None:
                hover["prompt tokens"] = sub["prompt_tokens"].to_numpy()
                hover["output tokens"] = sub["output_tokens"].to_numpy()
            score_txt = ""
            if scores is not None:
                row = scores.filter(pl.col("stage") == stage)
                if row.height and f"silhouette_{method}" in row.columns:
                    r = row.row(0, named=True)
                    score_txt = (
                        f" (silhouette {r[f'silhouette_{method}']:.2f} in 2-D, K-means ARI {r['adjusted_rand']:.2f})"
                    )
            fig = scatter_by_category(
                sub["x"].to_numpy(),
                sub["y"].to_numpy(),
                category_N=sub["dataset"].to_list(),
                hover_N=hover,
                x_title=f"{METHOD_NAMES[method]} 1",
                y_title=f"{METHOD_NAMES[method]} 2",
                what=f"{METHOD_NAMES[method]} of {stage} activation vectors, coloured by dataset{score_txt}",
                source=res.label,
                max_points=max_points,
                seed=seed,
            )
            figures.append(
                res.figure(
                    f"{kp}-{method}-{stage}",
                    fig,
                    file=rf.EMBEDDING,
                    caption=f"One point per request: its {stage} token counts per expert ({scope}), normalized, projected "
                    f"to 2-D with {METHOD_NAMES[method]} ({sub.height:,} requests). Axes have no unit; only neighbourhoods "
                    "matter.",
                )
            )
    return (
        Section(
            key=kp,
            title="Request clusters",
            intro="Do requests of one dataset activate similar experts? Each point is a request (docs/analysis.md, request embeddings).",
            figures=tuple(figures),
            notes=tuple(notes),
        ),
        [],
    )


def classifiers_section(res: Results, *, key_prefix: str = "") -> tuple[Section | None, list[str]]:
    acc = res.table(rf.CLASSIFY_ACCURACY)
    conf = res.table(rf.CLASSIFY_CONFUSION)
    kp = f"{key_prefix}classifiers"
    if acc is None and conf is None:
        summary = res.json(rf.ANALYSIS_SUMMARY) or {}
        why = (summary.get("classify") or {}).get("skipped", "no classify_*.parquet")
        return None, [f"classifiers: {why} in {res.path}"]
    figures = []
    if acc is not None:
        acc = acc.sort("layer")
        chance = float(acc["chance"][0])
        fig = lines_by_layer(
            {
                "test accuracy": acc["accuracy"].to_numpy(),
                "shuffled-label control": acc["shuffled_accuracy"].to_numpy(),
            },
            layers=acc["model_layer"].to_list(),
            y_title="accuracy (test split)",
            y_range=(0.0, 1.02),
            reference={"chance": chance},
            what=f"Which dataset a request came from, predicted from its prefill expert counts (mean {acc['accuracy'].mean():.3f})",  # type: ignore[str-bytes-safe]  # polars types Series.mean() as any Python literal
            source=res.label,
            colours={"test accuracy": OKABE_ITO[4], "shuffled-label control": OKABE_ITO[7]},
            dash={"shuffled-label control": "dash"},
        )
        figures.append(
            res.figure(
                f"{kp}-accuracy",
                fig,
                file=rf.CLASSIFY_ACCURACY,
                caption="Per layer, multinomial logistic regression from a request's raw prefill count vector to its dataset, "
                "80:20 split with equal representation of datasets. The control trains on shuffled labels; chance = 1/datasets.",
            )
        )
    if conf is not None:
        layers_L, model_L = layer_order(conf)
        names = datasets_all_last(
            conf["true_dataset"].unique().to_list() + conf["predicted_dataset"].unique().to_list()
        )
        idx = {n: i for i, n in enumerate(names)}
        z = np.zeros((len(layers_L), len(names), len(names)))
        li = {int(v): i for i, v in enumerate(layers_L)}
        for lay, t, p, c in conf.select("layer", "true_dataset", "predicted_dataset", "count").iter_rows():
            z[li[int(lay)], idx[t], idx[p]] = c
        fig = heatmaps_by_layer(
            z,
            layer_labels=model_L,
            x=names,
            y=names,
            x_title="predicted dataset",
            y_title="true dataset",
            value_title="test requests",
            what="Confusion matrix of the dataset classifier, per layer",
            source=res.label,
            colorscale=SEQUENTIAL,
            zmin=0.0,
            value_format=".0f",
            show_values=len(names) <= 10,
            square=True,
        )
        figures.append(
            res.figure(
                f"{kp}-confusion",
                fig,
                file=rf.CLASSIFY_CONFUSION,
                caption="Rows: the dataset a test request came from; columns: what the layer's classifier predicted. "
                "A perfect classifier fills the diagonal.",
                max_width=int(fig.layout.meta["width"]),
            )
        )
    return (
        Section(
            key=kp,
            title="Request-type classifiers",
            intro="How much a request's expert activations reveal about what it is: a lever for routing and a privacy risk.",
            figures=tuple(figures),
        ),
        [],
    )
