"""advise's fused evaluation (``advise.evaluate.evaluate_tokens`` over ``simulate_kernel.rule_counts``)
against the NumPy passes it replaced (``advise.evaluate._evaluate_tokens_reference``): every field of
``StepMetrics`` bit for bit (NaNs in the same places), for every copy model, replica rule (``vllm``,
``sglang``, ``same_node``) and hardware preset, on random placements with redundant experts, -1 ids,
repeated ids in a row, several steps and nodes; the fallbacks (no numba, a numba that cannot compile,
inputs the kernel does not take) and the errors as before."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from factories import FUSED_DEDUPS, FUSED_EXPERT, FUSED_SHAPES, fused_ids, fused_slots, redundant_placement
from hypothesis import given, settings
from hypothesis import strategies as st

import moetrace.placement.advise.evaluate as advise_evaluate
from moetrace.errors import ConfigError
from moetrace.placement import simulate_kernel
from moetrace.placement.advise.evaluate import _evaluate_tokens_reference, evaluate_tokens
from moetrace.placement.advise.types import StepMetrics, StepTokens
from moetrace.placement.deployment import Deployment
from moetrace.placement.eplb import rebalance
from moetrace.placement.hardware import CostModel, preset
from moetrace.placement.maps import Placement, placement_from_phy2log

pytest.importorskip("numba")

DEDUPS = FUSED_DEDUPS
RULES = ("vllm", "sglang", "same_node")
EXPERT = FUSED_EXPERT


def _case(seed: int, *, T=300, L=3, K=6, E=12, W=8, g=4, B=5, redundant=4, minus_one=0.15, dtype=np.int16):
    """Steps of ``T`` tokens over ``B`` steps from ``W`` ranks on nodes of ``g``, and a placement."""
    rng = np.random.default_rng(seed)
    ids = fused_ids(rng, T=T, L=L, K=K, E=E, minus_one=minus_one)
    tokens = StepTokens(ids.astype(dtype), rng.integers(0, B, T), rng.integers(0, W, T), B)
    deployment = Deployment(num_dp=1, num_tp=W, num_ep=W, num_gpus_per_node=g)
    assert deployment.ranks_per_node == g
    return tokens, redundant_placement(rng, L, E, E + redundant), deployment


def _kw(deployment: Deployment, **over) -> dict:
    kw = dict(
        deployment=deployment,
        dedup="rank",
        cost=CostModel(hardware=preset("h100"), expert=EXPERT),
        bytes_per_token=18,
        hidden_size=64,
        rule="same_node",
    )
    return kw | over


def _assert_same(tokens: StepTokens, placement: Placement, **kw) -> StepMetrics:
    got = evaluate_tokens(tokens, placement, **kw)
    want = _evaluate_tokens_reference(tokens, placement, **kw)
    for f in StepMetrics._fields:
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and a.shape == b.shape, f
        assert np.array_equal(a, b, equal_nan=True), f
    return got


@pytest.mark.parametrize("dedup", DEDUPS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("hw", ["h100", "gb200"])
def test_fused_equals_reference_every_copy_model_and_rule(dedup, rule, hw):
    tokens, placement, dep = _case(1)
    cost = CostModel(hardware=preset(hw), expert=EXPERT)
    got = _assert_same(tokens, placement, **_kw(dep, dedup=dedup, rule=rule, cost=cost))
    assert np.isfinite(got.moe_seconds_BL).all() and (got.send_ranks_L >= 1).all()


@pytest.mark.parametrize("ranks_per_node", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("rule", RULES)
def test_fused_equals_reference_nodes(ranks_per_node, rule):
    tokens, placement, dep = _case(2, W=16, g=ranks_per_node, redundant=20, B=3)
    for dedup in DEDUPS:
        _assert_same(tokens, placement, **_kw(dep, dedup=dedup, rule=rule, cost=CostModel()))


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64, np.int8])
def test_fused_equals_reference_id_dtypes(dtype):
    tokens, placement, dep = _case(3, dtype=dtype)
    for rule in RULES:
        _assert_same(tokens, placement, **_kw(dep, dedup="node", rule=rule))


@pytest.mark.parametrize("redundant", [0, 8])
@pytest.mark.parametrize("rule", RULES)
def test_fused_equals_reference_one_replica_and_unknown_expert(redundant, rule):
    tokens, placement, dep = _case(4, E=16, redundant=redundant)
    _assert_same(tokens, placement, **_kw(dep, dedup="expert", rule=rule))
    got = _assert_same(tokens, placement, **_kw(dep, rule=rule, cost=CostModel()))  # expert size unknown
    assert np.isnan(got.moe_seconds_BL).all()


def test_fused_edge_shapes():
    # no tokens; nothing recorded; everything recorded; a step without tokens (B = 40 over 40 tokens)
    for T, minus_one, B in ((0, 0.0, 5), (40, 1.0, 5), (40, 0.0, 5), (40, 0.0, 40)):
        tokens, placement, dep = _case(5, T=T, minus_one=minus_one, B=B)
        for rule in RULES:
            for dedup in DEDUPS:
                got = _assert_same(tokens, placement, **_kw(dep, dedup=dedup, rule=rule))
                assert np.isnan(got.send_ranks_L).all() == (T == 0 or minus_one == 1.0)
    tokens, placement, dep = _case(6, B=1, W=2, g=2, E=2, K=2, redundant=0)  # one node of two GPUs
    for rule in RULES:
        _assert_same(tokens, placement, **_kw(dep, dedup="node", rule=rule))


def test_fused_a_layer_without_a_recorded_id():
    tokens, placement, dep = _case(7, L=4)
    tokens.topk_ids_TLK[:, 2, :] = -1
    for rule in RULES:
        got = _assert_same(tokens, placement, **_kw(dep, dedup="node", rule=rule))
        assert np.isnan(got.send_ranks_L[2]) and not np.isnan(got.send_ranks_L[[0, 1, 3]]).any()


def test_fused_chunks_of_layers(monkeypatch):
    """Layers counted a few at a time give the arrays of one call (and of the reference)."""
    tokens, placement, dep = _case(8, L=7, B=6)
    whole = {r: _assert_same(tokens, placement, **_kw(dep, dedup="node", rule=r)) for r in RULES}
    monkeypatch.setattr(simulate_kernel, "CHUNK_CELLS", 2 * 6 * 8)  # two layers per call
    for r in RULES:
        chunked = _assert_same(tokens, placement, **_kw(dep, dedup="node", rule=r))
        assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(whole[r], chunked, strict=True))


def test_fused_on_an_eplb_placement():
    """A placement as advise fits it (EPLB with redundant slots over 2 nodes), 256-expert ids."""
    rng = np.random.default_rng(9)
    L, E, K, W, T, B = 3, 64, 8, 16, 2000, 10
    load = rng.gamma(0.5, size=(L, E)) + 0.01
    placement = rebalance(load, num_replicas=E + 2 * W, num_groups=1, num_nodes=2, num_gpus=W)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T * L)]).reshape(T, L, K).astype(np.int16)
    tokens = StepTokens(ids, rng.integers(0, B, T), rng.integers(0, W, T), B)
    dep = Deployment(num_dp=2, num_tp=8, num_ep=W, num_gpus_per_node=8)
    for rule in RULES:
        for dedup in DEDUPS:
            _assert_same(tokens, placement, **_kw(dep, dedup=dedup, rule=rule))


def test_errors_as_before():
    tokens, placement, dep = _case(10)
    tokens.topk_ids_TLK[3, 1, 2] = 12  # E = 12
    for rule in RULES:
        for f in (evaluate_tokens, _evaluate_tokens_reference):
            with pytest.raises(IndexError):
                f(tokens, placement, **_kw(dep, rule=rule))
    tokens, placement, dep = _case(10)
    for f in (evaluate_tokens, _evaluate_tokens_reference):
        with pytest.raises(ConfigError, match="replica policy"):
            f(tokens, placement, **_kw(dep, rule="nearest"))
        with pytest.raises(ConfigError, match="copies per"):
            f(tokens, placement, **_kw(dep, dedup="token"))


def test_inputs_the_kernel_does_not_take_run_the_reference(monkeypatch):
    """Slots that do not divide over the ranks: the reference's own failure; an expert without a
    replica: the reference's numbers."""
    calls = []
    monkeypatch.setattr(advise_evaluate, "_evaluate_tokens_fused", lambda *a, **k: calls.append(1))
    tokens, placement, dep = _case(11, redundant=1)  # 13 slots over 8 ranks
    with pytest.raises(ValueError):
        evaluate_tokens(tokens, placement, **_kw(dep))
    tokens, placement, dep = _case(11, E=12, redundant=4)
    phy = placement.phy2log.copy()
    phy[phy == 11] = 10  # expert 11 has no replica left
    holey = placement_from_phy2log(phy, num_experts=12)
    tokens.topk_ids_TLK[tokens.topk_ids_TLK == 11] = -1
    got = evaluate_tokens(tokens, holey, **_kw(dep, rule="vllm"))
    want = _evaluate_tokens_reference(tokens, holey, **_kw(dep, rule="vllm"))
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got, want, strict=True))
    assert not calls


