"""DeepSeek's expert-parallelism load balancer (EPLB), re-implemented in vectorized numpy.

Same algorithm and tie-breaking as deepseek-ai/EPLB ``eplb.py`` (it reproduces the README's worked
example exactly): replicate the heaviest experts greedily (min-max load per replica), pack expert
groups onto nodes, then pack replicas onto GPUs (LPT greedy with an equal count per pack). The
hierarchical policy runs when expert groups divide evenly over nodes; otherwise the global policy
(the same routine with one group and one node). Loops run over items and replicas only, never
over layers.

Shape legend: L layers, E logical experts, P physical slots (replicas), M max replicas per expert,
X rows of a batched sub-problem, n items, m packs.

Out of scope: predicting load (pass a measured or averaged ``load_LE``), routing tokens among
replicas (``replica_routing``), migration cost.
"""

from __future__ import annotations

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.maps import Placement, placement_from_phy2log

__all__ = ["rebalance", "balanced_packing", "replicate_experts"]


def balanced_packing(weight_Xn: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack n weighted items into ``num_packs`` packs of exactly n/m items each, balancing weight.

    Items are taken heaviest first and each goes to the lightest pack that still has room (first
    such pack on ties). Returns ``pack_index_Xn`` and ``rank_in_pack_Xn`` (int64 [X, n]).
    """
    X, n = weight_Xn.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(n), (X, n)).copy(), np.zeros((X, n), dtype=np.int64)
    order_Xn = np.argsort(-weight_Xn, axis=1, kind="stable")
    pack_w = np.zeros((X, num_packs), dtype=weight_Xn.dtype)
    pack_n = np.zeros((X, num_packs), dtype=np.int64)
    pack_index = np.empty((X, n), dtype=np.int64)
    rank_in_pack = np.empty((X, n), dtype=np.int64)
    rows = np.arange(X)
    for j in range(n):
        item = order_Xn[:, j]
        pack = np.argmin(np.where(pack_n < per_pack, pack_w, np.float32(np.inf)), axis=1)
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_n[rows, pack]
        pack_w[rows, pack] += weight_Xn[rows, item]
        pack_n[rows, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight_XE: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Add ``num_phy - E`` replicas, each to the expert with the largest load per replica.

    Returns ``phy2log_XP`` (expert of each replica), ``rank_XP`` (replica index of that expert) and
    ``logcnt_XE`` (replicas per expert), all int64.
    """
    X, E = weight_XE.shape
    phy2log = np.broadcast_to(np.arange(num_phy, dtype=np.int64), (X, num_phy)).copy()
    rank = np.zeros((X, num_phy), dtype=np.int64)
    logcnt = np.ones((X, E), dtype=np.int64)
    rows = np.arange(X)
    for i in range(E, num_phy):
        best = np.argmax(weight_XE / logcnt.astype(weight_XE.dtype), axis=1)
        phy2log[:, i] = best
        rank[:, i] = logcnt[rows, best]
        logcnt[rows, best] += 1
    return phy2log, rank, logcnt


def _inverse(perm_XN: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm_XN)
    np.put_along_axis(inv, perm_XN, np.broadcast_to(np.arange(perm_XN.shape[1]), perm_XN.shape), axis=1)
    return inv


def _hierarchical(
    weight_LE: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    L, E = weight_LE.shape
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_phy // num_gpus

    # Step 1: pack expert groups onto nodes
    tokens_per_group = weight_LE.reshape(L, num_groups, group_size).sum(-1)
    g_pack, g_rank = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (((g_pack * groups_per_node + g_rank) * group_size)[:, :, None] + np.arange(group_size)).reshape(L, E)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicate experts within each node
    tokens_per_mlog = np.take_along_axis(weight_LE, mlog2log, axis=1).reshape(L * num_nodes, E // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_phy // num_nodes)

    # Step 3: pack replicas onto the GPUs of each node
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt.astype(np.float32), phy2mlog, axis=1)
    pack, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * phy_per_gpu + rank_in_pack)

    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    pphy2mlog = (pphy2mlog.reshape(L, num_nodes, -1) + np.arange(0, E, E // num_nodes)[None, :, None]).reshape(L, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(L, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, -1), log2mlog, axis=1)
    return pphy2log, pphyrank, logcnt


def rebalance(load_LE: np.ndarray, *, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> Placement:
    """EPLB placement of ``load_LE`` (float [L, E], tokens per expert) on ``num_replicas`` slots.

    ``num_groups``: expert groups of a group-limited router (DeepSeek-V3: 8; 1 when the router has
    none). Hierarchical policy when ``num_groups % num_nodes == 0``, global otherwise. Slot ``p``
    lives on GPU ``p // (num_replicas / num_gpus)``. Returns ``Placement(phy2log [L, P],
    log2phy [L, E, M], logcnt [L, E])`` with EPLB's replica ranks.
    """
    load = np.asarray(load_LE, dtype=np.float32)  # EPLB works in float32; ties break the same way
    if load.ndim != 2:
        raise ConfigError(f"load must be [layers, experts], got shape {load.shape}")
    L, E = load.shape
    if num_replicas < E or num_replicas % num_gpus:
        raise ConfigError(f"num_replicas={num_replicas} must be >= {E} experts and a multiple of num_gpus={num_gpus}")
    if num_gpus % num_nodes:
        raise ConfigError(f"num_gpus={num_gpus} must be a multiple of num_nodes={num_nodes}")
    hierarchical = num_groups % num_nodes == 0 and E % num_groups == 0
    if hierarchical:
        if (num_replicas // num_nodes) < E // num_nodes or E % num_nodes:
            hierarchical = False
    if hierarchical:
        phy2log, phyrank, logcnt = _hierarchical(load, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = _hierarchical(load, num_replicas, 1, 1, num_gpus)
    M = int(logcnt.max())
    log2phy = np.full((L, E * M), -1, dtype=np.int64)
    np.put_along_axis(log2phy, phy2log * M + phyrank, np.broadcast_to(np.arange(num_replicas), (L, num_replicas)), axis=1)
    return Placement(phy2log, log2phy.reshape(L, E, M), logcnt)


def rebalance_unranked(load_LE: np.ndarray, **kw) -> Placement:
    """``rebalance`` with ``log2phy`` rebuilt in slot order (what engines rebuild from phy2log)."""
    p = rebalance(load_LE, **kw)
    return placement_from_phy2log(p.phy2log, num_experts=p.logcnt.shape[1])
