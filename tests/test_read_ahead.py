"""The reader decodes the next Parquet batch on a thread while the caller works on this one: the same
batches in the same order, never more than one ahead, an error where the file broke, no thread left behind."""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from factories import write_small_trace

from moetrace.errors import TraceFormatError
from moetrace.tracer.trace import open_trace
from moetrace.tracer.trace.read_ahead import read_ahead


class _Source:
    """An iterator that records how many items it has produced (and on which thread)."""

    def __init__(self, n: int, *, fail_at: int | None = None) -> None:
        self.n, self.fail_at, self.produced = n, fail_at, 0
        self.threads: set[str] = set()

    def __iter__(self) -> _Source:
        return self

    def __next__(self) -> int:
        self.threads.add(threading.current_thread().name)
        if self.produced == self.fail_at:
            raise OSError(f"item {self.produced} is unreadable")
        if self.produced == self.n:
            raise StopIteration
        self.produced += 1
        return self.produced - 1


def test_same_items_in_order_at_most_one_ahead():
    src = _Source(6)
    seen = []
    with read_ahead(src) as ahead:
        for i in ahead:
            time.sleep(0.02)  # room for the thread to run further ahead, if it would
            assert src.produced <= i + 2  # this one and the next, no more
            seen.append(i)
    assert seen == list(range(6))
    assert src.threads == {"moetrace-read-ahead_0"}  # decoded on the thread, not the caller's


def test_an_error_reaches_the_caller_after_the_items_before_it():
    src = _Source(6, fail_at=3)
    seen = []
    with pytest.raises(OSError, match="item 3 is unreadable"), read_ahead(src) as ahead:
        for i in ahead:
            seen.append(i)
    assert seen == [0, 1, 2]


def test_leaving_early_stops_the_thread():
    src = _Source(100)
    before = threading.active_count()
    with read_ahead(src) as ahead:
        for i in ahead:
            if i == 2:
                break
    assert threading.active_count() == before  # joined when the block ended
    produced = src.produced
    assert produced <= 4
    time.sleep(0.05)
    assert src.produced == produced  # nothing reads after the block


def test_an_exception_in_the_caller_stops_the_thread():
    src = _Source(100)
    before = threading.active_count()
    with pytest.raises(ZeroDivisionError), read_ahead(src) as ahead:
        for i in ahead:
            if i == 1:
                _ = 1 / 0
    assert threading.active_count() == before


def test_the_reader_gives_every_row_once_in_file_order(tmp_path):
    """Batches of 7 rows over parts of several row groups: the reader's rows are the parts' rows."""
    path = write_small_trace(tmp_path / "t")
    files = sorted((path / "routing").glob("*.parquet"))
    want = np.concatenate([pq.read_table(f, columns=["request_id"]).column(0).to_numpy() for f in files])
    got = [ta.request_id_T for ta in open_trace(path).iter_token_arrays(batch_tokens=7)]
    assert all(len(r) <= 7 for r in got)
    np.testing.assert_array_equal(np.concatenate(got), want)


def test_a_part_that_breaks_mid_read_is_refused(tmp_path):
    """A data page of the part's third row group overwritten: the first batches arrive, then the decode
    fails on the reader's thread and the caller gets the reader's error naming the part (not the
    checksum's, which is checked after the rows: the decode error is the first problem met)."""
    path = write_small_trace(tmp_path / "t", num_requests=12)
    f = sorted((path / "routing").glob("*.parquet"))[0]
    pq.write_table(pq.read_table(f), f, row_group_size=8, compression="none")
    meta = pq.read_metadata(f)
    assert meta.num_row_groups >= 4
    page = meta.row_group(2).column(0).data_page_offset
    raw = bytearray(f.read_bytes())
    raw[page : page + 32] = b"\xff" * 32  # the page header: garbage
    f.write_bytes(bytes(raw))
    read = 0
    with pytest.raises(TraceFormatError) as err:
        for ta in open_trace(path).iter_token_arrays(batch_tokens=8):
            read += len(ta.request_id_T)
    assert read == 16  # the two row groups before it
    assert f.name in str(err.value) and "moetrace validate" in str(err.value)
    assert "SHA-256" not in str(err.value)
