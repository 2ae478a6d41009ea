"""Decode the next Parquet batch on a background thread while the caller works on the current one.

``pyarrow.parquet.ParquetFile.iter_batches`` decodes a batch when it is asked for: the caller (the
reader's checks, the counting kernel, ``compare``'s held-out tokens) waits while Arrow decodes, and
Arrow's decoding thread waits while the caller works. The routing parts' ``experts`` column is one
dictionary-encoded column, so Arrow decodes it on one thread (about 1.1-2 s of the 1,000-request
DeepSeek-V3 synth trace's 2.2-3.5 s count, docs/benchmarks.md). :func:`read_ahead` overlaps the two:
a background thread decodes batch ``i + 1`` while the caller holds batch ``i``, never more than one
ahead (memory: one more batch, ``batch_tokens * L * K * 2`` bytes). The batches, their order and
their boundaries are the ones ``iter_batches`` gives; an Arrow error reaches the caller at the batch
it broke, as from ``iter_batches`` itself.

Out of scope: decoding several batches at once (one column holds almost all the bytes, and the
other core is the caller's).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

B = TypeVar("B")

_END = object()  # what ``next`` gives after the last batch


@contextmanager
def read_ahead(batches: Iterator[B]) -> Iterator[Iterator[B]]:
    """``with read_ahead(it) as ahead: for b in ahead: ...``: the items of ``it``, each produced on
    a background thread while the caller works on the previous one (at most one ahead). Leaving the
    block early (a ``break``, an exception) waits for the item being produced: nothing reads the file
    after the block. An exception raised by ``it`` is raised by the caller's ``next``, after the items
    before it."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetrace-read-ahead") as pool:

        def ahead() -> Iterator[B]:
            fut = pool.submit(next, batches, _END)
            while (item := fut.result()) is not _END:
                fut = pool.submit(next, batches, _END)  # decode the next one while the caller works on this one
                yield item  # type: ignore[misc]

        yield ahead()
