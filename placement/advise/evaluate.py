"""One placement evaluated on one stage's steps (``StepMetrics``): on a trace's simulated steps
(``evaluate_tokens``: the replicas an engine's dispatch picks, the copies, the one step model) or on a
load profile's windows of counts (``evaluate_counts``: expected loads and traffic).

How: on tokens, ``simulate_kernel.rule_counts`` counts each (step, layer) in one fused numba pass (the
engine's rule routed from ``eplb_replicas.rule_tables``) and ``step_model.layer_seconds`` prices the
counts; ``_evaluate_tokens_reference`` is the same evaluation as NumPy passes per layer, the reference the
kernel is tested against bit for bit (tests/test_advise_fused.py) and what runs without numba.

Shape legend (docs/architecture.md): N windows, B steps, L MoE layers, E logical experts, P physical
slots, W EP ranks, T tokens, K top-k slots; a chunk's arrays ``_LBW`` are per (layer, step, rank).

Out of scope: which options are evaluated (``fit``); their summary (``rows``); the
metrics' formulas (``metrics``, ``step_model``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moetrace.placement import simulate_kernel
from moetrace.placement.advise.metrics import (
    balancedness,
    expected_active_slots,
    expected_rank_load,
    expected_traffic,
    rank_load_from_ranks,
    send_ranks_per_token,
    vllm_balancedness,
)
from moetrace.placement.advise.types import StepMetrics, StepTokens
from moetrace.placement.deployment import Deployment
from moetrace.placement.eplb_replicas import ReplicaRule, check_rule, rule_copies, rule_tables
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
    """One placement on a trace's simulated steps: the routing and copies of ``eplb_replicas.rule_copies``
    (replica policy ``rule``), priced by the one step model (``step_model.layer_seconds`` with ``cost``'s
    kernel for ``dedup``; copies of ``hidden_size`` values, ``bytes_per_token`` bytes each), and from the
    same routing each rank's (token, expert) pairs and each token's destination ranks. Every field of
    ``StepMetrics`` float64 [B, L] (B = ``tokens.num_steps``) but ``vllm_balancedness_B`` [B] and
    ``send_ranks_L`` [L].

    Counted by ``simulate_kernel`` (one fused pass per (step, layer), GIL released) where numba runs,
    else by the NumPy passes (``_evaluate_tokens_reference``); the two give the same arrays bit for bit."""
    kw: dict[str, Any] = dict(
        deployment=deployment,
        dedup=dedup,
        cost=cost,
        bytes_per_token=bytes_per_token,
        hidden_size=hidden_size,
        rule=rule,
    )
    if simulate_kernel.available() and _fusable(tokens, placement, deployment):
        try:
            return _evaluate_tokens_fused(tokens, placement, **kw)
        except simulate_kernel.KernelUnavailable:  # these inputs or this numba: the NumPy passes, same bits
            return _evaluate_tokens_reference(tokens, placement, **kw)
    return _evaluate_tokens_reference(tokens, placement, **kw)


def _fusable(tokens: StepTokens, placement: Placement, deployment: Deployment) -> bool:
    """Whether the inputs are ones the kernel counts as the reference does: slots that divide over the
    ranks and those over nodes, every expert with a replica, steps and source ranks in range, a layer at
    least. Otherwise the reference runs (and fails, or counts, as it always did)."""
    W, g, B = deployment.num_ep, deployment.ranks_per_node, tokens.num_steps
    L, P = placement.phy2log.shape
    if W < 1 or g < 1 or P % W or W % g or L == 0 or tokens.topk_ids_TLK.ndim != 3 or not placement.logcnt.size:
        return False
    if tokens.topk_ids_TLK.shape[1] != L or (placement.logcnt < 1).any():
        return False
    step_T, src_T = np.asarray(tokens.step_T), np.asarray(tokens.src_rank_T)
    if len(step_T) != len(tokens.topk_ids_TLK) or len(src_T) != len(step_T):
        return False
    return not len(step_T) or bool(step_T.min() >= 0 and step_T.max() < B and src_T.min() >= 0 and src_T.max() < W)


def _evaluate_tokens_fused(
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
    """``evaluate_tokens`` from ``simulate_kernel.rule_counts`` (routed by ``eplb_replicas.rule_tables``),
    a chunk of layers at a time: every quantity the reference reads is an integer count per (step, GPU)
    (pairs, activated slots, distinct destination GPUs, the copy model's copies and peers), so its sums are
    exact whatever their order; the step model's formulas are per row, so one ``layer_seconds`` call over a
    chunk's (layer, step) rows gives the reference's values; vLLM's balancedness adds the layers' means in
    layer order, as the reference does."""
    W, g, B = deployment.num_ep, deployment.ranks_per_node, tokens.num_steps
    steps = simulate_kernel.sorted_steps(tokens.topk_ids_TLK, tokens.step_T, tokens.src_rank_T, num_batches=B)
    ids, step_T, src_T = steps.ids_TLK, steps.batch_T, steps.src_rank_T
    T, L, K = ids.shape
    P = placement.phy2log.shape[1]
    kernel = cost.kernel(dedup)  # unknown names fail in the reference's order: kernel, rule, copy model
    check_rule(rule)
    copy_model(dedup)
    out = {k: np.zeros((B, L)) for k in ("bal", "busy", "mean", "amax", "amean", "inter", "a2a", "moe")}
    tokens_BW = np.bincount(step_T * W + src_T, minlength=B * W).reshape(B, W)
    vllm_mean, vllm_max = np.zeros(B), np.zeros(B)
    send_L = np.full(L, np.nan)
    tables = rule_tables(placement, rule=rule, batch_T=step_T, src_rank_T=src_T, num_ranks=W, ranks_per_node=g)
    routed_L = (ids >= 0).any(axis=2).sum(axis=0)  # tokens with a recorded id, per layer
    step = max(1, simulate_kernel.CHUNK_CELLS // max(B * W, 1))
    buffer = np.empty(len(simulate_kernel.QUANTITIES) * min(step, L) * B * W, dtype=np.int32)  # every call's counts
    for l0 in range(0, L, step):
        l1 = min(L, l0 + step)
        Lc, cols = l1 - l0, slice(l0, l1)
        q = simulate_kernel.rule_counts(
            ids,
            layers=(l0, l1),
            tables=tables,
            num_slots=P,
            order_T=steps.order_T,
            start_B1=steps.start_B1,
            src_rank_T=src_T,
            num_ranks=W,
            ranks_per_node=g,
            dedup=dedup,
            buffer=buffer,
        )
        load_LBW = q[2].astype(np.float64)  # (token, expert) pairs per (layer, step, GPU)
        nact_LBW = q[1]
        out["bal"][:, cols] = balancedness(load_LBW).T
        max_LB, mean_LB = load_LBW.max(axis=2), load_LBW.mean(axis=2)
        out["busy"][:, cols], out["mean"][:, cols] = max_LB.T, mean_LB.T
        for li in range(Lc):  # layer by layer, the reference's order of float additions
            vllm_mean += mean_LB[li]
            vllm_max += max_LB[li]
        sent_L = q[0].sum(axis=(1, 2), dtype=np.int64)  # distinct destination GPUs, summed over tokens
        for li, l in enumerate(range(l0, l1)):
            if routed_L[l] > 0:
                send_L[l] = float(np.float64(sent_L[li]) / routed_L[l])
        traffic = simulate_kernel.chunk_traffic(q)
        out["inter"][:, cols] = (traffic.inter_copies_B() * 2 * bytes_per_token).reshape(Lc, B).T
        out["amax"][:, cols], out["amean"][:, cols] = nact_LBW.max(axis=2).T, nact_LBW.mean(axis=2).T
        secs = layer_seconds(
            traffic,
            kernel=kernel,
            hidden_size=hidden_size,
            ranks_per_node=g,
            expert=cost.expert,
            pairs_BW=load_LBW.reshape(Lc * B, W),
            active_BW=nact_LBW.reshape(Lc * B, W),
            tokens_BW=np.tile(tokens_BW, (Lc, 1)),
        )
        out["a2a"][:, cols], out["moe"][:, cols] = secs.a2a.reshape(Lc, B).T, secs.moe.reshape(Lc, B).T
    return _metrics(out, vllm_mean, vllm_max, send_L)


def _metrics(
    out: dict[str, np.ndarray], vllm_mean: np.ndarray, vllm_max: np.ndarray, send_L: np.ndarray
) -> StepMetrics:
    """``StepMetrics`` of the [B, L] arrays ``out``, vLLM's per-step sums over layers (float64 [B]) and the
    mean destination ranks per token (float64 [L])."""
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


def _evaluate_tokens_reference(
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
    """``evaluate_tokens`` by NumPy passes per layer (``rule_copies``, sorts and bincounts, the copy
    model's ``traffic``): the reference the fused kernel is tested against, and what runs without numba."""
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
    return _metrics(out, vllm_mean, vllm_max, send_L)


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
