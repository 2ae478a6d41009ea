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

Shape legend (docs/architecture.md): R requests, L MoE layers, E logical experts, K top-k
slots, T tokens, B batches, G node groups, P physical slots.

Out of scope: the algorithms themselves (pure functions in the sibling modules); the printed table
(``report``); rendering.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from moetrace import results as rf
from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.compare_manifest import CompareManifest, GroupingRecord
from moetrace.placement.cost import expert_compute_for
from moetrace.placement.deployment import Deployment
from moetrace.placement.exports import PlacementFile
from moetrace.placement.grouping import Grouping, fit_grouping, groups_of_clusters
from moetrace.placement.hardware import CostModel, Hardware, default_hardware
from moetrace.placement.held_out import held_out_R
from moetrace.placement.joint import effective_node_load_limit
from moetrace.placement.maps import Placement
from moetrace.placement.replica_routing import ReplicaPolicy
from moetrace.placement.routers import NoRouter, PriceRouter, Router, fit_router
from moetrace.placement.simulate import METRICS, simulate_volume
from moetrace.placement.step_model import DedupUnit, search_links
from moetrace.placement.strategies import BOUNDS, STRATEGIES, PlacementInputs, check_strategies, get_strategy

if TYPE_CHECKING:
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "CompareConfig",
    "parse_route_on",
    "TraceData",
    "expert_copy_floor",
    "held_out_batches",
    "load_trace_data",
    "with_held_out_tokens",
    "make_placement",
    "place_strategies",
    "run_compare",
    "write_results",
]


#: the least saving over linear (a share of linear's median) the oracle must show before compare says
#: what share of it each strategy reaches
MIN_ORACLE_GAIN = 0.02

#: fewer held-out requests than this and compare warns: its steps draw again and again from the same few
MIN_HELD_OUT_REQUESTS = 20

Stage = Literal["decode", "prefill"]

#: the most tokens one comparison simulates (batches x requests per batch), so a typo cannot ask for terabytes
MAX_SIMULATED_TOKENS = 20_000_000

#: the most held-out prompt tokens kept for the prefill steps (a uniform, seeded sample of them beyond)
MAX_PREFILL_TOKENS = 1 << 17
#: the most generated tokens ``--route-on first-decode:N`` lets a router see
MAX_ROUTE_FIRST_DECODE = 1 << 16

#: training requests the placements are fitted on by default (a seeded uniform sample beyond): with the
#: held-out cap, what bounds compare's and place's memory whatever the trace's size (issue 27)
MAX_TRAIN_REQUESTS = 20_000
#: held-out requests the batches draw from by default (a seeded uniform sample beyond)
MAX_TEST_REQUESTS = 5_000


