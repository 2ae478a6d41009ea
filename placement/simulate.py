"""All-to-all volume model of expert-parallel decode (docs/placement.md), vectorized over tokens.

A global batch is one decode step of held-out requests: each contributes one token, dispatched
at every MoE layer from its source GPU to the GPUs holding its k experts (replica chosen by a
``replica_routing`` policy) and combined back. Which copies travel is the copy model of the dedup
unit (``step_model.COPY_MODELS``): ``expert`` (one copy per routed expert), ``rank`` (default: one
per distinct GPU), ``node`` (one RDMA copy per remote node, landing on the sender's peer GPU there
and forwarded over NVLink; one per distinct GPU on the own node). A copy to the token's own GPU
moves nothing; a copy is inter-node when its two GPUs are on different nodes. The byte metrics
count those copies at ``bytes_per_token`` each; the step time (``cost``) prices the same copies.
Combine sends the same copies back, so its totals equal dispatch; its largest per-GPU send is
counted at the expert side.

Per (batch, layer) the model reports: intra/inter-node bytes for dispatch and combine, the largest
per-GPU send of each, distinct tokens received per GPU (max, mean) and activated experts (slots
with at least one token) per GPU (max, mean).

Shape legend (docs/architecture.md): T tokens, L MoE layers, K top-k slots, B batches, W EP ranks
(GPUs), P physical slots.

How: ``simulate_kernel`` counts each layer in one fused numba pass (where numba runs) and
``step_model.layer_seconds`` prices the counts; ``_simulate_volume_reference`` is the same model as NumPy
passes (``choose_slots``, the copy model's ``traffic``), the reference the kernel is tested against bit for
bit and what runs without numba.

Out of scope: choosing placements or batches (``compare``); per-GPU send matrices and real collectives
(``replay``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from moetrace.placement import simulate_kernel
from moetrace.placement.hardware import CostModel
from moetrace.placement.maps import Placement
from moetrace.placement.replica_routing import ReplicaPolicy, choose_slots
from moetrace.placement.step_model import DedupUnit, copy_model, layer_seconds

__all__ = ["DedupUnit", "LayerCopies", "METRICS", "TIME_METRICS", "layer_copies", "simulate_volume"]

#: metric names, each an array [B, L]
METRICS = (
    "dispatch_intra_bytes",
    "dispatch_inter_bytes",
    "combine_intra_bytes",
    "combine_inter_bytes",
    "max_rank_dispatch_send_bytes",
    "max_rank_combine_send_bytes",
    "tokens_per_rank_max",
    "tokens_per_rank_mean",
    "activated_experts_per_rank_max",
    "activated_experts_per_rank_mean",
)

#: most (layer, batch, GPU) cells ``simulate_volume`` prices at a time (a kernel call's layers, a few at a time):
#: the step model's float64 temporaries, 1 MiB each, then come from the allocator's heap, not fresh pages
#: (the kernel's 44 MiB chunks priced whole cost compare ~2 s of page clearing)
PRICE_CELLS = 1 << 17

#: with a cost model (``cost``): seconds per (batch, layer), the busiest GPU of each phase charged
TIME_METRICS = (
    "dispatch_seconds",
    "combine_seconds",
    "expert_seconds",  # NaN when the model's expert size is unknown
    "moe_seconds",  # dispatch + expert + combine (NaN with expert_seconds)
)

_SENTINEL = np.int64(1 << 40)  # sorts after every real rank


class LayerCopies(NamedTuple):
    """Where one MoE layer's tokens are routed (every array [T, K], in the routing's slot order). Which
    copies travel is the copy model's (``step_model.COPY_MODELS``), from these."""

    slot_TK: np.ndarray  # int64 physical slot serving each (token, expert); -1 where not recorded
    valid_TK: np.ndarray  # bool: the id was recorded
    rank_TK: np.ndarray  # int64 EP rank holding the slot (0 where not valid)


