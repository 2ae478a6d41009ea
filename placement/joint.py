"""moetrace's joint placer: request→node routing and expert membership optimised together.

What ``simulate`` (and ``moetrace a2a``) measures is, to first order, the share of a request's
routed (token, expert) pairs whose expert is not on the node serving the request. That depends on
two decisions at once: which node a request is sent to, and which experts each node holds. The
core paper fixes the first by K-means on decode vectors and a nearest-centroid router, then places
experts for those groups. Here both are optimised against the same objective, by alternation:

1. *Membership step* (exact): given the groups, each node's J = P/G experts per layer maximise the
   group's decode usage found on its own node, every expert placed at least once. This is the
   improved placer's b-matching LP (``improved.optimal_members``; integral, HiGHS). With redundant
   slots (J > E/G) heavily shared experts are replicated on the nodes that use them.
2. *Routing step* (exact): given the membership, each request's score for node g is the share of its
   *prefill* expert activations that node g holds (``route_RLE``: what a serving-time router sees).
   Requests are assigned to nodes maximising the total score with every node taking at most
   ``(1 + balance_slack) * R / G`` requests: a transportation LP (integral, HiGHS). Its dual prices
   ``price_G`` turn it into an online router: a new request goes to ``argmax_g score_g - price_g``,
   which reproduces the balanced assignment without seeing other requests.

Each request weighs the same in both steps (counts are divided by the request's own total), because
a decode step batches one token per running request whatever its length. The alternation starts
from a given assignment (the K-means groups) and keeps the iterate with the best training objective
(decode usage found locally under the prefill routing), so it is never worse than its start.

Cross-layer affinity enters through the routing: a request is sent to the node holding its experts
across all layers at once. Token-level affinity (layer l's expert predicting layer l+1's) would save
traffic only in an engine where a token moves with its experts; in expert-parallel decode every
layer dispatches from the token's own GPU, so it is not modelled here.

Shape legend (docs/architecture.md): R requests, L MoE layers, E logical experts, G node groups
(= nodes), P physical slots, J slots of one node group (P / G).

*Router groups kept whole* (``router_groups``, strategy ``joint_aligned``): for a group-limited
router (DeepSeek-V3: a token's experts come from at most 4 of 8 groups of consecutive ids) the
membership step places whole groups (``aligned_members``), so a token meets at most ``topk_group``
nodes; routing and prices are unchanged.

Out of scope: second-order effects of rank dedup (two experts of one token on one remote GPU cost
one copy); the GPUs inside a node (``data_placement.spread_in_nodes``); simulating traffic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from moetrace._deps import require
from moetrace.errors import ConfigError
from moetrace.placement.cost import ExpertCompute, Links
from moetrace.placement.data_placement import check_usage, expected_slot_load, spread_in_nodes
from moetrace.placement.expert_layout import choose_layouts
from moetrace.placement.improved import fixed_constraint_lp, optimal_members
from moetrace.placement.maps import Placement, placement_from_phy2log
from moetrace.placement.step_search import expected_step_seconds, improve_layout

if TYPE_CHECKING:
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "JointPlacement",
    "joint_placement",
    "aligned_members",
    "aligned_router_groups",
    "require_aligned",
    "local_share_ceiling",
    "node_scores",
    "balanced_assign",
    "balanced_constraints",
    "route_requests",
    "node_capacity",
    "effective_node_load_limit",
    "group_usage",
    "members_of_placement",
]

#: rows converted to float at a time (bounds memory on [R, L, E] count arrays)
_CHUNK_ROWS = 1024
#: the most bytes of per-request shares (float32 [rows, L*E], decode and routing each) the joint placer holds
#: across its iterations instead of recomputing them per call (DeepSeek-V3: 800 training requests, 48 MB)
_HELD_SHARES_BYTES = 128 << 20


@dataclass(frozen=True, kw_only=True)
class JointPlacement:
    """The joint placer's output."""

    placement: Placement  # expert slots; group g owns slots [g*J, (g+1)*J)
    member_LGE: np.ndarray  # bool [L, G, E]: node g holds expert e at layer l
    price_G: np.ndarray  # float64 [G]: the router's per-node price (route_requests)
    group_R: np.ndarray  # int64 [R]: node of each training request (rows order)
    objective_history: list[float]  # training objective per iteration (local decode share, mean per request)
    num_iters: int  # iterations run (the best iterate is returned)
    # the GPU-balance search's expected busiest-GPU link time after / before it (training requests, re-routed);
    # None when it did not run (``links`` None)
    layout_gain: float | None = None
    # layers whose GPUs were laid out by expected expert seconds (``expert_layout``); None: not asked
    layers_spread_by_experts: int | None = None


