"""EPLB fast paths give exactly the straightforward greedy's output, ties and zeros included."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrace.errors import ConfigError
from moetrace.placement import eplb


# ---------------------------------------------------------------- straightforward references
def packing_reference(weight_Nn: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Heaviest item first (stable), into the lightest pack with room (first on ties), row by row.

    One item per pack: item i goes to pack i, as in DeepSeek's code.
    """
    N, n = weight_Nn.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(n), (N, n)).copy(), np.zeros((N, n), dtype=np.int64)
    pack_index = np.empty((N, n), dtype=np.int64)
    rank_in_pack = np.empty((N, n), dtype=np.int64)
    for row in range(N):
        pack_w = np.zeros(num_packs, dtype=weight_Nn.dtype)
        pack_n = [0] * num_packs
        for item in np.argsort(-weight_Nn[row], kind="stable"):
            pack = min((p for p in range(num_packs) if pack_n[p] < per_pack), key=lambda p: pack_w[p])
            pack_index[row, item] = pack
            rank_in_pack[row, item] = pack_n[pack]
            pack_w[pack] += weight_Nn[row, item]
            pack_n[pack] += 1
    return pack_index, rank_in_pack


def replicate_reference(weight_NE: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """num_phy - E passes of argmax(weight / logcnt) over all experts (first expert on ties)."""
    N, E = weight_NE.shape
    phy2log = np.broadcast_to(np.arange(num_phy, dtype=np.int64), (N, num_phy)).copy()
    rank = np.zeros((N, num_phy), dtype=np.int64)
    logcnt = np.ones((N, E), dtype=np.int64)
    rows = np.arange(N)
    for i in range(E, num_phy):
        best = np.argmax(weight_NE / logcnt.astype(weight_NE.dtype), axis=1)
        phy2log[:, i] = best
        rank[:, i] = logcnt[rows, best]
        logcnt[rows, best] += 1
    return phy2log, rank, logcnt


def _weights(draw, shape: tuple[int, int]) -> np.ndarray:
    """float32 weights: continuous, small integers (many ties and zeros), all zero, or huge ranges."""
    kind = draw(st.sampled_from(["gamma", "ties", "zeros", "spread"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "gamma":
        w = rng.gamma(0.5, size=shape) * 1000
    elif kind == "ties":
        w = rng.integers(0, 4, size=shape)
    elif kind == "zeros":
        w = np.zeros(shape)
    else:
        w = rng.integers(0, 3, size=shape) * 10.0 ** rng.integers(-30, 30, size=shape)
    return w.astype(np.float32)


@st.composite
def replication_cases(draw):
    N, E = draw(st.integers(1, 5)), draw(st.integers(1, 24))
    return _weights(draw, (N, E)), E + draw(st.integers(0, 3 * E + 2))


@st.composite
def packing_cases(draw):
    N, packs, per_pack = draw(st.integers(1, 5)), draw(st.integers(1, 8)), draw(st.integers(1, 6))
    return _weights(draw, (N, packs * per_pack)), packs


@settings(max_examples=150, deadline=None)
@given(replication_cases())
def test_replication_matches_the_straightforward_greedy(case):
    weight, num_phy = case
    for fast, ref in zip(eplb.replicate_experts(weight, num_phy), replicate_reference(weight, num_phy)):
        np.testing.assert_array_equal(fast, ref)


@settings(max_examples=150, deadline=None)
@given(packing_cases())
def test_packing_matches_the_straightforward_greedy(case):
    weight, packs = case
    for fast, ref in zip(eplb.balanced_packing(weight, packs), packing_reference(weight, packs)):
        np.testing.assert_array_equal(fast, ref)


@st.composite
def rebalance_cases(draw):
    nodes = draw(st.sampled_from([1, 2, 4]))
    gpus = nodes * draw(st.sampled_from([1, 2, 4]))
    E = gpus * draw(st.integers(1, 4))
    P = E + gpus * draw(st.integers(0, 3))
    groups = draw(st.sampled_from([1, nodes, 2 * nodes]))
    if E % groups:
        groups = 1
    return _weights(draw, (draw(st.integers(1, 4)), E)), dict(num_replicas=P, num_groups=groups, num_nodes=nodes, num_gpus=gpus)


@settings(max_examples=60, deadline=None)
@given(rebalance_cases())
def test_rebalance_matches_the_straightforward_composition(case):
    load, kw = case
    fast = eplb.rebalance(load, **kw)
    with mock.patch.object(eplb, "balanced_packing", packing_reference), mock.patch.object(
        eplb, "replicate_experts", replicate_reference
    ):
        ref = eplb.rebalance(load, **kw)
    for a, b in zip(fast, ref):
        np.testing.assert_array_equal(a, b)


def test_deepseek_v3_shape_matches_reference():
    """The benchmarked shape (58 x 256 -> 320 slots, 8 nodes x 8 GPUs), both policies."""
    load = np.random.default_rng(0).gamma(0.5, size=(58, 256)) * 1000
    for groups in (8, 1):
        kw = dict(num_replicas=320, num_groups=groups, num_nodes=8, num_gpus=64)
        fast = eplb.rebalance(load, **kw)
        with mock.patch.object(eplb, "balanced_packing", packing_reference), mock.patch.object(
            eplb, "replicate_experts", replicate_reference
        ):
            ref = eplb.rebalance(load, **kw)
        for a, b in zip(fast, ref):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_rebalance_rejects_non_finite_load(bad):
    load = np.ones((2, 8))
    load[1, 3] = bad
    with pytest.raises(ConfigError, match="finite"):
        eplb.rebalance(load, num_replicas=8, num_groups=1, num_nodes=1, num_gpus=2)
