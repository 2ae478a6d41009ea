"""`moetrace analyze` end to end: files, manifest, summary, subsets, clean errors; and on a collected trace."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from factories import profile_trace
from typer.testing import CliRunner

from moetrace.analysis.run import AnalyzeConfig, analyze
from moetrace.cli import app
from moetrace.errors import ConfigError
from moetrace.results import resolve_recorded

runner = CliRunner()

EXPECTED_FILES = {
    "imbalance.parquet": ["dataset", "stage", "layer", "model_layer", "tokens", "imbalance_factor", "hottest_expert"],
    "expert_load.parquet": ["dataset", "stage", "layer", "model_layer", "expert", "tokens", "load"],
    "batch_imbalance.parquet": ["dataset", "batch", "stage", "layer", "model_layer", "imbalance_factor"],
    "dataset_correlation.parquet": ["stage", "layer", "model_layer", "dataset_a", "dataset_b", "pearson"],
    "dataset_correlation_mean.parquet": ["stage", "dataset_a", "dataset_b", "pearson"],
    "prefill_decode_pooled.parquet": ["dataset", "layer", "model_layer", "pearson"],
    "prefill_decode_per_request_layers.parquet": ["dataset", "layer", "model_layer", "pearson_mean", "num_requests"],
    "prefill_decode_per_request.parquet": ["request_id", "dataset", "pearson_mean", "num_layers"],
    "prefill_decode_recall.parquet": [
        "dataset",
        "layer",
        "model_layer",
        "k",
        "recall",
        "recall_popularity",
        "num_requests",
    ],
    "classify_accuracy.parquet": ["layer", "model_layer", "accuracy", "shuffled_accuracy", "chance"],
    "classify_confusion.parquet": ["layer", "model_layer", "true_dataset", "predicted_dataset", "count"],
    "embedding.parquet": ["request_id", "dataset", "stage", "method", "layer", "x", "y", "fitted"],
    "embedding_scores.parquet": [
        "stage",
        "layer",
        "num_requests",
        "num_datasets",
        "silhouette",
        "adjusted_rand",
        "num_fitted",
        "silhouette_tsne",
        "silhouette_umap",
    ],
    "affinity.parquet": [
        "layer",
        "model_layer",
        "next_model_layer",
        "mutual_information_bits",
        "uncertainty_coefficient",
        "top1_predictability",
        "top1_marginal",
        "pairs",
    ],
    "coactivation.parquet": ["layer", "model_layer", "expert_a", "expert_b", "count", "lift"],
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    E, L = 16, 3
    prof = np.ones((2, 2, L, E))
    prof[0, :, :, :4] = 10.0
    prof[1, :, :, 8:12] = 10.0
    return profile_trace(tmp_path_factory.mktemp("run") / "t", profiles_DSLE=prof, requests_per_dataset=40, seed=2)


def test_cli_writes_every_result_with_the_documented_columns(planted, tmp_path):
    out = tmp_path / "res"
    res = runner.invoke(
        app,
        [
            "analyze",
            str(planted),
            "-o",
            str(out),
            "--batch-size",
            "8",
            "--embedding-max-requests",
            "60",
            "--embedding-methods",
            "tsne,umap",
        ],
    )
    assert res.exit_code == 0, res.output
    for name, cols in EXPECTED_FILES.items():
        assert pl.read_parquet(out / name).columns == cols, name
    man = json.loads((out / "manifest.json").read_text())
    assert man["format"] == "moetrace.analysis" and not Path(man["trace"]["path"]).is_absolute()
    # the trace is recorded relative to the results (no absolute path of the user's machine)
    assert resolve_recorded(man["trace"]["path"], results_dir=out).resolve() == planted.resolve()
    assert man["trace"]["model"]["num_experts"] == 16 and man["trace"]["backend"]["name"] == "synthetic"
    assert man["parameters"]["batch_size"] == 8 and man["parameters"]["seed"] == 0
    assert set(man["files"]) == set(EXPECTED_FILES) | {"summary.json"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["classify"]["mean_accuracy"] > 0.9 and summary["classify"]["chance"] == 0.5
    # the printed table carries the paper's headline numbers
    for text in (
        "mean imbalance factor",
        "prefill↔decode correlation",
        "pooled per dataset",
        "per request",
        "mean accuracy",
        "chance 0.500",
        "shuffled control",
    ):
        assert text in res.output
    emb = pl.read_parquet(out / "embedding.parquet")
    assert emb.filter((pl.col("stage") == "prefill") & (pl.col("method") == "umap")).height == 60  # the cap, stratified
    assert emb.filter((pl.col("stage") == "decode") & (pl.col("method") == "tsne")).group_by("dataset").len()[
        "len"
    ].to_list() == [30, 30]


def test_embedding_fits_a_bounded_sample_and_places_the_rest_by_neighbours(planted, tmp_path):
    """t-SNE fits 20 of the 80 requests per stage; the other 60 land among their own dataset's fitted points."""
    cfg = AnalyzeConfig(only=("embedding",), embedding_fit_requests=20, embedding_max_requests=None)
    summary = analyze(planted, tmp_path / "e", config=cfg)
    assert summary["embedding"]["prefill"]["num_fitted"] == 20 and summary["embedding"]["prefill"]["num_requests"] == 80
    assert "nearest fitted requests" in summary["embedding"]["prefill"]["placement"]
    emb = pl.read_parquet(tmp_path / "e" / "embedding.parquet").filter(pl.col("stage") == "prefill")
    assert emb.height == 80 and emb["fitted"].sum() == 20
    assert emb.filter(pl.col("fitted")).group_by("dataset").len()["len"].to_list() == [10, 10]  # stratified
    fit, rest = emb.filter(pl.col("fitted")), emb.filter(~pl.col("fitted"))
    centre = {d: fit.filter(pl.col("dataset") == d).select("x", "y").mean().row(0) for d in ("ds0", "ds1")}
    for r in rest.iter_rows(named=True):
        dist = {d: (r["x"] - c[0]) ** 2 + (r["y"] - c[1]) ** 2 for d, c in centre.items()}
        assert min(dist, key=dist.__getitem__) == r["dataset"]


