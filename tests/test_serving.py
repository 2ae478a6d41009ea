"""The library router (moetrace.serving): placement files made by `moetrace place` on a small
synthetic trace, routed from the prompts' routed expert ids as the engines return them."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.placement.exports import load_placement
from moetrace.placement.joint import members_of_placement, node_capacity, node_scores
from moetrace.serving import ExpertRouter, RoutingError, expert_counts
from moetrace.serving.replay import held_out_requests, replay

runner = CliRunner()
DEPLOY = ["--config", "DP8TP1EP8", "--gpus-per-node", "2"]  # 4 nodes, 2 DP ranks each


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("serving")
    trace = d / "syn"
    r = runner.invoke(
        app,
        [
            "synth",
            "--model",
            "olmoe-1b-7b-tiny",
            "--datasets",
            "gsm8k,mbpp,xsum",
            "--requests",
            "120",
            "-o",
            str(trace),
        ],
    )
    assert r.exit_code == 0, r.output
    out = {"trace": trace}
    for strategy in ("joint", "improved", "linear"):
        p = d / f"{strategy}.json"
        r = runner.invoke(
            app, ["place", str(trace), *DEPLOY, "--strategy", strategy, "--test-fraction", "0.5", "-q", "-o", str(p)]
        )
        assert r.exit_code == 0, r.output
        out[strategy] = p
    return out


@pytest.fixture(scope="module")
def held(made):
    return held_out_requests(ExpertRouter.from_placement(made["joint"]), made["trace"])


def test_counts_from_routed_ids_equal_the_trace_counts(made, held):
    router = ExpertRouter.from_placement(made["joint"])
    for ids, counts in zip(held.prefill_ids, held.prefill_RLE, strict=True):
        assert ids.ndim == 3 and len(ids) > 0
        np.testing.assert_array_equal(router.counts(ids), counts)


def test_window_equals_compare_offline_routing_in_any_order(made, held):
    router = ExpertRouter.from_placement(made["joint"])
    assert router.kind == "price" and router.router.max_node_load is not None
    window = [d.node for d in router.route_window(held.prefill_ids)]
    np.testing.assert_array_equal(window, held.offline_nodes_R)
    # the window is one assignment: the arrival order changes nothing
    perm = np.random.default_rng(1).permutation(len(held.prefill_ids))
    shuffled = ExpertRouter.from_placement(made["joint"]).route_window([held.prefill_ids[i] for i in perm])
    np.testing.assert_array_equal([d.node for d in shuffled], held.offline_nodes_R[perm])
    # the cap of the window: no node over node_capacity(R, G, limit)
    R, G = len(window), router.num_nodes
    assert np.bincount(window, minlength=G).max() <= node_capacity(R, G, router.router.max_node_load)
    # every request is in flight on a DP rank of its node, ranks of a node evenly used
    assert router.inflight().sum() == R
    assert all(router.rank_node_A[d.rank] == d.node for d in router.route_window(held.prefill_ids[:4]))


def test_stream_scores_are_node_scores_bit_for_bit(made, held):
    router = ExpertRouter.from_placement(made["joint"])
    pf = router.placement_file
    member = members_of_placement(pf.placement, num_groups=router.num_nodes, num_experts=router.num_experts)
    for counts in held.prefill_RLE:
        want = node_scores(counts[None], member)[0]
        np.testing.assert_array_equal(router.scores(counts), want)
        if counts.any():  # the divisor route() hands in: the counts' integer sum
            np.testing.assert_array_equal(router.scores(counts, total=int(counts.sum())), want)


def test_stream_without_a_cap_is_the_offline_argmax(made, held):
    pf = load_placement(made["joint"])
    uncapped = dataclasses.replace(pf, router=dataclasses.replace(pf.router, max_node_load=None))
    offline = ExpertRouter(uncapped).nodes_of_window(held.prefill_RLE)
    stream = ExpertRouter(uncapped)
    assert [stream.route(ids).node for ids in held.prefill_ids] == offline.tolist()


def test_stream_keeps_every_node_under_the_capacity_of_the_inflight_count(made, held):
    router = ExpertRouter.from_placement(made["joint"])
    G, limit = router.num_nodes, router.router.max_node_load
    # a burst of one kind first (the requests the window sends to node 0), then the rest: no release
    first = [i for i, g in enumerate(held.offline_nodes_R) if g == held.offline_nodes_R[0]]
    order = first + [i for i in range(len(held.prefill_ids)) if i not in first]
    for n, i in enumerate(order, start=1):
        d = router.route(held.prefill_ids[i])
        assert d.routed and router.rank_node_A[d.rank] == d.node
        load_G = np.bincount(router.rank_node_A, weights=router.inflight(), minlength=G)
        assert load_G.max() <= node_capacity(n, G, limit), (n, load_G)
    # releasing frees room: the same request goes back to its best node once that node is empty
    for rank, k in enumerate(router.inflight().tolist()):
        for _ in range(k):
            router.release(rank)
    assert router.inflight().sum() == 0
    net = router.scores(held.prefill_RLE[0]) - np.asarray(router.router.node_prices_G)
    assert router.route(held.prefill_ids[0]).node == int(np.argmax(net))


def test_ranks_inside_a_node_take_turns_and_release_is_checked(made, held):
    router = ExpertRouter.from_placement(made["joint"])
    assert router.num_ranks == 8 and router.rank_node_A.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    pf = load_placement(made["joint"])
    free = ExpertRouter(dataclasses.replace(pf, router=dataclasses.replace(pf.router, max_node_load=None)))
    ids = held.prefill_ids[0]
    a, b, c = free.route(ids), free.route(ids), free.route(ids)
    assert a.node == b.node == c.node and a.rank != b.rank and c.rank == a.rank
    free.release(b.rank)
    assert free.route(ids).rank == b.rank
    with pytest.raises(ValueError, match="no request in flight"):
        free.release(next(r for r in range(8) if free.inflight()[r] == 0))
    with pytest.raises(ValueError, match="not one of"):
        free.release(99)


def test_missing_or_malformed_routing_falls_back_to_the_least_loaded_rank(made, held):
    router = ExpertRouter.from_placement(made["joint"])
    L, K = router.num_layers, 8
    cases = {
        "no routing": [None, np.zeros((0, L, K), np.int16), np.full((3, L, K), -1, np.int16)],
        "malformed": [np.zeros((3, L + 1, K), np.int16), np.full((2, L, K), 64, np.int16), np.zeros((2, L)), [["x"]]],
    }
    seen = []
    for reason, inputs in cases.items():
        for ids in inputs:
            d = router.route(ids)
            assert not d.routed and d.reason.startswith(reason), (reason, d)
            seen.append(d.rank)
    assert seen == list(range(len(seen)))  # the least-loaded rank each time: 0, 1, 2, ...
    assert router.stats()["fallbacks"] == {"no routing": 3, "malformed": 4}
    # a window: the unreadable one falls back, the others are routed as a window of their own
    ds = ExpertRouter.from_placement(made["joint"]).route_window([None, *held.prefill_ids[:3]])
    assert [d.routed for d in ds] == [False, True, True, True]
    strict = ExpertRouter.from_placement(made["joint"], fallback="error")
    with pytest.raises(RoutingError, match="MoE layers"):
        strict.route(np.zeros((3, L + 1, K), np.int16))
    assert not strict.route(None).routed  # missing routing is not an error


def test_down_ranks_and_nodes(made, held):
    router = ExpertRouter.from_placement(made["joint"])
    ids = held.prefill_ids[0]
    best = router.route(ids)
    router.release(best.rank)
    router.set_live(best.rank, False)
    other = router.route(ids)  # the node's other rank
    assert other.node == best.node and other.rank != best.rank
    router.set_live(other.rank, False)  # the whole node down: the next best live node
    d = router.route(ids)
    assert d.routed and d.node != best.node
    for r in range(router.num_ranks):
        router.set_live(r, False)
    with pytest.raises(RoutingError, match="no live"):
        router.route(ids)


def test_concurrent_arrivals_and_releases_lose_no_count(made, held):
    router = ExpertRouter.from_placement(made["joint"])
    errors = []

    def work(k: int) -> None:
        try:
            for j in range(150):
                d = router.route(held.prefill_ids[(k * 7 + j) % len(held.prefill_ids)])
                if j % 3:
                    router.release(d.rank)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st = router.stats()
    assert sum(st["decisions_per_rank"]) == 6 * 150
    assert sum(st["inflight_per_rank"]) == 6 * 50  # every third one kept


def test_centroid_router_window_and_stream_equal_offline(made):
    router = ExpertRouter.from_placement(made["improved"])
    assert router.kind == "centroid"
    ho = held_out_requests(router, made["trace"])
    assert [d.node for d in router.route_window(ho.prefill_ids)] == ho.offline_nodes_R.tolist()
    stream = ExpertRouter.from_placement(made["improved"])
    assert [stream.route(ids).node for ids in ho.prefill_ids] == ho.offline_nodes_R.tolist()


def test_ungrouped_placement_balances_over_ranks(made, held):
    router = ExpertRouter.from_placement(made["linear"])
    assert router.kind == "none"
    ranks = [router.route(ids).rank for ids in held.prefill_ids[:16]]
    assert ranks == list(range(8)) * 2


def test_replay_reports_window_equal_to_offline(made):
    res = replay(ExpertRouter.from_placement(made["joint"]), made["trace"])
    assert res.window_equals_offline and res.num_requests == 60
    assert 0.0 <= res.stream_agreement <= 1.0 and res.decision_p99_ms > 0


@given(
    shape=st.tuples(st.integers(1, 40), st.integers(1, 5), st.integers(1, 9)),
    num_experts=st.integers(1, 300),
    dtype=st.sampled_from([np.uint8, np.int16, np.int32, np.int64]),  # one compilation each and layout
    layout=st.sampled_from(["contiguous", "layer view"]),
    bad=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_counting_kernel_equals_numpy(shape, num_experts, dtype, layout, bad, seed):
    """The numba kernel and the NumPy bincount give the same counts (every id dtype, views of consecutive
    MoE layers as the proxy hands in), and refuse the same ids."""
    from moetrace.serving.router import _count_kernel, _count_numpy

    T, L, K = shape
    rng = np.random.default_rng(seed)
    top = min(num_experts, np.iinfo(dtype).max + 1)
    full = rng.integers(-1 if np.iinfo(dtype).min < 0 else 0, top, size=(T, L + 2, K)).astype(dtype)
    if bad:  # one id outside -1..E-1 where the dtype can hold one
        if np.iinfo(dtype).max >= num_experts:
            full[rng.integers(T), 1, rng.integers(K)] = num_experts
        elif np.iinfo(dtype).min < -1:
            full[rng.integers(T), 1, rng.integers(K)] = -2
    ids = np.ascontiguousarray(full[:, 1 : L + 1]) if layout == "contiguous" else full[:, 1 : L + 1]
    a, b = np.zeros((L, num_experts), np.int64), np.zeros((L, num_experts), np.int64)
    bad_a, bad_b = _count_kernel()(ids, a), _count_numpy(ids, b)
    assert bad_a == bad_b
    if not bad_a:
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(expert_counts(ids, num_layers=L, num_experts=num_experts), a)
    else:
        with pytest.raises(RoutingError, match="routed expert ids must be in"):
            expert_counts(ids, num_layers=L, num_experts=num_experts)


def test_expert_counts_rejects_ids_beyond_the_model():
    with pytest.raises(RoutingError, match="-1..3"):
        expert_counts(np.array([[[4]]]), num_layers=1, num_experts=4)
    np.testing.assert_array_equal(
        expert_counts(np.array([[[3, -1]], [[3, 0]]]), num_layers=1, num_experts=4), [[1, 0, 0, 2]]
    )


def _reference_rank(router: ExpertRouter, counts, inflight_A, live_A) -> int:
    """The stream rule (module docstring of moetrace.serving.router) restated on numpy arrays."""
    node_A = router.rank_node_A
    G = router.num_nodes
    net_G = router.scores(counts) - np.asarray(router.router.node_prices_G)
    eligible_G = np.bincount(node_A, weights=live_A, minlength=G) > 0
    if not eligible_G.any():
        raise RoutingError("no live rank")
    load_G = np.bincount(node_A, weights=inflight_A, minlength=G)
    cap = node_capacity(int(inflight_A.sum()) + 1, int(eligible_G.sum()), router.router.max_node_load)
    eligible_G &= load_G < cap
    node = int(np.flatnonzero(eligible_G)[np.argmax(net_G[eligible_G])])
    ranks = np.flatnonzero((node_A == node) & live_A)
    return int(ranks[np.argmin(inflight_A[ranks])])


@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["route", "route", "release", "down", "down", "up"]), st.integers(0, 10**6)),
        min_size=1,
        max_size=60,
    )
)
def test_stream_decisions_equal_the_rule_restated_on_arrays(made, held, ops):
    """Any sequence of arrivals, releases and ranks going down and up: each decision is the stream rule's
    on the router's own in-flight and live state, and that state adds up (per rank and per node)."""
    router = ExpertRouter.from_placement(made["joint"])
    A = router.num_ranks
    for op, x in ops:
        inflight, live = router.inflight(), router.live()
        if op == "route":
            ids = held.prefill_ids[x % len(held.prefill_ids)]
            try:
                want = _reference_rank(router, router.counts(ids), inflight, live)
            except RoutingError:
                want = None
            if want is None:  # every rank is down
                with pytest.raises(RoutingError):
                    router.route(ids)
            else:
                d = router.route(ids)
                assert d.routed and d.rank == want and d.node == router.rank_node_A[want]
        elif op == "release" and inflight.sum():
            router.release(int(np.flatnonzero(inflight)[x % np.count_nonzero(inflight)]))
        elif op in ("down", "up"):
            router.set_live(x % A, op == "up")
        after = router.inflight()
        assert after.min() >= 0
        stats = router.stats()
        assert stats["inflight_per_rank"] == after.tolist()
        assert stats["live_ranks"] == np.flatnonzero(router.live()).tolist()
