"""The GPUs inside each node charged for their experts, not only their links: a layer's layout chosen
by its expected MoE-layer time (dispatch + the busiest GPU's experts + combine).

``step_search.improve_layout`` arranges slots to lower the busiest GPU's expected link time. In
memory-bound decode a GPU's expert time is the weights it reads: one expert's bytes for every
expert that at least one token of the step activates (``cost.ExpertCompute``). A layout balanced
for links can stack a node's popular experts on one GPU, which then reads most of them every
step (Llama-4-Maverick's experts are 252 MB each: its decode step is nine tenths expert reads).

For each layer this module builds a second layout with the same node membership (so the router
and every copy's node are unchanged): each node's experts spread over its GPUs by balanced packing
of their expected expert seconds per step, ``max(P(activated) x read seconds, tokens x seconds per
token)``, where a copy of expert ``e`` on node ``g`` expects ``lambda`` tokens per step
(``data_placement.expected_slot_load`` scaled to the step's copies) and is activated with
probability ``1 - exp(-lambda)`` (tokens arrive as a Poisson stream). It keeps, per layer, the layout
with the lower expected MoE-layer time: ``link time x bytes of a dispatch and a combine copy +
max over GPUs of the summed expert seconds``.

Shape legend (docs/architecture.md): G node groups (= nodes), L MoE layers, E logical experts,
P physical slots, J slots of one node, W EP ranks (GPUs).

Out of scope: the variance of the busiest GPU (expectations per GPU, then their maximum); the
shared experts (the same on every GPU whatever the layout); prefill (compute-bound and charged by
the simulator; the weights here are decode's).
"""

from __future__ import annotations

import numpy as np

from moetrace.placement.cost import ExpertCompute, Links
from moetrace.placement.data_placement import expected_slot_load, spread_in_nodes
from moetrace.placement.step_search import layer_link_times, slot_flows_PG

__all__ = ["expert_seconds_LGE", "layer_moe_seconds", "choose_layouts"]


def expert_seconds_LGE(
    member_LGE: np.ndarray, usage_GLE: np.ndarray, *, copies_per_step: float, expert: ExpertCompute
) -> np.ndarray:
    """Expected seconds per decode step of each node's copy of each expert, float64 [L, G, E] (0 where
    the node holds none): ``usage_GLE`` (any positive scale per layer) rescaled so that a layer's
    copies sum to ``copies_per_step``."""
    load_LGE = expected_slot_load(member_LGE, usage_GLE)  # same-node-first, in usage units
    total_L = np.asarray(usage_GLE, dtype=np.float64).sum(axis=(0, 2))
    lam_LGE = load_LGE * (copies_per_step / np.maximum(total_L, 1e-300))[:, None, None]
    memory = (1.0 - np.exp(-lam_LGE)) * (expert.weight_bytes / expert.hbm_bytes_per_s)
    compute = lam_LGE * (expert.flops_per_token / expert.peak_flops)
    return np.where(member_LGE, np.maximum(memory, compute), 0.0)


def layer_moe_seconds(
    phy2log_P: np.ndarray,
    u_GE: np.ndarray,
    seconds_GE: np.ndarray,
    *,
    num_ranks: int,
    links: Links,
    copy_scale: float,
) -> float:
    """One layer's expected MoE seconds per step under ``phy2log_P`` (int [P]): its busiest GPU's link
    time (``u_GE`` float [G, E] copies per step, ``copy_scale``: bytes of a dispatch plus a combine
    copy) plus its busiest GPU's summed expert seconds (``seconds_GE``: per node's copy)."""
    P = len(phy2log_P)
    G = u_GE.shape[0]
    gpu_P = np.arange(P) // (P // num_ranks)
    link = layer_link_times(slot_flows_PG(phy2log_P, u_GE), gpu_P, num_ranks=num_ranks, num_nodes=G, links=links)
    node_P = np.arange(P) // (P // G)
    busy = np.bincount(gpu_P, seconds_GE[node_P, phy2log_P], num_ranks).max()
    return float(link.t_W.max() * copy_scale + busy)


def choose_layouts(
    phy2log_LP: np.ndarray,
    member_LGE: np.ndarray,
    usage_GLE: np.ndarray,
    *,
    ranks_per_group: int,
    links: Links,
    expert: ExpertCompute,
    copies_per_step: float,
    copy_bytes: float,
) -> tuple[np.ndarray, int]:
    """``phy2log_LP`` (int [L, P], node membership ``member_LGE``) with each layer's slots re-spread
    inside their nodes by expected expert seconds where that lowers the layer's expected MoE seconds
    (module docstring); and the number of layers changed. Nodes must hold distinct experts (a node
    holding one expert twice is left as it is). ``usage_GLE``: float [G, L, E] decode copies
    per node (any positive scale per layer); ``copy_bytes``: bytes of one dispatch plus one combine copy."""
    phy = np.asarray(phy2log_LP, dtype=np.int64)
    L, P = phy.shape
    G = member_LGE.shape[1]
    if not (np.asarray(member_LGE).sum(axis=2) == P // G).all():  # a node holding an expert twice: not a membership
        return phy.copy(), 0
    W = G * ranks_per_group
    sec_LGE = expert_seconds_LGE(member_LGE, usage_GLE, copies_per_step=copies_per_step, expert=expert)
    spread = spread_in_nodes(member_LGE, sec_LGE, ranks_per_group=ranks_per_group)
    u = np.asarray(usage_GLE, dtype=np.float64)
    total_L = u.sum(axis=(0, 2))
    out = phy.copy()
    changed = 0
    for l in range(L):
        u_GE = u[:, l, :] * (copies_per_step / max(total_L[l], 1e-300))
        kw = dict(num_ranks=W, links=links, copy_scale=copy_bytes)
        if layer_moe_seconds(spread[l], u_GE, sec_LGE[l], **kw) < layer_moe_seconds(phy[l], u_GE, sec_LGE[l], **kw):
            out[l] = spread[l]
            changed += 1
    return out, changed
