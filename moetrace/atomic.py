"""Writing files so that a reader never sees half of one: a temporary name, fsync, then a rename.

A failed write (disk full, interrupted) removes its temporary file and leaves whatever was at
``path`` before untouched.

Out of scope: what is written (each stage owns its files).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never half-written)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written temporary is never left behind
        raise


def write_json_atomic(path: Path, obj: Any, *, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (see :func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")
