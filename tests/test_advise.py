"""``moetrace advise``: the measures against hand-computed cases, migration, the sweep's slot limit,
single-stage inputs, profiles (counts only) and the command line."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
from factories import ADVISE_MODEL, zipf_trace
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import TraceFormatError
from moetrace.placement.advise import (
    AdviseConfig,
    StepTokens,
    advise_arrays,
    advise_profile_counts,
    advise_trace,
    evaluate_tokens,
    read_advice,
    write_advice,
)
from moetrace.placement.advise.current import read_current
from moetrace.placement.advise.inputs import trace_inputs
from moetrace.placement.advise.metrics import (
    balancedness,
    expected_traffic,
    migration,
    rank_load_from_ranks,
    redundancy_sweep,
    send_ranks_per_token,
    vllm_balancedness,
)
from moetrace.placement.baselines import linear
from moetrace.placement.cost import DEFAULT_LINKS, ExpertCompute
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.eplb import rebalance
from moetrace.placement.exports import PlacementFile, export_placement, load_placement, save_placement
from moetrace.placement.hardware import CostModel, hardware_of_links
from moetrace.placement.maps import placement_from_phy2log
from moetrace.placement.simulate import simulate_volume

L, E, K = 2, 16, 2
MODEL = ADVISE_MODEL  # L MoE layers of E experts, top-K
DEP = parse_deployment("DP2TP2EP4", num_gpus_per_node=2)  # 4 EP ranks on 2 nodes of 2 GPUs


# ---------------------------------------------------------------- measures, by hand
def test_balancedness_is_mean_over_max_per_layer_and_vllms_ratio_of_sums():
    assert balancedness(np.array([[2.0, 2.0, 4.0, 0.0]])).tolist() == [0.5]
    assert balancedness(np.array([[3.0, 3.0, 3.0]])).tolist() == [1.0]
    assert np.isnan(balancedness(np.zeros((1, 4))))[0]  # no tokens: undefined, not 0 or 1
    # one step, two layers: loads [1, 1] and [3, 1]: sum of means 1 + 2 = 3, sum of maxima 1 + 3 = 4
    assert vllm_balancedness(np.array([[[1.0, 1.0], [3.0, 1.0]]])).tolist() == [0.75]


def test_send_ranks_per_token_counts_distinct_ranks_own_included_invalid_left_out():
    rank = np.array([[0, 0, 1], [2, 3, 2], [1, 1, 1], [3, 0, 2]])
    valid = np.array([[True, True, True], [True, True, True], [True, True, True], [False, False, True]])
    assert send_ranks_per_token(rank, valid).tolist() == [2, 2, 1, 1]
    assert send_ranks_per_token(rank, np.zeros_like(valid)).tolist() == [0, 0, 0, 0]
    srt = np.sort(np.where(valid, rank, 99), axis=1)
    assert send_ranks_per_token(srt, srt < 99, presorted=True).tolist() == [2, 2, 1, 1]


def test_rank_load_counts_pairs_per_rank_and_step():
    rank = np.array([[0, 1], [1, 1], [3, 0]])
    valid = np.array([[True, True], [True, True], [True, False]])
    load = rank_load_from_ranks(rank, valid, np.array([0, 0, 1]), num_batches=2, num_ranks=4)
    assert load.tolist() == [[1, 3, 0, 0], [0, 0, 0, 1]]


def test_expected_traffic_of_a_profile_by_hand():
    """Two GPUs on two nodes, loads 4 and 2, sources spread evenly: each GPU sends half of the other's
    pairs across and receives half of its own from the other."""
    t = expected_traffic(np.array([[4.0, 2.0]]), ranks_per_node=1)
    assert t.send_inter.tolist() == [[1.0, 2.0]] and t.recv_inter.tolist() == [[2.0, 1.0]]
    assert t.send_intra.tolist() == [[0.0, 0.0]] and t.peers_send_inter.tolist() == [[1.0, 1.0]]
    t = expected_traffic(np.array([[4.0, 0.0, 2.0, 2.0]]), ranks_per_node=2)
    assert t.send_inter.sum() == pytest.approx(t.recv_inter.sum())
    assert t.recv_intra[0, 1] == 0 and t.peers_recv_intra[0, 1] == 0  # an idle GPU receives nothing


# ---------------------------------------------------------------- migration
def _brute_moved(cur_LP: np.ndarray, new_LP: np.ndarray, W: int, g: int) -> int:
    """Fewest moved experts over every rank permutation that maps nodes onto nodes (one layer)."""
    J = cur_LP.shape[1] // W
    best = None
    for perm in itertools.permutations(range(W)):
        if any(perm[b * g + j] // g != perm[b * g] // g for b in range(W // g) for j in range(g)):
            continue
        moved = 0
        for v in range(W):
            u = perm[v]
            cur, new = list(cur_LP[0, u * J : (u + 1) * J]), list(new_LP[0, v * J : (v + 1) * J])
            for e in new:
                if e in cur:
                    cur.remove(e)
                else:
                    moved += 1
        best = moved if best is None else min(best, moved)
    assert best is not None
    return best


def test_migration_is_zero_for_the_same_placement_up_to_relabelling():
    cur = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])
    assert migration(cur, cur, num_ranks=4, ranks_per_node=2, num_experts=8).experts_moved == 0
    swapped = np.array([[6, 7, 4, 5, 2, 3, 0, 1]])  # nodes swapped and ranks inside them
    m = migration(cur, swapped, num_ranks=4, ranks_per_node=2, num_experts=8)
    assert m.experts_moved == 0 and m.node_of_new_G.tolist() == [1, 0] and m.rank_of_new_LW.tolist() == [[3, 2, 1, 0]]


def test_migration_finds_the_known_best_permutation():
    cur = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])
    # new ranks {4,5} {6,0} | {2,3} {1,7}: on current node 1 ({4,5} {6,7}) the first node lacks 0 only; on
    # current node 0 ({0,1} {2,3}) the second lacks 7 only. Kept in place it would move 6.
    new = np.array([[4, 5, 6, 0, 2, 3, 1, 7]])
    m = migration(cur, new, num_ranks=4, ranks_per_node=2, num_experts=8)
    assert m.experts_moved == 2 == _brute_moved(cur, new, 4, 2)
    assert m.node_of_new_G.tolist() == [1, 0] and m.rank_of_new_LW.tolist() == [[2, 3, 1, 0]]


def test_migration_is_minimal_against_brute_force():
    rng = np.random.default_rng(3)
    for _ in range(40):
        cur = np.concatenate([rng.permutation(6), rng.integers(0, 6, 2)])[None]
        new = np.concatenate([rng.permutation(6), rng.integers(0, 6, 2)])[None]
        m = migration(cur, new, num_ranks=4, ranks_per_node=2, num_experts=6)
        assert m.experts_moved == _brute_moved(cur, new, 4, 2)


@settings(max_examples=60, deadline=None)
@given(
    L=st.integers(1, 3),
    W=st.sampled_from([1, 2, 4]),
    J=st.integers(1, 4),
    K=st.integers(1, 4),
    E=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_missing_copies_are_the_multiset_difference_of_every_rank_pair(L, W, J, K, E, seed):
    """migration's cost table: the experts of new rank v that current rank u lacks, each extra copy counted
    (a rank may hold an expert twice), for every (layer, u, v), as Counter subtraction counts them."""
    from collections import Counter

    from moetrace.placement.advise.metrics import _missing_LWW

    rng = np.random.default_rng(seed)
    cur, new = rng.integers(0, E, (L, W, J)), rng.integers(0, E, (L, W, K))
    got = _missing_LWW(cur, new, E)
    want = [
        [[sum((Counter(new[l, v]) - Counter(cur[l, u])).values()) for v in range(W)] for u in range(W)]
        for l in range(L)
    ]
    assert got.tolist() == want


# ---------------------------------------------------------------- the sweep
@pytest.mark.parametrize(("E_", "W", "S"), [(256, 64, 6), (16, 4, 4), (16, 4, 7), (60, 8, 9), (8, 8, 1), (10, 4, 3)])
def test_the_sweep_never_exceeds_the_slot_limit(E_, W, S):
    sweep = redundancy_sweep(num_experts=E_, num_ranks=W, max_slots_per_gpu=S)
    for r in sweep:
        assert (E_ + r) % W == 0 and (E_ + r) // W <= S and 0 <= r < E_
    assert sweep == sorted(sweep) and all(b - a == W for a, b in itertools.pairwise(sweep))
    nxt = (sweep[-1] + W) if sweep else (-E_) % W
    assert nxt >= E_ or (E_ + nxt) // W > S  # nothing deployable left out
    assert redundancy_sweep(num_experts=256, num_ranks=64, max_slots_per_gpu=6) == [0, 64, 128]


# ---------------------------------------------------------------- evaluation = the simulator's
@pytest.mark.parametrize("dedup", ["expert", "rank", "node"])
def test_one_pass_evaluation_counts_like_simulate_volume(dedup):
    """Bytes and activated experts as the simulator counts them (the step time of both is one
    function: tests/test_step_model.py prices every caller at once)."""
    rng = np.random.default_rng(1)
    T, B, W = 400, 8, DEP.num_ep
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T * L)]).reshape(T, L, K).astype(np.int16)
    ids[5, 0, 1] = -1
    step, src = rng.integers(0, B, T), rng.integers(0, W, T)
    load = rng.gamma(0.5, size=(L, E)) + 0.01
    placement = rebalance(load, num_replicas=E + 4, num_groups=1, num_nodes=2, num_gpus=W)
    cost = CostModel(expert=ExpertCompute(hidden_size=64, ffn_size=32))
    em = evaluate_tokens(
        StepTokens(ids, step, src, B),
        placement,
        deployment=DEP,
        dedup=dedup,
        cost=cost,
        bytes_per_token=128,
        hidden_size=64,
    )
    sv = simulate_volume(
        ids,
        placement=placement,
        batch_T=step,
        src_rank_T=src,
        num_batches=B,
        num_ranks=W,
        ranks_per_node=2,
        bytes_per_token=128,
        dedup=dedup,
        cost=cost,
    )
    np.testing.assert_allclose(em.inter_bytes_BL, sv["dispatch_inter_bytes"] + sv["combine_inter_bytes"])
    np.testing.assert_allclose(em.active_max_BL, sv["activated_experts_per_rank_max"])
    assert ((em.send_ranks_L >= 1) & (em.send_ranks_L <= K)).all()


# ---------------------------------------------------------------- --current
def test_current_maps_read_back_from_every_engine_format(tmp_path):
    rng = np.random.default_rng(0)
    phy = np.stack([np.concatenate([rng.permutation(E), rng.permutation(E)[:4]]) for _ in range(L)])
    placement = placement_from_phy2log(phy, num_experts=E)
    pf = PlacementFile(model=MODEL, deployment=DEP, strategy="eplb", placement=placement)
    save_placement(pf, tmp_path / "p.json")
    got, fmt = read_current(tmp_path / "p.json", model=MODEL, num_ranks=4)
    assert fmt == "moetrace" and np.array_equal(got.phy2log, phy)
    for fmt in ("sglang", "vllm", "vllm-ascend"):
        (tmp_path / fmt).write_text(export_placement(pf, fmt=fmt))
        got, name = read_current(tmp_path / fmt, model=MODEL, num_ranks=4)
        assert name == fmt and np.array_equal(got.phy2log, phy), fmt
    (tmp_path / "bad").write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2]] * 5}))
    with pytest.raises(TraceFormatError, match="5 rows"):
        read_current(tmp_path / "bad", model=MODEL, num_ranks=4)
    (tmp_path / "odd").write_text(json.dumps([list(range(E)) + [0]]))
    with pytest.raises(TraceFormatError, match="do not divide evenly"):
        read_current(tmp_path / "odd", model=MODEL, num_ranks=4)


CFG = AdviseConfig(
    deployment=DEP, num_steps=20, decode_tokens_per_gpu=2, prefill_tokens_per_gpu=16, max_slots_per_gpu=6
)


def test_trace_advice_stays_within_the_slot_limit_and_writes_its_files(tmp_path):
    adv = advise_trace(zipf_trace(tmp_path / "t"), CFG)
    assert adv.manifest.stages == ("prefill", "decode", "both")
    assert adv.manifest.redundancy_sweep == (0, 4, 8)  # 16 + R over 4 ranks within 6 slots per GPU
    for r in adv.rows:
        assert (E + r.num_redundant) / DEP.num_ep <= 6
        if r.option == adv.manifest.reference:
            assert r.experts_moved == 0 and r.a2a_vs_ref == pytest.approx(1.0, abs=0.05)
        assert np.isnan(r.moe_vs_ref) and r.bytes_moved is None  # not a preset: expert size unknown, never guessed
        assert r.measure == "a2a" and r.vs_ref("a2a") == r.a2a_vs_ref
    strategies = {r.strategy for r in adv.rows}
    assert strategies == {"linear", "round_robin", "eplb", "joint"}
    assert [v.stage for v in adv.manifest.verdicts[:3]] == ["prefill", "decode", "both"]
    assert any("correlate" in v for v in adv.verdicts)
    files = write_advice(adv, tmp_path / "out", deployment=DEP)
    written = read_advice(tmp_path / "out")  # format and version checked, read into its record
    for rec in written.recommended:  # every recommended placement is a valid placement file with its commands
        assert load_placement(tmp_path / "out" / rec.placement).strategy in ("eplb", "joint")
        cmds = next(c for c in written.commands if c.option == rec.option and c.stage == rec.stage)
        assert set(cmds.export) >= {"sglang", "trtllm", "vllm", "vllm-ascend"}
    assert files[-1].name == "advice.json"
    # the record advise returns is the file's, once the commands and the recorded paths are in
    assert written.recommended == adv.manifest.recommended and len(written.commands) == len(written.recommended)
    assert written == dataclasses.replace(
        adv.manifest, input=written.input, trace=written.trace, commands=written.commands
    )
    assert written.input == "../t" and written.hardware == CFG.hardware and written.rearrangement == CFG.rearrangement


def test_options_evaluated_while_joint_is_fitted_are_the_sequential_advice(tmp_path, monkeypatch):
    """advise_trace evaluates the options that need no grouped fit while joint is fitted: its rows and
    manifest are those of the inputs read whole and then evaluated, and the early path was taken."""
    from moetrace.placement.advise import inputs as advise_inputs
    from moetrace.placement.advise import run as advise_run

    t = zipf_trace(tmp_path / "t")
    sequential = advise_arrays(trace_inputs(t, CFG), CFG)
    early: list[int] = []
    real = advise_inputs.trace_inputs

    def spy(*args, on_ungrouped=None, **kw):
        def seen(ungrouped):
            early.append(len(ungrouped.extra))
            on_ungrouped(ungrouped)

        return real(*args, on_ungrouped=seen, **kw)

    monkeypatch.setattr(advise_run, "trace_inputs", spy)
    adv = advise_trace(t, CFG)
    assert early == [0]  # called once, before the grouped strategies were fitted
    # repr: the rows hold NaN where a measure is unknown (NaN != NaN), and floats in full
    assert repr(adv.rows) == repr(sequential.rows) and repr(adv.manifest) == repr(sequential.manifest)
    assert "joint" in {r.strategy for r in adv.rows}


def test_eplb_advised_for_decode_is_what_place_writes(tmp_path):
    """The decode EPLB placement advise evaluates is the one `moetrace place --strategy eplb` writes."""
    from moetrace.placement.compare import CompareConfig, load_trace_data, make_placement

    t = zipf_trace(tmp_path / "t")
    adv = advise_trace(t, CFG)
    data = load_trace_data(t, test_fraction=0.2, seed=0, held_out_tokens=False)
    ps = make_placement(data, CompareConfig(deployment=DEP, strategies=("eplb",), num_redundant=4), "eplb")
    opt = adv.options["decode-eplb-4"]  # every option evaluated, recommended or not (here none is)
    assert opt.placement.phy2log.shape == ps.placement.phy2log.shape
    assert np.array_equal(opt.placement.phy2log, ps.placement.phy2log)


@pytest.mark.parametrize(("stages", "lacks"), [(("decode",), "prefill"), (("prefill",), "decode")])
def test_single_stage_traces_advise_on_what_they_have_and_say_what_they_lack(tmp_path, stages, lacks):
    adv = advise_trace(zipf_trace(tmp_path / "t", stages=stages), CFG)
    assert adv.manifest.stages == stages
    assert {r.stage for r in adv.rows} == set(stages) and "joint" not in {r.strategy for r in adv.rows}
    assert adv.verdicts[0].startswith(stages[0].capitalize())
    assert any(f"no advice on {lacks} steps" in v and "correlation" in v for v in adv.verdicts)


def test_current_is_the_reference_and_migration_is_counted_from_it(tmp_path):
    t = zipf_trace(tmp_path / "t")
    pf = PlacementFile(
        model=MODEL,
        deployment=DEP,
        strategy="linear",
        placement=linear(num_layers=L, num_experts=E, num_slots=E, num_ranks=4),
    )
    save_placement(pf, tmp_path / "cur.json")
    (tmp_path / "cur.sglang.json").write_text(export_placement(pf, fmt="sglang"))
    adv = advise_trace(t, CFG, current=tmp_path / "cur.sglang.json")
    assert adv.manifest.reference == "current" and adv.manifest.current_format == "sglang"
    cur = {r.stage: r for r in adv.rows if r.option == "current"}
    lin = {r.stage: r for r in adv.rows if r.option == "linear"}
    assert all(cur[s].experts_moved == 0 == lin[s].experts_moved for s in cur)  # current is linear


# ---------------------------------------------------------------- profiles (counts only)
def _profile(skew: float, *, N=12, scale=4000, seed=0):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1) ** skew
    p = p / p.sum()
    return rng.multinomial(scale * K, p, size=(N, L)).astype(np.int64)


#: DeepSeek-V3's width: bandwidth, not the per-message latency, decides the all-to-all time
WIDE = dataclasses.replace(MODEL, hidden_size=7168)


def test_profile_advice_is_counts_only_and_says_so():
    adv = advise_profile_counts(WIDE, {"decode": _profile(1.5)}, CFG, source="mem")
    assert adv.manifest.input_kind == "profile" and adv.manifest.stages == ("decode",)
    assert all(np.isnan(r.send_ranks_per_token) for r in adv.rows)
    assert any("n/a" in v and "destination ranks" in v for v in adv.verdicts)
    assert adv.manifest.verdicts[0].verdict == "enable"


def test_a_balanced_profile_gets_no_gain_with_its_reason():
    adv = advise_profile_counts(WIDE, {"decode": _profile(0.0), "prefill": _profile(0.0, seed=1)}, CFG, source="mem")
    first = adv.manifest.verdicts[0]
    assert first.verdict == "no gain" and "already balanced" in first.text


def test_a_load_that_moves_every_window_is_named_as_such():
    """The load slides from one set of hot experts to another over the windows: a placement fitted on
    the first half cannot follow, one refitted on the window before can: rebalance periodically."""
    a, b = _profile(3.0, N=16), _profile(3.0, N=16, seed=1)[:, :, ::-1]  # the hot experts at the other end
    mix = np.linspace(0.0, 1.0, 16)[:, None, None]
    w = np.round((1 - mix) * a + mix * b).astype(np.int64)
    adv = advise_profile_counts(WIDE, {"decode": w}, CFG, source="mem")
    d = adv.manifest.drift["decode"]
    assert d.figure("lagged") > d.figure("static") + 0.05 and d.figure("own") >= d.figure("lagged") - 0.01
    assert "rebalance periodically" in adv.manifest.verdicts[0].text


def test_a_load_drawn_anew_every_window_cannot_be_followed():
    """Links-bound steps (no fixed cost per collective, as the hand-set machine has), so the sweep's
    best point uses redundant slots and the drift check has something to follow."""
    rng = np.random.default_rng(0)
    w = np.stack([_profile(3.0, N=1, seed=i)[0][:, rng.permutation(E)] for i in range(16)])
    cfg = dataclasses.replace(CFG, hardware=hardware_of_links(DEFAULT_LINKS))
    adv = advise_profile_counts(WIDE, {"decode": w}, cfg, source="mem")
    first = adv.manifest.verdicts[0]
    assert first.verdict == "no gain" and "faster than any placement can follow" in first.text


# ---------------------------------------------------------------- the command
def test_cli_writes_the_advice_and_prints_verdicts(tmp_path):
    t = zipf_trace(tmp_path / "t")
    res = CliRunner().invoke(
        app,
        [
            "advise",
            str(t),
            "--config",
            "DP2TP2EP4",
            "--gpus-per-node",
            "2",
            "--steps",
            "20",
            "-q",
            "-o",
            str(tmp_path / "a"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "a" / "advice.json").is_file() and (tmp_path / "a" / "options.parquet").is_file()
    for line in ("Prefill:", "Decode:", "Both stages with one placement:", "Prefill and decode loads correlate"):
        assert line in res.output
    again = CliRunner().invoke(
        app, ["advise", str(t), "--config", "DP2TP2EP4", "--gpus-per-node", "2", "-o", str(tmp_path / "a")]
    )
    assert again.exit_code == 2 and "--overwrite" in again.output and "Traceback" not in again.output


def test_the_dashboard_shows_the_advice_first(tmp_path):
    from moetrace.dashboards.report import write_dashboard

    t = zipf_trace(tmp_path / "t")
    write_advice(advise_trace(t, CFG), tmp_path / "a", deployment=DEP)
    rep = write_dashboard([t, tmp_path / "a"], out=tmp_path / "r.html")
    assert rep.sections[0] == "advice" and "overview" in rep.sections
    html = (tmp_path / "r.html").read_text()
    assert "Decode: " in html and "advice-balancedness-decode" in html and "advice-balancedness-prefill" in html
