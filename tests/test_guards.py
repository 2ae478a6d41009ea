"""Issue #26, items 3 and 4: commands refuse what cannot work before reading a trace, say what they
leave out, and stay quiet when asked (exit code, one clean message, no traceback)."""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import replace

import numpy as np
import pytest
from factories import SMALL, write_small_trace
from typer.testing import CliRunner

from moetrace import results as rf
from moetrace.cli import app
from moetrace.cli.common import third_party_bars
from moetrace.errors import ConfigError
from moetrace.placement import compare as compare_mod
from moetrace.placement import replay as ar
from moetrace.placement.compare import CompareConfig, load_trace_data
from moetrace.placement.compare_manifest import read_compare_manifest
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.replay import capacity as replay_capacity
from moetrace.placement.replay import run as replay_run
from moetrace.tracer.trace.writer import TraceWriter

DEP = ["--config", "DP2TP2EP4", "--gpus-per-node", "2"]
SMALL_RUN = ["--batches", "2", "--batch-requests", "4", "--strategies", "linear,eplb"]


def _one_clean_error(r, needle: str) -> None:
    """Exit code 2, one ``Error:`` line naming ``needle``, no traceback."""
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and needle in errors[0], r.output
    assert "Traceback" not in r.output


@pytest.fixture
def no_trace_read(monkeypatch):
    """Fail the test if a command starts the counting pass (the checks must come before it)."""

    def refuse(*_a, **_k):
        raise AssertionError("the trace was read before the data-free checks")

    monkeypatch.setattr(compare_mod, "load_trace_data", refuse)


# ---- --redundancy and slots: refused before the trace is read ----------------------------------------
@pytest.mark.parametrize("cmd", ["compare", "place", "a2a"])
def test_redundancy_of_e_or_more_is_refused_before_reading(small_trace, tmp_path, no_trace_read, cmd):
    out = ["-o", str(tmp_path / "out.json" if cmd == "place" else tmp_path / "out")]
    r = CliRunner().invoke(app, [cmd, str(small_trace), *DEP, "--redundancy", "16", *out])
    _one_clean_error(r, "--redundancy 16")
    assert "fewer than 16" in r.output  # E = 16: what would be accepted


def test_slots_that_do_not_divide_are_refused_before_reading(small_trace, no_trace_read):
    r = CliRunner().invoke(app, ["compare", str(small_trace), *DEP, "--redundancy", "1"])
    _one_clean_error(r, "do not divide over EP4 ranks")


def test_check_slots_accepts_below_e_and_refuses_e():
    dep = parse_deployment("DP2TP2EP4", num_gpus_per_node=2)
    assert dep.check_slots(num_experts=16, num_redundant=12) == 28
    with pytest.raises(ConfigError, match="--redundancy 16: a redundant slot"):
        dep.check_slots(num_experts=16, num_redundant=16)


# ---- compare: what it leaves out and why -------------------------------------------------------------
def _decode_only_trace(path):
    rng = np.random.default_rng(0)
    m = SMALL
    with TraceWriter(path, model=m, backend={"name": "import"}, collection={"stages": ["decode"]}) as w:
        for r in range(8):
            P, O = 3, 3
            ex = rng.integers(0, m.num_experts, size=(P + O, m.num_moe_layers * m.top_k)).astype(np.int16)
            ex[:, 1::2] = (ex[:, ::2] + 1) % m.num_experts  # top-2 distinct
            ex[:P] = -1  # prefill not recorded
            w.add_request(request_id=r, dataset="a", prompt_tokens=P, topk_ids_TX=ex)
    return path


