"""The one step model (placement/step_model.py): copy models, kernels and the step time against
hand-computed small cases, and every caller pricing the same traffic the same."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moetrace.placement.cost import ExpertCompute, Link, Links
from moetrace.placement.hardware import CostModel, Hardware
from moetrace.placement.step_model import (
    BF16,
    FP8_E4M3_BLOCK128,
    Kernel,
    Phase,
    copy_model,
    layer_seconds,
    phase_seconds_BW,
)

LINKS = Links(intra=Link(bytes_per_s=1e6, latency_s=1e-6), inter=Link(bytes_per_s=1e5, latency_s=1e-5))


def _traffic(rank_TK, src_T, dedup, *, W=4, g=2, batch_T=None):
    rank_TK = np.asarray(rank_TK, dtype=np.int64)
    T = rank_TK.shape[0]
    return copy_model(dedup).traffic(
        rank_TK=rank_TK,
        valid_TK=rank_TK >= 0,
        batch_T=np.zeros(T, dtype=np.int64) if batch_T is None else np.asarray(batch_T),
        src_rank_T=np.asarray(src_T, dtype=np.int64),
        num_batches=1 if batch_T is None else int(max(batch_T)) + 1,
        num_ranks=W,
        ranks_per_node=g,
    )


def test_expert_copies_hand_computed():
    # one token on GPU 0 (node 0) routed to GPUs 1 (node 0), 2 and 3 (node 1), 1000 bytes a copy
    t = _traffic([[1, 2, 3]], [0], "expert")
    assert t.send_intra[0].tolist() == [1, 0, 0, 0] and t.recv_intra[0].tolist() == [0, 1, 0, 0]
    assert t.send_inter[0].tolist() == [2, 0, 0, 0] and t.recv_inter[0].tolist() == [0, 0, 1, 1]
    assert t.peers_send_inter[0].tolist() == [2, 0, 0, 0]
    s = phase_seconds_BW(t, links=LINKS, bytes_per_copy=1000, ranks_per_node=2)
    # GPU 0: intra 1000/1e6 + 1e-6; inter 2000/1e5 + 2 * 1e-5; the classes overlap: the larger
    assert s[0, 0] == pytest.approx(2000 / 1e5 + 2e-5)
    assert s[0, 1] == pytest.approx(1000 / 1e6 + 1e-6)
    assert s[0, 2] == pytest.approx(1000 / 1e5 + 1e-5)
    assert s.max() == pytest.approx(0.02002)


def test_rank_dedup_sends_one_copy_per_gpu_and_nothing_to_itself():
    t = _traffic([[2, 2, 0, 3]], [0], "rank")
    assert t.send_inter[0].tolist() == [2, 0, 0, 0]  # GPU 2 once, GPU 3 once; GPU 0 is the token's own
    assert t.send_intra.sum() == 0


def test_node_dedup_lands_on_the_peer_gpu_and_forwards_over_nvlink():
    # token on GPU 1 (node 0, local index 1) routed to GPUs 2 and 3 (node 1) and 0 (own node)
    t = _traffic([[2, 3, 0]], [1], "node")
    assert t.send_inter[0].tolist() == [0, 1, 0, 0]  # one RDMA copy for node 1 ...
    assert t.recv_inter[0].tolist() == [0, 0, 0, 1]  # ... landing on GPU 3 (node 1, local index 1)
    assert t.send_intra[0].tolist() == [0, 1, 0, 1]  # 1 -> 0 on its own node; 3 forwards to 2
    assert t.recv_intra[0].tolist() == [1, 0, 1, 0]


def test_per_node_nic_adds_up_a_nodes_gpus():
    # GPUs 0 and 1 of node 0 each send one copy to node 1: per-GPU NICs carry one copy each, a node NIC two
    t = _traffic([[2], [3]], [0, 1], "expert")
    per_gpu = phase_seconds_BW(t, links=LINKS, bytes_per_copy=1000, ranks_per_node=2)
    node = Links(intra=LINKS.intra, inter=LINKS.inter, inter_nic="node")
    per_node = phase_seconds_BW(t, links=node, bytes_per_copy=1000, ranks_per_node=2)
    assert per_gpu.max() == pytest.approx(1000 / 1e5 + 1e-5)
    assert per_node.max() == pytest.approx(2000 / 1e5 + 2e-5)


def test_twice_the_tokens_on_one_node_costs_twice_on_its_links():
    even = _traffic([[2], [0]], [0, 2], "expert")  # one token from each node, to the other
    skew = _traffic([[2], [3], [0]], [0, 1, 2], "expert")  # node 0 sends two
    t_even = phase_seconds_BW(even, links=LINKS, bytes_per_copy=1e4, ranks_per_node=2)
    node = Links(intra=LINKS.intra, inter=LINKS.inter, inter_nic="node")
    t_skew = phase_seconds_BW(skew, links=node, bytes_per_copy=1e4, ranks_per_node=2)
    assert t_skew[0, :2].max() / t_even[0, :2].max() >= 1.9


def test_fp8_copies_carry_one_float_scale_per_128_values():
    assert FP8_E4M3_BLOCK128.bytes_per_token(7168) == 7168 + 56 * 4
    assert FP8_E4M3_BLOCK128.bytes_per_token(100) == 100 + 4  # a partial block still has a scale
    assert BF16.bytes_per_token(7168) == 14336


def _kernel(copies="expert", *, fixed_d=5e-6, fixed_c=7e-6, reduce=1e9):
    return Kernel(
        name="k",
        copies=copies,
        dispatch=Phase(value=FP8_E4M3_BLOCK128, links=LINKS, fixed_s=fixed_d),
        combine=Phase(value=BF16, links=LINKS, fixed_s=fixed_c),
        reduce_bytes_per_s=reduce,
    )


def test_layer_seconds_hand_computed():
    # one token on GPU 0 to GPUs 1 (same node), 2, 3 (node 1); hidden 128: fp8 copy 132 B, bf16 256 B
    t = _traffic([[1, 2, 3]], [0], "expert")
    s = layer_seconds(t, kernel=_kernel(), hidden_size=128, ranks_per_node=2)
    d = max(132 / 1e6 + 1e-6, 2 * 132 / 1e5 + 2 * 1e-5)  # GPU 0 sends: NVLink one copy, RDMA two
    assert s.dispatch[0] == pytest.approx(d + 5e-6)
    # combine: the three copies come back to GPU 0 (recv over both classes), then it reads them to reduce
    c = max(256 / 1e6 + 1e-6, 2 * 256 / 1e5 + 2 * 1e-5) + 3 * 256 / 1e9
    assert s.combine[0] == pytest.approx(c + 7e-6)
    assert math.isnan(s.expert[0]) and math.isnan(s.moe[0])  # no expert size: no partial sum posing as the whole


def test_expert_and_shared_terms_add_to_the_busiest_gpu():
    t = _traffic([[1, 2, 3]], [0], "expert")
    e = ExpertCompute(
        hidden_size=128, ffn_size=64, hbm_bytes_per_s=1e9, peak_flops=1e12, num_shared_experts=1, shared_ffn_size=64
    )
    pairs = np.array([[0.0, 1, 1, 1]])
    active = np.array([[0.0, 1, 1, 1]])
    tokens = np.array([[1.0, 0, 0, 0]])
    s = layer_seconds(
        t,
        kernel=_kernel(),
        hidden_size=128,
        ranks_per_node=2,
        expert=e,
        pairs_BW=pairs,
        active_BW=active,
        tokens_BW=tokens,
    )
    w = 3 * 128 * 64 * 2 / 1e9  # one expert's weights read
    assert s.expert[0] == pytest.approx(w)  # every busy GPU: one routed expert, or (GPU 0) one shared expert
    assert s.moe[0] == pytest.approx(s.dispatch[0] + w + s.combine[0])


def test_node_copies_time_the_forwarding_on_the_receiving_node():
    # token on GPU 1 to GPUs 2 and 3 (node 1): one RDMA copy to GPU 3, forwarded to GPU 2 over NVLink
    t = _traffic([[2, 3]], [1], "node")
    s = layer_seconds(
        t, kernel=_kernel("node", fixed_d=0, fixed_c=0, reduce=math.inf), hidden_size=128, ranks_per_node=2
    )
    assert s.dispatch[0] == pytest.approx(132 / 1e5 + 1e-5)  # the RDMA copy is the slower class
    per_expert = layer_seconds(
        _traffic([[2, 3]], [1], "expert"),
        kernel=_kernel(fixed_d=0, fixed_c=0, reduce=math.inf),
        hidden_size=128,
        ranks_per_node=2,
    )
    assert per_expert.dispatch[0] == pytest.approx(2 * 132 / 1e5 + 2e-5)  # two RDMA copies


def test_uniform_traffic_sends_k_copies_per_token_and_spreads_them():
    """The uniform routing calibrate prices measured rows on (``calibrate_traffic._traffic``), through a copy model."""
    from moetrace.placement.calibrate_traffic import _traffic

    t = _traffic(8, 8, 64, 64, 4, "expert", "uniform", 1, None)  # EP 8 on one node, 64 tokens a GPU, top-4 of 64
    sent = t.send_intra + t.send_inter
    B = sent.shape[0]
    assert sent.shape == (B, 8)
    # each token keeps the copies to its own GPU's experts (1/8 of them in expectation)
    assert sent.sum() == pytest.approx(B * 8 * 64 * 4 * 7 / 8, rel=0.05)
    assert t.send_inter.sum() == 0  # one node


def test_every_caller_prices_the_same_traffic_the_same(tmp_path):
    """compare (simulate_volume), advise on tokens, advise on counts and the a2a prediction: one
    step time for one traffic. Counts carry no token identity, so they are compared where the
    copies are per (token, expert) from sources spread evenly (a uniform routing of whole rows)."""
    from moetrace.placement.advise import StepTokens, evaluate_counts, evaluate_tokens
    from moetrace.placement.baselines import linear
    from moetrace.placement.deployment import parse_deployment
    from moetrace.placement.replay import ReplayCost, predicted_seconds_VBL
    from moetrace.placement.simulate import simulate_volume

    W, g, E, L = 4, 2, 8, 1
    # every GPU holds two tokens that send one copy to every GPU, itself included: sources spread
    # evenly, the case a profile's counts describe exactly
    src_T = np.repeat(np.arange(W), 2)
    rows = [
        [2 * w, 2 * ((w + 1) % W)] if i == 0 else [2 * ((w + 2) % W), 2 * ((w + 3) % W) + 1]
        for w in range(W)
        for i in (0, 1)
    ]
    ids = np.array(rows)[:, None, :]
    batch = np.zeros(len(src_T), dtype=np.int64)
    pl = linear(num_layers=L, num_experts=E, num_slots=E, num_ranks=W)
    hw = Hardware(
        name="t", source="test", kernels={"expert": _kernel(), "rank": _kernel("rank"), "node": _kernel("node")}
    )
    e = ExpertCompute(hidden_size=128, ffn_size=64, hbm_bytes_per_s=1e9, peak_flops=1e12)
    cost = CostModel(hardware=hw, expert=e)
    sim = simulate_volume(
        ids,
        placement=pl,
        batch_T=batch,
        src_rank_T=src_T,
        num_batches=1,
        num_ranks=W,
        ranks_per_node=g,
        bytes_per_token=256,
        dedup="expert",
        cost=cost,
        time_hidden_size=128,
    )
    dep = parse_deployment("DP4TP1EP4", num_gpus_per_node=g)
    tok = evaluate_tokens(
        StepTokens(topk_ids_TLK=ids, step_T=batch, src_rank_T=src_T, num_steps=1),
        pl,
        deployment=dep,
        dedup="expert",
        cost=cost,
        bytes_per_token=256,
        hidden_size=128,
    )
    a2a_sim = sim["dispatch_seconds"] + sim["combine_seconds"]
    assert tok.a2a_seconds_BL == pytest.approx(a2a_sim)
    assert tok.moe_seconds_BL == pytest.approx(sim["moe_seconds"])
    # counts: each expert gets what the tokens gave it
    counts = np.zeros((1, L, E))
    np.add.at(counts[0, 0], ids[:, 0, :].reshape(-1), 1)
    cnt = evaluate_counts(
        counts,
        pl,
        deployment=dep,
        cost=cost,
        dedup="expert",
        pairs_per_step=float(ids.size),
        bytes_per_token=256,
        hidden_size=128,
    )
    assert cnt.a2a_seconds_BL[0, 0] == pytest.approx(a2a_sim[0, 0])
    # the replay's prediction on the send matrix of the same copies, priced with the replay's kernel
    from types import SimpleNamespace

    from moetrace.placement.replay import replay_kernel

    rc = ReplayCost(
        links=LINKS, fixed_seconds=3e-6, wire_overhead=1.0, intra_probe_seconds=None, intra_probe_bytes=0, note="test"
    )
    sends = np.zeros((1, 1, 1, W, W), dtype=np.int64)
    for w, row in zip(src_T, ids[:, 0, :]):
        for dst in row // (E // W):
            sends[0, 0, 0, w, dst] += int(dst != w)
    plan = SimpleNamespace(sends_VBLWW=sends, ranks_per_node=g, bytes_per_token=256)
    replay_hw = Hardware(name="r", source="test", kernels={"expert": replay_kernel(rc)})
    sim_r = simulate_volume(
        ids,
        placement=pl,
        batch_T=batch,
        src_rank_T=src_T,
        num_batches=1,
        num_ranks=W,
        ranks_per_node=g,
        bytes_per_token=256,
        dedup="expert",
        cost=CostModel(hardware=replay_hw),
        time_hidden_size=256,
    )
    assert predicted_seconds_VBL(plan, rc)[0, 0, 0] == pytest.approx(sim_r["dispatch_seconds"][0, 0])
