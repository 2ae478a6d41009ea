"""Sizes on disk, for people: shared by the CLI, ``moetrace info`` and the dashboards (no heavy imports)."""

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
