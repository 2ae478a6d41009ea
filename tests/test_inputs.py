"""Reading user input files (moetrace.inputs): bounded, and no larger in memory than the file."""

from __future__ import annotations

import pytest


def test_reading_an_input_allocates_its_size_not_the_bound(tmp_path):
    """A 1 KB JSON read under a 256 MiB bound peaks at kilobytes (the bound was allocated whole before),
    and a file larger than the bound is still refused."""
    import tracemalloc

    from moetrace.errors import TraceFormatError
    from moetrace.inputs import read_input_bytes

    f = tmp_path / "small.json"
    f.write_bytes(b"[" + b"0," * 500 + b"0]")
    tracemalloc.start()
    data = read_input_bytes(f, max_bytes=256 << 20)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert data == f.read_bytes() and peak < 1 << 20
    with pytest.raises(TraceFormatError, match="more than the 100 such a file may hold"):
        read_input_bytes(f, max_bytes=100)
