"""The placement maps shared by every placer, in the vocabulary of EPLB, vLLM and SGLang.

A placement of one model puts P physical slots per MoE layer over the EP ranks; each slot holds one
logical expert (a *replica* of it). Physical slot ``p`` lives on EP rank ``p // (P / num_ranks)``.

Shape legend (docs/architecture.md): L MoE layers, E logical experts, P physical slots
(E + redundant), M max replicas of one expert, W EP ranks (GPUs).

Out of scope: choosing the placement (``eplb``, ``baselines``, ``data_placement``, ``improved``),
which replica a token uses (``replica_routing``), files (``exports``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Placement", "placement_from_phy2log", "placement_problems"]


class Placement(NamedTuple):
    """phy2log [L, P] int64 (logical expert of each slot), log2phy [L, E, M] int64 (slots of each
    expert, -1 padded, in replica-rank order), logcnt [L, E] int64 (replicas per expert)."""

    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray


def placement_from_phy2log(phy2log_LP: np.ndarray, *, num_experts: int) -> Placement:
    """Build ``log2phy`` and ``logcnt`` from ``phy2log`` [L, P]; replica ranks follow slot order."""
    phy2log = np.ascontiguousarray(phy2log_LP, dtype=np.int64)
    L, P = phy2log.shape
    rows = np.repeat(np.arange(L), P)
    logcnt = np.zeros((L, num_experts), dtype=np.int64)
    np.add.at(logcnt, (rows, phy2log.reshape(-1)), 1)
    M = max(int(logcnt.max(initial=1)), 1)
    # replica rank of each slot = how many earlier slots of the row hold the same expert
    order = np.argsort(phy2log, axis=1, kind="stable")  # slots grouped by expert, slot order kept
    sorted_log = np.take_along_axis(phy2log, order, axis=1)
    first = np.ones_like(sorted_log, dtype=bool)
    first[:, 1:] = sorted_log[:, 1:] != sorted_log[:, :-1]
    idx = np.broadcast_to(np.arange(P), (L, P))
    start = np.maximum.accumulate(np.where(first, idx, 0), axis=1)
    rank_sorted = idx - start
    log2phy = np.full((L, num_experts, M), -1, dtype=np.int64)
    log2phy[np.repeat(np.arange(L), P), sorted_log.reshape(-1), rank_sorted.reshape(-1)] = order.reshape(-1)
    return Placement(phy2log, log2phy, logcnt)


def placement_problems(placement: Placement, *, num_experts: int, num_ranks: int) -> list[str]:
    """Every way ``placement`` breaks the invariants (empty list when it is valid).

    Invariants: ids in range, every expert placed at least once, slots divide evenly over ranks,
    ``logcnt == bincount(phy2log)``, and ``log2phy`` lists exactly the slots of each expert.
    """
    phy2log, log2phy, logcnt = (np.asarray(a) for a in placement)
    out: list[str] = []
    if phy2log.ndim != 2:
        return [f"phy2log must be 2-D [layers, slots], got shape {phy2log.shape}"]
    L, P = phy2log.shape
    if P % num_ranks:
        out.append(f"{P} slots do not divide evenly over {num_ranks} EP ranks")
    if phy2log.min(initial=0) < 0 or phy2log.max(initial=0) >= num_experts:
        out.append(f"phy2log holds ids outside 0..{num_experts - 1}")
        return out
    if logcnt.shape != (L, num_experts):
        return out + [f"logcnt has shape {logcnt.shape}, expected {(L, num_experts)}"]
    counts = np.zeros((L, num_experts), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(L), P), phy2log.reshape(-1)), 1)
    missing = np.argwhere(counts == 0)
    if len(missing):
        layer, expert = missing[0]
        out.append(f"{len(missing)} (layer, expert) pairs have no slot, e.g. layer {layer} expert {expert}")
    if not np.array_equal(counts, logcnt):
        out.append("logcnt does not match the number of slots of each expert in phy2log")
    if log2phy.ndim != 3 or log2phy.shape[:2] != (L, num_experts):
        return out + [f"log2phy has shape {log2phy.shape}, expected ({L}, {num_experts}, max_replicas)"]
    valid = log2phy >= 0
    if not np.array_equal(valid.sum(-1), counts):
        out.append("log2phy does not list every replica exactly once")
    else:
        lay = np.broadcast_to(np.arange(L)[:, None, None], log2phy.shape)
        exp = np.broadcast_to(np.arange(num_experts)[None, :, None], log2phy.shape)
        if log2phy.max(initial=-1) >= P or not np.array_equal(phy2log[lay[valid], log2phy[valid]], exp[valid]):
            out.append("log2phy points at slots that hold a different expert")
    return out
