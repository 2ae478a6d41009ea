"""The one registry of placement strategies: name, label, one-line description, grouped or not, builder.

``moetrace place --strategy``, ``moetrace compare --strategies``, ``CompareConfig`` validation,
``make_placement`` and the dashboards' strategy labels all read ``STRATEGIES``; docs/placement.md
has the same table (a test keeps it in step). Adding a strategy: write the placer as a pure function of arrays in its own module, then add
one ``Strategy`` row here with a small builder from ``PlacementInputs`` (and, for a grouped one, the
kind of its router: a key of ``routers.ROUTERS``).

A *grouped* strategy needs request clustering: the training requests are clustered into one group
per node, and its placer sees per-group usage ``usage_GLE``; at serving time a router sends each
request to a group from its prefill only. ``router`` names its kind (``routers.ROUTERS``): the
clustering's (``centroid``: nearest prefill centroid, ``grouping``) or the placement's own (``price``:
the node holding most of the prompt's experts, less a per-node price that keeps nodes balanced,
``joint``); ``make_placement`` builds it with ``routers.fit_router``.

``BOUNDS`` names the rows ``compare`` adds that are not deployable strategies but upper bounds on
what any placement of this kind could reach (they look at the held-out requests' decode).

Shape legend (legend: docs/architecture.md): G node groups, L MoE layers, E logical experts,
P physical slots, W EP ranks.

Out of scope: the placement algorithms (``baselines``, ``eplb``, ``data_placement``, ``improved``, ``joint``;
a builder only adapts arguments); clustering and routing requests (``grouping``, ``routers``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from moetrace.errors import ConfigError

if TYPE_CHECKING:  # the placers (and numpy) load when a strategy is built, so `moetrace --help` stays light
    import numpy as np

    from moetrace.placement.cost import ExpertCompute, Links
    from moetrace.placement.maps import Placement
    from moetrace.placement.routers import RouterKind
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "PlacementInputs",
    "Strategy",
    "Bound",
    "STRATEGIES",
    "BOUNDS",
    "LABELS",
    "STRATEGY_NAMES",
    "RECOMMENDED",
    "get_strategy",
    "check_strategies",
]


@dataclass(frozen=True, kw_only=True)
class PlacementInputs:
    """Everything a strategy may use; the arrays come from the training requests only."""

    num_layers: int  # L MoE layers
    num_experts: int  # E logical experts per layer
    num_slots: int  # P physical slots per layer (E + redundant)
    num_ranks: int  # W EP ranks (GPUs)
    num_nodes: int  # G nodes (= node groups)
    ranks_per_node: int  # W / G
    router_groups: int  # expert groups of the model's group-limited router (DeepSeek-V3: 8), 1 when it has none
    seed: int  # seeds the random placement
    load_LE: np.ndarray  # float32 [L, E] decode tokens per (layer, expert)
    usage_GLE: np.ndarray | None = (
        None  # float64 [G, L, E] decode tokens per group; strategies with uses_group_usage only
    )
    decode_RLE: np.ndarray | None = None  # [R, L, E] decode counts of every request (price-routed strategies)
    prefill_RLE: np.ndarray | None = None  # [R, L, E] prefill counts of every request (what the router sees)
    train_rows: np.ndarray | None = None  # int64 rows of the training requests in the [R, ...] arrays
    init_group_N: np.ndarray | None = None  # int64 [len(train_rows)] starting node of each training request
    links: Links | None = None  # the cost model's links (the joint placer balances GPUs under them); None: defaults
    max_node_load: float = 1.10  # the routers' admission limit (busiest node over an even share)
    # how ``ours`` prices its candidates on its validation split (``compare.validation_pricer``: simulated
    # MoE-layer time of the validation requests' own tokens); None: expected link time from counts
    price_validation: Callable[..., dict[str, dict[str, float]]] | None = None
    # the routed experts' cost (``cost.expert_compute_for``): the joint placer lays out each node's GPUs by
    # expected MoE-layer time, expert reads included; None: by link time only (the model's size unknown)
    expert: ExpertCompute | None = None
    decode_copies_per_step: float = 0.0  # (token, expert) copies of one decode step (batch tokens x top-k); 0: unknown
    copy_bytes: float = 0.0  # bytes of one dispatch copy plus one combine copy (the kernel's value types)

    @property
    def shape(self) -> dict[str, int]:
        """The keyword arguments of the data-free placers."""
        return dict(
            num_layers=self.num_layers, num_experts=self.num_experts, num_slots=self.num_slots, num_ranks=self.num_ranks
        )


#: a builder returns the placement and what to record about how it was built (placement file ``source``)
Builder = Callable[["PlacementInputs"], "tuple[Placement, dict[str, Any]]"]


@dataclass(frozen=True)
class Strategy:
    """One placement strategy (a row of ``STRATEGIES``, fields in column order)."""

    name: str  # what --strategy / --strategies and the result files call it
    label: str  # short name for figures and tables (dashboards)
    grouped: bool  # needs request clustering (one group per node, a prefill router at serving time)
    build: Builder  # the placement from PlacementInputs
    description: str  # one line, the same in docs/placement.md's table
    router: RouterKind = "none"  # how a request finds its node at serving time (a key of routers.ROUTERS)
    # whether every group of a group-limited router stays on one node ("linear": only without redundant slots,
    # whose ``p mod E`` wraps over node boundaries)
    keeps_router_groups: Literal["no", "yes", "without_redundancy"] = "no"
    # raises ConfigError when the strategy cannot serve this (model, number of nodes); None: always can
    requires: Callable[[ModelInfo, int], None] | None = None
    # the builder reads ``usage_GLE`` (the training requests' decode tokens summed per group of the clustering)
    uses_group_usage: bool = False
    # the builder reads the load (``load_LE``, the requests): False for data-free placements (linear, round
    # robin, random), which ``advise`` builds once for every stage instead of fitting one per stage
    uses_load: bool = True

    def check(self, model: ModelInfo, *, num_nodes: int) -> None:
        """``ConfigError`` naming why this strategy cannot place ``model`` (a ModelInfo) on ``num_nodes``."""
        if self.requires is not None:
            self.requires(model, num_nodes)

    def keeps_groups(self, *, num_redundant: int) -> bool:
        """Every router group stays on one node (for a router whose groups fill whole nodes)."""
        return self.keeps_router_groups == "yes" or (
            self.keeps_router_groups == "without_redundancy" and not num_redundant
        )


@dataclass(frozen=True)
class Bound:
    """An upper bound ``compare`` reports next to the strategies (a row of ``BOUNDS``)."""

    name: str  # its name in compare's result files (never a --strategies choice)
    label: str  # short name for figures and tables
    description: str  # one line, the same in docs/placement.md


def _linear(x: PlacementInputs) -> tuple[Placement, dict[str, Any]]:
    from moetrace.placement.baselines import linear

    return linear(**x.shape), {}


def _round_robin(x: PlacementInputs) -> tuple[Placement, dict[str, Any]]:
    from moetrace.placement.baselines import round_robin

    return round_robin(**x.shape), {}


def _random(x: PlacementInputs) -> tuple[Placement, dict[str, Any]]:
    from moetrace.placement.baselines import random_placement

    return random_placement(**x.shape, seed=x.seed), {}


def _eplb(x: PlacementInputs) -> tuple[Placement, dict[str, Any]]:
    from moetrace.placement.eplb import Accumulate, rebalance

    # as SGLang and vLLM compute it (placement/eplb.py; DeepSeek's reference sums in float32)
    accumulate: Accumulate = "float64"
    placement = rebalance(
        x.load_LE,
        num_replicas=x.num_slots,
        num_groups=x.router_groups,
        num_nodes=x.num_nodes,
        num_gpus=x.num_ranks,
        accumulate=accumulate,
    )
    policy = "hierarchical" if x.router_groups % x.num_nodes == 0 else "global"
    return placement, {"eplb_num_groups": x.router_groups, "eplb_policy": policy, "eplb_sum": accumulate}


def _eplb_global(x: PlacementInputs) -> tuple[Placement, dict[str, Any]]:
    from moetrace.placement.eplb import Accumulate, rebalance

    accumulate: Accumulate = "float64"
    # one group, one node: DeepSeek's global policy (its README's choice for decode at large EP)
    placement = rebalance(
        x.load_LE, num_replicas=x.num_slots, num_groups=1, num_nodes=1, num_gpus=x.num_ranks, accumulate=accumulate
    )
    return placement, {"eplb_num_groups": 1, "eplb_policy": "global", "eplb_sum": accumulate}


def _usage_GLE(x: PlacementInputs) -> np.ndarray:
    if x.usage_GLE is None:
        raise ConfigError("a grouped strategy needs per-group usage (usage_GLE) from clustered training requests")
    return x.usage_GLE


def _data(x: PlacementInputs) -> tuple[Placement, dict[str, Any]]:
    from moetrace.placement.data_placement import data_placement

    return data_placement(_usage_GLE(x), num_slots=x.num_slots, ranks_per_group=x.ranks_per_node), {}


def _improved(x: PlacementInputs) -> tuple[Placement, dict[str, Any]]:
    from moetrace.placement.improved import improved_placement

    return improved_placement(_usage_GLE(x), num_slots=x.num_slots, ranks_per_group=x.ranks_per_node), {}


def _joint_with(x: PlacementInputs, router_groups: int | None) -> tuple[Placement, dict[str, Any]]:
    from moetrace.placement.cost import DEFAULT_LINKS
    from moetrace.placement.joint import joint_placement

    if x.decode_RLE is None or x.prefill_RLE is None or x.train_rows is None or x.init_group_N is None:
        raise ConfigError("the joint placer needs per-request decode and prefill counts and starting groups")
    jp = joint_placement(
        x.decode_RLE,
        x.prefill_RLE,
        init_group_R=x.init_group_N,
        num_groups=x.num_nodes,
        num_slots=x.num_slots,
        ranks_per_group=x.ranks_per_node,
        rows=x.train_rows,
        router_groups=router_groups,
        links=x.links or DEFAULT_LINKS,
        expert=x.expert,
        copies_per_step=x.decode_copies_per_step,
        copy_bytes=x.copy_bytes,
    )
    return jp.placement, {
        "router_price": [round(float(p), 9) for p in jp.price_G],
        "joint_iterations": jp.num_iters,
        "joint_objective": [round(v, 6) for v in jp.objective_history],
        **({} if jp.layout_gain is None else {"joint_layout_gain": round(jp.layout_gain, 6)}),
        **(
            {}
            if jp.layers_spread_by_experts is None
            else {"joint_layers_spread_by_expert_time": jp.layers_spread_by_experts}
        ),
    }


def _joint(x: PlacementInputs) -> tuple[Placement, dict[str, Any]]:
    return _joint_with(x, None)


def _ours(x: PlacementInputs) -> tuple[Placement, dict[str, Any]]:
    from moetrace.placement.ours import choose_ours

    return choose_ours(x, build_joint=_joint, max_node_load=x.max_node_load, price=x.price_validation)


def _aligned_possible(model: ModelInfo, num_nodes: int) -> None:
    from moetrace.placement.joint import require_aligned

    require_aligned(model, num_nodes=num_nodes)


def _joint_aligned(x: PlacementInputs) -> tuple[Placement, dict[str, Any]]:
    # x.router_groups is the model's n_group (1 without one): aligned_members refuses what cannot be kept whole
    placement, extra = _joint_with(x, x.router_groups)
    return placement, {**extra, "router_groups_kept_whole": x.router_groups}


#: the registry, in the order the CLI and docs list it
STRATEGIES: tuple[Strategy, ...] = (
    #        name           label                      grouped build         description
    Strategy(
        "linear",
        "linear (vLLM default)",
        False,
        _linear,
        "vLLM default: slot p holds expert p mod E",
        keeps_router_groups="without_redundancy",
        uses_load=False,
    ),
    Strategy(
        "round_robin", "round robin", False, _round_robin, "vLLM round robin: expert e on GPU e mod W", uses_load=False
    ),
    Strategy(
        "random",
        "random",
        False,
        _random,
        "every expert once plus random replicas, shuffled per layer (seeded)",
        uses_load=False,
    ),
    Strategy(
        "eplb", "EPLB", False, _eplb, "DeepSeek EPLB on the training requests' decode load", keeps_router_groups="yes"
    ),  # its hierarchical policy
    Strategy(
        "eplb_global",
        "EPLB, global policy",
        False,
        _eplb_global,
        "DeepSeek EPLB's global policy (experts packed over all GPUs, groups ignored), its README's choice for decode",
    ),
    Strategy(
        "data",
        "data-based (core paper)",
        True,
        _data,
        "core paper §4.2: each group's most-used experts on its node (greedy)",
        "centroid",
        uses_group_usage=True,
    ),
    Strategy(
        "improved",
        "improved",
        True,
        _improved,
        "the data placer's objective solved exactly (an integral LP)",
        "centroid",
        uses_group_usage=True,
    ),
    Strategy(
        "joint",
        "joint (ours)",
        True,
        _joint,
        "ours: request routing and expert membership optimised together (alternating exact LPs), prefill router with node prices",
        "price",
    ),
    Strategy(
        "ours",
        "ours",
        True,
        _ours,
        "ours, chosen on a validation split of the training requests: joint with its router, joint with no router, or EPLB (either policy), whichever is fastest there",
        "price",
    ),
    Strategy(
        "joint_free",
        "joint, no router (ours)",
        True,
        _joint,
        "ours served as engines serve today, with no router in front: the joint placement, requests spread evenly over nodes",
        "none",
    ),
    Strategy(
        "joint_aligned",
        "joint, groups whole (ours)",
        True,
        _joint_aligned,
        "ours for group-limited routers (DeepSeek-V3): joint with the router's expert groups kept whole on nodes, so a token meets at most topk_group nodes",
        "price",
        keeps_router_groups="yes",
        requires=_aligned_possible,
    ),
)
#: the bounds compare reports (``compare --no-oracle`` leaves them out)
BOUNDS: tuple[Bound, ...] = (
    Bound(
        "perfect_routing",
        "joint, perfect routing",
        "the joint placement with held-out requests routed by their own decode (a router that cannot be built)",
    ),
    Bound(
        "oracle",
        "oracle",
        "the joint placer fitted on the held-out requests themselves, routed by their decode: what this trace's structure allows",
    ),
    # for a group-limited router whose groups fill whole nodes, each bound is the better of joint and joint_aligned
)
#: figure and table label of every strategy and bound name
LABELS: dict[str, str] = {**{s.name: s.label for s in STRATEGIES}, **{b.name: b.label for b in BOUNDS}}
STRATEGY_NAMES: tuple[str, ...] = tuple(s.name for s in STRATEGIES)
#: the strategy moetrace recommends: ``place``'s default, drawn first and on top in the dashboard
RECOMMENDED: str = "ours"


def get_strategy(name: str) -> Strategy:
    """The registry row of ``name``; ``ConfigError`` naming the choices when there is none."""
    for s in STRATEGIES:
        if s.name == name:
            return s
    raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGY_NAMES)}")


def check_strategies(names: tuple[str, ...]) -> None:
    """``ConfigError`` unless ``names`` is a non-empty list of registered strategies."""
    bad = [s for s in names if s not in STRATEGY_NAMES]
    if bad or not names:
        what = f"unknown strategies {bad}" if bad else "no strategy given"
        raise ConfigError(f"{what}; choose from {', '.join(STRATEGY_NAMES)}")
