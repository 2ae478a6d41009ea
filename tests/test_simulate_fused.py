"""The fused simulation kernel (``simulate_kernel``) against the NumPy passes it replaced
(``simulate._simulate_volume_reference``): every metric bit for bit, for every copy model, replica
policy and hardware preset, on random placements with redundant experts, -1 ids, repeated ids in a
row, several batches and nodes; and the parallel parts of ``compare`` independent of the thread count."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from factories import FUSED_DEDUPS, FUSED_EXPERT, FUSED_SHAPES, fused_ids, fused_slots, redundant_placement
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrace.placement import simulate, simulate_kernel
from moetrace.placement.hardware import CostModel, preset
from moetrace.placement.simulate import _simulate_volume_reference, simulate_volume

pytest.importorskip("numba")

DEDUPS = FUSED_DEDUPS
POLICIES = ("same_node", "even", "metro")
EXPERT = FUSED_EXPERT


def _case(seed: int, *, T=300, L=3, K=6, E=12, W=8, g=4, B=5, redundant=4, minus_one=0.15, dtype=np.int16):
    rng = np.random.default_rng(seed)
    ids = fused_ids(rng, T=T, L=L, K=K, E=E, minus_one=minus_one)
    kw = dict(
        placement=redundant_placement(rng, L, E, E + redundant),
        batch_T=rng.integers(0, B, T),
        src_rank_T=rng.integers(0, W, T),
        num_batches=B,
        num_ranks=W,
        ranks_per_node=g,
        bytes_per_token=18,
    )
    return ids.astype(dtype), kw


def _assert_same(ids, **kw) -> dict[str, np.ndarray]:
    got = simulate_volume(ids, **kw)
    want = _simulate_volume_reference(ids, **kw)
    assert list(got) == list(want)
    for m in want:
        assert got[m].dtype == want[m].dtype and got[m].shape == want[m].shape, m
        assert np.array_equal(got[m], want[m], equal_nan=True), m
    return got


@pytest.mark.parametrize("dedup", DEDUPS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("hw", ["h100", "gb200"])
def test_fused_equals_reference_every_copy_model_and_policy(dedup, policy, hw):
    ids, kw = _case(1)
    _assert_same(
        ids, dedup=dedup, policy=policy, cost=CostModel(hardware=preset(hw), expert=EXPERT), time_hidden_size=64, **kw
    )


@pytest.mark.parametrize("ranks_per_node", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("dedup", DEDUPS)
def test_fused_equals_reference_nodes(ranks_per_node, dedup):
    ids, kw = _case(2, W=16, g=ranks_per_node, redundant=20, B=3)
    _assert_same(ids, dedup=dedup, policy="same_node", cost=CostModel(), **kw)


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64, np.int8])
def test_fused_equals_reference_id_dtypes(dtype):
    ids, kw = _case(3, dtype=dtype)
    _assert_same(ids, dedup="node", policy="same_node", **kw)


@pytest.mark.parametrize("redundant", [0, 8])
def test_fused_equals_reference_without_cost_and_unknown_expert(redundant):
    ids, kw = _case(4, E=16, redundant=redundant)
    _assert_same(ids, dedup="expert", policy="even", **kw)
    _assert_same(ids, dedup="rank", policy="metro", cost=CostModel(), **kw)  # expert and moe NaN


def test_fused_edge_shapes():
    for T, minus_one in ((0, 0.0), (40, 1.0), (40, 0.0)):  # no tokens; nothing recorded; everything recorded
        ids, kw = _case(5, T=T, minus_one=minus_one)
        for dedup in DEDUPS:
            _assert_same(ids, dedup=dedup, cost=CostModel(hardware=preset("h200"), expert=EXPERT), **kw)
    ids, kw = _case(6, B=1, W=2, g=2, E=2, K=2, redundant=0)  # one node of two GPUs
    _assert_same(ids, dedup="node", cost=CostModel(), **kw)


def test_fused_chunks_of_layers_and_sparse_traffic(monkeypatch):
    """Layers counted a few at a time, and the reference's (batch, src, dst) counts by ``np.unique``."""
    from moetrace.placement import step_model

    ids, kw = _case(7, L=7, B=6)
    whole = {p: _assert_same(ids, dedup="node", policy=p, cost=CostModel(expert=EXPERT), **kw) for p in POLICIES}
    monkeypatch.setattr(simulate_kernel, "CHUNK_CELLS", 2 * 6 * 8)  # two layers per call (metro: fewer)
    monkeypatch.setattr(step_model, "_DENSE_PAIRS", 1)  # the reference's sparse path
    for p in POLICIES:
        chunked = _assert_same(ids, dedup="node", policy=p, cost=CostModel(expert=EXPERT), **kw)
        assert all(np.array_equal(whole[p][m], chunked[m], equal_nan=True) for m in whole[p])
    monkeypatch.setattr(simulate_kernel, "CHUNK_CELLS", 5 * 6 * 8)  # five layers per call, priced one at a time
    monkeypatch.setattr(simulate, "PRICE_CELLS", 6 * 8)
    for p in POLICIES:
        priced = _assert_same(ids, dedup="node", policy=p, cost=CostModel(expert=EXPERT), **kw)
        assert all(np.array_equal(whole[p][m], priced[m], equal_nan=True) for m in whole[p])


