"""``moetrace advise``: should this deployment enable EPLB, with which policy and how many redundant
experts, and what does a data-based placement add, answered per stage in the engines' own terms.

For each recorded stage (prefill, decode, and both together) and each option (the placement served
now, ``--current``, or linear, vLLM's default; the strategies of ``advise_options``: by default
round robin, DeepSeek's EPLB under its hierarchical and its global policy with R redundant slots for
every R of ``advise_metrics.redundancy_sweep``, and ours, ``joint``, where per-request routing
allows; any registered strategy by name) this module measures, per MoE layer and step, then
summarised:

- balancedness as vLLM logs it, the busiest rank's (token, expert) pairs, activated experts per GPU,
  distinct destination ranks per token (``advise_metrics``), with the replicas an engine's dispatch
  picks (``eplb_replicas``: vLLM's hash, SGLang's local-first map, or moetrace's same-node model);
- inter-node bytes, predicted all-to-all and MoE-layer seconds per step from the cost model
  (``step_model`` with ``cost.CostModel`` on a trace's simulated steps; the cost model's formulas on
  expected traffic for a load profile), with the step-to-step spread;
- migration from the placement served now (``advise_metrics.migration``) and the memory the
  redundant slots take per GPU.

Then one verdict per stage in plain words (``advise_verdicts``), with the rearrangement's stall in
steps and whether the engine's schedule pays for it (``advise_rearrange``). Steps hold
``decode_tokens_per_gpu`` / ``prefill_tokens_per_gpu`` tokens per GPU (defaults 4 and 128).

Inputs: a trace (requests split into placement and held-out ones as ``compare`` splits them, so
``moetrace place --strategy eplb`` reproduces the decode EPLB placement advised; the held-out
requests' steps are drawn by ``compare.held_out_batches`` / ``prefill_batches``) or a load profile
(windows of expert counts in time order: the first half fits, the rest is evaluated; one window,
such as one engine statistics file, is fitted and evaluated in-sample, with no drift estimate, and
the output says so; no tokens, so no send-ranks-per-token and the per-(token, expert) copy model only).

Shape legend (docs/architecture.md): N windows, B steps, R requests, L MoE layers, E logical
experts, P physical slots, W EP ranks, G nodes, T tokens, K top-k slots, S stages.

Out of scope: the placers (``eplb``, ``baselines``, ``joint``), the volume and cost models
(``simulate``, ``cost``), engine files (``exports``), the result files (``advise_files``);
time-varying rebalancing schedules beyond the stall's cost: every option is a static placement.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np

from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.advise_files import commands, format_advice, read_advice, write_advice
from moetrace.placement.advise_metrics import (
    balancedness,
    expected_active_slots,
    expected_rank_load,
    expected_traffic,
    migration,
    quantiles_over_layers,
    rank_load_from_ranks,
    redundancy_sweep,
    send_ranks_per_token,
    vllm_balancedness,
)
from moetrace.placement.advise_options import (
    EPLB_STRATEGIES,
    data_free_placement,
    eplb_option_placement,
    eplb_policy,
    resolve_strategies,
)
from moetrace.placement.advise_rearrange import Rearrangement
from moetrace.placement.advise_types import Advice, Option
from moetrace.placement.advise_verdicts import best_eplb, stage_choices, verdicts
from moetrace.placement.decision import stage_choices_json
from moetrace.placement.deployment import Deployment
from moetrace.placement.eplb import ACCUMULATE, Accumulate
from moetrace.placement.eplb_replicas import ReplicaRule, check_rule, rule_copies, slot_shares
from moetrace.placement.hardware import CostModel, Hardware, default_hardware
from moetrace.placement.held_out import held_out_R
from moetrace.placement.maps import Placement
from moetrace.placement.step_model import DedupUnit, copy_model, layer_seconds

if TYPE_CHECKING:
    from moetrace.placement.compare import TraceData
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "AdviseConfig",
    "StepTokens",
    "StepMetrics",
    "StageInput",
    "AdviseInputs",
    "Option",
    "Advice",
    "evaluate_tokens",
    "evaluate_counts",
    "advise_arrays",
    "advise_trace",
    "advise_profile_counts",
    "write_advice",
    "read_advice",
    "format_advice",
    "advise_input",
    "commands",
    "STAGES",
    "DECODE_TOKENS_PER_GPU",
    "PREFILL_TOKENS_PER_GPU",
]

Stage = Literal["prefill", "decode", "both"]
Steps = Literal["prefill", "decode"]
STAGES: tuple[Stage, ...] = ("prefill", "decode", "both")
#: decode tokens per GPU in one step by default (32 requests per node of 8 GPUs, one token each)
DECODE_TOKENS_PER_GPU = 4
#: chunked-prefill tokens per GPU in one prefill step by default (1024 per node of 8 GPUs)
PREFILL_TOKENS_PER_GPU = 128
#: fewer windows than this give no drift estimate (the later half must hold windows to follow)
MIN_DRIFT_WINDOWS = 4


@dataclass(frozen=True, kw_only=True)
class AdviseConfig:
    """What to sweep and how to evaluate it."""

    deployment: Deployment  # DPaTPbEPc[TPd] on nodes of g GPUs
    max_slots_per_gpu: int = 0  # slot limit per GPU and layer for the EPLB sweep (0: E/W + 2)
    num_steps: int = 200  # decode steps simulated on a trace (each of step_requests tokens)
    decode_tokens_per_gpu: int = DECODE_TOKENS_PER_GPU  # decode tokens (one per request) per EP rank and step
    prefill_tokens_per_gpu: int = PREFILL_TOKENS_PER_GPU  # chunked-prefill tokens per EP rank and prefill step
    # registered strategies to evaluate (advise_options; empty: DEFAULT_STRATEGIES where they apply)
    strategies: tuple[str, ...] = ()
    eplb_sum: Accumulate = "float64"  # how EPLB sums pack weights: float64 as SGLang/vLLM, float32 as DeepSeek's
    replica_policy: ReplicaRule = (
        "same_node"  # which replica serves a (token, expert): an engine's rule (eplb_replicas)
    )
    rearrangement: Rearrangement = field(default_factory=Rearrangement)  # stall and interval of a rearrangement
    test_fraction: float = 0.2  # share of a trace's requests held out for evaluation (as compare)
    seed: int = 0  # the split and the drawn steps (as compare: the same seed, the same split)
    hardware: Hardware = field(default_factory=default_hardware)  # the step model's kernels (--link)
    decode_dedup: DedupUnit = "expert"  # decode copy model (DeepEP's low-latency kernels)
    prefill_dedup: DedupUnit = "node"  # prefill copy model (DeepEP's normal kernels)
    num_windows: int = 16  # windows of a trace's requests in arrival (id) order for the drift check
    # the user's HF config.json, parsed (--model-config): the experts' size where the model records none
    model_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.max_slots_per_gpu < 0 or self.num_steps < 4 or self.num_windows < 4:
            raise ConfigError("--max-slots-per-gpu must be >= 0, steps >= 4 and windows >= 4")
        if self.decode_tokens_per_gpu < 1 or self.prefill_tokens_per_gpu < 1:
            raise ConfigError(
                f"--decode-tokens-per-gpu and --prefill-tokens-per-gpu must be >= 1, got {self.decode_tokens_per_gpu} "
                f"and {self.prefill_tokens_per_gpu}"
            )
        if self.eplb_sum not in ACCUMULATE:
            raise ConfigError(f"--eplb-sum {self.eplb_sum!r}: one of {', '.join(ACCUMULATE)}")
        check_rule(self.replica_policy)
        if not (0.0 < self.test_fraction < 1.0):
            raise ConfigError(f"test fraction must be in (0, 1), got {self.test_fraction}")

    def sweep(self, num_experts: int) -> list[int]:
        """Redundant slots the EPLB sweep tries (``redundancy_sweep``); ``ConfigError`` when none fits."""
        W = self.deployment.num_ep
        out = redundancy_sweep(num_experts=num_experts, num_ranks=W, max_slots_per_gpu=self.slot_limit(num_experts))
        if not out:
            raise ConfigError(
                f"{self.deployment.name}: {num_experts} experts need at least {-(-num_experts // W)} slots per GPU; "
                f"--max-slots-per-gpu {self.slot_limit(num_experts)} leaves no EPLB option to try"
            )
        return out

    def slot_limit(self, num_experts: int) -> int:
        """Slots per GPU and layer the sweep may use: ``max_slots_per_gpu``, or ceil(E/W) + 2."""
        W = self.deployment.num_ep
        return self.max_slots_per_gpu or -(-num_experts // W) + 2

    @property
    def step_requests(self) -> int:
        """Decode tokens (requests) in one step over all EP ranks."""
        return self.decode_tokens_per_gpu * self.deployment.num_ep

    @property
    def prefill_tokens_per_node(self) -> int:
        """Chunked-prefill tokens per node in one prefill step."""
        return self.prefill_tokens_per_gpu * self.deployment.ranks_per_node


class StepTokens(NamedTuple):
    """Simulated steps of one stage on a trace: every token's routed ids, step and source rank."""

    topk_ids_TLK: np.ndarray  # int16 [T, L, K] (-1: not recorded)
    step_T: np.ndarray  # int64 [T] step of each token (0..num_steps-1)
    src_rank_T: np.ndarray  # int64 [T] EP rank each token leaves from
    num_steps: int  # B


