"""The per-step cost model (placement/cost.py) against hand-computed small cases."""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.errors import ConfigError
from moetrace.placement.cost import (
    DEFAULT_LINKS,
    ExpertCompute,
    Link,
    Links,
    collective_seconds_BW,
    expert_compute_for,
    expert_seconds_BW,
    gpu_traffic,
    parse_links,
)

LINKS = Links(intra=Link(bytes_per_s=1e6, latency_s=1e-6), inter=Link(bytes_per_s=1e5, latency_s=1e-5))


def _traffic(rank_TK, src_T, dedup, *, W=4, g=2, batch_T=None):
    rank_TK = np.asarray(rank_TK, dtype=np.int64)
    T = rank_TK.shape[0]
    return gpu_traffic(
        rank_TK=rank_TK,
        valid_TK=rank_TK >= 0,
        batch_T=np.zeros(T, dtype=np.int64) if batch_T is None else np.asarray(batch_T),
        src_rank_T=np.asarray(src_T, dtype=np.int64),
        num_batches=1 if batch_T is None else int(max(batch_T)) + 1,
        num_ranks=W,
        ranks_per_node=g,
        dedup=dedup,
    )


def test_expert_copies_hand_computed():
    # one token on GPU 0 (node 0) routed to GPUs 1 (node 0), 2 and 3 (node 1), 1000 bytes a copy
    t = _traffic([[1, 2, 3]], [0], "expert")
    assert t.send_intra[0].tolist() == [1, 0, 0, 0] and t.recv_intra[0].tolist() == [0, 1, 0, 0]
    assert t.send_inter[0].tolist() == [2, 0, 0, 0] and t.recv_inter[0].tolist() == [0, 0, 1, 1]
    assert t.peers_send_inter[0].tolist() == [2, 0, 0, 0]
    s = collective_seconds_BW(t, links=LINKS, bytes_per_copy=1000, ranks_per_node=2)
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
    per_gpu = collective_seconds_BW(t, links=LINKS, bytes_per_copy=1000, ranks_per_node=2)
    node = Links(intra=LINKS.intra, inter=LINKS.inter, inter_nic="node")
    per_node = collective_seconds_BW(t, links=node, bytes_per_copy=1000, ranks_per_node=2)
    assert per_gpu.max() == pytest.approx(1000 / 1e5 + 1e-5)
    assert per_node.max() == pytest.approx(2000 / 1e5 + 2e-5)


def test_twice_the_tokens_on_one_node_costs_twice_on_its_links():
    even = _traffic([[2], [0]], [0, 2], "expert")  # one token from each node, to the other
    skew = _traffic([[2], [3], [0]], [0, 1, 2], "expert")  # node 0 sends two
    t_even = collective_seconds_BW(even, links=LINKS, bytes_per_copy=1e4, ranks_per_node=2)
    node = Links(intra=LINKS.intra, inter=LINKS.inter, inter_nic="node")
    t_skew = collective_seconds_BW(skew, links=node, bytes_per_copy=1e4, ranks_per_node=2)
    assert t_skew[0, :2].max() / t_even[0, :2].max() >= 1.9


def test_expert_time_is_memory_bound_for_few_tokens_and_compute_bound_for_many():
    e = ExpertCompute(hidden_size=1000, ffn_size=500, weight_bytes_per_value=2, hbm_bytes_per_s=1e9, peak_flops=1e12)
    assert e.weight_bytes == 3e6 and e.flops_per_token == 3e6
    s = expert_seconds_BW(np.array([[1.0, 10_000.0]]), np.array([[2.0, 2.0]]), expert=e)
    assert s[0, 0] == pytest.approx(2 * 3e6 / 1e9)  # two experts' weights read
    assert s[0, 1] == pytest.approx(10_000 * 3e6 / 1e12)  # 10k (token, expert) pairs computed


def test_parse_links():
    links = parse_links("intra=300GB/s,2us,inter=400Gbit")
    assert links.intra == Link(bytes_per_s=300e9, latency_s=2e-6)
    assert links.inter == Link(bytes_per_s=50e9, latency_s=DEFAULT_LINKS.inter.latency_s)
    assert parse_links("inter=25") == Links(intra=DEFAULT_LINKS.intra, inter=Link(bytes_per_s=25e9, latency_s=0.4e-6))
    for bad in ("intra=fast", "nvlink=100", "inter=10,2us,3us", "intra=1,intra=2", "inter=10,soon"):
        with pytest.raises(ConfigError, match="--link"):
            parse_links(bad)


def test_expert_size_from_presets():
    dsv3 = expert_compute_for("deepseek-v3-tiny")
    assert dsv3 is not None and (dsv3.hidden_size, dsv3.ffn_size, dsv3.weight_bytes_per_value) == (7168, 2048, 1.0)
    olmoe = expert_compute_for("allenai/OLMoE-1B-7B-0924")
    assert olmoe is not None and (olmoe.hidden_size, olmoe.ffn_size) == (2048, 1024)
    assert expert_compute_for("my-own-model") is None
