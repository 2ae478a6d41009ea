"""``advice.json``, typed: one ``moetrace advise`` run's configuration, verdicts, decision per stage,
recommended placements and their commands, built and read here only.

``AdviceManifest`` is what ``advise.advise_arrays`` builds (``Advice.manifest``) and
``advise.files.write_advice`` writes as ``advice.json`` (``to_json``, with the commands and the
recorded paths; ``format`` and ``version`` from ``moetrace.results.ADVICE``, put first by
``moetrace.results.write_result_json``), and what every reader gets back (``from_json``; the
dashboard's advice section and card read its fields, never the JSON's keys). Its verdicts are
``AdviceVerdict`` (``advise.verdicts.verdicts``), its recommended placements ``Recommended``, their
commands ``AdviceCommand`` (``advise.files.commands``), its drift estimates
``DriftEstimate`` (``advise.drift.stage_drift``), its decision per stage
``placement.decision.StageChoice``, its step model ``placement.hardware.Hardware`` and its
rearrangement ``advise.rearrange.Rearrangement``. ``from_json`` takes exactly what the writer writes
and raises ``TraceFormatError`` naming the first key that is missing or of the wrong type; ``to_json``
gives the body back key for key, so a file read and written again is the same bytes. Keys added after
the format was stamped (``ADVICE_LATER_KEYS``) get their meaning from before they existed.

The record holds strict JSON values only (``plain_json``: numpy scalars as Python numbers, NaN as
null), so that what ``advise`` returns and what a reader gets back from the file are equal.

Out of scope: computing the advice (``advise``); ``options.parquet`` and ``layers.parquet``
(``advise.rows``); the parts no reader interprets, kept as the JSON they were written as (the
experts' size, a verdict's figures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from moetrace.errors import TraceFormatError
from moetrace.placement.decision import StageChoice
from moetrace.results import ADVICE, ManifestFields
from moetrace.tracer.trace.schema import ModelInfo

if TYPE_CHECKING:
    from moetrace.placement.advise.rearrange import Rearrangement
    from moetrace.placement.hardware import Hardware

__all__ = [
    "ADVICE_LATER_KEYS",
    "DRIFT_LATER_KEYS",
    "AdviceCommand",
    "AdviceManifest",
    "AdviceVerdict",
    "DriftEstimate",
    "Recommended",
    "plain_json",
]

#: keys advice.json gained after ``moetrace.advice`` v1 was stamped -> their value in files that lack them
ADVICE_LATER_KEYS: dict[str, Any] = {
    "trace": None,  # the trace's path (for its overview) came later
    "hardware": None,  # the step model's kernels came later (the links alone before)
    "strategies": (),  # the options' strategies were not listed
    "eplb_sum": None,
    "replica_policy": None,
    "step_tokens_per_gpu": None,
    "rearrangement": None,
    "drift_estimated": None,
    "best": {},  # the one rule's decision per stage came later (issue 39)
    "commands": (),
}


def plain_json(x: Any) -> Any:
    """``x`` as strict JSON values: numpy scalars as Python numbers, NaN as null, tuples as lists,
    keys as strings."""
    if isinstance(x, dict):
        return {str(k): plain_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [plain_json(v) for v in x]
    if isinstance(x, np.integer | bool):
        return x if isinstance(x, bool) else int(x)
    if isinstance(x, float | np.floating):
        return None if math.isnan(x) else float(x)
    return x


@dataclass(frozen=True, kw_only=True)
class AdviceVerdict:
    """One verdict of ``advice.json`` (``advise.verdicts.verdicts``): a stage's answer in words."""

    stage: str | None  # "prefill", "decode", "both"; None: about the input as a whole (what it lacks)
    verdict: str  # "enable" (EPLB), "deploy" (the decision, not EPLB), "no gain", "not evaluated", "separate", "together", "missing", ...
    option: str | None  # the option it recommends (an option key); None: none
    text: str  # the verdict in words, as the command prints it
    info: dict[str, Any] = field(default_factory=dict)  # the figures behind it (rearrangement cost ...), as written

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "verdict": self.verdict, "option": self.option, "text": self.text, **self.info}

    @classmethod
    def from_json(cls, obj: object, *, where: str) -> AdviceVerdict:
        r = ManifestFields(obj, where, kind=ADVICE)
        info = {k: v for k, v in r.obj.items() if k not in ("stage", "verdict", "option", "text")}
        return cls(
            stage=r.text("stage", optional=True),
            verdict=r.text("verdict"),
            option=r.text("option", optional=True),
            text=r.text("text"),
            info=info,
        )


