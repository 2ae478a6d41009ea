"""Which ``torch.distributed`` backend a replay runs on: gloo (CPU) or nccl (one GPU per rank).

Out of scope: running it (``rank``, ``launch``, ``smoke``).
"""

from __future__ import annotations

from typing import Literal

from moetrace.errors import ConfigError

__all__ = ["Backend", "choose_backend", "visible_gpus"]

Backend = Literal["gloo", "nccl", "auto"]


def choose_backend(
    backend: Backend, *, world_size: int, torchrun: bool, num_gpus: int | None = None, smoke: bool = False
) -> tuple[str, str]:
    """``(backend, note)``: ``gloo`` or ``nccl``, and a one-line note when ``auto`` could not take the
    GPUs it saw (empty otherwise). ``auto`` takes nccl when there is a GPU per rank on this machine
    (under torchrun: any GPU). ``num_gpus``: GPUs visible (None: ask torch). Raises ``ConfigError``
    for nccl without enough GPUs, saying what to do (``--smoke`` when there is at least one).
    ``smoke`` (``run_smoke``): nccl on one GPU, refused without one, under torchrun or with gloo."""
    if backend not in ("gloo", "nccl", "auto"):
        raise ConfigError(f"--backend {backend!r} is not gloo, nccl or auto")
    n = visible_gpus() if num_gpus is None else num_gpus
    if smoke:
        if torchrun or backend == "gloo":
            raise ConfigError("--smoke is a 1-rank NCCL check in this process; drop --torchrun and --backend gloo")
        if n < 1:
            raise ConfigError("--smoke needs a CUDA GPU and none is visible here; use --backend gloo to replay on CPU")
        return "nccl", ""
    need = 1 if torchrun else world_size
    hint = (
        f"; --smoke runs a 1-rank NCCL all_to_all on cuda:0 (a GPU check, not the {world_size}-rank replay)"
        if n
        else ""
    )
    if backend == "auto":
        if n >= need:
            return "nccl", ""
        if n:
            return (
                "gloo",
                f"note: {world_size} ranks but {n} GPU(s) here (NCCL needs one per rank): using gloo on CPU{hint}",
            )
        return "gloo", ""
    if backend == "nccl" and n < need:
        raise ConfigError(
            f"--backend nccl needs one GPU per rank: {world_size} ranks, {n} GPU(s) visible here; run on a node with "
            f"{world_size} GPUs (or across nodes: torchrun --nnodes ... -m moetrace a2a --torchrun), or use --backend gloo "
            f"to measure the bytes on CPU{hint}"
        )
    return backend, ""


def visible_gpus() -> int:
    """CUDA GPUs this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
