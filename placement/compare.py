"""Orchestration behind ``moetrace place`` and ``moetrace compare``: trace → placements → volume.

Steps: count tokens per (request, stage, layer, expert) with ``analysis.counts``; split requests
into train and test (seeded, by request); build each strategy's placement from the training
requests only; route the held-out requests to groups (grouped strategies: by their router
from prefill, ``routers``; others: uniformly at random); form global batches; simulate the all-to-all volume; normalize
inter-node volume to the median of the linear baseline (core paper Fig. 9).

A global batch is one decode step: each of the G groups (nodes) takes ``batch_requests / G``
requests drawn with replacement from the test requests routed to it, each at a uniformly drawn
decode position (one token per request). Within a node, requests go round robin over its DP
replicas and then over each replica's TP GPUs (the GPU the token is dispatched from). All strategies
draw from the same random stream (seed), so baselines share their batches.

The strategies come from the registry (``strategies.STRATEGIES``); the result files' names, format
and version from ``moetrace.results`` (``COMPARE``).

This module runs a comparison (``run_compare``: place, bound, simulate, rank); its parts live beside
it, and the names other modules import are re-exported here: the config (``compare_config``), the
trace's counts and held-out tokens (``compare_data``), the drawn steps and their pricing
(``compare_steps``), ours' validation pricer (``compare_pricer``), the placements
(``compare_placing``), the upper bounds (``compare_bounds``), the verdict (``compare_verdict``), the
result and its files (``compare_result``), compare.json's typed form (``compare_manifest``).

Shape legend (docs/architecture.md): R requests, L MoE layers, E logical experts, K top-k
slots, T tokens, B batches, G node groups, P physical slots.

Out of scope: the algorithms themselves (pure functions in the sibling modules); the printed table
(``report``); rendering.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from moetrace.placement.compare_bounds import bound_placements, expert_copy_floor
from moetrace.placement.compare_config import (
    MAX_ROUTE_FIRST_DECODE,
    MAX_SIMULATED_TOKENS,
    MAX_TEST_REQUESTS,
    MAX_TRAIN_REQUESTS,
    CompareConfig,
    parse_route_on,
)
from moetrace.placement.compare_data import (
    MAX_PREFILL_TOKENS,
    TraceData,
    check_caps,
    held_out_nbytes,
    load_trace_data,
    request_caps,
    with_held_out_tokens,
)
from moetrace.placement.compare_manifest import CompareManifest, GroupingRecord
from moetrace.placement.compare_placing import PlacedStrategy, make_placement, place_strategies, placement_file
from moetrace.placement.compare_pricer import VALIDATION_BATCHES, validation_pricer
from moetrace.placement.compare_result import MIN_ORACLE_GAIN, CompareResult, write_results
from moetrace.placement.compare_steps import (
    Measure,
    Stepper,
    a2a_seconds_B,
    a2a_seconds_median,
    held_out_batches,
    node_counts,
    node_shares,
    one_blas_thread,
    prefill_batches,
    seconds_B,
    seconds_median,
    simulation_workers,
)
from moetrace.placement.compare_verdict import compare_stage_choices, compare_verdict, within_limit
from moetrace.placement.joint import effective_node_load_limit
from moetrace.placement.strategies import BOUNDS

__all__ = [
    "EARLY_HELD_OUT_BYTES",
    "MAX_PREFILL_TOKENS",
    "MAX_ROUTE_FIRST_DECODE",
    "MAX_SIMULATED_TOKENS",
    "MAX_TEST_REQUESTS",
    "MAX_TRAIN_REQUESTS",
    "MIN_HELD_OUT_REQUESTS",
    "MIN_ORACLE_GAIN",
    "VALIDATION_BATCHES",
    "CompareConfig",
    "CompareResult",
    "Measure",
    "PlacedStrategy",
    "TraceData",
    "a2a_seconds_B",
    "a2a_seconds_median",
    "behind_the_placing",
    "bound_placements",
    "check_caps",
    "compare_verdict",
    "expert_copy_floor",
    "held_out_batches",
    "held_out_nbytes",
    "load_trace_data",
    "make_placement",
    "node_counts",
    "node_shares",
    "parse_route_on",
    "place_strategies",
    "placement_file",
    "prefill_batches",
    "request_caps",
    "run_compare",
    "seconds_B",
    "seconds_median",
    "validation_pricer",
    "with_held_out_tokens",
    "within_limit",
    "write_results",
]


#: fewer held-out requests than this and compare warns: its steps draw again and again from the same few
MIN_HELD_OUT_REQUESTS = 20


#: held-out tokens of at most this many bytes (``held_out_nbytes``: the decode ids and the prefill sample)
#: are read before placing (``moetrace compare`` collects them in its counting pass:
#: ``load_trace_data(held_out_max_bytes=...)``), and each strategy's simulations run beside the placing of
#: the next; more are read after placing, so that the clustering's arrays and the tokens are never resident
#: together (the README's 10,000-request trace holds 570 MB of them)
EARLY_HELD_OUT_BYTES = 256 << 20


def _simulation_key(ps: PlacedStrategy) -> tuple[int, int, int]:
    """Candidates with one key simulate alike: the same placement and routing objects, and the same
    ``extra`` (which the simulation's notes go to); ``dataclasses.replace`` keeps all three."""
    return id(ps.placement), id(ps.group_of_test_R), id(ps.extra)


#: the nice value of compare's simulation threads (Linux), over the process's own
SIMULATION_NICE = 10


def behind_the_placing() -> None:
    """A simulation thread yields its core to the placing where both want it (Linux: the thread's nice value
    raised by ``SIMULATION_NICE``; the placing's own threads keep the process's): the placing is compare's
    critical path, and the simulations fill the cores it leaves (19.3 against 20.4 s, median of 6
    alternating runs; advise's evaluations beside its grouped fits likewise). Results do not depend on
    it; elsewhere nothing changes."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + SIMULATION_NICE)
    except OSError:  # a sandbox that forbids it: the simulations compete with the placing, as they did
        return


def _decode_steps(
    data: TraceData, cfg: CompareConfig, stepper: Stepper, ps: PlacedStrategy
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``ps`` simulated on the held-out decode steps, and what the steps note of its routing (for
    ``ps.extra``, which the caller updates: simulations run on threads beside the placing)."""
    assert data.test_topk_ids_TLK is not None and data.test_req_T is not None  # read by with_held_out_tokens
    G = cfg.deployment.num_groups
    usable = np.flatnonzero(data.is_test_R & (np.bincount(data.test_req_T, minlength=len(data.is_test_R)) > 0))
    rows, batch, src, empty = held_out_batches(data, cfg, ps.group_of_test_R)
    notes = {
        "groups_without_routed_requests": empty,
        # held-out requests routed to the busiest node, over an even share (1: no router, even by construction)
        "busiest_node_load": round(float(node_shares(ps.group_of_test_R, usable, G).max() * G), 4),
        # the limit integer counts of these requests can meet (9 requests on 8 nodes: 2 on one node)
        "node_load_limit": round(effective_node_load_limit(len(usable), G, cfg.max_node_load), 4),
    }
    metrics = stepper.volume(
        data.test_topk_ids_TLK, ps.placement, (rows, batch, src), steps=cfg.num_batches, dedup=cfg.dedup
    )
    return metrics, notes


def _prefill_steps(
    data: TraceData, cfg: CompareConfig, stepper: Stepper, ps: PlacedStrategy
) -> dict[str, np.ndarray] | None:
    """``ps`` simulated on the held-out prefill steps (None: the trace has none to draw)."""
    drawn = prefill_batches(data, cfg, ps.group_of_test_R)
    if drawn is None:
        return None
    assert data.test_prefill_ids_TLK is not None
    return stepper.volume(
        data.test_prefill_ids_TLK, ps.placement, drawn, steps=cfg.num_prefill_batches, dedup=cfg.prefill_dedup
    )


def _both_stages(
    data: TraceData, cfg: CompareConfig, stepper: Stepper, ps: PlacedStrategy
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None, dict[str, Any]]:
    metrics, notes = _decode_steps(data, cfg, stepper, ps)
    return metrics, _prefill_steps(data, cfg, stepper, ps), notes


def run_compare(
    data: TraceData, cfg: CompareConfig, *, progress: Callable[[int, int], None] | None = None
) -> CompareResult:
    """Place every strategy on the training requests and simulate them on the held-out ones.

    ``progress(steps_done, steps_total)`` is called after each placement and each simulation
    (two steps per strategy, the linear reference included).

    The simulations run on threads (``simulation_workers``; the kernel releases the GIL), beside the
    placing where the held-out tokens are small enough to read first (``EARLY_HELD_OUT_BYTES``), else
    beside the bounds' placing; BLAS on one thread (``one_blas_thread``). Each simulation is computed
    whole on one thread from seeded draws, so the results do not depend on the threads or the order.
    """
    with one_blas_thread():
        return _run_compare(data, cfg, progress=progress)


def _run_compare(data: TraceData, cfg: CompareConfig, *, progress: Callable[[int, int], None] | None) -> CompareResult:
    dep, m = cfg.deployment, data.model
    G = dep.num_groups
    strategies = list(dict.fromkeys(cfg.strategies))
    reference = "linear"
    todo = strategies if reference in strategies else [reference, *strategies]
    bounds = [b.name for b in BOUNDS] if cfg.oracle else []
    steps, done = 2 * len(todo) + 2 * len(bounds), 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, steps)

    check_caps(data, cfg)
    stepper = Stepper.of(data.model, cfg)
    measure = stepper.measure
    early = held_out_nbytes(data) <= EARLY_HELD_OUT_BYTES
    if early:
        data = with_held_out_tokens(data)
    runs: dict[str, Future] = {}
    metrics: dict[str, dict[str, np.ndarray]] = {}
    prefill: dict[str, dict[str, np.ndarray]] = {}
    skipped: dict[str, str] = {}  # bound -> why it has no row (compare.json `skipped`, printed as a note)
    bound_failures: dict[str, list[str]] = {}  # bound -> deployable rows within the limit that beat it
    pool = ThreadPoolExecutor(max_workers=simulation_workers(len(todo)), initializer=behind_the_placing)
    try:

        def placed_one(s: str, ps: PlacedStrategy) -> None:
            step()
            if early:  # its simulations beside the next placement
                runs[s] = pool.submit(_both_stages, data, cfg, stepper, ps)

        placed = place_strategies(data, cfg, todo, on_placed=placed_one)
        if not early:
            data = with_held_out_tokens(data)  # after placing: the tokens and the clustering never share memory
            runs = {s: pool.submit(_both_stages, data, cfg, stepper, placed[s]) for s in todo}
        if bounds and data.tokens_from is not None:  # a load profile: no requests to route by their own decode
            skipped.update(dict.fromkeys(bounds, "a load profile has no requests; the bounds route held-out requests"))
            bounds, steps = [], steps - 2 * len(bounds)
        if bounds and not data.routable:  # the bounds start from the joint placement, which needs prefill
            why = (
                "the trace recorded decode routing only; the bounds start from the joint placement, whose router "
                "needs prefill routing (or the what-if --route-on first-decode:N)"
            )
            skipped.update(dict.fromkeys(bounds, why))
            bounds, steps = [], steps - 2 * len(bounds)
        # the bounds are placed while the strategies simulate, and simulated as their candidates come: every
        # bound's candidates side by side, each simulated once (the oracle's include perfect routing's)
        decode_runs: dict[tuple[int, int, int], tuple[PlacedStrategy, Future]] = {}

        def bound_placed(_: str, built: list[PlacedStrategy]) -> None:
            step()
            for c in built:
                if (key := _simulation_key(c)) not in decode_runs:
                    decode_runs[key] = c, pool.submit(_decode_steps, data, cfg, stepper, c)

        candidates = bound_placements(data, cfg, placed, on_placed=bound_placed) if bounds else {}
        for s in todo:
            dm, pm, notes = runs[s].result()
            placed[s].extra.update(notes)
            metrics[s] = dm
            if pm is not None:
                prefill[s] = pm
            step()

        # a bound is the best of its own candidates (one per kind of placement, each with the held-out decode
        # known) within the node-load limit, ranked by the verdict's measure (MoE-layer time per step; all-to-all
        # time when the expert size is unknown); never a deployable row: a deployable row within the limit that
        # beats a bound is the bound's failure, reported as such
        def verdict_s(mc: dict[str, np.ndarray]) -> float:
            return seconds_median(mc, measure)

        within = [s for s in todo if within_limit(placed[s])]
        simulated = {}
        for key, (c, run) in decode_runs.items():
            simulated[key], notes = run.result()
            c.extra.update(notes)  # the extra of every candidate with this key
        for s in bounds:
            sims = [(dict(simulated[_simulation_key(c)]), c) for c in candidates[s]]
            fits = [mc for mc in sims if within_limit(mc[1])] or sims
            metrics[s], placed[s] = min(fits, key=lambda mc: verdict_s(mc[0]))
            beaten = [d for d in within if verdict_s(metrics[d]) < verdict_s(metrics[s]) - 1e-12]
            if beaten:
                bound_failures[s] = beaten
        prefill_runs = {s: pool.submit(_prefill_steps, data, cfg, stepper, placed[s]) for s in bounds}
        for s, run in prefill_runs.items():
            if (pm := run.result()) is not None:
                prefill[s] = pm
            step()
    finally:  # an error in placing: the simulations not started are dropped, not waited for
        pool.shutdown(wait=True, cancel_futures=True)
    floor = None
    if cfg.oracle and data.tokens_from is not None:
        skipped["floor"] = "a load profile has no requests; the floor bounds each held-out request's local share"
    elif cfg.oracle and cfg.dedup == "expert" and cfg.num_redundant == 0:
        floor = expert_copy_floor(
            data.decode_RLE, rows=np.flatnonzero(data.is_test_R), num_groups=G, num_slots=m.num_experts
        )
    elif cfg.oracle:
        skipped["floor"] = (
            f"proven for --dedup expert without redundant slots only (this run: --dedup {cfg.dedup}, "
            f"--redundancy {cfg.num_redundant})"
        )
    manifest = CompareManifest(
        strategies=tuple(strategies),
        num_clusters=cfg.num_clusters,
        num_redundant=cfg.num_redundant,
        test_fraction=cfg.test_fraction,
        num_batches=cfg.num_batches,
        num_batch_requests=cfg.num_batch_requests,
        dedup=cfg.dedup,
        replica_policy=cfg.replica_policy,
        bytes_per_value=cfg.bytes_per_value,
        seed=cfg.seed,
        oracle=cfg.oracle,
        deployment=dep.name,
        gpus_per_node=dep.num_gpus_per_node,
        batch_requests=cfg.batch_requests,
        num_ep=dep.num_ep,
        num_nodes=dep.num_nodes,
        ranks_per_node=dep.ranks_per_node,
        bounds=tuple(bounds),
        trace=data.trace_path,
        num_train_requests=int((~data.is_test_R).sum()),
        num_test_requests=int(data.is_test_R.sum()),
        bound_kinds={b: placed[b].extra.get("kind") for b in bounds},
        expert_copy_floor=floor,
        reference=reference,
        model=m,
        grouping={
            s: GroupingRecord(
                num_clusters=p.grouping.num_clusters,
                cluster_to_groups=tuple(tuple(int(g) for g in gs) for gs in p.grouping.cluster_to_groups),
                router_match_rate=p.router_match_rate,
                groups_without_routed_requests=tuple(p.extra.get("groups_without_routed_requests", [])),
            )
            for s, p in placed.items()
            if p.grouping is not None
        },
        route_first_decode=data.route_first_decode,
        request_unit=data.request_unit,
        prefill_dedup=cfg.prefill_dedup,
        links=cfg.hardware.kernel(cfg.dedup).dispatch.links.to_json(),
        hardware=cfg.hardware,
        model_config=cfg.model_config,
        max_node_load=cfg.max_node_load,
        prefill_tokens_per_node=cfg.prefill_tokens_per_node,
        num_prefill_batches=cfg.num_prefill_batches if prefill else 0,
        expert=None if stepper.expert is None else stepper.expert.to_json(),
        skipped=skipped,
        verdict=compare_verdict(
            metrics,
            placed,
            todo,
            reference=reference,
            measure=measure,
            stages=compare_stage_choices(metrics, prefill, placed, todo, reference, measure, cfg.num_redundant),
        ),
        bound_failures=bound_failures,
        tokens_from=data.tokens_from,
        **request_caps(data),
    )
    return CompareResult(config=cfg, manifest=manifest, metrics=metrics, placed=placed, prefill_metrics=prefill)
