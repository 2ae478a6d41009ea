"""Sizes on disk, for people: shared by the CLI, ``moetrace info`` and the dashboards (no heavy imports);
and the one memory check before a large allocation (:func:`check_memory`: the figure and the knob)."""

from __future__ import annotations

import os
from pathlib import Path


def dir_bytes(path: str | os.PathLike) -> int:
    """Total size in bytes of the files below ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


#: the share of the memory available now that one allocation moetrace plans may take
MEMORY_SHARE = 0.8


def memory_available() -> int | None:
    """Bytes of memory available now (``MemAvailable`` of /proc/meminfo); None where unknown (no /proc)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(nbytes: int, *, what: str, knob: str, available: int | None = None) -> None:
    """Refuse (``ConfigError``), before it is allocated, work that needs ``nbytes`` of memory when that is
    more than :data:`MEMORY_SHARE` of what is available now (``available``: that figure, default
    :func:`memory_available`; unknown: not checked). The message gives the figure and ``knob``, the
    option that lowers it."""
    from moetrace.errors import ConfigError

    avail = memory_available() if available is None else available
    if avail is not None and nbytes > MEMORY_SHARE * avail:
        raise ConfigError(
            f"{what} needs about {human_bytes(nbytes)} of memory, more than this machine has available "
            f"({human_bytes(avail)}, of which moetrace plans to use {MEMORY_SHARE:.0%}): {knob}"
        )
