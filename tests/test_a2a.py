"""The all-to-all replay: send matrices equal the simulator's bytes; real gloo collectives (4 ranks,
2 nodes of 2 GPUs, all links loopback here; tests/test_a2a_netemu.py covers emulated links) move
exactly those bytes; results files; mismatches are reported."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from moetrace import results as rf
from moetrace.cli import app
from moetrace.placement import replay as ar
from moetrace.placement.compare import CompareConfig, held_out_batches, load_trace_data, make_placement
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.maps import placement_from_phy2log
from moetrace.placement.replay import results as replay_results
from moetrace.placement.replay.sends import A2AMismatchError, check_against_simulator, rank_link_bytes, send_matrices
from moetrace.placement.simulate import simulate_volume

DEP = dict(config="DP2TP2EP4", gpus_per_node=2)
HIDDEN = 16


@pytest.fixture(scope="module")
def cfg():
    return CompareConfig(
        deployment=parse_deployment(DEP["config"], num_gpus_per_node=DEP["gpus_per_node"]),
        strategies=("linear", "eplb", "data"),
        num_batches=3,
        num_batch_requests=16,
        num_redundant=4,
    )


@pytest.fixture(scope="module")
def data(replay_trace, cfg):
    return load_trace_data(replay_trace, test_fraction=cfg.test_fraction, seed=cfg.seed)


@pytest.fixture(scope="module")
def plan(data, cfg):
    return ar.build_plan(data, cfg=cfg, hidden_size=HIDDEN, backend="gloo")


@pytest.fixture(scope="module")
def records(plan):
    records, network = ar.run_a2a(plan, emulate=False)
    assert network.mode == "loopback" and "not emulated" in network.note
    return records


@pytest.mark.parametrize("dedup", ["rank", "expert", "node"])
@pytest.mark.parametrize("policy", ["same_node", "even", "metro"])
def test_send_matrices_equal_simulator_bytes(data, cfg, dedup, policy):
    """Summed by link class, the matrices are the simulator's dispatch/combine bytes for every (batch, layer)."""
    dep = cfg.deployment
    for s in ("linear", "eplb", "data"):
        ps = make_placement(data, cfg, s)
        rows, batch, src, _ = held_out_batches(data, cfg, ps.group_of_test_R)
        kw = dict(
            placement=ps.placement,
            batch_T=batch,
            src_rank_T=src,
            num_batches=cfg.num_batches,
            num_ranks=dep.num_ep,
            ranks_per_node=dep.ranks_per_node,
            dedup=dedup,
            policy=policy,
        )
        ids = data.test_topk_ids_TLK[rows]
        sends = send_matrices(ids, **kw)
        assert sends.shape == (cfg.num_batches, 2, 4, 4) and sends.dtype == np.int64
        assert (np.diagonal(sends, axis1=2, axis2=3) == 0).all()  # nothing moves to the token's own GPU
        sim = simulate_volume(ids, bytes_per_token=32, **kw)
        check_against_simulator(sends, sim, ranks_per_node=dep.ranks_per_node, bytes_per_token=32)
        intra, inter = rank_link_bytes(sends, phase="dispatch", ranks_per_node=dep.ranks_per_node, bytes_per_token=32)
        np.testing.assert_array_equal(inter.sum(-1), sim["dispatch_inter_bytes"])
        np.testing.assert_array_equal((intra + inter).max(-1), sim["max_rank_dispatch_send_bytes"])
        c_intra, c_inter = rank_link_bytes(
            sends, phase="combine", ranks_per_node=dep.ranks_per_node, bytes_per_token=32
        )
        np.testing.assert_array_equal((c_intra + c_inter).max(-1), sim["max_rank_combine_send_bytes"])


