"""One EP rank of the replay: every strategy's, batch's and MoE layer's dispatch and combine collectives.

``run_rank`` on every rank, for every strategy, batch and MoE layer: builds the real dispatch buffer
(one row of ``hidden_size`` values of ``dtype`` per token copy it sends, stamped with its rank),
calls ``all_to_all_single`` for dispatch and again for combine (the received rows go back, reverse
splits), times each (barrier first; ``perf_counter`` on gloo, CUDA events on NCCL), checks every
received row came from the rank it should, and records the bytes of every split it actually sent.
Batches are the outer loop (strategies inside), and before each batch every rank runs probes: empty
collectives (gloo's fixed cost) and node-local ones (loopback's rate). Each rank's result is one
``RankRecord``; rank 0 gathers them (``gather_object``, which pickles: a frozen dataclass of numpy arrays
and plain values pickles as it is) and, under ``launch.launch_local``, pickles the list once more to
the parent.

Shape legend (docs/architecture.md): B batches, L MoE layers, W EP ranks (GPUs), V strategies,
N probe repeats.

Out of scope: starting the ranks (``launch``), the plan (``plan``), reading the records (``results``).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.replay.plan import A2APlan

__all__ = ["PROBE_INTRA_BYTES", "PROBE_REPEATS", "RankRecord", "run_rank"]

#: probe collectives of each kind (empty; node-local rows only) before every batch's collectives
PROBE_REPEATS = 4
#: bytes each rank sends to the other ranks of its node in a node-local probe (loopback's rate)
PROBE_INTRA_BYTES = 4 << 20


@dataclass(frozen=True, kw_only=True)
class RankRecord:
    """One EP rank's record of a whole replay (``run_rank``; read by ``results`` and ``predict``).

    Phase axis (the ``2``): dispatch, combine (``sends.PHASES``). Bytes are of the splits of the
    tensors actually passed to ``all_to_all_single``; seconds are wall time per collective (barrier
    first; ``perf_counter`` on gloo, CUDA events on NCCL).
    """

    rank: int  # this EP rank, 0..W-1
    sent_VBL2W: np.ndarray  # int64 [V, B, L, 2, W] bytes this rank sent to each rank
    recv_VBL2W: np.ndarray  # int64 [V, B, L, 2, W] bytes this rank received from each rank
    seconds_VBL2: np.ndarray  # float64 [V, B, L, 2] seconds of each collective on this rank
    probe_empty_seconds_BN: np.ndarray  # float64 [B, N] seconds of each empty probe collective before batch b
    probe_intra_seconds_BN: np.ndarray  # float64 [B, N] seconds of each node-local probe; NaN: none (1 rank/node)
    probe_intra_bytes: int  # bytes this rank sent (and received) in one node-local probe
    payload_errors: tuple[str, ...]  # received rows that came from the wrong rank, one line each (at most 5)
    device: str  # the GPU's name (NCCL), or "cpu"
    host: str  # this rank's host name


def run_rank(rank: int, world_size: int, plan: A2APlan, progress_path: str | None = None) -> list[RankRecord] | None:
    """Replay ``plan`` as EP rank ``rank``; rank 0 returns every rank's ``RankRecord``, in rank order (others None).

    ``progress_path``: rank 0 writes there the number of batches it has finished, after each one (the
    parent of local ranks reads it for its progress bar).

    Initializes ``torch.distributed`` from ``env://`` unless a process group already exists (then
    uses and keeps it).
    """
    import torch
    import torch.distributed as dist

    if plan.world_size != world_size:
        raise ConfigError(
            f"{world_size} ranks started but the deployment has EP{plan.world_size}; start one process per EP "
            "rank (with TPd > 1, an EP rank's d GPUs are one process)"
        )
    if plan.backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    own = not dist.is_initialized()
    if own:
        dist.init_process_group(plan.backend, init_method="env://", rank=rank, world_size=world_size)
    try:
        rec = _collectives(rank, plan, device, progress_path if rank == 0 else None)
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(rec, gathered, dst=0)
        return None if gathered is None else [_gathered_record(r, w) for w, r in enumerate(gathered)]
    finally:
        if own:
            dist.destroy_process_group()


def _gathered_record(rec: object, rank: int) -> RankRecord:
    """Rank ``rank``'s gathered record, checked to be one (``gather_object`` unpickles whatever was sent)."""
    if not isinstance(rec, RankRecord) or rec.rank != rank:
        raise TypeError(f"gathered record {rank} is {type(rec).__name__} of rank {getattr(rec, 'rank', '?')}")
    return rec


