"""Which replica an engine's dispatch sends a (token, expert) to when EPLB gave the expert several:
the replica policies ``advise --replica-policy`` evaluates, read from the engines' code.

- ``vllm``: vLLM 0.33.0, ``vllm/model_executor/layers/fused_moe/router/base_router.py``
  (``_eplb_map_and_record_i32_kernel``, the rule the issue places after vllm-project/vllm#40810): a
  token's replica index is a Knuth multiplicative hash of its row in its rank's batch,
  ``((row * 2654435769) & 0xFFFFFFFF) % replica_count``, the same for all its top-k experts, into the
  expert's replicas in ascending slot order (``eplb_state.py`` builds ``logical_to_physical_map``
  from the physical-to-logical map in slot order). No locality: a replica on another node is as
  likely as one on the token's own GPU. (vLLM 0.26.0 indexed by the flattened position
  ``(row * K + k) % replica_count`` instead.)
- ``sglang``: SGLang 0.5.23, ``python/sglang/srt/eplb/expert_location.py``
  (``compute_logical_to_rank_dispatch_physical_map`` and ``_find_nearest_expert``), the
  ``--ep-dispatch-algorithm static`` that ``srt/arg_groups/parallel_hook.py`` sets by default with
  EPLB and an all-to-all backend: one fixed replica per (source rank, layer, expert), local first:
  the expert's only replica; else the first replica on the rank's own GPU; else the first on its
  node when some but not all replicas are there; else a fair seeded choice over all replicas
  (``random.Random(42)``, ``_fair_choices``: each replica ``k // n`` times plus a sample of the
  rest, shuffled) for the ranks left, drawn in (layer, expert) order. sgl-project/sglang#13423
  proposed taking a node's replicas round robin by rank instead of the first; it was closed
  unmerged and 0.5.23 takes the first, which is what this module does.
- ``same_node``: moetrace's own model (``replica_routing``: a replica on the token's node if any,
  round robin by token index), what ``compare`` and ``advise`` used before the engines' rules.

On a load profile (counts, no tokens) each rule becomes the share of an expert's tokens each slot
serves (``slot_shares``), sources spread evenly over the ranks: ``vllm``'s hash and ``same_node``'s
round robin split evenly; ``sglang``'s map sends each source rank's share to its one replica.

Shape legend (docs/architecture.md): T tokens, K top-k slots, L MoE layers, E logical experts,
P physical slots, M max replicas per expert, W EP ranks.

Out of scope: where the replicas are (the placers); traffic and time (``simulate``, ``step_model``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Literal, get_args

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement import simulate_kernel
from moetrace.placement.maps import Placement
from moetrace.placement.simulate import LayerCopies, layer_copies

__all__ = [
    "REPLICA_RULES",
    "ReplicaRule",
    "rule_copies",
    "rule_tables",
    "sglang_dispatch_map",
    "slot_shares",
    "token_rows",
    "vllm_slots",
]

#: the replica policies advise offers: the engines' rules and moetrace's own model
ReplicaRule = Literal["vllm", "sglang", "same_node"]
REPLICA_RULES: tuple[str, ...] = get_args(ReplicaRule)
#: vLLM's hash multiplier: floor(2^32 / golden ratio) (Knuth)
KNUTH = 2654435769
#: the seed SGLang's static dispatch map draws its fair choices with
SGLANG_SEED = 42


def check_rule(rule: str) -> None:
    """``ConfigError`` naming the choices unless ``rule`` is one of ``REPLICA_RULES``."""
    if rule not in REPLICA_RULES:
        raise ConfigError(f"replica policy {rule!r}: choose one of {', '.join(REPLICA_RULES)}")


def _ascending_replicas(phy2log_P: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Each expert's slots in ascending order, int64 [E, M] (-1 padded), and their count [E]."""
    p2l = np.asarray(phy2log_P, dtype=np.int64)
    order = np.argsort(p2l, kind="stable")  # slots grouped by expert, ascending within each
    cnt = np.bincount(p2l, minlength=num_experts)
    start = np.concatenate([[0], np.cumsum(cnt)[:-1]])
    rank = np.arange(len(p2l)) - start[p2l[order]]
    out = np.full((num_experts, max(int(cnt.max()), 1)), -1, dtype=np.int64)
    out[p2l[order], rank] = order
    return out, cnt


