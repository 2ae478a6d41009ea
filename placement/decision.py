"""One decision per stage: the rule ``compare``, ``advise``, the demo and the dashboard card all use
to name the best option of a stage (decode, prefill), and the words that say how two answers relate
when they were asked different questions.

**The objective**: predicted MoE-layer time per step (dispatch + the slowest GPU's experts + combine,
all MoE layers; the busiest GPU of each collective and the busiest node charged), median over the
stage's held-out steps, over the reference's (linear's) median; all-to-all time when the model's
expert size is unknown (never guessed).

**The rule** (``choose``): among the deployable options (a router within the node-load limit), the
lowest time; options within ``WITHIN_BEST`` of it count as equal and the one with the fewest
redundant slots wins, then the lower time. An option that saves less than ``MIN_GAIN`` of the
reference's time is not worth a rearrangement (or a router): the decision is then to keep the
reference, and the closest option is named beside it.

What differs between the commands is the **option set**, never the rule: ``compare`` ranks the
strategies it is given, each one placement fitted on the decode load of the training requests and
served on both stages at ``--redundancy`` slots; ``advise`` also sweeps EPLB's redundant experts and
fits each stage's placement on that stage's own load (``relation``).

Out of scope: simulating the options (``compare``, ``advise``), the verdicts' prose (``report``,
``advise.verdicts``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "EPLB_STRATEGIES",
    "MIN_GAIN",
    "OBJECTIVE",
    "WITHIN_BEST",
    "Candidate",
    "StageChoice",
    "choose",
    "objective",
    "option_key",
    "pct",
    "relation",
    "stage_choices_json",
]

#: the strategies whose options are swept over redundant slots (EPLB's two policies)
EPLB_STRATEGIES: tuple[str, ...] = ("eplb", "eplb_global")
#: a gain below this share of the reference's predicted time is no gain (not worth a rearrangement or a router)
MIN_GAIN = 0.03
#: options within this share of the best predicted time count as equally good (the fewest redundant slots win)
WITHIN_BEST = 0.01

#: how a cost worse than the reference's is marked in a decision's words
WORSE_WORD = "worse than"

#: the objective in words (printed by every command that names a best option)
OBJECTIVE = (
    "predicted MoE-layer time per step (dispatch + the slowest GPU's experts + combine; busiest GPU and node "
    "charged), median over held-out steps, over linear's"
)
#: the same when the model's expert size is unknown
OBJECTIVE_A2A = (
    "predicted all-to-all time per step (dispatch + combine; busiest GPU charged; the expert size is unknown: "
    "no MoE-layer time), median over held-out steps, over linear's"
)


def objective(measure: str) -> str:
    """``OBJECTIVE`` for ``MoE-layer time``, ``OBJECTIVE_A2A`` otherwise."""
    return OBJECTIVE if measure == "MoE-layer time" else OBJECTIVE_A2A


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One option of one stage, its medians over the reference's (NaN where unknown)."""

    option: str  # the option's key: a strategy name, or ``eplb-64`` for a sweep point
    strategy: str  # the registered strategy
    num_redundant: int = 0
    time: float  # the objective over the reference's median (MoE-layer time; all-to-all when unknown)
    a2a: float = math.nan  # all-to-all time over the reference's
    inter: float = math.nan  # inter-node bytes over the reference's
    deployable: bool = True  # False: its router sends a node more than the node-load limit


@dataclass(frozen=True, kw_only=True)
class StageChoice:
    """The decision of one stage (``choose``)."""

    stage: str
    decision: str  # the option to deploy: the best one, or the reference when nothing gains MIN_GAIN
    best: str | None  # the fastest deployable option by the rule (None: no candidate with a time)
    strategy: str | None  # the best option's strategy
    num_redundant: int
    time: float  # the best option's objective over the reference's
    a2a: float
    inter: float
    reference: str
    measure: str  # "MoE-layer time" or "all-to-all time"
    why: str  # one sentence: why the decision

    def text(self) -> str:
        """``decode: joint: MoE-layer time −17 %, all-to-all −20 %, inter-node bytes −21 %``."""
        if self.best is None:
            return f"{self.stage}: no option with a predicted time"
        figures = f"{self.measure} {pct(self.time)}" + "".join(
            f", {what} {pct(v)}"
            for what, v in (("all-to-all", self.a2a), ("inter-node bytes", self.inter))
            if math.isfinite(v) and not (what == "all-to-all" and self.measure == "all-to-all time")
        )
        if self.decision == self.reference and self.reference in (self.best, self.strategy):
            return f"{self.stage}: keep {self.reference} ({self.why})"
        if self.decision == self.reference:
            return f"{self.stage}: keep {self.reference} ({self.why}; closest: {label(self.best)}, {figures})"
        worse = [w for w, v in (("all-to-all", self.a2a), ("inter-node bytes", self.inter)) if round(v, 3) > 1.0]
        return f"{self.stage}: {label(self.best)}: {figures}" + (
            f" ({WORSE_WORD} {self.reference} in {' and '.join(worse)})" if worse else ""
        )

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> StageChoice:
        """Back from ``to_json`` (null figures as NaN)."""
        nums = ("time", "a2a", "inter")
        fields: dict[str, Any] = {k: (math.nan if k in nums and v is None else v) for k, v in obj.items()}
        return cls(**fields)


