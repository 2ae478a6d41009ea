"""One writer per trace: an OS file lock held for the writer's whole life, released by the OS on a crash.

A trace directory has a lock file ``.writer.lock``. A whole-trace writer (``collect``, ``import``,
``synth``; resume or overwrite) holds it exclusively. The shards of a sharded collection share the
directory by design: each holds ``.writer.lock`` *shared* (so no whole-trace writer can start, and
in particular no ``--overwrite`` can delete their parts) plus its own ``manifests/.shard-SSS.lock``
exclusively (so one shard never runs twice). A writer that cannot get its locks is refused at once
with the holder's pid, host, command and start time, which the holder writes into the lock file.

The locks are ``flock(2)`` locks: the kernel drops them when the holding process dies, even by
``kill -9``, so a crashed writer never blocks its own ``--resume``. They hold on local file systems
and on NFSv4 (where Linux maps them to byte-range locks).

The lock file is opened with ``O_NOFOLLOW``: a ``.writer.lock`` that is a symbolic link (or not a
regular file) is refused, so a shared directory cannot make a writer truncate another file.
Results folders (``analyze``, ``compare``, ``a2a`` outputs) take the same lock (:func:`lock_results`),
so two runs never interleave their files; :func:`probe_lock` asks, without keeping it, whether a
directory's lock is free (``collect`` asks before loading a model; ``--overwrite`` of a directory
holding a trace asks before deleting anything).

Out of scope: what the writer writes (``writer``), readers (a reader never takes a lock: it reads
committed parts only, see ``writer``'s crash-safety notes), which output paths a command may write
(``moetrace.cli.common.claim_output``).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Literal

from moetrace.errors import TraceBusyError

TRACE_LOCK = ".writer.lock"

Mode = Literal["exclusive", "shared"]


def _holder_info() -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]])[:300],
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _describe_holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        h = {}
    if not isinstance(h, dict) or "pid" not in h:
        return "another process"
    return f"pid {h.get('pid')} on {h.get('host')} ({h.get('command')!s}, started {h.get('started')})"


def _open_lock_file(path: Path) -> IO[str]:
    """Open (create) the lock file ``path`` without following a symbolic link; refuse anything but a
    regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError:
        if os.path.islink(path):
            raise TraceBusyError(
                f"{path} is a symbolic link; moetrace never follows one when writing. Remove it (a lock file "
                "is a plain file moetrace creates), then run the command again"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise TraceBusyError(f"{path} is not a regular file; remove it, then run the command again")
    return os.fdopen(fd, "a+")


class WriterLock:
    """The locks one trace writer holds; :meth:`release` (or process exit) gives them back."""

    def __init__(self) -> None:
        self._files: list[tuple[IO[str], Mode]] = []

    def _take(self, path: Path, mode: Mode, *, busy: Callable[[str], str]) -> None:
        """Lock ``path``; when another process holds it, raise with ``busy(<its holder, described>)``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        f = _open_lock_file(path)
        try:
            fcntl.flock(f.fileno(), (fcntl.LOCK_EX if mode == "exclusive" else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise TraceBusyError(busy(_describe_holder(path))) from None
        except OSError as exc:  # a file system without locks: say so rather than write unprotected
            f.close()
            raise TraceBusyError(
                f"{path.parent}: cannot lock {path.name} ({exc.strerror}); this file system does not support "
                "file locks, so moetrace cannot guarantee a single writer. Write the trace to a local disk."
            ) from None
        f.truncate(0)  # whatever a crashed holder left there is stale now
        if mode == "exclusive":  # the holder names itself for whoever is refused
            f.write(json.dumps(_holder_info()))
            f.flush()
        self._files.append((f, mode))

    def release(self) -> None:
        for f, mode in reversed(self._files):
            if mode == "exclusive":
                f.truncate(0)  # a released lock names no holder
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()
        self._files = []


def lock_trace(path: str | os.PathLike, *, shard_lock: str | None = None) -> WriterLock:
    """Take the writer locks of trace directory ``path`` (created if missing).

    ``shard_lock=None``: the whole trace, exclusively. ``shard_lock="manifests/.shard-003.lock"``: the
    trace shared with the other shards, and that shard's lock exclusively. Raises
    :class:`~moetrace.errors.TraceBusyError` naming the holder when another writer has them.
    """
    p = Path(path)
    lock = WriterLock()
    trace_lock = p / TRACE_LOCK
    if shard_lock is None:

        def whole(holder: str) -> str:
            if not holder.startswith("pid"):  # shared holders write no name: running shards
                return (
                    f"{p} is being written by running shards of a sharded collection (manifests/.shard-*.lock); "
                    "wait for them to finish, then `moetrace merge-shards`"
                )
            return (
                f"{p} is being written by {holder}; wait for it to finish or stop it "
                "(a stopped run is continued with --resume), or choose another -o"
            )

        lock._take(trace_lock, "exclusive", busy=whole)
        return lock
    lock._take(
        trace_lock,
        "shared",
        busy=lambda holder: (
            f"{p} is being written by {holder} as a whole trace; a shard "
            "cannot join it. Wait for it to finish, or collect the shards into another -o"
        ),
    )
    try:
        lock._take(
            p / shard_lock, "exclusive", busy=lambda holder: f"{p}: this shard is already being collected by {holder}"
        )
    except TraceBusyError:
        lock.release()
        raise
    return lock


def probe_lock(path: str | os.PathLike, *, shared: bool = False) -> None:
    """Raise :class:`~moetrace.errors.TraceBusyError` naming the holder if another process holds the
    writer lock of directory ``path``; take nothing. A directory without a lock file is free.

    ``shared=True`` asks only whether a whole-trace writer (exclusive holder) runs, as a shard would.
    """
    p = Path(path)
    lock_file = p / TRACE_LOCK
    if not os.path.lexists(lock_file):
        return
    f = _open_lock_file(lock_file)
    try:
        fcntl.flock(f.fileno(), (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _describe_holder(lock_file)
        f.close()
        if not holder.startswith("pid"):
            raise TraceBusyError(f"{p} is being written by running shards of a sharded collection") from None
        raise TraceBusyError(f"{p} is being written by {holder}; wait for it to finish or choose another -o") from None
    except OSError:
        f.close()
        return  # a file system without locks: the writer itself refuses to start there
    fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    f.close()


def lock_results(path: str | os.PathLike, *, what: str) -> WriterLock:
    """Take the writer lock of results folder ``path`` (created if missing) exclusively, so two runs never
    write into one folder at once. ``what`` names the command for the refusal (``moetrace analyze``)."""
    p = Path(path)
    lock = WriterLock()
    lock._take(
        p / TRACE_LOCK,
        "exclusive",
        busy=lambda holder: f"{p} is being written by {holder}; wait for it to finish, or give `{what}` another -o",
    )
    return lock