def test_send_matrix_hand_example():
    """Two nodes of two ranks, one slot per expert per rank: a token on rank 0 routed to experts on ranks 0, 1, 3."""
    pl = placement_from_phy2log(np.array([[0, 1, 2, 3]]), num_experts=4)
    ids = np.array([[[0, 1]], [[1, 3]], [[3, 3]]])  # [T=3, L=1, K=2]; the last repeats an expert (dedup)
    kw = dict(
        placement=pl,
        batch_T=np.array([0, 0, 1]),
        src_rank_T=np.array([0, 0, 2]),
        num_batches=2,
        num_ranks=4,
        ranks_per_node=2,
    )
    s = send_matrices(ids, **kw)
    want = np.zeros((2, 1, 4, 4), dtype=np.int64)
    want[0, 0, 0, 1] = 2  # tokens 0 and 1 -> rank 1 (intra); expert 0 is local to token 0
    want[0, 0, 0, 3] = 1  # token 1 -> rank 3 (inter)
    want[1, 0, 2, 3] = 1  # token 2 -> rank 3 once (rank dedup), intra
    np.testing.assert_array_equal(s, want)
    assert send_matrices(ids, dedup="expert", **kw)[1, 0, 2, 3] == 1  # the same expert twice is still one copy


def test_check_against_simulator_names_the_mismatch(plan):
    sim = {
        f"{p}_{c}_bytes": np.zeros(plan.sim_inter_VBL.shape[1:])
        for p in ("dispatch", "combine")
        for c in ("intra", "inter")
    }
    with pytest.raises(
        A2AMismatchError, match=r"linear: send matrix gives \d+ dispatch intra-node bytes at batch 0, layer 0"
    ):
        check_against_simulator(
            plan.sends_VBLWW[0], sim, ranks_per_node=2, bytes_per_token=plan.bytes_per_token, label="linear"
        )


def test_gloo_collectives_move_exactly_the_predicted_bytes(plan, records):
    assert [r.rank for r in records] == [0, 1, 2, 3]
    assert ar.first_mismatch(plan, records) is None
    table = ar.result_table(plan, records)
    V, B, L = plan.sim_inter_VBL.shape
    assert table.height == V * B * L * 2 * 4
    assert (table["measured_inter_bytes"] == table["predicted_inter_bytes"]).all()
    assert (table["measured_intra_bytes"] == table["predicted_intra_bytes"]).all()
    assert (table["seconds"] > 0).all()
    # per (strategy, batch, layer), dispatch and combine each total the simulator's bytes
    for v, s in enumerate(plan.strategies):
        for phase in ("dispatch", "combine"):
            t = table.filter((table["strategy"] == s) & (table["phase"] == phase)).sort(["batch", "layer", "rank"])
            inter_BL = t["measured_inter_bytes"].to_numpy().reshape(B, L, 4).sum(-1)
            intra_BL = t["measured_intra_bytes"].to_numpy().reshape(B, L, 4).sum(-1)
            np.testing.assert_array_equal(inter_BL, plan.sim_inter_VBL[v])
            np.testing.assert_array_equal(intra_BL, plan.sim_intra_VBL[v])
    assert plan.sim_inter_VBL.sum() > 0 and plan.sim_intra_VBL.sum() > 0  # both link classes are exercised


def test_ranking_by_measured_bytes_equals_simulators(plan, records):
    rows = ar.summary_rows(plan, records)
    measured = [r.measured_inter_node_bytes_per_batch_median for r in rows]
    simulated = [r.simulated_inter_node_bytes_per_batch_median for r in rows]
    assert measured == simulated
    by_measured = [
        r.strategy for r in sorted(rows, key=lambda r: (r.measured_inter_node_normalized_median, r.strategy))
    ]
    by_simulated = [
        r.strategy for r in sorted(rows, key=lambda r: (r.simulated_inter_node_normalized_median, r.strategy))
    ]
    assert by_measured == by_simulated
    assert rows[0].strategy == "linear" and rows[0].measured_inter_node_normalized_median == 1.0
    data_row = next(r for r in rows if r.strategy == "data")
    assert data_row.measured_inter_node_normalized_median < 1.0  # the planted structure pays off on the wire


