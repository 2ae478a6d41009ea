"""``options.parquet``'s row, typed: one option evaluated on one stage's steps, as ``moetrace advise``
reports it.

``OptionRow`` is what ``advise.rows.summary_row`` builds (``Advice.rows``), what the verdicts
(``advise.verdicts``), the drift check (``advise.drift``) and the printed table (``advise.files``) read,
and what ``advise.files.write_advice`` writes as ``options.parquet`` (``to_row``: one column per field,
in field order) and every reader gets back (``from_row``: the dashboard's advice section reads its
fields, never the table's column names). The two predicted times are read through ``vs_ref`` /
``seconds_per_step`` with a ``Measure`` (``"moe"``: dispatch + experts + combine; ``"a2a"``: dispatch +
combine), never through column names built from it; ``measure`` says which one a row ranks by.

Ratios ``*_vs_ref`` are over the reference option's median on the same steps (NaN when that median
is 0 or not finite); ``*_p10`` / ``*_p90`` are the 10th and 90th percentile over steps of the same ratio.

Out of scope: computing the row (``advise.rows``); ``layers.parquet`` (columns, ``advise.rows.add_layer_rows``);
``advice.json`` (``advise_manifest``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from moetrace.errors import TraceFormatError
from moetrace.results import ADVICE, ADVICE_OPTIONS, ManifestFields

__all__ = ["MEASURES", "OPTION_COLUMNS", "STAGES", "Measure", "OptionRow", "Stage", "Steps"]

#: the placements advise fits (a recorded stage, or both with one placement) and the steps it evaluates
#: them on (a recorded stage); ``advise.types`` re-exports them
Stage = Literal["prefill", "decode", "both"]
Steps = Literal["prefill", "decode"]
STAGES: tuple[Stage, ...] = ("prefill", "decode", "both")

#: a predicted time per step: MoE layers (dispatch + experts + combine) or the all-to-all alone (dispatch + combine)
Measure = Literal["moe", "a2a"]
MEASURES: tuple[Measure, ...] = get_args(Measure)


@dataclass(frozen=True, kw_only=True)
class OptionRow:
    """One (stage, steps, option) of ``options.parquet`` (fields in the order of its columns). Counts of
    (token, expert) pairs and bytes are per step, medians over steps unless said otherwise."""

    stage: Stage  # the stage the option's placement serves and was fitted for: "prefill", "decode", "both"
    steps: Steps  # the recorded stage whose steps (a profile's windows) it is evaluated on: "prefill", "decode"
    option: str  # the option's key, unique within a stage (``eplb-64``, ``eplb_global-64``, ``linear``, ``joint``)
    strategy: str  # the registered strategy (or "current") that built it
    label: str  # how tables and verdicts name it (``EPLB global, 64 redundant``)
    num_redundant: int  # R: redundant slots per layer
    fitted_on: str  # the stage whose load it was fitted on ("" for data-free placements)
    eplb_policy: str | None  # EPLB's policy it ran ("hierarchical", "global"); None: not an EPLB option
    router: bool  # its requests must be sent to nodes by a router (a grouped placement with one)
    balancedness_min: float  # balancedness (mean / max pairs per EP rank, mean over steps) of the least balanced layer
    balancedness_p50: float  # its median over layers
    balancedness_p90: float  # its 90th percentile over layers
    balancedness_mean: float  # its mean over layers
    balancedness_vllm: float  # vLLM's per-step figure (sum over layers of mean / sum of max), median over steps
    busiest_rank_tokens: float  # (token, expert) pairs of the busiest EP rank per (step, layer), mean
    mean_rank_tokens: float  # pairs of the mean EP rank per (step, layer), mean
    activated_experts_per_gpu_max: float  # activated experts (slots with >= 1 token) of the GPU activating most, mean
    activated_experts_per_gpu_mean: float  # the same, mean over GPUs
    send_ranks_per_token: float  # distinct destination ranks per token, mean (NaN on a load profile: no tokens)
    inter_node_bytes_per_step: float  # bytes between nodes per step, dispatch + combine over layers
    inter_node_vs_ref: float  # that over the reference's median
    a2a_seconds_per_step: float  # predicted seconds of dispatch + combine over layers per step
    a2a_vs_ref: float  # that over the reference's median, median over steps
    a2a_vs_ref_p10: float  # its 10th percentile over steps
    a2a_vs_ref_p90: float  # its 90th percentile over steps
    moe_seconds_per_step: float  # predicted seconds of dispatch + experts + combine per step (NaN: expert size unknown)
    moe_vs_ref: float  # that over the reference's median, median over steps (NaN: expert size unknown)
    moe_vs_ref_p10: float  # its 10th percentile over steps
    moe_vs_ref_p90: float  # its 90th percentile over steps
    experts_moved: int  # (layer, expert copy) pairs copied onto a GPU lacking them to go from the reference to it
    bytes_moved: float | None  # their weights in bytes; None: expert size unknown
    extra_slots_per_gpu: float  # redundant slots per GPU over all MoE layers
    extra_bytes_per_gpu: float | None  # their weights in bytes per GPU; None: expert size unknown

    # ---------------------------------------------------------------- the two predicted times
    @property
    def measure(self) -> Measure:
        """The time this row ranks by: MoE-layer time, or all-to-all time when the expert size is unknown."""
        return "moe" if math.isfinite(self.moe_vs_ref) else "a2a"

    def seconds_per_step(self, measure: Measure) -> float:
        """Predicted seconds per step of ``measure``, median over steps."""
        return self.moe_seconds_per_step if measure == "moe" else self.a2a_seconds_per_step

    def vs_ref(self, measure: Measure) -> float:
        """``measure`` over the reference's median, median over steps."""
        return self.moe_vs_ref if measure == "moe" else self.a2a_vs_ref

    def vs_ref_p10(self, measure: Measure) -> float:
        """``vs_ref``'s 10th percentile over steps."""
        return self.moe_vs_ref_p10 if measure == "moe" else self.a2a_vs_ref_p10

    def vs_ref_p90(self, measure: Measure) -> float:
        """``vs_ref``'s 90th percentile over steps."""
        return self.moe_vs_ref_p90 if measure == "moe" else self.a2a_vs_ref_p90

    def with_vs_ref(self, measure: Measure, value: float) -> OptionRow:
        """A copy whose ``vs_ref(measure)`` is ``value`` (a time weighed over both stages' steps)."""
        if measure == "moe":
            return dataclasses.replace(self, moe_vs_ref=value)
        return dataclasses.replace(self, a2a_vs_ref=value)

    # ---------------------------------------------------------------- options.parquet
    def to_row(self) -> dict[str, Any]:
        """The row as the Parquet writer takes it: column -> value, in column order, values as built."""
        return {name: getattr(self, name) for name in OPTION_COLUMNS}

    @classmethod
    def from_row(cls, row: Mapping[str, Any], *, where: str = ADVICE_OPTIONS) -> OptionRow:
        """The row read back (``polars.DataFrame.iter_rows(named=True)``); a column missing or of another
        type is a ``TraceFormatError`` naming ``where`` and the column."""
        r = ManifestFields(dict(row), where, kind=ADVICE)
        stage, steps = r.text("stage"), r.text("steps")
        if stage not in STAGES or steps not in get_args(Steps):
            raise TraceFormatError(
                f"{where}: `stage` {stage!r} or `steps` {steps!r} names no stage; re-run `{ADVICE.command}`"
            )
        nums = {k: r.number(k, optional=k in _OPTIONAL) for k in _NUMBERS}
        return cls(
            stage=stage,
            steps=steps,
            option=r.text("option"),
            strategy=r.text("strategy"),
            label=r.text("label"),
            num_redundant=r.integer("num_redundant"),
            fitted_on=r.text("fitted_on"),
            eplb_policy=r.text("eplb_policy", optional=True),
            router=r.get("router", bool),
            experts_moved=r.integer("experts_moved"),
            **nums,
        )


#: options.parquet's columns, in order (``OptionRow``'s fields)
OPTION_COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(OptionRow))
#: the columns ``from_row`` reads one by one; every other is a number (an integer column read as a float too)
_NOT_NUMBERS = ("stage", "steps", "option", "strategy", "label", "num_redundant", "fitted_on", "eplb_policy", "router")
_NUMBERS: tuple[str, ...] = tuple(c for c in OPTION_COLUMNS if c not in (*_NOT_NUMBERS, "experts_moved"))
#: the numbers null when the expert size is unknown
_OPTIONAL = frozenset({"bytes_moved", "extra_bytes_per_gpu"})