#: keys a drift estimate gained after advice.json v1 was stamped -> their value in files that lack them
DRIFT_LATER_KEYS: dict[str, Any] = {
    "strategy": None,  # EPLB's policy came later (EPLB's hierarchical one, the only one then): unsaid
    "lagged": None,  # the refitted and per-window placements came later: unknown
    "own": None,
}

#: a drift estimate's balancedness figures, in the order advice.json holds them
_DRIFT_FIGURES: tuple[str, ...] = ("reference", "static", "lagged", "own")


@dataclass(frozen=True, kw_only=True)
class DriftEstimate:
    """One stage's drift estimate in ``advice.json``'s ``drift`` (``advise.drift.stage_drift``): on the
    later half of the windows in arrival order, the balancedness (vLLM's figure, mean over windows) of
    the reference and of EPLB fitted three ways; or, when skipped, why. A figure that is unknown (NaN:
    no window with load) is None, written as null."""

    num_windows: int  # N windows of the stage's load in arrival order
    skipped: str | None = None  # why there is no estimate (too few windows, no EPLB option); None: estimated
    num_redundant: int | None = None  # redundant slots of the EPLB sweep point used; None: skipped
    strategy: str | None = None  # EPLB's policy used ("eplb", "eplb_global"); None: skipped, or an older file
    reference: float | None = None  # balancedness of the reference placement (``--current``, else linear)
    static: float | None = None  # EPLB fitted once on the first half of the windows
    lagged: float | None = None  # EPLB refitted on the window before each one (a periodic rearrangement)
    own: float | None = None  # EPLB fitted on each window itself (a ceiling no deployed placement reaches)

    @property
    def estimated(self) -> bool:
        """The drift was estimated (not skipped)."""
        return self.skipped is None

    def figure(self, name: str) -> float:
        """The balancedness ``name`` (``reference``, ``static``, ``lagged``, ``own``); NaN when unknown or skipped."""
        v = getattr(self, name) if name in _DRIFT_FIGURES else None
        return float("nan") if v is None else v

    def to_json(self) -> dict[str, Any]:
        if self.skipped is not None:
            return {"num_windows": self.num_windows, "skipped": self.skipped}
        policy = {} if self.strategy is None else {"strategy": self.strategy}  # None: an older file, unsaid
        return {
            "num_windows": self.num_windows,
            "num_redundant": self.num_redundant,
            **policy,
            **{k: getattr(self, k) for k in _DRIFT_FIGURES},
        }

    @classmethod
    def from_json(cls, obj: object, *, where: str) -> DriftEstimate:
        r = ManifestFields(obj, where, kind=ADVICE, later=DRIFT_LATER_KEYS)
        if "skipped" in r.obj:
            return cls(num_windows=r.integer("num_windows"), skipped=r.text("skipped"))
        return cls(
            num_windows=r.integer("num_windows"),
            num_redundant=r.integer("num_redundant"),
            strategy=r.text("strategy", optional=True),
            reference=r.number("reference", optional=True),
            static=r.number("static", optional=True),
            lagged=r.number("lagged", optional=True),
            own=r.number("own", optional=True),
        )

    @classmethod
    def of(cls, *, num_windows: int, num_redundant: int, strategy: str, **figures: float) -> DriftEstimate:
        """An estimate from its figures (NaN: unknown, kept as None)."""

        def known(k: str) -> float | None:
            return None if math.isnan(figures[k]) else float(figures[k])

        return cls(
            num_windows=num_windows,
            num_redundant=num_redundant,
            strategy=strategy,
            reference=known("reference"),
            static=known("static"),
            lagged=known("lagged"),
            own=known("own"),
        )


@dataclass(frozen=True, kw_only=True)
class Recommended:
    """One recommended placement of ``advice.json``: a stage's option and its placement file."""

    stage: str  # the stage it serves ("prefill", "decode", "both")
    option: str  # the option's key (``eplb-64``, ``joint``)
    placement: str  # its placement file, relative to the advice directory

    @property
    def stem(self) -> str:
        """``<stage>-<option>``: the placement file's stem and the key of ``Advice.placements``."""
        return f"{self.stage}-{self.option}"

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "option": self.option, "placement": self.placement}

    @classmethod
    def from_json(cls, obj: object, *, where: str) -> Recommended:
        r = ManifestFields(obj, where, kind=ADVICE)
        return cls(stage=r.text("stage"), option=r.text("option"), placement=r.text("placement"))