class StepMetrics(NamedTuple):
    """One option on one stage's steps; arrays float64 [B, L] (B steps or windows) but ``send_ranks_L``."""

    balancedness_BL: np.ndarray  # mean / max (token, expert) pairs per rank
    vllm_balancedness_B: np.ndarray  # [B] what vLLM logs for the step: sum_l mean / sum_l max
    busiest_BL: np.ndarray  # pairs of the busiest rank
    mean_rank_BL: np.ndarray  # pairs of the mean rank
    active_max_BL: np.ndarray  # activated experts (slots with >= 1 token) of the GPU activating most
    active_mean_BL: np.ndarray  # the mean over GPUs
    send_ranks_L: np.ndarray  # [L] distinct destination ranks per token, mean over tokens (NaN: a profile)
    inter_bytes_BL: np.ndarray  # inter-node bytes, dispatch + combine
    a2a_seconds_BL: np.ndarray  # predicted dispatch + combine seconds
    moe_seconds_BL: np.ndarray  # predicted dispatch + experts + combine seconds (NaN: expert size unknown)


@dataclass(frozen=True, kw_only=True)
class StageInput:
    """One recorded stage: the load placements fit and how options are evaluated on it."""

    fit_LE: np.ndarray  # float64 [L, E] the tokens per (layer, expert) placements are fitted on
    windows_NLE: np.ndarray  # float64 [N, L, E] the load per window in arrival order (drift check)
    tokens: StepTokens | None = None  # a trace's simulated steps (None: evaluate on counts)
    counts_NLE: np.ndarray | None = None  # a profile's evaluation windows (float64 [N, L, E])
    pairs_per_step: float = 0.0  # (token, expert) pairs of one step (a profile's windows are scaled to it)


@dataclass(frozen=True, kw_only=True)
class AdviseInputs:
    """Everything ``advise_arrays`` reads, as arrays: from a trace (``advise_trace``) or a profile."""

    model: ModelInfo  # the model (its E, layers, router groups, expert size)
    source: str  # the input's path and kind, for the result
    kind: Literal["trace", "profile"]  # what the input was
    stages: dict[Steps, StageInput]  # the recorded stages
    current: Placement | None = None  # --current (None: linear is the reference)
    current_format: str = ""  # the format --current was read as
    extra: tuple[Option, ...] = ()  # grouped strategies built from the trace's requests (joint...), fitted on decode
    # their steps where their router sends requests elsewhere: (option key, steps) -> steps drawn through it
    extra_tokens: dict[tuple[str, Steps], StepTokens] = field(default_factory=dict)
    routable: bool = False  # per-request prefill and decode recorded (grouped strategies can be built)
    missing: tuple[str, ...] = ()  # what the input lacks, in words (said in the verdicts)


