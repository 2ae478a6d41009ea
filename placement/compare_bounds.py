"""The upper bounds ``compare`` reports (``strategies.BOUNDS``): the candidates of perfect routing and
the test-set oracle (``bound_placements``; ``compare`` keeps each bound's best), and the certified
floor under every placement's inter-node volume (``expert_copy_floor``).

Shape legend (docs/architecture.md): R requests, L MoE layers, E logical experts, G node groups.

Out of scope: simulating the candidates and ranking them (``compare``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from moetrace.placement.compare_config import CompareConfig
from moetrace.placement.compare_data import TraceData
from moetrace.placement.compare_placing import PlacedStrategy, make_placement
from moetrace.placement.compare_steps import time_hidden_size
from moetrace.placement.step_model import search_links

__all__ = ["bound_placements", "expert_copy_floor"]


def bound_placements(
    data: TraceData,
    cfg: CompareConfig,
    placed: dict[str, PlacedStrategy],
    *,
    on_placed: Callable[[str, list[PlacedStrategy]], None] | None = None,
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

    ``extra["kind"]`` of a candidate names the strategy it derives from. ``on_placed(bound, candidates)``
    is called as each bound's candidates are built (``compare`` simulates them while the next are).
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
        on_placed("perfect_routing", out["perfect_routing"])
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
                cfg.hardware.kernel(cfg.dedup), hidden_size=time_hidden_size(data.model, config=cfg.model_config)
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
        on_placed("oracle", out["oracle"])
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
