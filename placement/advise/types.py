"""The records ``moetrace advise`` passes between its modules: an evaluated ``Option``, the
``Advice`` (its ``advice.json`` as ``advise_manifest.AdviceManifest``, summary rows as
``advise_option_row.OptionRow``, per-layer rows, placements), what it evaluates (``AdviseInputs``: per recorded stage a ``StageInput``, a trace's
simulated steps as ``StepTokens``) and what one option on one stage's steps measures
(``StepMetrics``); the stage names (defined beside ``OptionRow``).

Shape legend (docs/architecture.md): N windows, B steps, L MoE layers, E logical experts, T tokens,
K top-k slots.

Out of scope: computing them (``run``), writing them (``files``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np

from moetrace.placement.advise.options import EPLB_STRATEGIES, EplbPolicy, option_label
from moetrace.placement.advise_manifest import AdviceManifest
from moetrace.placement.advise_option_row import STAGES, OptionRow, Stage, Steps
from moetrace.placement.maps import Placement

if TYPE_CHECKING:
    from moetrace.placement.routers import Router
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "STAGES",
    "Advice",
    "AdviseInputs",
    "Option",
    "Stage",
    "StageInput",
    "StepMetrics",
    "StepTokens",
    "Steps",
]


@dataclass(frozen=True, kw_only=True)
class Option:
    """One placement advise evaluates."""

    name: str  # "current" or a registered strategy ("linear", "eplb", "eplb_global", "joint", ...)
    num_redundant: int  # R: redundant slots per layer
    placement: Placement  # over the MoE layers
    fitted_on: str = ""  # the stage whose load it was fitted on ("" for data-free placements)
    router: Router | None = None  # the serving router of a grouped placement (joint); None: requests spread evenly
    policy: EplbPolicy | None = None  # the EPLB policy it ran (EPLB strategies only)

    @property
    def key(self) -> str:
        """``eplb-64``, ``eplb_global-64``, ``linear``: unique within a stage."""
        return f"{self.name}-{self.num_redundant}" if self.name in EPLB_STRATEGIES else self.name

    @property
    def label(self) -> str:
        return option_label(self.name, self.num_redundant, policy=self.policy)

    @property
    def has_router(self) -> bool:
        """Its requests must be sent to nodes by a router (a grouped placement with one)."""
        from moetrace.placement.routers import NoRouter

        return self.router is not None and not isinstance(self.router, NoRouter)


@dataclass(frozen=True, kw_only=True)
class Advice:
    """What ``advise_arrays`` found: summary rows, per-layer rows, verdicts, commands, placements."""

    manifest: AdviceManifest  # advice.json (config, verdicts, decision, correlations, drift; commands when written)
    rows: list[OptionRow]  # one per (stage, steps, option): the summary (options.parquet)
    layer_rows: dict[str, np.ndarray]  # columns of layers.parquet (stage, steps, option, layer, measures)
    placements: dict[str, Option] = field(default_factory=dict)  # file stem -> a recommended option to write
    options: dict[str, Option] = field(default_factory=dict)  # "<stage>-<option key>" -> every option evaluated

    @property
    def verdicts(self) -> list[str]:
        """The verdicts in words, in the order the command prints them."""
        return [v.text for v in self.manifest.verdicts]


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