def test_out_of_range_ids_and_unknown_names_fail_as_before():
    ids, kw = _case(8)
    ids[3, 1, 2] = 12  # E = 12
    for f in (simulate_volume, _simulate_volume_reference):
        with pytest.raises(IndexError):
            f(ids, dedup="rank", policy="same_node", **kw)
    ids, kw = _case(8)
    with pytest.raises(ValueError, match="unknown replica policy"):
        simulate_volume(ids, policy="nearest", **kw)
    ids, kw = _case(8, redundant=0)  # 12 slots over 8 GPUs
    with pytest.raises(ValueError):
        simulate_volume(ids, **kw)


def test_without_numba_the_reference_runs(monkeypatch):
    ids, kw = _case(9)
    want = _simulate_volume_reference(ids, dedup="node", cost=CostModel(), **kw)
    monkeypatch.setattr(simulate_kernel, "available", lambda: False)
    got = simulate_volume(ids, dedup="node", cost=CostModel(), **kw)
    assert all(np.array_equal(got[m], want[m], equal_nan=True) for m in want)


def test_threads_give_the_same_results():
    """The kernel releases the GIL; simulations run side by side equal those run one at a time."""
    cases = [_case(s, T=2000, L=4) for s in range(4)]
    alone = [simulate_volume(ids, dedup="node", cost=CostModel(), **kw) for ids, kw in cases]
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda c: simulate_volume(c[0], dedup="node", cost=CostModel(), **c[1]), cases))
    for a, b in zip(alone, together):
        assert all(np.array_equal(a[m], b[m], equal_nan=True) for m in a)


@settings(max_examples=40)
@given(**FUSED_SHAPES, dedup=st.sampled_from(DEDUPS), policy=st.sampled_from(POLICIES))
def test_fused_equals_reference_random(seed, T, L, K, E, nodes, g, per_rank, B, minus_one, dedup, policy):
    W = nodes * g
    P = fused_slots(E, W, per_rank)
    ids, kw = _case(seed, T=T, L=L, K=K, E=E, W=W, g=g, B=B, redundant=P - E, minus_one=minus_one)
    _assert_same(ids, dedup=dedup, policy=policy, cost=CostModel(expert=EXPERT), time_hidden_size=32, **kw)


def test_a_kernel_numba_cannot_compile_falls_back_to_the_reference(monkeypatch):
    from numba.core.errors import TypingError

    from moetrace.analysis import jit

    def broken():
        raise TypingError("this numba cannot type the kernel")

    monkeypatch.setattr(jit, "_FAILED", {})  # the failure is remembered for this test only
    monkeypatch.setattr(simulate_kernel, "_kernel", broken)
    ids, kw = _case(10)
    want = _simulate_volume_reference(ids, dedup="expert", cost=CostModel(), **kw)
    with pytest.warns(RuntimeWarning, match="simulate-layers"):
        got = simulate_volume(ids, dedup="expert", cost=CostModel(), **kw)
    again = simulate_volume(ids, dedup="expert", cost=CostModel(), **kw)  # no second warning needed
    for m in want:
        assert np.array_equal(got[m], want[m], equal_nan=True) and np.array_equal(again[m], want[m], equal_nan=True)


@settings(max_examples=25)
@given(**FUSED_SHAPES, dedup=st.sampled_from(DEDUPS), policy=st.sampled_from(POLICIES))
def test_drawn_rows_equal_the_gathered_tokens(seed, T, L, K, E, nodes, g, per_rank, B, minus_one, dedup, policy):
    """``rows_T`` (compare's draws, with repeats, in any order) gives what ``ids[rows_T]`` gives, bit for bit,
    through the kernel and through the NumPy passes alike."""
    W = nodes * g
    P = fused_slots(E, W, per_rank)
    ids, kw = _case(seed, T=T, L=L, K=K, E=E, W=W, g=g, B=B, redundant=P - E, minus_one=minus_one)
    rng = np.random.default_rng(seed + 1)
    rows = rng.integers(0, T, 2 * T)  # every drawn token: a row of ids, some twice, some never
    kw |= dict(batch_T=rng.integers(0, B, 2 * T), src_rank_T=rng.integers(0, W, 2 * T))
    cost = CostModel(expert=EXPERT)
    want = _simulate_volume_reference(ids[rows], dedup=dedup, policy=policy, cost=cost, time_hidden_size=32, **kw)
    got = simulate_volume(ids, rows_T=rows, dedup=dedup, policy=policy, cost=cost, time_hidden_size=32, **kw)
    assert list(got) == list(want)
    assert all(np.array_equal(got[m], want[m], equal_nan=True) for m in want)


def test_drawn_rows_outside_the_ids_fail_before_the_kernel_reads():
    ids, kw = _case(11)
    kw |= dict(batch_T=kw["batch_T"][:4], src_rank_T=kw["src_rank_T"][:4])
    with pytest.raises(IndexError, match="rows_T must be in 0..299"):
        simulate_volume(ids, rows_T=np.array([0, 5, 300, 2]), **kw)
    with pytest.raises(ValueError, match="rows_T has 3 entries for 4 tokens"):
        simulate_volume(ids, rows_T=np.array([0, 5, 2]), **kw)
    with pytest.raises(ValueError, match="batch_T has 4 entries for 300 tokens"):
        simulate_volume(ids, **kw)
