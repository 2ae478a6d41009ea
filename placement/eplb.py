"""DeepSeek's expert-parallelism load balancer (EPLB), re-implemented in vectorized numpy.

The algorithm of deepseek-ai/EPLB ``eplb.py``: replicate the heaviest experts greedily (min-max
load per replica), pack expert groups onto nodes, then pack replicas onto GPUs (LPT greedy with an
equal count per pack). The hierarchical policy runs when expert groups divide evenly over nodes;
otherwise the global policy (the same routine with one group and one node). Loops run over items and
replicas only, never over layers.

Which summation (``accumulate``): every engine casts the load to float32 and sums expert groups
in float32; they differ in how a pack's weight accumulates while packing. DeepSeek's reference adds
torch float32 scalars (``pack_weights[pack] += weight[i, group]``); the engines that run EPLB add
in float64: SGLang 0.5.23's copy (``python/sglang/srt/eplb/eplb_algorithms/deepseek.py``: Python
floats from ``weight.tolist()``) and vLLM 0.33.0's (``vllm/distributed/eplb/policy/default.py``: a
float64 ``pack_weights`` array). Where two packs' sums fall within a float32 rounding of each other,
the next item goes to another GPU, so on the same tie-free load the reference and the engines
place some layers differently (``tests/golden/eplb_engines.json``: up to 13 of 300 random
DeepSeek-V3 layers). ``accumulate="float64"`` (the default) computes it as SGLang and vLLM do;
``accumulate="float32"`` as DeepSeek's reference. Beyond the packing sums, vLLM divides loads by
replica counts in float64 (``weight / logcnt`` with an int64 count) where SGLang, the reference and
moetrace divide in float32; the two engines can differ from each other only where two per-replica
loads are within a float32 rounding (never on the golden file's loads), and there moetrace follows
SGLang.

Where the output may differ from DeepSeek's with ``accumulate="float32"`` (``tests/golden/eplb_deepseek.json``
holds their outputs on 161 cases; ``tests/test_placement_eplb.py`` checks each statement below): both packing
steps sort items heaviest first, and only the order of items of *equal* weight can differ. Ours
puts the lower index first. DeepSeek's uses torch's unstable sort, which promises no order for
ties: torch's CPU build with libstdc++ keeps index order for up to 16 items (its insertion-sort
threshold) and not beyond. So the outputs are identical when every sort has at most 16 items
(slots of a node, ``num_replicas / num_nodes``, or all ``num_replicas`` under the global policy;
no sort at all with one slot per GPU) or holds no equal weights. Otherwise:

- the replicas of one expert always weigh the same, so their order in ``log2phy[l, e]`` (replica
  rank → slot) may differ; the set of slots, ``phy2log`` and ``logcnt`` do not;
- two different experts of one node with the same load per replica (integer or zero loads) may
  trade slots: ``phy2log`` differs, each GPU's multiset of per-replica loads does not;
- with more than 16 expert groups (hierarchical policy), groups of the same total load may go to
  other nodes: ``logcnt`` and ``phy2log`` may differ, each node's total load does not.

The replication step breaks ties the same way in both (first expert).

Shape legend (docs/architecture.md): L MoE layers, E logical experts, P physical slots
(replicas), M max replicas per expert, N rows of a batched sub-problem; inside one sub-problem
n items and m packs (lower case: local to this module), ``_`` any number of columns.

Out of scope: predicting load (pass a measured or averaged ``load_LE``), routing tokens among
replicas (``replica_routing``), migration cost.
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.maps import Placement

__all__ = ["ACCUMULATE", "ACCUMULATE_WHO", "Accumulate", "balanced_packing", "rebalance", "replicate_experts"]

#: how pack weights accumulate: float64 as SGLang and vLLM, float32 as DeepSeek's reference (module docstring)
Accumulate = Literal["float64", "float32"]
ACCUMULATE: tuple[str, ...] = get_args(Accumulate)
#: who sums that way, as outputs name it
ACCUMULATE_WHO: dict[str, str] = {"float64": "as SGLang and vLLM", "float32": "as DeepSeek's reference"}


def _take_rows(a_N_: np.ndarray, idx_N_: np.ndarray) -> np.ndarray:
    """``np.take_along_axis(a_N_, idx_N_, axis=1)`` as one flat gather (about 2x faster)."""
    N, cols = a_N_.shape
    return np.ascontiguousarray(a_N_).reshape(-1)[idx_N_ + (np.arange(N, dtype=np.int64) * cols)[:, None]]


def _put_rows(out_N_: np.ndarray, idx_N_: np.ndarray, values_N_: np.ndarray) -> None:
    """``np.put_along_axis(out_N_, idx_N_, values_N_, axis=1)`` as one flat scatter (out contiguous)."""
    N, cols = out_N_.shape
    out_N_.reshape(-1)[idx_N_ + (np.arange(N, dtype=np.int64) * cols)[:, None]] = values_N_


def _argsort_desc(weight_Nn: np.ndarray) -> np.ndarray:
    """``np.argsort(-weight_Nn, axis=1, kind="stable")``: heaviest first, lower index first on ties.

    float32 (what EPLB uses) sorts unique int64 keys (32 descending-order bits, then the 31-bit
    index), ~4x faster than numpy's stable float sort; other dtypes use that sort.
    """
    n = weight_Nn.shape[1]
    if weight_Nn.dtype != np.float32 or n >= 2**31:
        return np.argsort(-weight_Nn, axis=1, kind="stable")
    bits = (weight_Nn + np.float32(0)).view(np.int32).astype(np.int64)  # + 0 folds -0.0 into +0.0
    desc = 0x7FFFFFFF - (bits ^ ((bits >> 31) & 0x7FFFFFFF))  # in [0, 2**32), ascending as w descends
    return np.sort((desc << 31) | np.arange(n, dtype=np.int64), axis=1) & 0x7FFFFFFF


def balanced_packing(
    weight_Nn: np.ndarray, num_packs: int, *, accumulate: Accumulate | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Pack n weighted items into ``num_packs`` packs of exactly n/m items each, balancing weight.

    Items are taken heaviest first (lower index first on equal weight) and each goes to the
    lightest pack that still has room (first such pack on ties); pack weights accumulate in
    ``accumulate`` (None: the weights' dtype; no NaN). Returns ``pack_index_Nn`` and
    ``rank_in_pack_Nn`` (int64 [N, n]). The greedy is sequential over the n items and vectorized
    over the N rows; each step touches one pack per row, and a full pack's key becomes +inf instead
    of masking every step.
    """
    N, n = weight_Nn.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(n), (N, n)).copy(), np.zeros((N, n), dtype=np.int64)
    acc = weight_Nn.dtype if accumulate is None else np.dtype(accumulate)
    order_Nn = _argsort_desc(weight_Nn)  # the order of the weights as given (float32 in every engine)
    w_nN = np.ascontiguousarray(_take_rows(weight_Nn, order_Nn).T).astype(acc, copy=False)  # j-th heaviest per row
    # key_Nm: weight of each pack, +inf once it is full (so argmin never picks it again)
    key_Nm = np.zeros((N, num_packs), dtype=acc)
    key_flat = key_Nm.reshape(-1)
    cnt_flat = np.zeros(N * num_packs, dtype=np.int64)
    full_on = np.zeros(per_pack, dtype=acc)  # added to a pack's key when it gets item c + 1
    full_on[per_pack - 1] = np.inf
    row_off = np.arange(N, dtype=np.int64) * num_packs
    pack_nN = np.empty((n, N), dtype=np.int64)
    rank_nN = np.zeros((n, N), dtype=np.int64)
    start = 0
    if num_packs <= n and (w_nN[:num_packs] > 0).all():
        # the m heaviest items, all positive, land in packs 0..m-1 in turn (each later pack is empty)
        pack_nN[:num_packs] = np.arange(num_packs)[:, None]
        key_Nm[:] = w_nN[:num_packs].T
        cnt_flat[:] = 1
        start = num_packs
    for j in range(start, n):
        pack = key_Nm.argmin(axis=1)
        pack_nN[j] = pack
        flat = pack + row_off
        cnt = cnt_flat[flat]
        rank_nN[j] = cnt
        cnt_flat[flat] = cnt + 1
        key_flat[flat] = (key_flat[flat] + w_nN[j]) + full_on[cnt]
    pack_index = np.empty((N, n), dtype=np.int64)
    rank_in_pack = np.empty((N, n), dtype=np.int64)
    _put_rows(pack_index, order_Nn, np.ascontiguousarray(pack_nN.T))
    _put_rows(rank_in_pack, order_Nn, np.ascontiguousarray(rank_nN.T))
    return pack_index, rank_in_pack


