"""Which replica (physical slot) serves each (token, expert) when an expert has several.

Policies (docs/placement.md): ``same_node`` — a replica on the token's own node if there is one (several:
token index modulo their count), else any replica (token index modulo the replica count);
``even`` — EPLB's even token split over all replicas (token index modulo the replica count);
``metro`` — METRO's greedy minimum activated experts (METRO paper, Algorithm 1): per batch, every
activated expert sends all its tokens to one replica, on the candidate GPU with the fewest
activated experts so far; experts with one replica are fixed first, replicated ones follow in
expert-id order, ties to the lowest GPU. Vectorized over tokens (and over batches for ``metro``).

Shape legend (docs/architecture.md): T tokens, K top-k slots, E logical experts, P physical
slots, M max replicas, B batches, W EP ranks (GPUs), G node groups (= nodes).

Out of scope: where replicas are (the placers), traffic accounting (``simulate``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

__all__ = ["ReplicaPolicy", "choose_slots", "local_replicas"]

ReplicaPolicy = Literal["same_node", "even", "metro"]


def local_replicas(
    phy2log_P: np.ndarray, node_of_slot_P: np.ndarray, num_nodes: int, num_experts: int
) -> tuple[np.ndarray, np.ndarray]:
    """The replicas of each expert on each node: slots int64 [G, E, M'] in slot order (-1 padded; M' the
    most on one node, at least 1) and their counts int64 [G, E]."""
    P = len(phy2log_P)
    key = node_of_slot_P * num_experts + phy2log_P
    order = np.argsort(key, kind="stable")
    skey = key[order]
    first = np.r_[True, skey[1:] != skey[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(P), 0))
    rank = np.arange(P) - start
    cnt = np.bincount(key, minlength=num_nodes * num_experts).reshape(num_nodes, num_experts)
    local = np.full((num_nodes, num_experts, max(int(cnt.max()), 1)), -1, dtype=np.int64)
    local[node_of_slot_P[order], phy2log_P[order], rank] = order
    return local, cnt


def choose_slots(
    topk_ids_TK: np.ndarray,
    *,
    phy2log_P: np.ndarray,
    log2phy_EM: np.ndarray,
    logcnt_E: np.ndarray,
    src_node_T: np.ndarray,
    batch_T: np.ndarray,
    num_batches: int,
    num_ranks: int,
    ranks_per_node: int,
    policy: ReplicaPolicy = "same_node",
) -> np.ndarray:
    """Physical slot of each (token, expert), int64 [T, K]; -1 where the id is -1 (not recorded)."""
    ids = np.asarray(topk_ids_TK, dtype=np.int64)
    valid = ids >= 0
    e = np.where(valid, ids, 0)
    T, K = ids.shape
    if int(logcnt_E.max()) == 1:  # one replica each: every policy picks it
        return np.where(valid, log2phy_EM[:, 0][e], -1)
    idx = np.broadcast_to(np.arange(T, dtype=np.int64)[:, None], (T, K))
    cnt = logcnt_E[e]
    even = log2phy_EM[e, idx % cnt]
    if policy == "even":
        slot = even
    elif policy == "same_node":
        P = len(phy2log_P)
        node_of_slot = (np.arange(P) // (P // num_ranks)) // ranks_per_node
        num_nodes = num_ranks // ranks_per_node
        local, lcnt = local_replicas(phy2log_P, node_of_slot, num_nodes, log2phy_EM.shape[0])
        src = np.broadcast_to(np.asarray(src_node_T)[:, None], (T, K))
        n_local = lcnt[src, e]
        slot = np.where(n_local > 0, local[src, e, idx % np.maximum(n_local, 1)], even)
    elif policy == "metro":
        slot = _metro(e, valid, phy2log_P, log2phy_EM, logcnt_E, batch_T, num_batches, num_ranks)
    else:
        raise ValueError(f"unknown replica policy {policy!r}")
    return np.where(valid, slot, -1)


def _metro(e_TK, valid_TK, phy2log_P, log2phy_EM, logcnt_E, batch_T, B, num_ranks) -> np.ndarray:
    E = len(logcnt_E)
    P = len(phy2log_P)
    per_rank = P // num_ranks
    b = np.broadcast_to(np.asarray(batch_T)[:, None], e_TK.shape)
    active_BE = np.bincount((b * E + e_TK)[valid_TK], minlength=B * E).reshape(B, E) > 0
    choice_BE = np.broadcast_to(log2phy_EM[:, 0], (B, E)).copy()  # single-replica experts: fixed
    single = logcnt_E == 1
    rank_of_first = log2phy_EM[:, 0] // per_rank
    act_BW = np.zeros((B, num_ranks), dtype=np.int64)
    np.add.at(
        act_BW, (np.nonzero(active_BE[:, single])[0], rank_of_first[single][np.nonzero(active_BE[:, single])[1]]), 1
    )
    rows = np.arange(B)
    for ex in np.flatnonzero(~single):
        cand_slots = log2phy_EM[ex, : logcnt_E[ex]]
        cand_ranks = cand_slots // per_rank
        a = active_BE[:, ex]
        pick = np.argmin(act_BW[:, cand_ranks], axis=1)  # first minimum = lowest slot, hence lowest GPU
        choice_BE[:, ex] = cand_slots[pick]
        act_BW[rows[a], cand_ranks[pick[a]]] += 1
    return choice_BE[b, e_TK]
