"""Which placements ``moetrace advise`` evaluates: any registered strategy by name, EPLB's two
policies swept over redundant slots, summed as the engine that will load them sums.

- **Names** are ``strategies.STRATEGIES``' (``--strategies``); by default ``DEFAULT_STRATEGIES``:
  linear, round robin, EPLB's hierarchical and global policies, and ours (``joint``) where
  per-request routing allows. The reference (``--current``, else linear) is always evaluated.
- **EPLB** (``eplb``, ``eplb_global``) is swept over the redundant slots of
  ``AdviseConfig.sweep``; every other strategy is evaluated at 0 redundant slots.
  ``eplb`` is the registry's row: DeepSeek's hierarchical policy where the model's router groups
  divide over the nodes, its global policy otherwise; ``eplb_global`` is always the global policy
  (DeepSeek EPLB's README recommends it for decode at large EP). Where the two compute the same
  placement (one node, or groups that do not divide over the nodes) only ``eplb`` is evaluated,
  labelled with the policy it ran, and the output says so.
- **Summation** (``eplb_sum``): ``eplb.Accumulate``, float64 as SGLang and vLLM, float32 as
  DeepSeek's reference.
- **Grouped strategies** (``data``, ``improved``, ``joint``, ``ours``, ...) cluster requests and route
  each by its prefill: they need a trace that recorded prefill and decode (``compare.make_placement``
  builds them; their steps are drawn through their routers). Asked for on a load profile or a
  one-stage trace, they are refused naming why; by default ``joint`` is left out there and the
  output says so.

Shape legend (docs/architecture.md): L MoE layers, E logical experts, P physical slots, W EP ranks.

Out of scope: evaluating the placements (``run``), the placers themselves (``eplb``,
``baselines``, ``joint``, ...), the registry (``strategies``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.decision import EPLB_STRATEGIES
from moetrace.placement.deployment import Deployment
from moetrace.placement.eplb import Accumulate, rebalance
from moetrace.placement.maps import Placement
from moetrace.placement.strategies import LABELS, STRATEGY_NAMES, PlacementInputs, get_strategy

if TYPE_CHECKING:
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "DEFAULT_STRATEGIES",
    "EPLB_STRATEGIES",
    "EplbPolicy",
    "data_free_placement",
    "ungrouped_placement",
    "eplb_option_placement",
    "eplb_policy",
    "option_label",
    "resolve_strategies",
]

#: EPLB's policies as advise names them
EplbPolicy = Literal["hierarchical", "global"]
#: the strategies swept over redundant slots
#: what advise evaluates when --strategies is not given (joint where per-request routing allows)
DEFAULT_STRATEGIES: tuple[str, ...] = ("linear", "round_robin", "eplb", "eplb_global", "joint")


def eplb_policy(strategy: str, *, model: ModelInfo, deployment: Deployment) -> EplbPolicy:
    """The policy ``strategy`` (``eplb`` or ``eplb_global``) runs on ``model`` at ``deployment``:
    hierarchical only for ``eplb`` with router groups that divide over more than one node (with one
    node the hierarchical policy places exactly as the global one does)."""
    groups, nodes = model.n_group or 1, deployment.num_nodes
    hierarchical = groups % nodes == 0 and model.num_experts % groups == 0 and nodes > 1
    return "hierarchical" if strategy == "eplb" and hierarchical else "global"


def eplb_option_placement(
    load_LE: np.ndarray,
    *,
    strategy: str,
    model: ModelInfo,
    deployment: Deployment,
    num_redundant: int,
    eplb_sum: Accumulate,
) -> Placement:
    """EPLB of ``load_LE`` (float [L, E] tokens) with ``num_redundant`` redundant slots under the
    policy of ``strategy`` (``eplb_policy``), pack weights summed in ``eplb_sum``: for ``eplb`` the
    registry row's arguments (the model's router groups, every node), so ``moetrace place --strategy
    eplb`` writes the same placement."""
    if strategy not in EPLB_STRATEGIES:
        raise ConfigError(f"{strategy!r} is not an EPLB strategy ({', '.join(EPLB_STRATEGIES)})")
    glob = strategy == "eplb_global"
    return rebalance(
        np.asarray(load_LE, dtype=np.float64),
        num_replicas=model.num_experts + num_redundant,
        num_groups=1 if glob else model.n_group or 1,
        num_nodes=1 if glob else deployment.num_nodes,
        num_gpus=deployment.num_ep,
        accumulate=eplb_sum,
    )


def data_free_placement(name: str, *, model: ModelInfo, deployment: Deployment, seed: int) -> Placement:
    """The placement of an ungrouped, non-EPLB registry strategy that reads no load (``linear``,
    ``round_robin``, ``random``: ``Strategy.uses_load`` False) at 0 redundant slots, built by its
    registry row (a zero load is passed)."""
    if get_strategy(name).uses_load:
        raise ConfigError(f"{name!r} needs load or requests; it is not a data-free strategy")
    E, L = model.num_experts, model.num_moe_layers
    return ungrouped_placement(name, np.zeros((L, E), dtype=np.float32), model=model, deployment=deployment, seed=seed)


def ungrouped_placement(
    name: str, load_LE: np.ndarray, *, model: ModelInfo, deployment: Deployment, seed: int
) -> Placement:
    """The placement of an ungrouped, non-EPLB registry strategy at 0 redundant slots, built by its
    registry row on ``load_LE`` (float [L, E], the tokens of the stage it is fitted on): whatever a
    newly registered strategy is, ``advise --strategies NAME`` evaluates it."""
    spec = get_strategy(name)
    if spec.grouped or name in EPLB_STRATEGIES:
        raise ConfigError(f"{name!r} needs requests or EPLB's sweep; it is not built here")
    E, L = model.num_experts, model.num_moe_layers
    x = PlacementInputs(
        num_layers=L,
        num_experts=E,
        num_slots=E,
        num_ranks=deployment.num_ep,
        num_nodes=deployment.num_nodes,
        ranks_per_node=deployment.ranks_per_node,
        router_groups=model.n_group or 1,
        seed=seed,
        load_LE=load_LE,
    )
    return spec.build(x)[0]


def option_label(name: str, num_redundant: int, *, policy: EplbPolicy | None = None) -> str:
    """How tables and verdicts name an option: ``EPLB, 64 redundant`` (hierarchical), ``EPLB global,
    64 redundant``, else the registry's label."""
    if name in EPLB_STRATEGIES:
        return f"EPLB{' global' if policy == 'global' else ''}, {num_redundant} redundant"
    return {"current": "current", "joint": "joint (ours)"}.get(name, LABELS.get(name, name))


