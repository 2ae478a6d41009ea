"""The fused per-layer counts of ``simulate_volume`` and of ``advise``'s ``evaluate_tokens``: one numba
pass over a layer's ``[T, K]`` ids gives everything the volume and step models read, per (batch, GPU).

Per token of a batch (docs/placement.md), in one pass: the slot serving each (token, expert) (the
replica ``replica_routing.choose_slots`` picks: the one replica; ``even``: token index modulo the replica
count; ``same_node``: a replica on the token's node if there is one; ``metro`` is routed by
``choose_slots`` itself and handed in; or the engines' rules of ``eplb_replicas.rule_copies``, from the
tables ``eplb_replicas.rule_tables`` builds in NumPy: vLLM's hash of the token's row as a per-token key
into the expert's replicas, SGLang's static map as a (source GPU, expert) table), the GPU holding it,
the token's distinct GPUs, the slots activated in the batch, and the copies of the copy model
(``step_model.COPY_MODELS``: ``expert``, one per routed slot named once in the row; ``rank``, one per
distinct destination GPU; ``node``, one per GPU on the own node, one RDMA copy per remote node to the
sender's peer there, forwarded over NVLink to that node's other destination GPUs), each counted sent and
received per link class, and each (source, destination) pair of a batch once as a peer. Counts are
integers, so the ``[B, W]`` sums the step model takes of them are the same numbers whatever their order:
``simulate_volume`` and ``evaluate_tokens`` price them with ``step_model.layer_seconds``, bit for bit what
the NumPy passes (``simulate._simulate_volume_reference``, ``advise.evaluate._evaluate_tokens_reference``)
give.

The kernel is compiled on first use (``cache=True``: on disk by numba) and releases the GIL
(``nogil``): callers simulate placements on threads. Without numba (the bare install: ``available`` is
False) or where numba cannot compile the kernel (``analysis.jit`` warns once; ``layer_counts`` and
``rule_counts`` raise ``KernelUnavailable``), the callers run their NumPy passes.

Shape legend (docs/architecture.md): T tokens, L MoE layers (Lc of one chunk), K top-k slots,
E logical experts, P physical slots, M max replicas, B batches, W EP ranks (GPUs), G node groups (= nodes),
Q the counted quantities (``QUANTITIES``).

Out of scope: pricing the counts (``step_model``); the metrics built from them (``simulate``,
``advise.evaluate``); the engines' rules themselves (``eplb_replicas``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from moetrace.placement.maps import Placement
from moetrace.placement.replica_routing import ReplicaPolicy, choose_slots, local_replicas
from moetrace.placement.step_model import DedupUnit, GpuTraffic

__all__ = [
    "CHUNK_CELLS",
    "QUANTITIES",
    "RuleTables",
    "SortedSteps",
    "available",
    "chunk_traffic",
    "hashed_tables",
    "layer_counts",
    "mapped_tables",
    "policy_tables",
    "routing_tables",
    "rule_counts",
    "sorted_steps",
]

#: most (layer, batch, GPU) cells the callers count per kernel call (the int32 counts of a chunk: 44 MiB). Fewer
#: layers per call cost the kernel its cache: a batch's token rows are read once for the chunk's layers (500
#: DeepSeek-V3 decode steps: 108 ns per (token, layer) at 32 layers a call, 135 at 4)
CHUNK_CELLS = 1 << 20

#: what ``layer_counts`` returns along axis Q, each an int32 count per (layer, batch, GPU)
QUANTITIES = (
    "tokens",  # distinct tokens a GPU receives (one per token whatever the copy model)
    "active",  # slots with at least one (token, expert) of the batch
    "pairs",  # (token, expert) pairs the GPU computes
    "send_intra",  # copies sent over NVLink
    "recv_intra",
    "send_inter",  # copies sent over the network
    "recv_inter",
    "peers_send_intra",  # distinct GPUs sent to over NVLink
    "peers_recv_intra",
    "peers_send_inter",
    "peers_recv_inter",
)
_COPIES = {"expert": 0, "rank": 1, "node": 2}
#: how a layer's slots are chosen: the one replica, ``even``, ``same_node``, handed in (``metro``), a
#: per-token key modulo the replica count (vLLM's hash), a (source GPU, expert) map (SGLang's static map)
_ONE, _EVEN, _SAME_NODE, _GIVEN, _HASH, _MAP = 0, 1, 2, 3, 4, 5

_KERNELS: dict[str, Callable[..., Any]] = {}


class SortedSteps(NamedTuple):
    """A step simulation's inputs as every kernel call takes them."""

    ids_TLK: np.ndarray  # int16/32/64 [N, L, K] C-contiguous logical ids (-1: not recorded)
    row_T: np.ndarray  # int64 [T] the row of ``ids_TLK`` holding each token's ids
    batch_T: np.ndarray  # int64 [T] step of each token
    src_rank_T: np.ndarray  # int64 [T] EP rank each token leaves from
    order_T: np.ndarray  # int64 [T] tokens sorted by step (stable)
    start_B1: np.ndarray  # int64 [B + 1] where each step's tokens start in ``order_T``


