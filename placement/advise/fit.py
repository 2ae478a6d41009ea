"""The options ``moetrace advise`` fits for one stage (``stage_options``): the data-free ones once,
EPLB's per redundancy sweep point (``eplb_fit``), the trace's grouped ones for a recorded stage.

Shape legend (docs/architecture.md): L MoE layers, E logical experts.

Out of scope: which strategies apply (``options``); evaluating the options (``evaluate``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moetrace.placement.advise.config import AdviseConfig
from moetrace.placement.advise.options import (
    EPLB_STRATEGIES,
    data_free_placement,
    eplb_option_placement,
    eplb_policy,
    ungrouped_placement,
)
from moetrace.placement.advise.types import AdviseInputs, Option, Stage
from moetrace.placement.strategies import get_strategy

if TYPE_CHECKING:
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = ["eplb_fit", "stage_options"]


def eplb_fit(
    load_LE: np.ndarray, *, strategy: str, m: ModelInfo, cfg: AdviseConfig, num_redundant: int, stage: str
) -> Option:
    """One EPLB option: ``strategy``'s policy on ``load_LE`` with ``num_redundant`` slots, summed as ``cfg`` says."""
    dep = cfg.deployment
    placement = eplb_option_placement(
        load_LE, strategy=strategy, model=m, deployment=dep, num_redundant=num_redundant, eplb_sum=cfg.eplb_sum
    )
    policy = eplb_policy(strategy, model=m, deployment=dep)
    return Option(name=strategy, num_redundant=num_redundant, placement=placement, fitted_on=stage, policy=policy)


def stage_options(
    inputs: AdviseInputs, cfg: AdviseConfig, names: tuple[str, ...], *, stage: Stage, sweep: list[int]
) -> list[Option]:
    """The options fitted for ``stage`` in ``names``' order: data-free ones once, EPLB's per sweep point,
    the trace's grouped ones (``inputs.extra``) for a recorded stage."""
    m, dep = inputs.model, cfg.deployment
    load = _fit_stage_load(inputs, stage)
    out: list[Option] = []
    for name in names:
        if name in EPLB_STRATEGIES:
            out += [eplb_fit(load, strategy=name, m=m, cfg=cfg, num_redundant=r, stage=stage) for r in sweep]
        elif not get_strategy(name).uses_load:  # data-free (linear, round robin, random): one for every stage
            out.append(
                Option(
                    name=name,
                    num_redundant=0,
                    placement=data_free_placement(name, model=m, deployment=dep, seed=cfg.seed),
                )
            )
        elif not get_strategy(name).grouped:  # any other registered strategy: fitted on the stage's load
            placement = ungrouped_placement(name, load, model=m, deployment=dep, seed=cfg.seed)
            out.append(Option(name=name, num_redundant=0, placement=placement, fitted_on=stage))
        elif stage != "both":
            out += [o for o in inputs.extra if o.name == name]
    return out


def _fit_stage_load(inputs: AdviseInputs, stage: Stage) -> np.ndarray:
    if stage == "both":
        return sum((s.fit_LE for s in inputs.stages.values()), np.zeros_like(next(iter(inputs.stages.values())).fit_LE))
    return inputs.stages[stage].fit_LE
