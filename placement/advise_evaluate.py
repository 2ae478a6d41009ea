"""One placement evaluated on one stage's steps (``StepMetrics``): on a trace's simulated steps
(``evaluate_tokens``: the replicas an engine's dispatch picks, the copies, the one step model) or on a
load profile's windows of counts (``evaluate_counts``: expected loads and traffic).

Shape legend (docs/architecture.md): N windows, B steps, L MoE layers, E logical experts, P physical
slots, W EP ranks, T tokens, K top-k slots.

Out of scope: which options are evaluated (``advise_fit``); their summary (``advise_rows``); the
metrics' formulas (``advise_metrics``, ``step_model``).
"""

from __future__ import annotations

import numpy as np

from moetrace.placement.advise_metrics import (
    balancedness,
    expected_active_slots,
    expected_rank_load,
    expected_traffic,
    rank_load_from_ranks,
    send_ranks_per_token,
    vllm_balancedness,
)
from moetrace.placement.advise_types import StepMetrics, StepTokens
from moetrace.placement.deployment import Deployment
from moetrace.placement.eplb_replicas import ReplicaRule, rule_copies
from moetrace.placement.hardware import CostModel
from moetrace.placement.maps import Placement
from moetrace.placement.step_model import DedupUnit, copy_model, layer_seconds

__all__ = ["evaluate_counts", "evaluate_tokens"]


