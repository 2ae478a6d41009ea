"""Ours, chosen where it pays: the joint placement with its router, the same placement with no router,
or EPLB (hierarchical or global), whichever serves a validation split of the training requests in
the least expected step time (docs/placement.md, "Ours: routed only where routing pays").

The training requests are split (seeded) into a fitting part and a validation part (never the
held-out requests ``compare`` evaluates on). Every candidate is fitted on the fitting part; each is
then priced on the validation requests by the step model in expectation
(``step_search.expected_step_seconds``: the busiest GPU's link time per layer, summed over layers,
with the kernel's dispatch and combine rates): routed candidates route the validation requests by
their prefill with the router's prices and admission limit; router-free ones spread every request
evenly over the nodes (as engines serve today). The cheapest wins, so ours is never priced worse than
EPLB on the validation split; a router is kept only when it beats its own placement served without
one by ``min_router_gain``.

Shape legend (docs/architecture.md): R requests, L MoE layers, E experts, G nodes, P physical slots.

Out of scope: the fixed cost per collective and the expert computation (the same for every candidate
in expectation at equal tokens per node); per-message latency; the prefill stage.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from moetrace.placement.maps import Placement

__all__ = ["CANDIDATES", "choose_ours"]

#: the candidates, in the order they are reported
CANDIDATES = ("joint", "joint_free", "eplb", "eplb_global")


def choose_ours(
    x: Any,
    *,
    build_joint: Any,
    validation_fraction: float = 0.2,
    max_node_load: float = 1.10,
    min_router_gain: float = 0.01,
) -> tuple[Placement, dict[str, Any]]:
    """The placement and provenance of ours on ``x`` (``strategies.PlacementInputs``).

    ``build_joint(x) -> (placement, extra)``: the joint placer (its ``extra["router_price"]``: node
    prices). The provenance records the choice (``ours_choice``), whether it is served with the price
    router (``served_router``: "price" or "none") and every candidate's validation step time over
    linear's (``ours_validation``).
    """
    from moetrace.placement.baselines import linear
    from moetrace.placement.cost import DEFAULT_LINKS
    from moetrace.placement.eplb import rebalance
    from moetrace.placement.joint import group_usage, members_of_placement, node_scores, route_requests
    from moetrace.placement.step_search import expected_step_seconds

    assert x.train_rows is not None and x.decode_RLE is not None and x.prefill_RLE is not None
    train = np.asarray(x.train_rows)
    G = x.num_nodes
    rng = np.random.default_rng(x.seed)
    order = rng.permutation(len(train))
    n_val = min(max(G, int(round(validation_fraction * len(train)))), len(train) - G)
    if n_val < G:  # too few requests to hold any out: the joint placement with its router
        placement, extra = build_joint(x)
        return placement, {**extra, "ours_choice": "joint", "served_router": "price", "ours_validation": {}}
    val, fit_idx = np.sort(train[order[:n_val]]), np.sort(order[n_val:])
    fit = train[fit_idx]
    load_LE = np.asarray(x.decode_RLE[fit], dtype=np.float64).sum(0)
    x_fit = replace(
        x,
        train_rows=fit,
        init_group_N=None if x.init_group_N is None else np.asarray(x.init_group_N)[fit_idx],
        load_LE=load_LE,
    )
    joint_pl, joint_extra = build_joint(x_fit)
    shape = dict(num_replicas=x.num_slots, num_gpus=x.num_ranks, accumulate="float64")
    placements = {
        "joint": joint_pl,
        "joint_free": joint_pl,
        "eplb": rebalance(load_LE, num_groups=x.router_groups, num_nodes=x.num_nodes, **shape),
        "eplb_global": rebalance(load_LE, num_groups=1, num_nodes=1, **shape),
    }
    # validation usage: routed by the joint router, or every request spread evenly over the nodes
    even_GLE = np.repeat(group_usage(x.decode_RLE, np.zeros(len(val), np.int64), num_groups=1, rows=val) / G, G, axis=0)
    member = members_of_placement(joint_pl, num_groups=G, num_experts=x.num_experts)
    routed_R = route_requests(
        node_scores(x.prefill_RLE, member, rows=val),
        np.asarray(joint_extra["router_price"]),
        max_node_load=max_node_load,
    )
    usage = {c: even_GLE for c in CANDIDATES}
    usage["joint"] = group_usage(x.decode_RLE, routed_R, num_groups=G, rows=val)
    lin = linear(num_layers=x.num_layers, num_experts=x.num_experts, num_slots=x.num_slots, num_ranks=x.num_ranks)
    ref = expected_step_seconds(lin.phy2log, even_GLE, num_ranks=x.num_ranks, links=x.links or DEFAULT_LINKS)
    score = {
        c: expected_step_seconds(placements[c].phy2log, usage[c], num_ranks=x.num_ranks, links=x.links or DEFAULT_LINKS)
        / ref
        for c in CANDIDATES
    }
    best_free = min(("joint_free", "eplb", "eplb_global"), key=lambda c: score[c])
    choice = "joint" if score["joint"] < score[best_free] * (1.0 - min_router_gain) else best_free
    if choice in ("joint", "joint_free"):
        extra = dict(joint_extra)
    else:
        extra = {"eplb_policy": "hierarchical" if choice == "eplb" else "global", "eplb_sum": "float64"}
    extra.update(
        {
            "router_price": joint_extra["router_price"],  # read only when served with the router
            "ours_choice": choice,
            "served_router": "price" if choice == "joint" else "none",
            "ours_validation": {c: round(float(v), 6) for c, v in score.items()},
            "ours_validation_requests": int(len(val)),
            "ours_router_gain": round(float(1.0 - score["joint"] / score["joint_free"]), 6),
        }
    )
    return placements[choice], extra
