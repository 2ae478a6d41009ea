"""Writing files so that a reader never sees half of one: a temporary name, fsync, then a rename.

A failed write (disk full, interrupted) removes its temporary file and leaves whatever was at
``path`` before untouched. No symbolic link is ever followed: the temporary file is created
exclusively (``O_CREAT | O_EXCL``, which never follows a link) under an unpredictable name
(``.<name>.<random>.tmp``) in ``path``'s directory, and the final rename replaces the directory
entry ``path`` itself. A ``path`` that exists as a symbolic link or as anything but a regular file
(a directory, a device node, a named pipe) is refused (``OutputExistsError``), before anything is
written.

Out of scope: what is written (each stage owns its files); whether ``path`` may be written at all
(``moetrace.cli.common.claim_output``, the one rule for every output path).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from moetrace.errors import OutputExistsError


def check_regular_target(path: str | os.PathLike) -> None:
    """Raise ``OutputExistsError`` unless ``path`` is absent or a regular file (checked with ``lstat``:
    a symbolic link is refused whatever it points at, so a write never lands on its target)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise OutputExistsError(f"{path} is a symbolic link; moetrace never writes through one: choose another -o")
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a device, pipe or socket)"
        raise OutputExistsError(f"{path} is {kind}; choose another -o")


def temp_file_beside(path: str | os.PathLike, *, suffix: str = ".tmp") -> Path:
    """Create (exclusively, mode 0666 & ~umask) an empty temporary file ``.<name>.<random><suffix>`` in
    ``path``'s directory and return its path; the name cannot be guessed, and creating it never
    follows a symbolic link."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)  # mkstemp makes it private; a result file is shared like any other
    finally:
        os.close(fd)
    return Path(name)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (an existing empty regular file); on success it is fsynced
    and renamed to ``path``, on any failure it is removed (``path`` keeps what it had).

    Refuses (``OutputExistsError``) a ``path`` that is a symbolic link or not a regular file."""
    path = Path(path)
    check_regular_target(path)
    tmp = temp_file_beside(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        check_regular_target(path)  # nothing swapped in a link while we wrote
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written temporary is never left behind
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file and a rename (never half-written)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: Path, obj: object, *, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (see :func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")
