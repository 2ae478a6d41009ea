"""One GPU: the NCCL smoke check (``moetrace a2a --smoke``), for a machine with fewer GPUs than ranks.

Out of scope: the W-rank replay (``rank``, ``launch``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.replay.backend import visible_gpus
from moetrace.placement.replay.plan import A2APlan
from moetrace.placement.replay.sends import A2AMismatchError
from moetrace.sizes import human_bytes

__all__ = ["SmokeRow", "format_smoke", "run_smoke"]


@dataclass(frozen=True)
class SmokeRow:
    """One strategy's NCCL smoke check (``run_smoke``): medians over its (batch, layer) collectives."""

    strategy: str  # the strategy whose dispatch was moved
    collectives: int  # all_to_all_single calls timed, one per (batch, layer)
    bytes_per_collective_median: float  # bytes moved per collective (each equals the simulator's dispatch bytes)
    seconds_median: float  # seconds per collective (CUDA events)
    gbytes_per_second_median: float  # 1e9 bytes per second, the median over collectives of bytes / seconds
    device: str  # the GPU's name


def run_smoke(plan: A2APlan, *, device_index: int = 0) -> list[SmokeRow]:
    """A 1-rank NCCL check on ``cuda:<device_index>`` (for a machine with fewer GPUs than ranks).

    Per (strategy, batch, layer): one ``all_to_all_single`` with world size 1 of the batch's whole
    dispatch (every rank's token copies, ``sends_VBLWW[v, b, l].sum()`` rows of ``hidden_size``
    values, grouped by sending rank and stamped with it; input and output splits ``[rows]``), timed
    with CUDA events. Checks the rows arrive unchanged and their bytes equal the simulator's dispatch
    total (intra + inter); raises ``A2AMismatchError`` otherwise. Returns one ``SmokeRow`` per strategy.

    Out of scope: links between GPUs (with one rank NCCL copies on the device; the W-rank replay
    needs W GPUs), combine (the same copy back).
    """
    import torch
    import torch.distributed as dist

    if visible_gpus() <= device_index:
        raise ConfigError(f"--smoke needs a CUDA GPU (cuda:{device_index}); none is visible here")
    if dist.is_initialized():
        raise ConfigError("--smoke runs its own 1-rank process group; a process group already exists")
    torch.cuda.set_device(device_index)
    device = torch.device("cuda", device_index)
    dt = getattr(torch, plan.dtype)
    V, B, L, W, _ = plan.sends_VBLWW.shape
    stamp_W = torch.tensor([float(w % 200 + 1) for w in range(W)], dtype=dt, device=device)
    rows_max = max(int(plan.sends_VBLWW.sum(axis=(-1, -2)).max(initial=0)), 1)
    send_buf = torch.empty((rows_max, plan.hidden_size), dtype=dt, device=device)
    recv_buf = torch.empty_like(send_buf)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:

        def once(n: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_to_all_single(recv_buf[:n], send_buf[:n], [n], [n])
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        once(rows_max)  # warm-up: NCCL's communicator starts on the first collective
        out = []
        for v, name in enumerate(plan.strategies):
            secs, nbytes = [], []
            for b in range(B):
                for l in range(L):
                    per_src_W = torch.tensor(plan.sends_VBLWW[v, b, l].sum(-1), device=device)
                    n = int(per_src_W.sum())
                    send_buf[:n] = torch.repeat_interleave(stamp_W, per_src_W)[:, None]
                    secs.append(once(n))
                    got = recv_buf[:n].numel() * recv_buf.element_size()
                    want = plan.sim_intra_VBL[v, b, l] + plan.sim_inter_VBL[v, b, l]
                    if got != want or not bool(recv_buf[:n].eq(send_buf[:n]).all()):
                        raise A2AMismatchError(
                            f"--smoke {name} batch {b} layer {l}: {got} bytes moved (simulator: "
                            f"{want:.0f}) or a row arrived changed"
                        )
                    nbytes.append(got)
            med_s = float(np.median(secs))
            out.append(
                SmokeRow(
                    strategy=name,
                    collectives=len(secs),
                    bytes_per_collective_median=float(np.median(nbytes)),
                    seconds_median=med_s,
                    gbytes_per_second_median=float(np.median(np.asarray(nbytes) / np.maximum(secs, 1e-12)) / 1e9),
                    device=torch.cuda.get_device_name(device),
                )
            )
        return out
    finally:
        dist.destroy_process_group()


def format_smoke(plan: A2APlan, rows: list[SmokeRow]) -> str:
    """Header line, column titles and one row per strategy of ``run_smoke``'s result."""
    lines = [
        f"NCCL smoke check on 1 GPU ({rows[0].device if rows else '?'}): each {plan.config.deployment} "
        f"batch's dispatch ({plan.world_size} ranks' rows) as one all_to_all_single of world size 1, "
        f"hidden {plan.hidden_size} {plan.dtype}",
        f"{'strategy':<12} {'collectives':>11} {'bytes (median)':>15} {'seconds':>10} {'GB/s':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r.strategy:<12} {r.collectives:>11} {human_bytes(r.bytes_per_collective_median):>15} "
            f"{r.seconds_median:>10.2e} {r.gbytes_per_second_median:>8.2f}"
        )
    return "\n".join(lines)