@dataclass(frozen=True, kw_only=True)
class AdviceCommand:
    """The commands that reproduce and export one recommended placement (``advise.files.commands``)."""

    stage: str  # the stage it serves
    option: str  # the option's key
    placement: str  # the placement file's path as the commands name it
    place: str | None  # the ``moetrace place`` command that writes it again; None: no such command
    export: dict[str, str]  # engine -> the ``moetrace export`` command for it, in the order written

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "option": self.option,
            "placement": self.placement,
            "place": self.place,
            "export": dict(self.export),
        }

    @classmethod
    def from_json(cls, obj: object, *, where: str) -> AdviceCommand:
        r = ManifestFields(obj, where, kind=ADVICE)
        export = r.get("export", dict)
        if not all(isinstance(v, str) for v in export.values()):
            raise TraceFormatError(f"{where}: `export` must map engines to commands; re-run `{ADVICE.command}`")
        return cls(
            stage=r.text("stage"),
            option=r.text("option"),
            placement=r.text("placement"),
            place=r.text("place", optional=True),
            export={str(k): v for k, v in export.items()},
        )


@dataclass(frozen=True, kw_only=True)
class AdviceManifest:
    """One ``moetrace advise`` run (fields in the order advice.json holds them)."""

    input: str  # the trace or load profile advised on (written relative to the advice directory)
    input_kind: str  # "trace" or "profile"
    trace: str | None  # the trace's path (its overview is shown too); None: a profile
    model: ModelInfo  # the model
    deployment: str  # DPaTPbEPc[TPd]
    gpus_per_node: int  # GPUs per node
    num_ep: int  # W EP ranks
    num_nodes: int  # G nodes
    reference: str  # the option every other is measured against (linear, or ``current``)
    current_format: str | None  # the format ``--current`` was read as; None: not given
    stages: tuple[str, ...]  # the placements advised: "prefill", "decode", "both"
    recorded_stages: tuple[str, ...]  # the stages the input recorded (whose steps were evaluated)
    missing: tuple[str, ...]  # what the input lacks, in words
    redundancy_sweep: tuple[int, ...]  # redundant slots per layer EPLB was swept over
    max_slots_per_gpu: int  # the most slots per GPU and layer the sweep used
    num_steps: dict[str, int]  # recorded stage -> steps (or windows) evaluated
    decode_dedup: str  # copy model of decode steps
    prefill_dedup: str  # copy model of prefill steps
    hardware: Hardware | None  # the step model's kernels and links; None: an older file
    expert: dict[str, Any] | None  # the experts' size (cost.ExpertCompute.to_json), as written; None: unknown
    test_fraction: float  # share of a trace's requests held out
    seed: int  # split and sampling
    strategies: tuple[str, ...]  # the strategies whose options were evaluated
    eplb_sum: str | None  # how EPLB summed its pack weights ("float64", "float32")
    replica_policy: str | None  # which replica serves a token
    step_tokens_per_gpu: dict[str, int] | None  # "decode" / "prefill" -> tokens per GPU in one step
    rearrangement: Rearrangement | None  # the rearrangement's stall and interval; None: an older file
    prefill_decode_correlation: float | None  # the stages' loads' correlation; None: one stage recorded
    drift_estimated: bool | None  # the drift was estimated over windows
    drift: dict[str, DriftEstimate]  # stage -> its drift estimate (or why skipped)
    verdicts: tuple[AdviceVerdict, ...]  # in the order the command prints them
    best: dict[str, StageChoice]  # stage -> its decision by the one rule (placement.decision); empty: older file
    recommended: tuple[Recommended, ...]  # the placements written under placements/
    commands: tuple[AdviceCommand, ...] = ()  # the commands reproducing and exporting each recommended one

    def to_json(self) -> dict[str, Any]:
        """advice.json's body (``moetrace.results.write_result_json`` puts format and version first)."""
        out: dict[str, Any] = {}
        for name in _ADVICE_KEYS:
            v = getattr(self, name)
            if name == "model":
                v = v.to_dict()
            elif name in ("best", "drift"):
                v = {st: x.to_json() for st, x in v.items()}
            elif name in ("verdicts", "recommended", "commands"):
                v = [x.to_json() for x in v]
            elif name == "hardware" and v is not None:
                v = v.to_json()
            elif name == "rearrangement" and v is not None:
                v = {"stall_seconds": v.stall_seconds, "interval_steps": v.interval_steps}
            elif isinstance(v, tuple):
                v = list(v)
            out[name] = v
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, where: str) -> AdviceManifest:
        """The manifest in ``obj`` (advice.json read from ``where``, format and version already checked)."""
        r = ManifestFields(obj, where, kind=ADVICE, later=ADVICE_LATER_KEYS)
        return cls(
            input=r.text("input"),
            input_kind=r.text("input_kind"),
            trace=r.text("trace", optional=True),
            model=r.parsed("model", ModelInfo.from_dict),
            deployment=r.text("deployment"),
            gpus_per_node=r.integer("gpus_per_node"),
            num_ep=r.integer("num_ep"),
            num_nodes=r.integer("num_nodes"),
            reference=r.text("reference"),
            current_format=r.text("current_format", optional=True),
            stages=r.names("stages"),
            recorded_stages=r.names("recorded_stages"),
            missing=r.names("missing"),
            redundancy_sweep=r.ints("redundancy_sweep"),
            max_slots_per_gpu=r.integer("max_slots_per_gpu"),
            num_steps={str(k): int(v) for k, v in r.get("num_steps", dict).items()},
            decode_dedup=r.text("decode_dedup"),
            prefill_dedup=r.text("prefill_dedup"),
            hardware=r.parsed_or_none("hardware", _hardware),
            expert=r.get("expert", dict, optional=True),
            test_fraction=r.number("test_fraction"),
            seed=r.integer("seed"),
            strategies=r.names("strategies"),
            eplb_sum=r.text("eplb_sum", optional=True),
            replica_policy=r.text("replica_policy", optional=True),
            step_tokens_per_gpu=r.get("step_tokens_per_gpu", dict, optional=True),
            rearrangement=r.parsed_or_none("rearrangement", _rearrangement),
            prefill_decode_correlation=r.number("prefill_decode_correlation", optional=True),
            drift_estimated=r.get("drift_estimated", bool, optional=True),
            drift={
                str(st): DriftEstimate.from_json(d, where=f"{where} drift {st!r}")
                for st, d in r.get("drift", dict).items()
            },
            verdicts=tuple(
                AdviceVerdict.from_json(v, where=f"{where} verdicts[{i}]")
                for i, v in enumerate(r.get("verdicts", list))
            ),
            best=r.parsed("best", _choices),
            recommended=tuple(
                Recommended.from_json(v, where=f"{where} recommended[{i}]")
                for i, v in enumerate(r.get("recommended", list))
            ),
            commands=tuple(
                AdviceCommand.from_json(v, where=f"{where} commands[{i}]")
                for i, v in enumerate(r.get("commands", (list, tuple)))
            ),
        )


