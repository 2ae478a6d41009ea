"""Ours, chosen where it pays: the joint placement with its router, the same placement with no router,
or EPLB (hierarchical or global), whichever serves a validation split of the training requests in
the least time (docs/placement.md, "Ours: routed only where routing pays").

The training requests are split (seeded) into a fitting part and a validation part (never the
held-out requests ``compare`` evaluates on). Every candidate is fitted on the fitting part; routed
candidates route the validation requests by their prefill with the router's prices and admission
limit; router-free ones spread every request evenly over the nodes (as engines serve today). Each is
then priced on the validation requests by ``price`` (``compare.validation_pricer``: the validation
requests' own tokens simulated as compare simulates the held-out ones, in the verdict's measure,
MoE-layer time: dispatch + the slowest GPU's experts, memory-bound reads of its activated experts or
compute-bound pairs + combine, under the deployment's copy models; the time to serve the validation
requests, decode and prefill steps together, over linear's). The cheapest wins, so ours is never
priced worse than EPLB on the validation split in that measure; a router is kept only when it beats
the best router-free candidate by ``min_router_gain`` (what the router adds is recorded either way),
and the router-free joint placement is served instead of EPLB only when it beats EPLB's better policy
by ``min_placement_gain`` (ties go to what the engines compute themselves). Where the price also
gives all-to-all time (``a2a_score``), a joint candidate must not be slower than that EPLB policy in
it either (``A2A_TOLERANCE``): ours is then at most EPLB in both measures on the validation split.

Without ``price`` (library callers with counts only, no tokens) the candidates are priced by the
expected busiest-GPU link time of decode copies per (token, expert) (``step_search.expected_step_seconds``),
and the provenance says so (``ours_measure``).

Shape legend (docs/architecture.md): R requests, L MoE layers, E experts, G nodes, P physical slots.

Out of scope: fitting the candidates to the measure (each is fitted by its own placer); the
validation split's noise (a small split can pick a candidate the held-out requests rank second).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from moetrace.placement.maps import Placement

__all__ = ["A2A_TOLERANCE", "CANDIDATES", "MIN_PLACEMENT_GAIN", "MIN_ROUTER_GAIN", "choose_ours"]

#: the candidates, in the order they are reported
CANDIDATES = ("joint", "joint_free", "eplb", "eplb_global")

#: the least share of the best router-free candidate's validation time the router must save to be kept
#: (a tenth of a point: below it the validation steps cannot tell the two apart, and a router is infrastructure)
MIN_ROUTER_GAIN = 0.001

#: the least share of EPLB's validation time the router-free joint placement must save to be served
#: instead of EPLB (the engines compute EPLB themselves; below a tenth of a point the validation steps
#: cannot tell the two apart, and a placement file to ship is infrastructure too)
MIN_PLACEMENT_GAIN = 0.001

#: how much slower in all-to-all time than the better EPLB policy (a share of its validation time) a
#: joint candidate may be and still replace it: none beyond float rounding. The choice is made in
#: MoE-layer time, but a placement that wins there by reading fewer experts while sending more bytes
#: than EPLB is not served: ours stays at most EPLB in both measures the deployment is judged by
A2A_TOLERANCE = 1e-9


def choose_ours(
    x: Any,
    *,
    build_joint: Any,
    validation_fraction: float = 0.2,
    max_node_load: float = 1.10,
    min_router_gain: float = MIN_ROUTER_GAIN,
    min_placement_gain: float = MIN_PLACEMENT_GAIN,
    price: Any = None,
    refit: bool = True,
    refit_joint: bool = False,
) -> tuple[Placement, dict[str, Any]]:
    """The placement and provenance of ours on ``x`` (``strategies.PlacementInputs``).

    ``build_joint(x) -> (placement, extra)``: the joint placer (its ``extra["router_price"]``: node
    prices). ``price(val_rows, {candidate: (placement, node of each validation row or None)})``: per
    candidate a dict with ``score`` (lower is better, 1 = linear) and any details to record
    (``compare.validation_pricer``); None: expected link time. The provenance records the choice
    (``ours_choice``), whether it is served with the price router (``served_router``: "price" or
    "none"), every candidate's score (``ours_validation``), the measure (``ours_measure``), the details
    (``ours_validation_detail``) and what the router adds over the same placement served without it
    (``ours_router_gain``, a share of the router-free time). ``refit``: an EPLB choice is fitted
    again on every training request (EPLB is a fixed function of the counts: more counts, the same
    method; the strategy's own row's placement), else the one fitted on the fitting part is returned.
    ``refit_joint``: the same for a joint choice; off by default, because the joint placer is a
    search whose outcome varies with its input (on the Llama-4 capture a refit on every training
    request lost 1.7 points of MoE-layer time to the placement the split had scored, and went from
    1.2 points under EPLB to 0.6 over it): the placement served is the one measured.
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
    detail: dict[str, dict[str, float]] = {}
    a2a: dict[str, float] = {}
    if price is not None:
        priced = price(val, {c: (placements[c], routed_R if c == "joint" else None) for c in CANDIDATES})
        score = {c: float(priced[c]["score"]) for c in CANDIDATES}
        detail = {c: {k: round(float(v), 6) for k, v in priced[c].items() if k != "score"} for c in CANDIDATES}
        a2a = {c: float(priced[c]["a2a_score"]) for c in CANDIDATES if "a2a_score" in priced[c]}
        measure = "MoE-layer time to serve the validation requests (decode and prefill steps), simulated"
    else:
        usage = {c: even_GLE for c in CANDIDATES}
        usage["joint"] = group_usage(x.decode_RLE, routed_R, num_groups=G, rows=val)
        lin = linear(num_layers=x.num_layers, num_experts=x.num_experts, num_slots=x.num_slots, num_ranks=x.num_ranks)
        links = x.links or DEFAULT_LINKS
        ref = expected_step_seconds(lin.phy2log, even_GLE, num_ranks=x.num_ranks, links=links)
        score = {
            c: expected_step_seconds(placements[c].phy2log, usage[c], num_ranks=x.num_ranks, links=links) / ref
            for c in CANDIDATES
        }
        measure = "expected decode link time of the busiest GPU, copies per (token, expert)"
    best_eplb = min(("eplb", "eplb_global"), key=lambda c: score[c])

    def no_slower_link(c: str) -> bool:  # all-to-all time no worse than the EPLB it would replace
        return len(a2a) < len(CANDIDATES) or not a2a[c] > a2a[best_eplb] * (1.0 + A2A_TOLERANCE)

    free_pays = score["joint_free"] < score[best_eplb] * (1.0 - min_placement_gain)
    best_free = "joint_free" if free_pays and no_slower_link("joint_free") else best_eplb
    router_pays = score["joint"] < score[best_free] * (1.0 - min_router_gain)
    choice = "joint" if router_pays and no_slower_link("joint") else best_free
    # candidates that paid in MoE-layer time but were refused for sending slower than EPLB
    refused = [c for c, pays in (("joint_free", free_pays), ("joint", router_pays)) if pays and not no_slower_link(c)]
    # an EPLB choice refitted on every training request (the same placement as the strategy's own row);
    # a joint choice served as the placement the validation split scored, unless refit_joint
    if choice in ("joint", "joint_free"):
        chosen, joint_extra = build_joint(x) if refit_joint else (joint_pl, joint_extra)
        extra = dict(joint_extra)
    else:
        groups, nodes = (x.router_groups, x.num_nodes) if choice == "eplb" else (1, 1)
        chosen = rebalance(x.load_LE, num_groups=groups, num_nodes=nodes, **shape) if refit else placements[choice]
        policy = "hierarchical" if choice == "eplb" and x.router_groups % x.num_nodes == 0 else "global"
        extra = {"eplb_num_groups": groups, "eplb_policy": policy, "eplb_sum": "float64"}
    extra.update(
        {
            "router_price": joint_extra["router_price"],  # read only when served with the router
            "ours_refitted": bool(refit_joint if choice in ("joint", "joint_free") else refit),
            "ours_choice": choice,
            "served_router": "price" if choice == "joint" else "none",
            "ours_measure": measure,
            "ours_validation": {c: round(float(v), 6) for c, v in score.items()},
            **({"ours_validation_a2a": {c: round(v, 6) for c, v in a2a.items()}} if a2a else {}),
            **({"ours_refused_slower_a2a": refused} if refused else {}),
            **({"ours_validation_detail": detail} if detail else {}),
            "ours_validation_requests": int(len(val)),
            "ours_router_gain": round(float(1.0 - score["joint"] / score["joint_free"]), 6),
            "ours_router_gain_over_best_free": round(float(1.0 - score["joint"] / score[best_free]), 6),
        }
    )
    return chosen, extra