def test_results_files_carry_format_and_version(plan, records, tmp_path):
    files = ar.write_a2a_results(tmp_path / "out", plan, records, ar.Network(mode="loopback", note="n"))
    assert [f.name for f in files] == [rf.A2A_COLLECTIVES, rf.A2A_MANIFEST]
    kind, manifest = rf.read_result_manifest(tmp_path / "out")
    assert kind is rf.A2A and manifest["format"] == "moetrace.a2a" and manifest["version"] == 1
    assert manifest["network"] == {"mode": "loopback", "link": "", "qdisc": "", "note": "n", "link_bytes": []}
    assert all(r["layer_seconds_median"] > 0 for r in manifest["summary"])
    assert manifest["bytes_match"] is True and manifest["first_mismatch"] is None
    assert rf.read_table_format(tmp_path / "out" / rf.A2A_COLLECTIVES) == ("moetrace.a2a.collectives", 1)
    with pytest.raises(Exception, match="already holds a2a results"):
        rf.check_output(tmp_path / "out", rf.A2A, overwrite=False)


def test_mismatch_is_a_clean_error(plan, records, monkeypatch):
    real = replay_results._predicted

    def off_by_one(p):
        intra, inter = real(p)
        inter = inter.copy()
        inter[1, 0, 1, 0, 2] += 1  # eplb, batch 0, layer 1, dispatch, rank 2
        return intra, inter

    monkeypatch.setattr(replay_results, "_predicted", off_by_one)
    msg = ar.first_mismatch(plan, records)
    assert msg is not None and msg.startswith("eplb batch 0 layer 1 dispatch rank 2: measured")
    with pytest.raises(A2AMismatchError, match="eplb batch 0 layer 1 dispatch rank 2"):
        ar.raise_on_mismatch(plan, records)


def test_payload_errors_are_reported(plan, records):
    bad = list(records)
    bad[3] = dataclasses.replace(
        bad[3], payload_errors=("rank 3 linear batch 0 layer 0 dispatch: a received row does not carry ...",)
    )
    assert ar.first_mismatch(plan, bad).startswith("rank 3 linear batch 0 layer 0 dispatch")


def _fake_records(plan, *, fixed_s, intra_s):
    """Records as ``run_rank`` returns them, without ranks: the plan's bytes, made-up times, probes of
    ``fixed_s`` (empty) and ``intra_s`` (node-local)."""
    V, B, L, W, _ = plan.sends_VBLWW.shape
    rng = np.random.default_rng(0)
    bpt = plan.bytes_per_token
    recs = []
    for w in range(W):
        sent = np.stack([plan.sends_VBLWW[..., w, :], plan.sends_VBLWW[..., :, w]], axis=3) * bpt  # [V,B,L,2,W]
        recs.append(
            ar.RankRecord(
                rank=w,
                sent_VBL2W=sent,
                recv_VBL2W=sent,
                seconds_VBL2=0.01 + 0.01 * rng.random((V, B, L, 2)),
                probe_empty_seconds_BN=np.full((B, ar.PROBE_REPEATS), fixed_s),
                probe_intra_seconds_BN=np.full((B, ar.PROBE_REPEATS), intra_s),
                probe_intra_bytes=ar.PROBE_INTRA_BYTES,
                payload_errors=(),
                device="cpu",
                host="h",
            )
        )
    network = ar.Network(mode="emulated", link="8Mbit", qdisc="tbf")
    return recs, network


