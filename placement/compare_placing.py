"""Each strategy's placement from the training requests (``make_placement``, ``place_strategies``:
built through the registry, grouped strategies clustered once and routed by their router), what it
holds (``PlacedStrategy``), and what ``moetrace place`` writes for it (``placement_file``).

Shape legend (docs/architecture.md): R requests, L MoE layers, E logical experts, G node groups,
P physical slots, N rows of the training requests.

Out of scope: the placers (the strategies' modules); simulating the placements (``compare``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from moetrace import results as rf
from moetrace.errors import ConfigError, option_hint
from moetrace.placement.compare_config import CompareConfig
from moetrace.placement.compare_data import TraceData, request_caps
from moetrace.placement.compare_pricer import validation_pricer
from moetrace.placement.compare_steps import time_hidden_size
from moetrace.placement.cost import expert_compute_for
from moetrace.placement.exports import PlacementFile
from moetrace.placement.grouping import Grouping, fit_grouping, groups_of_clusters
from moetrace.placement.maps import Placement
from moetrace.placement.routers import NoRouter, PriceRouter, Router, fit_router
from moetrace.placement.step_model import copy_pair_bytes, search_links
from moetrace.placement.strategies import STRATEGIES, PlacementInputs, get_strategy

__all__ = ["PlacedStrategy", "make_placement", "place_strategies", "placement_file"]


#: compare's what-if for a decode-only capture, dropped from the message of a command without --route-on
#: (a2a, place: ``errors.option_hint``)
_OR_ROUTE_ON = option_hint(
    "--route-on", ", or the what-if --route-on first-decode:N (routes on each request's first N generated tokens)"
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
            f"decode only (manifest collection.stages, e.g. `moetrace import --stages decode-only`); choose an "
            f"ungrouped strategy ({', '.join(s.name for s in STRATEGIES if not s.grouped)}) or a trace with both "
            f"stages{_OR_ROUTE_ON}"
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
    kernel = cfg.hardware.kernel(cfg.dedup)
    hidden = time_hidden_size(m, config=cfg.model_config)
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
        links=search_links(kernel, hidden_size=hidden),
        # the joint placer lays out each node's GPUs by expected MoE-layer time, expert reads included
        expert=expert_compute_for(m, config=cfg.model_config),
        decode_copies_per_step=float(cfg.batch_requests * m.top_k),
        copy_bytes=copy_pair_bytes(kernel, hidden_size=hidden),
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


def place_strategies(
    data: TraceData,
    cfg: CompareConfig,
    strategies: Sequence[str],
    *,
    on_placed: Callable[[str, PlacedStrategy], None] | None = None,
) -> dict[str, PlacedStrategy]:
    """Each strategy's placement from the training requests, in order (duplicates once); the grouped
    strategies share one grouping. ``on_placed(name, placed)`` is called after each (``compare``
    starts its simulations there while the next strategy is placed)."""
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
            on_placed(s, placed[s])
    return placed


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
