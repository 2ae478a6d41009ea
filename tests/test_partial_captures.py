"""Partial and real captures (issue #26): one MoE layer of four recorded, decode-only imports, tiny traces.

`analyze` gives numbers for the recorded layers (never n/a from NaN layers entering a mean), says how
many layers were empty, never names expert 0 as the hottest of an empty layer, and records every
skipped analysis with its reason; `info` separates recorded from unrecorded tokens.
"""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest
from factories import (
    PARTIAL_E,
    PARTIAL_K,
    PARTIAL_L,
    PARTIAL_RECORDED,
    partial_trace,
)
from typer.testing import CliRunner

from moetrace.analysis.run import AnalyzeConfig, analyze, format_summary
from moetrace.cli import app
from moetrace.stats import mean_skip_nan
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.summary import recorded_tokens

runner = CliRunner()
L, RECORDED, E, K = PARTIAL_L, PARTIAL_RECORDED, PARTIAL_E, PARTIAL_K


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    return partial_trace(tmp_path_factory.mktemp("partial") / "t")


@pytest.fixture(scope="module")
def one_layer_results(one_layer, tmp_path_factory):
    out = tmp_path_factory.mktemp("partial_res") / "r"
    cfg = AnalyzeConfig(batch_size=8, embedding_methods=("tsne",))
    return analyze(one_layer, out, config=cfg), out


def test_mean_skip_nan_leaves_nan_out_and_counts_it():
    assert mean_skip_nan(np.array([np.nan, 2.0, np.nan, 4.0])) == (3.0, 2)
    mean, num_nan = mean_skip_nan(np.full(3, np.nan))
    assert math.isnan(mean) and num_nan == 3


def test_analyze_on_one_recorded_layer_gives_numbers_not_na(one_layer_results):
    summary, out = one_layer_results
    assert summary["layers"] == {"num_layers": L, "empty": {"prefill": [0, 1, 3], "decode": [0, 1, 3]}}
    imb = pl.read_parquet(out / "imbalance.parquet")
    for ds in ("all", "ds0", "ds1"):
        for stage in ("prefill", "decode"):
            only = imb.filter((pl.col("dataset") == ds) & (pl.col("stage") == stage) & (pl.col("layer") == RECORDED))
            # the mean over layers is the one recorded layer's IF, not NaN
            assert summary["imbalance"]["mean_if"][ds][stage] == pytest.approx(only["imbalance_factor"][0])
    for stage in ("prefill", "decode"):
        assert summary["imbalance"]["batch_if"]["all"][stage] > 1.0
    cor = summary["correlation"]
    assert all(cor[k] is not None for k in ("prefill_decode_pooled", "prefill_decode_per_request", "recall"))
    assert all(v is not None for v in cor["prefill_decode_pooled_by_dataset"].values())
    assert summary["classify"]["mean_accuracy"] > 0.9  # the recorded layer separates the datasets
    assert (summary["classify"]["num_layers"], summary["classify"]["num_empty_layers"]) == (1, 3)
    assert pl.read_parquet(out / "classify_accuracy.parquet")["layer"].to_list() == [RECORDED]
    assert set(summary["embedding"]) == {"prefill", "decode"}
    text = format_summary(summary)
    assert "n/a" not in text.split("cross-layer")[0]
    assert "prefill: 3 of 4 MoE layers have no recorded routing" in text


def test_empty_layers_have_nan_if_and_no_hottest_expert(one_layer_results):
    _, out = one_layer_results
    imb = pl.read_parquet(out / "imbalance.parquet")
    empty = imb.filter(pl.col("layer") != RECORDED)
    assert empty["imbalance_factor"].is_nan().all() and empty["hottest_expert"].is_null().all()
    assert (empty["tokens"] == 0).all()
    rec = imb.filter(pl.col("layer") == RECORDED)
    assert rec["hottest_expert"].is_not_null().all() and (rec["tokens"] > 0).all()
    # ds1's hot experts are 5..7: the hottest is one of them, never expert 0 by default
    assert set(rec.filter(pl.col("dataset") == "ds1")["hottest_expert"].to_list()) <= {5, 6, 7}


def test_skipped_parts_are_recorded_in_manifest_summary_and_text(one_layer_results):
    summary, out = one_layer_results
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["skipped"]) == {"cross_layer_affinity"}
    assert "two consecutive MoE layers" in manifest["skipped"]["cross_layer_affinity"]
    assert json.loads((out / "summary.json").read_text())["skipped"] == manifest["skipped"]
    assert "cross_layer_affinity: skipped (needs tokens routed at two consecutive" in format_summary(summary)
    assert (out / "coactivation.parquet").is_file()  # co-activation within the one layer still ran