def test_subset_layers_and_seeded_reproducibility(planted, tmp_path):
    cfg = AnalyzeConfig(only=("imbalance", "correlation"), layers=(2, 0), batch_size=4, seed=3)
    s1 = analyze(planted, tmp_path / "a", config=cfg)
    s2 = analyze(planted, tmp_path / "b", config=cfg)
    assert set(s1) >= {"imbalance", "correlation"} and "classify" not in s1
    assert not (tmp_path / "a" / "classify_accuracy.parquet").exists()
    imb = pl.read_parquet(tmp_path / "a" / "imbalance.parquet")
    assert sorted(imb["layer"].unique().to_list()) == [0, 2]
    assert pl.read_parquet(tmp_path / "a" / "batch_imbalance.parquet").equals(
        pl.read_parquet(tmp_path / "b" / "batch_imbalance.parquet")
    )
    assert s1["imbalance"] == s2["imbalance"]


def test_counts_table_is_opt_in(planted, tmp_path):
    analyze(planted, tmp_path / "c", config=AnalyzeConfig(only=("counts",)))
    df = pl.read_parquet(tmp_path / "c" / "counts.parquet")
    assert df["count"].sum() == 80 * (30 + 20) * 3 * 2  # requests * tokens * layers * top-k, nothing unrouted


def test_cli_errors_are_clean(planted, tmp_path):
    res = runner.invoke(app, ["analyze", str(planted), "-o", str(tmp_path / "x"), "--only", "imbalance,clusters"])
    assert res.exit_code == 2 and "clusters" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["analyze", str(planted), "-o", str(tmp_path / "x"), "--layers", "0,a"])
    assert res.exit_code == 2 and "--layers" in res.output
    res = runner.invoke(app, ["analyze", str(planted), "-o", str(tmp_path / "x"), "--layers", "7"])
    assert res.exit_code == 2 and "0..2" in res.output
    res = runner.invoke(app, ["analyze", str(tmp_path / "nope"), "-o", str(tmp_path / "x")])
    assert res.exit_code == 2 and "no such trace directory" in res.output
    ok = runner.invoke(app, ["analyze", str(planted), "-o", str(tmp_path / "y"), "--only", "imbalance"])
    assert ok.exit_code == 0
    again = runner.invoke(app, ["analyze", str(planted), "-o", str(tmp_path / "y"), "--only", "imbalance"])
    assert again.exit_code == 2 and "--overwrite" in again.output
    assert (
        runner.invoke(
            app, ["analyze", str(planted), "-o", str(tmp_path / "y"), "--only", "imbalance", "--overwrite"]
        ).exit_code
        == 0
    )
    with pytest.raises(ConfigError):
        AnalyzeConfig(batch_size=0)


