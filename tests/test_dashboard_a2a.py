"""The dashboard draws `moetrace a2a` results: measured vs predicted inter-node bytes per strategy and
collective time per layer, from a tiny real gloo replay (4 ranks, 2 emulated nodes of 2 GPUs)."""

from __future__ import annotations

import json

import polars as pl
import pytest
from browser.figjson import figures_from_html
from factories import planted_trace
from typer.testing import CliRunner

from moetrace import results as rf
from moetrace.cli import app
from moetrace.dashboards.inputs import detect
from moetrace.dashboards.report import write_dashboard


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash-a2a")
    trace = planted_trace(tmp / "planted", structured=True, num_requests=40)
    out = tmp / "a2a"
    r = CliRunner().invoke(app, ["a2a", str(trace), "--config", "DP2TP2EP4", "--gpus-per-node", "2", "--strategies",
                                 "linear,eplb", "--batches", "2", "--batch-requests", "8", "--hidden-size", "16",
                                 "--redundancy", "4", "--backend", "gloo", "-o", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    return trace, out


def test_dashboard_draws_a2a_results(runs, tmp_path):
    trace, a2a = runs
    assert detect(a2a).kind == "a2a"
    html_out = tmp_path / "r.html"
    r = CliRunner().invoke(app, ["dashboard", str(trace), str(a2a), "-o", str(html_out)])
    assert r.exit_code == 0, r.output
    assert "a2a" in r.output and "no measured all-to-all results" not in r.output
    text = html_out.read_text()
    assert "Measured all-to-all vs predictions" in text and "WARNING" not in text
    figs = figures_from_html(text)
    assert {"a2a-bytes", "a2a-time"} <= set(figs)
    assert all(figs[k]["source"] == str(a2a / rf.A2A_COLLECTIVES) for k in ("a2a-bytes", "a2a-time"))
    # bytes: measured and predicted bars per strategy, equal, normalized to linear
    measured, predicted = figs["a2a-bytes"]["data"]
    assert list(measured["x"]) == list(predicted["x"]) == ["linear (vLLM default)", "EPLB"]
    assert list(measured["y"]) == pytest.approx(list(predicted["y"]))
    assert measured["y"][0] == pytest.approx(1.0)
    df = pl.read_parquet(a2a / rf.A2A_COLLECTIVES)
    per_batch = df.filter(pl.col("strategy") == "eplb").group_by("batch").agg(pl.col("measured_inter_bytes").sum())
    assert measured["customdata"][1] == pytest.approx(float(per_batch["measured_inter_bytes"].median()))
    # time: a line per strategy and phase over the MoE layers
    lines = figs["a2a-time"]["data"]
    assert len(lines) == 4 and {t["line"]["dash"] for t in lines} == {"solid", "dot"}
    mode = json.loads((a2a / rf.A2A_MANIFEST).read_text())["network"]["mode"]  # as root: emulated nodes
    assert ("indicative only" in text) == (mode == "loopback") and ("shaped inter-node link" in text) == (
        mode == "emulated"
    )
    # the summary card: EPLB (the only strategy besides linear) measured / predicted, and the byte check

    (eplb,) = [r for r in json.loads((a2a / rf.A2A_MANIFEST).read_text())["summary"] if r["strategy"] == "eplb"]
    value = (
        f"{eplb['measured_inter_node_normalized_median']:.2f}× / {eplb['simulated_inter_node_normalized_median']:.2f}×"
    )
    assert f'<div class="headline" data-key="a2a" data-source="{a2a / rf.A2A_MANIFEST}">' in text
    assert f'<div class="h-value">{value}</div>' in text
    assert f"all {df.height:,} (collective, rank) pairs sent exactly the predicted bytes" in text


def test_a2a_mismatch_is_a_visible_warning(runs, tmp_path):
    _, a2a = runs
    bad = tmp_path / "bad"
    bad.mkdir()
    df = pl.read_parquet(a2a / rf.A2A_COLLECTIVES)
    df = df.with_columns(pl.when(pl.int_range(pl.len()) == 0).then(pl.col("measured_inter_bytes") + 2)
                         .otherwise(pl.col("measured_inter_bytes")).alias("measured_inter_bytes"))  # fmt: skip
    df.write_parquet(bad / rf.A2A_COLLECTIVES)
    (bad / rf.A2A_MANIFEST).write_bytes((a2a / rf.A2A_MANIFEST).read_bytes())
    rep = write_dashboard([bad], out=tmp_path / "r.html")
    assert "a2a" in rep.sections
    text = rep.path.read_text()
    assert "WARNING: measured all-to-all bytes differ" in text
    assert '<div class="headline warning" data-key="a2a"' in text  # the summary card warns too
    assert f"WARNING: 1 of {df.height:,} (collective, rank) pairs sent other bytes than predicted" in text
    ann = figures_from_html(text)["a2a-bytes"]["layout"].get("annotations", [])
    assert any("measured ≠ predicted in 1" in a.get("text", "") for a in ann)


def test_links_caption_reads_the_network_mode():
    """The time figure's caption says how the run's links were realized (a2a.json ``network.mode``),
    never "loopback" for a run on emulated, shaped links."""
    from moetrace.dashboards.section_a2a import links_caption
    from moetrace.placement.replay.network import Network

    emulated = links_caption(
        backend="gloo", device="cpu", network=Network(mode="emulated", link="1Gbit,50us", qdisc="netem")
    )
    assert "emulated, shaped inter-node link (1Gbit,50us, netem)" in emulated and "indicative only" not in emulated
    loop = links_caption(backend="gloo", device="cpu", network=Network(mode="loopback"))
    assert "every link local loopback" in loop and "emulated" not in loop
    assert "torchrun job" in links_caption(backend="nccl", device="cuda", network=Network(mode="torchrun"))


def test_a2a_json_reads_into_its_record_and_back_byte_for_byte(runs):
    """What `moetrace a2a` writes is what ``A2AManifest.from_json`` takes, and ``to_json`` gives it
    back: the same bytes once format and version lead (``write_result_json``)."""
    from moetrace.dashboards.records import A2AManifest

    _, a2a = runs
    text = (a2a / rf.A2A_MANIFEST).read_text()
    rec = A2AManifest.from_json(json.loads(text), where="a2a.json")
    assert json.dumps({**rf.json_header(rf.A2A), **rec.to_json()}, indent=2) + "\n" == text
    assert rec.strategies == ("linear", "eplb") and [r.strategy for r in rec.summary] == ["linear", "eplb"]
    assert detect(a2a).a2a == rec  # the dashboard's inputs carry the same record
