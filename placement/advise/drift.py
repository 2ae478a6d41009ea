"""What ``moetrace advise`` says about the load across stages and over time: how the prefill and the
decode load correlate (``stage_correlation``), the steps each stage's traffic takes (``stage_weights``),
and whether the imbalance moves faster than a static placement follows (``stage_drift``, on the
windows in arrival order).

Shape legend (docs/architecture.md): N windows, L MoE layers, E logical experts.

Out of scope: the verdicts worded from them (``verdicts``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moetrace.placement.advise.config import AdviseConfig
from moetrace.placement.advise.fit import eplb_fit
from moetrace.placement.advise.metrics import expected_rank_load, vllm_balancedness
from moetrace.placement.advise.options import EPLB_STRATEGIES, data_free_placement
from moetrace.placement.advise.types import AdviseInputs, Stage, Steps
from moetrace.placement.advise.verdicts import best_eplb
from moetrace.placement.advise_manifest import DriftEstimate
from moetrace.placement.advise_option_row import OptionRow
from moetrace.placement.deployment import Deployment
from moetrace.placement.maps import Placement

if TYPE_CHECKING:
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = ["MIN_DRIFT_WINDOWS", "stage_correlation", "stage_drift", "stage_weights"]


#: fewer windows than this give no drift estimate (the later half must hold windows to follow)
MIN_DRIFT_WINDOWS = 4


def stage_correlation(inputs: AdviseInputs) -> float | None:
    """Pearson r of the prefill and the decode load over experts, mean over layers (None: one stage)."""
    from moetrace.stats import mean_skip_nan, pearson_paired

    if len(inputs.stages) < 2:
        return None
    r_L = pearson_paired(inputs.stages["prefill"].fit_LE, inputs.stages["decode"].fit_LE)
    mean, _ = mean_skip_nan(r_L)
    return None if np.isnan(mean) else round(mean, 4)


def stage_weights(inputs: AdviseInputs) -> dict[str, float]:
    """Steps each stage's traffic takes (its routed pairs over the pairs of one step): how a placement
    serving both stages weighs their step times."""
    return {
        st: float(si.fit_LE.sum() / max(si.fit_LE.shape[0], 1)) / si.pairs_per_step if si.pairs_per_step > 0 else 0.0
        for st, si in inputs.stages.items()
    }


def _stage_windows(inputs: AdviseInputs, stage: Stage) -> np.ndarray:
    if stage == "both":
        ws = [s.windows_NLE for s in inputs.stages.values()]
        n = min(len(w) for w in ws)
        return sum((w[:n] for w in ws), np.zeros_like(ws[0][:n]))
    return inputs.stages[stage].windows_NLE


def stage_drift(inputs: AdviseInputs, stage: Stage, *, cfg: AdviseConfig, rows: list[OptionRow]) -> DriftEstimate:
    """Does the imbalance move faster than a static placement follows? On the windows in arrival order,
    balancedness (vLLM's figure, mean over the later half of the windows) of: the reference; EPLB fitted
    on the first half (``static``); EPLB refitted on the window before each one (``lagged``: a placement
    that follows one window late, as a periodic rearrangement does); EPLB fitted on each window itself
    (``own``: a ceiling no deployed placement reaches, since it knows the window's load in advance). All
    with the recommended EPLB option's policy and sweep point (else the largest). Moving load: ``lagged``
    beats ``static``; load that changes faster than any placement follows: ``own`` far above both.
    Fewer than ``MIN_DRIFT_WINDOWS`` windows: skipped, with the reason (``DriftEstimate.skipped``)."""
    m, dep = inputs.model, cfg.deployment
    w_NLE = _stage_windows(inputs, stage)
    N = len(w_NLE)
    if N < MIN_DRIFT_WINDOWS:
        return DriftEstimate(num_windows=N, skipped=f"fewer than {MIN_DRIFT_WINDOWS} windows: no drift estimate")
    half = N // 2
    own: Steps = "decode" if stage == "both" else stage
    cand = [r for r in rows if r.stage == stage and r.strategy in EPLB_STRATEGIES and r.steps == own]
    if not cand:
        return DriftEstimate(num_windows=N, skipped="no EPLB option evaluated")
    best = best_eplb(cand)
    R = int(best.num_redundant) if best is not None else max(int(r.num_redundant) for r in cand)
    strategy = str(best.strategy) if best is not None else "eplb"
    W = dep.num_ep

    def fitted(load_LE: np.ndarray) -> Placement:
        return eplb_fit(load_LE, strategy=strategy, m=m, cfg=cfg, num_redundant=R, stage=stage).placement

    def b(w_LE: np.ndarray, placement: Placement) -> float:
        return float(vllm_balancedness(expected_rank_load(w_LE[None], placement, num_ranks=W))[0])

    ref, static = _ref_placement(inputs, m=m, dep=dep, seed=cfg.seed), fitted(w_NLE[:half].sum(0))
    later = range(half, N)
    return DriftEstimate.of(
        num_windows=N,
        num_redundant=R,
        strategy=strategy,
        reference=_mean_or_nan(np.array([b(w_NLE[i], ref) for i in later])),
        static=_mean_or_nan(np.array([b(w_NLE[i], static) for i in later])),
        lagged=_mean_or_nan(np.array([b(w_NLE[i], fitted(w_NLE[i - 1])) for i in later])),
        own=_mean_or_nan(np.array([b(w_NLE[i], fitted(w_NLE[i])) for i in later])),
    )


def _mean_or_nan(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    return round(float(np.nanmean(x)), 4) if np.isfinite(x).any() else float("nan")


def _ref_placement(inputs: AdviseInputs, *, m: ModelInfo, dep: Deployment, seed: int) -> Placement:
    """The reference placement: ``--current``, else linear."""
    if inputs.current is not None:
        return inputs.current
    return data_free_placement("linear", model=m, deployment=dep, seed=seed)