@dataclass(frozen=True, kw_only=True)
class CompareConfig:
    """What to place and how to evaluate it."""

    deployment: Deployment  # DPaTPbEPcTPd on nodes of g GPUs
    strategies: tuple[str, ...] = ("linear", "eplb", "data", "joint", "joint_free", "ours")  # placements to compare
    num_clusters: int = 0  # K-means clusters for grouped strategies (0: one per group)
    num_redundant: int = 0  # redundant slots per layer (P = E + R)
    test_fraction: float = 0.2  # share of requests held out for evaluation
    num_batches: int = 500  # global batches simulated
    num_batch_requests: int = 0  # requests per global batch (0: 32 per group)
    dedup: DedupUnit = "expert"  # decode copy model: a token is sent once per distinct destination of this unit
    replica_policy: ReplicaPolicy = "same_node"  # which replica serves a token when there are several
    bytes_per_value: int = 2  # bytes per hidden value on the wire (bf16 = 2)
    seed: int = 0  # split, K-means, random placement and batch sampling
    oracle: bool = True  # also report the upper bounds (strategies.BOUNDS: perfect routing, test-set oracle)
    prefill_dedup: DedupUnit = "node"  # prefill copy model (DeepEP's normal kernels: one copy per node)
    hardware: Hardware = field(default_factory=default_hardware)  # the step model's kernels (--link: preset, file)
    max_node_load: float = 1.10  # routers sending the busiest node more than this over an even share are flagged
    prefill_tokens_per_node: int = 1024  # chunked-prefill tokens per node and step at an even share (0: none)
    # what-if for decode-only captures: routers see each request's first N generated tokens instead of its
    # prefill, and only the later ones are placed and simulated (0: routers see the prefill, as deployed)
    route_first_decode: int = 0
    # placements are fitted on at most this many training requests (a seeded uniform sample of them beyond;
    # only the sample is counted): bounds memory on large traces (load_trace_data takes the same value)
    max_train_requests: int = MAX_TRAIN_REQUESTS
    # the batches draw from at most this many held-out requests (a seeded uniform sample beyond; only they
    # are counted and only their tokens read)
    max_test_requests: int = MAX_TEST_REQUESTS
    # the user's HF config.json, parsed (--model-config): the experts' size where the trace's model records
    # none (cost.expert_compute_for); None: the trace's ModelInfo, then the preset
    model_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_strategies(self.strategies)
        if self.max_train_requests < 1 or self.max_test_requests < 1:
            raise ConfigError(
                f"the training and held-out request caps must be >= 1, got {self.max_train_requests}, "
                f"{self.max_test_requests}"
            )
        if not (0 <= self.route_first_decode <= MAX_ROUTE_FIRST_DECODE):
            raise ConfigError(
                f"--route-on first-decode:N needs N in 1..{MAX_ROUTE_FIRST_DECODE:,}, got {self.route_first_decode}"
            )
        if not (0.0 < self.test_fraction < 1.0):
            raise ConfigError(f"test fraction must be in (0, 1), got {self.test_fraction}")
        simulated = self.num_batches * self.batch_requests
        if simulated > MAX_SIMULATED_TOKENS:  # bounded work: checked before anything is allocated
            raise ConfigError(
                f"--batches {self.num_batches} x {self.batch_requests} requests per batch = {simulated:,} simulated tokens; "
                f"at most {MAX_SIMULATED_TOKENS:,} per run (about 100 bytes of memory each): lower --batches or --batch-requests"
            )
        if self.num_batches < 1 or self.num_batch_requests < 0 or self.num_clusters < 0:
            raise ConfigError("--batches must be >= 1, --batch-requests and --clusters >= 0")
        if not (1.0 <= self.max_node_load < 100.0):
            raise ConfigError(
                f"--max-node-load must be in [1, 100) (1.10: 10% over an even share), got {self.max_node_load}"
            )
        if self.prefill_tokens_per_node < 0 or self.prefill_tokens_per_node * self.deployment.num_groups > 1 << 22:
            raise ConfigError(
                f"--prefill-tokens must be in 0..{(1 << 22) // self.deployment.num_groups:,} per node, got {self.prefill_tokens_per_node}"
            )

    @property
    def batch_requests(self) -> int:
        return self.num_batch_requests or 32 * self.deployment.num_groups

    @property
    def num_prefill_batches(self) -> int:
        """Prefill steps simulated: one per 100 decode steps, at least 4 (and at most ``num_batches``);
        0 without prefill tokens."""
        if self.prefill_tokens_per_node == 0:
            return 0
        return min(self.num_batches, max(4, self.num_batches // 100))


@dataclass(frozen=True, kw_only=True)
class TraceData:
    """What placement and evaluation read from a trace."""

    model: ModelInfo  # the traced model
    trace_path: str  # where it came from
    prefill_RLE: np.ndarray  # [R, L, E] prefill token counts, unsigned (count_trace's smallest safe dtype)
    decode_RLE: np.ndarray  # [R, L, E] decode token counts, same dtype
    is_test_R: np.ndarray  # bool [R] held out from placement
    test_topk_ids_TLK: (
        np.ndarray | None
    )  # int16 [T, L, K] held-out decode tokens with a recorded id (None: not read yet)
    test_req_T: (
        np.ndarray | None
    )  # int64 [T] row (0..R-1) of each held-out token's request, ascending (None: not read yet)
    test_prefill_ids_TLK: np.ndarray | None = (
        None  # int16 [T', L, K] a seeded sample (MAX_PREFILL_TOKENS) of the held-out prompt tokens
    )
    test_prefill_req_T: np.ndarray | None = None  # int64 [T'] row of each one's request, ascending
    stages: frozenset[str] = frozenset({"prefill", "decode"})  # routing stages the trace recorded (schema.stages_of)
    allow_incomplete: bool = False  # read from a trace without its completion mark (for the held-out tokens' pass)
    # N > 0: ``prefill_RLE`` holds each request's first N generated tokens (what the routers see, a what-if),
    # and ``decode_RLE`` and the held-out tokens only the later ones
    route_first_decode: int = 0
    request_unit: str = "request"  # what a trace request is (manifest collection.request_unit; "forward pass": an import without request ids)
    # int64 [R] the row in the trace's requests table (``Trace.request_arrays``) of each row here, ascending;
    # None: every request of the trace, in that order (or no trace: a load profile)
    trace_rows_R: np.ndarray | None = None
    num_trace_requests: int | None = None  # requests in the trace (R when nothing was capped; None: a load profile)
    num_trace_train_requests: int | None = None  # training requests of the split before the cap (None: a load profile)
    num_trace_test_requests: int | None = None  # held-out requests of the split before the cap
    max_train_requests: int | None = None  # the cap applied to the training requests (None: a load profile)
    max_test_requests: int | None = None  # the cap applied to the held-out requests

    @property
    def routable(self) -> bool:
        """Whether a router has something to route on: prefill routing, or the first generated tokens."""
        return "prefill" in self.stages or self.route_first_decode > 0

    tokens_from: str | None = (
        None  # None: the trace's held-out requests; else how the tokens were drawn (profile_batches)
    )


def load_trace_data(
    trace: str | os.PathLike,
    *,
    test_fraction: float,
    seed: int,
    allow_incomplete: bool = False,
    progress: Callable[[int, int], None] | None = None,
    held_out_tokens: bool = True,
    route_first_decode: int = 0,
    max_train_requests: int = MAX_TRAIN_REQUESTS,
    max_test_requests: int = MAX_TEST_REQUESTS,
) -> TraceData:
    """Count the trace, split train/test and (``held_out_tokens``) keep the held-out requests' decode
    tokens (streamed once more; ``with_held_out_tokens`` reads them later instead, so that placing
    and holding the tokens never add up in memory).

    Bounded memory: after the split (every request of the trace, as without caps), at most
    ``max_train_requests`` training and ``max_test_requests`` held-out requests are kept (seeded
    uniform samples of each, ``CompareConfig``'s fields of the same names); only they are counted and
    only their tokens read, so the counts hold at most the sum of the caps' rows. The rows of the
    result are the kept requests in trace order (``TraceData.trace_rows_R``); below both caps they are
    every request, and nothing changes.

    ``progress(tokens_done, tokens_total)`` is passed to the counting pass (``count_trace``).
    ``route_first_decode`` N > 0: the what-if of ``CompareConfig.route_first_decode`` (one more pass
    counts each request's first N generated tokens).
    """
    from moetrace.analysis.counts import count_trace
    from moetrace.tracer.trace.reader import open_trace
    from moetrace.tracer.trace.schema import STAGE_DECODE, stages_of

    tr = open_trace(trace, require_complete=not allow_incomplete)
    stages = stages_of(tr)
    if STAGE_DECODE not in stages:
        raise TraceFormatError(
            f"{trace}: recorded prefill routing only (manifest collection.stages); placements are built "
            "from decode counts and the all-to-all model simulates decode steps: use a trace with "
            "decode routing"
        )
    if max_train_requests < 1 or max_test_requests < 1:
        raise ConfigError(f"request caps must be >= 1, got {max_train_requests}, {max_test_requests}")
    R = len(tr.request_arrays.request_id_R)
    if R < 4:
        raise TraceFormatError(f"{trace}: {R} requests; placement needs at least 4 (some to train, some to test)")
    is_test_all = held_out_R(R, test_fraction=test_fraction, seed=seed)
    n_test = int(is_test_all.sum())
    keep_rng = np.random.default_rng([seed, 27])  # its own stream: the split is the same with or without caps
    keep = np.sort(
        np.concatenate(
            [
                _sample_rows(np.flatnonzero(~is_test_all), max_train_requests, keep_rng),
                _sample_rows(np.flatnonzero(is_test_all), max_test_requests, keep_rng),
            ]
        )
    )
    capped = len(keep) < R
    counts = count_trace(tr, allow_incomplete=allow_incomplete, progress=progress, rows=keep if capped else None)
    is_test = is_test_all[keep]
    _release_arrow_memory()
    route_RLE, decode_RLE = counts.stage("prefill"), counts.stage("decode")  # views of one counts array
    if route_first_decode > 0:  # one more pass: each request's first N generated tokens
        prompt_R = tr.request_arrays.prompt_tokens_R
        route_RLE = count_trace(
            tr,
            stages=[STAGE_DECODE],
            allow_incomplete=allow_incomplete,
            rows=keep,
            keep_T=lambda ta: ta.position_T - prompt_R[ta.row_T] < route_first_decode,
        ).stage(STAGE_DECODE)
        _release_arrow_memory()
        decode_RLE = decode_RLE - route_RLE  # the later tokens (the first ones are a subset: never below 0)
    data = TraceData(
        model=tr.model,
        trace_path=str(trace),
        prefill_RLE=route_RLE,
        decode_RLE=decode_RLE,
        is_test_R=is_test,
        test_topk_ids_TLK=None,
        test_req_T=None,
        stages=stages,
        allow_incomplete=allow_incomplete,
        route_first_decode=route_first_decode,
        request_unit=str((tr.manifest.get("collection") or {}).get("request_unit") or "request"),
        trace_rows_R=keep if capped else None,
        num_trace_requests=R,
        num_trace_train_requests=R - n_test,
        num_trace_test_requests=n_test,
        max_train_requests=max_train_requests,
        max_test_requests=max_test_requests,
    )
    return with_held_out_tokens(data) if held_out_tokens else data


def _sample_rows(rows: np.ndarray, cap: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` itself when it has at most ``cap`` entries, else a uniform sample of ``cap`` of them
    (without replacement, ascending)."""
    if len(rows) <= cap:
        return rows
    return np.sort(rng.choice(rows, size=cap, replace=False))


def parse_route_on(text: str) -> int:
    """``--route-on``: ``prefill`` -> 0, ``first-decode:N`` -> N (``CompareConfig.route_first_decode``)."""
    t = text.strip()
    if t == "prefill":
        return 0
    head, _, n = t.partition(":")
    if head == "first-decode" and n.isdigit() and 0 < int(n) <= MAX_ROUTE_FIRST_DECODE:
        return int(n)
    raise ConfigError(
        f"--route-on {text!r}: use `prefill` (as deployed) or `first-decode:N` with N in 1..{MAX_ROUTE_FIRST_DECODE:,} "
        "(a what-if for decode-only captures: routers see each request's first N generated tokens)"
    )


def _release_arrow_memory() -> None:
    """Give back the pages Arrow's allocator keeps after a pass over the trace (RSS, not correctness)."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def with_held_out_tokens(data: TraceData) -> TraceData:
    """``data`` with ``test_topk_ids_TLK`` / ``test_req_T`` read from its trace (itself if they are).

    The held-out decode rows are written in place into one array sized from the requests table (an
    upper bound: rows with no recorded id are skipped): no list of parts and no concatenated copy,
    and pages never written are never resident.
    """
    from moetrace.tracer.trace.reader import open_trace

    if data.test_topk_ids_TLK is not None:
        return data
    tr = open_trace(data.trace_path, require_complete=not data.allow_incomplete)
    L, K = tr.model.num_moe_layers, tr.model.top_k
    req_table = tr.request_arrays  # sorted by request id (the rows of the counts when nothing was capped)
    is_test = data.is_test_R
    trace_rows = np.arange(len(is_test)) if data.trace_rows_R is None else data.trace_rows_R
    row_map = np.full(len(req_table.request_id_R), -1, dtype=np.int64)  # trace row -> row of data (-1: not kept)
    row_map[trace_rows] = np.arange(len(trace_rows))
    is_test_x = np.append(is_test, False)  # indexed by row_map: -1 (a request not kept) reads False
    bound = int(req_table.output_tokens_R[trace_rows[is_test]].sum(dtype=np.int64))
    ids = np.empty((bound, L, K), dtype=np.int16)
    req_parts, n = [], 0
    with_prefill = "prefill" in data.stages
    p_bound = int(req_table.prompt_tokens_R[trace_rows[is_test]].sum(dtype=np.int64)) if with_prefill else 0
    keep_share = min(1.0, MAX_PREFILL_TOKENS / max(p_bound, 1))  # a uniform sample of the prompt tokens
    p_ids = np.empty((min(p_bound, MAX_PREFILL_TOKENS + (1 << 14)), L, K), dtype=np.int16)
    p_req_parts: list[np.ndarray] = []
    pn = 0
    p_rng = np.random.default_rng([len(is_test), 11])
    for ta in tr.iter_token_arrays(batch_tokens=1 << 14):
        trace_row = np.searchsorted(req_table.request_id_R, ta.request_id_T)
        row = row_map[trace_row]
        recorded = (ta.topk_ids_TLK >= 0).any(axis=(1, 2))
        keep = ta.is_decode_T & is_test_x[row] & recorded
        if data.route_first_decode:  # the router saw the first N generated tokens: simulate the later ones
            keep &= ta.position_T - req_table.prompt_tokens_R[trace_row] >= data.route_first_decode
        k = int(keep.sum())
        if n + k > bound:  # the reader checked every row against the requests table, so this cannot happen
            raise AssertionError(f"{data.trace_path}: more held-out decode rows than the requests table claims")
        ids[n : n + k] = ta.topk_ids_TLK[keep]
        req_parts.append(row[keep])
        n += k
        if with_prefill:
            pkeep = ~ta.is_decode_T & is_test_x[row] & recorded & (p_rng.random(len(row)) < keep_share)
            pk = min(int(pkeep.sum()), len(p_ids) - pn)
            sel = np.flatnonzero(pkeep)[:pk]
            p_ids[pn : pn + pk] = ta.topk_ids_TLK[sel]
            p_req_parts.append(row[sel])
            pn += pk
    _release_arrow_memory()
    if n == 0:
        raise TraceFormatError(
            f"{data.trace_path}: the held-out requests have no decode tokens; the volume model needs decode steps"
        )
    req = np.concatenate(req_parts)
    ids = ids[:n]
    if (np.diff(req) < 0).any():  # rows not in request order (e.g. shards interleaved): one reordered copy
        order = np.argsort(req, kind="stable")
        ids, req = ids[order], req[order]
    p_req = np.concatenate(p_req_parts) if p_req_parts else np.zeros(0, dtype=np.int64)
    p_out = p_ids[:pn]
    if (np.diff(p_req) < 0).any():
        order = np.argsort(p_req, kind="stable")
        p_out, p_req = p_out[order], p_req[order]
    return replace(
        data,
        test_topk_ids_TLK=ids,
        test_req_T=req,
        test_prefill_ids_TLK=p_out if pn else None,
        test_prefill_req_T=p_req if pn else None,
    )


@dataclass(frozen=True, kw_only=True)
class PlacedStrategy:
    """One strategy's placement and, for grouped strategies, its grouping and router."""

    strategy: str  # registry name (strategies.STRATEGIES)
    placement: Placement  # over the MoE layers
    grouping: Grouping | None = None  # clusters and their groups (grouped strategies)
    router: Router = field(
        default_factory=NoRouter
    )  # how requests find their node (with its match rate on the held-out requests)
    group_of_test_R: np.ndarray | None = None  # int64 [R] group of each request (test rows meaningful)
    decode_group_of_test_R: np.ndarray | None = None  # int64 [R] price router only: the balanced assignment by decode
    extra: dict[str, Any] = field(default_factory=dict)  # provenance (eplb policy, groups without routed requests)

    @property
    def router_match_rate(self) -> float | None:
        """Share of held-out requests routed from prefill as their decode would route them (None: no router)."""
        return None if isinstance(self.router, NoRouter) else self.router.match_rate


def make_placement(
    data: TraceData, cfg: CompareConfig, strategy: str, *, grouping: Grouping | None = None
) -> PlacedStrategy:
    """The placement of ``strategy`` from the training requests of ``data`` (built through the registry).

    Grouped strategies cluster the training requests first (or reuse ``grouping``), sum their decode
    tokens per group into ``usage_GLE`` and route the held-out requests by their prefill vectors.
    """
    spec = get_strategy(strategy)
    m, dep = data.model, cfg.deployment
    spec.check(m, num_nodes=dep.num_nodes)
    L, E, G = m.num_moe_layers, m.num_experts, dep.num_groups
    P = dep.check_slots(num_experts=E, num_redundant=cfg.num_redundant)  # before clustering: fail fast
    train_R = np.flatnonzero(~data.is_test_R)
    R = len(data.is_test_R)
    usage_GLE = init_group_N = None
    if spec.grouped and not data.routable:
        raise ConfigError(
            f"strategy {strategy!r} groups requests and routes each by its prefill routing, but {data.trace_path} recorded "
            f"decode only (manifest collection.stages, e.g. import --stages decode-only); choose an ungrouped strategy "
            f"({', '.join(s.name for s in STRATEGIES if not s.grouped)}), a trace with both stages, or the what-if "
            "--route-on first-decode:N (routes on each request's first N generated tokens)"
        )
    if spec.grouped:
        if grouping is None:
            grouping = fit_grouping(
                data.decode_RLE.reshape(R, -1),
                data.prefill_RLE.reshape(R, -1),
                rows=train_R,
                num_clusters=cfg.num_clusters or G,
                num_groups=G,
                seed=cfg.seed,
            )
        init_group_N = groups_of_clusters(grouping.labels_R, grouping.cluster_to_groups)
        if spec.uses_group_usage:  # (the price-routed placer sums its own, per-request usage)
            usage_GLE = _sum_rows(data.decode_RLE, train_R, init_group_N, G)
    inputs = PlacementInputs(
        num_layers=L,
        num_experts=E,
        num_slots=P,
        num_ranks=dep.num_ep,
        num_nodes=dep.num_nodes,
        ranks_per_node=dep.ranks_per_node,
        router_groups=m.n_group or 1,
        seed=cfg.seed,
        load_LE=_sum_rows(data.decode_RLE, train_R)[0],
        usage_GLE=usage_GLE,
        decode_RLE=data.decode_RLE,
        prefill_RLE=data.prefill_RLE,
        train_rows=train_R,
        init_group_N=init_group_N,
        links=search_links(cfg.hardware.kernel(cfg.dedup), hidden_size=_time_hidden(m, config=cfg.model_config)),
        max_node_load=cfg.max_node_load,
        price_validation=validation_pricer(data, cfg) if spec.name == "ours" else None,
    )
    placement, extra = spec.build(inputs)
    kind = extra.get("served_router", spec.router)  # ours may choose to serve with no router
    router = fit_router(kind, grouping=grouping, provenance=extra, num_groups=G)
    if isinstance(router, PriceRouter):  # ours keeps nodes within the load limit (the paper's router is as published)
        router = replace(router, max_node_load=cfg.max_node_load)
    if isinstance(router, NoRouter):
        return PlacedStrategy(strategy=strategy, placement=placement, extra=extra)
    routes = router.route(data.prefill_RLE, placement=placement, is_test_R=data.is_test_R, decode_RLE=data.decode_RLE)
    return PlacedStrategy(
        strategy=strategy,
        placement=placement,
        grouping=grouping,
        extra=extra,
        group_of_test_R=routes.group_R,
        router=replace(router, match_rate=routes.match_rate),
        decode_group_of_test_R=routes.decode_group_R,
    )


def _sum_rows(
    x_RLE: np.ndarray, rows: np.ndarray, group_N: np.ndarray | None = None, num_groups: int = 1
) -> np.ndarray:
    """``out[g]`` = the sum of ``x_RLE[rows[i]]`` over the i with ``group_N[i] == g`` (every i when
    ``group_N`` is None), float64 [num_groups, L, E]; a chunk of rows at a time, so the selected
    rows are never copied all at once."""
    out = np.zeros((num_groups, *x_RLE.shape[1:]))
    for lo in range(0, len(rows), 1024):
        chunk = x_RLE[rows[lo : lo + 1024]]
        if group_N is None:
            out[0] += chunk.sum(0, dtype=np.float64)
            continue
        g = group_N[lo : lo + 1024]
        for k in np.unique(g):
            out[k] += chunk[g == k].sum(0, dtype=np.float64)
    return out


def _sources(dep: Deployment, per_group: int) -> np.ndarray:
    """EP rank each request position of each group's micro-batch dispatches from, int64 [G, per_group]."""
    rep_node_A = dep.replica_node_A()
    out = np.empty((dep.num_groups, per_group), dtype=np.int64)
    j = np.arange(per_group)
    for g in range(dep.num_groups):
        reps = np.flatnonzero(rep_node_A == g)
        if len(reps) == 0:
            raise ConfigError(f"{dep.name}: node {g} hosts no DP replica (TP wider than a node is not modelled)")
        src = np.stack([dep.replica_source_ranks(int(r)) for r in reps])  # [replicas, tp]
        out[g] = src[j % len(reps), (j // len(reps)) % dep.num_tp]
    return out


def node_shares(group_of_R: np.ndarray | None, rows: np.ndarray, num_groups: int) -> np.ndarray:
    """Share of the requests ``rows`` that a router sends each node, float64 [G] summing to 1 (even
    without a router: ``group_of_R`` None)."""
    if group_of_R is None or len(rows) == 0:
        return np.full(num_groups, 1.0 / num_groups)
    n_G = np.bincount(group_of_R[rows], minlength=num_groups).astype(np.float64)
    return n_G / n_G.sum()


def node_counts(share_G: np.ndarray, total: int) -> np.ndarray:
    """``total`` split over nodes in proportion to ``share_G`` (largest remainders), int64 [G]."""
    raw = share_G * total
    out = np.floor(raw).astype(np.int64)
    rest = total - int(out.sum())
    if rest > 0:
        out[np.argsort(-(raw - out), kind="stable")[:rest]] += 1
    return out


def held_out_batches(
    data: TraceData, cfg: CompareConfig, group_of_R: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Token rows, batch index and source rank of every simulated decode token (int64 [T] each), and the
    groups no held-out request was routed to.

    At a fixed global request rate each node's micro-batch is proportional to the share of requests
    its router sends it: node g takes ``node_counts(share, batch_requests)[g]`` requests per step
    (``batch_requests / G`` each without a router), drawn with replacement from the held-out requests
    routed to it, each at a uniformly drawn decode position.
    """
    dep, B, G = cfg.deployment, cfg.num_batches, cfg.deployment.num_groups
    rng = np.random.default_rng([cfg.seed, 7])
    R = len(data.is_test_R)
    assert data.test_req_T is not None, "read the held-out tokens first (with_held_out_tokens)"
    ntok_R = np.bincount(data.test_req_T, minlength=R)
    start_R = np.zeros(R, dtype=np.int64)
    np.cumsum(ntok_R[:-1], out=start_R[1:])
    usable = np.flatnonzero(data.is_test_R & (ntok_R > 0))
    if group_of_R is None:
        n_G = np.full(G, max(1, cfg.batch_requests // G), dtype=np.int64)
    else:
        n_G = node_counts(node_shares(group_of_R, usable, G), max(G, cfg.batch_requests))
    width = int(n_G.max())
    src_GR = _sources(dep, width)
    rows, batch, src, empty = [], [], [], []
    u_pick = rng.random((B, G, width))
    u_pos = rng.random((B, G, width))
    for g in range(G):
        n = int(n_G[g])
        pool = usable if group_of_R is None else usable[group_of_R[usable] == g]
        if len(pool) == 0:
            empty.append(g)
            continue  # the router sends this node nothing: it idles
        req = pool[(u_pick[:, g, :n] * len(pool)).astype(np.int64)]
        tok = start_R[req] + (u_pos[:, g, :n] * ntok_R[req]).astype(np.int64)
        rows.append(tok.reshape(-1))
        batch.append(np.repeat(np.arange(B), n))
        src.append(np.broadcast_to(src_GR[g, :n], (B, n)).reshape(-1))
    return np.concatenate(rows), np.concatenate(batch), np.concatenate(src), empty


def prefill_batches(
    data: TraceData, cfg: CompareConfig, group_of_R: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Rows of ``data.test_prefill_ids_TLK``, prefill step and source rank of every simulated prompt
    token (int64 [T] each), or None when the trace kept no prompt tokens.

    A prefill step gives the nodes ``prefill_tokens_per_node * G`` prompt tokens in all, split in
    proportion to the share of requests each node's router sends it (chunked prefill at a fixed
    global request rate); node g's tokens are drawn uniformly from the prompt tokens of the held-out
    requests routed to it, and go round robin over its DP replicas and their TP GPUs.
    """
    if data.test_prefill_req_T is None or cfg.num_prefill_batches == 0:
        return None
    dep, B, G = cfg.deployment, cfg.num_prefill_batches, cfg.deployment.num_groups
    rng = np.random.default_rng([cfg.seed, 13])
    req_T = data.test_prefill_req_T
    usable = np.unique(req_T)
    n_G = node_counts(node_shares(group_of_R, usable, G), cfg.prefill_tokens_per_node * G)
    width = int(n_G.max())
    src_GR = _sources(dep, max(width, 1))
    u = rng.random((B, G, width))
    rows, batch, src = [], [], []
    for g in range(G):
        n = int(n_G[g])
        tokens = np.arange(len(req_T)) if group_of_R is None else np.flatnonzero(group_of_R[req_T] == g)
        if len(tokens) == 0 or n == 0:
            continue
        rows.append(tokens[(u[:, g, :n] * len(tokens)).astype(np.int64)].reshape(-1))
        batch.append(np.repeat(np.arange(B), n))
        src.append(np.broadcast_to(src_GR[g, :n], (B, n)).reshape(-1))
    if not rows:
        return None
    return np.concatenate(rows), np.concatenate(batch), np.concatenate(src)


@dataclass(frozen=True, kw_only=True)
class CompareResult:
    """What ``run_compare`` found: per strategy its placement and simulated traffic."""

    config: CompareConfig  # what was asked
    manifest: CompareManifest  # the run's configuration and facts, as written to compare.json
    metrics: dict[str, dict[str, np.ndarray]]  # strategy -> metric -> float64 [B, L] (decode steps)
    placed: dict[str, PlacedStrategy]  # strategy -> its placement
    prefill_metrics: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # same, prefill steps (empty: none)

    @property
    def model(self) -> ModelInfo:
        """The traced model."""
        return self.manifest.model

    @property
    def reference(self) -> str:
        """The strategy whose median normalizes inter-node volume."""
        return self.manifest.reference

    @property
    def bounds(self) -> tuple[str, ...]:
        """The rows of ``metrics`` that are upper bounds (strategies.BOUNDS), not strategies."""
        return self.manifest.bounds

    def inter_BL(self, strategy: str) -> np.ndarray:
        return _inter_BL(self.metrics[strategy])

    def normalized_B(self, strategy: str) -> np.ndarray:
        """Per-batch inter-node bytes (all layers) / median of the reference's, float [B]."""
        ref = np.median(self.inter_BL(self.reference).sum(1))
        return self.inter_BL(strategy).sum(1) / ref if ref > 0 else np.full(self.inter_BL(strategy).shape[0], np.nan)

    def time_normalized_B(
        self, strategy: str, what: Literal["a2a", "moe"] = "a2a", *, stage: Stage = "decode"
    ) -> np.ndarray:
        """Per-step predicted seconds (all layers) of ``what`` (``a2a``: dispatch + combine; ``moe``:
        with the experts) over the reference's median, float [B] (NaN where unknown)."""
        metrics = self.metrics if stage == "decode" else self.prefill_metrics
        if strategy not in metrics or self.reference not in metrics:
            return np.full(1, np.nan)

        def seconds_B(s: str) -> np.ndarray:
            m = metrics[s]
            return a2a_seconds_B(m) if what == "a2a" else m["moe_seconds"].sum(1)

        ref = float(np.median(seconds_B(self.reference)))
        return seconds_B(strategy) / ref if ref > 0 else np.full(len(seconds_B(strategy)), np.nan)

    @property
    def measure(self) -> Measure:
        """What the verdict ranks by (``compare_verdict``): ``moe`` (MoE-layer time), or ``a2a`` when the
        model's expert size is unknown."""
        v = self.manifest.verdict
        return "a2a" if v is None or v.get("measure") == "a2a_time" else "moe"

    def summary_rows(self) -> list[dict[str, Any]]:
        """One row per strategy and bound. ``oracle_captured``: the share of the oracle's saving over
        linear that the row reaches, (1 - v) / (1 - v_oracle) of median normalized times in the
        verdict's measure (``measure``: MoE-layer time, all-to-all time when the expert size is
        unknown); None without an oracle row, or when the oracle saves less than ``MIN_ORACLE_GAIN``
        (a share of noise is noise). Time columns: decode steps unless prefixed ``prefill_``."""
        med = {s: _q(self.time_normalized_B(s, self.measure), 0.5) for s in self.metrics}
        gain = 1.0 - med["oracle"] if "oracle" in med else 0.0
        gain = gain if gain >= MIN_ORACLE_GAIN else 0.0
        limit = self.manifest.max_node_load
        rows = []
        for s, m in self.metrics.items():
            nb = self.normalized_B(s)
            a2a, moe = self.time_normalized_B(s, "a2a"), self.time_normalized_B(s, "moe")
            load = self.placed[s].extra.get("busiest_node_load")
            gpu_load = m["tokens_per_rank_max"] / np.where(
                m["tokens_per_rank_mean"] > 0, m["tokens_per_rank_mean"], np.nan
            )
            pre = self.prefill_metrics.get(s)
            rows.append(
                {
                    "strategy": s,
                    "is_bound": s in self.bounds,
                    "a2a_time_normalized_median": _q(a2a, 0.5),
                    "a2a_time_normalized_p10": _q(a2a, 0.1),
                    "a2a_time_normalized_p90": _q(a2a, 0.9),
                    "moe_time_normalized_median": _q(moe, 0.5),
                    "moe_time_normalized_p10": _q(moe, 0.1),
                    "moe_time_normalized_p90": _q(moe, 0.9),
                    "a2a_seconds_per_step_median": a2a_seconds_median(m),
                    "moe_seconds_per_step_median": float(np.median(m["moe_seconds"].sum(1))),
                    "busiest_node_load": load,
                    "over_node_load_limit": bool(
                        load is not None
                        and limit is not None
                        and load > self.placed[s].extra.get("node_load_limit", limit) + 1e-9
                    ),
                    "busiest_gpu_load": float(np.nanmean(gpu_load)) if np.isfinite(gpu_load).any() else float("nan"),
                    "oracle_captured": (1.0 - med[s]) / gain if gain > 0 else None,
                    "inter_node_normalized_median": float(np.median(nb)),
                    "inter_node_normalized_p10": float(np.quantile(nb, 0.1)),
                    "inter_node_normalized_p90": float(np.quantile(nb, 0.9)),
                    "inter_node_bytes_per_batch_median": float(np.median(self.inter_BL(s).sum(1))),
                    "intra_node_bytes_per_batch_median": float(
                        np.median((m["dispatch_intra_bytes"] + m["combine_intra_bytes"]).sum(1))
                    ),
                    "max_rank_dispatch_send_bytes_mean": float(m["max_rank_dispatch_send_bytes"].mean()),
                    "tokens_per_rank_max_mean": float(m["tokens_per_rank_max"].mean()),
                    "activated_experts_per_rank_max_mean": float(m["activated_experts_per_rank_max"].mean()),
                    "router_match_rate": self.placed[s].router_match_rate,
                    "groups_without_routed_requests": len(
                        self.placed[s].extra.get("groups_without_routed_requests", [])
                    ),
                    "prefill_a2a_time_normalized_median": _q(self.time_normalized_B(s, "a2a", stage="prefill"), 0.5),
                    "prefill_moe_time_normalized_median": _q(self.time_normalized_B(s, "moe", stage="prefill"), 0.5),
                    "prefill_inter_node_normalized_median": self._prefill_bytes_normalized(s, pre),
                }
            )
        return rows

    def _prefill_bytes_normalized(self, strategy: str, pre: dict[str, np.ndarray] | None) -> float:
        ref = self.prefill_metrics.get(self.reference)
        if pre is None or ref is None:
            return float("nan")
        r = float(np.median(_inter_BL(ref).sum(1)))
        return float(np.median(_inter_BL(pre).sum(1)) / r) if r > 0 else float("nan")


def _q(x: np.ndarray, q: float) -> float:
    """Quantile ``q`` of ``x``, NaN when ``x`` holds any NaN (an unknown term stays unknown)."""
    return float("nan") if np.isnan(x).any() else float(np.quantile(x, q))


def place_strategies(
    data: TraceData, cfg: CompareConfig, strategies: Sequence[str], *, on_placed: Callable[[], None] | None = None
) -> dict[str, PlacedStrategy]:
    """Each strategy's placement from the training requests, in order (duplicates once); the grouped
    strategies share one grouping. ``on_placed()`` is called after each."""
    placed: dict[str, PlacedStrategy] = {}
    grouping = None
    for s in strategies:  # fail before minutes of other placements
        get_strategy(s).check(data.model, num_nodes=cfg.deployment.num_nodes)
    for s in dict.fromkeys(strategies):
        if s == "joint_free" and "joint" in placed:  # the same placement, served with no router
            j = placed["joint"]
            placed[s] = PlacedStrategy(strategy=s, placement=j.placement, grouping=j.grouping, extra=dict(j.extra))
        else:
            placed[s] = make_placement(data, cfg, s, grouping=grouping)
        grouping = placed[s].grouping or grouping
        if on_placed is not None:
            on_placed()
    return placed


def run_compare(
    data: TraceData, cfg: CompareConfig, *, progress: Callable[[int, int], None] | None = None
) -> CompareResult:
    """Place every strategy on the training requests and simulate them on the held-out ones.

    ``progress(steps_done, steps_total)`` is called after each placement and each simulation
    (two steps per strategy, the linear reference included).
    """
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
    placed = place_strategies(data, cfg, todo, on_placed=step)
    data = with_held_out_tokens(data)  # after placing: the tokens and the clustering never share memory
    skipped: dict[str, str] = {}  # bound -> why it has no row (compare.json `skipped`, printed as a note)
    bound_failures: dict[str, list[str]] = {}  # bound -> deployable rows within the limit that beat it
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
    candidates = bound_placements(data, cfg, placed, on_placed=step) if bounds else {}

    stepper = _Stepper.of(data.model, cfg)
    measure = stepper.measure
    assert data.test_req_T is not None  # read by with_held_out_tokens above
    usable = np.flatnonzero(data.is_test_R & (np.bincount(data.test_req_T, minlength=len(data.is_test_R)) > 0))

    def simulate(ps: PlacedStrategy) -> dict[str, np.ndarray]:
        assert data.test_topk_ids_TLK is not None  # read by with_held_out_tokens above
        rows, batch, src, empty = held_out_batches(data, cfg, ps.group_of_test_R)
        ps.extra["groups_without_routed_requests"] = empty
        # held-out requests routed to the busiest node, over an even share (1: no router, even by construction)
        ps.extra["busiest_node_load"] = round(float(node_shares(ps.group_of_test_R, usable, G).max() * G), 4)
        # the limit integer counts of these requests can meet (9 requests on 8 nodes: 2 on one node)
        ps.extra["node_load_limit"] = round(effective_node_load_limit(len(usable), G, cfg.max_node_load), 4)
        return stepper.volume(
            data.test_topk_ids_TLK, ps.placement, (rows, batch, src), steps=cfg.num_batches, dedup=cfg.dedup
        )

    def simulate_prefill(ps: PlacedStrategy) -> dict[str, np.ndarray] | None:
        drawn = prefill_batches(data, cfg, ps.group_of_test_R)
        if drawn is None:
            return None
        assert data.test_prefill_ids_TLK is not None
        return stepper.volume(
            data.test_prefill_ids_TLK, ps.placement, drawn, steps=cfg.num_prefill_batches, dedup=cfg.prefill_dedup
        )

    metrics: dict[str, dict[str, np.ndarray]] = {}
    prefill: dict[str, dict[str, np.ndarray]] = {}

    def both_stages(s: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
        return simulate(placed[s]), simulate_prefill(placed[s])

    # numpy's sorts and ufuncs release the GIL: two threads keep two cores busy (results do not depend on it)
    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        for s, (dm, pm) in zip(todo, pool.map(both_stages, todo)):
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
    for s in bounds:
        with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
            sims = list(zip(pool.map(simulate, candidates[s]), candidates[s]))
        fits = [mc for mc in sims if within_limit(mc[1])] or sims
        metrics[s], placed[s] = min(fits, key=lambda mc: verdict_s(mc[0]))
        beaten = [d for d in within if verdict_s(metrics[d]) < verdict_s(metrics[s]) - 1e-12]
        if beaten:
            bound_failures[s] = beaten
        if (pm := simulate_prefill(placed[s])) is not None:
            prefill[s] = pm
        step()
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
        hardware=cfg.hardware.to_json(),
        model_config=cfg.model_config,
        max_node_load=cfg.max_node_load,
        prefill_tokens_per_node=cfg.prefill_tokens_per_node,
        num_prefill_batches=cfg.num_prefill_batches if prefill else 0,
        expert=None if stepper.expert is None else stepper.expert.to_json(),
        skipped=skipped,
        verdict=compare_verdict(metrics, placed, todo, reference=reference, measure=measure)
        | {"stages": _stage_choices(metrics, prefill, placed, todo, reference, measure, cfg.num_redundant)},
        bound_failures=bound_failures,
        tokens_from=data.tokens_from,
        **request_caps(data),
    )
    return CompareResult(config=cfg, manifest=manifest, metrics=metrics, placed=placed, prefill_metrics=prefill)


#: what the verdict ranks by: MoE-layer time per step (dispatch + the slowest GPU's experts + combine), or
#: all-to-all time (dispatch + combine) when the model's expert size is unknown
Measure = Literal["moe", "a2a"]

#: decode steps ``ours`` prices each candidate on over its validation split (at most compare's own)
VALIDATION_BATCHES = 200


@dataclass(frozen=True, kw_only=True)
class _Stepper:
    """One stage's simulated traffic and step time of a placement: ``simulate_volume`` under the run's cost
    model (compare's held-out steps and ours' validation steps alike)."""

    model: ModelInfo
    cfg: CompareConfig
    cost: CostModel
    time_hidden: int  # values per copy: the full-size model's (a -tiny preset mirrors its routing, not its width)

    @classmethod
    def of(cls, m: ModelInfo, cfg: CompareConfig) -> _Stepper:
        expert = expert_compute_for(m, config=cfg.model_config)
        hidden = expert.hidden_size if expert is not None else _time_hidden(m, config=cfg.model_config)
        return cls(model=m, cfg=cfg, cost=CostModel(hardware=cfg.hardware, expert=expert), time_hidden=hidden)

    @property
    def expert(self) -> Any:
        return self.cost.expert

    @property
    def measure(self) -> Measure:
        """MoE-layer time where the expert size is known, else all-to-all time."""
        return "a2a" if self.cost.expert is None else "moe"

    def volume(
        self,
        ids_TLK: np.ndarray,
        placement: Placement,
        drawn: tuple[np.ndarray, np.ndarray, np.ndarray],
        *,
        steps: int,
        dedup: DedupUnit,
    ) -> dict[str, np.ndarray]:
        """``drawn`` = (token rows of ``ids_TLK``, step, source rank)."""
        dep = self.cfg.deployment
        rows, batch, src = drawn
        return simulate_volume(
            ids_TLK[rows],
            placement=placement,
            batch_T=batch,
            src_rank_T=src,
            num_batches=steps,
            num_ranks=dep.num_ep,
            ranks_per_node=dep.ranks_per_node,
            bytes_per_token=self.model.hidden_size * self.cfg.bytes_per_value,
            dedup=dedup,
            policy=self.cfg.replica_policy,
            cost=self.cost,
            time_hidden_size=self.time_hidden,
        )


def within_limit(ps: PlacedStrategy) -> bool:
    """Whether a simulated strategy kept its busiest node within the node-load limit (``node_load_limit``:
    the limit integer counts of the held-out requests can meet)."""
    return ps.extra["busiest_node_load"] <= ps.extra["node_load_limit"] + 1e-9


def seconds_B(metrics: dict[str, np.ndarray], measure: Measure) -> np.ndarray:
    """Predicted seconds of every step (all layers) in ``measure``, float64 [B]."""
    return a2a_seconds_B(metrics) if measure == "a2a" else metrics["moe_seconds"].sum(1)


def seconds_median(metrics: dict[str, np.ndarray], measure: Measure) -> float:
    """Median over steps of ``seconds_B`` (what the verdict ranks by)."""
    return float(np.median(seconds_B(metrics, measure)))


def compare_verdict(
    metrics: dict[str, dict[str, np.ndarray]],
    placed: dict[str, PlacedStrategy],
    strategies: Sequence[str],
    *,
    reference: str,
    measure: Measure,
) -> dict[str, Any]:
    """compare.json's ``verdict``: the deployable strategies (``strategies``, bounds never) within the
    node-load limit ranked by ``measure``'s median per step (ties: the recommended strategy first, then
    the given order), the first of them recommended; those over the limit listed apart. Each strategy's
    median in ``measure`` and in all-to-all time, over the reference's."""
    from moetrace.placement.strategies import RECOMMENDED

    def ratio(s: str, what: Measure) -> float:
        ref = seconds_median(metrics[reference], what)
        return round(seconds_median(metrics[s], what) / ref, 6) if ref > 0 else float("nan")

    order = {s: i for i, s in enumerate(strategies)}
    within = [s for s in strategies if within_limit(placed[s])]
    ranking = sorted(within, key=lambda s: (round(seconds_median(metrics[s], measure), 15), s != RECOMMENDED, order[s]))
    return {
        "measure": "moe_time" if measure == "moe" else "a2a_time",
        "ranking": ranking,
        "recommended": ranking[0] if ranking else None,
        "over_node_load_limit": [s for s in strategies if s not in within],
        "time_normalized": {s: ratio(s, measure) for s in strategies},
        "a2a_time_normalized": {s: ratio(s, "a2a") for s in strategies},
    }


def _stage_choices(
    decode: dict[str, dict[str, np.ndarray]],
    prefill: dict[str, dict[str, np.ndarray]],
    placed: dict[str, PlacedStrategy],
    strategies: Sequence[str],
    reference: str,
    measure: Measure,
    num_redundant: int,
) -> dict[str, dict[str, Any]]:
    """compare.json's ``verdict.stages``: per simulated stage the decision over ``strategies`` (bounds
    never) by ``decision.choose``, the rule ``advise`` and the dashboard card apply too."""
    from moetrace.placement.decision import Candidate, choose, option_key, stage_choices_json

    def over(x: float, r: float) -> float:
        return x / r if r > 0 else float("nan")

    def inter(m: dict[str, np.ndarray]) -> float:
        return float(np.median(_inter_BL(m).sum(1)))

    out = []
    for stage, metrics in (("decode", decode), ("prefill", prefill)):
        if reference not in metrics:
            continue
        ref = metrics[reference]
        cands = [
            Candidate(
                option=option_key(s, num_redundant),
                strategy=s,
                num_redundant=num_redundant,
                time=over(seconds_median(metrics[s], measure), seconds_median(ref, measure)),
                a2a=over(seconds_median(metrics[s], "a2a"), seconds_median(ref, "a2a")),
                inter=over(inter(metrics[s]), inter(ref)),
                deployable=within_limit(placed[s]),
            )
            for s in strategies
            if s in metrics
        ]
        what = "MoE-layer time" if measure == "moe" else "all-to-all time"
        out.append(choose(stage, cands, reference=option_key(reference, num_redundant), measure=what))
    return stage_choices_json(out)


def validation_pricer(data: TraceData, cfg: CompareConfig) -> Callable[..., dict[str, dict[str, float]]] | None:
    """How ``ours`` prices its candidates on its validation split (``ours.choose_ours``'s ``price``): the
    validation requests' own tokens (one more pass over the trace) simulated as compare simulates the
    held-out ones, under the run's copy models and step model (``_Stepper``: MoE-layer time, expert
    computation included), in decode (``VALIDATION_BATCHES`` steps) and prefill. None for a load
    profile (no requests to read).

    ``price(val_rows, {name: (placement, node of each validation row or None: spread evenly)})`` returns
    per candidate ``score`` (the time to serve the validation requests over linear's: decode steps
    ``decode tokens / batch_requests`` times the median decode step plus prefill steps ``prompt tokens /
    (prefill_tokens_per_node * G)`` times the median prefill step, in the verdict's measure), and the
    decode and prefill medians of both measures over linear's (``decode_moe``, ``decode_a2a``,
    ``prefill_moe``, ``prefill_a2a``; NaN where not simulated)."""
    if data.tokens_from is not None:
        return None
    from moetrace.placement.baselines import linear

    def price(
        val_rows: np.ndarray, candidates: dict[str, tuple[Placement, np.ndarray | None]]
    ) -> dict[str, dict[str, float]]:
        R, G = len(data.is_test_R), cfg.deployment.num_groups
        is_val = np.zeros(R, dtype=bool)
        is_val[val_rows] = True
        vdata = with_held_out_tokens(
            replace(
                data,
                is_test_R=is_val,
                test_topk_ids_TLK=None,
                test_req_T=None,
                test_prefill_ids_TLK=None,
                test_prefill_req_T=None,
            )
        )
        vcfg = replace(cfg, num_batches=min(cfg.num_batches, VALIDATION_BATCHES), oracle=False)
        stepper = _Stepper.of(data.model, vcfg)
        m = data.model
        P = cfg.deployment.check_slots(num_experts=m.num_experts, num_redundant=cfg.num_redundant)
        lin = linear(
            num_layers=m.num_moe_layers, num_experts=m.num_experts, num_slots=P, num_ranks=cfg.deployment.num_ep
        )
        assert vdata.test_topk_ids_TLK is not None and vdata.test_req_T is not None
        medians: dict[str, dict[str, float]] = {}
        for name, (placement, group_V) in {"linear": (lin, None), **candidates}.items():
            group_R = None
            if group_V is not None:
                group_R = np.zeros(R, dtype=np.int64)
                group_R[val_rows] = group_V
            rows, batch, src, _ = held_out_batches(vdata, vcfg, group_R)
            dm = stepper.volume(
                vdata.test_topk_ids_TLK, placement, (rows, batch, src), steps=vcfg.num_batches, dedup=cfg.dedup
            )
            med = {f"decode_{w}": seconds_median(dm, w) for w in ("moe", "a2a")}
            drawn = prefill_batches(vdata, vcfg, group_R)
            if drawn is not None and vdata.test_prefill_ids_TLK is not None:
                pm = stepper.volume(
                    vdata.test_prefill_ids_TLK,
                    placement,
                    drawn,
                    steps=vcfg.num_prefill_batches,
                    dedup=cfg.prefill_dedup,
                )
                med |= {f"prefill_{w}": seconds_median(pm, w) for w in ("moe", "a2a")}
            else:
                med |= {"prefill_moe": float("nan"), "prefill_a2a": float("nan")}
            medians[name] = med
        w = stepper.measure
        decode_steps = len(vdata.test_req_T) / vcfg.batch_requests
        prompt_tokens = 0.0
        if data.route_first_decode == 0 and "prefill" in data.stages and np.isfinite(medians["linear"][f"prefill_{w}"]):
            prompt_tokens = float(data.prefill_RLE[val_rows, 0, :].sum(dtype=np.float64)) / max(m.top_k, 1)
        prefill_steps = prompt_tokens / max(cfg.prefill_tokens_per_node * G, 1)

        def served(med: dict[str, float]) -> float:
            pre = med[f"prefill_{w}"] if prefill_steps > 0 else 0.0
            return decode_steps * med[f"decode_{w}"] + prefill_steps * pre

        ref = medians["linear"]
        out = {}
        for name in candidates:
            med = medians[name]
            out[name] = {
                "score": served(med) / served(ref),
                **{k: (v / ref[k] if ref[k] > 0 else float("nan")) for k, v in med.items()},
            }
        return out

    return price


def check_caps(data: TraceData, cfg: CompareConfig) -> None:
    """``ConfigError`` when ``data`` was loaded with other request caps than ``cfg`` asks for."""
    if data.max_train_requests is None:  # a load profile: no requests to cap
        return
    if (data.max_train_requests, data.max_test_requests) != (cfg.max_train_requests, cfg.max_test_requests):
        raise ConfigError(
            f"the trace data was loaded with request caps {data.max_train_requests} train / {data.max_test_requests} "
            f"held out, the config asks for {cfg.max_train_requests} / {cfg.max_test_requests}: pass the config's "
            "max_train_requests and max_test_requests to load_trace_data"
        )


def request_caps(data: TraceData) -> dict[str, int | None]:
    """What compare.json and a placement file's ``source`` record of the request caps: the trace's
    requests and split before them, and the caps (None each for a load profile)."""
    return {
        "num_trace_requests": data.num_trace_requests,
        "num_trace_train_requests": data.num_trace_train_requests,
        "num_trace_test_requests": data.num_trace_test_requests,
        "max_train_requests": data.max_train_requests,
        "max_test_requests": data.max_test_requests,
    }


def _time_hidden(m: ModelInfo, *, config: dict[str, Any] | None = None) -> int:
    """Values per all-to-all copy: the full-size model's hidden size (a ``-tiny`` preset mirrors a
    model's routing at a small width; its copies are priced at the full model's; ``config``: the
    user's --model-config)."""
    expert = expert_compute_for(m, config=config)
    return expert.hidden_size if expert is not None else m.hidden_size


def a2a_seconds_B(metrics: dict[str, np.ndarray]) -> np.ndarray:
    """Predicted all-to-all seconds of every step (dispatch + combine, all layers), float64 [B]."""
    return (metrics["dispatch_seconds"] + metrics["combine_seconds"]).sum(1)


def a2a_seconds_median(metrics: dict[str, np.ndarray]) -> float:
    """Median over steps of ``a2a_seconds_B`` (the figure compare ranks placements by)."""
    return float(np.median(a2a_seconds_B(metrics)))


def _inter_BL(metrics: dict[str, np.ndarray]) -> np.ndarray:
    """Inter-node bytes (dispatch + combine) of every batch and layer, float64 [B, L]."""
    return metrics["dispatch_inter_bytes"] + metrics["combine_inter_bytes"]


def bound_placements(
    data: TraceData,
    cfg: CompareConfig,
    placed: dict[str, PlacedStrategy],
    *,
    on_placed: Callable[[], None] | None = None,
) -> dict[str, list[PlacedStrategy]]:
    """The candidates of each upper bound of ``strategies.BOUNDS``, one per kind of joint placement
    (free membership; and, for a group-limited router whose groups fill whole nodes, groups kept
    whole: ``joint_aligned``); ``run_compare`` keeps the candidate with the least held-out volume.
    Each looks at the held-out requests' decode, so none is deployable:

    - ``perfect_routing``: the joint placement (reused from ``placed`` or built), held-out requests
      assigned to nodes by their own decode activations (balanced, exact LP);
    - ``oracle``: the joint placer fitted on the held-out requests themselves and routed by their
      decode, started from the perfect routing: the inter-node volume this trace's structure allows
      a placement of these kinds (one node per request, ``J`` slots per node) to reach.

    ``extra["kind"]`` of a candidate names the strategy it derives from.
    """
    from moetrace.placement.joint import aligned_router_groups, joint_placement

    G, m = cfg.deployment.num_groups, data.model
    kinds: list[tuple[str, int | None]] = [("joint", None)]
    if (rg := aligned_router_groups(m, num_nodes=cfg.deployment.num_nodes)) is not None:
        kinds.append(("joint_aligned", rg))
    grouping = next((p.grouping for p in placed.values() if p.grouping is not None), None)
    base = {}
    for name, _ in kinds:
        base[name] = placed.get(name) or make_placement(data, cfg, name, grouping=grouping)
        grouping = grouping or base[name].grouping
    test = np.flatnonzero(data.is_test_R)
    out: dict[str, list[PlacedStrategy]] = {
        "perfect_routing": [
            PlacedStrategy(
                strategy="perfect_routing",
                placement=base[name].placement,
                group_of_test_R=base[name].decode_group_of_test_R,
                extra={"kind": name},
            )  # assigned by decode
            for name, _ in kinds
        ]
    }
    if on_placed is not None:
        on_placed()
    P = cfg.deployment.check_slots(num_experts=m.num_experts, num_redundant=cfg.num_redundant)
    out["oracle"] = []
    for name, rg in kinds:
        perfect_R = base[name].decode_group_of_test_R
        assert perfect_R is not None  # joint placements route by price, which also assigns by decode
        jo = joint_placement(
            data.decode_RLE,
            data.decode_RLE,
            init_group_R=perfect_R[test],
            num_groups=G,
            num_slots=P,
            ranks_per_group=cfg.deployment.ranks_per_node,
            rows=test,
            router_groups=rg,
            balance_slack=cfg.max_node_load - 1.0,  # the limit deployable rows are held to
            links=search_links(
                cfg.hardware.kernel(cfg.dedup), hidden_size=_time_hidden(data.model, config=cfg.model_config)
            ),
        )
        group_R = np.zeros(len(data.is_test_R), dtype=np.int64)
        group_R[test] = jo.group_R
        out["oracle"].append(
            PlacedStrategy(
                strategy="oracle",
                placement=jo.placement,
                group_of_test_R=group_R,
                extra={"joint_iterations": jo.num_iters, "kind": name},
            )
        )
    # the oracle sees everything perfect routing sees: its candidates are the oracle's too
    out["oracle"] += [replace(c, strategy="oracle") for c in out["perfect_routing"]]
    if on_placed is not None:
        on_placed()
    return out


def expert_copy_floor(decode_RLE: np.ndarray, *, rows: np.ndarray, num_groups: int, num_slots: int) -> float:
    """A floor under every placement's inter-node volume over linear's, copies counted per (token,
    expert) (``--dedup expert``) with no redundant slots: a certified bound, where the oracle is the
    best placement a solver found.

    Whatever a placement and a router do, a request served by a node that holds J = ``num_slots`` /
    ``num_groups`` experts per layer finds locally at most the share of its decode (token, expert)
    pairs that its own J most-used experts of each layer take. Averaged over ``rows`` (each request
    weighed equally, as batches weigh them when every node is routed an even share) that ceiling
    ``c`` bounds the local share; linear serves each request from every node alike, a local share of
    1/G. Returns ``(1 - c) / (1 - 1/G)``. A router that loads nodes unevenly changes the weights
    (``held_out_batches`` fills every node's micro-batch from its own pool), so the bound assumes even nodes.
    ``decode_RLE``: decode token counts [R, L, E], any numeric dtype; requests without decode tokens
    are left out.
    """
    from moetrace.placement.joint import local_share_ceiling

    ceiling = local_share_ceiling(decode_RLE, num_node_slots=num_slots // num_groups, rows=rows)
    return (1.0 - ceiling) / (1.0 - 1.0 / num_groups)


def placement_file(
    data: TraceData, cfg: CompareConfig, ps: PlacedStrategy, *, out: str | os.PathLike | None = None
) -> PlacementFile:
    """What ``moetrace place`` writes for ``ps``: the placement, its router, and where they came from
    (``out``: the file it is written to; the trace is recorded relative to its folder)."""
    return PlacementFile(
        model=data.model,
        deployment=cfg.deployment,
        strategy=ps.strategy,
        placement=ps.placement,
        router=ps.router,
        source={
            "trace": data.trace_path
            if out is None
            else rf.recorded_path(data.trace_path, results_dir=Path(out).parent),
            "seed": cfg.seed,
            "test_fraction": cfg.test_fraction,
            "num_train_requests": int((~data.is_test_R).sum()),
            **({} if data.max_train_requests is None else request_caps(data)),
            **ps.extra,
        },
    )


def write_results(result: CompareResult, out: str | os.PathLike) -> list[Path]:
    """Write the files the dashboards read (documented in docs/placement.md; names, format and
    version from ``moetrace.results.COMPARE``); returns their paths, ``compare.json`` last."""
    import polars as pl

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_layers = np.asarray(result.model.moe_layers)
    frames, batch_frames, place_frames = [], [], []
    for s, m in result.metrics.items():
        B, L = m[METRICS[0]].shape
        ref_L = np.median(result.inter_BL(result.reference), axis=0)
        inter_BL = result.inter_BL(s)
        cols = {
            "strategy": [s] * (B * L),
            "batch": np.repeat(np.arange(B), L),
            "layer": np.tile(np.arange(L), B),
            "model_layer": np.tile(model_layers, B),
        }
        cols.update({k: v.reshape(-1) for k, v in m.items()})
        cols["inter_node_normalized"] = (inter_BL / np.where(ref_L > 0, ref_L, np.nan)).reshape(-1)
        frames.append(pl.DataFrame(cols))
        batch_frames.append(
            pl.DataFrame(
                {
                    "strategy": [s] * B,
                    "batch": np.arange(B),
                    **{
                        k: m[k].sum(1)  # over layers
                        for k in (
                            "dispatch_intra_bytes",
                            "dispatch_inter_bytes",
                            "combine_intra_bytes",
                            "combine_inter_bytes",
                        )
                    },
                    "inter_node_normalized": result.normalized_B(s),
                    "a2a_time_normalized": result.time_normalized_B(s, "a2a"),
                    "moe_time_normalized": result.time_normalized_B(s, "moe"),
                }
            )
        )
        place_frames.append((s, result.placed[s].placement.phy2log))
    num_ep, ranks_per_node = result.manifest.num_ep, result.manifest.ranks_per_node
    rows = []
    for s, phy2log_LP in place_frames:
        Lp, P = phy2log_LP.shape
        gpu_P = np.arange(P) // (P // num_ep)
        rows.append(
            pl.DataFrame(
                {
                    "strategy": [s] * (Lp * P),
                    "layer": np.repeat(np.arange(Lp), P),
                    "model_layer": np.repeat(model_layers, P),
                    "slot": np.tile(np.arange(P), Lp),
                    "gpu": np.tile(gpu_P, Lp),
                    "node": np.tile(gpu_P // ranks_per_node, Lp),
                    "expert": phy2log_LP.reshape(-1),
                }
            )
        )
    return [
        rf.write_result_table(out, rf.COMPARE, rf.COMPARE_LAYERS, pl.concat(frames)),
        rf.write_result_table(out, rf.COMPARE, rf.COMPARE_BATCHES, pl.concat(batch_frames)),
        rf.write_result_table(out, rf.COMPARE, rf.COMPARE_SUMMARY, pl.DataFrame(result.summary_rows())),
        rf.write_result_table(out, rf.COMPARE, rf.COMPARE_PLACEMENTS, pl.concat(rows)),
        rf.write_result_json(
            out,
            rf.COMPARE,
            rf.COMPARE_MANIFEST,
            {**result.manifest.to_json(), "trace": rf.recorded_path(result.manifest.trace, results_dir=out)},
        ),  # last: names a complete directory
    ]
