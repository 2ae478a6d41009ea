"""The core paper's data-based expert placement (§4.2): two phases per layer, then verification.

Each of the G expert groups (one per node) holds exactly J = P/G slots. Group usage
``usage_GLE[g, l, e]`` = decode tokens of the training requests assigned to group g that layer l
routed to expert e. Phase 1 places every expert once: all (group, expert) pairs are visited by
descending usage and an unplaced expert goes to the group if it holds fewer than ceil(E/G) unique
experts (the max-unique bound; the min follows because every expert must land somewhere). Phase 2
fills each group's remaining slots with the experts it uses most that it lacks (redundant
replicas). Sizes are exact by construction; coverage and sizes are then verified. Inside a node the
J experts are spread over its GPUs by balanced packing on their expected token load (EPLB's
``balanced_packing``), so memory (slots) is equal per GPU and token load is balanced.

Shape legend (docs/architecture.md): G node groups (= nodes), L MoE layers, E logical experts,
P physical slots, J slots of one node group (P / G).

Out of scope: clustering requests into groups (``grouping``), the improved placer (``improved``).
"""

from __future__ import annotations

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.eplb import balanced_packing
from moetrace.placement.maps import Placement, placement_from_phy2log

__all__ = [
    "data_placement",
    "two_phase_members",
    "spread_in_nodes",
    "expected_slot_load",
    "place_members",
    "check_usage",
    "verify_members",
]


def check_usage(usage_GLE: np.ndarray, num_slots: int, ranks_per_group: int) -> tuple[int, int, int, int]:
    """``(G, L, E, J)`` of a membership problem: ``usage_GLE`` [G, L, E] over ``num_slots`` slots per layer
    on ``ranks_per_group`` GPUs per group, J = ``num_slots`` / G; ``ConfigError`` naming what cannot be placed."""
    if usage_GLE.ndim != 3:
        raise ConfigError(f"usage must be [groups, layers, experts], got shape {usage_GLE.shape}")
    G, L, E = usage_GLE.shape
    if num_slots < E or num_slots % (G * ranks_per_group):
        raise ConfigError(
            f"{num_slots} slots must be >= {E} experts and divide over {G} groups x {ranks_per_group} GPUs"
        )
    if num_slots // G > E:
        raise ConfigError(
            f"each of the {G} groups would hold {num_slots // G} slots but there are only {E} experts; a second copy "
            "of an expert on the same node cannot save inter-node traffic, so lower --redundancy"
        )
    return G, L, E, num_slots // G


def two_phase_members(usage_GLE: np.ndarray, *, num_slots: int) -> np.ndarray:
    """Phases 1 and 2: membership ``member_LGE`` (bool [L, G, E]), exactly J experts per group."""
    G, L, E, J = check_usage(usage_GLE, num_slots, 1)
    u_LGE = np.transpose(np.asarray(usage_GLE, dtype=np.float64), (1, 0, 2))
    max_unique = -(-E // G)
    # Phase 1: visit (group, expert) pairs by descending usage (ties: lower group, then expert)
    order = np.argsort(-u_LGE.reshape(L, G * E), axis=1, kind="stable")
    member = np.zeros((L, G, E), dtype=bool)
    placed = np.zeros((L, E), dtype=bool)
    size = np.zeros((L, G), dtype=np.int64)
    rows = np.arange(L)
    for j in range(G * E):
        g_L, e_L = np.divmod(order[:, j], E)
        ok = ~placed[rows, e_L] & (size[rows, g_L] < max_unique)
        r = rows[ok]
        member[r, g_L[ok], e_L[ok]] = True
        placed[r, e_L[ok]] = True
        size[r, g_L[ok]] += 1
    # Phase 2: most-used missing experts fill the remaining slots (redundant replicas)
    for l in range(L):
        for g in range(G):
            room = J - int(size[l, g])
            if room:
                cand = np.argsort(np.where(member[l, g], np.inf, -u_LGE[l, g]), kind="stable")
                member[l, g, cand[:room]] = True
    verify_members(member, J)
    return member


def verify_members(member_LGE: np.ndarray, J: int) -> None:
    """``AssertionError`` unless every group of ``member_LGE`` (bool [L, G, E]) holds exactly J experts
    and every expert is in a group (a placer's bug, never a user's input)."""
    sizes = member_LGE.sum(-1)
    if not (sizes == J).all():
        raise AssertionError(f"group sizes {np.unique(sizes)} differ from J={J}")
    if not member_LGE.any(1).all():
        raise AssertionError("an expert has no group")


def expected_slot_load(member_LGE: np.ndarray, usage_GLE: np.ndarray) -> np.ndarray:
    """Expected tokens per (layer, group, expert) copy under same-node-first routing, float [L, G, E].

    A group's own tokens use its copy; tokens of groups lacking the expert split evenly over copies.
    """
    u = np.transpose(np.asarray(usage_GLE, dtype=np.float64), (1, 0, 2))
    cnt = member_LGE.sum(1, keepdims=True)
    remote = (u * ~member_LGE).sum(1, keepdims=True)
    return np.where(member_LGE, u + remote / np.maximum(cnt, 1), 0.0)


def spread_in_nodes(member_LGE: np.ndarray, load_LGE: np.ndarray, *, ranks_per_group: int) -> np.ndarray:
    """Order each group's J experts over its GPUs by balanced packing of their load: phy2log [L, P]."""
    L, G, E = member_LGE.shape
    J = int(member_LGE[0, 0].sum())
    per_rank = J // ranks_per_group
    experts = np.argsort(~member_LGE, axis=2, kind="stable")[:, :, :J]  # [L, G, J] members, ascending id
    w = np.take_along_axis(load_LGE, experts, axis=2).reshape(L * G, J)
    pack, rank_in_pack = balanced_packing(w.astype(np.float32), ranks_per_group)
    pos = pack * per_rank + rank_in_pack
    out = np.empty((L * G, J), dtype=np.int64)
    np.put_along_axis(out, pos, experts.reshape(L * G, J), axis=1)
    return out.reshape(L, G * J)


def data_placement(usage_GLE: np.ndarray, *, num_slots: int, ranks_per_group: int) -> Placement:
    """The two-phase data-based placement; group g owns slots [g*J, (g+1)*J) (node g's GPUs).

    ``usage_GLE``: float [G, L, E] decode tokens per group, layer and expert (training requests).
    """
    return place_members(usage_GLE, two_phase_members, num_slots=num_slots, ranks_per_group=ranks_per_group)


def place_members(usage_GLE: np.ndarray, members, *, num_slots: int, ranks_per_group: int) -> Placement:
    """The placement whose group membership is ``members(usage_GLE, num_slots=...)`` (bool [L, G, E]),
    spread over each group's GPUs by expected load; group g owns slots [g*J, (g+1)*J)."""
    G, L, E, J = check_usage(np.asarray(usage_GLE), num_slots, ranks_per_group)
    member = members(usage_GLE, num_slots=num_slots)
    phy2log = spread_in_nodes(member, expected_slot_load(member, usage_GLE), ranks_per_group=ranks_per_group)
    return placement_from_phy2log(phy2log, num_experts=E)