def _collectives(rank: int, plan: A2APlan, device: Any, progress_path: str | None = None) -> RankRecord:
    """This rank's record of the whole plan on ``device``, the process group up."""
    import torch
    import torch.distributed as dist

    V, B, L, W, _ = plan.sends_VBLWW.shape
    dt = getattr(torch, plan.dtype)
    cuda = device.type == "cuda"
    stamp_W = torch.tensor([float(w % 200 + 1) for w in range(W)], dtype=dt, device=device)  # exact in bf16
    out_rows = int(plan.sends_VBLWW[..., rank].sum(-1).max(initial=0))  # most rows this rank receives in dispatch
    in_rows = int(plan.sends_VBLWW[..., rank, :].sum(-1).max(initial=0))  # most rows it sends
    send_buf = torch.full((max(in_rows, 1), plan.hidden_size), float(stamp_W[rank]), dtype=dt, device=device)
    recv_buf = torch.empty((max(out_rows, 1), plan.hidden_size), dtype=dt, device=device)
    back_buf = torch.empty_like(send_buf)
    sent = np.zeros((V, B, L, 2, W), dtype=np.int64)
    recv = np.zeros((V, B, L, 2, W), dtype=np.int64)
    secs = np.zeros((V, B, L, 2))
    errors: list[str] = []

    def collective(out, inp, out_splits, in_splits) -> float:
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_to_all_single(out, inp, out_splits, in_splits)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        dist.all_to_all_single(out, inp, out_splits, in_splits)
        return time.perf_counter() - t0

    def nbytes(t, splits) -> np.ndarray:  # bytes of each split of the tensor actually passed
        return np.array([c.numel() * c.element_size() for c in torch.split(t, splits)], dtype=np.int64)

    def check(t, splits, want_W, what) -> None:
        want = torch.repeat_interleave(want_W, torch.tensor(splits, device=device))
        if not bool(t.eq(want[:, None]).all()) and len(errors) < 5:
            errors.append(
                f"rank {rank} {what}: a received row does not carry the stamp of the rank that should send it"
            )

    for _ in range(plan.warmup):
        s = plan.sends_VBLWW[0, 0, 0]
        collective(
            recv_buf[: int(s[:, rank].sum())], send_buf[: int(s[rank].sum())], s[:, rank].tolist(), s[rank].tolist()
        )
    # the probes: an empty collective (gloo's fixed cost) and one of node-local rows only (loopback's rate)
    g = plan.ranks_per_node
    peer_rows = -(-PROBE_INTRA_BYTES // (plan.bytes_per_token * (g - 1))) if g > 1 else 0
    local_W = [peer_rows if w // g == rank // g and w != rank else 0 for w in range(W)]
    probe_in = torch.full((max(sum(local_W), 1), plan.hidden_size), float(stamp_W[rank]), dtype=dt, device=device)
    probe_out = torch.empty_like(probe_in)
    empty_W = [0] * W
    empty_s = np.zeros((B, PROBE_REPEATS))
    intra_s = np.full((B, PROBE_REPEATS), np.nan)
    for b in range(B):  # batches outer, strategies inner: a drift in the machine's load touches all strategies alike
        for i in range(PROBE_REPEATS):
            empty_s[b, i] = collective(probe_out[:0], probe_in[:0], empty_W, empty_W)
            if g > 1:
                intra_s[b, i] = collective(probe_out[: sum(local_W)], probe_in[: sum(local_W)], local_W, local_W)
        for v in range(V):
            for l in range(L):
                s = plan.sends_VBLWW[v, b, l]
                to_W, from_W = s[rank].tolist(), s[:, rank].tolist()  # rows sent to / received from each rank
                inp, out = send_buf[: sum(to_W)], recv_buf[: sum(from_W)]
                secs[v, b, l, 0] = collective(out, inp, from_W, to_W)
                sent[v, b, l, 0], recv[v, b, l, 0] = nbytes(inp, to_W), nbytes(out, from_W)
                back = back_buf[: sum(to_W)]
                secs[v, b, l, 1] = collective(back, out, to_W, from_W)  # combine: the received rows go back
                sent[v, b, l, 1], recv[v, b, l, 1] = nbytes(out, from_W), nbytes(back, to_W)
                where = f"{plan.strategies[v]} batch {b} layer {l}"
                check(out, from_W, stamp_W, f"{where} dispatch")
                check(back, to_W, stamp_W[rank].repeat(W), f"{where} combine")
        if progress_path is not None:
            Path(progress_path).write_text(str(b + 1))
    return RankRecord(
        rank=rank,
        sent_VBL2W=sent,
        recv_VBL2W=recv,
        seconds_VBL2=secs,
        probe_empty_seconds_BN=empty_s,
        probe_intra_seconds_BN=intra_s,
        probe_intra_bytes=int(sum(local_W)) * plan.bytes_per_token,
        payload_errors=tuple(errors),
        device=str(torch.cuda.get_device_name(device) if cuda else "cpu"),
        host=socket.gethostname(),
    )
