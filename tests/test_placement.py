"""Placement algorithms: invariants of every placer, the EPLB golden example, grouping cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrace.errors import ConfigError
from moetrace.placement.baselines import linear, random_placement, round_robin
from moetrace.placement.data_placement import data_placement, two_phase_members
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.eplb import rebalance
from moetrace.placement.grouping import groups_of_clusters, map_clusters_to_groups
from moetrace.placement.improved import improved_placement, optimal_members
from moetrace.placement.maps import Placement, placement_from_phy2log, placement_problems
from moetrace.placement.replica_routing import choose_slots
from moetrace.placement.simulate import simulate_volume

# ---------------------------------------------------------------- EPLB golden example (README)
README_WEIGHT = np.array(
    [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
)
README_PHY2LOG = np.array(
    [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1], [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
)


def test_eplb_reproduces_readme_example():
    p = rebalance(README_WEIGHT, num_replicas=16, num_groups=4, num_nodes=2, num_gpus=8)
    np.testing.assert_array_equal(p.phy2log, README_PHY2LOG)
    assert placement_problems(p, num_experts=12, num_ranks=8) == []


# ---------------------------------------------------------------- invariants of every placer
def _check(p: Placement, *, E: int, P: int, N: int) -> None:
    phy2log, log2phy, logcnt = p
    assert placement_problems(p, num_experts=E, num_ranks=N) == []
    assert (logcnt >= 1).all()
    assert (logcnt.sum(-1) == P).all()
    for l in range(phy2log.shape[0]):
        assert np.array_equal(np.bincount(phy2log[l], minlength=E), logcnt[l])
        for r in range(P):
            assert r in log2phy[l, phy2log[l, r]]
    # slots per GPU equal: P divides over N ranks and every slot maps to one rank
    assert P % N == 0 and np.bincount(np.arange(P) // (P // N), minlength=N).tolist() == [P // N] * N


@st.composite
def problems(draw):
    nodes = draw(st.sampled_from([1, 2, 4]))
    ranks_per_node = draw(st.sampled_from([1, 2, 4]))
    N = nodes * ranks_per_node
    E = N * draw(st.integers(1, 4))
    P = E + N * draw(st.integers(0, 2))
    if P // nodes > E:
        P = E
    L = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    load = np.random.default_rng(seed).gamma(0.6, size=(L, E)) * 100
    usage = np.random.default_rng(seed + 1).gamma(0.6, size=(nodes, L, E)) * 50
    return dict(nodes=nodes, rpn=ranks_per_node, N=N, E=E, P=P, L=L, seed=seed, load=load, usage=usage)


@settings(max_examples=40, deadline=None)
@given(problems())
def test_every_placer_keeps_the_invariants(pb):
    E, P, N, L = pb["E"], pb["P"], pb["N"], pb["L"]
    shape = dict(num_layers=L, num_experts=E, num_slots=P, num_ranks=N)
    placements = [linear(**shape), round_robin(**shape), random_placement(**shape, seed=pb["seed"])]
    placements.append(rebalance(pb["load"], num_replicas=P, num_groups=pb["nodes"], num_nodes=pb["nodes"], num_gpus=N))
    placements.append(rebalance(pb["load"], num_replicas=P, num_groups=1, num_nodes=pb["nodes"], num_gpus=N))
    if P // pb["nodes"] <= E:  # a node cannot hold two copies of one expert
        placements.append(data_placement(pb["usage"], num_slots=P, ranks_per_group=pb["rpn"]))
        placements.append(improved_placement(pb["usage"], num_slots=P, ranks_per_group=pb["rpn"]))
    for p in placements:
        _check(p, E=E, P=P, N=N)


@settings(max_examples=15, deadline=None)
@given(problems())
def test_placers_are_deterministic(pb):
    E, P, N, L = pb["E"], pb["P"], pb["N"], pb["L"]
    shape = dict(num_layers=L, num_experts=E, num_slots=P, num_ranks=N)
    for make in (
        lambda: random_placement(**shape, seed=pb["seed"]),
        lambda: rebalance(pb["load"], num_replicas=P, num_groups=pb["nodes"], num_nodes=pb["nodes"], num_gpus=N),
        lambda: data_placement(pb["usage"], num_slots=P, ranks_per_group=pb["rpn"]),
        lambda: improved_placement(pb["usage"], num_slots=P, ranks_per_group=pb["rpn"]),
    ):
        a, b = make(), make()
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


@settings(max_examples=25, deadline=None)
@given(problems())
def test_improved_membership_is_never_worse_than_greedy(pb):
    P = pb["P"]
    assert P // pb["nodes"] <= pb["E"]
    u = np.transpose(pb["usage"], (1, 0, 2))
    greedy = two_phase_members(pb["usage"], num_slots=P)
    exact = optimal_members(pb["usage"], num_slots=P)
    assert (u * exact).sum() >= (u * greedy).sum() - 1e-6


def test_data_placement_recovers_planted_domains():
    # 2 groups; group 0 uses only even experts, group 1 only odd ones: each lands on its group's node
    E, G = 8, 2
    usage = np.zeros((G, 1, E))
    usage[0, 0, 0::2] = [40, 30, 20, 10]
    usage[1, 0, 1::2] = [5, 15, 25, 35]
    for placer in (data_placement, improved_placement):
        p = placer(usage, num_slots=E, ranks_per_group=2)
        assert sorted(p.phy2log[0, :4]) == [0, 2, 4, 6]
        assert sorted(p.phy2log[0, 4:]) == [1, 3, 5, 7]


def test_linear_and_round_robin_match_vllm():
    lin = linear(num_layers=1, num_experts=8, num_slots=8, num_ranks=4)
    rr = round_robin(num_layers=1, num_experts=8, num_slots=8, num_ranks=4)
    assert lin.phy2log[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # rank 0: [0, 1], rank 1: [2, 3] ...
    assert rr.phy2log[0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]  # expert e on rank e % 4


def test_log2phy_lists_replicas_in_slot_order():
    p = placement_from_phy2log(np.array([[0, 1, 0, 2, 0, 1]]), num_experts=3)
    assert p.log2phy[0].tolist() == [[0, 2, 4], [1, 5, -1], [3, -1, -1]]
    assert p.logcnt[0].tolist() == [3, 2, 1]


# ---------------------------------------------------------------- deployment
def test_deployment_parses_and_derives_topology():
    d = parse_deployment("DP8TP8EP64")
    assert (d.num_gpus, d.num_nodes, d.ranks_per_node) == (64, 8, 8)
    assert d.rank_node_W().tolist()[:9] == [0] * 8 + [1]
    d2 = parse_deployment("dp8tp8ep32tp2")
    assert (d2.num_ep, d2.num_ep_tp, d2.ranks_per_node) == (32, 2, 4)
    assert d.check_slots(num_experts=256, num_redundant=64) == 320


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("DP8TP8", "not of the form"),
        ("DP8TP8EP32", "must cover the same GPUs"),
        ("DP3TP4EP12", "do not fill whole nodes"),
        ("DP4TP4EP4TP4", "must sit on one node"),
        ("DP0TP8EP0", "DP must be >= 1, got 0"),  # named in the notation, not by the dataclass field
        ("DP8TP8EP64TP0", "the TP after EP must be >= 1"),
    ],
)
def test_deployment_rejects_inconsistent_configs(spec, fragment):
    kw = {"num_gpus_per_node": 8} if "TP4EP4TP4" not in spec else {"num_gpus_per_node": 2}
    with pytest.raises(ConfigError, match=fragment):
        parse_deployment(spec, **kw)


def test_slots_must_divide_over_ranks():
    with pytest.raises(ConfigError, match="do not divide over EP48"):
        parse_deployment("DP6TP8EP48").check_slots(num_experts=256, num_redundant=0)


# ---------------------------------------------------------------- grouping: the three cases
def test_cluster_to_group_one_to_one():
    assert map_clusters_to_groups(np.array([5, 9, 2]), num_groups=3) == [[0], [1], [2]]


def test_more_groups_than_clusters_go_to_largest_round_robin():
    # sizes: cluster 1 largest, then 0, then 2; 4 extra groups (3..6) go 1, 0, 2, 1
    assert map_clusters_to_groups(np.array([5, 9, 2]), num_groups=7) == [[0, 4], [1, 3, 6], [2, 5]]


def test_more_clusters_than_groups_merge_similar_centroids():
    c = np.array([[1, 0, 0, 0], [0.9, 0.1, 0, 0], [0, 0, 1, 0], [0, 0, 0.95, 0.05]], dtype=float)
    m = map_clusters_to_groups(np.array([3, 3, 3, 3]), num_groups=2, centroids_CF=c)
    assert m[0] == m[1] and m[2] == m[3] and m[0] != m[2]


def test_groups_of_clusters_round_robin_within_cluster():
    g = groups_of_clusters(np.array([0, 0, 0, 1]), [[0, 2], [1]])
    assert g.tolist() == [0, 2, 0, 1]


# ---------------------------------------------------------------- replica routing and simulator
def test_same_node_prefers_local_replica_and_metro_concentrates():
    # 2 nodes x 1 GPU, 4 slots: expert 0 on both nodes
    p = placement_from_phy2log(np.array([[0, 1, 0, 2]]), num_experts=3)
    ids = np.array([[0], [0], [0], [0]])
    kw = dict(
        phy2log_P=p.phy2log[0],
        log2phy_EM=p.log2phy[0],
        logcnt_E=p.logcnt[0],
        batch_T=np.zeros(4, int),
        num_batches=1,
        num_ranks=2,
        ranks_per_node=1,
    )
    same = choose_slots(ids, src_node_T=np.array([0, 1, 1, 0]), policy="same_node", **kw)
    assert same[:, 0].tolist() == [0, 2, 2, 0]
    even = choose_slots(ids, src_node_T=np.zeros(4, int), policy="even", **kw)
    assert even[:, 0].tolist() == [0, 2, 0, 2]
    metro = choose_slots(ids, src_node_T=np.zeros(4, int), policy="metro", **kw)
    assert len(set(metro[:, 0].tolist())) == 1  # all tokens of one expert to one replica


def test_simulator_counts_by_hand():
    # 2 nodes x 2 GPUs, one expert per GPU; token from GPU 0 to experts {0 (self), 1 (intra), 2, 3 (inter)}
    p = placement_from_phy2log(np.array([[0, 1, 2, 3]]), num_experts=4)
    ids = np.array([[[0, 1, 2, 3]], [[2, 3, -1, -1]]])
    kw = dict(
        placement=p,
        batch_T=np.array([0, 1]),
        src_rank_T=np.array([0, 0]),
        num_batches=2,
        num_ranks=4,
        ranks_per_node=2,
        bytes_per_token=10,
    )
    m = simulate_volume(ids, dedup="rank", **kw)
    assert m["dispatch_intra_bytes"][:, 0].tolist() == [10, 0]
    assert m["dispatch_inter_bytes"][:, 0].tolist() == [20, 20]
    assert m["max_rank_dispatch_send_bytes"][:, 0].tolist() == [30, 20]
    assert m["activated_experts_per_rank_max"][:, 0].tolist() == [1, 1]
    node = simulate_volume(ids, dedup="node", **kw)
    assert node["dispatch_inter_bytes"][:, 0].tolist() == [10, 10]  # one copy to node 1


def test_grouping_fitted_on_a_sample_labels_every_request_like_kmeans():
    """Past max_fit_requests K-means sees a seeded sample; every request gets its nearest centroid,
    and planted clusters come out the same as with the full fit."""
    from moetrace.placement.grouping import fit_grouping, l2_normalize

    rng = np.random.default_rng(0)
    R, F, C = 240, 24, 3
    truth = np.arange(R) % C
    x = rng.poisson(1.0, (R, F)).astype(np.uint16)
    for c in range(C):
        x[truth == c, 8 * c : 8 * c + 8] += 20
    full = fit_grouping(x, x, num_clusters=C, num_groups=C, seed=0)
    sampled = fit_grouping(x, x, num_clusters=C, num_groups=C, seed=0, max_fit_requests=30)
    for g in (full, sampled):  # each planted cluster is exactly one label
        assert len({(t, l) for t, l in zip(truth, g.labels_R)}) == C
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    d = ((xn[:, None, :] - sampled.decode_centroids_CF[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(sampled.labels_R, d.argmin(1))
    # the router's prefill centroids: each cluster's normalized rows summed in row order (np.add.at's sums,
    # bit for bit), over its size
    for g in (full, sampled):
        pre = np.zeros((C, F))
        np.add.at(pre, g.labels_R, l2_normalize(x))
        pre /= np.bincount(g.labels_R, minlength=C)[:, None]
        np.testing.assert_array_equal(g.prefill_centroids_CF, pre)