def test_predicted_time_ratios_follow_the_busiest_node_link(plan):
    """On emulated nodes each collective is predicted as the fixed cost plus the slower of its busiest
    node link direction (inter-node bytes of the node's ranks at the link's payload rate) and its busiest
    rank's loopback bytes; the summary's ratios to linear are those of the per-batch sums."""
    fixed, rate_intra = 2e-3, 1e9
    recs, network = _fake_records(plan, fixed_s=fixed, intra_s=fixed + ar.PROBE_INTRA_BYTES / rate_intra)
    cost = ar.replay_cost(plan, recs, network)
    rate_inter = 1e6 * 1448 / (1514 + 66 / 2)  # 8 Mbit/s of 1514-byte frames carrying 1448 bytes, half an ACK each
    assert cost.fixed_seconds == pytest.approx(fixed)
    assert cost.links.inter_nic == "node" and cost.links.inter.bytes_per_s == pytest.approx(rate_inter)
    assert cost.links.intra.bytes_per_s == pytest.approx(rate_intra)
    V, B, L, W, _ = plan.sends_VBLWW.shape
    bpt, g = plan.bytes_per_token, plan.ranks_per_node
    want = np.zeros((V, B))
    for v, b, l in np.ndindex(V, B, L):
        s = plan.sends_VBLWW[v, b, l] * bpt
        node = np.arange(W) // g
        out_G = [s[node == n][:, node != n].sum() for n in range(W // g)]
        in_G = [s[node != n][:, node == n].sum() for n in range(W // g)]
        local = s * (node[:, None] == node[None, :])
        t_inter = max(out_G + in_G) / rate_inter
        t_intra = max(local.sum(0).max(), local.sum(1).max()) / rate_intra
        want[v, b] += 2 * (fixed + max(t_inter, t_intra))  # dispatch + combine
    np.testing.assert_allclose(2 * ar.predicted_seconds_VBL(plan, cost).sum(2), want, rtol=1e-9)
    rows = ar.summary_rows(plan, recs, network)
    secs_VB = np.stack([r.seconds_VBL2 for r in recs], -1).max(-1).sum(axis=(2, 3))
    for v, r in enumerate(rows):
        pred = np.median(want[v]) / np.median(want[0])
        meas = np.median(secs_VB[v]) / np.median(secs_VB[0])
        assert r.predicted_time_normalized_median == pytest.approx(pred)
        assert r.measured_time_normalized_median == pytest.approx(meas)
        assert r.predicted_over_measured == pytest.approx(pred / meas)
        assert r.predicted_seconds_per_batch_median == pytest.approx(np.median(want[v]))
    data_row = rows[plan.strategies.index("data")]
    assert data_row.predicted_time_normalized_median is not None
    assert data_row.predicted_time_normalized_median < 1.0  # fewer inter-node bytes: less predicted time
    text = ar.format_summary(plan, recs, network)
    assert "cost model: inter 7.488 Mbit/s of payload per node" in text and "fixed 2.00 ms per collective" in text


@pytest.mark.parametrize("dedup", ["expert", "rank"])
def test_replay_traffic_is_the_cost_models(data, cfg, dedup):
    """The time model the replay charges is compare's: from the send matrices, the cost model's seconds equal
    ``simulate_volume``'s ``dispatch_seconds`` for the same links and copies."""
    from moetrace.placement.cost import Link, Links
    from moetrace.placement.hardware import CostModel, Hardware

    dep = cfg.deployment
    links = Links(
        intra=Link(bytes_per_s=2e9, latency_s=1e-6), inter=Link(bytes_per_s=1e8, latency_s=5e-6), inter_nic="node"
    )
    ps = make_placement(data, cfg, "data")
    rows, batch, src, _ = held_out_batches(data, cfg, ps.group_of_test_R)
    kw = dict(
        placement=ps.placement,
        batch_T=batch,
        src_rank_T=src,
        num_batches=cfg.num_batches,
        num_ranks=dep.num_ep,
        ranks_per_node=dep.ranks_per_node,
        dedup=dedup,
    )
    ids = data.test_topk_ids_TLK[rows]
    rc = ar.ReplayCost(
        links=links, fixed_seconds=2e-6, wire_overhead=1.0, intra_probe_seconds=None, intra_probe_bytes=0
    )
    hw = Hardware(name="replay", source="test", kernels={dedup: ar.replay_kernel(rc)})
    sim = simulate_volume(ids, bytes_per_token=64, cost=CostModel(hardware=hw), time_hidden_size=64, **kw)
    sends = send_matrices(ids, **kw)
    B, L, W, _ = sends.shape
    plan = SimpleNamespace(sends_VBLWW=sends[None], ranks_per_node=dep.ranks_per_node, bytes_per_token=64)
    np.testing.assert_allclose(ar.predicted_seconds_VBL(plan, rc)[0], sim["dispatch_seconds"], rtol=1e-12)
    assert sim["dispatch_seconds"].max() > 0


def test_a2a_json_is_its_typed_record_written_through_to_json(plan, tmp_path):
    """The writer builds ``A2AManifest`` (``replay.a2a_manifest``, its rows ``A2ASummaryRow``) and writes
    its ``to_json``: the file reads back into the same record and writes back the same bytes."""
    from moetrace.placement.a2a_manifest import A2AConfig, A2AManifest, A2ASummaryRow

    recs, network = _fake_records(plan, fixed_s=1e-3, intra_s=2e-3)
    out = tmp_path / "out"
    ar.write_a2a_results(out, plan, recs, network)
    text = (out / rf.A2A_MANIFEST).read_text()
    rec = A2AManifest.from_json(json.loads(text), where="a2a.json")
    assert rec == ar.a2a_manifest(plan, recs, network, out=out)
    assert json.dumps({**rf.json_header(rf.A2A), **rec.to_json()}, indent=2) + "\n" == text
    assert all(isinstance(r, A2ASummaryRow) for r in rec.summary) and rec.summary == tuple(
        ar.summary_rows(plan, recs, network)
    )
    assert rec.network == network and rec.cost_model is not None and rec.strategies == plan.strategies
    assert rec.bytes_match and rec.first_mismatch is None and rec.reference == "linear"
    # the plan's provenance is typed too: a2a.json's first keys, the trace recorded relative to the results
    assert isinstance(plan.config, A2AConfig) and rec.config == dataclasses.replace(plan.config, trace=rec.config.trace)
    assert list(rec.to_json())[: len(plan.config.to_json())] == list(plan.config.to_json())
    assert A2AConfig.from_json(plan.config.to_json(), where="config") == plan.config


def test_no_time_prediction_without_emulated_links(plan):
    """Loopback (or torchrun) links: the model's link classes mean nothing there; no predicted time, and the
    summary says why."""
    recs, _ = _fake_records(plan, fixed_s=1e-3, intra_s=2e-3)
    loop = ar.Network(mode="loopback", note="n")
    assert ar.replay_cost(plan, recs, loop) is None
    rows = ar.summary_rows(plan, recs, loop)
    assert all(r.predicted_time_normalized_median is None and r.predicted_over_measured is None for r in rows)
    assert rows[0].measured_time_normalized_median == 1.0
    assert "time prediction: none" in ar.format_summary(plan, recs, loop)


def test_cli_a2a_end_to_end(replay_trace, tmp_path, monkeypatch):
    out = tmp_path / "a2a"
    args = [
        "a2a",
        str(replay_trace),
        "--config",
        DEP["config"],
        "--gpus-per-node",
        str(DEP["gpus_per_node"]),
        "--strategies",
        "linear,eplb",
        "--batches",
        "2",
        "--batch-requests",
        "8",
        "--hidden-size",
        str(HIDDEN),
        "--redundancy",
        "4",
        "--backend",
        "gloo",
        "-o",
        str(out),
    ]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "measured bytes equal the simulator's" in r.output and "linear" in r.output
    assert json.loads((out / rf.A2A_MANIFEST).read_text())["strategies"] == ["linear", "eplb"]
    r = CliRunner().invoke(app, args)  # refused before any work
    assert r.exit_code == 2 and "--overwrite" in r.output
    # a forced mismatch exits non-zero naming it
    real = replay_results._predicted
    monkeypatch.setattr(replay_results, "_predicted", lambda p: (real(p)[0] + 1, real(p)[1]))
    r = CliRunner().invoke(app, [*args, "--overwrite"])
    assert (
        r.exit_code == 2
        and "measured all-to-all bytes differ from the simulator: linear batch 0 layer 0 dispatch rank 0" in r.output
    )


def test_cli_nccl_without_gpus_says_so(replay_trace, tmp_path):
    import torch

    if torch.cuda.device_count() >= 4:
        pytest.skip("this machine has a GPU per rank")
    r = CliRunner().invoke(
        app,
        [
            "a2a",
            str(replay_trace),
            "--config",
            DEP["config"],
            "--gpus-per-node",
            "2",
            "--backend",
            "nccl",
            "-o",
            str(tmp_path / "x"),
        ],
    )
    assert r.exit_code == 2 and "--backend nccl needs one GPU per rank: 4 ranks" in r.output


def test_torchrun_flag_without_torchrun_env(replay_trace, tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    r = CliRunner().invoke(
        app,
        [
            "a2a",
            str(replay_trace),
            "--config",
            DEP["config"],
            "--gpus-per-node",
            "2",
            "--backend",
            "gloo",
            "--torchrun",
            "--batches",
            "1",
            "--redundancy",
            "4",
            "-o",
            str(tmp_path / "x"),
        ],
    )
    assert r.exit_code == 2 and "RANK and WORLD_SIZE are not set" in r.output


def test_cli_a2a_from_placement_files(data, cfg, replay_trace, tmp_path):
    from moetrace.placement.compare import placement_file
    from moetrace.placement.exports import load_placement, save_placement
    from moetrace.placement.replay import placed_from_file

    files, made = [], {}
    for s in ("linear", "data", "joint"):
        made[s] = make_placement(data, cfg, s)
        save_placement(placement_file(data, cfg, made[s]), tmp_path / f"{s}.json")
        files += ["--placement", str(tmp_path / f"{s}.json")]
    for s in ("data", "joint"):  # a file routes held-out requests exactly as the placement run did
        got = placed_from_file(data, cfg, load_placement(tmp_path / f"{s}.json"), where=s)
        test = data.is_test_R
        np.testing.assert_array_equal(got.group_of_test_R[test], made[s].group_of_test_R[test])
    base = [
        "a2a",
        str(replay_trace),
        "--gpus-per-node",
        "2",
        "--batches",
        "2",
        "--batch-requests",
        "8",
        "--hidden-size",
        "8",
        "--backend",
        "gloo",
        *files,
    ]
    r = CliRunner().invoke(app, [*base, "--config", "DP2TP2EP4", "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "out" / rf.A2A_MANIFEST).read_text())
    assert m["strategies"] == ["linear", "data", "joint"] and m["bytes_match"] is True
    r = CliRunner().invoke(app, [*base, "--config", "DP4TP2EP8", "-o", str(tmp_path / "bad")])  # 4 nodes of 2: EP8
    assert r.exit_code == 2 and "placement for EP4" in r.output and "EP8" in r.output


@pytest.mark.parametrize("strategy", ["data", "joint"])
def test_a2a_refuses_a_router_for_another_number_of_nodes(data, cfg, strategy, tmp_path):
    """A routed placement's router sends requests to the nodes it was placed for; a deployment with
    other nodes (the same EP ranks on fewer, wider nodes) cannot serve it."""
    from dataclasses import replace

    from moetrace.errors import ConfigError
    from moetrace.placement.compare import placement_file
    from moetrace.placement.exports import load_placement, save_placement
    from moetrace.placement.replay import placed_from_file

    save_placement(placement_file(data, cfg, make_placement(data, cfg, strategy)), tmp_path / "p.json")
    pf = load_placement(tmp_path / "p.json")
    one_node = replace(cfg, deployment=parse_deployment(DEP["config"], num_gpus_per_node=4))
    with pytest.raises(
        ConfigError,
        match=rf"{pf.router.kind} router sends requests to 2 nodes; --config DP2TP2EP4 on "
        "nodes of 4 GPUs has 1",
    ):
        placed_from_file(data, one_node, pf, where="p.json")