def token_rows(step_T: np.ndarray, src_rank_T: np.ndarray, *, num_ranks: int) -> np.ndarray:
    """Each token's row in its source rank's batch of its step (tokens in array order), int64 [T]."""
    key = np.asarray(step_T, dtype=np.int64) * num_ranks + np.asarray(src_rank_T, dtype=np.int64)
    order = np.argsort(key, kind="stable")
    skey = key[order]
    first = np.r_[True, skey[1:] != skey[:-1]] if len(skey) else np.zeros(0, dtype=bool)
    start = np.maximum.accumulate(np.where(first, np.arange(len(skey)), 0))
    out = np.empty(len(key), dtype=np.int64)
    out[order] = np.arange(len(skey)) - start
    return out


def vllm_slots(topk_ids_TK: np.ndarray, *, phy2log_P: np.ndarray, row_T: np.ndarray, num_experts: int) -> np.ndarray:
    """vLLM 0.33.0's replica of each (token, expert), int64 [T, K] (-1 where the id is -1): the
    Knuth hash of the token's row in its rank's batch, modulo the expert's replica count."""
    ids = np.asarray(topk_ids_TK, dtype=np.int64)
    valid = ids >= 0
    e = np.where(valid, ids, 0)
    reps, cnt = _ascending_replicas(phy2log_P, num_experts)
    hashed = (np.asarray(row_T, dtype=np.int64) * KNUTH) & 0xFFFFFFFF
    idx = hashed[:, None] % np.maximum(cnt[e], 1)
    return np.where(valid, reps[e, idx], -1)


def _fair_choices(arr: list[int], k: int, r: random.Random) -> list[int]:
    """SGLang 0.5.23's ``_fair_choices``: each of ``arr`` ``k // len(arr)`` times plus a sample, shuffled."""
    quotient, remainder = divmod(k, len(arr))
    ans = arr * quotient + r.sample(arr, k=remainder)
    r.shuffle(ans)
    return ans


