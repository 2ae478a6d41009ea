"""SHA-256 of trace parts: of a file on disk, of the bytes as they are written, of files read in the background.

The manifest's ``parts`` records the SHA-256 of every part's two files (docs/trace-format.md). The writer hashes
the bytes as it writes them (:class:`HashingFile`, wrapped around the output stream the Parquet encoders write
into), so a part is never read back; ``validate`` and ``Trace.verify_checksums`` hash the files on disk
(:func:`file_sha256`), ``validate`` on a background thread while it reads the rows (:func:`hash_files`).
``hashlib`` releases the GIL while it hashes, so the background thread runs beside the caller's work.

Deliberately light: only the standard library (``validate`` imports it at start-up).

Out of scope: which files a trace has (``layout``), what a mismatch means (``validate``, ``reader``).
"""

from __future__ import annotations

import collections
import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

#: bytes read at a time when a file's checksum is computed
HASH_CHUNK = 8 << 20
#: bytes written but not yet hashed that a ``HashingFile`` lets queue up before a write waits for the hash
MAX_PENDING = 64 << 20
#: bytes written between two background ``fdatasync`` calls of a ``HashingFile`` opened with ``sync_every``
SYNC_EVERY = 8 << 20


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of file ``path``'s bytes, as 64 hex digits (read in 8 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_files(paths: Sequence[Path]) -> tuple[ThreadPoolExecutor, list[Future[str]]]:
    """Start hashing ``paths`` one after another on one background thread; returns the executor (shut it down
    when done) and one future per path (its hex digest, or the ``OSError`` that reading it raised)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetrace-sha256")
    return pool, [pool.submit(file_sha256, p) for p in paths]


class HashingFile:
    """A writable binary file that computes the SHA-256 of every byte written through it.

    Wraps ``f`` (an open binary file; closed by :meth:`close`). Each ``write`` hands its bytes-like object to the
    file, then to one background thread that hashes the objects in the order written (the object is kept until
    hashed, so the writer must not change it afterwards: the Parquet encoders write fresh objects). At most
    ``max_pending`` bytes wait to be hashed; a write beyond that waits for the oldest. :meth:`hexdigest` waits for
    the hash of everything written. Usable wherever pyarrow takes an output stream (``pq.ParquetWriter``,
    ``pq.write_table``): pyarrow never closes a stream it did not open.

    With ``sync_every`` (bytes), every time that many more bytes were written the file is flushed and an
    ``fdatasync`` started on another thread (unless the last one still runs): the disk writes while the caller
    encodes, and the caller's final ``fsync`` has only the rest to wait for. :meth:`close` waits for it.
    """

    def __init__(self, f: BinaryIO, *, max_pending: int = MAX_PENDING, sync_every: int | None = None) -> None:
        self._f = f
        self._sha = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetrace-write-sha256")
        self._pending: collections.deque[tuple[Future[None], int]] = collections.deque()
        self._pending_bytes = 0
        self._max_pending = max_pending
        self._pos = 0
        self._syncer: ThreadPoolExecutor | None = None
        self._sync: Future[None] | None = None
        self._sync_every = sync_every
        self._synced_at = 0  # bytes written when the last background fdatasync started

    # ---- the file protocol pyarrow and the fast encoder use
    def write(self, b: Any) -> int:
        n = self._f.write(b)
        size = len(b) if isinstance(b, bytes) else memoryview(b).nbytes
        if n is not None and n != size:  # a raw file's short write: never from a buffered file
            raise OSError(f"short write: {n} of {size} bytes")
        self._pos += size
        self._pending.append((self._pool.submit(self._sha.update, b), size))
        self._pending_bytes += size
        while self._pending_bytes > self._max_pending:
            self._wait_oldest()
        if self._sync_every is not None and self._pos - self._synced_at >= self._sync_every:
            self.sync_in_background()
        return size

    def _wait_oldest(self) -> None:
        fut, size = self._pending.popleft()
        self._pending_bytes -= size
        fut.result()

    def flush(self) -> None:
        self._f.flush()

    def tell(self) -> int:
        return self._pos

    def fileno(self) -> int:
        return self._f.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self._f.closed

    def sync_in_background(self) -> None:
        """Flush, then ``fdatasync`` the file on a background thread (unless the last one is still running)."""
        if self._sync is not None and not self._sync.done():
            return
        self._f.flush()
        self._synced_at = self._pos
        if self._syncer is None:
            self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetrace-write-sync")
        self._sync = self._syncer.submit(os.fdatasync, self._f.fileno())

    def _stop_sync(self) -> None:
        """Wait for the background ``fdatasync`` (before the descriptor is closed); raises its ``OSError``."""
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None
            sync, self._sync = self._sync, None
            if sync is not None:
                sync.result()

    def close(self) -> None:
        """Close the file (the hash goes on: :meth:`hexdigest`). Idempotent."""
        try:
            self._stop_sync()
        finally:
            self._f.close()

    # ---- the checksum
    def hexdigest(self) -> str:
        """The SHA-256 of every byte written, as 64 hex digits (waits for the background hashing)."""
        while self._pending:
            self._wait_oldest()
        self._pool.shutdown(wait=True)
        return self._sha.hexdigest()

    def abort(self) -> None:
        """Close the file and drop the hashing still queued (the part is being discarded)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        try:
            self._stop_sync()
        finally:
            self._f.close()

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
