"""A trace's held-out requests replayed through the library router (``moetrace route replay``).

Each held-out request of the placement's own split (the file's ``source``: seed, test fraction,
caps; ``compare.load_trace_data``) is given to ``ExpertRouter`` as the engines give it: its prompt's
routed expert ids ``[T, L, K]``. The replay reports whether the window routing equals the offline
routing ``compare`` uses (``Router.route`` on the trace's counts), how often a stream of single
arrivals lands on the same node, and the decision latency of one arrival.

Shape legend (docs/architecture.md): T tokens, L MoE layers, K top-k slots, E experts, R requests,
G nodes, A DP ranks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.compare import MAX_TEST_REQUESTS, MAX_TRAIN_REQUESTS, load_trace_data
from moetrace.serving.router import ExpertRouter
from moetrace.tracer.trace.reader import open_trace

__all__ = ["HeldOut", "ReplayResult", "held_out_requests", "prefill_ids_of_rows", "replay"]


@dataclass(frozen=True)
class HeldOut:
    """The placement's held-out requests of a trace."""

    trace_rows_R: np.ndarray  # int64 [R] rows of the trace's requests table, ascending (arrival order)
    prefill_RLE: np.ndarray  # [R, L, E] prefill counts as compare counts them
    offline_nodes_R: np.ndarray  # int64 [R] compare's routing of them (the placement's own router, all at once)
    prefill_ids: list[np.ndarray]  # [R] int16 [T, L, K] each request's prompt routed experts


def prefill_ids_of_rows(trace: str | os.PathLike[str], rows: np.ndarray) -> list[np.ndarray]:
    """The prompt tokens' routed expert ids of each trace row in ``rows`` (int16 ``[T, L, K]`` each,
    in position order), read from the trace (one pass)."""
    tr = open_trace(trace)
    index = {int(r): i for i, r in enumerate(np.asarray(rows).tolist())}
    parts: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in index]
    want = np.zeros(len(tr.request_arrays.request_id_R), dtype=bool)
    want[np.asarray(rows, dtype=np.int64)] = True
    for ta in tr.iter_token_arrays():
        sel = np.flatnonzero(want[ta.row_T] & ~ta.is_decode_T)
        for r in np.unique(ta.row_T[sel]).tolist():
            mine = sel[ta.row_T[sel] == r]
            parts[index[r]].append((ta.position_T[mine], ta.topk_ids_TLK[mine]))
    L, K = tr.model.num_moe_layers, tr.model.top_k
    out = []
    for ps in parts:
        if not ps:
            out.append(np.zeros((0, L, K), np.int16))
            continue
        pos = np.concatenate([p for p, _ in ps])
        ids = np.concatenate([i for _, i in ps])
        out.append(ids[np.argsort(pos, kind="stable")])
    return out


def held_out_requests(router: ExpertRouter, trace: str | os.PathLike[str]) -> HeldOut:
    """The held-out requests of the split the placement file was made with, routed offline."""
    src = router.placement_file.source or {}
    if "seed" not in src or "test_fraction" not in src:
        raise ConfigError(
            "the placement file records no train/test split (`source`); re-create it with `moetrace place`"
        )
    data = load_trace_data(
        trace,
        test_fraction=float(src["test_fraction"]),
        seed=int(src["seed"]),
        held_out_tokens=False,
        max_train_requests=int(src.get("max_train_requests", MAX_TRAIN_REQUESTS)),
        max_test_requests=int(src.get("max_test_requests", MAX_TEST_REQUESTS)),
    )
    if data.model.num_experts != router.num_experts or data.model.num_moe_layers != router.num_layers:
        raise ConfigError(f"{trace}: its model does not match the placement's ({router.placement_file.model.name})")
    test = np.flatnonzero(data.is_test_R)
    routes = router.router.route(data.prefill_RLE, placement=router.placement_file.placement, is_test_R=data.is_test_R)
    offline = np.zeros(len(test), np.int64) if routes.group_R is None else routes.group_R[test]
    rows = test if data.trace_rows_R is None else data.trace_rows_R[test]
    return HeldOut(
        trace_rows_R=rows,
        prefill_RLE=data.prefill_RLE[test],
        offline_nodes_R=offline,
        prefill_ids=prefill_ids_of_rows(trace, rows),
    )


@dataclass(frozen=True)
class ReplayResult:
    num_requests: int
    window_equals_offline: bool  # the held-out set as one window: the same node for every request
    window_nodes_R: np.ndarray  # int64 [R]
    offline_nodes_R: np.ndarray  # int64 [R]
    stream_nodes_R: np.ndarray  # int64 [R] single arrivals in trace order, all kept in flight
    stream_agreement: float  # share of requests the stream sends where the window does
    decision_p50_ms: float  # one arrival, routed experts in: counting, scoring, admission
    decision_p99_ms: float
    max_node_load_window: float  # the busiest node's requests over an even share, window routing
    max_node_load_stream: float


def replay(router: ExpertRouter, trace: str | os.PathLike[str]) -> ReplayResult:
    """Route the placement's held-out requests of ``trace`` as one window and as a stream (the router's
    load is reset before and after)."""
    ho = held_out_requests(router, trace)
    R, G = len(ho.prefill_ids), router.num_nodes
    fresh = ExpertRouter(router.placement_file, fallback=router.fallback)
    window = np.array([d.node for d in fresh.route_window(ho.prefill_ids)], dtype=np.int64)
    stream = ExpertRouter(router.placement_file, fallback=router.fallback)
    nodes, ms = [], []
    for ids in ho.prefill_ids:
        t0 = time.perf_counter()
        d = stream.route(ids)
        ms.append((time.perf_counter() - t0) * 1e3)
        nodes.append(d.node)
    stream_R = np.array(nodes, dtype=np.int64)

    def load(n: np.ndarray) -> float:
        return float(np.bincount(n, minlength=G).max() * G / max(R, 1))

    return ReplayResult(
        num_requests=R,
        window_equals_offline=bool(np.array_equal(window, ho.offline_nodes_R)),
        window_nodes_R=window,
        offline_nodes_R=ho.offline_nodes_R,
        stream_nodes_R=stream_R,
        stream_agreement=float((stream_R == window).mean()) if R else 1.0,
        decision_p50_ms=float(np.percentile(ms, 50)) if ms else 0.0,
        decision_p99_ms=float(np.percentile(ms, 99)) if ms else 0.0,
        max_node_load_window=load(window),
        max_node_load_stream=load(stream_R),
    )