def sorted_steps(
    topk_ids_TLK: np.ndarray,
    batch_T: np.ndarray,
    src_rank_T: np.ndarray,
    *,
    num_batches: int,
    rows_T: np.ndarray | None = None,
) -> SortedSteps:
    """The ids in a dtype the kernel reads, contiguous, and the tokens grouped by step. ``rows_T``: int
    [T] token t's ids are ``topk_ids_TLK[rows_T[t]]`` (None: row t); ``IndexError`` outside its rows."""
    ids = np.asarray(topk_ids_TLK)
    if ids.dtype not in (np.int16, np.int32, np.int64):
        ids = ids.astype(np.int64)
    batch = np.ascontiguousarray(batch_T, dtype=np.int64)
    if len(src_rank_T) != len(batch):
        raise ValueError(f"src_rank_T has {len(src_rank_T)} entries for {len(batch)} tokens (batch_T)")
    if rows_T is None:
        if len(batch) != len(ids):
            raise ValueError(f"batch_T has {len(batch)} entries for {len(ids)} tokens (topk_ids_TLK)")
        row_T = np.arange(len(batch), dtype=np.int64)
    else:
        row_T = np.ascontiguousarray(rows_T, dtype=np.int64)
        if len(row_T) != len(batch):
            raise ValueError(f"rows_T has {len(row_T)} entries for {len(batch)} tokens")
        if len(row_T) and (row_T.min() < 0 or row_T.max() >= len(ids)):  # the kernel does not check its reads
            raise IndexError(f"rows_T must be in 0..{len(ids) - 1}, the rows of topk_ids_TLK")
    start_B1 = np.zeros(num_batches + 1, dtype=np.int64)
    np.cumsum(np.bincount(batch, minlength=num_batches), out=start_B1[1:])
    return SortedSteps(
        ids_TLK=np.ascontiguousarray(ids),
        row_T=row_T,
        batch_T=batch,
        src_rank_T=np.ascontiguousarray(src_rank_T, dtype=np.int64),
        order_T=np.argsort(batch, kind="stable"),
        start_B1=start_B1,
    )


def chunk_traffic(counts_QLBW: np.ndarray) -> GpuTraffic:
    """The copy model's traffic of a chunk's counts (``QUANTITIES`` 3..10), one row per (layer, batch):
    float64 [Lc * B, W] each, as ``step_model.layer_seconds`` reads it."""
    _, Lc, B, W = counts_QLBW.shape
    return GpuTraffic(*(counts_QLBW[i].reshape(Lc * B, W).astype(np.float64) for i in range(3, 11)))


class KernelUnavailable(RuntimeError):
    """numba is missing or could not compile the kernel: use the NumPy passes."""