def test_without_numba_the_reference_runs(monkeypatch):
    tokens, placement, dep = _case(12)
    want = _evaluate_tokens_reference(tokens, placement, **_kw(dep, dedup="node", rule="vllm"))
    monkeypatch.setattr(simulate_kernel, "available", lambda: False)
    monkeypatch.setattr(advise_evaluate, "_evaluate_tokens_fused", None)  # would fail if called
    got = evaluate_tokens(tokens, placement, **_kw(dep, dedup="node", rule="vllm"))
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got, want, strict=True))


def test_a_kernel_numba_cannot_compile_falls_back_to_the_reference(monkeypatch):
    from numba.core.errors import TypingError

    from moetrace.analysis import jit

    def broken():
        raise TypingError("this numba cannot type the kernel")

    monkeypatch.setattr(jit, "_FAILED", {})  # the failure is remembered for this test only
    monkeypatch.setattr(simulate_kernel, "_kernel", broken)
    tokens, placement, dep = _case(13)
    want = _evaluate_tokens_reference(tokens, placement, **_kw(dep, rule="sglang"))
    with pytest.warns(RuntimeWarning, match="simulate-layers"):
        got = evaluate_tokens(tokens, placement, **_kw(dep, rule="sglang"))
    again = evaluate_tokens(tokens, placement, **_kw(dep, rule="sglang"))
    for a, b, c in zip(got, again, want, strict=True):
        assert np.array_equal(a, c, equal_nan=True) and np.array_equal(b, c, equal_nan=True)


