"""The SHA-256 checksums of trace parts: hashed as written (``checksum.HashingFile``), they equal hashlib's of the
bytes on disk; a part's temporary file is never visible under its final name before it is whole."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from factories import write_small_trace

from moetrace.errors import WriteError
from moetrace.tracer.trace.checksum import HashingFile, file_sha256, hash_files
from moetrace.tracer.trace.validate import find_problems
from moetrace.tracer.trace.writer import TraceWriter


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("max_pending", [1, 1 << 20])
def test_hashing_file_hashes_every_byte_in_order(tmp_path, max_pending):
    """bytes, memoryviews of numpy arrays and Arrow buffers, through a queue that waits (1 byte) or not."""
    rng = np.random.default_rng(0)
    chunks = [b"PAR1", rng.integers(0, 255, 100_000, dtype=np.uint8).data, pa.py_buffer(b"x" * 70_000), b"", b"end"]
    with HashingFile(open(tmp_path / "f", "wb"), max_pending=max_pending) as f:
        for c in chunks:
            f.write(c)
        assert f.tell() == sum(memoryview(c).nbytes for c in chunks)
    assert f.closed
    assert f.hexdigest() == _sha(tmp_path / "f") == file_sha256(tmp_path / "f")


def test_hashing_file_under_pyarrow(tmp_path):
    t = pa.table({"a": np.arange(10_000), "b": [str(i % 7) for i in range(10_000)]})
    with HashingFile(open(tmp_path / "t.parquet", "wb")) as f:
        pq.write_table(t, f, compression="zstd")
    assert f.hexdigest() == _sha(tmp_path / "t.parquet")
    assert pq.read_table(tmp_path / "t.parquet").equals(t)


@pytest.mark.parametrize("encoder", ["fast", "pyarrow"])
def test_manifest_checksums_are_the_files_sha256(tmp_path, encoder):
    """Several parts (small part_tokens), each file's recorded SHA-256 equal to hashlib's of its bytes."""
    path = write_small_trace(tmp_path / "t", num_requests=9, part_tokens=10, row_group_tokens=4, encoder=encoder)
    parts = json.loads((path / "manifest.json").read_text())["parts"]
    assert len(parts) > 2
    for name, entry in parts.items():
        assert entry["routing_sha256"] == _sha(path / "routing" / name)
        assert entry["requests_sha256"] == _sha(path / "requests" / name)
    assert find_problems(path) == []


def test_resumed_parts_without_checksums_are_hashed_from_disk(tmp_path):
    path = write_small_trace(tmp_path / "t", num_requests=4, part_tokens=10)
    m = json.loads((path / "manifest.json").read_text())
    for entry in m["parts"].values():  # as a run killed before close leaves them: committed, not listed
        del entry["routing_sha256"]
    (path / "manifest.json").write_text(json.dumps(m))
    from factories import SMALL

    with TraceWriter(
        path, model=SMALL, backend={"name": "synthetic"}, collection={"seed": 0}, on_existing="resume"
    ) as w:
        w.add_request(request_id=99, dataset="a", prompt_tokens=2, topk_ids_TX=np.zeros((3, SMALL.ids_per_token)))
    parts = json.loads((path / "manifest.json").read_text())["parts"]
    assert len(parts) == len(m["parts"]) + 1
    for name, entry in parts.items():
        assert entry["routing_sha256"] == _sha(path / "routing" / name)
        assert entry["requests_sha256"] == _sha(path / "requests" / name)


def test_hash_files_in_the_background(tmp_path):
    (tmp_path / "a").write_bytes(b"a" * 1000)
    pool, futures = hash_files([tmp_path / "a", tmp_path / "missing"])
    try:
        assert futures[0].result() == hashlib.sha256(b"a" * 1000).hexdigest()
        with pytest.raises(OSError):
            futures[1].result()
    finally:
        pool.shutdown()


def test_a_failed_part_write_leaves_no_part_and_no_temporary(tmp_path, monkeypatch):
    """A write that fails half-way (disk full) leaves neither a final-named part nor a temporary file."""
    from factories import SMALL

    calls = {"n": 0}
    real = HashingFile.write

    def failing(self, b):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(28, "No space left on device")
        return real(self, b)

    monkeypatch.setattr(HashingFile, "write", failing)
    with pytest.raises(WriteError, match="no space left"):
        with TraceWriter(tmp_path / "t", model=SMALL, backend={"name": "synthetic"}, collection={}) as w:
            w.add_request(request_id=0, dataset="a", prompt_tokens=2, topk_ids_TX=np.zeros((3, SMALL.ids_per_token)))
            w.commit()
    for sub in ("routing", "requests"):
        assert os.listdir(tmp_path / "t" / sub) == []