def sglang_dispatch_map(
    phy2log_LP: np.ndarray, *, num_experts: int, num_ranks: int, ranks_per_node: int, seed: int = SGLANG_SEED
) -> np.ndarray:
    """SGLang 0.5.23's static dispatch map: the slot every source rank sends each expert's tokens to,
    int64 [L, W, E] (module docstring). Vectorised over ranks but for the fair choices, which are
    drawn in SGLang's (layer, expert) order from one ``random.Random(seed)``."""
    p2l = np.asarray(phy2log_LP, dtype=np.int64)
    L, P = p2l.shape
    W, E, g = num_ranks, num_experts, ranks_per_node
    G = W // g
    per_rank = P // W
    big = np.iinfo(np.int64).max
    l_P = np.broadcast_to(np.arange(L)[:, None], (L, P))
    slot_P = np.broadcast_to(np.arange(P)[None, :], (L, P))
    gpu_first = np.full((L, W, E), big, dtype=np.int64)
    np.minimum.at(gpu_first, (l_P, slot_P // per_rank, p2l), slot_P)
    node_first = np.full((L, G, E), big, dtype=np.int64)
    np.minimum.at(node_first, (l_P, slot_P // (per_rank * g), p2l), slot_P)
    node_cnt = np.zeros((L, G, E), dtype=np.int64)
    np.add.at(node_cnt, (l_P, slot_P // (per_rank * g), p2l), 1)
    cnt_LE = node_cnt.sum(axis=1)
    only_LE = np.full((L, E), big, dtype=np.int64)
    np.minimum.at(only_LE, (l_P, p2l), slot_P)
    node_of_w = np.arange(W) // g
    nc_LWE = node_cnt[:, node_of_w, :]
    narrows = (nc_LWE > 0) & (nc_LWE < cnt_LE[:, None, :])
    out = np.where(
        (cnt_LE == 1)[:, None, :],
        only_LE[:, None, :],
        np.where(gpu_first < big, gpu_first, np.where(narrows, node_first[:, node_of_w, :], -1)),
    )
    r = random.Random(seed)
    left = out < 0  # [L, W, E]
    for l, e in zip(*np.nonzero(left.any(axis=1)), strict=True):  # (layer, expert) in SGLang's loop order
        ranks = np.flatnonzero(left[l, :, e])
        cand = [int(p) for p in np.flatnonzero(p2l[l] == e)]
        out[l, ranks, e] = _fair_choices(cand, len(ranks), r)
    return out


def slot_shares(placement: Placement, *, rule: ReplicaRule, num_ranks: int, ranks_per_node: int) -> np.ndarray:
    """The share of its expert's tokens each slot serves under ``rule`` with sources spread evenly over
    the ranks, float64 [L, P] (each expert's slots sum to 1)."""
    check_rule(rule)
    p2l = placement.phy2log
    L, P = p2l.shape
    if rule != "sglang":  # the hash and the round robin split evenly
        return 1.0 / np.take_along_axis(placement.logcnt, p2l, axis=1).astype(np.float64)
    E = placement.logcnt.shape[1]
    dmap = sglang_dispatch_map(p2l, num_experts=E, num_ranks=num_ranks, ranks_per_node=ranks_per_node)
    share = np.zeros((L, P))
    np.add.at(share, (np.broadcast_to(np.arange(L)[:, None, None], dmap.shape), dmap), 1.0 / num_ranks)
    return share


def rule_copies(
    topk_ids_TLK: np.ndarray,
    *,
    placement: Placement,
    rule: ReplicaRule,
    batch_T: np.ndarray,
    src_rank_T: np.ndarray,
    num_batches: int,
    num_ranks: int,
    ranks_per_node: int,
) -> Iterator[LayerCopies]:
    """The dispatch copies of every MoE layer under ``rule`` (``simulate.layer_copies`` for ``same_node``,
    the engines' rules otherwise): slot, validity and EP rank of each (token, expert)."""
    check_rule(rule)
    if rule == "same_node":
        yield from layer_copies(
            topk_ids_TLK,
            placement=placement,
            batch_T=batch_T,
            src_rank_T=src_rank_T,
            num_batches=num_batches,
            num_ranks=num_ranks,
            ranks_per_node=ranks_per_node,
            policy="same_node",
        )
        return
    ids = np.asarray(topk_ids_TLK)
    p2l = placement.phy2log
    L, P = p2l.shape
    E = placement.logcnt.shape[1]
    per_rank = P // num_ranks
    src = np.asarray(src_rank_T, dtype=np.int64)
    if rule == "vllm":
        rows = token_rows(batch_T, src, num_ranks=num_ranks)
    else:
        dmap = sglang_dispatch_map(p2l, num_experts=E, num_ranks=num_ranks, ranks_per_node=ranks_per_node)
    for l in range(L):
        e = np.asarray(ids[:, l, :], dtype=np.int64)
        valid = e >= 0
        if rule == "vllm":
            slot = vllm_slots(e, phy2log_P=p2l[l], row_T=rows, num_experts=E)
        else:
            slot = np.where(valid, dmap[l][src[:, None], np.where(valid, e, 0)], -1)
        yield LayerCopies(slot_TK=slot, valid_TK=valid, rank_TK=np.where(valid, slot // per_rank, 0))


def rule_tables(
    placement: Placement,
    *,
    rule: ReplicaRule,
    batch_T: np.ndarray,
    src_rank_T: np.ndarray,
    num_ranks: int,
    ranks_per_node: int,
) -> simulate_kernel.RuleTables:
    """The tables ``simulate_kernel.rule_counts`` routes ``rule`` by, the slots ``rule_copies`` picks:
    ``same_node`` the kernel's own policy; ``vllm`` each token's Knuth hash of its row
    (``token_rows``; int64 [T]) into each expert's replicas in ascending slot order; ``sglang`` the
    static map (``sglang_dispatch_map``, int64 [L, W, E]). ``batch_T``, ``src_rank_T``: int [T]."""
    check_rule(rule)
    if rule == "same_node":
        return simulate_kernel.policy_tables(
            placement, num_ranks=num_ranks, ranks_per_node=ranks_per_node, policy="same_node"
        )
    p2l = placement.phy2log
    L, P = p2l.shape
    E = placement.logcnt.shape[1]
    if rule == "sglang":
        dmap = sglang_dispatch_map(p2l, num_experts=E, num_ranks=num_ranks, ranks_per_node=ranks_per_node)
        return simulate_kernel.mapped_tables(placement, dmap)
    per_layer = [_ascending_replicas(p2l[l], E) for l in range(L)]
    M = max((r.shape[1] for r, _ in per_layer), default=1)
    reps_LEM = np.full((L, E, M), -1, dtype=np.int64)
    cnt_LE = np.zeros((L, E), dtype=np.int64)
    for l, (reps, cnt) in enumerate(per_layer):
        reps_LEM[l, :, : reps.shape[1]] = reps
        cnt_LE[l] = cnt
    rows = token_rows(batch_T, np.asarray(src_rank_T, dtype=np.int64), num_ranks=num_ranks)
    return simulate_kernel.hashed_tables(reps_LEM, cnt_LE, (rows * KNUTH) & 0xFFFFFFFF)