def test_compare_on_decode_only_trace_records_and_says_why_the_bounds_are_missing(tmp_path):
    trace = _decode_only_trace(tmp_path / "t")
    out = tmp_path / "res"
    r = CliRunner().invoke(app, ["compare", str(trace), *DEP, *SMALL_RUN, "-o", str(out)])
    assert r.exit_code == 0, r.output
    notes = [ln for ln in r.output.splitlines() if ln.startswith("note: no ")]
    assert [n.split(":")[1].strip() for n in notes] == ["no perfect_routing row", "no oracle row"]
    assert all("decode routing only" in n for n in notes)
    man = read_compare_manifest(out / rf.COMPARE_MANIFEST)
    assert man.bounds == () and set(man.skipped) == {"perfect_routing", "oracle"}
    assert "decode routing only" in json.loads((out / rf.COMPARE_MANIFEST).read_text())["skipped"]["oracle"]


def test_compare_json_without_skipped_reads_as_nothing_skipped(small_trace, tmp_path):
    out = tmp_path / "res"
    r = CliRunner().invoke(app, ["compare", str(small_trace), *DEP, *SMALL_RUN, "-o", str(out)])
    assert r.exit_code == 0, r.output
    body = json.loads((out / rf.COMPARE_MANIFEST).read_text())
    assert "skipped" not in body  # nothing skipped: the key is left out, as older files lack it
    assert read_compare_manifest(out / rf.COMPARE_MANIFEST).skipped == {}


def test_compare_skips_the_floor_with_redundancy_and_says_so(small_trace):
    data = load_trace_data(small_trace, test_fraction=0.2, seed=0)
    cfg = CompareConfig(
        deployment=parse_deployment("DP2TP2EP4", num_gpus_per_node=2),
        strategies=("linear",),
        num_redundant=4,
        num_batches=2,
        num_batch_requests=4,
    )
    res = compare_mod.run_compare(data, cfg)
    assert res.manifest.expert_copy_floor is None and "--redundancy 4" in res.manifest.skipped["floor"]


def test_compare_warns_on_few_held_out_requests_and_random_weights(tmp_path):
    trace = write_small_trace(tmp_path / "t", model=replace(SMALL, source="moetrace:small-tiny"))
    r = CliRunner().invoke(app, ["compare", str(trace), *DEP, *SMALL_RUN])
    assert r.exit_code == 0, r.output
    assert "warning: 1 held-out request(s) (fewer than 20)" in r.output
    assert "caution: small has seeded random weights (moetrace:small-tiny)" in r.output


def test_compare_has_no_caution_for_real_weights_and_enough_requests(tmp_path):
    trace = write_small_trace(tmp_path / "t", num_requests=100)
    r = CliRunner().invoke(app, ["compare", str(trace), *DEP, *SMALL_RUN])
    assert r.exit_code == 0, r.output
    assert "caution:" not in r.output and "held-out request(s)" not in r.output


# ---- a2a: the machine's capacity, progress -----------------------------------------------------------
def test_local_capacity_counts_cores_and_memory():
    fits = dict(num_cpus=2, mem_available_bytes=64 << 30)
    assert ar.local_capacity_problem(8, **fits) is None
    assert "64 local ranks on 2 CPU core(s)" in ar.local_capacity_problem(64, **fits)
    why = ar.local_capacity_problem(8, num_cpus=16, mem_available_bytes=2 << 30)
    assert why is not None and "8 local ranks need about" in why
    assert ar.local_capacity_problem(8, num_cpus=16, mem_available_bytes=None) is None  # memory unknown
    assert ar.local_capacity_problem(4, num_cpus=1, mem_available_bytes=8 << 30, extra_bytes_per_rank=4 << 30)


def test_a2a_refuses_more_ranks_than_the_machine_before_reading(small_trace, tmp_path, monkeypatch, no_trace_read):
    monkeypatch.setattr(replay_capacity, "machine_capacity", lambda: (2, 24 << 30))
    args = ["a2a", str(small_trace), "--config", "DP8TP8EP64", "-o", str(tmp_path / "a2a")]
    r = CliRunner().invoke(app, args)
    _one_clean_error(r, "64 local ranks on 2 CPU core(s)")
    assert "--force" in r.output


