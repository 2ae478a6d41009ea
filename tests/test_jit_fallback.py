"""The numba kernels' NumPy twins (analysis/kernels_numpy.py) and the fallback when numba cannot
compile (analysis/jit.py): seen on a GPU machine whose numba failed in its parfor pass."""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.analysis import affinity, counts, jit
from moetrace.analysis.kernels_numpy import count_numpy, pair_numpy


def _ids(rng, T, L, K, E, *, holes=True):
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T * L)]).reshape(T, L * K).astype(np.int16)
    if holes:
        ids[rng.random(T) < 0.1] = -1  # unrecorded tokens
    return ids


@pytest.mark.parametrize("dtype", [np.uint8, np.uint32])
def test_count_numpy_equals_the_kernel(dtype):
    rng = np.random.default_rng(0)
    T, L, K, E, R, S = 300, 5, 3, 16, 7, 2
    ids = _ids(rng, T, L, K, E)
    row = rng.integers(-1, R, T)
    stage = rng.integers(-1, S, T).astype(np.int8)
    layers = np.array([4, 0, 2], dtype=np.int64)
    a = np.zeros((R, S, 3, E), dtype)
    b = np.zeros_like(a)
    bad_a = counts._kernel()(a, row, stage, ids, layers, K, 2)
    bad_b = count_numpy(b, row, stage, ids, layers, K, 2)
    np.testing.assert_array_equal(a, b)
    assert bad_a == bad_b == 0


def test_count_numpy_reports_bad_ids_and_overflow_like_the_kernel():
    ids = np.array([[1, 20], [1, 2]], dtype=np.int16)  # E = 4: id 20 is bad
    row, stage, layers = np.array([0, 0]), np.array([0, 0], np.int8), np.array([0], np.int64)
    for fn in (counts._kernel(), count_numpy):
        c = np.full((1, 1, 1, 4), 255, np.uint8)  # every cell full: the next id overflows
        assert fn(c, row, stage, ids, layers, 2, 1) > 0


def test_pair_numpy_equals_the_kernel():
    rng = np.random.default_rng(1)
    T, L, K, E = 400, 4, 3, 10
    ids = _ids(rng, T, L, K, E)
    keep = rng.random(T) < 0.8
    outs = []
    for fn in (affinity._kernel(), pair_numpy):
        o = (
            np.zeros((L - 1, E, E), np.int64),
            np.zeros((L, E, E), np.int64),
            np.zeros((L, E), np.int64),
            np.zeros(L, np.int64),
        )
        fn(ids, keep, K, *o, 2)
        outs.append(o)
    for x, y in zip(*outs):
        np.testing.assert_array_equal(x, y)


def test_a_kernel_numba_cannot_compile_falls_back_with_a_warning(monkeypatch):
    def broken():
        def fail(*args):
            raise RecursionError("maximum recursion depth exceeded")  # what the parfor pass raised

        return fail

    monkeypatch.setattr(jit, "_FAILED", {})
    monkeypatch.setattr(counts, "_kernel", broken)
    rng = np.random.default_rng(2)
    ids = _ids(rng, 50, 2, 2, 8, holes=False)
    row, stage, layers = np.zeros(50, np.int64), np.zeros(50, np.int8), np.arange(2, dtype=np.int64)
    got = np.zeros((1, 1, 2, 8), np.uint32)
    with pytest.warns(RuntimeWarning, match=r"could not compile moetrace's expert-count kernel .*RecursionError"):
        counts.count_arrays(got, row_T=row, stage_T=stage, topk_ids_TX=ids, layers_L=layers, top_k=2)
    want = np.zeros_like(got)
    count_numpy(want, row, stage, ids, layers, 2, 1)
    np.testing.assert_array_equal(got, want)
    assert got.sum() == 50 * 2 * 2
    # a kernel that fails while running (not numba's error) is not hidden
    monkeypatch.setattr(jit, "_FAILED", {})

    def raising():
        def fail(*args):
            raise IndexError("boom")

        return fail

    monkeypatch.setattr(counts, "_kernel", raising)
    with pytest.raises(IndexError):
        counts.count_arrays(got, row_T=row, stage_T=stage, topk_ids_TX=ids, layers_L=layers, top_k=2)