def available() -> bool:
    """Whether numba is importable (whether it compiles the kernel, ``layer_counts`` finds out)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel() -> Callable[..., Any]:
    """The numba kernel, compiled on first use (cached on disk by numba)."""
    if "layers" in _KERNELS:
        return _KERNELS["layers"]
    import numba

    @numba.njit(cache=True, nogil=True)
    def layers_kernel(
        ids_TLK, row_T, l0, slots_TLK, mode_L, log2phy_LEM, logcnt_LE, local_LGEM, lcnt_LGE, key_T, map_LWE,
        order_T, start_B1, src_T, rank_of_slot_P, node_of_rank_W, g, copies, out_QLBW,
    ):  # fmt: skip
        # ids_TLK: int [N, L, K] logical ids (< 0: not recorded), token t's in row row_T[t] (int64 [T], checked
        # by the caller: no copy of the drawn rows is made); slots_TLK: int32 [T, Lc, K] slots of
        # the layers whose mode_L is _GIVEN (else unused); key_T: int64 [T] each token's replica key
        # (_HASH); map_LWE: int64 [L, W, E] the slot each source GPU sends each expert to (_MAP);
        # log2phy_LEM, logcnt_LE: each expert's replicas (_HASH: in the order the key indexes);
        # order_T, start_B1: tokens grouped by batch (batch b is order_T[start_B1[b]:start_B1[b + 1]]);
        # src_T: int64 source GPU; rank_of_slot_P, node_of_rank_W: int64 lookups (no division in the
        # loop); out_QLBW: int32 [Q, Lc, B, W] zeros, filled for layers l0 .. l0 + Lc - 1. Returns the
        # number of ids >= E.
        K = ids_TLK.shape[2]
        Lc = out_QLBW.shape[1]
        B = out_QLBW.shape[2]
        W = out_QLBW.shape[3]
        E = logcnt_LE.shape[1]
        P = rank_of_slot_P.shape[0]
        # stamps: the last batch (pairs, activated slots) or token (its slots, GPUs, nodes) that saw each
        pair_stamp_WW = np.zeros(W * W, dtype=np.int32)  # (src, dst) flat
        slot_batch_P = np.zeros(P, dtype=np.int32)
        slot_token_P = np.zeros(P, dtype=np.int64)
        rank_token_W = np.zeros(W, dtype=np.int64)
        node_token_G = np.zeros(W, dtype=np.int64)
        slot_K = np.empty(K, dtype=np.int64)
        dist_K = np.empty(K, dtype=np.int64)  # the token's distinct GPUs
        bad = 0
        serial = 0  # token stamp
        # batch outer, layer inner: a batch's token rows stay in cache while every layer passes
        for b in range(B):
            for li in range(Lc):
                l = l0 + li
                mode = mode_L[l]
                stamp = np.int32(li * B + b + 1)
                tok_W = out_QLBW[0, li, b]  # this (layer, batch)'s row of each quantity
                act_W = out_QLBW[1, li, b]
                pairs_W = out_QLBW[2, li, b]
                send_in_W, recv_in_W = out_QLBW[3, li, b], out_QLBW[4, li, b]
                send_out_W, recv_out_W = out_QLBW[5, li, b], out_QLBW[6, li, b]
                psend_in_W, precv_in_W = out_QLBW[7, li, b], out_QLBW[8, li, b]
                psend_out_W, precv_out_W = out_QLBW[9, li, b], out_QLBW[10, li, b]
                for j in range(start_B1[b], start_B1[b + 1]):
                    t = order_T[j]
                    tr = row_T[t]
                    s = src_T[t]
                    sn = node_of_rank_W[s]
                    serial += 1
                    # the slot of each (token, expert): choose_slots' rule
                    for k in range(K):
                        e = np.int64(ids_TLK[tr, l, k])
                        sl = -1
                        if mode == _GIVEN:
                            sl = np.int64(slots_TLK[t, li, k])
                        elif e >= E:
                            bad += 1
                        elif e >= 0:
                            if mode == _ONE:
                                sl = log2phy_LEM[l, e, 0]
                            elif mode == _HASH:  # vLLM: the token's key modulo the replica count
                                cnt = logcnt_LE[l, e]
                                sl = log2phy_LEM[l, e, key_T[t] % cnt if cnt > 1 else 0]
                            elif mode == _MAP:  # SGLang's static map: one slot per (source GPU, expert)
                                sl = map_LWE[l, s, e]
                            elif mode == _SAME_NODE:  # a replica on the token's node if there is one, else even
                                # (a division only where there is a choice: x % 1 is 0)
                                n_local = lcnt_LGE[l, sn, e]
                                if n_local == 1:
                                    sl = local_LGEM[l, sn, e, 0]
                                elif n_local > 1:
                                    sl = local_LGEM[l, sn, e, t % n_local]
                                else:
                                    cnt = logcnt_LE[l, e]
                                    sl = log2phy_LEM[l, e, t % cnt if cnt > 1 else 0]
                            else:  # even
                                cnt = logcnt_LE[l, e]
                                sl = log2phy_LEM[l, e, t % cnt if cnt > 1 else 0]
                        slot_K[k] = sl
                    # pairs, activated slots, distinct GPUs; the copies of copy models expert (each slot of
                    # the row once) and rank (each distinct GPU once), all sent by s: counted as they come
                    nd = 0
                    sent_in = sent_out = peers_in = peers_out = 0
                    for k in range(K):
                        sl = slot_K[k]
                        if sl < 0:
                            continue
                        r = rank_of_slot_P[sl]
                        pairs_W[r] += 1
                        # branch-free first sightings (data-dependent branches mispredict)
                        act_W[r] += np.int32(slot_batch_P[sl] != stamp)
                        slot_batch_P[sl] = stamp
                        new_rank = np.int32(rank_token_W[r] != serial)
                        rank_token_W[r] = serial
                        dist_K[nd] = r
                        nd += new_rank
                        tok_W[r] += new_rank
                        new_slot = slot_token_P[sl] != serial
                        slot_token_P[sl] = serial
                        if r != s and ((copies == 0 and new_slot) or (copies == 1 and new_rank == 1)):
                            first = np.int32(pair_stamp_WW[s * W + r] != stamp)  # the pair's first copy in the batch
                            pair_stamp_WW[s * W + r] = stamp
                            if node_of_rank_W[r] == sn:  # intra-node
                                sent_in += 1
                                peers_in += first
                                recv_in_W[r] += 1
                                precv_in_W[r] += first
                            else:
                                sent_out += 1
                                peers_out += first
                                recv_out_W[r] += 1
                                precv_out_W[r] += first
                    send_in_W[s] += sent_in
                    send_out_W[s] += sent_out
                    psend_in_W[s] += peers_in
                    psend_out_W[s] += peers_out
                    if copies == 2:  # node: own node direct; one RDMA copy per remote node, then forwarded
                        # (each copy's counting is written out: as an inlined njit helper it measured 230 against
                        # 182 ns per (token, layer), the arrays' reference counting at every call)
                        for i in range(nd):
                            d = dist_K[i]
                            if d == s:
                                continue
                            node = node_of_rank_W[d]
                            if node == sn:  # NVLink, direct
                                first = np.int32(pair_stamp_WW[s * W + d] != stamp)
                                pair_stamp_WW[s * W + d] = stamp
                                send_in_W[s] += 1
                                recv_in_W[d] += 1
                                psend_in_W[s] += first
                                precv_in_W[d] += first
                                continue
                            land = s + (node - sn) * g  # the sender's peer on that node
                            if node_token_G[node] != serial:  # one RDMA copy to it per token
                                node_token_G[node] = serial
                                first = np.int32(pair_stamp_WW[s * W + land] != stamp)
                                pair_stamp_WW[s * W + land] = stamp
                                send_out_W[s] += 1
                                recv_out_W[land] += 1
                                psend_out_W[s] += first
                                precv_out_W[land] += first
                            if land != d:  # forwarded over NVLink there
                                first = np.int32(pair_stamp_WW[land * W + d] != stamp)
                                pair_stamp_WW[land * W + d] = stamp
                                send_in_W[land] += 1
                                recv_in_W[d] += 1
                                psend_in_W[land] += first
                                precv_in_W[d] += first
        return bad

    _KERNELS["layers"] = layers_kernel
    return layers_kernel


def _unavailable(*args: Any) -> int:
    raise KernelUnavailable("the fused simulation kernel could not be compiled")


class RuleTables(NamedTuple):
    """What the kernel routes a layer's (token, expert) pairs by (``policy_tables``, ``hashed_tables``,
    ``mapped_tables``); the arrays a mode does not read are placeholders of one element."""

    mode_L: np.ndarray  # int64 [L] how each layer's slots are chosen (_ONE, _EVEN, ...)
    replicas_LEM: np.ndarray  # int64 [L, E, M] each expert's slots (-1 padded; _HASH indexes them by key)
    count_LE: np.ndarray  # int64 [L, E] each expert's replica count
    local_LGEM: np.ndarray  # int64 [L, G, E, M'] replicas on each node (``same_node``), counts ``lcnt_LGE``
    lcnt_LGE: np.ndarray  # int64 [L, G, E]
    key_T: np.ndarray  # int64 [T] each token's replica key (_HASH)
    map_LWE: np.ndarray  # int64 [L, W, E] the slot each source GPU sends each expert to (_MAP)


def _none() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The placeholders of ``local_LGEM``, ``key_T`` and ``map_LWE`` (int64, one element each)."""
    return np.zeros((1, 1, 1, 1), dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros((1, 1, 1), dtype=np.int64)


def routing_tables(placement: Placement, *, num_ranks: int, ranks_per_node: int, policy: ReplicaPolicy):
    """What the kernel routes by, per layer: ``mode_L`` int64 [L] (how slots are chosen), and for
    ``same_node`` the local replicas ``local_LGEM`` int64 [L, G, E, M'] (-1 padded) with their counts
    ``lcnt_LGE`` int64 [L, G, E] (``replica_routing.local_replicas``; [L, 1, 1, 1] zeros otherwise)."""
    L, P = placement.phy2log.shape
    multi_L = placement.logcnt.max(axis=1, initial=1) > 1
    if multi_L.any() and policy not in ("same_node", "even", "metro"):  # one replica: every policy picks it
        raise ValueError(f"unknown replica policy {policy!r}")
    E = placement.logcnt.shape[1]
    code = {"even": _EVEN, "same_node": _SAME_NODE, "metro": _GIVEN}.get(policy, _ONE)
    mode_L = np.where(multi_L, code, _ONE).astype(np.int64)
    local_LGEM = np.zeros((L, 1, 1, 1), dtype=np.int64)
    lcnt_LGE = np.zeros((L, 1, 1), dtype=np.int64)
    if policy == "same_node" and multi_L.any():
        G = num_ranks // ranks_per_node
        node_of_slot = (np.arange(P) // (P // num_ranks)) // ranks_per_node
        tables = [local_replicas(placement.phy2log[l], node_of_slot, G, E) for l in range(L)]
        M = max(t[0].shape[2] for t in tables)
        local_LGEM = np.full((L, G, E, M), -1, dtype=np.int64)
        lcnt_LGE = np.zeros((L, G, E), dtype=np.int64)
        for l, (local, cnt) in enumerate(tables):
            local_LGEM[l, :, :, : local.shape[2]] = local
            lcnt_LGE[l] = cnt
    return mode_L, local_LGEM, lcnt_LGE


def policy_tables(placement: Placement, *, num_ranks: int, ranks_per_node: int, policy: ReplicaPolicy) -> RuleTables:
    """``RuleTables`` of a ``replica_routing`` policy (``routing_tables``; ``metro``'s slots are handed in)."""
    mode_L, local_LGEM, lcnt_LGE = routing_tables(
        placement, num_ranks=num_ranks, ranks_per_node=ranks_per_node, policy=policy
    )
    return _policy_rule_tables(placement, (mode_L, local_LGEM, lcnt_LGE))


def _policy_rule_tables(placement: Placement, tables: tuple[np.ndarray, np.ndarray, np.ndarray]) -> RuleTables:
    _, key_T, map_LWE = _none()
    return RuleTables(
        tables[0],
        np.ascontiguousarray(placement.log2phy, dtype=np.int64),
        np.ascontiguousarray(placement.logcnt, dtype=np.int64),
        tables[1],
        tables[2],
        key_T,
        map_LWE,
    )


def hashed_tables(replicas_LEM: np.ndarray, count_LE: np.ndarray, key_T: np.ndarray) -> RuleTables:
    """``RuleTables`` where token ``t`` takes replica ``key_T[t] % count`` of each expert, listed in
    ``replicas_LEM`` (int [L, E, M], -1 padded) with ``count_LE`` (int [L, E]) each; ``key_T``: int [T],
    not negative (vLLM's hash of the token's row: ``eplb_replicas.rule_tables``). A layer where every
    expert has one replica takes it."""
    count = np.ascontiguousarray(count_LE, dtype=np.int64)
    local_LGEM, _, map_LWE = _none()
    mode_L = np.where(count.max(axis=1, initial=1) > 1, _HASH, _ONE).astype(np.int64)
    lcnt = np.zeros((1, 1, 1), dtype=np.int64)
    reps = np.ascontiguousarray(replicas_LEM, dtype=np.int64)
    return RuleTables(mode_L, reps, count, local_LGEM, lcnt, np.ascontiguousarray(key_T, dtype=np.int64), map_LWE)


def mapped_tables(placement: Placement, map_LWE: np.ndarray) -> RuleTables:
    """``RuleTables`` where a token from GPU ``w`` sends expert ``e`` of layer ``l`` to slot
    ``map_LWE[l, w, e]`` (int [L, W, E]: SGLang's static dispatch map, ``eplb_replicas.sglang_dispatch_map``).
    A layer where every expert has one replica takes it."""
    local_LGEM, key_T, _ = _none()
    mode_L = np.where(placement.logcnt.max(axis=1, initial=1) > 1, _MAP, _ONE).astype(np.int64)
    return RuleTables(
        mode_L,
        np.ascontiguousarray(placement.log2phy, dtype=np.int64),
        np.ascontiguousarray(placement.logcnt, dtype=np.int64),
        local_LGEM,
        np.zeros((1, 1, 1), dtype=np.int64),
        key_T,
        np.ascontiguousarray(map_LWE, dtype=np.int64),
    )


def layer_counts(
    ids_TLK: np.ndarray,
    *,
    layers: tuple[int, int],
    placement: Placement,
    tables: tuple[np.ndarray, np.ndarray, np.ndarray],
    order_T: np.ndarray,
    start_B1: np.ndarray,
    batch_T: np.ndarray,
    src_rank_T: np.ndarray,
    num_ranks: int,
    ranks_per_node: int,
    dedup: DedupUnit,
    policy: ReplicaPolicy,
    row_T: np.ndarray | None = None,
    buffer: np.ndarray | None = None,
) -> np.ndarray:
    """The ``QUANTITIES`` of layers ``layers = (l0, l1)``, int32 [Q, l1 - l0, B, W].

    ``ids_TLK``: int16/int32/int64 [N, L, K] logical ids (< 0 not recorded; C-contiguous), token t's in
    row ``row_T[t]`` (``sorted_steps``' int64 [T], in range; None: row t); ``tables``:
    ``routing_tables``' three arrays; ``order_T``, ``start_B1``: int64 tokens grouped by batch and the
    start of each batch's run [B + 1]; ``batch_T``, ``src_rank_T``: int64 [T] (``batch_T`` only to route
    ``metro``). Raises ``KernelUnavailable`` where numba cannot run the kernel, ``IndexError`` on an id
    >= E (as ``choose_slots`` would).
    """
    l0, l1 = layers
    T, K = len(src_rank_T), ids_TLK.shape[2]
    B, W = len(start_B1) - 1, num_ranks
    rt = _policy_rule_tables(placement, tables)
    slots_TLK = None
    if (rt.mode_L[l0:l1] == _GIVEN).any():  # metro: choose_slots routes, the kernel counts
        slots_TLK = np.empty((T, l1 - l0, K), dtype=np.int32)
        for li, l in enumerate(range(l0, l1)):
            slots_TLK[:, li, :] = choose_slots(
                ids_TLK[:, l, :] if row_T is None else ids_TLK[row_T, l, :],
                phy2log_P=placement.phy2log[l],
                log2phy_EM=placement.log2phy[l],
                logcnt_E=placement.logcnt[l],
                src_node_T=src_rank_T // ranks_per_node,
                batch_T=batch_T,
                num_batches=B,
                num_ranks=W,
                ranks_per_node=ranks_per_node,
                policy=policy,
            )
    return rule_counts(
        ids_TLK,
        layers=layers,
        tables=rt,
        num_slots=placement.phy2log.shape[1],
        order_T=order_T,
        start_B1=start_B1,
        src_rank_T=src_rank_T,
        num_ranks=num_ranks,
        ranks_per_node=ranks_per_node,
        dedup=dedup,
        slots_TLK=slots_TLK,
        row_T=row_T,
        buffer=buffer,
    )


def rule_counts(
    ids_TLK: np.ndarray,
    *,
    layers: tuple[int, int],
    tables: RuleTables,
    num_slots: int,
    order_T: np.ndarray,
    start_B1: np.ndarray,
    src_rank_T: np.ndarray,
    num_ranks: int,
    ranks_per_node: int,
    dedup: DedupUnit,
    slots_TLK: np.ndarray | None = None,
    row_T: np.ndarray | None = None,
    buffer: np.ndarray | None = None,
) -> np.ndarray:
    """The ``QUANTITIES`` of layers ``layers = (l0, l1)`` routed by ``tables``, int32 [Q, l1 - l0, B, W].

    ``ids_TLK``: int16/int32/int64 [N, L, K] logical ids (< 0 not recorded; C-contiguous), token t's in
    row ``row_T[t]`` (int64 [T], in range: ``sorted_steps`` checks it; None: row t); ``num_slots``:
    P, the slots of the placement; ``order_T``, ``start_B1``: int64 tokens grouped by batch and the start
    of each batch's run [B + 1]; ``src_rank_T``: int64 [T]; ``slots_TLK``: int32 [T, l1 - l0, K] the
    slots of the layers whose mode is handed in (None: none is); ``buffer``: int32, C-contiguous, the memory of
    the result when it is large enough (a caller's, reused between calls; None: a new array). Raises
    ``KernelUnavailable`` where numba cannot run the kernel, ``IndexError`` on an id >= E.
    """
    from moetrace.analysis.jit import run_kernel

    l0, l1 = layers
    B, W, P = len(start_B1) - 1, num_ranks, num_slots
    shape = (len(QUANTITIES), l1 - l0, B, W)
    size = len(QUANTITIES) * (l1 - l0) * B * W
    out_QLBW: np.ndarray
    if buffer is None or buffer.size < size:
        out_QLBW = np.zeros(shape, dtype=np.int32)
    else:  # the caller's memory, reused from call to call (44 MiB a call: fresh pages cost their clearing)
        out_QLBW = buffer.reshape(-1)[:size].reshape(shape)
        out_QLBW.fill(0)
    if row_T is None:
        row_T = np.arange(len(src_rank_T), dtype=np.int64)
    bad = run_kernel(
        "simulate-layers",
        _kernel,
        _unavailable,
        ids_TLK,
        row_T,
        l0,
        np.zeros((1, 1, 1), dtype=np.int32) if slots_TLK is None else slots_TLK,
        tables.mode_L,
        tables.replicas_LEM,
        tables.count_LE,
        tables.local_LGEM,
        tables.lcnt_LGE,
        tables.key_T,
        tables.map_LWE,
        order_T,
        start_B1,
        src_rank_T,
        np.arange(P) // (P // W),
        np.arange(W) // ranks_per_node,
        ranks_per_node,
        _COPIES[dedup],
        out_QLBW,
    )
    if bad:
        raise IndexError(f"{bad} expert ids of layers {l0}..{l1 - 1} are >= num_experts={tables.count_LE.shape[1]}")
    return out_QLBW