def resolve_strategies(
    asked: tuple[str, ...], *, model: ModelInfo, deployment: Deployment, routable: bool, kind: str
) -> tuple[tuple[str, ...], list[str]]:
    """The strategies to evaluate and what the output must say about the choice.

    ``asked``: the user's names (empty: ``DEFAULT_STRATEGIES``); ``routable``: the input holds
    per-request prefill and decode (grouped strategies can be built); ``kind``: ``trace`` or
    ``profile`` (named in the refusal). ``ConfigError`` for an unknown name, or a grouped strategy
    asked for where it cannot be built."""
    explicit = bool(asked)
    names = tuple(dict.fromkeys(asked)) if explicit else DEFAULT_STRATEGIES
    bad = [n for n in names if n not in STRATEGY_NAMES]
    if bad:
        raise ConfigError(f"unknown strategies {bad}; choose from {', '.join(STRATEGY_NAMES)}")
    notes: list[str] = []
    grouped = [n for n in names if get_strategy(n).grouped]
    if grouped and not routable:
        if explicit:
            what = "a load profile holds counts, not requests" if kind == "profile" else "the trace lacks a stage"
            raise ConfigError(
                f"--strategies {','.join(grouped)}: these cluster requests and route each by its prefill, so they "
                f"need a trace that recorded prefill and decode ({what}); choose from "
                f"{', '.join(n for n in STRATEGY_NAMES if not get_strategy(n).grouped)}"
            )
        names = tuple(n for n in names if n not in grouped)
    if "eplb" in names and "eplb_global" in names:
        if eplb_policy("eplb", model=model, deployment=deployment) == "global":
            names = tuple(n for n in names if n != "eplb_global")
            notes.append(
                f"EPLB's hierarchical policy does not apply at {deployment.name} "
                f"({model.n_group or 1} router group(s) over {deployment.num_nodes} node(s)): EPLB runs its global "
                "policy here, evaluated once (eplb)."
            )
    return names, notes
