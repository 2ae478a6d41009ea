"""The joint placer's GPU-balance search (placement/step_search.py): the expected link terms against
hand-computed cases, and the search's invariants (never a slower layer, slots and replicas kept)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrace.placement.cost import Link, Links
from moetrace.placement.joint import joint_placement, members_of_placement
from moetrace.placement.maps import placement_from_phy2log, placement_problems
from moetrace.placement.step_search import (
    expected_step_seconds,
    improve_layout,
    layer_link_times,
    slot_flows_PG,
)

#: 1 byte/s inside a node, 0.5 between nodes: times are copies (inter copies count twice)
UNIT = Links(intra=Link(bytes_per_s=1.0, latency_s=0.0), inter=Link(bytes_per_s=0.5, latency_s=0.0))


def test_slot_flows_same_node_first_hand_computed():
    # 2 nodes, experts {0, 1} on node 0 and {2, 0} on node 1: expert 0 has a copy on each node
    u_GE = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    flows = slot_flows_PG(np.array([0, 1, 2, 0]), u_GE)
    # each node's copies to expert 0 stay home; experts 1 and 2 (one copy) serve both nodes
    np.testing.assert_allclose(flows, [[1, 0], [2, 5], [3, 6], [0, 4]])


def test_layer_link_times_hand_computed():
    # 2 nodes x 2 GPUs, expert e on GPU e; node 0 sends 4, 2, 1, 0 copies to experts 0..3, node 1 0, 1, 2, 3
    u_GE = np.array([[4.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    phy = np.arange(4)
    lt = layer_link_times(slot_flows_PG(phy, u_GE), np.arange(4), num_ranks=4, num_nodes=2, links=UNIT)
    # half of a node's copies to its own experts come from the other GPU of the node
    np.testing.assert_allclose(lt.recv_intra_W, [2.0, 1.0, 1.0, 1.5])
    np.testing.assert_allclose(lt.recv_inter_W, [0.0, 1.0, 1.0, 0.0])
    np.testing.assert_allclose(lt.send_inter_G, [0.5, 0.5])  # (1 + 0) / 2 and (0 + 1) / 2 per GPU
    np.testing.assert_allclose(lt.send_intra_G, [1.5, 1.25])  # 1/2 x (4 + 2) / 2 and 1/2 x (2 + 3) / 2
    # t = max(max(send, recv) intra / 1, max(send, recv) inter / 0.5)
    np.testing.assert_allclose(lt.t_W, [2.0, 2.0, 2.0, 1.5])
    assert expected_step_seconds(phy[None, :], u_GE[:, None, :], num_ranks=4, links=UNIT) == 2.0


def test_search_splits_two_hot_experts_on_one_gpu():
    # 1 node of 2 GPUs would be all NVLink; take 2 nodes x 2 GPUs, 8 experts, two hot ones on GPU 0
    u_GE = np.ones((2, 8))
    u_GE[:, [0, 1]] = 20.0
    phy = np.arange(8)[None, :]  # GPU 0 holds experts 0 and 1
    u_GLE = u_GE[:, None, :]
    before = expected_step_seconds(phy, u_GLE, num_ranks=4, links=UNIT)
    out = improve_layout(phy, u_GLE, num_ranks=4, links=UNIT)
    gpu_of = np.empty(8, dtype=np.int64)
    gpu_of[out[0]] = np.arange(8) // 2
    assert gpu_of[0] != gpu_of[1]  # the two hot experts no longer share a GPU
    assert expected_step_seconds(out, u_GLE, num_ranks=4, links=UNIT) < 0.75 * before


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from([(2, 1), (2, 2), (4, 2), (2, 4)]),
    st.integers(1, 3),
    st.integers(0, 1),
    st.integers(0, 2**16),
    st.booleans(),
)
def test_search_never_slows_a_layer_and_keeps_slots(nodes_rpn, per_rank, extra, seed, across):
    nodes, rpn = nodes_rpn
    W = nodes * rpn
    E = W * per_rank
    P = E + W * extra
    L = 3
    rng = np.random.default_rng(seed)
    # each node holds distinct experts (the membership the placers make), replicas on other nodes
    phy = np.empty((L, P), dtype=np.int64)
    J = P // nodes
    for l in range(L):
        base = rng.permutation(E)
        slots = [list(base[g * (E // nodes) : (g + 1) * (E // nodes)]) for g in range(nodes)]
        for g in range(nodes):
            lacking = [e for e in range(E) if e not in slots[g]]
            slots[g] += list(rng.choice(lacking, J - len(slots[g]), replace=False))
        phy[l] = np.concatenate([rng.permutation(s) for s in slots])
    u_GLE = rng.gamma(0.5, 2.0, (nodes, L, E))
    out = improve_layout(phy, u_GLE, num_ranks=W, links=UNIT, across_nodes=across)
    assert placement_problems(placement_from_phy2log(out, num_experts=E), num_experts=E, num_ranks=W) == []
    node_of_slot = np.arange(P) // J
    for l in range(L):
        lt = {
            name: layer_link_times(
                slot_flows_PG(p[l], u_GLE[:, l]), np.arange(P) // (P // W), num_ranks=W, num_nodes=nodes, links=UNIT
            ).t_W.max()
            for name, p in (("before", phy), ("after", out))
        }
        assert lt["after"] <= lt["before"] * (1 + 1e-9)
        assert sorted(out[l]) == sorted(phy[l])  # every expert keeps its number of copies
        counts = np.bincount(phy[l], minlength=E)
        for e in range(E):  # replicated experts (and all, without across) stay on their nodes
            if counts[e] > 1 or not across:
                assert sorted(node_of_slot[out[l] == e]) == sorted(node_of_slot[phy[l] == e])


def test_joint_with_links_balances_gpus_and_reports_the_gain():
    # 2 nodes x 4 GPUs, 16 experts; two datasets, each using 4 hot experts: locality alone puts
    # them on one node; the search must spread each node's hot experts over its GPUs
    rng = np.random.default_rng(3)
    R, L, E, G, rpn = 64, 2, 16, 2, 4
    decode = np.zeros((R, L, E), dtype=np.uint16)
    prefill = np.zeros((R, L, E), dtype=np.uint16)
    for r in range(R):
        hot = 4 * (r % 2) + np.arange(4)
        for x in (decode, prefill):
            for l in range(L):
                np.add.at(x[r, l], rng.choice(hot, 20), 1)
                np.add.at(x[r, l], rng.integers(0, E, 4), 1)
    kw = dict(init_group_R=np.arange(R) % G, num_groups=G, num_slots=E, ranks_per_group=rpn)
    plain = joint_placement(decode, prefill, **kw)
    timed = joint_placement(decode, prefill, **kw, links=UNIT)
    assert plain.layout_gain is None and timed.layout_gain is not None and timed.layout_gain < 1.0
    assert placement_problems(timed.placement, num_experts=E, num_ranks=G * rpn) == []
    for jp in (plain, timed):  # the router still sends each dataset to one node
        assert len({int(g) for g in jp.group_R[::2]}) == 1 and len({int(g) for g in jp.group_R[1::2]}) == 1
    per_rank = E // (G * rpn)
    for l in range(L):
        gpu_of = np.empty(E, dtype=np.int64)
        gpu_of[timed.placement.phy2log[l]] = np.arange(E) // per_rank
        for d in range(2):  # each dataset's 4 hot experts on 4 different GPUs
            assert len(set(gpu_of[4 * d + np.arange(4)])) == 4
    np.testing.assert_array_equal(members_of_placement(timed.placement, num_groups=G, num_experts=E), timed.member_LGE)