def _shares(x_RLE: np.ndarray, rows: np.ndarray, lo: int, dtype: type = np.float32) -> np.ndarray:
    """Rows ``rows[lo:lo+chunk]`` of ``x_RLE`` as ``dtype`` [n, L*E], each divided by its own total."""
    c = x_RLE[rows[lo : lo + _CHUNK_ROWS]].reshape(min(_CHUNK_ROWS, len(rows) - lo), -1).astype(dtype)
    tot = c.sum(1, keepdims=True)
    return np.divide(c, tot, out=c, where=tot > 0)


def row_shares(x_RLE: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Every selected row's activation shares, float32 [len(rows), L*E]: ``_shares``' chunks, stacked (the
    same values: each row is divided by its own total)."""
    out = np.empty((len(rows), x_RLE.shape[1] * x_RLE.shape[2]), dtype=np.float32)
    for lo in range(0, len(rows), _CHUNK_ROWS):
        out[lo : lo + _CHUNK_ROWS] = _shares(x_RLE, rows, lo)
    return out


def node_scores(
    x_RLE: np.ndarray, member_LGE: np.ndarray, *, rows: np.ndarray | None = None, shares_NF: np.ndarray | None = None
) -> np.ndarray:
    """Share of each request's expert activations held by each node, float64 [len(rows), G] in [0, 1].

    ``x_RLE``: token counts [R, L, E] (any numeric dtype; prefill counts for a router, decode counts
    to measure); ``member_LGE``: bool [L, G, E]. A request with no activations scores 0 everywhere.
    ``shares_NF``: ``row_shares(x_RLE, rows)`` when the caller holds them (None: a chunk at a time).
    """
    rows = np.arange(x_RLE.shape[0]) if rows is None else np.asarray(rows)
    L, G, E = member_LGE.shape
    m_FG = np.ascontiguousarray(np.transpose(member_LGE, (0, 2, 1)).reshape(L * E, G), dtype=np.float32)
    out = np.empty((len(rows), G))
    for lo in range(0, len(rows), _CHUNK_ROWS):
        s = _shares(x_RLE, rows, lo) if shares_NF is None else shares_NF[lo : lo + _CHUNK_ROWS]
        out[lo : lo + _CHUNK_ROWS] = s @ m_FG
    return out


def local_share_ceiling(x_RLE: np.ndarray, *, num_node_slots: int, rows: np.ndarray | None = None) -> float:
    """The most any node holding ``num_node_slots`` experts per layer can serve locally, on average:
    the mean over requests of the share of each one's activations taken by its own
    ``num_node_slots`` most-used experts of every layer (each request weighs 1; requests without
    activations are left out), float in [0, 1]. ``x_RLE``: token counts [R, L, E], any numeric dtype.
    """
    rows = np.arange(x_RLE.shape[0]) if rows is None else np.asarray(rows)
    R, L, E = x_RLE.shape
    J = num_node_slots
    total, n = 0.0, 0
    for lo in range(0, len(rows), _CHUNK_ROWS):
        s = _shares(x_RLE, rows, lo, np.float64).reshape(-1, L, E)
        total += float(np.partition(s, E - J, axis=2)[:, :, E - J :].sum())
        n += int((s.sum(axis=(1, 2)) > 0).sum())
    return total / max(n, 1)


def group_usage(
    x_RLE: np.ndarray,
    group_N: np.ndarray,
    *,
    num_groups: int,
    rows: np.ndarray | None = None,
    shares_NF: np.ndarray | None = None,
) -> np.ndarray:
    """Per node, the sum of its requests' activation shares, float64 [G, L, E] (each request weighs 1).

    ``group_N``: int [len(rows)] node of each selected row; ``shares_NF``: ``row_shares(x_RLE, rows)`` when
    the caller holds them (None: a chunk at a time).
    """
    rows = np.arange(x_RLE.shape[0]) if rows is None else np.asarray(rows)
    R, L, E = x_RLE.shape
    out = np.zeros((num_groups, L * E))
    for lo in range(0, len(rows), _CHUNK_ROWS):
        s = _shares(x_RLE, rows, lo) if shares_NF is None else shares_NF[lo : lo + _CHUNK_ROWS]
        g = np.asarray(group_N[lo : lo + _CHUNK_ROWS])
        for k in np.unique(g):
            out[k] += s[g == k].sum(0, dtype=np.float64)
    return out.reshape(num_groups, L, E)


def balanced_constraints(
    num_requests: int, num_groups: int, *, balance_slack: float = 0.05
) -> tuple[Any, np.ndarray, Any, np.ndarray]:
    """``balanced_assign``'s constraints over the R * G assignment variables (request-major):
    ``(A_ub, b_ub, A_eq, b_eq)``: scipy CSR matrices, int64 upper bounds, float64 ones. Each request on one node
    (``A_eq x = 1``); each node's count at most ``node_capacity(R, G, 1 + slack)`` (rows 0..G-1) and at
    least ``floor((1 - slack) R / G)`` (rows G..2G-1, negated)."""
    sparse = require("scipy.sparse", purpose="the joint placer's balanced routing")
    R, G = num_requests, num_groups
    hi = node_capacity(R, G, 1.0 + balance_slack)  # the router's own cap: integer counts can meet it
    lo = min(int(np.floor((1.0 - balance_slack) * R / G)), R // G)
    cols = np.arange(R * G)
    A_eq = sparse.csr_matrix((np.ones(R * G), (np.repeat(np.arange(R), G), cols)), shape=(R, R * G))
    node = np.tile(np.arange(G), R)
    A_ub = sparse.csr_matrix(
        (
            np.concatenate([np.ones(R * G), -np.ones(R * G)]),
            (np.concatenate([node, G + node]), np.concatenate([cols, cols])),
        ),
        shape=(2 * G, R * G),
    )
    b_ub = np.concatenate([np.full(G, hi), np.full(G, -lo)])
    return A_ub, b_ub, A_eq, np.ones(R)


def balanced_assign(score_RG: np.ndarray, *, balance_slack: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Assign every request to one node, maximising the total score, every node taking between
    ``floor((1 - slack) R / G)`` and ``node_capacity(R, G, 1 + slack)`` requests: ``(group_R int64 [R],
    price_G float64 [G])``.

    A transportation LP (HiGHS), integral at its optimum because its constraint matrix is totally
    unimodular. ``price_G`` (score units) is the net dual of each node's two capacity constraints:
    ``argmax_g score - price`` gives the same assignment up to ties (``route_requests``); a node in
    demand has a positive price, one that must be filled a negative one.
    """
    s = np.asarray(score_RG, dtype=np.float64)
    R, G = s.shape
    if R == 0:
        return np.zeros(0, np.int64), np.zeros(G)
    A_ub, b_ub, A_eq, b_eq = balanced_constraints(R, G, balance_slack=balance_slack)
    # interior point + crossover: a vertex, 2x faster than simplex here (linprog's answer, without its overhead)
    res = fixed_constraint_lp(A_ub, b_ub, A_eq, b_eq, bounds=(0, 1), method="highs-ipm")(-s.reshape(-1))
    if res.status != 0 or res.x is None or res.ineqlin_marginals is None:
        raise AssertionError(f"balanced routing LP failed ({res.message})")
    group_R = np.argmax(res.x.reshape(R, G), axis=1).astype(np.int64)
    marg = -res.ineqlin_marginals  # >= 0: duals of the upper, then the lower bounds
    return group_R, marg[:G] - marg[G:]


def node_capacity(num_requests: int, num_nodes: int, max_node_load: float) -> int:
    """Requests one node may take of ``num_requests`` routed together: ``max_node_load`` times an even
    share, rounded down, but never below the even share rounded up (integer counts must be able to
    meet the limit: 9 requests on 8 nodes put 2 on one node, whatever the limit)."""
    even = num_requests / num_nodes
    return max(-(-num_requests // num_nodes), int(np.floor(max_node_load * even + 1e-9)))


def effective_node_load_limit(num_requests: int, num_nodes: int, max_node_load: float) -> float:
    """The node load (busiest node's requests over an even share) that ``node_capacity`` allows:
    ``max_node_load``, or more when integer counts cannot meet it (``ceil(R / G) / (R / G)``)."""
    if num_requests <= 0:
        return max_node_load
    return max(max_node_load, -(-num_requests // num_nodes) * num_nodes / num_requests)


def route_requests(score_RG: np.ndarray, price_G: np.ndarray, *, max_node_load: float | None = None) -> np.ndarray:
    """The router: each request to ``argmax_g score_RG[r, g] - price_G[g]``, int64 [R].

    With ``max_node_load`` the requests routed together (the requests in flight: compare's held-out
    set, a serving router's admission window) are assigned at once, maximising the summed net score
    with no node over ``node_capacity(R, G, max_node_load)`` requests: a transportation problem,
    solved exactly (its LP has integral vertices). The result does not depend on the order the
    requests arrive in (shuffled or in single-domain bursts) beyond ties, and no node exceeds the
    limit that ``effective_node_load_limit`` states."""
    net_RG = np.asarray(score_RG, dtype=np.float64) - np.asarray(price_G, dtype=np.float64)[None, :]
    if max_node_load is None:
        return np.argmax(net_RG, axis=1).astype(np.int64)
    R, G = net_RG.shape
    if R == 0:
        return np.zeros(0, dtype=np.int64)
    cap = node_capacity(R, G, max_node_load)
    best = np.argmax(net_RG, axis=1)
    if np.bincount(best, minlength=G).max() <= cap:  # the unconstrained choice already fits
        return best.astype(np.int64)
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix, vstack

    rows = np.repeat(np.arange(R), G)
    cols = np.arange(R * G)
    a_eq = coo_matrix((np.ones(R * G), (rows, cols)), shape=(R, R * G))
    a_ub = coo_matrix((np.ones(R * G), (np.tile(np.arange(G), R), cols)), shape=(G, R * G))
    # ties broken towards lower node ids, so equal inputs in any order give equal loads
    c = -(net_RG - 1e-9 * np.arange(G)[None, :]).reshape(-1)
    res = linprog(
        c,
        A_ub=vstack([a_ub]).tocsr(),
        b_ub=np.full(G, float(cap)),
        A_eq=a_eq.tocsr(),
        b_eq=np.ones(R),
        bounds=(0.0, 1.0),
        method="highs",
    )
    if res.status != 0:  # cannot happen: the capacities hold every request (cap * G >= R)
        raise RuntimeError(f"capacity-constrained routing failed: {res.message}")
    x_RG = res.x.reshape(R, G)
    out = np.argmax(x_RG, axis=1).astype(np.int64)
    # a fractional vertex (numerical ties) could leave a node one over: move the cheapest extras
    counts = np.bincount(out, minlength=G)
    for g in np.flatnonzero(counts > cap):
        mine = np.flatnonzero(out == g)
        for r in mine[np.argsort(x_RG[mine, g])][: counts[g] - cap]:
            room = np.flatnonzero(np.bincount(out, minlength=G) < cap)
            out[r] = room[np.argmax(net_RG[r, room])]
    return out


def members_of_placement(placement: Placement, *, num_groups: int, num_experts: int) -> np.ndarray:
    """Which experts each node holds, bool [L, G, E] (node g = slots [g*P/G, (g+1)*P/G))."""
    L, P = placement.phy2log.shape
    member = np.zeros((L, num_groups, num_experts), dtype=bool)
    node_P = np.arange(P) // (P // num_groups)
    for l in range(L):
        member[l, node_P, placement.phy2log[l]] = True
    return member


def aligned_router_groups(model: ModelInfo, *, num_nodes: int) -> int | None:
    """``model.n_group`` when its router is group-limited (``topk_group < n_group``) and its groups can
    fill whole nodes (``n_group`` a multiple of ``num_nodes``); else None."""
    n = model.n_group
    return n if model.group_limited and n is not None and n % num_nodes == 0 else None


def require_aligned(model: ModelInfo, *, num_nodes: int) -> int:
    """``aligned_router_groups`` or a ``ConfigError`` saying why the groups cannot be kept whole and
    what to use instead."""
    rg = aligned_router_groups(model, num_nodes=num_nodes)
    if rg is not None:
        return rg
    if not model.group_limited:
        why = f"{model.name}'s router is not group-limited (no n_group/topk_group limit in its config)"
    else:
        why = (
            f"{model.name}'s {model.n_group} router groups cannot fill {num_nodes} nodes whole "
            f"(n_group must be a multiple of the node count)"
        )
    raise ConfigError(
        f"strategy joint_aligned keeps a group-limited router's expert groups whole on nodes, but {why}; "
        "use the strategy `joint` instead"
    )


def aligned_members(usage_GLE: np.ndarray, *, num_slots: int, router_groups: int) -> np.ndarray:
    """Membership keeping a group-limited router's expert groups whole: bool [L, G, E].

    The router's ``router_groups`` groups (consecutive ids, E / router_groups experts each) go to the
    nodes ``router_groups / G`` per node, each group to exactly one node, maximising the group usage
    found on its node (the same exact LP as ``optimal_members``, over groups instead of experts). A
    token then meets at most ``topk_group`` nodes, as under the router's own node limit. Redundant
    slots (J > E / G) take the node's most-used experts it does not hold yet.
    """
    u = np.asarray(usage_GLE, dtype=np.float64)
    G, L, E = u.shape
    J = num_slots // G
    if router_groups < 2 or E % router_groups or router_groups % G:
        raise ConfigError(
            f"keeping the router's expert groups whole needs a group-limited router whose groups fill whole nodes: "
            f"{router_groups} group(s) of {E} experts over {G} nodes (n_group must be a multiple of the node count); "
            "use the strategy `joint` instead"
        )
    size = E // router_groups
    group_member = optimal_members(u.reshape(G, L, router_groups, size).sum(3), num_slots=router_groups)  # [L, G, H]
    member = np.repeat(group_member, size, axis=2)  # [L, G, E]
    extra = J - E // G
    if extra > 0:
        gain = np.where(member, -np.inf, np.transpose(u, (1, 0, 2)))  # [L, G, E]: usage of the experts a node lacks
        top = np.argsort(-gain, axis=2, kind="stable")[:, :, :extra]
        np.put_along_axis(member, top, True, axis=2)
    return member


def joint_placement(
    decode_RLE: np.ndarray,
    route_RLE: np.ndarray,
    *,
    init_group_R: np.ndarray,
    num_groups: int,
    num_slots: int,
    ranks_per_group: int,
    rows: np.ndarray | None = None,
    num_iters: int = 8,
    balance_slack: float = 0.05,
    tol: float = 1e-4,
    router_groups: int | None = None,
    links: Links | None = None,
    expert: ExpertCompute | None = None,
    copies_per_step: float = 0.0,
    copy_bytes: float = 0.0,
) -> JointPlacement:
    """Alternate exact membership and balanced routing from ``init_group_R``; the best iterate.

    ``decode_RLE``: decode token counts [R, L, E] (what the placement serves); ``route_RLE``: the
    counts the router sees (prefill at serving time; decode for the perfect-routing oracle); both any
    numeric dtype. ``rows``: the requests to use (default all); ``init_group_R``: int [len(rows)]
    their starting nodes in 0..``num_groups``-1. Stops after ``num_iters`` iterations, when the
    routing no longer changes, or when the objective (mean local decode share, in [0, 1]) gained
    less than ``tol``. ``router_groups``: keep a group-limited router's expert groups whole on nodes
    (``aligned_members``) instead of choosing every expert's node freely (None). With ``links``,
    ``expert`` (the routed experts' cost), ``copies_per_step`` (decode (token, expert) copies of one
    step) and ``copy_bytes`` (one dispatch plus one combine copy) each layer keeps, of its link-balanced
    layout and the same nodes' experts spread by expected expert seconds, the one with the lower
    expected MoE-layer time (``expert_layout.choose_layouts``).
    """
    rows = np.arange(decode_RLE.shape[0]) if rows is None else np.asarray(rows)
    group = np.asarray(init_group_R, dtype=np.int64)
    if len(group) != len(rows):
        raise ConfigError(f"init_group_R has {len(group)} entries for {len(rows)} requests")
    G = num_groups
    if num_iters < 1:
        raise ConfigError(f"num_iters must be at least 1, got {num_iters}")
    if len(group) == 0 or group.min() < 0 or group.max() >= G:
        raise ConfigError(f"init_group_R must hold nodes 0..{G - 1} for at least one training request")
    check_usage(np.zeros((G, 1, decode_RLE.shape[2])), num_slots, ranks_per_group)
    history: list[float] = []
    best = None
    # each iteration reads the same rows' shares: held once where they fit, else a chunk at a time per call
    held = len(rows) * decode_RLE.shape[1] * decode_RLE.shape[2] * 4 <= _HELD_SHARES_BYTES
    dec_NF = row_shares(decode_RLE, rows) if held else None
    route_NF = (dec_NF if route_RLE is decode_RLE else row_shares(route_RLE, rows)) if held else None
    usage_GLE = group_usage(decode_RLE, group, num_groups=G, rows=rows, shares_NF=dec_NF)
    for _ in range(num_iters):
        member = (
            optimal_members(usage_GLE, num_slots=num_slots)
            if router_groups is None
            else aligned_members(usage_GLE, num_slots=num_slots, router_groups=router_groups)
        )
        scores = node_scores(route_RLE, member, rows=rows, shares_NF=route_NF)
        routed, price = balanced_assign(scores, balance_slack=balance_slack)
        routed_usage = group_usage(decode_RLE, routed, num_groups=G, rows=rows, shares_NF=dec_NF)
        # training objective: the decode share a request finds on the node the router sends it to,
        # averaged over requests (each request's shares sum to 1 over all layers and experts)
        obj = float(sum((routed_usage[g] * member[:, g, :]).sum() for g in range(G)) / len(rows))
        history.append(obj)
        improved = best is None or obj > best[0] + tol
        if best is None or obj > best[0]:
            best = (obj, member, routed_usage, price, routed)
        if not improved or np.array_equal(routed, group):
            break
        group, usage_GLE = routed, routed_usage
    assert best is not None  # num_iters >= 1 and the first iterate is always kept
    obj, member, usage_GLE, price, group = best
    E = decode_RLE.shape[2]
    phy2log = spread_in_nodes(member, expected_slot_load(member, usage_GLE), ranks_per_group=ranks_per_group)
    placement, gain, layers_spread = placement_from_phy2log(phy2log, num_experts=E), None, None
    if links is not None:  # the busiest GPU charged: slots moved to lower the expected link time, then re-routed
        W = G * ranks_per_group
        before = expected_step_seconds(phy2log, usage_GLE, num_ranks=W, links=links)
        phy2log = improve_layout(phy2log, usage_GLE, num_ranks=W, links=links, across_nodes=router_groups is None)
        placement = placement_from_phy2log(phy2log, num_experts=E)
        member = members_of_placement(placement, num_groups=G, num_experts=E)  # the membership the moves left
        scores = node_scores(route_RLE, member, rows=rows, shares_NF=route_NF)
        group, price = balanced_assign(scores, balance_slack=balance_slack)
        usage_GLE = group_usage(decode_RLE, group, num_groups=G, rows=rows, shares_NF=dec_NF)  # the re-fitted router's
        after = expected_step_seconds(phy2log, usage_GLE, num_ranks=W, links=links)
        gain = after / before if before > 0 else None
        if expert is not None and copies_per_step > 0 and copy_bytes > 0:
            phy2log, layers_spread = choose_layouts(
                phy2log,
                member,
                usage_GLE,
                ranks_per_group=ranks_per_group,
                links=links,
                expert=expert,
                copies_per_step=copies_per_step,
                copy_bytes=copy_bytes,
            )
            placement = placement_from_phy2log(phy2log, num_experts=E)  # same nodes: routing and prices hold
    return JointPlacement(
        placement=placement,
        member_LGE=member,
        price_G=price,
        group_R=group,
        objective_history=history,
        num_iters=len(history),
        layout_gain=gain,
        layers_spread_by_experts=layers_spread,
    )