# ------------------------------------------------------------------------------ evaluation
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


# ------------------------------------------------------------------------------ options
def _eplb_fit(
    load_LE: np.ndarray, *, strategy: str, m: ModelInfo, cfg: AdviseConfig, num_redundant: int, stage: str
) -> Option:
    """One EPLB option: ``strategy``'s policy on ``load_LE`` with ``num_redundant`` slots, summed as ``cfg`` says."""
    dep = cfg.deployment
    placement = eplb_option_placement(
        load_LE, strategy=strategy, model=m, deployment=dep, num_redundant=num_redundant, eplb_sum=cfg.eplb_sum
    )
    policy = eplb_policy(strategy, model=m, deployment=dep)
    return Option(name=strategy, num_redundant=num_redundant, placement=placement, fitted_on=stage, policy=policy)


def _stage_options(
    inputs: AdviseInputs, cfg: AdviseConfig, names: tuple[str, ...], *, stage: Stage, sweep: list[int]
) -> list[Option]:
    """The options fitted for ``stage`` in ``names``' order: data-free ones once, EPLB's per sweep point,
    the trace's grouped ones (``inputs.extra``) for a recorded stage."""
    m, dep = inputs.model, cfg.deployment
    load = _fit_stage_load(inputs, stage)
    out: list[Option] = []
    for name in names:
        if name in EPLB_STRATEGIES:
            out += [_eplb_fit(load, strategy=name, m=m, cfg=cfg, num_redundant=r, stage=stage) for r in sweep]
        elif name in ("linear", "round_robin", "random"):
            out.append(
                Option(
                    name=name,
                    num_redundant=0,
                    placement=data_free_placement(name, model=m, deployment=dep, seed=cfg.seed),
                )
            )
        elif stage != "both":
            out += [o for o in inputs.extra if o.name == name]
    return out


def _fit_stage_load(inputs: AdviseInputs, stage: Stage) -> np.ndarray:
    if stage == "both":
        return sum((s.fit_LE for s in inputs.stages.values()), np.zeros_like(next(iter(inputs.stages.values())).fit_LE))
    return inputs.stages[stage].fit_LE


def _stage_windows(inputs: AdviseInputs, stage: Stage) -> np.ndarray:
    if stage == "both":
        ws = [s.windows_NLE for s in inputs.stages.values()]
        n = min(len(w) for w in ws)
        return sum((w[:n] for w in ws), np.zeros_like(ws[0][:n]))
    return inputs.stages[stage].windows_NLE


# ------------------------------------------------------------------------------ summaries
def _q(x: np.ndarray, q: float) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float("nan") if x.size == 0 or np.isnan(x).any() else float(np.quantile(x, q))


def _layer_mean(x_BL: np.ndarray) -> np.ndarray:
    """Mean over steps of every layer, steps without tokens (NaN) left out; NaN for a layer without any."""
    x = np.asarray(x_BL, dtype=np.float64)
    n = (~np.isnan(x)).sum(axis=0)
    return np.where(n > 0, np.nansum(x, axis=0) / np.maximum(n, 1), np.nan)