def replicate_experts(weight_NE: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Add ``num_phy - E`` replicas, each to the expert with the largest load per replica.

    The first expert wins ties. Returns ``phy2log_NP`` (expert of each replica), ``rank_NP``
    (replica index of that expert) and ``logcnt_NE`` (replicas per expert), all int64. Each step
    recomputes load per replica only for the expert that just gained one (same values as
    recomputing ``weight / logcnt`` in full).
    """
    N, E = weight_NE.shape
    phy2log = np.broadcast_to(np.arange(num_phy, dtype=np.int64), (N, num_phy)).copy()
    rank = np.zeros((N, num_phy), dtype=np.int64)
    logcnt = np.ones((N, E), dtype=np.int64)
    cnt_flat = logcnt.reshape(-1)
    w_flat = np.ascontiguousarray(weight_NE).reshape(-1)
    per_replica = weight_NE / logcnt.astype(weight_NE.dtype)  # [N, E] load per replica
    per_replica_flat = per_replica.reshape(-1)
    row_off = np.arange(N, dtype=np.int64) * E
    for i in range(E, num_phy):
        best = per_replica.argmax(axis=1)
        phy2log[:, i] = best
        flat = best + row_off
        cnt = cnt_flat[flat]
        rank[:, i] = cnt
        cnt += 1
        cnt_flat[flat] = cnt
        per_replica_flat[flat] = w_flat[flat] / cnt.astype(weight_NE.dtype)
    return phy2log, rank, logcnt


def _inverse(perm_N_: np.ndarray) -> np.ndarray:
    inv = np.empty(perm_N_.shape, dtype=perm_N_.dtype)
    _put_rows(inv, perm_N_, np.broadcast_to(np.arange(perm_N_.shape[1]), perm_N_.shape))
    return inv


def _hierarchical(
    weight_LE: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int, accumulate: Accumulate
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    L, E = weight_LE.shape
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_phy // num_gpus

    # Step 1: pack expert groups onto nodes
    tokens_per_group = weight_LE.reshape(L, num_groups, group_size).sum(-1)
    g_pack, g_rank = balanced_packing(tokens_per_group, num_nodes, accumulate=accumulate)
    log2mlog = (((g_pack * groups_per_node + g_rank) * group_size)[:, :, None] + np.arange(group_size)).reshape(L, E)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicate experts within each node
    tokens_per_mlog = _take_rows(weight_LE, mlog2log).reshape(L * num_nodes, E // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_phy // num_nodes)

    # Step 3: pack replicas onto the GPUs of each node
    tokens_per_phy = _take_rows(tokens_per_mlog / mlogcnt.astype(np.float32), phy2mlog)
    pack, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes, accumulate=accumulate)
    pphy2phy = _inverse(pack * phy_per_gpu + rank_in_pack)

    pphy2mlog = _take_rows(phy2mlog, pphy2phy)
    pphy2mlog = (pphy2mlog.reshape(L, num_nodes, -1) + np.arange(0, E, E // num_nodes)[None, :, None]).reshape(L, -1)
    pphy2log = _take_rows(mlog2log, pphy2mlog)
    pphyrank = _take_rows(phyrank, pphy2phy).reshape(L, -1)
    logcnt = _take_rows(mlogcnt.reshape(L, -1), log2mlog)
    return pphy2log, pphyrank, logcnt


def rebalance(
    load_LE: np.ndarray,
    *,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    accumulate: Accumulate = "float64",
) -> Placement:
    """EPLB placement of ``load_LE`` (float [L, E], tokens per expert) on ``num_replicas`` slots.

    ``num_groups``: expert groups of a group-limited router (DeepSeek-V3: 8; 1 when the router has
    none). Hierarchical policy when ``num_groups % num_nodes == 0`` and the groups divide E evenly
    (where they do not, DeepSeek's code stops on an assertion), global otherwise. Slot ``p``
    lives on GPU ``p // (num_replicas / num_gpus)``. ``accumulate``: how pack weights sum,
    ``"float64"`` as SGLang and vLLM compute it, ``"float32"`` as DeepSeek's reference (module
    docstring). Returns ``Placement(phy2log [L, P], log2phy [L, E, M], logcnt [L, E])`` with EPLB's
    replica ranks.
    """
    if accumulate not in ACCUMULATE:
        raise ConfigError(f"accumulate={accumulate!r}: one of {', '.join(ACCUMULATE)}")
    load = np.asarray(load_LE, dtype=np.float32)  # every EPLB casts to float32 first; ties break the same way
    if load.ndim != 2:
        raise ConfigError(f"load must be [layers, experts], got shape {load.shape}")
    L, E = load.shape
    if not np.isfinite(load).all():
        raise ConfigError("load has NaN or infinite entries: pass finite token counts per (layer, expert)")
    if num_replicas < E or num_replicas % num_gpus:
        raise ConfigError(f"num_replicas={num_replicas} must be >= {E} experts and a multiple of num_gpus={num_gpus}")
    if num_gpus % num_nodes:
        raise ConfigError(f"num_gpus={num_gpus} must be a multiple of num_nodes={num_nodes}")
    hierarchical = num_groups % num_nodes == 0 and E % num_groups == 0  # then nodes divide E and P too
    if hierarchical:
        phy2log, phyrank, logcnt = _hierarchical(load, num_replicas, num_groups, num_nodes, num_gpus, accumulate)
    else:
        phy2log, phyrank, logcnt = _hierarchical(load, num_replicas, 1, 1, num_gpus, accumulate)
    M = int(logcnt.max())
    log2phy = np.full((L, E * M), -1, dtype=np.int64)
    _put_rows(log2phy, phy2log * M + phyrank, np.broadcast_to(np.arange(num_replicas), (L, num_replicas)))
    return Placement(phy2log, log2phy.reshape(L, E, M), logcnt)