def test_analyze_a_trace_from_the_tiny_model_collector(tmp_path):
    trace = tmp_path / "tiny"
    res = runner.invoke(
        app,
        [
            "collect",
            "--model",
            "olmoe-1b-7b-tiny",
            "--max-new-tokens",
            "6",
            "--dataset",
            "math-word,code",
            "--per-dataset",
            "6",
            "-o",
            str(trace),
        ],
    )
    assert res.exit_code == 0, res.output
    out = tmp_path / "res"
    res = runner.invoke(
        app,
        [
            "analyze",
            str(trace),
            "-o",
            str(out),
            "--batch-size",
            "4",
            "--only",
            "imbalance,correlation,classify,affinity",
        ],
    )
    assert res.exit_code == 0, res.output
    imb = pl.read_parquet(out / "imbalance.parquet")
    assert imb["layer"].n_unique() == 16 and set(imb["dataset"]) == {"all", "code", "math-word"}
    # IF is bounded by E/k: at most every token on the same k experts
    assert imb["imbalance_factor"].drop_nans().is_between(1.0, 64 / 8).all()
    # decode tokens: 5 routed per request (the 6th is never forwarded) x 12 requests
    assert imb.filter((pl.col("dataset") == "all") & (pl.col("stage") == "decode"))["tokens"].unique().to_list() == [60]
    acc = pl.read_parquet(out / "classify_accuracy.parquet")
    assert acc.height == 16 and (acc["chance"] == 0.5).all()


def test_summary_prints_undefined_scores_as_na():
    """Regression: a one-dataset trace printed `silhouette nan`; an undefined score reads n/a."""
    from moetrace.analysis.run import format_summary

    text = format_summary(
        {
            "embedding": {"prefill": {"silhouette": float("nan"), "adjusted_rand": 0.25}},
            "classify": {"skipped": "needs at least 2 datasets"},
        }
    )
    assert "silhouette n/a, K-means ARI 0.250" in text and "nan" not in text


def test_max_requests_analyses_a_stratified_sample_and_says_so(tmp_path):
    """Memory bounded at any trace size (issue #27): beyond --max-requests, a seeded sample stratified by
    dataset is counted and analysed, recorded in the summary and printed; below it nothing changes."""
    from moetrace.analysis.run import request_sample
    from moetrace.tracer.trace.reader import open_trace

    planted = tmp_path / "t"
    res = runner.invoke(app, ["synth", "--model", "olmoe-1b-7b-tiny", "--datasets", "gsm8k,mbpp,xsum",
                              "--requests", "360", "-o", str(planted), "-q"])  # fmt: skip
    assert res.exit_code == 0, res.output
    datasets = open_trace(planted).request_arrays.dataset_R
    R = len(datasets)
    assert (
        request_sample(datasets, max_requests=R, seed=0) is None
        and request_sample(datasets, max_requests=0, seed=0) is None
    )
    rows = request_sample(datasets, max_requests=R // 2, seed=0)
    assert rows is not None and (np.diff(rows) > 0).all() and len(rows) <= R
    assert set(np.asarray(datasets)[rows]) == set(np.asarray(datasets))  # every dataset kept
    out = tmp_path / "r"
    res = runner.invoke(app, ["analyze", str(planted), "-o", str(out), "--only", "imbalance",
                              "--max-requests", str(R // 2)])  # fmt: skip
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_requests"] == len(rows) < R
    assert summary["request_sample"] == {"num_trace_requests": R, "num_analysed": len(rows), "max_requests": R // 2}
    assert f"a sample of {len(rows):,} of the trace's {R:,} requests" in res.output
