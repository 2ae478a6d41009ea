"""The rows ``moetrace advise`` reports per evaluated option: the summary row of one option on one
stage's steps (``summary_row``: an ``advise_option_row.OptionRow``, every time also over the
reference's median), the migration from the reference and the redundant slots' memory
(``migration_row``: a ``MigrationRow``, part of the summary row), and the per-layer rows of
layers.parquet (``add_layer_rows``, ``layer_arrays``).

Shape legend (docs/architecture.md): B steps, L MoE layers.

Out of scope: evaluating the options (``evaluate``); the verdicts (``verdicts``); the
files (``files``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from moetrace.placement.advise.metrics import migration, quantiles_over_layers
from moetrace.placement.advise.types import Option, Stage, StepMetrics, Steps
from moetrace.placement.advise_option_row import OptionRow
from moetrace.placement.deployment import Deployment
from moetrace.placement.hardware import CostModel

if TYPE_CHECKING:
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = ["MigrationRow", "add_layer_rows", "layer_arrays", "migration_row", "summary_row", "weight_bytes"]


@dataclass(frozen=True, kw_only=True)
class MigrationRow:
    """What going from the reference to an option moves, and its redundant slots' memory (the last four
    columns of ``OptionRow``; one per option, shared by the stages' steps it is evaluated on)."""

    experts_moved: int  # (layer, expert copy) pairs copied onto a GPU lacking them
    bytes_moved: float | None  # their weights in bytes; None: expert size unknown
    extra_slots_per_gpu: float  # redundant slots per GPU over all MoE layers
    extra_bytes_per_gpu: float | None  # their weights in bytes per GPU; None: expert size unknown


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


def summary_row(
    m: StepMetrics, ref: StepMetrics, *, option: Option, stage: Stage, steps: Steps, moved: MigrationRow
) -> OptionRow:
    """The summary row of one option on one stage's steps (every time also over the reference's median),
    with its migration from the reference (``migration_row``)."""
    bq = quantiles_over_layers(_layer_mean(m.balancedness_BL))
    a2a_B, moe_B, inter_B = m.a2a_seconds_BL.sum(1), m.moe_seconds_BL.sum(1), m.inter_bytes_BL.sum(1)
    ref_a2a, ref_moe = _q(ref.a2a_seconds_BL.sum(1), 0.5), _q(ref.moe_seconds_BL.sum(1), 0.5)
    ref_inter = _q(ref.inter_bytes_BL.sum(1), 0.5)

    def rel(x_B: np.ndarray, r: float, q: float) -> float:
        return _q(x_B / r, q) if r > 0 and np.isfinite(r) else float("nan")

    return OptionRow(
        stage=stage,
        steps=steps,
        option=option.key,
        strategy=option.name,
        label=option.label,
        num_redundant=option.num_redundant,
        fitted_on=option.fitted_on,
        eplb_policy=option.policy,
        router=option.has_router,
        balancedness_min=bq["min"],
        balancedness_p50=bq["p50"],
        balancedness_p90=bq["p90"],
        balancedness_mean=bq["mean"],
        balancedness_vllm=_q(m.vllm_balancedness_B[np.isfinite(m.vllm_balancedness_B)], 0.5),
        busiest_rank_tokens=_nanmean(m.busiest_BL),
        mean_rank_tokens=_nanmean(m.mean_rank_BL),
        activated_experts_per_gpu_max=_nanmean(m.active_max_BL),
        activated_experts_per_gpu_mean=_nanmean(m.active_mean_BL),
        send_ranks_per_token=_nanmean(m.send_ranks_L),
        inter_node_bytes_per_step=_q(inter_B, 0.5),
        inter_node_vs_ref=rel(inter_B, ref_inter, 0.5),
        a2a_seconds_per_step=_q(a2a_B, 0.5),
        a2a_vs_ref=rel(a2a_B, ref_a2a, 0.5),
        a2a_vs_ref_p10=rel(a2a_B, ref_a2a, 0.1),
        a2a_vs_ref_p90=rel(a2a_B, ref_a2a, 0.9),
        moe_seconds_per_step=_q(moe_B, 0.5),
        moe_vs_ref=rel(moe_B, ref_moe, 0.5),
        moe_vs_ref_p10=rel(moe_B, ref_moe, 0.1),
        moe_vs_ref_p90=rel(moe_B, ref_moe, 0.9),
        experts_moved=moved.experts_moved,
        bytes_moved=moved.bytes_moved,
        extra_slots_per_gpu=moved.extra_slots_per_gpu,
        extra_bytes_per_gpu=moved.extra_bytes_per_gpu,
    )


def weight_bytes(cost: CostModel) -> float | None:
    return None if cost.expert is None else cost.expert.weight_bytes


def migration_row(
    ref: Option, opt: Option, *, dep: Deployment, model: ModelInfo, weight_bytes: float | None
) -> MigrationRow:
    """Experts (and bytes) moving from the reference to ``opt``, and the redundant slots' memory per GPU."""
    mig = migration(
        ref.placement.phy2log,
        opt.placement.phy2log,
        num_ranks=dep.num_ep,
        ranks_per_node=dep.ranks_per_node,
        num_experts=model.num_experts,
    )
    extra_slots = opt.num_redundant / dep.num_ep * model.num_moe_layers  # per GPU, all layers
    return MigrationRow(
        experts_moved=mig.experts_moved,
        bytes_moved=None if weight_bytes is None else mig.experts_moved * weight_bytes,
        extra_slots_per_gpu=extra_slots,
        extra_bytes_per_gpu=None if weight_bytes is None else extra_slots * weight_bytes,
    )


def add_layer_rows(
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


def layer_arrays(cols: dict[str, list[Any]]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in cols.items()}