def test_threads_give_the_same_results():
    """The kernel releases the GIL; evaluations run side by side equal those run one at a time."""
    cases = [(_case(s, T=2000, L=4), RULES[s % 3]) for s in range(6)]

    def one(c):
        (tokens, placement, dep), rule = c
        return evaluate_tokens(tokens, placement, **_kw(dep, dedup="node", rule=rule))

    alone = [one(c) for c in cases]
    with ThreadPoolExecutor(max_workers=3) as pool:
        together = list(pool.map(one, cases))
    for a, b in zip(alone, together, strict=True):
        assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b, strict=True))


@settings(max_examples=40, deadline=None)
@given(**FUSED_SHAPES, dedup=st.sampled_from(DEDUPS), rule=st.sampled_from(RULES))
def test_fused_equals_reference_random(seed, T, L, K, E, nodes, g, per_rank, B, minus_one, dedup, rule):
    """Random placements with redundant experts (every expert once, the other slots random copies)."""
    W = nodes * g
    P = fused_slots(E, W, per_rank)
    tokens, placement, dep = _case(seed, T=T, L=L, K=K, E=E, W=W, g=g, B=B, redundant=P - E, minus_one=minus_one)
    _assert_same(tokens, placement, **_kw(dep, dedup=dedup, rule=rule, cost=CostModel(expert=EXPERT), hidden_size=32))
