"""validate's fast paths compute what the plain ones do: Arrow columns as numpy without pandas, the
group-limited routing check by shifts against a direct id -> group lookup and a row-by-row reference, and no
pandas imported by `moetrace validate` at all."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest
from factories import write_small_trace

from moetrace.tracer.presets import model_info_for
from moetrace.tracer.trace import group_limit
from moetrace.tracer.trace.arrays import numpy_of, string_scalar
from moetrace.tracer.trace.group_limit import GroupLimit


@pytest.mark.parametrize(
    "arr",
    [
        pa.array(np.arange(-5, 20, dtype=np.int16)),
        pa.array(np.arange(30, dtype=np.int64)).slice(7, 11),
        pa.array(np.arange(10, dtype=np.uint32)),
        pa.array(np.linspace(0, 1, 9)),
        pa.array(np.arange(37) % 3 == 0).slice(5, 23),
        pa.array(np.zeros(0, np.int32)),
        pa.chunked_array([pa.array(np.arange(4, dtype=np.int32)), pa.array(np.arange(9, dtype=np.int32)).slice(2)]),
        pa.FixedSizeListArray.from_arrays(pa.array(np.arange(24, dtype=np.int16)), 4).slice(2, 3).flatten(),
    ],
)
def test_numpy_of_equals_to_numpy(arr):
    got = numpy_of(arr)
    want = arr.to_numpy() if isinstance(arr, pa.ChunkedArray) else arr.to_numpy(zero_copy_only=False)
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_numpy_of_refuses_nulls_and_strings():
    with pytest.raises(ValueError, match="nulls"):
        numpy_of(pa.array([1, None], pa.int64()))
    with pytest.raises(TypeError):
        numpy_of(pa.array(["a"]))
    assert string_scalar("decode") == pa.scalar("decode", pa.string())


class _Batch:
    def __init__(self, ids_TX: np.ndarray) -> None:
        self.ids_N = ids_TX.reshape(-1)
        self.num_rows = ids_TX.shape[0]
        self.request_id_T = np.arange(self.num_rows, dtype=np.int64)
        self.position_T = np.zeros(self.num_rows, np.int64)


def _reference_bad(ids_TX: np.ndarray, L: int, K: int, E: int, n_group: int, topk_group: int) -> int:
    size = E // n_group
    bad = 0
    for row in ids_TX.reshape(-1, K):
        groups = {int(e) // size for e in row if 0 <= e and int(e) // size < n_group}
        bad += len(groups) > topk_group
    return bad


@pytest.mark.parametrize(
    ("E", "n_group", "topk_group", "K"),
    [(256, 8, 4, 8), (256, 8, 2, 4), (64, 4, 2, 8), (96, 8, 3, 8), (128, 16, 4, 8)],
)
@pytest.mark.parametrize("chunk_ids", [1 << 18, 100])
def test_group_limit_fast_path_equals_lookup_and_reference(E, n_group, topk_group, K, chunk_ids, monkeypatch):
    """Ids in range, -1, just past E, far past E and negative: the shift path (8 groups of 2**s experts), the
    direct id -> group table and a set-per-row reference count the same rows, in one chunk or many."""
    monkeypatch.setattr(group_limit, "_GROUP_CHUNK_IDS", chunk_ids)
    L = 3
    model = replace(model_info_for("deepseek-v3"), num_experts=E, n_group=n_group, topk_group=topk_group, top_k=K)
    model = replace(model, moe_layers=tuple(range(L)), num_hidden_layers=L)
    rng = np.random.default_rng(E + K)
    T = 400
    ids = rng.integers(0, E, size=(T, L * K)).astype(np.int16)
    ids[rng.random(ids.shape) < 0.05] = -1
    ids[rng.random(ids.shape) < 0.02] = E + 3
    ids[rng.random(ids.shape) < 0.02] = 30000
    ids[rng.random(ids.shape) < 0.01] = -7
    want = _reference_bad(ids, L, K, E, n_group, topk_group)
    fast = GroupLimit(model)
    fast.add(_Batch(ids))
    table = GroupLimit(model)
    table.shift = None
    table.add(_Batch(ids))
    assert fast.num_bad == table.num_bad == want
    assert want > 0
    first = next(i for i, row in enumerate(ids.reshape(-1, K)) if _reference_bad(row, 1, K, E, n_group, topk_group))
    assert fast.example is not None and fast.example[2] == first % L and fast.example[0] == first // L


def test_validate_imports_no_pandas(tmp_path):
    path = write_small_trace(tmp_path / "t")
    code = (
        "import sys\nfrom moetrace.cli import main\nsys.argv = ['moetrace', 'validate', sys.argv[1]]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'pandas' not in sys.modules, 'validate imported pandas'\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_reading_a_trace_imports_no_pandas(tmp_path):
    """The reader (requests table, every routing row) as compare and analyze start with it: pandas (~0.3 s
    to import) is not among what it loads."""
    path = write_small_trace(tmp_path / "t")
    code = (
        "import sys\nfrom moetrace.tracer.trace import open_trace\n"
        "tr = open_trace(sys.argv[1])\nassert len(tr.request_arrays.request_id_R) == 6\n"
        "assert sum(len(ta.row_T) for ta in tr.iter_token_arrays(batch_tokens=8)) == tr.num_tokens()\n"
        "assert 'pandas' not in sys.modules, 'the reader imported pandas'\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