def test_embedding_with_fewer_than_5_requests_is_recorded_as_skipped(tmp_path):
    t = partial_trace(tmp_path / "t", recorded_layers=tuple(range(L)), requests_per_dataset=2)
    summary = analyze(t, tmp_path / "r", config=AnalyzeConfig(only=("embedding",), embedding_methods=("tsne",)))
    skipped = json.loads((tmp_path / "r" / "manifest.json").read_text())["skipped"]
    assert "needs at least 5 requests with recorded prefill routing, the trace has 4" in skipped["embedding"]
    assert "decode" in skipped["embedding"]
    assert "embedding: skipped (" in format_summary(summary)
    assert not (tmp_path / "r" / "embedding.parquet").exists()


def test_embedding_of_one_stage_skipped_is_a_recorded_part(tmp_path):
    # an embedding of an empty layer: neither stage has a request with routing there
    t = partial_trace(tmp_path / "t")
    cfg = AnalyzeConfig(only=("embedding",), embedding_methods=("tsne",), embedding_layer=0)
    analyze(t, tmp_path / "r", config=cfg)
    skipped = json.loads((tmp_path / "r" / "manifest.json").read_text())["skipped"]
    assert "at MoE layer 0" in skipped["embedding"] and "--embedding-layer" in skipped["embedding"]


def test_decode_only_import_counts_prompt_rows_as_unrecorded(tmp_path):
    t = partial_trace(tmp_path / "t", recorded_layers=tuple(range(L)), decode_only=True)
    rec = recorded_tokens(open_trace(t))
    assert rec.datasets == ("ds0", "ds1")
    assert rec.recorded_DS[:, 0].tolist() == [0, 0]  # no prompt position holds routing
    assert rec.unrecorded_DS[:, 0].tolist() == [20 * 12, 20 * 12]
    assert rec.recorded_DS[:, 1].tolist() == [20 * 8, 20 * 8]
    res = runner.invoke(app, ["info", str(t)])
    assert res.exit_code == 0, res.output
    total = next(line for line in res.output.splitlines() if line.startswith("total")).split()
    assert total[1:] == ["40", "0", "480", "320", "0"]
    assert "recorded at" not in res.output  # every layer holds routing


def test_info_names_the_recorded_layers_of_a_partial_capture(one_layer):
    res = runner.invoke(app, ["info", str(one_layer)])
    assert res.exit_code == 0, res.output
    assert "routing recorded at 1 of them (MoE-layer ordinals [2])" in res.output


def test_cli_analyze_on_a_partial_capture_prints_numbers(one_layer, tmp_path):
    res = runner.invoke(
        app, ["analyze", str(one_layer), "-o", str(tmp_path / "r"), "--only", "imbalance", "--batch-size", "8"]
    )
    assert res.exit_code == 0, res.output
    mean_all = next(line for line in res.output.splitlines() if line.strip().startswith("all"))
    assert "n/a" not in mean_all
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    mean_if = summary["imbalance"]["mean_if"]["all"]
    assert mean_all.split()[1:] == [f"{mean_if['decode']:.3f}", f"{mean_if['prefill']:.3f}"]
    assert "3 of 4 MoE layers have no recorded routing" in res.output


def test_cli_analyze_of_layers_without_routing_is_one_clean_message(one_layer, tmp_path):
    res = runner.invoke(app, ["analyze", str(one_layer), "-o", str(tmp_path / "r"), "--layers", "0,1"])
    assert res.exit_code != 0
    assert "no recorded routing at the analysed MoE layers [0, 1]" in res.output
    assert "moetrace info" in res.output and "Traceback" not in res.output


def test_dashboard_headline_and_notes_of_a_partial_capture(one_layer_results):
    from moetrace.dashboards.inputs import detect
    from moetrace.dashboards.results import Results
    from moetrace.dashboards.summary import analysis_skipped_notes, imbalance_headline

    summary, out = one_layer_results
    res = Results.from_input(detect(out))
    h = imbalance_headline(res)
    assert h is not None
    assert h.value == f"{summary['imbalance']['mean_if']['all']['prefill']:.2f}×"  # prefill first
    assert "mean over 1 MoE layers (3 of 4 without recorded routing)" in h.label
    assert "nan" not in h.detail.lower() and f"worst layer {RECORDED}:" in h.detail
    notes = analysis_skipped_notes(res)
    assert len(notes) == 1 and notes[0].startswith("cross_layer_affinity (") and "two consecutive" in notes[0]
