"""Whether this machine can run a local replay's ranks: cores and memory (``moetrace a2a`` refuses more).

Each local rank is one process (torch imported, a gloo group up) plus its plan and buffers
(``plan.plan_bytes_per_rank``); ``local_capacity_problem`` is the pure rule, ``check_local_capacity``
applies it to this machine (``machine_capacity``).

Out of scope: starting the ranks (``launch``), ranks on other machines (torchrun).
"""

from __future__ import annotations

import os

from moetrace.errors import ConfigError
from moetrace.sizes import human_bytes

__all__ = [
    "MAX_RANKS_PER_CORE",
    "MEMORY_SHARE",
    "RANK_RSS_BYTES",
    "check_local_capacity",
    "local_capacity_problem",
    "machine_capacity",
]

#: resident memory of one local rank: torch, numpy and moetrace imported and a gloo group up (measured:
#: ~310 MB each of 4 ranks, 187 MB of it anonymous, torch 2.x CPU on Linux x86-64); its plan and buffers add to it
RANK_RSS_BYTES = 320 * 2**20
#: the most local ranks per CPU core: beyond it they queue for cores, and the times measure the scheduler
MAX_RANKS_PER_CORE = 4
#: the share of the memory available now that the local ranks may plan to use
MEMORY_SHARE = 0.8


def machine_capacity() -> tuple[int, int | None]:
    """CPU cores this process may run on and the memory available now (``MemAvailable`` of
    /proc/meminfo, bytes; None where there is no such file)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/proc/meminfo") as f:
            lines = f.readlines()
    except OSError:  # no /proc (macOS): memory unknown, only the cores are checked
        return cpus, None
    kb = [int(x.split()[1]) for x in lines if x.startswith("MemAvailable:")]
    return cpus, kb[0] * 1024 if kb else None


def local_capacity_problem(
    world_size: int, *, num_cpus: int, mem_available_bytes: int | None, extra_bytes_per_rank: int = 0
) -> str | None:
    """Why ``world_size`` local ranks are more than this machine can run (one line), or None when they fit.

    Pure: ``num_cpus`` cores (at most ``MAX_RANKS_PER_CORE`` ranks each), ``mem_available_bytes`` (None:
    unknown, not checked), of which ``MEMORY_SHARE`` for ``RANK_RSS_BYTES + extra_bytes_per_rank`` per rank.
    """
    if world_size > MAX_RANKS_PER_CORE * num_cpus:
        return (
            f"{world_size} local ranks on {num_cpus} CPU core(s): at most {MAX_RANKS_PER_CORE} per core run "
            "without queueing for cores (times then measure the scheduler)"
        )
    need = world_size * (RANK_RSS_BYTES + extra_bytes_per_rank)
    if mem_available_bytes is not None and need > MEMORY_SHARE * mem_available_bytes:
        return (
            f"{world_size} local ranks need about {human_bytes(need)} of memory "
            f"({human_bytes(RANK_RSS_BYTES + extra_bytes_per_rank)} each), {human_bytes(mem_available_bytes)} is "
            "available"
        )
    return None


def check_local_capacity(world_size: int, *, extra_bytes_per_rank: int = 0, force: bool = False) -> str | None:
    """Refuse (``ConfigError``, one line) a local run of more ranks than this machine can run
    (``local_capacity_problem`` on ``machine_capacity``); with ``force``, return that line as a
    warning instead. None when they fit."""
    cpus, mem = machine_capacity()
    why = local_capacity_problem(
        world_size, num_cpus=cpus, mem_available_bytes=mem, extra_bytes_per_rank=extra_bytes_per_rank
    )
    if why is None:
        return None
    if not force:
        raise ConfigError(
            f"{why}; run a smaller deployment, start the ranks on several machines with torchrun (--torchrun), "
            "or pass --force to start them anyway"
        )
    return f"warning: {why}; starting them anyway (--force)"
