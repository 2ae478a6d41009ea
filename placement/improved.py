"""moetrace's improved placer: the group-membership problem solved exactly, then load-aware GPUs.

The core paper's phase 1 is greedy. What the simulator measures (inter-node volume with requests
routed to their group) is, to first order, the usage mass a group finds on its own node: every
routed (token, expert) pair whose expert is not on the token's node crosses the network. Maximizing
``sum_g sum_e usage[g, e] * member[g, e]`` subject to exactly J slots per group and every expert in
at least one group is a bipartite b-matching with a coverage constraint; its constraint matrix is
totally unimodular, so the LP optimum (HiGHS) is integral and optimal. Ties are broken towards
experts with more overall load via a tiny perturbation, so the solution is deterministic. GPUs
inside a node are then filled as in the data placer (balanced packing of expected load).

Shape legend (docs/architecture.md): G node groups (= nodes), L MoE layers, E logical experts,
P physical slots, J slots of one node group (P / G).

Out of scope: clustering requests (``grouping``); second-order effects (two experts of one token on
the same remote GPU cost one copy, not two).
"""

from __future__ import annotations

import numpy as np

from moetrace._deps import require
from moetrace.placement.data_placement import check_usage, place_members, verify_members
from moetrace.placement.maps import Placement

__all__ = ["improved_placement", "optimal_members"]


def optimal_members(usage_GLE: np.ndarray, *, num_slots: int) -> np.ndarray:
    """Membership ``member_LGE`` (bool [L, G, E]) maximizing group-local usage, J per group."""
    G, L, E, J = check_usage(np.asarray(usage_GLE), num_slots, 1)
    optimize = require("scipy.optimize", purpose="the improved placer's exact assignment")
    sparse = require("scipy.sparse", purpose="the improved placer's exact assignment")
    u = np.transpose(np.asarray(usage_GLE, dtype=np.float64), (1, 0, 2))  # [L, G, E]
    # constraints over x[g, e] (flattened g-major): sum_e x = J per group; -sum_g x <= -1 per expert
    gi = np.repeat(np.arange(G), E)
    ei = np.tile(np.arange(E), G)
    A_eq = sparse.csr_matrix((np.ones(G * E), (gi, np.arange(G * E))), shape=(G, G * E))
    A_ub = sparse.csr_matrix((-np.ones(G * E), (ei, np.arange(G * E))), shape=(E, G * E))
    member = np.zeros((L, G, E), dtype=bool)
    for l in range(L):
        scale = max(u[l].max(), 1.0)
        tie = 1e-6 * (u[l].sum(0) / scale)[None, :] * np.ones((G, 1))  # prefer heavy experts on ties
        c = -(u[l] / scale + tie).reshape(-1)
        res = optimize.linprog(
            c, A_ub=A_ub, b_ub=-np.ones(E), A_eq=A_eq, b_eq=np.full(G, J), bounds=(0, 1), method="highs-ds"
        )
        if res.status != 0:
            raise AssertionError(f"layer {l}: assignment LP failed ({res.message})")
        x = res.x.reshape(G, E)
        if np.abs(x - np.round(x)).max() > 1e-6:
            raise AssertionError(f"layer {l}: assignment LP returned a fractional vertex")
        member[l] = x > 0.5
    verify_members(member, J)
    return member


def improved_placement(usage_GLE: np.ndarray, *, num_slots: int, ranks_per_group: int) -> Placement:
    """Exact group membership + balanced GPUs; group g owns slots [g*J, (g+1)*J).

    ``usage_GLE``: float [G, L, E] decode tokens per group, layer and expert (training requests).
    """
    return place_members(usage_GLE, optimal_members, num_slots=num_slots, ranks_per_group=ranks_per_group)
