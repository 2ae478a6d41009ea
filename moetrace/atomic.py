"""Writing files so that a reader never sees half of one: a temporary name, fsync, then a rename.

A failed write (disk full, interrupted) removes its temporary file and leaves whatever was at
``path`` before untouched. No symbolic link is ever followed: the temporary file is created
exclusively (``O_CREAT | O_EXCL``, which never follows a link) under an unpredictable name
(``.<name>.<pid>.<random>.tmp``) in ``path``'s directory, and the final rename replaces the directory
entry ``path`` itself. A temporary left by a writer killed with SIGKILL (its ``pid`` gone) is removed
by the next write of the same path. A ``path`` that exists as a symbolic link or as anything but a regular file
(a directory, a device node, a named pipe) is refused (``OutputExistsError``), before anything is
written.

A directory that replaces another as a whole (a results folder, an imported trace) is built beside it
and swapped in (:func:`replacing_directory`, :func:`swap_in_directory`): on Linux one
``renameat2(RENAME_EXCHANGE)`` exchanges the two at once, so at every instant the path holds the whole
old or the whole new directory and is never missing; a kill leaves at most a hidden ``.<name>.<random>.new``
(removed by the run's ``lifetime.guard`` supervisor). Where the exchange is not available (not Linux, a
file system without it) two renames do it, the old directory first moved aside to
``.<name>.<12 hex>.old``; a kill between them leaves the path missing for an instant that
:func:`recover_directory` (run by the next ``replacing_directory`` of that path) repairs by moving the
old one back.

Out of scope: what is written (each stage owns its files); whether ``path`` may be written at all
(``moetrace.cli.common.claim_output``, the one rule for every output path).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import stat
import sys
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
    """Create (exclusively, mode 0666 & ~umask) an empty temporary file ``.<name>.<pid>.<random><suffix>``
    in ``path``'s directory and return its path (``pid``: this process's, so that a later write can tell
    a killed writer's leftover from a live one's); the name cannot be guessed, and creating it never
    follows a symbolic link."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=suffix, dir=path.parent)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)  # mkstemp makes it private; a result file is shared like any other
    finally:
        os.close(fd)
    return Path(name)


def remove_dead_temporaries(path: str | os.PathLike, *, suffix: str = ".tmp") -> list[Path]:
    """Remove the temporaries ``.<name>.<pid>.<random><suffix>`` beside ``path`` whose writer ``pid`` no
    longer runs (a write killed by SIGKILL between its temporary and its rename); returns them. A live
    writer's temporary, and any file not named so, is left alone."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.[A-Za-z0-9_]+{re.escape(suffix)}")
    gone: list[Path] = []
    if not os.path.isdir("/proc/self"):
        return gone  # no /proc to tell a dead writer from a live one
    try:
        names = os.listdir(path.parent)
    except OSError:
        return gone
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid() or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        leftover = path.parent / name
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(leftover).st_mode):  # never a link or a directory
                leftover.unlink()
                gone.append(leftover)
    return gone


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (an existing empty regular file); on success it is fsynced
    and renamed to ``path``, on any failure it is removed (``path`` keeps what it had).

    Refuses (``OutputExistsError``) a ``path`` that is a symbolic link or not a regular file."""
    path = Path(path)
    check_regular_target(path)
    remove_dead_temporaries(path)
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


# ---- directories replaced as a whole -----------------------------------------------------------
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Exchange the directory entries ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``).
    Returns False, having changed nothing, where the OS or the file system cannot; raises ``OSError`` else."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:  # a C library older than glibc 2.28
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(a), None, os.fspath(b))


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every regular file and directory under ``root`` (files written through ``atomic_path`` are
    synced already; this costs them a system call each)."""
    for d, _dirs, files in os.walk(root):
        for name in files:
            f = os.path.join(d, name)
            if stat.S_ISREG(os.lstat(f).st_mode):
                fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_directory(Path(d))


def _aside_names(target: Path) -> list[Path]:
    """The ``.<name>.<12 hex>.old`` directories a two-rename swap of ``target`` left, newest first."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.[0-9a-f]{{12}}\.old")
    try:
        found = [p for p in target.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir()]
    except FileNotFoundError:
        return []
    return sorted(found, key=lambda p: p.lstat().st_mtime_ns, reverse=True)


def recover_directory(target: str | os.PathLike) -> None:
    """Repair what a two-rename swap (:func:`swap_in_directory` without the exchange) killed half-way
    left: ``target`` missing while its old directory waits aside is moved back; asides of a swap that
    finished (``target`` present) are removed."""
    target = Path(target)
    asides = _aside_names(target)
    if asides and not os.path.lexists(target):
        os.rename(asides.pop(0), target)
    for p in asides:
        shutil.rmtree(p, ignore_errors=True)


def swap_in_directory(new: str | os.PathLike, target: str | os.PathLike) -> None:
    """Make the directory ``new`` (beside ``target``, on the same file system) the one at ``target`` and
    remove the old one (module docstring: one exchange, or two renames that ``recover_directory`` repairs)."""
    new, target = Path(new), Path(target)
    _fsync_tree(new)  # what was built is on disk before it becomes ``target``
    if not os.path.lexists(target):
        os.rename(new, target)
    elif exchange_paths(new, target):
        _fsync_directory(target.parent)
        shutil.rmtree(new, ignore_errors=True)  # ``new`` holds the old directory now
        return
    else:
        aside = target.parent / f".{target.name}.{secrets.token_hex(6)}.old"
        os.rename(target, aside)
        try:
            os.rename(new, target)
        except BaseException:
            os.rename(aside, target)  # put the old one back
            raise
        shutil.rmtree(aside, ignore_errors=True)
    _fsync_directory(target.parent)


@contextlib.contextmanager
def replacing_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh hidden directory beside ``target`` (``.<name>.<random>.new``) to build its new
    contents in; when the block succeeds it replaces ``target`` as a whole (:func:`swap_in_directory`),
    when the block fails it is removed and ``target`` is untouched (a SIGKILL too: ``lifetime.guard``).

    The one mechanism for every command that writes a folder (results folders, ``import --overwrite``).
    ``target``'s permissions are kept (a new folder gets the umask's)."""
    from moetrace import lifetime

    target = Path(target)
    recover_directory(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".new", dir=target.parent))
    with lifetime.guard(paths=[new], kill_descendants=False):
        try:
            if target.is_dir():
                mode = target.stat().st_mode & 0o7777
            else:
                mask = os.umask(0)
                os.umask(mask)
                mode = 0o777 & ~mask
            os.chmod(new, mode)  # mkdtemp's is private
            yield new
            swap_in_directory(new, target)
        finally:
            shutil.rmtree(new, ignore_errors=True)  # a failed block's directory (gone already on success)
