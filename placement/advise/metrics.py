"""The measures ``moetrace advise`` reports, as pure functions of arrays (no file, no trace).

- **Balancedness** as vLLM defines it (vllm-project/vllm ``vllm/distributed/eplb/eplb_state.py``,
  ``EplbState.step`` with ``log_balancedness`` and ``_compute_eplb_load_stats``): per forward pass,
  ``num_tokens_per_rank`` [L, W] is the (token, expert) pairs each EP rank computes in each MoE
  layer; a layer's balancedness is ``mean_w / max_w``, and the figure vLLM logs for a step is
  ``sum_l mean_w / sum_l max_w`` (1.0: every rank equally loaded). Before ``_compute_eplb_load_stats``
  the same lines reduced the transposed axes (commit 50feac95 of that file); the comment there
  already stated the per-layer definition used here.
- **Send ranks per token** (TensorRT-LLM's wide-EP all-to-all, its "send ranks per token"): the
  distinct EP ranks that serve one token's routed experts in one layer, its own rank included.
- **Rank loads of a profile**: an expert's tokens split evenly over its replicas (what EPLB assumes
  and what vLLM's round robin over replicas does on average), so a window of counts gives each
  rank's load without any token.
- **Expected traffic of a profile** under the per-(token, expert) copy model (``dedup expert``):
  sources spread evenly over the GPUs, so GPU ``w`` receives ``load[w] (W - 1) / W`` copies and
  sends ``sum_{w' != w} load[w'] / W``; activated experts per step under independent arrivals
  (a slot expecting ``m`` pairs in a step is active with probability ``1 - exp(-m)``). The result
  is a ``step_model.GpuTraffic``, priced by the step model's own formulas.
- **Migration**: expert weights that move from one placement to another when EP ranks are relabelled
  to move the fewest: nodes as whole blocks (one relabelling for every layer, so a node-routed
  placement keeps its router), ranks inside a node per layer; both are assignment problems
  (``scipy.optimize.linear_sum_assignment``).
- **Redundancy sweep**: 0, W, 2W, ... redundant slots while ``E + R`` fits the slot limit per GPU.

Shape legend (docs/architecture.md): N rows (windows or steps), B batches (steps), L MoE layers,
E logical experts, P physical slots, W EP ranks (GPUs), G nodes, T tokens, K top-k slots.

Out of scope: choosing placements (``eplb``, ``baselines``, ``joint``), simulating token copies
(``simulate``), the per-step time formulas (``cost``); reading inputs and wording the verdict
(``run``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moetrace.placement.maps import Placement
from moetrace.placement.step_model import GpuTraffic

__all__ = [
    "balancedness",
    "vllm_balancedness",
    "send_ranks_per_token",
    "rank_load_from_ranks",
    "expected_rank_load",
    "expected_active_slots",
    "expected_traffic",
    "Migration",
    "migration",
    "redundancy_sweep",
    "quantiles_over_layers",
]


def balancedness(load_NW: np.ndarray) -> np.ndarray:
    """Per row, mean over ranks / max over ranks of the (token, expert) pairs each rank computes,
    float64 [N] (any leading shape: ``[..., W]`` -> ``[...]``); NaN for a row without tokens."""
    x = np.asarray(load_NW, dtype=np.float64)
    mx = x.max(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mx > 0, x.mean(axis=-1) / np.where(mx > 0, mx, 1.0), np.nan)


def vllm_balancedness(load_BLW: np.ndarray) -> np.ndarray:
    """The figure vLLM logs per step: ``sum_l mean_w / sum_l max_w``, float64 [B]; NaN without tokens."""
    x = np.asarray(load_BLW, dtype=np.float64)
    mean, mx = x.mean(axis=-1).sum(axis=-1), x.max(axis=-1).sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mx > 0, mean / np.where(mx > 0, mx, 1.0), np.nan)


def send_ranks_per_token(rank_TK: np.ndarray, valid_TK: np.ndarray, *, presorted: bool = False) -> np.ndarray:
    """Distinct EP ranks among each token's valid routed entries (its own rank included), int64 [T];
    0 for a token with no recorded id. ``presorted``: each row of ``rank_TK`` is sorted with the
    invalid entries last (saves the sort)."""
    valid = np.asarray(valid_TK, dtype=bool)
    if presorted:
        s, new = np.asarray(rank_TK), valid.copy()
    else:
        s = np.sort(np.where(valid, np.asarray(rank_TK, dtype=np.int64), -1), axis=1)
        new = s >= 0
    new[:, 1:] &= s[:, 1:] != s[:, :-1]
    return new.sum(axis=1).astype(np.int64)


def rank_load_from_ranks(
    rank_TK: np.ndarray, valid_TK: np.ndarray, batch_T: np.ndarray, *, num_batches: int, num_ranks: int
) -> np.ndarray:
    """(token, expert) pairs each rank computes in each batch, float64 [B, W], from the rank serving
    every routed entry (``simulate.layer_copies``' ``rank_TK``)."""
    valid = np.asarray(valid_TK, dtype=bool)
    key = np.asarray(batch_T, dtype=np.int64)[:, None] * num_ranks + np.asarray(rank_TK, dtype=np.int64)
    return np.bincount(key[valid], minlength=num_batches * num_ranks).reshape(num_batches, num_ranks).astype(np.float64)


def _slot_load(counts_NLE: np.ndarray, placement: Placement, slot_share_LP: np.ndarray | None = None) -> np.ndarray:
    """Pairs per physical slot, float64 [N, L, P]: an expert's count split over its replicas by
    ``slot_share_LP`` (float [L, P], each expert's slots summing to 1; None: evenly)."""
    c = np.asarray(counts_NLE, dtype=np.float64)
    L, P = placement.phy2log.shape
    per_slot = np.take_along_axis(c, np.broadcast_to(placement.phy2log[None], (c.shape[0], L, P)), axis=2)
    if slot_share_LP is None:  # divided, as the even split always was (the same floats)
        return per_slot / np.take_along_axis(placement.logcnt, placement.phy2log, axis=1)[None].astype(np.float64)
    return per_slot * np.asarray(slot_share_LP, dtype=np.float64)[None]


def expected_rank_load(
    counts_NLE: np.ndarray, placement: Placement, *, num_ranks: int, slot_share_LP: np.ndarray | None = None
) -> np.ndarray:
    """Each rank's (token, expert) pairs per window, float64 [N, L, W]: ``counts_NLE`` (tokens routed to
    each logical expert per window) split over each expert's replicas (evenly, or by ``slot_share_LP``:
    ``eplb_replicas.slot_shares`` of an engine's replica rule) and summed per rank."""
    slot_NLP = _slot_load(counts_NLE, placement, slot_share_LP)
    N, L, P = slot_NLP.shape
    return slot_NLP.reshape(N, L, num_ranks, P // num_ranks).sum(axis=3)


def expected_active_slots(
    counts_NLE: np.ndarray,
    placement: Placement,
    *,
    num_ranks: int,
    pairs_per_step_N: np.ndarray,
    slot_share_LP: np.ndarray | None = None,
) -> np.ndarray:
    """Expected slots with at least one token in one step, per rank, float64 [N, L, W].

    A window's counts are scaled to a step of ``pairs_per_step_N`` (token, expert) pairs (float [N]);
    a slot expecting ``m`` pairs in that step is active with probability ``1 - exp(-m)`` (independent
    arrivals). Memory-bound decode pays per activated expert (METRO), so a step's activations matter,
    not a window's (where nearly every slot is active). ``slot_share_LP``: as ``expected_rank_load``."""
    slot_NLP = _slot_load(counts_NLE, placement, slot_share_LP)
    N, L, P = slot_NLP.shape
    total_N = slot_NLP.sum(axis=2).mean(axis=1)  # pairs per layer and window
    with np.errstate(invalid="ignore", divide="ignore"):
        scale_N = np.where(total_N > 0, np.asarray(pairs_per_step_N, dtype=np.float64) / total_N, 0.0)
    m = slot_NLP * scale_N[:, None, None]
    return (1.0 - np.exp(-m)).reshape(N, L, num_ranks, P // num_ranks).sum(axis=3)


def expected_traffic(load_NW: np.ndarray, *, ranks_per_node: int) -> GpuTraffic:
    """Copies per GPU under one copy per (token, expert) with sources spread evenly over the GPUs:
    ``step_model.GpuTraffic`` with rows N (every array float64 [N, W]).

    ``load_NW``: (token, expert) pairs each GPU computes. A GPU sends ``load[w'] / W`` copies to every
    other GPU ``w'`` and receives ``load[w] / W`` from each of the others; a peer is counted when
    its copies are not zero."""
    x = np.asarray(load_NW, dtype=np.float64)
    N, W = x.shape
    g = ranks_per_node
    node_sum = x.reshape(N, W // g, g).sum(axis=2)  # [N, G]
    same_node_NW = np.repeat(node_sum, g, axis=1) - x  # pairs on the other GPUs of w's node
    other_NW = x.sum(axis=1, keepdims=True) - x - same_node_NW  # pairs on GPUs of other nodes
    busy = x > 0
    busy_node = np.repeat(busy.reshape(N, W // g, g).sum(axis=2), g, axis=1) - busy  # busy others on the node
    busy_other = busy.sum(axis=1, keepdims=True) - busy - busy_node
    return GpuTraffic(
        send_intra=same_node_NW / W,
        recv_intra=x * (g - 1) / W,
        send_inter=other_NW / W,
        recv_inter=x * (W - g) / W,
        peers_send_intra=busy_node.astype(np.float64),
        peers_recv_intra=np.where(busy, g - 1, 0).astype(np.float64),
        peers_send_inter=busy_other.astype(np.float64),
        peers_recv_inter=np.where(busy, W - g, 0).astype(np.float64),
    )


class Migration(NamedTuple):
    """Experts that move from one placement to another, with the rank relabelling that moves fewest."""

    experts_moved: int  # (layer, expert copy) pairs that must be copied onto a GPU lacking them
    node_of_new_G: np.ndarray  # int64 [G]: the new placement's node g is deployed on current node node_of_new_G[g]
    rank_of_new_LW: np.ndarray  # int64 [L, W]: the new placement's rank w of layer l goes to current rank [l, w]


def _missing_LWW(cur_LWJ: np.ndarray, new_LWK: np.ndarray, num_experts: int) -> np.ndarray:
    """``out[l, u, v]``: experts of new rank ``v`` (a multiset of K ids) that current rank ``u`` lacks in
    layer ``l`` (each extra copy counts), int64 [L, W, W]; ids in 0 .. num_experts - 1.

    The j-th id of ``v``, the o-th copy of its expert within ``v`` (o = 0 for the first), is missing from
    ``u`` when ``u`` holds at most o copies of it: summing that over ``v``'s K ids is the multiset
    difference, without a [W, W, E] table per layer."""
    L, W, J = cur_LWJ.shape
    K = new_LWK.shape[2]
    E = num_experts
    have_LWE = np.bincount((np.arange(L * W).repeat(J) * E + cur_LWJ.reshape(-1)), minlength=L * W * E).reshape(
        L, W, E
    )  # copies of each expert on each current rank
    new_LX = new_LWK.reshape(L, W * K)
    # occurrence index of each new id within its rank: the ids before it in the rank equal to it
    same = new_LWK[:, :, :, None] == new_LWK[:, :, None, :]  # [L, W, K(j), K(i)]
    occ_LX = np.tril(same, k=-1).sum(axis=3).reshape(L, W * K)
    held_LWX = np.take_along_axis(have_LWE, new_LX[:, None, :].repeat(W, axis=1), axis=2)  # [L, W(u), W*K]
    return (held_LWX <= occ_LX[:, None, :]).reshape(L, W, W, K).sum(axis=3)


def migration(
    current_LP: np.ndarray, new_LP: np.ndarray, *, num_ranks: int, ranks_per_node: int, num_experts: int
) -> Migration:
    """The fewest expert copies to move from ``current_LP`` to ``new_LP`` (phy2log, int [L, P] each;
    P may differ: slots per rank are ``P / num_ranks`` of each).

    Moving means: a GPU of the new placement needs an expert its current GPU does not hold (each
    extra copy counts). The new placement's nodes may be relabelled as whole blocks (one relabelling
    for every layer), and its ranks inside a node per layer; both relabellings that move fewest are
    exact assignment problems. 0 when ``new_LP`` equals ``current_LP`` up to such a relabelling.
    """
    from scipy.optimize import linear_sum_assignment

    cur, new = np.asarray(current_LP, dtype=np.int64), np.asarray(new_LP, dtype=np.int64)
    L, W, g = cur.shape[0], num_ranks, ranks_per_node
    G = W // g
    # rank-to-rank costs per layer: experts of new rank v missing from current rank u, [L, W(u), W(v)]
    cost_LWW = _missing_LWW(cur.reshape(L, W, -1), new.reshape(L, W, -1), num_experts)
    # inside each (current node a, new node b) pair and layer, the best assignment of ranks: block
    # [a, b, l] is cost_LWW[l, a*g:(a+1)*g, b*g:(b+1)*g]; cols[a, b, l, i] the new local rank of current i
    blocks = cost_LWW.reshape(L, G, g, G, g).transpose(1, 3, 0, 2, 4)
    cols = np.empty((G, G, L, g), dtype=np.int64)
    for a in range(G):
        for b in range(G):
            for l in range(L):
                cols[a, b, l] = linear_sum_assignment(blocks[a, b, l])[1]  # rows: 0..g-1 (square)
    inner = np.take_along_axis(blocks, cols[..., None], axis=4)[..., 0].sum(axis=(2, 3))  # [G, G]
    best = np.argsort(cols, axis=3)  # for new local rank j, the current local rank
    cur_nodes, new_nodes = linear_sum_assignment(inner)
    node_of_new = np.empty(G, dtype=np.int64)
    node_of_new[new_nodes] = cur_nodes
    rank_of_new = (node_of_new[:, None, None] * g + best[node_of_new, np.arange(G)]).transpose(1, 0, 2).reshape(L, W)
    moved = int(inner[cur_nodes, new_nodes].sum())
    return Migration(experts_moved=moved, node_of_new_G=node_of_new, rank_of_new_LW=rank_of_new)


def redundancy_sweep(*, num_experts: int, num_ranks: int, max_slots_per_gpu: int) -> list[int]:
    """Redundant slots per layer to try: 0, W, 2W, ... while ``(E + R) / W`` slots per GPU stay within
    ``max_slots_per_gpu`` and ``R < E`` (``Deployment.check_slots``). With E not a multiple of W the
    first step is the R that makes ``E + R`` one (0 is then not deployable and left out)."""
    first = (-num_experts) % num_ranks
    out = []
    r = first
    while r < num_experts and (num_experts + r) // num_ranks <= max_slots_per_gpu:
        out.append(r)
        r += num_ranks
    return out


def quantiles_over_layers(values_L: np.ndarray) -> dict[str, float]:
    """``min``, ``p50``, ``p90`` and ``mean`` of the layers' values, NaN layers left out (all NaN: NaN)."""
    v = np.asarray(values_L, dtype=np.float64)
    v = v[~np.isnan(v)]
    if v.size == 0:
        return {"min": float("nan"), "p50": float("nan"), "p90": float("nan"), "mean": float("nan")}
    return {
        "min": float(v.min()),
        "p50": float(np.quantile(v, 0.5)),
        "p90": float(np.quantile(v, 0.9)),
        "mean": float(v.mean()),
    }
