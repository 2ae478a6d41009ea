"""Data-free placements: vLLM's linear and round-robin strategies, and a seeded random one.

Shape legend (docs/architecture.md): L MoE layers, E logical experts, P physical slots,
W EP ranks.
With redundancy (P > E) the extra slots take experts 0, 1, ... again (linear), cycling
(round robin) or a random permutation, so every expert keeps at least one slot.

Out of scope: load- or data-aware placement (``eplb``, ``data_placement``, ``improved``).
"""

from __future__ import annotations

import numpy as np

from moetrace.placement.maps import Placement, placement_from_phy2log

__all__ = ["linear", "round_robin", "random_placement"]


def linear(*, num_layers: int, num_experts: int, num_slots: int, num_ranks: int) -> Placement:
    """vLLM ``linear``: slot p holds expert p mod E, so expert e sits on rank e // (P/W)."""
    del num_ranks  # slot p is on rank p // (P/W) by convention
    phy2log = np.broadcast_to(np.arange(num_slots) % num_experts, (num_layers, num_slots))
    return placement_from_phy2log(phy2log, num_experts=num_experts)


def round_robin(*, num_layers: int, num_experts: int, num_slots: int, num_ranks: int) -> Placement:
    """vLLM ``round_robin``: expert e on rank e mod W (slot j of rank r holds expert j·W + r)."""
    per_rank = num_slots // num_ranks
    p = np.arange(num_slots)
    logical = (p % per_rank) * num_ranks + p // per_rank  # rank-major slot -> rank-cycling expert
    phy2log = np.broadcast_to(logical % num_experts, (num_layers, num_slots))
    return placement_from_phy2log(phy2log, num_experts=num_experts)


def random_placement(*, num_layers: int, num_experts: int, num_slots: int, num_ranks: int, seed: int) -> Placement:
    """Every expert once plus random extra replicas, shuffled over slots independently per layer."""
    del num_ranks
    rng = np.random.default_rng(seed)
    extra = rng.integers(0, num_experts, size=(num_layers, num_slots - num_experts))
    base = np.concatenate([np.broadcast_to(np.arange(num_experts), (num_layers, num_experts)), extra], axis=1)
    phy2log = rng.permuted(base, axis=1)
    return placement_from_phy2log(phy2log, num_experts=num_experts)