def evaluate_tokens(
    tokens: StepTokens,
    placement: Placement,
    *,
    deployment: Deployment,
    dedup: DedupUnit,
    cost: CostModel,
    bytes_per_token: int,
    hidden_size: int,
    rule: ReplicaRule = "same_node",
) -> StepMetrics:
    """One placement on a trace's simulated steps, one pass over the layers: the routing and copies of
    ``eplb_replicas.rule_copies`` (replica policy ``rule``), priced by the one step model
    (``step_model.layer_seconds`` with ``cost``'s kernel for ``dedup``; copies of ``hidden_size``
    values), and from the same routing each rank's (token, expert) pairs and each token's
    destination ranks."""
    W, g, B = deployment.num_ep, deployment.ranks_per_node, tokens.num_steps
    ids = tokens.topk_ids_TLK
    L = ids.shape[1]
    step_T = np.asarray(tokens.step_T, dtype=np.int64)
    src_T = np.asarray(tokens.src_rank_T, dtype=np.int64)
    P = placement.phy2log.shape[1]
    out = {k: np.zeros((B, L)) for k in ("bal", "busy", "mean", "amax", "amean", "inter", "a2a", "moe")}
    kernel = cost.kernel(dedup)
    tokens_BW = np.bincount(step_T * W + src_T, minlength=B * W).reshape(B, W)
    vllm_mean, vllm_max = np.zeros(B), np.zeros(B)
    send_L = np.full(L, np.nan)
    copies = rule_copies(
        ids,
        placement=placement,
        rule=rule,
        batch_T=step_T,
        src_rank_T=src_T,
        num_batches=B,
        num_ranks=W,
        ranks_per_node=g,
    )
    bK = step_T[:, None]
    for l, c in enumerate(copies):
        load_BW = rank_load_from_ranks(c.rank_TK, c.valid_TK, step_T, num_batches=B, num_ranks=W)
        out["bal"][:, l] = balancedness(load_BW)
        out["busy"][:, l], out["mean"][:, l] = load_BW.max(axis=1), load_BW.mean(axis=1)
        vllm_mean += load_BW.mean(axis=1)
        vllm_max += load_BW.max(axis=1)
        srank = np.sort(np.where(c.valid_TK, c.rank_TK, W), axis=1)  # invalid entries sort last (>= W)
        n_T = send_ranks_per_token(srank, srank < W, presorted=True)
        send_L[l] = float(n_T[n_T > 0].mean()) if (n_T > 0).any() else np.nan
        traffic = copy_model(dedup).traffic(
            rank_TK=c.rank_TK,
            valid_TK=c.valid_TK,
            batch_T=step_T,
            src_rank_T=src_T,
            num_batches=B,
            num_ranks=W,
            ranks_per_node=g,
            sorted_rank_TK=srank,
            slot_TK=c.slot_TK,
        )
        out["inter"][:, l] = traffic.inter_copies_B() * 2 * bytes_per_token  # dispatch and combine
        act = np.bincount((bK * P + c.slot_TK)[c.valid_TK], minlength=B * P).reshape(B, W, P // W) > 0
        nact = act.sum(axis=2)
        out["amax"][:, l], out["amean"][:, l] = nact.max(axis=1), nact.mean(axis=1)
        secs = layer_seconds(
            traffic,
            kernel=kernel,
            hidden_size=hidden_size,
            ranks_per_node=g,
            expert=cost.expert,
            pairs_BW=load_BW,
            active_BW=nact,
            tokens_BW=tokens_BW,
        )
        out["a2a"][:, l], out["moe"][:, l] = secs.a2a, secs.moe
    with np.errstate(invalid="ignore", divide="ignore"):
        vllm_B = np.where(vllm_max > 0, vllm_mean / np.where(vllm_max > 0, vllm_max, 1.0), np.nan)
    return StepMetrics(
        balancedness_BL=out["bal"],
        vllm_balancedness_B=vllm_B,
        busiest_BL=out["busy"],
        mean_rank_BL=out["mean"],
        active_max_BL=out["amax"],
        active_mean_BL=out["amean"],
        send_ranks_L=send_L,
        inter_bytes_BL=out["inter"],
        a2a_seconds_BL=out["a2a"],
        moe_seconds_BL=out["moe"],
    )


def evaluate_counts(
    counts_NLE: np.ndarray,
    placement: Placement,
    *,
    deployment: Deployment,
    cost: CostModel,
    dedup: DedupUnit,
    pairs_per_step: float,
    bytes_per_token: int,
    hidden_size: int,
    slot_share_LP: np.ndarray | None = None,
) -> StepMetrics:
    """One placement on a profile's windows of counts (float [N, L, E]): balancedness and the busiest
    rank per window (replicas share an expert's tokens evenly, or by ``slot_share_LP``: float [L, P],
    ``eplb_replicas.slot_shares`` of an engine's rule); the per-step terms (activated
    experts, copies, seconds) on the window scaled to a step of ``pairs_per_step`` (token, expert)
    pairs, under one copy per (token, expert) from sources spread evenly (``expected_traffic``).
    No tokens, so no destination ranks per token (NaN)."""
    W, g = deployment.num_ep, deployment.ranks_per_node
    c = np.asarray(counts_NLE, dtype=np.float64)
    N, L, _ = c.shape
    load_NLW = expected_rank_load(c, placement, num_ranks=W, slot_share_LP=slot_share_LP)
    total_N = load_NLW.sum(axis=2).mean(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        scale_N = np.where(total_N > 0, pairs_per_step / np.where(total_N > 0, total_N, 1.0), 0.0)
    step_NLW = load_NLW * scale_N[:, None, None]
    active_NLW = expected_active_slots(
        c, placement, num_ranks=W, pairs_per_step_N=np.full(N, pairs_per_step), slot_share_LP=slot_share_LP
    )
    flat = step_NLW.reshape(N * L, W)
    traffic = expected_traffic(flat, ranks_per_node=g)
    secs = layer_seconds(
        traffic,
        kernel=cost.kernel(dedup),
        hidden_size=hidden_size,
        ranks_per_node=g,
        expert=cost.expert,
        pairs_BW=flat,
        active_BW=active_NLW.reshape(N * L, W),
    )
    a2a_NL, moe_NL = secs.a2a.reshape(N, L), secs.moe.reshape(N, L)
    inter = (traffic.send_inter.sum(axis=1) * 2.0 * bytes_per_token).reshape(N, L)
    return StepMetrics(
        balancedness_BL=balancedness(load_NLW),
        vllm_balancedness_B=vllm_balancedness(load_NLW),
        busiest_BL=load_NLW.max(axis=2),
        mean_rank_BL=load_NLW.mean(axis=2),
        active_max_BL=active_NLW.max(axis=2),
        active_mean_BL=active_NLW.mean(axis=2),
        send_ranks_L=np.full(L, np.nan),
        inter_bytes_BL=inter,
        a2a_seconds_BL=a2a_NL,
        moe_seconds_BL=moe_NL,
    )