def _hardware(obj: dict[str, Any]) -> Hardware:
    from moetrace.placement.hardware import hardware_from_json

    return hardware_from_json(obj, name="`hardware`")


def _rearrangement(obj: dict[str, Any]) -> Rearrangement:
    from moetrace.placement.advise.rearrange import Rearrangement

    s, n = obj.get("stall_seconds"), obj.get("interval_steps")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(
            f"`rearrangement` must hold a number `stall_seconds` and an integer `interval_steps`, got {obj!r}"
        )
    return Rearrangement(stall_seconds=s, interval_steps=n)


def _choices(obj: dict[str, Any]) -> dict[str, StageChoice]:
    """``best``: stage -> its decision (``StageChoice.from_json``: null figures as NaN)."""
    try:
        return {str(st): StageChoice.from_json(ch) for st, ch in obj.items()}
    except (TypeError, AttributeError) as exc:  # a key missing or unknown, a decision not an object
        raise TypeError(f"`best` holds a malformed decision ({exc}); re-run `{ADVICE.command}`") from None


#: advice.json's keys in the order ``advise`` and ``write_advice`` write them
_ADVICE_KEYS: tuple[str, ...] = (
    "input",
    "input_kind",
    "trace",
    "model",
    "deployment",
    "gpus_per_node",
    "num_ep",
    "num_nodes",
    "reference",
    "current_format",
    "stages",
    "recorded_stages",
    "missing",
    "redundancy_sweep",
    "max_slots_per_gpu",
    "num_steps",
    "decode_dedup",
    "prefill_dedup",
    "hardware",
    "expert",
    "test_fraction",
    "seed",
    "strategies",
    "eplb_sum",
    "replica_policy",
    "step_tokens_per_gpu",
    "rearrangement",
    "prefill_decode_correlation",
    "drift_estimated",
    "drift",
    "verdicts",
    "best",
    "recommended",
    "commands",
)
