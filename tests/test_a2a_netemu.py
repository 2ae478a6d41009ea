"""Emulated nodes for the all-to-all replay: --link parsing; without namespaces a stated loopback run;
as root, real namespaces, always removed, and a replay across them (the shaped link's effect:
test_a2a_link.py); TPd > 1 is replayed per EP rank."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from typer.testing import CliRunner

from moetrace import results as rf
from moetrace.cli import app
from moetrace.environ import environ
from moetrace.errors import ConfigError
from moetrace.placement import netemu
from moetrace.placement import replay as ar
from moetrace.placement.compare import CompareConfig, load_trace_data
from moetrace.placement.deployment import parse_deployment

CAN_EMULATE, WHY_NOT = netemu.probe()
needs_netns = pytest.mark.skipif(not CAN_EMULATE, reason=f"network namespaces cannot be made here: {WHY_NOT}")


def _namespaces() -> set[str]:
    out = subprocess.run([netemu._tool("ip"), "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


# ---- parsing and the fallback, everywhere -------------------------------------------------------------
def test_parse_link():
    link = netemu.parse_link("1Gbit,50us")
    assert (link.rate_bit, link.latency_s, link.tc_rate, link.tc_delay) == (
        10**9,
        pytest.approx(50e-6),
        "1000000000bit",
        "50us",
    )
    assert netemu.parse_link("200mbit").latency_s == 0.0
    assert netemu.parse_link("1.5Gbit,2ms").rate_bit == 1_500_000_000
    for bad, says in (
        ("fast", "is not RATE[,LATENCY]"),
        ("1GB,1ms", "is not RATE[,LATENCY]"),
        ("1Gbit,soon", "latency 'soon' is not a number with a unit"),
        ("100bit", "at least 8kbit"),
        ("1Gbit,1ms,2", "is not RATE[,LATENCY]"),
    ):
        with pytest.raises(ConfigError, match=f"--link {bad!r}.*{says}" if "RATE" not in says else "not RATE"):
            netemu.parse_link(bad)


def test_probe_can_be_forced_off(monkeypatch):
    monkeypatch.setenv(netemu.NO_NETNS_ENV, "1")
    assert netemu.probe() == (False, f"{netemu.NO_NETNS_ENV} is set")


def test_emulate_required_but_impossible_is_one_line(replay_trace, monkeypatch):
    """--emulate-nodes where namespaces cannot be made stops before starting any rank."""
    monkeypatch.setenv(netemu.NO_NETNS_ENV, "1")
    cfg = CompareConfig(
        deployment=parse_deployment("DP2TP2EP4", num_gpus_per_node=2), strategies=("linear",), num_batches=1
    )
    plan = ar.build_plan(load_trace_data(replay_trace, test_fraction=cfg.test_fraction, seed=0), cfg=cfg, hidden_size=4)
    with pytest.raises(
        ConfigError,
        match=r"^--emulate-nodes: network namespaces cannot be made here \(MOETRACE_NO_NETNS "
        r"is set\); run as root, or use --no-emulate-nodes$",
    ):
        ar.run_a2a(plan, emulate=True)


def test_without_namespaces_says_so_and_still_measures_bytes_tpd2(replay_trace, tmp_path, monkeypatch):
    """Forced off (as without root): one note that inter-node time is not emulated, bytes still exact.
    The deployment has TP2 after EP: replayed as one process per EP rank, with a note."""
    monkeypatch.setenv(netemu.NO_NETNS_ENV, "1")
    out = tmp_path / "a2a"
    r = CliRunner().invoke(
        app,
        [
            "a2a",
            str(replay_trace),
            "--config",
            "DP4TP2EP4TP2",
            "--gpus-per-node",
            "4",
            "--strategies",
            "linear,data",
            "--batches",
            "2",
            "--batch-requests",
            "8",
            "--hidden-size",
            "8",
            "--backend",
            "gloo",
            "-o",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    notes = [x for x in r.output.splitlines() if x.startswith("note:")]
    assert (
        "note: inter-node time is not emulated (MOETRACE_NO_NETNS is set): all links are loopback; bytes are measured "
        "exactly" in notes
    )
    assert any("TP2 after EP is replayed as one process per EP rank" in x for x in notes)
    assert "links: all local to this machine" in r.output and "measured bytes equal the simulator's" in r.output
    m = json.loads((out / rf.A2A_MANIFEST).read_text())
    assert m["network"]["mode"] == "loopback" and m["world_size"] == 4 and m["num_nodes"] == 2 and m["bytes_match"]


def test_bad_link_fails_before_any_work(replay_trace, tmp_path):
    r = CliRunner().invoke(
        app,
        [
            "a2a",
            str(replay_trace),
            "--config",
            "DP2TP2EP4",
            "--gpus-per-node",
            "2",
            "--link",
            "fast",
            "-o",
            str(tmp_path / "x"),
        ],
    )
    assert r.exit_code == 2 and "--link 'fast' is not RATE[,LATENCY]" in r.output


# ---- as root: real namespaces ------------------------------------------------------------------------
@needs_netns
def test_namespaces_are_unique_and_always_removed():
    link = netemu.parse_link("100Mbit")
    before = _namespaces()
    with netemu.emulated_nodes(2, link) as a, netemu.emulated_nodes(2, link) as b:  # two concurrent runs
        made = _namespaces() - before
        assert set(a.namespaces) | {a.hub} | set(b.namespaces) | {b.hub} == made and len(made) == 6
        assert a.addrs == ("10.77.0.1", "10.77.0.2") and a.rank_env()["GLOO_SOCKET_IFNAME"] == netemu.NODE_IF
        qd = subprocess.run(
            [netemu._tool("tc"), "-n", a.namespaces[1], "qdisc", "show", "dev", netemu.NODE_IF],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert a.node_qdisc in qd and "rate 100Mbit" in qd
    assert _namespaces() == before
    with pytest.raises(RuntimeError, match="boom"), netemu.emulated_nodes(2, link):
        raise RuntimeError("boom")
    assert _namespaces() == before


@needs_netns
def test_replay_on_emulated_nodes_moves_exactly_the_predicted_bytes(replay_trace, capfd):
    cfg = CompareConfig(
        deployment=parse_deployment("DP2TP2EP4", num_gpus_per_node=2),
        strategies=("linear", "data"),
        num_batches=2,
        num_batch_requests=8,
        num_redundant=4,
    )
    plan = ar.build_plan(
        load_trace_data(replay_trace, test_fraction=cfg.test_fraction, seed=0), cfg=cfg, hidden_size=64, backend="gloo"
    )
    notes: list[str] = []
    records, net = ar.run_a2a(plan, emulate=None, link="500Mbit", log=notes.append)  # auto: root can, so it does
    assert net.mode == "emulated" and net.link == "500Mbit" and net.qdisc in ("netem", "tbf")
    assert ar.first_mismatch(plan, records) is None
    sent_out_G = np.asarray(net.link_bytes_G2)[:, 0]
    inter_bytes = 2 * plan.sim_inter_VBL.sum()  # dispatch + combine over every strategy, batch and layer
    assert sent_out_G.sum() >= inter_bytes  # the payload crossed the shaped links (plus TCP/gloo headers)
    assert all(n.startswith("note:") for n in notes)
    assert "links: a network namespace per node, inter-node links shaped to 500Mbit" in ar.format_summary(
        plan, records, net
    )
    cost = ar.replay_cost(plan, records, net)  # the cost model as this run realised it
    assert cost.links.inter.bytes_per_s * netemu.WIRE_BYTES_PER_PAYLOAD_BYTE == pytest.approx(500e6 / 8)
    assert cost.fixed_seconds > 0 and cost.links.intra.bytes_per_s > 0
    rows = ar.summary_rows(plan, records, net)
    assert rows[0].predicted_time_normalized_median == 1.0
    assert rows[1].predicted_over_measured is not None and rows[1].predicted_over_measured > 0
    # the ranks start with c10d's log at ERROR: no per-connection "cannot resolve the hostname" noise
    assert "hostname of the client socket" not in capfd.readouterr().err


def test_rank_processes_start_with_quiet_c10d_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    assert netemu.EmulatedNodes.spawn_env() == {"TORCH_CPP_LOG_LEVEL": "ERROR"}
    with environ(netemu.EmulatedNodes.spawn_env()):  # what launch_local wraps the spawn in
        assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert "TORCH_CPP_LOG_LEVEL" not in os.environ  # restored
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    assert netemu.EmulatedNodes.spawn_env() == {"TORCH_CPP_LOG_LEVEL": "INFO"}
