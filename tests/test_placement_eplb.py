"""EPLB against DeepSeek's own outputs and the engines', and the invariants any input keeps.

``tests/golden/eplb_deepseek.json`` holds what deepseek-ai/EPLB's ``eplb.py`` returned on 161 cases
(``tests/golden/make_eplb_golden.py`` regenerates it from their file). With ``accumulate="float32"``
(the reference's summation) each case must match exactly, or differ only in the ways
``moetrace.placement.eplb``'s docstring names, which are derived here from the case's inputs alone.

``tests/golden/eplb_engines.json`` holds, on tie-free loads, what SGLang 0.5.23
(``sglang/srt/eplb/eplb_algorithms/deepseek.py``), vLLM 0.33.0 (``vllm/distributed/eplb/policy/default.py``)
and DeepSeek's ``eplb.py`` (commit d52c72d) returned (``tests/golden/make_eplb_engines_golden.py``): the default
float64 summation must give both engines' placement, the float32 one the reference's.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrace.errors import ConfigError
from moetrace.placement import eplb
from moetrace.placement.maps import Placement, placement_problems

GOLDEN = Path(__file__).parent / "golden" / "eplb_deepseek.json"
CASES: list[dict[str, Any]] = json.loads(GOLDEN.read_text())["cases"]
ENGINES = json.loads((Path(__file__).parent / "golden" / "eplb_engines.json").read_text())
REFERENCE = "float32"  # DeepSeek's reference sums pack weights in float32
TIES_IN_ORDER = 16  # torch's CPU sort keeps equal weights in index order up to this many items

Difference = Literal["none", "replica_order", "equal_experts", "equal_groups"]


def _inputs(case: dict[str, Any]) -> tuple[np.ndarray, dict[str, int]]:
    kw = {k: case[k] for k in ("num_replicas", "num_groups", "num_nodes", "num_gpus")}
    return np.asarray(case["load"], dtype=np.float32), kw


def _deepseek(case: dict[str, Any]) -> Placement:
    """The golden outputs as a Placement (log2phy padded with -1 to the most replicas)."""
    logcnt = np.asarray(case["logcnt"], dtype=np.int64)
    log2phy = np.full((*logcnt.shape, int(logcnt.max())), -1, dtype=np.int64)
    for l, experts in enumerate(case["log2phy"]):
        for e, slots in enumerate(experts):
            log2phy[l, e, : len(slots)] = slots
    return Placement(np.asarray(case["phy2log"], dtype=np.int64), log2phy, logcnt)


def _policy(case: dict[str, Any]) -> tuple[int, int]:
    """(groups, nodes) the algorithm runs with: the global policy is one group on one node."""
    groups, nodes = case["num_groups"], case["num_nodes"]
    return (groups, nodes) if groups % nodes == 0 else (1, 1)


def _replica_load_LP(load_LE: np.ndarray, p: Placement) -> np.ndarray:
    """float32 [L, P]: the load each slot carries (its expert's load over its replica count)."""
    rows = np.arange(load_LE.shape[0])[:, None]
    return load_LE[rows, p.phy2log] / p.logcnt[rows, p.phy2log].astype(np.float32)


def _allowed_difference(case: dict[str, Any], ours: Placement) -> Difference:
    """The largest difference from DeepSeek's output that the module docstring allows for this case."""
    load, kw = _inputs(case)
    groups, nodes = _policy(case)
    L, E = load.shape
    group_load = load.reshape(L, groups, E // groups).sum(-1)
    if groups // nodes > 1 and groups > TIES_IN_ORDER and any(len(set(r.tolist())) < groups for r in group_load):
        return "equal_groups"
    per_node = kw["num_replicas"] // nodes
    if kw["num_replicas"] // kw["num_gpus"] == 1 or per_node <= TIES_IN_ORDER:
        return "none"
    w_LP = _replica_load_LP(load, ours)
    for l in range(L):
        for node in range(nodes):
            experts, first = np.unique(ours.phy2log[l, node * per_node : (node + 1) * per_node], return_index=True)
            if len(set(w_LP[l, node * per_node + first].tolist())) < len(experts):
                return "equal_experts"
    return "replica_order"


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_deepseek_but_for_the_order_of_equal_weights(case):
    load, kw = _inputs(case)
    ours, theirs = eplb.rebalance(load, **kw, accumulate=REFERENCE), _deepseek(case)
    assert placement_problems(ours, num_experts=load.shape[1], num_ranks=kw["num_gpus"]) == []
    allowed = _allowed_difference(case, ours)
    if allowed == "equal_groups":  # each node's total load is the same
        node = [_replica_load_LP(load, p).reshape(load.shape[0], _policy(case)[1], -1).sum(-1) for p in (ours, theirs)]
        np.testing.assert_allclose(node[0], node[1], rtol=1e-5)
        return
    np.testing.assert_array_equal(ours.logcnt, theirs.logcnt)
    gpu = [
        np.sort(_replica_load_LP(load, p).reshape(load.shape[0], kw["num_gpus"], -1), axis=-1) for p in (ours, theirs)
    ]
    np.testing.assert_array_equal(gpu[0], gpu[1])  # each GPU's multiset of per-replica loads
    if allowed == "equal_experts":
        return
    np.testing.assert_array_equal(ours.phy2log, theirs.phy2log)
    np.testing.assert_array_equal(np.sort(ours.log2phy, axis=-1), np.sort(theirs.log2phy, axis=-1))  # same slots
    if allowed == "none":
        np.testing.assert_array_equal(ours.log2phy, theirs.log2phy)


def test_golden_cases_show_every_documented_difference():
    """The golden set exercises each case of the docstring, and each difference really occurs."""
    allowed: Counter[str] = Counter()
    differs: Counter[str] = Counter()
    for case in CASES:
        load, kw = _inputs(case)
        ours, theirs = eplb.rebalance(load, **kw, accumulate=REFERENCE), _deepseek(case)
        kind = _allowed_difference(case, ours)
        allowed[kind] += 1
        differs[kind] += not all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    assert len(CASES) >= 150 and CASES[0]["name"] == "readme"  # the README's worked example, exactly
    assert differs["none"] == 0 and allowed["none"] >= 20
    for kind in ("replica_order", "equal_experts", "equal_groups"):
        assert differs[kind] >= 3, (kind, allowed, differs)
    kinds = Counter(c["kind"] for c in CASES)
    assert {"ties", "counts", "gamma", "zeros", "spread"} <= set(kinds) and kinds["gamma"] >= 40
    policies = Counter(
        "global" if c["num_groups"] % c["num_nodes"] else "hierarchical" for c in CASES if c["num_nodes"] > 1
    )
    assert min(policies["global"], policies["hierarchical"]) >= 20


# ---------------------------------------------------------------- invariants on any input
def _weights(draw, shape: tuple[int, int]) -> np.ndarray:
    """float32 weights: continuous, small integers (many ties and zeros), all zero, or huge ranges."""
    kind = draw(st.sampled_from(["gamma", "ties", "zeros", "spread"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    w: np.ndarray
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


@settings(max_examples=100, deadline=None)
@given(replication_cases())
def test_replication_minimises_the_heaviest_replica(case):
    """Every replica went to an expert that was the heaviest per replica when it got it: no other
    count vector with the same total has a lighter heaviest replica."""
    weight, num_phy = case
    phy2log, rank, logcnt = eplb.replicate_experts(weight, num_phy)
    E = weight.shape[1]
    assert (logcnt >= 1).all() and (logcnt.sum(1) == num_phy).all()
    for n in range(weight.shape[0]):
        assert np.array_equal(np.bincount(phy2log[n], minlength=E), logcnt[n])
        for e in range(E):  # an expert's replicas are ranked 0, 1, ... in slot order
            assert rank[n, phy2log[n] == e].tolist() == list(range(logcnt[n, e]))
    heaviest = (weight / logcnt.astype(np.float32)).max(1, keepdims=True)
    before_last = weight / np.maximum(logcnt - 1, 1).astype(np.float32)
    assert ((logcnt == 1) | (before_last >= heaviest)).all()


@st.composite
def packing_cases(draw):
    N, packs, per_pack = draw(st.integers(1, 5)), draw(st.integers(1, 8)), draw(st.integers(1, 6))
    return _weights(draw, (N, packs * per_pack)), packs


@settings(max_examples=100, deadline=None)
@given(packing_cases())
def test_packing_fills_every_pack_heaviest_first(case):
    weight, packs = case
    pack, rank = eplb.balanced_packing(weight, packs)
    per_pack = weight.shape[1] // packs
    for n in range(weight.shape[0]):
        for k in range(packs):
            mine = np.flatnonzero(pack[n] == k)
            assert sorted(rank[n, mine].tolist()) == list(range(per_pack))  # exactly n/m items, ranked once each
            by_rank = weight[n, mine[np.argsort(rank[n, mine])]]
            assert per_pack == 1 or (np.diff(by_rank) <= 0).all()  # a pack receives its items heaviest first


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=40), st.integers(1, 3))
def test_descending_argsort_is_numpys_stable_one(values, rows):
    """The float32 fast path (sorting integer keys) orders like a stable sort, -0.0, subnormals and ties included."""
    w = np.tile(np.asarray(values, dtype=np.float32), (rows, 1))
    np.testing.assert_array_equal(eplb._argsort_desc(w), np.argsort(-w, axis=1, kind="stable"))


@st.composite
def rebalance_cases(draw):
    nodes = draw(st.sampled_from([1, 2, 4]))
    gpus = nodes * draw(st.sampled_from([1, 2, 4]))
    groups = nodes * draw(st.sampled_from([1, 2]))
    E = groups * draw(st.integers(1, 6))
    P = -(-(E + draw(st.integers(0, 2 * gpus))) // gpus) * gpus
    return _weights(draw, (draw(st.integers(1, 4)), E)), {
        "num_replicas": P,
        "num_groups": groups,
        "num_nodes": nodes,
        "num_gpus": gpus,
    }


@settings(max_examples=60, deadline=None)
@given(rebalance_cases())
def test_hierarchical_policy_keeps_each_group_on_one_node(case):
    load, kw = case
    p = eplb.rebalance(load, **kw)
    L, E = load.shape
    assert placement_problems(p, num_experts=E, num_ranks=kw["num_gpus"]) == []
    group_of_slot = p.phy2log // (E // kw["num_groups"])
    node_of_slot = np.arange(kw["num_replicas"]) // (kw["num_replicas"] // kw["num_nodes"])
    for l in range(L):
        nodes_of_group = [set(node_of_slot[group_of_slot[l] == g].tolist()) for g in range(kw["num_groups"])]
        assert all(len(s) == 1 for s in nodes_of_group)
        assert Counter(n for (n,) in nodes_of_group) == Counter(
            {n: kw["num_groups"] // kw["num_nodes"] for n in range(kw["num_nodes"])}
        )


def test_groups_that_do_not_divide_the_experts_fall_back_to_the_global_policy():
    load = np.random.default_rng(0).gamma(0.5, size=(2, 16)).astype(np.float32)
    a = eplb.rebalance(load, num_replicas=24, num_groups=3, num_nodes=1, num_gpus=4)
    b = eplb.rebalance(load, num_replicas=24, num_groups=1, num_nodes=1, num_gpus=4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_rebalance_rejects_non_finite_load(bad):
    load = np.ones((2, 8))
    load[1, 3] = bad
    with pytest.raises(ConfigError, match="finite"):
        eplb.rebalance(load, num_replicas=8, num_groups=1, num_nodes=1, num_gpus=2)


@pytest.mark.parametrize("case", ENGINES["cases"], ids=[c["name"] for c in ENGINES["cases"]])
def test_float64_is_sglang_0_5_23_and_vllm_0_33_0_float32_is_deepseeks(case):
    load = np.asarray(case["load"], dtype=np.float32)
    kw = {k: case[k] for k in ("num_replicas", "num_groups", "num_nodes", "num_gpus")}
    ours = eplb.rebalance(load, **kw)  # float64: the default
    np.testing.assert_array_equal(ours.phy2log, np.asarray(case["sglang_phy2log"]))
    np.testing.assert_array_equal(ours.phy2log, np.asarray(case["vllm_phy2log"]))
    assert placement_problems(ours, num_experts=load.shape[1], num_ranks=kw["num_gpus"]) == []
    reference = eplb.rebalance(load, **kw, accumulate="float32")
    np.testing.assert_array_equal(reference.phy2log, np.asarray(case["deepseek_phy2log"]))


def test_the_engine_golden_holds_layers_where_the_summations_disagree():
    """Without such layers the test above could not tell float64 from float32."""
    assert ENGINES["about"]["sglang"].startswith("sglang 0.5.23") and ENGINES["about"]["vllm"].startswith("vllm 0.33.0")
    differ = 0
    for case in ENGINES["cases"]:
        assert case["candidates_where_sglang_and_vllm_differ"] == 0
        differ += sum(a != b for a, b in zip(case["sglang_phy2log"], case["deepseek_phy2log"]))
    assert differ >= 10 and {c["num_groups"] % c["num_nodes"] == 0 for c in ENGINES["cases"]} == {True, False}


def test_accumulate_is_checked():
    with pytest.raises(ConfigError, match="accumulate='float16'"):
        eplb.rebalance(np.ones((1, 8)), num_replicas=8, num_groups=1, num_nodes=1, num_gpus=2, accumulate="float16")  # type: ignore[arg-type]


def test_the_eplb_strategy_records_its_summation():
    """``place --strategy eplb`` writes what its builder returns into the placement file's ``source``."""
    from moetrace.placement.strategies import PlacementInputs, get_strategy

    case = ENGINES["cases"][0]
    load = np.asarray(case["load"], dtype=np.float32)
    x = PlacementInputs(
        num_layers=load.shape[0],
        num_experts=load.shape[1],
        num_slots=case["num_replicas"],
        num_ranks=case["num_gpus"],
        num_nodes=case["num_nodes"],
        ranks_per_node=case["num_gpus"] // case["num_nodes"],
        router_groups=case["num_groups"],
        seed=0,
        load_LE=load,
    )
    placement, extra = get_strategy("eplb").build(x)
    assert extra == {"eplb_num_groups": 8, "eplb_policy": "hierarchical", "eplb_sum": "float64"}
    np.testing.assert_array_equal(placement.phy2log, np.asarray(case["sglang_phy2log"]))