def pct(x: float) -> str:
    """A ratio as a signed change: ``0.83`` -> ``−17 %``, ``1.004`` -> ``+0.4 %``."""
    v = (x - 1.0) * 100
    return (f"{v:+.1f} %" if abs(v) < 9.95 else f"{v:+.0f} %").replace("-", "−")


def option_key(strategy: str, num_redundant: int) -> str:
    """An option's key as ``advise`` names it: EPLB's strategies with their redundant slots (``eplb-0``)."""
    return f"{strategy}-{num_redundant}" if strategy in EPLB_STRATEGIES else strategy


def label(option: str) -> str:
    """An option key as the commands name it: ``eplb-64`` -> ``eplb with 64 redundant``, ``eplb-0`` ->
    ``eplb without redundant``; a strategy name as it is (``--strategy`` takes it)."""
    base, _, red = option.rpartition("-")
    if base and red.isascii() and red.isdigit():
        return f"{base} with {red} redundant" if int(red) else f"{base} without redundant"
    return option


def choose(stage: str, candidates: Sequence[Candidate], *, reference: str, measure: str) -> StageChoice:
    """The decision of ``stage`` over ``candidates`` (the reference among them or not) by the rule above."""
    timed = [c for c in candidates if math.isfinite(c.time)]
    ok = [c for c in timed if c.deployable]
    if not ok:
        why = "no deployable option within the node-load limit" if timed else "no option has a predicted time"
        return StageChoice(
            stage=stage, decision=reference, best=None, strategy=None, num_redundant=0, time=math.nan,
            a2a=math.nan, inter=math.nan, reference=reference, measure=measure, why=why,
        )  # fmt: skip
    least = min(c.time for c in ok)
    order = {c.option: i for i, c in enumerate(ok)}
    best = min(
        (c for c in ok if c.time <= least * (1 + WITHIN_BEST)), key=lambda c: (c.num_redundant, c.time, order[c.option])
    )
    gain = 1.0 - best.time
    if best.option == reference or best.strategy == reference:
        decision, why = reference, f"no option is faster than {reference}"
    elif gain < MIN_GAIN:
        decision, why = reference, f"no option saves {MIN_GAIN:.0%} of {reference}'s {measure}"
    else:
        decision, why = best.option, f"the lowest {measure} of the options, {gain:.0%} under {reference}"
    return StageChoice(
        stage=stage,
        decision=decision,
        best=best.option,
        strategy=best.strategy,
        num_redundant=best.num_redundant,
        time=best.time,
        a2a=best.a2a,
        inter=best.inter,
        reference=reference,
        measure=measure,
        why=why,
    )


def stage_choices_json(choices: Sequence[StageChoice]) -> dict[str, dict[str, Any]]:
    """``{stage: choice}`` as written to compare.json's ``verdict.stages`` and advice.json's ``best``."""
    return {c.stage: c.to_json() for c in choices}


def relation(*, command: str, strategies: Sequence[str], num_redundant: int = 0) -> str:
    """How this command's answer relates to the other's (they share the rule and the objective; the
    option sets differ)."""
    if command == "compare":
        return (
            f"compare ranks the strategies given ({', '.join(strategies)}) at {num_redundant} redundant slots, each "
            "one placement fitted on decode load and served on both stages; `moetrace advise` applies the same rule "
            "to more options (EPLB's redundant experts, each stage fitted on its own load): its answer is the deploy "
            "decision where the two differ"
        )
    if command == "place":
        return (
            "place writes one placement for both stages (ours chooses among joint, joint_free and EPLB's two "
            "policies by the same objective on a validation split); the best per stage: `moetrace advise` (or "
            "`moetrace compare` for a fixed list)"
        )
    return (
        "advise: every option fitted on the stage it serves (EPLB swept over redundant experts); `moetrace compare` "
        "applies the same rule to the strategies it is given, fitted on decode load"
    )