def layer_copies(topk_ids_TLK: np.ndarray, **routing: Any) -> Iterator[LayerCopies]:
    """The dispatch copies of every MoE layer in turn: the routing of ``simulate_volume``, shared with
    ``a2a.send_matrices``. ``topk_ids_TLK``: int [T, L, K]; ``routing``: the keyword arguments of
    ``simulate_volume`` but ``bytes_per_token`` (placement, batch_T, src_rank_T, num_batches,
    num_ranks, ranks_per_node, dedup, policy)."""
    ids = np.asarray(topk_ids_TLK)
    pl = routing.pop("placement")
    for l in range(ids.shape[1]):
        yield _dispatch_copies(
            ids[:, l, :], phy2log_P=pl.phy2log[l], log2phy_EM=pl.log2phy[l], logcnt_E=pl.logcnt[l], **routing
        )


def _dispatch_copies(
    topk_ids_TK: np.ndarray,
    *,
    phy2log_P: np.ndarray,
    log2phy_EM: np.ndarray,
    logcnt_E: np.ndarray,
    batch_T: np.ndarray,
    src_rank_T: np.ndarray,
    num_batches: int,
    num_ranks: int,
    ranks_per_node: int,
    dedup: DedupUnit = "rank",
    policy: ReplicaPolicy = "same_node",
) -> LayerCopies:
    """The slot and GPU serving each (token, expert) of one layer (the one routing rule of this module).

    ``topk_ids_TK``: int [T, K] logical ids (-1 ignored); ``batch_T``, ``src_rank_T``: int64 [T];
    the placement arrays of this layer (``phy2log_P`` [P], ``log2phy_EM`` [E, M], ``logcnt_E`` [E]).
    ``dedup`` names the copy model the caller prices with; the routing does not depend on it.
    """
    del dedup
    src_rank_T = np.asarray(src_rank_T, dtype=np.int64)
    W = num_ranks
    per_rank = len(phy2log_P) // W
    slot = choose_slots(
        topk_ids_TK,
        phy2log_P=phy2log_P,
        log2phy_EM=log2phy_EM,
        logcnt_E=logcnt_E,
        src_node_T=src_rank_T // ranks_per_node,
        batch_T=batch_T,
        num_batches=num_batches,
        num_ranks=W,
        ranks_per_node=ranks_per_node,
        policy=policy,
    )
    valid = slot >= 0
    return LayerCopies(slot_TK=slot, valid_TK=valid, rank_TK=np.where(valid, slot // per_rank, 0))


def simulate_volume(
    topk_ids_TLK: np.ndarray,
    *,
    placement: Placement,
    batch_T: np.ndarray,
    src_rank_T: np.ndarray,
    num_batches: int,
    num_ranks: int,
    ranks_per_node: int,
    bytes_per_token: int,
    dedup: DedupUnit = "rank",
    policy: ReplicaPolicy = "same_node",
    cost: CostModel | None = None,
    time_hidden_size: int | None = None,
    rows_T: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Traffic of every (batch, layer); each metric float64 [B, L] (bytes, tokens or experts), and
    with ``cost`` the ``TIME_METRICS`` in seconds (``step_model.layer_seconds`` with the kernel
    ``cost`` has for ``dedup``; a copy carries ``time_hidden_size`` values, default
    ``bytes_per_token / 2``, in the kernel's value types).

    ``topk_ids_TLK``: int [T, L, K] logical expert ids (-1 ignored); ``batch_T``: batch of each token
    (0..B-1); ``src_rank_T``: GPU (EP rank) the token leaves from. ``rows_T``: int [T'] the tokens
    drawn, as rows of ``topk_ids_TLK`` (token t is row ``rows_T[t]``; ``batch_T`` and ``src_rank_T``
    are then [T']): the result of ``topk_ids_TLK[rows_T]`` without that copy (a decode simulation's
    draws are 119 MB of DeepSeek-V3 ids, written and freed per placement).

    Counted by ``simulate_kernel`` (one fused pass per layer, GIL released) where numba runs, else by
    the NumPy passes (``_simulate_volume_reference``); the two give the same arrays bit for bit.
    """
    kw: dict[str, Any] = dict(
        placement=placement,
        batch_T=batch_T,
        src_rank_T=src_rank_T,
        num_batches=num_batches,
        num_ranks=num_ranks,
        ranks_per_node=ranks_per_node,
        bytes_per_token=bytes_per_token,
        dedup=dedup,
        policy=policy,
        cost=cost,
        time_hidden_size=time_hidden_size,
    )

    def reference() -> dict[str, np.ndarray]:
        return _simulate_volume_reference(topk_ids_TLK if rows_T is None else np.asarray(topk_ids_TLK)[rows_T], **kw)

    if simulate_kernel.available():
        try:
            return _simulate_volume_fused(topk_ids_TLK, rows_T=rows_T, **kw)
        except simulate_kernel.KernelUnavailable:  # these inputs or this numba: the NumPy passes, same bits
            return reference()
    return reference()


def _simulate_volume_fused(
    topk_ids_TLK: np.ndarray,
    *,
    placement: Placement,
    batch_T: np.ndarray,
    src_rank_T: np.ndarray,
    num_batches: int,
    num_ranks: int,
    ranks_per_node: int,
    bytes_per_token: int,
    dedup: DedupUnit = "rank",
    policy: ReplicaPolicy = "same_node",
    cost: CostModel | None = None,
    time_hidden_size: int | None = None,
    rows_T: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """``simulate_volume`` from ``simulate_kernel.layer_counts``, a chunk of layers at a time: the same
    metrics and the same ``layer_seconds`` call over the chunk's (layer, batch) rows (every step-model
    formula is per row, so stacking rows changes no value)."""
    B, W, g = num_batches, num_ranks, ranks_per_node
    steps = simulate_kernel.sorted_steps(topk_ids_TLK, batch_T, src_rank_T, num_batches=B, rows_T=rows_T)
    ids, batch_T, src_rank_T = steps.ids_TLK, steps.batch_T, steps.src_rank_T
    T, (L, K) = len(batch_T), ids.shape[1:]
    copy_model(dedup)  # an unknown copy model fails here as in the reference
    P = placement.phy2log.shape[1]
    if W < 1 or g < 1 or P % W or W % g:  # the reference fails on these too (its reshapes)
        raise ValueError(f"{P} slots must divide over {W} EP ranks, and those over nodes of {g} GPUs")
    if T and (batch_T.min() < 0 or batch_T.max() >= B or src_rank_T.min() < 0 or src_rank_T.max() >= W):
        raise ValueError(f"batch_T must be in 0..{B - 1} and src_rank_T in 0..{W - 1}")
    out = {m: np.zeros((B, L)) for m in METRICS + (TIME_METRICS if cost is not None else ())}
    tokens_BW = np.bincount(batch_T * W + src_rank_T, minlength=B * W).reshape(B, W)  # shared experts' tokens
    tables = simulate_kernel.routing_tables(placement, num_ranks=W, ranks_per_node=g, policy=policy)
    step = max(1, simulate_kernel.CHUNK_CELLS // max(B * W, 1))
    sub = max(1, PRICE_CELLS // max(B * W, 1))
    if policy == "metro":  # choose_slots' slots of a chunk are held too (int32 [T, chunk, K])
        step = max(1, min(step, simulate_kernel.CHUNK_CELLS * 16 // max(T * K, 1)))
    buffer = np.empty(len(simulate_kernel.QUANTITIES) * min(step, L) * B * W, dtype=np.int32)  # every call's counts
    for l0 in range(0, L, step):
        l1 = min(L, l0 + step)
        Lc = l1 - l0
        q = simulate_kernel.layer_counts(
            ids,
            layers=(l0, l1),
            placement=placement,
            tables=tables,
            order_T=steps.order_T,
            start_B1=steps.start_B1,
            batch_T=batch_T,
            src_rank_T=src_rank_T,
            num_ranks=W,
            ranks_per_node=g,
            dedup=dedup,
            policy=policy,
            row_T=steps.row_T,
            buffer=buffer,
        )
        for a in range(0, Lc, sub):  # priced a few layers at a time: their float64 copies are reused heap memory
            b = min(Lc, a + sub)
            _price_counts(
                out,
                q[:, a:b],
                cols=slice(l0 + a, l0 + b),
                tokens_BW=tokens_BW,
                bytes_per_token=bytes_per_token,
                ranks_per_node=g,
                dedup=dedup,
                cost=cost,
                time_hidden_size=time_hidden_size,
            )
    return out


def _price_counts(
    out: dict[str, np.ndarray],
    q: np.ndarray,
    *,
    cols: slice,
    tokens_BW: np.ndarray,
    bytes_per_token: int,
    ranks_per_node: int,
    dedup: DedupUnit,
    cost: CostModel | None,
    time_hidden_size: int | None,
) -> None:
    """The metrics of the layers ``cols`` from their counts ``q`` (int32 [Q, Lc, B, W], ``simulate_kernel``'s
    ``QUANTITIES``), written into ``out``'s [B, L] arrays (the step model's formulas are per (layer, batch)
    row: any split of the layers gives the same values)."""
    _, Lc, B, W = q.shape
    tok_LBW, nact_LBW, pairs_LBW = q[0], q[1], q[2]
    out["tokens_per_rank_max"][:, cols] = tok_LBW.max(2).T
    out["tokens_per_rank_mean"][:, cols] = tok_LBW.mean(2).T
    out["activated_experts_per_rank_max"][:, cols] = nact_LBW.max(2).T
    out["activated_experts_per_rank_mean"][:, cols] = nact_LBW.mean(2).T
    traffic = simulate_kernel.chunk_traffic(q)
    n_intra = traffic.intra_copies_B().reshape(Lc, B).T
    n_inter = traffic.inter_copies_B().reshape(Lc, B).T
    out["dispatch_intra_bytes"][:, cols] = n_intra * bytes_per_token
    out["dispatch_inter_bytes"][:, cols] = n_inter * bytes_per_token
    out["combine_intra_bytes"][:, cols] = n_intra * bytes_per_token  # the same copies back
    out["combine_inter_bytes"][:, cols] = n_inter * bytes_per_token
    send = (traffic.send_intra + traffic.send_inter).max(1).reshape(Lc, B).T
    recv = (traffic.recv_intra + traffic.recv_inter).max(1).reshape(Lc, B).T
    out["max_rank_dispatch_send_bytes"][:, cols] = send * bytes_per_token
    out["max_rank_combine_send_bytes"][:, cols] = recv * bytes_per_token
    if cost is not None:
        secs = layer_seconds(
            traffic,
            kernel=cost.kernel(dedup),
            hidden_size=time_hidden_size or bytes_per_token // 2,
            ranks_per_node=ranks_per_node,
            expert=cost.expert,
            pairs_BW=pairs_LBW.reshape(Lc * B, W),
            active_BW=nact_LBW.reshape(Lc * B, W),
            tokens_BW=np.tile(tokens_BW, (Lc, 1)),
        )
        out["dispatch_seconds"][:, cols] = secs.dispatch.reshape(Lc, B).T
        out["combine_seconds"][:, cols] = secs.combine.reshape(Lc, B).T
        out["expert_seconds"][:, cols] = secs.expert.reshape(Lc, B).T  # NaN when the expert size is unknown
        out["moe_seconds"][:, cols] = secs.moe.reshape(Lc, B).T


def _simulate_volume_reference(
    topk_ids_TLK: np.ndarray,
    *,
    placement: Placement,
    batch_T: np.ndarray,
    src_rank_T: np.ndarray,
    num_batches: int,
    num_ranks: int,
    ranks_per_node: int,
    bytes_per_token: int,
    dedup: DedupUnit = "rank",
    policy: ReplicaPolicy = "same_node",
    cost: CostModel | None = None,
    time_hidden_size: int | None = None,
) -> dict[str, np.ndarray]:
    """``simulate_volume`` by NumPy passes per layer (``choose_slots``, the copy model's ``traffic``, sorts
    and bincounts): the reference the fused kernel is tested against, and what runs without numba."""
    ids = np.asarray(topk_ids_TLK)
    T, L, K = ids.shape
    B, W = num_batches, num_ranks
    P = placement.phy2log.shape[1]
    per_rank = P // W
    batch_T = np.asarray(batch_T, dtype=np.int64)
    src_rank_T = np.asarray(src_rank_T, dtype=np.int64)
    out = {m: np.zeros((B, L)) for m in METRICS + (TIME_METRICS if cost is not None else ())}
    tokens_BW = np.bincount(batch_T * W + src_rank_T, minlength=B * W).reshape(B, W)  # shared experts' tokens
    copies = layer_copies(
        ids,
        placement=placement,
        batch_T=batch_T,
        src_rank_T=src_rank_T,
        num_batches=B,
        num_ranks=W,
        ranks_per_node=ranks_per_node,
        dedup=dedup,
        policy=policy,
    )
    model = copy_model(dedup)
    for l, c in enumerate(copies):
        slot, valid, rank = c.slot_TK, c.valid_TK, c.rank_TK
        bK = np.broadcast_to(batch_T[:, None], valid.shape)
        # distinct tokens per GPU (rank dedup, whatever the unit) and activated slots per GPU
        rkey = np.sort(np.where(valid, rank, _SENTINEL), axis=1)
        rfirst = np.ones_like(rkey, dtype=bool)
        rfirst[:, 1:] = rkey[:, 1:] != rkey[:, :-1]
        rfirst &= rkey != _SENTINEL
        tok = np.bincount((bK * W + rkey)[rfirst], minlength=B * W).reshape(B, W)
        out["tokens_per_rank_max"][:, l] = tok.max(1)
        out["tokens_per_rank_mean"][:, l] = tok.mean(1)
        act = np.bincount((bK * P + slot)[valid], minlength=B * P).reshape(B, W, per_rank) > 0
        nact = act.sum(2)
        out["activated_experts_per_rank_max"][:, l] = nact.max(1)
        out["activated_experts_per_rank_mean"][:, l] = nact.mean(1)
        # the copy model's copies: the bytes below and the step time are the same copies
        traffic = model.traffic(
            rank_TK=rank,
            valid_TK=valid,
            batch_T=batch_T,
            src_rank_T=src_rank_T,
            num_batches=B,
            num_ranks=W,
            ranks_per_node=ranks_per_node,
            sorted_rank_TK=rkey,
            slot_TK=slot,
        )
        n_intra, n_inter = traffic.intra_copies_B(), traffic.inter_copies_B()
        out["dispatch_intra_bytes"][:, l] = n_intra * bytes_per_token
        out["dispatch_inter_bytes"][:, l] = n_inter * bytes_per_token
        out["combine_intra_bytes"][:, l] = n_intra * bytes_per_token  # the same copies back
        out["combine_inter_bytes"][:, l] = n_inter * bytes_per_token
        out["max_rank_dispatch_send_bytes"][:, l] = (traffic.send_intra + traffic.send_inter).max(1) * bytes_per_token
        out["max_rank_combine_send_bytes"][:, l] = (traffic.recv_intra + traffic.recv_inter).max(1) * bytes_per_token
        if cost is not None:
            pairs = np.bincount((bK * W + rank)[valid], minlength=B * W).reshape(B, W)
            secs = layer_seconds(
                traffic,
                kernel=cost.kernel(dedup),
                hidden_size=time_hidden_size or bytes_per_token // 2,
                ranks_per_node=ranks_per_node,
                expert=cost.expert,
                pairs_BW=pairs,
                active_BW=nact,
                tokens_BW=tokens_BW,
            )
            out["dispatch_seconds"][:, l] = secs.dispatch
            out["combine_seconds"][:, l] = secs.combine
            out["expert_seconds"][:, l] = secs.expert  # NaN when the expert size is unknown
            out["moe_seconds"][:, l] = secs.moe  # NaN then too: no partial sum posing as the whole
    return out