def test_a2a_force_starts_anyway_with_a_warning(small_trace, tmp_path, monkeypatch):
    monkeypatch.setattr(replay_capacity, "machine_capacity", lambda: (1, 256 << 20))  # EP4: memory for none of them

    def stop(*_a, **kw):
        assert kw["progress"] is not None
        raise ConfigError("stopped where the ranks would start")

    monkeypatch.setattr(replay_run, "run_a2a", stop)
    args = ["a2a", str(small_trace), *DEP, "--batches", "2", "--batch-requests", "4", "-o", str(tmp_path / "a2a")]
    r = CliRunner().invoke(app, args)
    _one_clean_error(r, "local ranks need about")  # refused without --force
    r = CliRunner().invoke(app, [*args, "--force"])
    _one_clean_error(r, "stopped where the ranks would start")
    assert "warning: 4 local ranks need about" in r.output and "(--force)" in r.output


def test_a2a_reports_progress_as_rank_0_finishes_batches(tmp_path):
    trace = write_small_trace(tmp_path / "t", num_requests=8)
    cfg = CompareConfig(
        deployment=parse_deployment("DP1TP2EP2", num_gpus_per_node=2),
        strategies=("linear",),
        num_batches=3,
        num_batch_requests=4,
    )
    plan = ar.build_plan(load_trace_data(trace, test_fraction=0.5, seed=0), cfg=cfg, hidden_size=8, backend="gloo")
    seen: list[tuple[int, int]] = []
    records, _ = ar.run_a2a(plan, emulate=False, progress=lambda d, t: seen.append((d, t)))
    assert records is not None and len(records) == 2
    assert seen and all(t == 3 for _, t in seen) and [d for d, _ in seen] == sorted({d for d, _ in seen})
    assert seen[-1][0] <= 3  # the last poll may come before rank 0's last write; never beyond the total


# ---- collect: third-party bars off under -q or off a terminal ----------------------------------------
def test_third_party_bars_silenced_for_the_block_and_restored(monkeypatch):
    import huggingface_hub.utils as hub

    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")  # the module (`hub.tqdm` is the class)

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    # huggingface_hub reads the variable once, at its import: an earlier quiet run in this process may
    # have imported it with the variable set; start from "not set" as a fresh process would
    monkeypatch.setattr(hub_tqdm, "HF_HUB_DISABLE_PROGRESS_BARS", None)
    hub.enable_progress_bars()
    with third_party_bars(True):
        assert "TQDM_DISABLE" not in os.environ and not hub.are_progress_bars_disabled()
    with third_party_bars(False):
        assert os.environ["TQDM_DISABLE"] == "1" and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
        assert hub.are_progress_bars_disabled()
    assert "TQDM_DISABLE" not in os.environ and not hub.are_progress_bars_disabled()


def test_hf_loading_follows_the_quiet_environment(monkeypatch):
    import transformers

    from moetrace.tracer.backends.hf import _progress_bars_as_environment

    log = transformers.utils.logging
    log.enable_progress_bar()
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with _progress_bars_as_environment(transformers):
        assert not log.is_progress_bar_enabled()
    assert log.is_progress_bar_enabled()
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS")
    with _progress_bars_as_environment(transformers):
        assert log.is_progress_bar_enabled()


@pytest.mark.parametrize("quiet", [True, False])
def test_collect_off_a_terminal_or_quiet_runs_with_third_party_bars_off(tmp_path, monkeypatch, quiet):
    import moetrace.tracer.sharding as sharding

    seen = {}

    def fake(*_a, **_k):
        seen["env"] = os.environ.get("TQDM_DISABLE"), os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
        raise ConfigError("stopped before loading")

    monkeypatch.setattr(sharding, "run_collection", fake)
    args = ["collect", "--model", "deepseek-v3-tiny", "--dataset", "bundled", "-o", str(tmp_path / "t")]
    r = CliRunner().invoke(app, [*args, *(["-q"] if quiet else [])])  # CliRunner's stderr is no terminal
    _one_clean_error(r, "stopped before loading")
    assert seen["env"] == ("1", "1")