def _nanmean(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")


def _summary(
    m: StepMetrics, ref: StepMetrics, *, option: Option, stage: Stage, steps: Steps, model: ModelInfo
) -> dict[str, Any]:
    """The summary row of one option on one stage's steps (every time also over the reference's median)."""
    bq = quantiles_over_layers(_layer_mean(m.balancedness_BL))
    a2a_B, moe_B, inter_B = m.a2a_seconds_BL.sum(1), m.moe_seconds_BL.sum(1), m.inter_bytes_BL.sum(1)
    ref_a2a, ref_moe = _q(ref.a2a_seconds_BL.sum(1), 0.5), _q(ref.moe_seconds_BL.sum(1), 0.5)
    ref_inter = _q(ref.inter_bytes_BL.sum(1), 0.5)

    def rel(x_B: np.ndarray, r: float, q: float) -> float:
        return _q(x_B / r, q) if r > 0 and np.isfinite(r) else float("nan")

    return {
        "stage": stage,
        "steps": steps,
        "option": option.key,
        "strategy": option.name,
        "label": option.label,
        "num_redundant": option.num_redundant,
        "fitted_on": option.fitted_on,
        "eplb_policy": option.policy,
        "router": option.has_router,
        "balancedness_min": bq["min"],
        "balancedness_p50": bq["p50"],
        "balancedness_p90": bq["p90"],
        "balancedness_mean": bq["mean"],
        "balancedness_vllm": _q(m.vllm_balancedness_B[np.isfinite(m.vllm_balancedness_B)], 0.5),
        "busiest_rank_tokens": _nanmean(m.busiest_BL),
        "mean_rank_tokens": _nanmean(m.mean_rank_BL),
        "activated_experts_per_gpu_max": _nanmean(m.active_max_BL),
        "activated_experts_per_gpu_mean": _nanmean(m.active_mean_BL),
        "send_ranks_per_token": _nanmean(m.send_ranks_L),
        "inter_node_bytes_per_step": _q(inter_B, 0.5),
        "inter_node_vs_ref": rel(inter_B, ref_inter, 0.5),
        "a2a_seconds_per_step": _q(a2a_B, 0.5),
        "a2a_vs_ref": rel(a2a_B, ref_a2a, 0.5),
        "a2a_vs_ref_p10": rel(a2a_B, ref_a2a, 0.1),
        "a2a_vs_ref_p90": rel(a2a_B, ref_a2a, 0.9),
        "moe_seconds_per_step": _q(moe_B, 0.5),
        "moe_vs_ref": rel(moe_B, ref_moe, 0.5),
        "moe_vs_ref_p10": rel(moe_B, ref_moe, 0.1),
        "moe_vs_ref_p90": rel(moe_B, ref_moe, 0.9),
    }


# ------------------------------------------------------------------------------ the advice
def advise_arrays(
    inputs: AdviseInputs, cfg: AdviseConfig, *, progress: Callable[[int, int], None] | None = None
) -> Advice:
    """Evaluate every option on every recorded stage of ``inputs``, then word the verdicts.

    ``progress(done, total)`` after each (option, steps) evaluation.
    """
    from moetrace.placement.cost import expert_compute_for

    m, dep = inputs.model, cfg.deployment
    E = m.num_experts
    sweep = cfg.sweep(E)
    expert = expert_compute_for(m, config=cfg.model_config)
    cost = CostModel(hardware=cfg.hardware, expert=expert)
    bytes_per_token = m.hidden_size * 2
    time_hidden = expert.hidden_size if expert is not None else m.hidden_size
    recorded: list[Steps] = [s for s in ("prefill", "decode") if s in inputs.stages]
    stages: list[Stage] = list(recorded)
    if len(recorded) == 2:
        stages.append("both")

    names, notes = resolve_strategies(
        cfg.strategies, model=m, deployment=dep, routable=inputs.routable, kind=inputs.kind
    )
    ref_opt = (
        Option(name="current", num_redundant=inputs.current.phy2log.shape[1] - E, placement=inputs.current)
        if inputs.current is not None
        else Option(
            name="linear",
            num_redundant=0,
            placement=data_free_placement("linear", model=m, deployment=dep, seed=cfg.seed),
        )
    )
    options: dict[Stage, list[Option]] = {}
    for st in stages:
        here = _stage_options(inputs, cfg, names, stage=st, sweep=sweep)
        options[st] = [ref_opt, *(o for o in here if o.key != ref_opt.key)]
    shares: dict[tuple[str, str], np.ndarray] = {}  # a profile's slot shares under the replica rule, per option

    def slot_share(opt: Option) -> np.ndarray | None:
        if cfg.replica_policy != "sglang":  # the other rules split evenly on average
            return None
        k = (opt.fitted_on, opt.key)
        if k not in shares:
            shares[k] = slot_shares(
                opt.placement, rule=cfg.replica_policy, num_ranks=dep.num_ep, ranks_per_node=dep.ranks_per_node
            )
        return shares[k]

    def job_key(opt: Option, steps: Steps) -> tuple[str, str, Steps]:
        return (opt.fitted_on, opt.key, steps)

    def evaluate(job: tuple[Option, Steps]) -> StepMetrics:
        opt, steps = job
        si = inputs.stages[steps]
        toks = inputs.extra_tokens.get((opt.key, steps), si.tokens)
        if toks is not None:
            return evaluate_tokens(
                toks,
                opt.placement,
                deployment=dep,
                dedup=cfg.decode_dedup if steps == "decode" else cfg.prefill_dedup,
                cost=cost,
                bytes_per_token=bytes_per_token,
                hidden_size=time_hidden,
                rule=cfg.replica_policy,
            )
        assert si.counts_NLE is not None  # a profile stage
        return evaluate_counts(
            si.counts_NLE,
            opt.placement,
            deployment=dep,
            cost=cost,
            dedup=cfg.decode_dedup if steps == "decode" else cfg.prefill_dedup,
            pairs_per_step=si.pairs_per_step,
            bytes_per_token=bytes_per_token,
            hidden_size=time_hidden,
            slot_share_LP=slot_share(opt),
        )

    plan = [(st, steps) for st in stages for steps in (recorded if st == "both" else [st])]
    jobs: dict[tuple[str, str, Steps], tuple[Option, Steps]] = {}
    for st, steps in plan:
        for opt in [ref_opt, *options[st]]:
            jobs.setdefault(job_key(opt, steps), (opt, steps))
    evals: dict[tuple[str, str, Steps], StepMetrics] = {}
    # numpy's sorts and bincounts release the GIL: two threads keep two cores busy (results do not depend on it)
    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        for n, (k, em) in enumerate(zip(jobs, pool.map(evaluate, jobs.values())), start=1):
            evals[k] = em
            if progress is not None:
                progress(n, len(jobs))
    moved: dict[tuple[str, str], dict[str, Any]] = {}

    rows: list[dict[str, Any]] = []
    layer_cols: dict[str, list[Any]] = {
        k: []
        for k in (
            "stage",
            "steps",
            "option",
            "layer",
            "model_layer",
            "balancedness",
            "busiest_rank_tokens",
            "activated_experts_per_gpu_max",
            "send_ranks_per_token",
            "inter_node_bytes",
            "moe_seconds",
        )
    }
    for st, steps in plan:
        ref = evals[job_key(ref_opt, steps)]
        for opt in options[st]:
            em = evals[job_key(opt, steps)]
            row = _summary(em, ref, option=opt, stage=st, steps=steps, model=m)
            if (opt.fitted_on, opt.key) not in moved:
                moved[(opt.fitted_on, opt.key)] = _migration_row(
                    ref_opt, opt, dep=dep, model=m, weight_bytes=_weight_bytes(cost)
                )
            row.update(moved[(opt.fitted_on, opt.key)])
            rows.append(row)
            _add_layers(layer_cols, em, stage=st, steps=steps, option=opt.key, model=m)

    correlation = _stage_correlation(inputs)
    drift = {st: _drift(inputs, st, cfg=cfg, rows=rows) for st in stages}
    drift_estimated = all("skipped" not in d for d in drift.values())
    missing = [*inputs.missing, *notes]
    if not drift_estimated:
        n = min(len(inputs.stages[s].windows_NLE) for s in recorded)
        missing.append(
            f"No drift estimate: the input has {n} window(s) of counts (a drift estimate needs {MIN_DRIFT_WINDOWS}); "
            + (
                "placements are fitted and evaluated on the same counts (in-sample: an upper bound on what a placement "
                "fitted on past load keeps), and whether the load moves faster than a static placement follows is "
                "unknown. Record several windows (SGLang's expert distribution recorder per pass, or `moetrace "
                "profile --window-tokens`) to know."
                if n == 1
                else "whether the load moves faster than a static placement follows is unknown."
            )
        )
    verdict_list, recommended = verdicts(
        rows,
        stages=list(stages),
        ref_key=ref_opt.key,
        ref_label=ref_opt.label,
        drift={str(k): v for k, v in drift.items()},
        correlation=correlation,
        weights=_stage_weights(inputs),
        missing=tuple(missing),
        rearrangement=cfg.rearrangement,
    )
    best = stage_choices(rows, stages=list(stages), ref_key=ref_opt.key)  # the one rule (decision.choose)
    recommended = list(
        dict.fromkeys([*recommended, *((c.stage, c.decision) for c in best if c.decision != ref_opt.key)])
    )
    placements = {
        f"{st}-{key}": next(o for o in options[st] if o.key == key) for st, key in recommended if st in options
    }
    manifest = {
        "input": inputs.source,
        "input_kind": inputs.kind,
        "trace": inputs.source if inputs.kind == "trace" else None,  # the dashboard shows its overview too
        "model": m.to_dict(),
        "deployment": dep.name,
        "gpus_per_node": dep.num_gpus_per_node,
        "num_ep": dep.num_ep,
        "num_nodes": dep.num_nodes,
        "reference": ref_opt.key,
        "current_format": inputs.current_format or None,
        "stages": list(stages),
        "recorded_stages": list(recorded),
        "missing": missing,
        "redundancy_sweep": sweep,
        "max_slots_per_gpu": cfg.slot_limit(E),
        "num_steps": {s: int(_num_steps(inputs, s)) for s in recorded},
        "decode_dedup": cfg.decode_dedup,
        "prefill_dedup": cfg.prefill_dedup,
        "hardware": cfg.hardware.to_json(),
        "expert": None if expert is None else expert.to_json(),
        "test_fraction": cfg.test_fraction,
        "seed": cfg.seed,
        "strategies": list(names),
        "eplb_sum": cfg.eplb_sum,
        "replica_policy": cfg.replica_policy,
        "step_tokens_per_gpu": {"decode": cfg.decode_tokens_per_gpu, "prefill": cfg.prefill_tokens_per_gpu},
        "rearrangement": {
            "stall_seconds": cfg.rearrangement.stall_seconds,
            "interval_steps": cfg.rearrangement.interval_steps,
        },
        "prefill_decode_correlation": correlation,
        "drift_estimated": drift_estimated,
        "drift": drift,
        "verdicts": verdict_list,
        "best": stage_choices_json(best),
        "recommended": [
            {"stage": st, "option": key, "placement": f"placements/{st}-{key}.json"} for st, key in recommended
        ],
    }
    return Advice(
        manifest=manifest,
        rows=rows,
        layer_rows=_layer_arrays(layer_cols),
        placements=placements,
        options={f"{st}-{o.key}": o for st in stages for o in options[st]},
    )


def _num_steps(inputs: AdviseInputs, steps: Steps) -> int:
    si = inputs.stages[steps]
    if si.tokens is not None:
        return si.tokens.num_steps
    return 0 if si.counts_NLE is None else int(si.counts_NLE.shape[0])


def _weight_bytes(cost: CostModel) -> float | None:
    return None if cost.expert is None else cost.expert.weight_bytes


def _migration_row(
    ref: Option, opt: Option, *, dep: Deployment, model: ModelInfo, weight_bytes: float | None
) -> dict[str, Any]:
    """Experts (and bytes) moving from the reference to ``opt``, and the redundant slots' memory per GPU."""
    mig = migration(
        ref.placement.phy2log,
        opt.placement.phy2log,
        num_ranks=dep.num_ep,
        ranks_per_node=dep.ranks_per_node,
        num_experts=model.num_experts,
    )
    extra_slots = opt.num_redundant / dep.num_ep * model.num_moe_layers  # per GPU, all layers
    return {
        "experts_moved": mig.experts_moved,
        "bytes_moved": None if weight_bytes is None else mig.experts_moved * weight_bytes,
        "extra_slots_per_gpu": extra_slots,
        "extra_bytes_per_gpu": None if weight_bytes is None else extra_slots * weight_bytes,
    }


def _add_layers(
    cols: dict[str, list[Any]], em: StepMetrics, *, stage: str, steps: str, option: str, model: ModelInfo
) -> None:
    L = em.balancedness_BL.shape[1]
    with np.errstate(invalid="ignore"):
        per = {
            "balancedness": _layer_mean(em.balancedness_BL),
            "busiest_rank_tokens": em.busiest_BL.mean(axis=0),
            "activated_experts_per_gpu_max": em.active_max_BL.mean(axis=0),
            "send_ranks_per_token": em.send_ranks_L,
            "inter_node_bytes": em.inter_bytes_BL.mean(axis=0),
            "moe_seconds": np.median(em.moe_seconds_BL, axis=0),
        }
    cols["stage"] += [stage] * L
    cols["steps"] += [steps] * L
    cols["option"] += [option] * L
    cols["layer"] += list(range(L))
    cols["model_layer"] += list(model.moe_layers)
    for k, v in per.items():
        cols[k] += [float(x) for x in v]


def _layer_arrays(cols: dict[str, list[Any]]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in cols.items()}


def _stage_correlation(inputs: AdviseInputs) -> float | None:
    """Pearson r of the prefill and the decode load over experts, mean over layers (None: one stage)."""
    from moetrace.stats import mean_skip_nan, pearson_paired

    if len(inputs.stages) < 2:
        return None
    r_L = pearson_paired(inputs.stages["prefill"].fit_LE, inputs.stages["decode"].fit_LE)
    mean, _ = mean_skip_nan(r_L)
    return None if np.isnan(mean) else round(mean, 4)


def _stage_weights(inputs: AdviseInputs) -> dict[str, float]:
    """Steps each stage's traffic takes (its routed pairs over the pairs of one step): how a placement
    serving both stages weighs their step times."""
    return {
        st: float(si.fit_LE.sum() / max(si.fit_LE.shape[0], 1)) / si.pairs_per_step if si.pairs_per_step > 0 else 0.0
        for st, si in inputs.stages.items()
    }


def _drift(inputs: AdviseInputs, stage: Stage, *, cfg: AdviseConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Does the imbalance move faster than a static placement follows? On the windows in arrival order,
    balancedness (vLLM's figure, mean over the later half of the windows) of: the reference; EPLB fitted
    on the first half (``static``); EPLB refitted on the window before each one (``lagged``: a placement
    that follows one window late, as a periodic rearrangement does); EPLB fitted on each window itself
    (``own``: a ceiling no deployed placement reaches, since it knows the window's load in advance). All
    with the recommended EPLB option's policy and sweep point (else the largest). Moving load: ``lagged``
    beats ``static``; load that changes faster than any placement follows: ``own`` far above both.
    Fewer than ``MIN_DRIFT_WINDOWS`` windows: skipped, with the reason."""
    m, dep = inputs.model, cfg.deployment
    w_NLE = _stage_windows(inputs, stage)
    N = len(w_NLE)
    if N < MIN_DRIFT_WINDOWS:
        return {"num_windows": N, "skipped": f"fewer than {MIN_DRIFT_WINDOWS} windows: no drift estimate"}
    half = N // 2
    own: Steps = "decode" if stage == "both" else stage
    cand = [r for r in rows if r["stage"] == stage and r["strategy"] in EPLB_STRATEGIES and r["steps"] == own]
    if not cand:
        return {"num_windows": N, "skipped": "no EPLB option evaluated"}
    best = best_eplb(cand)
    R = int(best["num_redundant"]) if best is not None else max(int(r["num_redundant"]) for r in cand)
    strategy = str(best["strategy"]) if best is not None else "eplb"
    W = dep.num_ep

    def fitted(load_LE: np.ndarray) -> Placement:
        return _eplb_fit(load_LE, strategy=strategy, m=m, cfg=cfg, num_redundant=R, stage=stage).placement

    def b(w_LE: np.ndarray, placement: Placement) -> float:
        return float(vllm_balancedness(expected_rank_load(w_LE[None], placement, num_ranks=W))[0])

    ref, static = _ref_placement(inputs, m=m, dep=dep, seed=cfg.seed), fitted(w_NLE[:half].sum(0))
    later = range(half, N)
    return {
        "num_windows": N,
        "num_redundant": R,
        "strategy": strategy,
        "reference": _mean_or_nan(np.array([b(w_NLE[i], ref) for i in later])),
        "static": _mean_or_nan(np.array([b(w_NLE[i], static) for i in later])),
        "lagged": _mean_or_nan(np.array([b(w_NLE[i], fitted(w_NLE[i - 1])) for i in later])),
        "own": _mean_or_nan(np.array([b(w_NLE[i], fitted(w_NLE[i])) for i in later])),
    }


def _mean_or_nan(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    return round(float(np.nanmean(x)), 4) if np.isfinite(x).any() else float("nan")


def _ref_placement(inputs: AdviseInputs, *, m: ModelInfo, dep: Deployment, seed: int) -> Placement:
    """The reference placement: ``--current``, else linear."""
    if inputs.current is not None:
        return inputs.current
    return data_free_placement("linear", model=m, deployment=dep, seed=seed)


# ------------------------------------------------------------------------------ from a trace
def _windows(counts_RLE: np.ndarray, rows: np.ndarray, num_windows: int) -> np.ndarray:
    """``rows`` (arrival order) cut into ``num_windows`` contiguous windows, each summed, float64 [N, L, E]."""
    chunks = np.array_split(rows, min(num_windows, len(rows)))
    return np.stack([counts_RLE[c].sum(axis=0, dtype=np.float64) for c in chunks if len(c)])


def _sum_rows(counts_RLE: np.ndarray, rows: np.ndarray) -> np.ndarray:
    out = np.zeros(counts_RLE.shape[1:])
    for lo in range(0, len(rows), 1024):
        out += counts_RLE[rows[lo : lo + 1024]].sum(axis=0, dtype=np.float64)
    return out


def _load_trace(
    trace: str | os.PathLike, cfg: AdviseConfig, *, progress: Callable[[int, int], None] | None
) -> TraceData:
    """Counts, the compare split and the held-out tokens of a trace, whatever stages it recorded."""
    from moetrace.analysis.counts import count_trace
    from moetrace.placement.compare import load_trace_data
    from moetrace.tracer.trace.reader import open_trace
    from moetrace.tracer.trace.schema import stages_of

    tr = open_trace(trace)
    stages = stages_of(tr)
    if "decode" in stages:
        return load_trace_data(
            trace, test_fraction=cfg.test_fraction, seed=cfg.seed, progress=progress, held_out_tokens=False
        )
    from moetrace.placement.compare import TraceData

    counts = count_trace(tr, progress=progress)
    R = counts.num_requests
    if R < 4:
        raise TraceFormatError(f"{trace}: {R} requests; advise needs at least 4 (some to fit, some to evaluate)")
    is_test = held_out_R(R, test_fraction=cfg.test_fraction, seed=cfg.seed)  # compare's split: one seed, one split
    return TraceData(
        model=tr.model,
        trace_path=str(trace),
        prefill_RLE=counts.stage("prefill"),
        decode_RLE=counts.stage("decode"),
        is_test_R=is_test,
        test_topk_ids_TLK=None,
        test_req_T=None,
        stages=stages,
    )


def _prefill_tokens(data: TraceData) -> TraceData:
    """The held-out prompt tokens (a seeded sample, ``compare.MAX_PREFILL_TOKENS``) of a trace without decode."""
    from moetrace.placement.compare import MAX_PREFILL_TOKENS
    from moetrace.tracer.trace.reader import open_trace

    tr = open_trace(data.trace_path)
    req = tr.request_arrays
    bound = int(req.prompt_tokens_R[data.is_test_R].sum(dtype=np.int64))
    keep = min(1.0, MAX_PREFILL_TOKENS / max(bound, 1))
    rng = np.random.default_rng([len(data.is_test_R), 11])
    ids, rows = [], []
    for ta in tr.iter_token_arrays(batch_tokens=1 << 14):
        sel = ~ta.is_decode_T & data.is_test_R[ta.row_T] & (ta.topk_ids_TLK >= 0).any(axis=(1, 2))
        sel &= rng.random(len(sel)) < keep
        ids.append(ta.topk_ids_TLK[sel])
        rows.append(ta.row_T[sel])
    if not ids or sum(len(r) for r in rows) == 0:
        raise TraceFormatError(f"{data.trace_path}: the held-out requests have no recorded prompt tokens")
    p_ids, p_req = np.concatenate(ids), np.concatenate(rows)
    order = np.argsort(p_req, kind="stable")
    L, K = tr.model.num_moe_layers, tr.model.top_k
    return replace(
        data,
        test_topk_ids_TLK=np.zeros((0, L, K), np.int16),
        test_req_T=np.zeros(0, np.int64),
        test_prefill_ids_TLK=p_ids[order],
        test_prefill_req_T=p_req[order],
    )


def advise_trace(
    trace: str | os.PathLike,
    cfg: AdviseConfig,
    *,
    current: str | os.PathLike | None = None,
    progress: Callable[[int, int], None] | None = None,
    count_progress: Callable[[int, int], None] | None = None,
) -> Advice:
    """The advice on a trace: placements fitted on ``compare``'s training requests, evaluated on steps
    drawn from the held-out requests (decode: ``num_steps`` steps of ``step_requests`` tokens; prefill:
    ``prefill_tokens_per_node`` per node and step, one per 100 decode steps and at least 4)."""
    from moetrace.placement.compare import (
        CompareConfig,
        held_out_batches,
        make_placement,
        prefill_batches,
        with_held_out_tokens,
    )
    from moetrace.placement.strategies import get_strategy
    from moetrace.tracer.trace.reader import open_trace
    from moetrace.tracer.trace.schema import stages_of

    dep = cfg.deployment
    tr = open_trace(trace)  # the manifest only: the checks below come before minutes of counting
    model = tr.model
    cfg.sweep(model.num_experts)
    recorded = stages_of(tr)
    names, _ = resolve_strategies(
        cfg.strategies,
        model=model,
        deployment=dep,
        routable="prefill" in recorded and "decode" in recorded,
        kind="trace",
    )
    grouped = [n for n in names if get_strategy(n).grouped]
    for n in grouped:
        get_strategy(n).check(model, num_nodes=dep.num_nodes)
    cur = None
    if current is not None:  # before minutes of counting
        from moetrace.placement.advise_current import read_current

        cur = read_current(current, model=model, num_ranks=dep.num_ep)
    data = _load_trace(trace, cfg, progress=count_progress)
    ccfg = CompareConfig(
        deployment=dep,
        strategies=("linear",),
        test_fraction=cfg.test_fraction,
        num_batches=cfg.num_steps,
        num_batch_requests=cfg.step_requests,
        dedup=cfg.decode_dedup,
        seed=cfg.seed,
        oracle=False,
        prefill_dedup=cfg.prefill_dedup,
        hardware=cfg.hardware,
        prefill_tokens_per_node=cfg.prefill_tokens_per_node,
    )
    extra: list[Option] = []
    groups: dict[str, np.ndarray] = {}  # option key -> group of each request, where a router sends it
    missing: list[str] = []
    has_p, has_d = "prefill" in data.stages, "decode" in data.stages
    if has_p and has_d:
        for n in grouped:  # fitted before the held-out tokens are read (memory)
            ps = make_placement(data, ccfg, n)
            extra.append(Option(name=n, num_redundant=0, placement=ps.placement, fitted_on="decode", router=ps.router))
            if ps.group_of_test_R is not None:
                groups[n] = ps.group_of_test_R
    else:
        missing.append(
            f"The trace recorded {'prefill' if has_p else 'decode'} routing only: no advice on "
            f"{'decode' if has_p else 'prefill'} steps, no prefill/decode correlation, and no joint placement "
            "(its router reads a request's prefill and places its decode)."
        )
    data = with_held_out_tokens(data) if has_d else _prefill_tokens(data)
    train = np.flatnonzero(~data.is_test_R)
    order = np.arange(len(data.is_test_R))  # counts rows are in request-id (arrival) order
    stages: dict[Steps, StageInput] = {}
    extra_tokens: dict[tuple[str, Steps], StepTokens] = {}
    if has_d:
        assert data.test_topk_ids_TLK is not None
        rows, step, src, _ = held_out_batches(data, ccfg, None)
        stages["decode"] = StageInput(
            fit_LE=_sum_rows(data.decode_RLE, train),
            windows_NLE=_windows(data.decode_RLE, order, cfg.num_windows),
            tokens=StepTokens(data.test_topk_ids_TLK[rows], step, src, cfg.num_steps),
            pairs_per_step=float(cfg.step_requests * data.model.top_k),
        )
        for key, group in groups.items():
            jr, js, jsrc, _ = held_out_batches(data, ccfg, group)
            extra_tokens[(key, "decode")] = StepTokens(data.test_topk_ids_TLK[jr], js, jsrc, cfg.num_steps)
    if has_p:
        nb = ccfg.num_prefill_batches if has_d else max(4, cfg.num_steps // 100)
        pcfg = replace(ccfg, num_batches=nb) if not has_d else ccfg
        drawn = prefill_batches(data, pcfg, None)
        if drawn is not None:
            assert data.test_prefill_ids_TLK is not None
            prow, pstep, psrc = drawn
            stages["prefill"] = StageInput(
                fit_LE=_sum_rows(data.prefill_RLE, train),
                windows_NLE=_windows(data.prefill_RLE, order, cfg.num_windows),
                tokens=StepTokens(data.test_prefill_ids_TLK[prow], pstep, psrc, pcfg.num_prefill_batches),
                pairs_per_step=float(cfg.prefill_tokens_per_node * dep.num_groups * data.model.top_k),
            )
            for key, group in groups.items():
                if (jd := prefill_batches(data, pcfg, group)) is not None:
                    extra_tokens[(key, "prefill")] = StepTokens(
                        data.test_prefill_ids_TLK[jd[0]], jd[1], jd[2], pcfg.num_prefill_batches
                    )
    inputs = AdviseInputs(
        model=data.model,
        source=str(trace),
        kind="trace",
        stages=stages,
        current=None if cur is None else cur[0],
        current_format="" if cur is None else cur[1],
        extra=tuple(extra),
        extra_tokens=extra_tokens,
        routable=has_p and has_d,
        missing=tuple(missing),
    )
    return advise_arrays(inputs, cfg, progress=progress)


# ------------------------------------------------------------------------------ from a profile
def advise_profile_counts(
    model: ModelInfo,
    counts: dict[str, np.ndarray],
    cfg: AdviseConfig,
    *,
    source: str,
    window_tokens: float | dict[str, float] | None = None,
    current: Placement | None = None,
    current_format: str = "",
) -> Advice:
    """The advice on a load profile: per stage, windows of expert counts in time order (int [N, L, E]);
    the first half fits the placements, the later half is evaluated (balancedness per window; the
    per-step terms on each window scaled to one step of ``step_requests`` decode tokens or
    ``prefill_tokens_per_node`` prompt tokens per node). One window (one engine statistics file) is
    fitted and evaluated in-sample, with no drift estimate (said in the output). ``window_tokens``
    only documents the windows."""
    del window_tokens  # the windows' counts are what is evaluated; steps are the config's
    stages: dict[Steps, StageInput] = {}
    K = model.top_k
    mixed = "mixed" in counts and "prefill" not in counts and "decode" not in counts
    if mixed:  # the engine's recorder counted both stages together (SGLang stat, TensorRT-LLM): one stage
        counts = {"decode": counts["mixed"]}
    for st in ("prefill", "decode"):
        if st not in counts:
            continue
        c = np.asarray(counts[st], dtype=np.float64)
        if c.ndim != 3 or c.shape[1:] != (model.num_moe_layers, model.num_experts) or len(c) < 1:
            raise ConfigError(
                f"profile counts of {st} must be [windows >= 1, {model.num_moe_layers} layers, {model.num_experts} experts], "
                f"got {c.shape}"
            )
        half = len(c) // 2
        fit, evaluated = (c[:half], c[half:]) if half else (c, c)  # one window: in-sample
        step_tokens = cfg.step_requests if st == "decode" else cfg.prefill_tokens_per_node * cfg.deployment.num_groups
        stages[st] = StageInput(
            fit_LE=fit.sum(axis=0), windows_NLE=c, counts_NLE=evaluated, pairs_per_step=float(step_tokens * K)
        )
    if not stages:
        raise ConfigError("the profile holds neither prefill nor decode counts")
    missing = [
        "A load profile holds counts, not tokens: distinct destination ranks per token are n/a, the copy model "
        "is one copy per (token, expert) in both stages (a trace's prefill steps count one per node), and ours (joint) and the other grouped strategies "
        "need per-request routing."
    ]
    if mixed:
        missing.append(
            "The profile's counts mix prefill and decode (the engine's recorder does not tell them apart): advised "
            "as one stage under the decode step model; the verdict labelled decode is for that mixed traffic."
        )
    elif len(stages) == 1:
        have = next(iter(stages))
        missing.append(
            f"The profile has {have} counts only: no advice on the other stage, no prefill/decode correlation."
        )
    inputs = AdviseInputs(
        model=model,
        source=source,
        kind="profile",
        stages=stages,
        current=current,
        current_format=current_format,
        missing=tuple(missing),
    )
    if cfg.strategies:  # refuse what a profile cannot build before any evaluation
        resolve_strategies(cfg.strategies, model=model, deployment=cfg.deployment, routable=False, kind="profile")
    return advise_arrays(inputs, cfg)


def advise_profile(path: str | os.PathLike, cfg: AdviseConfig, *, current: str | os.PathLike | None = None) -> Advice:
    """The advice on a load profile file (``moetrace.tracer.trace.profile``, docs/profile.md)."""
    from moetrace.tracer.trace import profile as prof

    p = prof.open_profile(path)
    cur = None
    if current is not None:
        from moetrace.placement.advise_current import read_current

        cur = read_current(current, model=p.model, num_ranks=cfg.deployment.num_ep)
    return advise_profile_counts(
        p.model,
        dict(p.counts),
        cfg,
        source=str(path),
        current=None if cur is None else cur[0],
        current_format="" if cur is None else cur[1],
    )


def is_profile(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a load profile."""
    from moetrace.tracer.trace import profile as prof

    return bool(prof.is_profile(path))


def advise_input(
    path: str | os.PathLike,
    cfg: AdviseConfig,
    *,
    current: str | os.PathLike | None = None,
    progress: Callable[[int, int], None] | None = None,
    count_progress: Callable[[int, int], None] | None = None,
) -> Advice:
    """The advice on ``path``: a load profile when it is one, else a trace."""
    if is_profile(path):
        return advise_profile(path, cfg, current=current)
    return advise_trace(path, cfg, current=current, progress=progress, count_progress=count_progress)
