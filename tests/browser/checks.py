"""Every figure's data against the result file it was drawn from, recomputed here independently.

``check_all(figures, produced)`` takes ``{figure key: [trace dicts]}`` — read either from the HTML
(``figjson``) or from the live page in Chromium (``harness``) — and asserts, figure by figure, that
the numbers drawn are the numbers in the results. It returns the keys it checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from browser.fixtures import Produced


def _arr(v: Any, dtype=float) -> np.ndarray:
    return np.asarray(v, dtype=dtype)


def _by_name(traces: list[dict]) -> dict[str, dict]:
    return {t.get("name"): t for t in traces}


def check_imbalance(figs: dict[str, list[dict]], an: Path) -> list[str]:
    imb = pl.read_parquet(an / "imbalance.parquet")
    checked = []
    for stage in ("prefill", "decode"):
        (t,) = figs[f"imbalance-if-{stage}"]
        sub = imb.filter(pl.col("stage") == stage)
        assert t["x"][-1] == "all" and sorted(t["x"][:-1]) == t["x"][:-1]
        layers = sorted(sub["model_layer"].unique().to_list())
        assert [int(v) for v in t["y"]] == layers
        z = _arr(t["z"])
        for i, ml in enumerate(layers):
            for j, ds in enumerate(t["x"]):
                want = sub.filter((pl.col("model_layer") == ml) & (pl.col("dataset") == ds))["imbalance_factor"].item()
                assert z[i, j] == want, (stage, ml, ds)
        checked.append(f"imbalance-if-{stage}")

    load = pl.read_parquet(an / "expert_load.parquet")
    traces = _by_name(figs["imbalance-expert-load"])
    assert len(traces) == load.select("dataset", "stage").unique().height
    # colour levels of the default (log) view: 1 + 254 * log(load / lo) / log(hi / lo), lo = the smallest
    # positive load of every scope, hi the largest; the exact load is the hover's customdata
    v = load["load"].to_numpy()
    lo, hi = v[v > 0].min(), v.max()
    for name, t in traces.items():
        ds, stage = name.split(" · ")
        sub = load.filter((pl.col("dataset") == ds) & (pl.col("stage") == stage)).sort("model_layer", "expert")
        L, E = sub["model_layer"].n_unique(), sub["expert"].n_unique()
        want = sub["load"].to_numpy().reshape(L, E)
        np.testing.assert_allclose(_arr(t["customdata"]), want, rtol=1e-6)
        levels = 1 + np.rint(254 * np.log(np.maximum(want, lo) / lo) / np.log(hi / lo))
        np.testing.assert_allclose(_arr(t["z"]), levels, atol=1)
    checked.append("imbalance-expert-load")

    bt = pl.read_parquet(an / "batch_imbalance.parquet")
    traces = figs["imbalance-batches"]
    shown = [t for t in traces if t.get("visible", True) is not False]
    assert {t["name"] for t in shown} == {"prefill", "decode"}
    for t in shown:  # the first dropdown entry: mixed batches ("all")
        sub = bt.filter((pl.col("dataset") == "all") & (pl.col("stage") == t["name"]))
        med = (
            sub.group_by("model_layer")
            .agg(
                pl.col("imbalance_factor").quantile(0.5, "linear").alias("m"),
                pl.col("imbalance_factor").min().alias("lo"),
                pl.col("imbalance_factor").max().alias("hi"),
            )
            .sort("model_layer")
        )
        assert [int(v) for v in t["x"]] == med["model_layer"].to_list()
        np.testing.assert_allclose(_arr(t["median"]), med["m"].to_numpy(), rtol=1e-12)
        np.testing.assert_allclose(_arr(t["lowerfence"]), med["lo"].to_numpy(), rtol=1e-12)
        np.testing.assert_allclose(_arr(t["upperfence"]), med["hi"].to_numpy(), rtol=1e-12)
    checked.append("imbalance-batches")
    return checked


def check_correlation(figs: dict[str, list[dict]], an: Path) -> list[str]:
    per = pl.read_parquet(an / "dataset_correlation.parquet")
    mean = pl.read_parquet(an / "dataset_correlation_mean.parquet")
    checked = []
    for stage in ("prefill", "decode"):
        traces = figs[f"correlation-datasets-{stage}"]
        names = traces[0]["x"]
        layers = sorted(per["model_layer"].unique().to_list())
        assert len(traces) == 1 + len(layers)  # mean, then one per layer
        for i, t in enumerate(traces):
            src = (
                mean.filter(pl.col("stage") == stage)
                if i == 0
                else per.filter((pl.col("stage") == stage) & (pl.col("model_layer") == layers[i - 1]))
            )
            want = np.array([[src.filter((pl.col("dataset_a") == a) & (pl.col("dataset_b") == b))["pearson"].item()
                              for b in names] for a in names])  # fmt: skip
            np.testing.assert_allclose(_arr(t["z"]), want, rtol=1e-12)
        checked.append(f"correlation-datasets-{stage}")

    pooled = pl.read_parquet(an / "prefill_decode_pooled.parquet")
    traces = _by_name(figs["correlation-prefill-decode"])
    for ds in pooled["dataset"].unique().to_list():
        sub = pooled.filter(pl.col("dataset") == ds).sort("layer")
        t = traces[f"pooled: {ds}"]
        assert [int(v) for v in t["x"]] == sub["model_layer"].to_list()
        np.testing.assert_allclose(_arr(t["y"]), sub["pearson"].to_numpy(), rtol=1e-12)
    pr = (
        pl.read_parquet(an / "prefill_decode_per_request_layers.parquet")
        .filter(pl.col("dataset") == "all")
        .sort("layer")
    )
    np.testing.assert_allclose(_arr(traces["per request (mean r over requests)"]["y"]), pr["pearson_mean"].to_numpy())
    checked.append("correlation-prefill-decode")
    return checked


def check_clusters(figs: dict[str, list[dict]], an: Path, trace: Path) -> list[str]:
    from moetrace.tracer.trace.reader import open_trace

    emb = pl.read_parquet(an / "embedding.parquet")
    req = open_trace(trace).requests().collect()
    lengths = {r["request_id"]: (r["prompt_tokens"], r["output_tokens"]) for r in req.iter_rows(named=True)}
    checked = []
    for (method, stage), sub in emb.group_by("method", "stage"):
        traces = figs[f"clusters-{method}-{stage}"]
        assert all(t["type"] == "scattergl" for t in traces)  # WebGL
        drawn = {}
        for t in traces:
            cd = _arr(t["customdata"], dtype=np.int64).reshape(-1, 3)
            for (rid, p, o), x, y in zip(cd, t["x"], t["y"]):
                drawn[int(rid)] = (t["name"], float(x), float(y))
                assert (p, o) == lengths[int(rid)]  # hover shows the request's real lengths
        assert len(drawn) == sub.height  # every request drawn (below the cap), once
        for r in sub.iter_rows(named=True):
            name, x, y = drawn[r["request_id"]]
            assert name == r["dataset"]
            assert np.float32(x) == r["x"] and np.float32(y) == r["y"]
        checked.append(f"clusters-{method}-{stage}")
    return checked


def check_classifiers(figs: dict[str, list[dict]], an: Path) -> list[str]:
    acc = pl.read_parquet(an / "classify_accuracy.parquet").sort("layer")
    traces = _by_name(figs["classifiers-accuracy"])
    np.testing.assert_allclose(_arr(traces["test accuracy"]["y"]), acc["accuracy"].to_numpy())
    np.testing.assert_allclose(_arr(traces["shuffled-label control"]["y"]), acc["shuffled_accuracy"].to_numpy())
    assert [int(v) for v in traces["test accuracy"]["x"]] == acc["model_layer"].to_list()
    conf = pl.read_parquet(an / "classify_confusion.parquet")
    traces = figs["classifiers-confusion"]
    layers = sorted(conf["model_layer"].unique().to_list())
    assert len(traces) == len(layers)
    for t, ml in zip(traces, layers):
        names = t["x"]
        sub = conf.filter(pl.col("model_layer") == ml)
        want = np.zeros((len(names), len(names)))
        for r in sub.iter_rows(named=True):
            want[names.index(r["true_dataset"]), names.index(r["predicted_dataset"])] += r["count"]
        np.testing.assert_array_equal(_arr(t["z"]), want)
    return ["classifiers-accuracy", "classifiers-confusion"]


def _check_node_holdings(figs: dict[str, list[dict]], cmp: Path, analysis: Path, name_of: dict) -> list[str]:
    """The datasets-per-node heatmap and the tokens-per-GPU bars, recomputed with joins: each slot
    carries its expert's decode tokens / the expert's replicas, summed by node (per dataset) or GPU."""
    places = pl.read_parquet(cmp / "placements.parquet")
    load = pl.read_parquet(analysis / "expert_load.parquet").filter(pl.col("stage") == "decode")
    for t_serves, t_tokens in zip(figs["placement-serves"], figs["placement-tokens"]):
        s = name_of[t_serves["name"]]
        assert name_of[t_tokens["name"]] == s
        sub = places.filter(pl.col("strategy") == s)
        reps = sub.group_by("layer", "expert").agg(pl.len().alias("replicas"))
        slots = sub.join(reps, on=["layer", "expert"])
        per = slots.join(load.select("dataset", "layer", "expert", "tokens"), on=["layer", "expert"]).with_columns(
            (pl.col("tokens") / pl.col("replicas")).alias("w")
        )
        datasets = list(t_serves["x"])
        by_node = per.group_by("dataset", "node").agg(pl.col("w").sum())
        z = _arr(t_serves["z"])
        for d, ds in enumerate(datasets):
            rows = by_node.filter(pl.col("dataset") == ds).sort("node")
            np.testing.assert_allclose(z[:, d], rows["w"].to_numpy() / rows["w"].sum(), rtol=1e-9)
        every = per.filter(pl.col("dataset") == "all").group_by("gpu").agg(pl.col("w").sum()).sort("gpu")
        w = every["w"].to_numpy()
        np.testing.assert_allclose(_arr(t_tokens["y"]), w / w.mean(), rtol=1e-9)
    # the dropdown opens on the recommended one (ours), or, in results without it, on the first grouped one
    opened = name_of[figs["placement-serves"][0]["name"]]
    assert opened == "ours" or ("ours" not in name_of.values() and opened == "joint"), opened
    return ["placement-serves", "placement-tokens"]


def check_placement(figs: dict[str, list[dict]], cmp: Path, analysis: Path | None = None) -> list[str]:
    from moetrace.dashboards.section_placement import STRATEGY_NAMES

    labels = {v: k for k, v in STRATEGY_NAMES.items()}
    name_of = {
        **{n: n for n in pl.read_parquet(cmp / "summary.parquet")["strategy"]},
        **labels,
    }  # rows outside the registry keep their name
    bt = pl.read_parquet(cmp / "batches.parquet")
    traces = figs["placement-normalized"]
    assert {name_of[t["name"]] for t in traces} == set(bt["strategy"].unique().to_list())
    assert name_of[traces[0]["name"]] == "linear"  # the reference first
    for t in traces:
        want = bt.filter(pl.col("strategy") == name_of[t["name"]]).sort("batch")["inter_node_normalized"].to_numpy()
        np.testing.assert_allclose(_arr(t["y"]), want, rtol=1e-12)
    # the reference's median is exactly 1 (what "normalized" means)
    assert np.median(_arr(traces[0]["y"])) == 1.0
    checked = ["placement-normalized", "placement-layers-share"]
    # results written with the cost model: the predicted-time boxes (per batch) and per-layer lines
    for key, col in (("placement-time", "a2a_time_normalized"), ("placement-moe-time", "moe_time_normalized")):
        if key in figs:
            assert [name_of[t["name"]] for t in figs[key]] == [name_of[t["name"]] for t in traces]
            for t in figs[key]:
                want = bt.filter(pl.col("strategy") == name_of[t["name"]]).sort("batch")[col].to_numpy()
                np.testing.assert_allclose(_arr(t["y"]), want, rtol=1e-12)
            checked.append(key)

    lay = pl.read_parquet(cmp / "layers.parquet")
    for t in figs["placement-layers-share"]:
        sub = lay.filter(pl.col("strategy") == name_of[t["name"]])
        L = sub["layer"].n_unique()
        inter = np.zeros(L)
        total = np.zeros(L)
        for r in sub.iter_rows(named=True):
            i = r["dispatch_inter_bytes"] + r["combine_inter_bytes"]
            inter[r["layer"]] += i
            total[r["layer"]] += i + r["dispatch_intra_bytes"] + r["combine_intra_bytes"]
        np.testing.assert_allclose(_arr(t["y"]), inter / total, rtol=1e-12)
    if "placement-layers-time" in figs:
        for t in figs["placement-layers-time"]:
            sub = lay.filter(pl.col("strategy") == name_of[t["name"]])
            want = [
                np.median(
                    [
                        r["dispatch_seconds"] + r["combine_seconds"]
                        for r in sub.filter(pl.col("layer") == i).iter_rows(named=True)
                    ]
                )
                * 1e6
                for i in range(sub["layer"].n_unique())
            ]
            np.testing.assert_allclose(_arr(t["y"]), want, rtol=1e-9)
        checked.append("placement-layers-time")

    if analysis is not None and "placement-serves" in figs:
        checked += _check_node_holdings(figs, cmp, analysis, name_of)
    return checked


def check_all(figs: dict[str, list[dict]], p: Produced) -> list[str]:
    checked = []
    if p.analysis is not None:
        checked += check_imbalance(figs, p.analysis)
        checked += check_correlation(figs, p.analysis)
        checked += check_clusters(figs, p.analysis, p.trace)
        checked += check_classifiers(figs, p.analysis)
    if p.compare is not None:
        checked += check_placement(figs, p.compare, p.analysis)
    return checked
