"""The load profile: format round trip, reduction from a trace, and the commands that read one."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
from factories import SMALL, write_small_trace
from typer.testing import CliRunner

from moetrace.analysis.counts import count_trace
from moetrace.cli import app
from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.compare import CompareConfig, load_trace_data, make_placement, run_compare
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.profile_batches import draw_tokens, load_profile_data, profile_strategies
from moetrace.tracer.trace.profile import (
    HEADER_KEY,
    LoadProfile,
    Window,
    is_profile,
    open_profile,
    profile_from_trace,
    write_profile,
)
from moetrace.tracer.trace.reader import open_trace

runner = CliRunner()


@pytest.fixture
def trace(tmp_path):
    return write_small_trace(tmp_path / "trace", num_requests=12)


def test_profile_of_a_trace_holds_its_counts_and_round_trips(trace, tmp_path):
    prof = profile_from_trace(trace)
    counts = count_trace(open_trace(trace))
    for stage in ("prefill", "decode"):
        assert np.array_equal(prof.total(stage), counts.stage(stage).sum(0))
        for d in ("a", "b"):
            assert prof.datasets is not None
            assert np.array_equal(prof.datasets[stage][d], counts.stage(stage)[counts.dataset_R == d].sum(0))
    write_profile(prof, tmp_path / "p.parquet", overwrite=False)
    assert is_profile(tmp_path / "p.parquet") and not is_profile(trace)
    assert open_profile(tmp_path / "p.parquet") == prof


def test_windows_split_the_rows_in_order_and_add_up(trace, tmp_path):
    whole = profile_from_trace(trace)
    prof = profile_from_trace(trace, window_tokens=10)
    rows = open_trace(trace).num_tokens()
    assert prof.num_windows == -(-rows // 10) and prof.window_tokens == Window(unit="tokens", size=10)
    for s in prof.stages:
        assert np.array_equal(prof.counts[s].sum(0), whole.total(s))
    # the first window: the first 10 rows of the trace
    first = next(open_trace(trace).iter_token_arrays(batch_tokens=10))
    ids = first.topk_ids_TLK[first.is_decode_T]
    want = np.zeros((SMALL.num_moe_layers, SMALL.num_experts), np.int64)
    for l in range(SMALL.num_moe_layers):
        np.add.at(want[l], ids[:, l][ids[:, l] >= 0], 1)
    assert np.array_equal(prof.counts["decode"][0], want)
    write_profile(prof, tmp_path / "w.parquet", overwrite=False)
    assert open_profile(tmp_path / "w.parquet") == prof


def test_writes_refuse_to_clobber_and_reads_refuse_other_versions(trace, tmp_path):
    prof = profile_from_trace(trace)
    out = tmp_path / "p.parquet"
    write_profile(prof, out, overwrite=False)
    with pytest.raises(Exception, match="already exists"):
        write_profile(prof, out, overwrite=False)
    table = pq.read_table(out)
    header = json.loads(table.schema.metadata[HEADER_KEY])
    for key, value, msg in [
        ("version", 2, "version 2 is not supported"),
        ("format", "x", "expected 'moetrace.profile'"),
    ]:
        bad = tmp_path / f"bad-{key}.parquet"
        pq.write_table(table.replace_schema_metadata({HEADER_KEY: json.dumps({**header, key: value})}), bad)
        with pytest.raises(TraceFormatError, match=msg):
            open_profile(bad)
    short = tmp_path / "short.parquet"
    pq.write_table(table.slice(0, 3), short)
    with pytest.raises(TraceFormatError, match="rows, the header asks for"):
        open_profile(short)
    for not_one in (trace, tmp_path / "missing", trace / "manifest.json"):
        with pytest.raises(TraceFormatError):
            open_profile(not_one)


def test_inconsistent_profiles_are_refused():
    c = np.ones((1, SMALL.num_moe_layers, SMALL.num_experts), np.int64)
    with pytest.raises(TraceFormatError, match="add up"):
        LoadProfile(model=SMALL, counts={"decode": c}, datasets={"decode": {"a": c[0] * 2}})
    with pytest.raises(TraceFormatError, match="negative"):
        LoadProfile(model=SMALL, counts={"decode": -c})
    with pytest.raises(TraceFormatError, match="mixed"):
        LoadProfile(model=SMALL, counts={"decode": c, "mixed": c})
    with pytest.raises(TraceFormatError, match="shape"):
        LoadProfile(model=SMALL, counts={"decode": c[:, :, :3]})


def test_eplb_on_a_profile_places_as_on_the_trace(tmp_path):
    trace = write_small_trace(tmp_path / "t", num_requests=40, seed=3)
    write_profile(profile_from_trace(trace), tmp_path / "p.parquet", overwrite=False)
    cfg = CompareConfig(deployment=parse_deployment("DP4TP1EP4", num_gpus_per_node=2), strategies=("eplb",))
    on_trace = load_trace_data(trace, test_fraction=0.2, seed=0, held_out_tokens=False)
    on_trace = replace(on_trace, is_test_R=np.zeros_like(on_trace.is_test_R))  # every request trains
    on_profile = load_profile_data(tmp_path / "p.parquet", seed=0, num_tokens=256)
    for redundancy in (0, 4):
        c = replace(cfg, num_redundant=redundancy)
        a = make_placement(on_trace, c, "eplb").placement
        b = make_placement(on_profile, c, "eplb").placement
        assert np.array_equal(a.phy2log, b.phy2log)


def test_drawn_tokens_follow_the_loads():
    counts_LE = np.array([[100, 300, 0, 600], [0, 0, 0, 0]])  # K=2: inclusion 0.2, 0.6, 0, 1.2 -> capped
    ids = draw_tokens(counts_LE, num_tokens=20_000, top_k=2, seed=1)
    assert ids.shape == (20_000, 2, 2) and (ids[:, 1] == -1).all()
    assert (ids[:, 0, 0] != ids[:, 0, 1]).all()  # distinct experts per token
    share = np.bincount(ids[:, 0].ravel(), minlength=4) / 20_000
    assert share[2] == 0 and share[3] == 1.0  # capped at one per token, the rest spread
    assert share[1] / share[0] == pytest.approx(3.0, rel=0.1)
    assert np.array_equal(ids, draw_tokens(counts_LE, num_tokens=20_000, top_k=2, seed=1))


def test_grouped_strategies_are_refused_on_a_profile():
    assert profile_strategies(("linear", "eplb"), asked=True) == ("linear", "eplb")
    assert profile_strategies(("linear", "eplb", "data", "joint"), asked=False) == ("linear", "eplb")
    with pytest.raises(ConfigError, match="'data' groups requests.*choose from linear"):
        profile_strategies(("linear", "data"), asked=True)


def test_compare_on_a_profile_skips_the_bounds_and_says_where_tokens_come_from(tmp_path):
    trace = write_small_trace(tmp_path / "t", num_requests=20)
    write_profile(profile_from_trace(trace), tmp_path / "p.parquet", overwrite=False)
    data = load_profile_data(tmp_path / "p.parquet", seed=0, num_tokens=512)
    cfg = CompareConfig(
        deployment=parse_deployment("DP2TP1EP2", num_gpus_per_node=1), strategies=("linear", "eplb"), num_batches=10
    )
    res = run_compare(data, cfg)
    assert set(res.metrics) == {"linear", "eplb"}
    assert set(res.manifest.skipped) == {"perfect_routing", "oracle", "floor"}
    assert res.manifest.tokens_from is not None and "load profile" in res.manifest.tokens_from
    assert "tokens_from" in res.manifest.to_json()


def test_cli_profile_info_analyze_compare_place_export(tmp_path):
    trace = write_small_trace(tmp_path / "t", num_requests=20)
    prof = tmp_path / "p.parquet"
    r = runner.invoke(app, ["profile", str(trace), "-o", str(prof), "--window-tokens", "25", "-q"])
    assert r.exit_code == 0, r.output
    assert "load profile of small" in r.output
    r = runner.invoke(app, ["profile", str(trace), "-o", str(prof), "-q"])
    assert r.exit_code == 2 and "already exists" in r.output
    r = runner.invoke(app, ["info", str(prof)])
    assert r.exit_code == 0 and "load profile" in r.output and "decode" in r.output
    r = runner.invoke(app, ["analyze", str(prof), "-o", str(tmp_path / "an"), "-q"])
    assert r.exit_code == 0, r.output
    assert "embedding: skipped (needs per-request" in r.output and "median over windows" in r.output
    summary = json.loads((tmp_path / "an" / "summary.json").read_text())
    assert "batch_imbalance" in summary["skipped"] and summary["correlation"]["prefill_decode_pooled"] is not None
    assert (tmp_path / "an" / "window_imbalance.parquet").exists()
    common = ["--config", "DP2TP1EP2", "--gpus-per-node", "1", "--batches", "10", "-q"]
    r = runner.invoke(app, ["compare", str(prof), *common, "-o", str(tmp_path / "cmp")])
    assert r.exit_code == 0, r.output
    assert "a load profile (tokens drawn" in r.output and "data" not in r.output.split("\n")[5]
    assert "tokens_from" in json.loads((tmp_path / "cmp" / "compare.json").read_text())
    r = runner.invoke(app, ["compare", str(prof), *common, "--strategies", "linear,joint"])
    assert r.exit_code == 2 and "'joint' groups requests" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["place", str(prof), *common[:-3], "--strategy", "eplb", "-o", str(tmp_path / "pl.json")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["place", str(prof), *common[:-3], "-o", str(tmp_path / "pl2.json")])
    assert r.exit_code == 2 and "'ours' groups requests" in r.output
    for src, name in ((prof, "a.json"), (trace, "b.json")):
        r = runner.invoke(app, ["export", str(src), "-f", "sglang-logical-count", "-o", str(tmp_path / name), "-q"])
        assert r.exit_code == 0, r.output
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
