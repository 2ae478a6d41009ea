"""``moetrace advise``: should this deployment enable EPLB, with how many redundant experts, and what
does a data-based placement add, answered per stage in the engines' own terms.

For each recorded stage (prefill, decode, and both together) and each option (the placement served
now, ``--current``, or linear, vLLM's default; round robin; DeepSeek's EPLB with R redundant slots
for every R of ``advise_metrics.redundancy_sweep``; ours, ``joint``, where per-request routing allows:
a trace with prefill) this module measures, per MoE layer and step, then summarised:

- balancedness as vLLM logs it, the busiest rank's (token, expert) pairs, activated experts per GPU,
  distinct destination ranks per token (``advise_metrics``);
- inter-node bytes, predicted all-to-all and MoE-layer seconds per step from the cost model
  (``simulate.simulate_volume`` with ``cost.CostModel`` on a trace's simulated steps; the cost
  model's formulas on expected traffic for a load profile), with the step-to-step spread;
- migration from the placement served now (``advise_metrics.migration``) and the memory the
  redundant slots take per GPU.

Then one verdict per stage in plain words (``verdicts``): the smallest EPLB sweep point within 1 %
of the best predicted MoE-layer time, its gain with p10-p90, the weights that move; "no gain" when
that is the truth and why: already balanced, imbalance that moves from window to window faster than
a static placement follows (a placement fitted on earlier windows against one refitted on every
later window), or step-to-step noise that no static placement removes. Prefill and decode loads'
correlation says whether one placement can serve both. Each recommended option comes with the
``moetrace place`` / ``moetrace export`` commands for every engine (``exports.PLACEMENT_EXPORTS``).

Inputs: a trace (requests split into placement and held-out ones as ``compare`` splits them, so
``moetrace place --strategy eplb`` reproduces the decode EPLB placement advised; the held-out
requests' steps are drawn by ``compare.held_out_batches`` / ``prefill_batches``) or a load profile
(windows of expert counts in time order: the first half fits, the rest is evaluated; no tokens,
so no send-ranks-per-token and the per-(token, expert) copy model only).

Shape legend (docs/architecture.md): N windows, B steps, R requests, L MoE layers, E logical
experts, P physical slots, W EP ranks, G nodes, T tokens, K top-k slots, S stages.

Out of scope: the placers (``eplb``, ``baselines``, ``joint``), the volume and cost models
(``simulate``, ``cost``), engine files (``exports``); time-varying rebalancing schedules (vLLM's
``step_interval``): every option here is a static placement.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np

from moetrace import results as rf
from moetrace.errors import ConfigError, TraceFormatError
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
from moetrace.placement.deployment import Deployment
from moetrace.placement.hardware import CostModel, Hardware, default_hardware
from moetrace.placement.maps import Placement
from moetrace.placement.simulate import layer_copies
from moetrace.placement.step_model import DedupUnit, copy_model, layer_seconds

if TYPE_CHECKING:
    from moetrace.placement.compare import TraceData
    from moetrace.placement.routers import Router
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
]

Stage = Literal["prefill", "decode", "both"]
Steps = Literal["prefill", "decode"]
STAGES: tuple[Stage, ...] = ("prefill", "decode", "both")

#: a gain below this share of the reference's predicted MoE-layer time is reported as no gain
MIN_GAIN = 0.03
#: a reference at least this balanced (vLLM's figure, median over steps) is "already balanced"
BALANCED = 0.90
#: EPLB sweep points within this share of the best predicted time count as equally good (the fewest slots win)
WITHIN_BEST = 0.01
#: balancedness a placement refitted on the window before must gain over a static one to call the load moving
DRIFT_GAP = 0.02
#: prefill and decode loads correlating below this are better balanced separately
SEPARATE_BELOW = 0.80


@dataclass(frozen=True, kw_only=True)
class AdviseConfig:
    """What to sweep and how to evaluate it."""

    deployment: Deployment  # DPaTPbEPc[TPd] on nodes of g GPUs
    max_slots_per_gpu: int = 0  # slot limit per GPU and layer for the EPLB sweep (0: E/W + 2)
    num_steps: int = 200  # decode steps simulated on a trace (each takes batch_requests tokens)
    batch_requests: int = 0  # requests per decode step (0: 32 per node)
    prefill_tokens_per_node: int = 1024  # chunked-prefill tokens per node and prefill step
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
        return self.batch_requests or 32 * self.deployment.num_groups


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
class Option:
    """One placement advise evaluates."""

    name: str  # "current", "linear", "round_robin", "eplb", "joint"
    num_redundant: int  # R: redundant slots per layer
    placement: Placement  # over the MoE layers
    fitted_on: str = ""  # the stage whose load it was fitted on ("" for data-free placements)
    router: Router | None = None  # the serving router of a grouped placement (joint)

    @property
    def key(self) -> str:
        """``eplb-64``, ``linear``: unique within a stage."""
        return f"{self.name}-{self.num_redundant}" if self.name == "eplb" else self.name

    @property
    def label(self) -> str:
        names = {"current": "current", "linear": "linear (vLLM default)", "round_robin": "round robin"}
        if self.name == "eplb":
            return f"EPLB, {self.num_redundant} redundant"
        return names.get(self.name, "joint (ours)" if self.name == "joint" else self.name)


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
    joint: Option | None = None  # ours, where per-request routing allows
    joint_tokens: dict[Steps, StepTokens] = field(default_factory=dict)  # its steps (drawn through its router)
    missing: tuple[str, ...] = ()  # what the input lacks, in words (said in the verdicts)


@dataclass(frozen=True, kw_only=True)
class Advice:
    """What ``advise_arrays`` found: summary rows, per-layer rows, verdicts, commands, placements."""

    manifest: dict[str, Any]  # the advice.json body (config, verdicts, commands, correlations, drift)
    rows: list[dict[str, Any]]  # one per (stage, steps, option): the summary (options.parquet)
    layer_rows: dict[str, np.ndarray]  # columns of layers.parquet (stage, steps, option, layer, measures)
    placements: dict[str, Option] = field(default_factory=dict)  # file stem -> a recommended option to write

    @property
    def verdicts(self) -> list[str]:
        return [v["text"] for v in self.manifest["verdicts"]]


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
) -> StepMetrics:
    """One placement on a trace's simulated steps, one pass over the layers: the routing and copies of
    ``simulate.layer_copies`` (replica policy ``same_node``), priced by the one step model
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
    copies = layer_copies(
        ids,
        placement=placement,
        batch_T=step_T,
        src_rank_T=src_T,
        num_batches=B,
        num_ranks=W,
        ranks_per_node=g,
        dedup=dedup,
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
) -> StepMetrics:
    """One placement on a profile's windows of counts (float [N, L, E]): balancedness and the busiest
    rank per window (replicas share an expert's tokens evenly); the per-step terms (activated
    experts, copies, seconds) on the window scaled to a step of ``pairs_per_step`` (token, expert)
    pairs, under one copy per (token, expert) from sources spread evenly (``expected_traffic``).
    No tokens, so no destination ranks per token (NaN)."""
    W, g = deployment.num_ep, deployment.ranks_per_node
    c = np.asarray(counts_NLE, dtype=np.float64)
    N, L, _ = c.shape
    load_NLW = expected_rank_load(c, placement, num_ranks=W)
    total_N = load_NLW.sum(axis=2).mean(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        scale_N = np.where(total_N > 0, pairs_per_step / np.where(total_N > 0, total_N, 1.0), 0.0)
    step_NLW = load_NLW * scale_N[:, None, None]
    active_NLW = expected_active_slots(c, placement, num_ranks=W, pairs_per_step_N=np.full(N, pairs_per_step))
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
def _data_free(name: str, *, model: ModelInfo, deployment: Deployment, num_redundant: int) -> Placement:
    from moetrace.placement.baselines import linear, round_robin

    fn = linear if name == "linear" else round_robin
    return fn(
        num_layers=model.num_moe_layers,
        num_experts=model.num_experts,
        num_slots=model.num_experts + num_redundant,
        num_ranks=deployment.num_ep,
    )


def _eplb(load_LE: np.ndarray, *, model: ModelInfo, deployment: Deployment, num_redundant: int) -> Placement:
    """EPLB exactly as ``strategies``' ``eplb`` row builds it (the model's router groups, every node)."""
    from moetrace.placement.eplb import rebalance

    return rebalance(
        np.asarray(load_LE, dtype=np.float64),
        num_replicas=model.num_experts + num_redundant,
        num_groups=model.n_group or 1,
        num_nodes=deployment.num_nodes,
        num_gpus=deployment.num_ep,
    )


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

    ref_opt = (
        Option(name="current", num_redundant=inputs.current.phy2log.shape[1] - E, placement=inputs.current)
        if inputs.current is not None
        else Option(
            name="linear", num_redundant=0, placement=_data_free("linear", model=m, deployment=dep, num_redundant=0)
        )
    )
    fixed = [ref_opt]
    if ref_opt.name != "linear":
        fixed.append(
            Option(
                name="linear", num_redundant=0, placement=_data_free("linear", model=m, deployment=dep, num_redundant=0)
            )
        )
    fixed.append(
        Option(
            name="round_robin",
            num_redundant=0,
            placement=_data_free("round_robin", model=m, deployment=dep, num_redundant=0),
        )
    )
    options: dict[Stage, list[Option]] = {}
    for st in stages:
        load = _fit_stage_load(inputs, st)
        eplbs = [
            Option(
                name="eplb",
                num_redundant=r,
                placement=_eplb(load, model=m, deployment=dep, num_redundant=r),
                fitted_on=st,
            )
            for r in sweep
        ]
        options[st] = [*fixed, *eplbs, *([inputs.joint] if inputs.joint is not None and st != "both" else [])]

    def job_key(opt: Option, steps: Steps) -> tuple[str, str, Steps]:
        return (opt.fitted_on, opt.key, steps)

    def evaluate(job: tuple[Option, Steps]) -> StepMetrics:
        opt, steps = job
        si = inputs.stages[steps]
        toks = inputs.joint_tokens.get(steps) if opt.name == "joint" else si.tokens
        if toks is not None:
            return evaluate_tokens(
                toks,
                opt.placement,
                deployment=dep,
                dedup=cfg.decode_dedup if steps == "decode" else cfg.prefill_dedup,
                cost=cost,
                bytes_per_token=bytes_per_token,
                hidden_size=time_hidden,
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
    verdicts, recommended = _verdicts(
        rows, stages=stages, ref=ref_opt, drift=drift, correlation=correlation, inputs=inputs
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
        "missing": list(inputs.missing),
        "redundancy_sweep": sweep,
        "max_slots_per_gpu": cfg.slot_limit(E),
        "num_steps": {s: int(_num_steps(inputs, s)) for s in recorded},
        "decode_dedup": cfg.decode_dedup,
        "prefill_dedup": cfg.prefill_dedup,
        "hardware": cfg.hardware.to_json(),
        "expert": None if expert is None else expert.to_json(),
        "test_fraction": cfg.test_fraction,
        "seed": cfg.seed,
        "prefill_decode_correlation": correlation,
        "drift": drift,
        "verdicts": verdicts,
        "recommended": [
            {"stage": st, "option": key, "placement": f"placements/{st}-{key}.json"} for st, key in recommended
        ],
    }
    return Advice(manifest=manifest, rows=rows, layer_rows=_layer_arrays(layer_cols), placements=placements)


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


def _drift(inputs: AdviseInputs, stage: Stage, *, cfg: AdviseConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Does the imbalance move faster than a static placement follows? On the windows in arrival order,
    balancedness (vLLM's figure, mean over the later half of the windows) of: the reference; EPLB fitted
    on the first half (``static``); EPLB refitted on the window before each one (``lagged``: a placement
    that follows one window late, as a periodic rearrangement does); EPLB fitted on each window itself
    (``own``: a ceiling no deployed placement reaches, since it knows the window's load in advance). All
    at the recommended sweep point (else the largest). Moving load: ``lagged`` beats ``static``; load
    that changes faster than any placement follows: ``own`` far above both."""
    m, dep = inputs.model, cfg.deployment
    w_NLE = _stage_windows(inputs, stage)
    N = len(w_NLE)
    if N < 4:
        return {"num_windows": N, "skipped": "fewer than 4 windows"}
    half = N // 2
    own: Steps = "decode" if stage == "both" else stage
    cand = [r for r in rows if r["stage"] == stage and r["strategy"] == "eplb" and r["steps"] == own]
    best = _best_eplb(cand)
    R = int(best["num_redundant"]) if best is not None else max(int(r["num_redundant"]) for r in cand)
    W = dep.num_ep

    def fitted(load_LE: np.ndarray) -> Placement:
        return _eplb(load_LE, model=m, deployment=dep, num_redundant=R)

    def b(w_LE: np.ndarray, placement: Placement) -> float:
        return float(vllm_balancedness(expected_rank_load(w_LE[None], placement, num_ranks=W))[0])

    ref, static = _ref_placement(inputs, m=m, dep=dep), fitted(w_NLE[:half].sum(0))
    later = range(half, N)
    return {
        "num_windows": N,
        "num_redundant": R,
        "reference": _mean_or_nan(np.array([b(w_NLE[i], ref) for i in later])),
        "static": _mean_or_nan(np.array([b(w_NLE[i], static) for i in later])),
        "lagged": _mean_or_nan(np.array([b(w_NLE[i], fitted(w_NLE[i - 1])) for i in later])),
        "own": _mean_or_nan(np.array([b(w_NLE[i], fitted(w_NLE[i])) for i in later])),
    }


def _mean_or_nan(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    return round(float(np.nanmean(x)), 4) if np.isfinite(x).any() else float("nan")


def _ref_placement(inputs: AdviseInputs, *, m: ModelInfo, dep: Deployment) -> Placement:
    """The reference placement: ``--current``, else linear."""
    if inputs.current is not None:
        return inputs.current
    return _data_free("linear", model=m, deployment=dep, num_redundant=0)


def _best_eplb(cand: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The smallest sweep point within ``WITHIN_BEST`` of the best predicted MoE-layer time (all-to-all
    time when the expert size is unknown); None without candidates."""
    if not cand:
        return None
    key = "moe_vs_ref" if all(np.isfinite(r["moe_vs_ref"]) for r in cand) else "a2a_vs_ref"
    if not all(np.isfinite(r[key]) for r in cand):
        key = "balancedness_vllm"
        best = max(r[key] for r in cand)
        return min((r for r in cand if r[key] >= best - WITHIN_BEST), key=lambda r: r["num_redundant"])
    best = min(r[key] for r in cand)
    return min((r for r in cand if r[key] <= best * (1 + WITHIN_BEST)), key=lambda r: r["num_redundant"])


# ------------------------------------------------------------------------------ verdicts
def _pct(x: float) -> str:
    """A ratio as a signed change: ``0.83`` -> ``−17 %``, ``1.004`` -> ``+0.4 %``."""
    v = (x - 1.0) * 100
    return (f"{v:+.1f} %" if abs(v) < 9.95 else f"{v:+.0f} %").replace("-", "−")


def _gb(x: float | None) -> str:
    return "n/a (expert size unknown)" if x is None else f"{x / 1e9:.1f} GB"


def _time_key(r0: dict[str, Any]) -> tuple[str, str]:
    """The time a verdict ranks by: MoE-layer time, or all-to-all time when the expert size is unknown."""
    if np.isfinite(r0["moe_vs_ref"]):
        return "moe", "predicted MoE-layer time"
    return "a2a", "predicted all-to-all time"


def _enable_text(who: str, best: dict[str, Any], b0: float, change: str) -> str:
    red = (
        f"with {best['num_redundant']} redundant experts"
        if best["num_redundant"]
        else "without redundant experts (a rearrangement only)"
    )
    return (
        f"{who}: enable EPLB {red}: balancedness {b0:.2f} → {best['balancedness_vllm']:.2f}, {change}, "
        f"{_gb(best['bytes_moved'])} of weights move once ({best['experts_moved']} expert copies), "
        f"{_gb(best['extra_bytes_per_gpu'])} more per GPU for the redundant slots."
    )


def _stage_weights(inputs: AdviseInputs) -> dict[str, float]:
    """Steps each stage's traffic takes (its routed pairs over the pairs of one step): how a placement
    serving both stages weighs their step times."""
    return {
        st: float(si.fit_LE.sum() / max(si.fit_LE.shape[0], 1)) / si.pairs_per_step if si.pairs_per_step > 0 else 0.0
        for st, si in inputs.stages.items()
    }


def _verdicts(
    rows: list[dict[str, Any]],
    *,
    stages: list[Stage],
    ref: Option,
    drift: dict[Stage, dict[str, Any]],
    correlation: float | None,
    inputs: AdviseInputs,
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """One verdict per stage in plain words, with the numbers behind it; and the recommended (stage,
    option key) pairs (their placement files and commands). The placement of ``both`` serves prefill
    and decode steps, weighed by the steps each stage's traffic takes (``_stage_weights``)."""
    out: list[dict[str, Any]] = []
    recommended: list[tuple[str, str]] = []
    weights = _stage_weights(inputs)
    for st in stages:
        here = [r for r in rows if r["stage"] == st]
        r0_by = {r["steps"]: r for r in here if r["option"] == ref.key}
        tk, what = _time_key(next(iter(r0_by.values())))
        if st == "both":
            # one row per option: its step time weighed over both stages, over the reference's
            def weighed(key: str, here: list[dict[str, Any]] = here, tk: str = tk) -> float:
                return sum(weights[r["steps"]] * r[f"{tk}_seconds_per_step"] for r in here if r["option"] == key)

            total0 = weighed(ref.key)
            cand = []
            for r in (r for r in here if r["strategy"] == "eplb" and r["steps"] == "decode"):
                cand.append({**r, f"{tk}_vs_ref": weighed(r["option"]) / total0 if total0 > 0 else float("nan")})
            best = _best_eplb(cand)
            assert best is not None
            per = {r["steps"]: r for r in here if r["option"] == best["option"]}
            change = (
                f"{what} weighed over both stages {_pct(best[f'{tk}_vs_ref'])} ("
                + ", ".join(f"{s} steps {_pct(per[s][f'{tk}_vs_ref'])}" for s in ("decode", "prefill") if s in per)
                + ")"
            )
            b0 = r0_by["decode"]["balancedness_vllm"]
            who = "Both stages with one placement"
        else:
            r0 = r0_by[st]
            best = _best_eplb([r for r in here if r["strategy"] == "eplb"])
            assert best is not None
            spread = f"p10–p90 {_pct(best[f'{tk}_vs_ref_p10'])}…{_pct(best[f'{tk}_vs_ref_p90'])}"
            change = f"{what} {_pct(best[f'{tk}_vs_ref'])} ({spread})"
            b0 = r0["balancedness_vllm"]
            who = st.capitalize()
        gain = 1.0 - best[f"{tk}_vs_ref"]
        if gain >= MIN_GAIN:
            verdict, option = "enable", best["option"]
            text = _enable_text(who, best, b0, change)
            recommended.append((st, best["option"]))
            d = drift.get(st, {})
            if d.get("lagged", float("nan")) - d.get("static", float("nan")) > DRIFT_GAP:
                text += (
                    f" The load also moves between windows: refitted on the window before, EPLB keeps balancedness "
                    f"{d['lagged']:.2f} against {d['static']:.2f} fitted once: rebalance periodically (vLLM's "
                    "--eplb-config step_interval)."
                )
        else:
            verdict, option = "no gain", None
            text = (
                f"{who}: no gain from EPLB: the best sweep point ({best['num_redundant']} redundant) gives {change} "
                f"(balancedness {b0:.2f} → {best['balancedness_vllm']:.2f}); "
                f"{_no_gain_reason(b0, best, drift.get(st, {}))}."
            )
        joint = next((r for r in here if r["strategy"] == "joint"), None)
        if joint is not None:
            jt = joint[f"{tk}_vs_ref"]
            base = best if verdict == "enable" else r0_by[st]
            ib = base["inter_node_bytes_per_step"]
            dbytes = joint["inter_node_bytes_per_step"] / ib if ib else float("nan")
            vs = f"that EPLB's {_pct(best[f'{tk}_vs_ref'])}" if verdict == "enable" else f"{ref.label}"
            if np.isfinite(jt) and 1.0 - jt >= MIN_GAIN and jt < best[f"{tk}_vs_ref"]:
                text += (
                    f" Ours (joint) reaches {what} {_pct(jt)} (against {vs}) with {_pct(dbytes)} inter-node bytes, "
                    f"but needs the prefill router (placement file: placements/{st}-joint.json)."
                )
                recommended.append((st, "joint"))
            else:
                text += f" Ours (joint): {what} {_pct(jt)}, inter-node bytes {_pct(dbytes)}: not worth its router here."
        out.append({"stage": st, "verdict": verdict, "option": option, "text": text})
    if correlation is not None and "both" in stages:
        sep = correlation < SEPARATE_BELOW
        gains = any(v["verdict"] == "enable" for v in out)
        advice = (
            "balance them separately (one placement per stage, as with prefill/decode disaggregation)."
            if sep and gains
            else "one placement can serve both."
            if gains
            else "neither stage gains from a placement, so there is nothing to balance separately."
        )
        sep = sep and gains
        text = f"Prefill and decode loads correlate {correlation:.2f}: {advice}"
        out.append({"stage": "both", "verdict": "separate" if sep else "together", "option": None, "text": text})
    for miss in inputs.missing:
        out.append({"stage": None, "verdict": "missing", "option": None, "text": miss})
    return out, list(dict.fromkeys(recommended))


def _no_gain_reason(b0: float, best: dict[str, Any], drift: dict[str, Any]) -> str:
    static, lagged, own = (drift.get(k, float("nan")) for k in ("static", "lagged", "own"))
    if np.isfinite(b0) and b0 >= BALANCED:
        return f"already balanced (balancedness {b0:.2f} ≥ {BALANCED:.2f})"
    if all(np.isfinite(x) for x in (static, lagged, own)):
        seen = (
            f"on the later windows EPLB fitted on the first half reaches balancedness {static:.2f}, refitted on "
            f"the window before {lagged:.2f}, fitted on each window itself {own:.2f}"
        )
        if lagged - static > DRIFT_GAP:
            return f"the imbalance moves from window to window: a static placement cannot follow it ({seen}); rebalance periodically instead"
        if own - max(static, lagged) > 2 * DRIFT_GAP + 0.05:
            return f"the imbalance moves from window to window faster than any placement can follow ({seen})"
    if best["balancedness_vllm"] - b0 < 0.05:
        return "the step-to-step imbalance is noise of small batches that no static placement removes"
    return "better balance does not shorten the step here (the all-to-all or the activated experts decide it)"


# ------------------------------------------------------------------------------ commands
def commands(advice: Advice, *, out: str | os.PathLike) -> list[dict[str, Any]]:
    """The ``moetrace place`` / ``moetrace export`` commands of every recommended option, per engine
    (``out``: the advice directory holding its placement files)."""
    from moetrace.placement.exports import PLACEMENT_EXPORTS

    out_cmds = []
    suffix = {"sglang": "json", "trtllm": "yaml", "vllm": "json", "vllm-ascend": "json"}
    man = advice.manifest
    input_path, config = man["input"], man["deployment"]
    gpn = f" --gpus-per-node {man['gpus_per_node']}" if man["gpus_per_node"] != 8 else ""
    for rec in man["recommended"]:
        st, key = rec["stage"], rec["option"]
        opt = advice.placements[f"{st}-{key}"]
        path = f"{out}/{rec['placement']}"
        place = None
        if man["input_kind"] == "trace" and (st == "decode" and opt.name == "eplb" or opt.name == "joint"):
            red = f" --redundancy {opt.num_redundant}" if opt.num_redundant else ""
            place = (
                f"moetrace place {input_path} --config {config}{gpn} --strategy {opt.name}{red} "
                f"--test-fraction {man['test_fraction']} --seed {man['seed']} -o {st}-{key}.json"
            )
        exports: dict[str, str] = {
            fmt: f"moetrace export {path} --format {fmt} -o {st}-{key}.{fmt}.{suffix[fmt]}" for fmt in PLACEMENT_EXPORTS
        }
        if man["input_kind"] == "trace" and opt.name == "eplb":
            stage_arg = "both" if st == "both" else st
            exports["sglang (counts; SGLang runs its own EPLB)"] = (
                f"moetrace export {input_path} --format sglang-logical-count --stage {stage_arg} -o logical_count.json"
            )
        out_cmds.append({"stage": st, "option": key, "placement": path, "place": place, "export": exports})
    return out_cmds


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
    rng = np.random.default_rng(cfg.seed)  # compare's split (load_trace_data), so the same seed splits alike
    n_test = min(max(1, int(round(R * cfg.test_fraction))), R - 1)
    is_test = np.zeros(R, dtype=bool)
    is_test[rng.permutation(R)[:n_test]] = True
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
    from moetrace.tracer.trace.reader import open_trace

    dep = cfg.deployment
    model = open_trace(trace).model  # the manifest only: the checks below come before minutes of counting
    cfg.sweep(model.num_experts)
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
        num_batch_requests=cfg.batch_requests,
        dedup=cfg.decode_dedup,
        seed=cfg.seed,
        oracle=False,
        prefill_dedup=cfg.prefill_dedup,
        hardware=cfg.hardware,
        prefill_tokens_per_node=cfg.prefill_tokens_per_node,
    )
    joint, group = None, None
    missing: list[str] = []
    has_p, has_d = "prefill" in data.stages, "decode" in data.stages
    if has_p and has_d:
        ps = make_placement(data, ccfg, "joint")  # fitted before the held-out tokens are read (memory)
        joint = Option(name="joint", num_redundant=0, placement=ps.placement, fitted_on="decode", router=ps.router)
        group = ps.group_of_test_R
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
    joint_tokens: dict[Steps, StepTokens] = {}
    if has_d:
        assert data.test_topk_ids_TLK is not None
        rows, step, src, _ = held_out_batches(data, ccfg, None)
        stages["decode"] = StageInput(
            fit_LE=_sum_rows(data.decode_RLE, train),
            windows_NLE=_windows(data.decode_RLE, order, cfg.num_windows),
            tokens=StepTokens(data.test_topk_ids_TLK[rows], step, src, cfg.num_steps),
            pairs_per_step=float(cfg.step_requests * data.model.top_k),
        )
        if group is not None:
            jr, js, jsrc, _ = held_out_batches(data, ccfg, group)
            joint_tokens["decode"] = StepTokens(data.test_topk_ids_TLK[jr], js, jsrc, cfg.num_steps)
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
            if group is not None and (jd := prefill_batches(data, pcfg, group)) is not None:
                joint_tokens["prefill"] = StepTokens(
                    data.test_prefill_ids_TLK[jd[0]], jd[1], jd[2], pcfg.num_prefill_batches
                )
    inputs = AdviseInputs(
        model=data.model,
        source=str(trace),
        kind="trace",
        stages=stages,
        current=None if cur is None else cur[0],
        current_format="" if cur is None else cur[1],
        joint=joint,
        joint_tokens=joint_tokens,
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
    ``prefill_tokens_per_node`` prompt tokens per node). ``window_tokens`` only documents the windows."""
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
        if c.ndim != 3 or c.shape[1:] != (model.num_moe_layers, model.num_experts) or len(c) < 2:
            raise ConfigError(
                f"profile counts of {st} must be [windows >= 2, {model.num_moe_layers} layers, {model.num_experts} experts], "
                f"got {c.shape}"
            )
        half = len(c) // 2
        step_tokens = cfg.step_requests if st == "decode" else cfg.prefill_tokens_per_node * cfg.deployment.num_groups
        stages[st] = StageInput(
            fit_LE=c[:half].sum(axis=0), windows_NLE=c, counts_NLE=c[half:], pairs_per_step=float(step_tokens * K)
        )
    if not stages:
        raise ConfigError("the profile holds neither prefill nor decode counts")
    missing = [
        "A load profile holds counts, not tokens: distinct destination ranks per token are n/a, the copy model "
        "is one copy per (token, expert) whatever --dedup says, and ours (joint) needs per-request routing."
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


# ------------------------------------------------------------------------------ result files
def write_advice(advice: Advice, out: str | os.PathLike, *, deployment: Deployment) -> list[Path]:
    """Write the advice directory (``moetrace.results.ADVICE``): ``options.parquet``, ``layers.parquet``,
    the recommended placements under ``placements/``, and ``advice.json`` (with the ``commands``) last.
    Returns the paths."""
    import polars as pl

    from moetrace.placement.exports import PlacementFile, save_placement
    from moetrace.placement.routers import NoRouter
    from moetrace.tracer.trace.schema import ModelInfo

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    model = ModelInfo.from_dict(advice.manifest["model"])
    for stem, opt in advice.placements.items():
        p = out / "placements" / f"{stem}.json"
        pf = PlacementFile(
            model=model,
            deployment=deployment,
            strategy=opt.name,
            placement=opt.placement,
            router=opt.router if opt.router is not None else NoRouter(),
            source={
                "advise": rf.recorded_path(advice.manifest["input"], results_dir=p.parent),
                "fitted_on": opt.fitted_on or None,
                "option": opt.key,
            },
        )
        save_placement(pf, p)
        written.append(p)
    written.append(rf.write_result_table(out, rf.ADVICE, rf.ADVICE_OPTIONS, pl.DataFrame(advice.rows)))
    written.append(rf.write_result_table(out, rf.ADVICE, rf.ADVICE_LAYERS, pl.DataFrame(advice.layer_rows)))
    body = {**advice.manifest, "commands": commands(advice, out=out)}
    for key in ("input", "trace"):  # relative to the results: no absolute path of the user's machine
        if isinstance(body.get(key), str):
            body[key] = rf.recorded_path(body[key], results_dir=out)
    written.append(rf.write_result_json(out, rf.ADVICE, rf.ADVICE_MANIFEST, _plain(body)))
    return written


def _plain(x: Any) -> Any:
    """``x`` with numpy scalars as Python numbers and NaN as null (strict JSON)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, np.integer | bool):
        return x if isinstance(x, bool) else int(x)
    if isinstance(x, float | np.floating):
        return None if np.isnan(x) else float(x)
    return x


def format_advice(advice: Advice, *, out: str | os.PathLike) -> str:
    """The verdicts, a table of the options per stage and the commands, as ``moetrace advise`` prints them."""
    man = advice.manifest
    lines = [
        f"moetrace advise: {man['input']} ({man['input_kind']}), {man['deployment']}, reference {man['reference']}"
    ]
    if man.get("expert") is None:  # the time column is then all-to-all time; say why and how to give the size
        from moetrace.placement.cost import expert_unknown_reason
        from moetrace.tracer.trace.schema import ModelInfo

        reason = expert_unknown_reason(ModelInfo.from_dict(man["model"]))
        lines.append(reason or "MoE-layer time n/a: the expert size is unknown")
    for st in man["stages"]:
        for steps in dict.fromkeys(r["steps"] for r in advice.rows if r["stage"] == st):
            lines.append(f"\n{st} placement, {steps} steps:")
            lines.append(
                f"  {'option':<28} {'balanced':>8} {'busiest':>8} {'act/GPU':>7} {'ranks/tok':>9} {'MoE time':>9} "
                f"{'[p10, p90]':>15} {'inter B':>8} {'moved':>9}"
            )
            for r in (r for r in advice.rows if r["stage"] == st and r["steps"] == steps):
                moved = "—" if r["bytes_moved"] is None else f"{r['bytes_moved'] / 1e9:.1f} GB"
                t = r["moe_vs_ref"] if np.isfinite(r["moe_vs_ref"]) else r["a2a_vs_ref"]
                t10 = r["moe_vs_ref_p10"] if np.isfinite(r["moe_vs_ref"]) else r["a2a_vs_ref_p10"]
                t90 = r["moe_vs_ref_p90"] if np.isfinite(r["moe_vs_ref"]) else r["a2a_vs_ref_p90"]
                sr = "n/a" if np.isnan(r["send_ranks_per_token"]) else f"{r['send_ranks_per_token']:.2f}"
                lines.append(
                    f"  {r['label']:<28} {r['balancedness_vllm']:>8.3f} {r['busiest_rank_tokens']:>8.1f} "
                    f"{r['activated_experts_per_gpu_max']:>7.2f} {sr:>9} {t:>9.3f} [{t10:.3f}, {t90:.3f}] "
                    f"{r['inter_node_vs_ref']:>8.3f} {moved:>9}"
                )
    lines.append("")
    lines += [v["text"] for v in man["verdicts"]]
    for c in commands(advice, out=out):
        lines.append(f"\n{c['stage']}: {c['option']} (placement file {c['placement']})")
        if c["place"]:
            lines.append(f"  {c['place']}")
        lines += [f"  {cmd}" for cmd in c["export"].values()]
    return "\n".join(lines)


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


def read_advice(path: str | os.PathLike) -> dict[str, Any]:
    """The ``advice.json`` of an advice directory, checked (format and version)."""
    p = Path(path) / rf.ADVICE_MANIFEST
    try:
        obj = json.loads(p.read_text())
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no {rf.ADVICE_MANIFEST} (write one with `moetrace advise`)") from None
    rf.check_result_json(p, obj, rf.ADVICE)
    return obj
