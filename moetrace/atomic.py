"""Writing files so that a reader never sees half of one: a temporary name, fsync, then a rename.

A failed write (disk full, interrupted) removes its temporary file and leaves whatever was at
``path`` before untouched.

Out of scope: what is written (each stage owns its files).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed to ``path``, on
    any failure it is removed (``path`` keeps what it had)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written temporary is never left behind
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never half-written)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: Path, obj: object, *, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (see :func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")
