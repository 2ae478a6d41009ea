"""``a2a.json`` and ``advice.json``, typed: what the dashboard reads of ``moetrace a2a`` and
``moetrace advise`` results, and nothing from their keys.

``A2AManifest`` is the ``a2a.json`` that ``placement.replay.results.write_a2a_results`` writes (its
summary rows ``A2ASummaryRow``, its links ``placement.replay.network.Network``); ``AdviceManifest``
the ``advice.json`` that ``placement.advise_files.write_advice`` writes (its verdicts, recommended
placements and commands as records, its per-stage decision as ``placement.decision.StageChoice``).
``from_json`` takes exactly what those writers write (format and version already checked by
``moetrace.results.read_result_manifest``) and raises ``TraceFormatError`` naming the first key that
is missing or of the wrong type; ``to_json`` gives the body back key for key, in the writer's order
(``moetrace.results.write_result_json`` puts ``format`` and ``version`` first), so a file read and
written again is the same bytes. Keys added after a format was stamped (``A2A_LATER_KEYS``,
``ADVICE_LATER_KEYS``) get their meaning from before they existed.

Out of scope: writing these files (the writers above own them; these records do not change a byte
of what is written); ``compare.json`` (``placement.compare_manifest.CompareManifest``); the
parts no dashboard section reads, kept as the JSON they were written as (the replay's cost model,
advise's hardware, expert, drift and rearrangement settings); the tables beside the manifests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moetrace.errors import TraceFormatError
from moetrace.placement.decision import StageChoice
from moetrace.results import A2A, ADVICE
from moetrace.tracer.trace.schema import ModelInfo

if TYPE_CHECKING:  # imported where an a2a.json is read: the replay package is 0.3 s of imports
    from moetrace.placement.replay.network import Network

__all__ = [
    "A2A_LATER_KEYS",
    "ADVICE_LATER_KEYS",
    "A2AManifest",
    "A2ASummaryRow",
    "AdviceCommand",
    "AdviceManifest",
    "AdviceVerdict",
    "Recommended",
]

#: keys a2a.json gained after ``moetrace.a2a`` v1 was stamped -> their value in files that lack them
A2A_LATER_KEYS: dict[str, Any] = {
    "network": None,  # how the links were realized (emulated nodes came later): unknown
    "cost_model": None,  # the step model against the replay came later: no prediction
    # summary rows: time per batch and its prediction came with the cost model
    "layer_seconds_median": None,
    "measured_seconds_per_batch_median": None,
    "predicted_seconds_per_batch_median": None,
    "measured_time_normalized_median": None,
    "predicted_time_normalized_median": None,
    "predicted_over_measured": None,
}

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


class _Fields:
    """Typed access to one JSON object's keys; ``later`` fills the keys older files lack."""

    def __init__(self, obj: object, where: str, *, command: str, later: dict[str, Any]) -> None:
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected an object, got {type(obj).__name__}; re-run `{command}`")
        self.obj, self.where, self.command, self.later = obj, where, command, later

    def get(self, key: str, typ: type | tuple[type, ...], *, optional: bool = False) -> Any:
        if key not in self.obj:
            if key in self.later:
                return self.later[key]
            raise TraceFormatError(f"{self.where}: no `{key}`; re-run `{self.command}`")
        v = self.obj[key]
        types = typ if isinstance(typ, tuple) else (typ,)
        if (v is None and optional) or (isinstance(v, types) and (bool in types or not isinstance(v, bool))):
            return v
        raise TraceFormatError(
            f"{self.where}: `{key}` is {v!r}, expected {' or '.join(t.__name__ for t in types)}"
            f"{' or null' if optional else ''}; re-run `{self.command}`"
        )

    def integer(self, key: str) -> int:
        return int(self.get(key, int))

    def number(self, key: str, *, optional: bool = False) -> Any:
        v = self.get(key, (int, float), optional=optional)
        return None if v is None else float(v)

    def text(self, key: str, *, optional: bool = False) -> Any:
        return self.get(key, str, optional=optional)

    def names(self, key: str) -> tuple[str, ...]:
        v = self.get(key, (list, tuple))
        if not all(isinstance(s, str) for s in v):
            raise TraceFormatError(f"{self.where}: `{key}` must be a list of names; re-run `{self.command}`")
        return tuple(v)

    def model(self) -> ModelInfo:
        try:
            return ModelInfo.from_dict(self.get("model", dict))
        except TraceFormatError as exc:
            raise TraceFormatError(f"{self.where}: {exc}") from None


# ------------------------------------------------------------------------------------------ a2a.json
@dataclass(frozen=True, kw_only=True)
class A2ASummaryRow:
    """One strategy of ``a2a.json``'s ``summary`` (``replay.results.summary_rows``), normalized to the
    reference's median over batches (NaN when that median is 0)."""

    strategy: str  # the strategy replayed
    reference: str  # the strategy whose median normalizes (linear when replayed, else the first)
    measured_inter_node_normalized_median: float  # median inter-node bytes per batch the collectives sent / ref's
    simulated_inter_node_normalized_median: float  # the same of the simulator's bytes
    measured_inter_node_bytes_per_batch_median: float  # bytes, dispatch + combine over layers and ranks
    simulated_inter_node_bytes_per_batch_median: float  # bytes, the simulator's
    dispatch_seconds_median: float  # median over (batch, layer) of the slowest rank's dispatch collective
    combine_seconds_median: float  # the same of combine
    layer_seconds_median: float | None  # dispatch + combine of one (batch, layer), median; None: an older file
    measured_seconds_per_batch_median: float | None  # dispatch + combine over layers per batch, median
    predicted_seconds_per_batch_median: float | None  # the step model's (emulated nodes only); None: no model
    measured_time_normalized_median: float | None  # measured time per batch / the reference's, median
    predicted_time_normalized_median: float | None  # the step model's, likewise (emulated nodes only)
    predicted_over_measured: float | None  # the two ratios' quotient (emulated nodes only)

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in _A2A_ROW_KEYS}

    @classmethod
    def from_json(cls, obj: object, *, where: str) -> A2ASummaryRow:
        r = _Fields(obj, where, command=A2A.command, later=A2A_LATER_KEYS)
        nums = {k: r.number(k, optional=k in A2A_LATER_KEYS) for k in _A2A_ROW_KEYS[2:]}
        return cls(strategy=r.text("strategy"), reference=r.text("reference"), **nums)


#: the summary row's keys in the order ``summary_rows`` writes them
_A2A_ROW_KEYS: tuple[str, ...] = (
    "strategy",
    "reference",
    "measured_inter_node_normalized_median",
    "simulated_inter_node_normalized_median",
    "measured_inter_node_bytes_per_batch_median",
    "simulated_inter_node_bytes_per_batch_median",
    "dispatch_seconds_median",
    "combine_seconds_median",
    "layer_seconds_median",
    "measured_seconds_per_batch_median",
    "predicted_seconds_per_batch_median",
    "measured_time_normalized_median",
    "predicted_time_normalized_median",
    "predicted_over_measured",
)


@dataclass(frozen=True, kw_only=True)
class A2AManifest:
    """One ``moetrace a2a`` run (fields in the order a2a.json holds them; the first thirteen are the
    replay plan's ``config``)."""

    deployment: str  # DPaTPbEPc[TPd]
    gpus_per_node: int  # GPUs per node
    num_ep: int  # W EP ranks
    num_nodes: int  # G nodes
    ranks_per_node: int  # EP ranks per node
    num_batches: int  # global batches replayed
    batch_requests: int  # requests per global batch
    dedup: str  # copy model of the decode steps ("rank", "expert", "node")
    replica_policy: str  # which replica serves a token
    seed: int  # split and batch sampling
    test_fraction: float  # share of requests held out
    trace: str  # the trace's path, relative to the results directory
    model: ModelInfo  # the traced model
    strategies: tuple[str, ...]  # V strategies, in run order
    backend: str  # "gloo" or "nccl"
    world_size: int  # ranks that ran
    hidden_size: int  # values per token row
    dtype: str  # their dtype on the wire
    bytes_per_token: int  # bytes of one token row
    device: str  # "cpu" or "cuda"
    hosts: tuple[str, ...]  # host names of the ranks
    bytes_match: bool  # every (collective, rank) sent exactly the predicted bytes
    first_mismatch: str | None  # the first collective that did not, in words; None: all matched
    summary: tuple[A2ASummaryRow, ...]  # one per strategy, in run order
    network: Network | None  # how the links between nodes were realized; None: an older file
    cost_model: dict[str, Any] | None  # the step model's links as realized (replay.predict.ReplayCost), as written

    def to_json(self) -> dict[str, Any]:
        """a2a.json's body (``moetrace.results.write_result_json`` puts format and version first)."""
        return {
            "deployment": self.deployment,
            "gpus_per_node": self.gpus_per_node,
            "num_ep": self.num_ep,
            "num_nodes": self.num_nodes,
            "ranks_per_node": self.ranks_per_node,
            "num_batches": self.num_batches,
            "batch_requests": self.batch_requests,
            "dedup": self.dedup,
            "replica_policy": self.replica_policy,
            "seed": self.seed,
            "test_fraction": self.test_fraction,
            "trace": self.trace,
            "model": self.model.to_dict(),
            "strategies": list(self.strategies),
            "backend": self.backend,
            "world_size": self.world_size,
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "bytes_per_token": self.bytes_per_token,
            "device": self.device,
            "hosts": list(self.hosts),
            "bytes_match": self.bytes_match,
            "first_mismatch": self.first_mismatch,
            "summary": [r.to_json() for r in self.summary],
            "network": None if self.network is None else self.network.to_dict(),
            "cost_model": self.cost_model,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, where: str) -> A2AManifest:
        """The manifest in ``obj`` (a2a.json read from ``where``, format and version already checked)."""
        r = _Fields(obj, where, command=A2A.command, later=A2A_LATER_KEYS)
        return cls(
            deployment=r.text("deployment"),
            gpus_per_node=r.integer("gpus_per_node"),
            num_ep=r.integer("num_ep"),
            num_nodes=r.integer("num_nodes"),
            ranks_per_node=r.integer("ranks_per_node"),
            num_batches=r.integer("num_batches"),
            batch_requests=r.integer("batch_requests"),
            dedup=r.text("dedup"),
            replica_policy=r.text("replica_policy"),
            seed=r.integer("seed"),
            test_fraction=r.number("test_fraction"),
            trace=r.text("trace"),
            model=r.model(),
            strategies=r.names("strategies"),
            backend=r.text("backend"),
            world_size=r.integer("world_size"),
            hidden_size=r.integer("hidden_size"),
            dtype=r.text("dtype"),
            bytes_per_token=r.integer("bytes_per_token"),
            device=r.text("device"),
            hosts=r.names("hosts"),
            bytes_match=r.get("bytes_match", bool),
            first_mismatch=r.text("first_mismatch", optional=True),
            summary=tuple(
                A2ASummaryRow.from_json(row, where=f"{where} summary[{i}]")
                for i, row in enumerate(r.get("summary", list))
            ),
            network=_network(r.get("network", dict, optional=True), where=f"{where} network"),
            cost_model=r.get("cost_model", dict, optional=True),
        )

    @property
    def reference(self) -> str:
        """The strategy the summary is normalized to (linear when it ran)."""
        return self.summary[0].reference if self.summary else "linear"


def _network(obj: dict[str, Any] | None, *, where: str) -> Network | None:
    from moetrace.placement.replay.network import Network

    if obj is None:
        return None
    r = _Fields(obj, where, command=A2A.command, later={"link": "", "qdisc": "", "note": "", "link_bytes": []})
    link_bytes = r.get("link_bytes", list)
    try:
        pairs = tuple((int(a), int(b)) for a, b in link_bytes)
    except (TypeError, ValueError):
        raise TraceFormatError(
            f"{where}: `link_bytes` must be [sent, received] per node; re-run `{A2A.command}`"
        ) from None
    return Network(
        mode=r.text("mode"), link=r.text("link"), qdisc=r.text("qdisc"), note=r.text("note"), link_bytes_G2=pairs
    )


# --------------------------------------------------------------------------------------- advice.json
@dataclass(frozen=True, kw_only=True)
class AdviceVerdict:
    """One verdict of ``advice.json`` (``advise_verdicts.verdicts``): a stage's answer in words."""

    stage: str | None  # "prefill", "decode", "both"; None: about the input as a whole (what it lacks)
    verdict: str  # "enable", "no gain", "not evaluated", "separate", "together", "missing", ...
    option: str | None  # the option it recommends (an option key); None: none
    text: str  # the verdict in words, as the command prints it
    info: dict[str, Any] = field(default_factory=dict)  # the figures behind it (rearrangement cost ...), as written

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "verdict": self.verdict, "option": self.option, "text": self.text, **self.info}

    @classmethod
    def from_json(cls, obj: object, *, where: str) -> AdviceVerdict:
        r = _Fields(obj, where, command=ADVICE.command, later={})
        info = {k: v for k, v in r.obj.items() if k not in ("stage", "verdict", "option", "text")}
        return cls(
            stage=r.text("stage", optional=True),
            verdict=r.text("verdict"),
            option=r.text("option", optional=True),
            text=r.text("text"),
            info=info,
        )


@dataclass(frozen=True, kw_only=True)
class Recommended:
    """One recommended placement of ``advice.json``: a stage's option and its placement file."""

    stage: str  # the stage it serves ("prefill", "decode", "both")
    option: str  # the option's key (``eplb-64``, ``joint``)
    placement: str  # its placement file, relative to the advice directory

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "option": self.option, "placement": self.placement}

    @classmethod
    def from_json(cls, obj: object, *, where: str) -> Recommended:
        r = _Fields(obj, where, command=ADVICE.command, later={})
        return cls(stage=r.text("stage"), option=r.text("option"), placement=r.text("placement"))


@dataclass(frozen=True, kw_only=True)
class AdviceCommand:
    """The commands that reproduce and export one recommended placement (``advise_files.commands``)."""

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
        r = _Fields(obj, where, command=ADVICE.command, later={})
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

    input: str  # the trace or load profile advised on, relative to the advice directory
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
    hardware: dict[str, Any] | None  # the step model's kernels and links (hardware.Hardware.to_json), as written
    expert: dict[str, Any] | None  # the experts' size (cost.ExpertCompute.to_json), as written; None: unknown
    test_fraction: float  # share of a trace's requests held out
    seed: int  # split and sampling
    strategies: tuple[str, ...]  # the strategies whose options were evaluated
    eplb_sum: str | None  # how EPLB summed its pack weights ("float64", "float32")
    replica_policy: str | None  # which replica serves a token
    step_tokens_per_gpu: dict[str, int] | None  # "decode" / "prefill" -> tokens per GPU in one step
    rearrangement: dict[str, Any] | None  # the rearrangement's stall and interval, as written
    prefill_decode_correlation: float | None  # the stages' loads' correlation; None: one stage recorded
    drift_estimated: bool | None  # the drift was estimated over windows
    drift: dict[str, Any]  # stage -> the drift estimate (or why skipped), as written
    verdicts: tuple[AdviceVerdict, ...]  # in the order the command prints them
    best: dict[str, StageChoice]  # stage -> its decision by the one rule (placement.decision); empty: older file
    recommended: tuple[Recommended, ...]  # the placements written under placements/
    commands: tuple[AdviceCommand, ...]  # the commands reproducing and exporting each recommended one

    def to_json(self) -> dict[str, Any]:
        """advice.json's body (``moetrace.results.write_result_json`` puts format and version first)."""
        out: dict[str, Any] = {}
        for name in _ADVICE_KEYS:
            v = getattr(self, name)
            if name == "model":
                v = v.to_dict()
            elif name == "best":
                v = {st: ch.to_json() for st, ch in v.items()}
            elif name in ("verdicts", "recommended", "commands"):
                v = [x.to_json() for x in v]
            elif isinstance(v, tuple):
                v = list(v)
            out[name] = v
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, where: str) -> AdviceManifest:
        """The manifest in ``obj`` (advice.json read from ``where``, format and version already checked)."""
        r = _Fields(obj, where, command=ADVICE.command, later=ADVICE_LATER_KEYS)
        return cls(
            input=r.text("input"),
            input_kind=r.text("input_kind"),
            trace=r.text("trace", optional=True),
            model=r.model(),
            deployment=r.text("deployment"),
            gpus_per_node=r.integer("gpus_per_node"),
            num_ep=r.integer("num_ep"),
            num_nodes=r.integer("num_nodes"),
            reference=r.text("reference"),
            current_format=r.text("current_format", optional=True),
            stages=r.names("stages"),
            recorded_stages=r.names("recorded_stages"),
            missing=r.names("missing"),
            redundancy_sweep=_ints(r, "redundancy_sweep"),
            max_slots_per_gpu=r.integer("max_slots_per_gpu"),
            num_steps={str(k): int(v) for k, v in r.get("num_steps", dict).items()},
            decode_dedup=r.text("decode_dedup"),
            prefill_dedup=r.text("prefill_dedup"),
            hardware=r.get("hardware", dict, optional=True),
            expert=r.get("expert", dict, optional=True),
            test_fraction=r.number("test_fraction"),
            seed=r.integer("seed"),
            strategies=r.names("strategies"),
            eplb_sum=r.text("eplb_sum", optional=True),
            replica_policy=r.text("replica_policy", optional=True),
            step_tokens_per_gpu=r.get("step_tokens_per_gpu", dict, optional=True),
            rearrangement=r.get("rearrangement", dict, optional=True),
            prefill_decode_correlation=r.number("prefill_decode_correlation", optional=True),
            drift_estimated=r.get("drift_estimated", bool, optional=True),
            drift=r.get("drift", dict),
            verdicts=tuple(
                AdviceVerdict.from_json(v, where=f"{where} verdicts[{i}]")
                for i, v in enumerate(r.get("verdicts", list))
            ),
            best=_choices(r),
            recommended=tuple(
                Recommended.from_json(v, where=f"{where} recommended[{i}]")
                for i, v in enumerate(r.get("recommended", list))
            ),
            commands=tuple(
                AdviceCommand.from_json(v, where=f"{where} commands[{i}]")
                for i, v in enumerate(r.get("commands", (list, tuple)))
            ),
        )


def _ints(r: _Fields, key: str) -> tuple[int, ...]:
    v = r.get(key, list)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise TraceFormatError(f"{r.where}: `{key}` must be a list of integers; re-run `{r.command}`")
    return tuple(v)


def _choices(r: _Fields) -> dict[str, StageChoice]:
    """``best``: stage -> its decision (``StageChoice.from_json``: null figures as NaN)."""
    try:
        return {str(st): StageChoice.from_json(ch) for st, ch in r.get("best", dict).items()}
    except TypeError as exc:  # a key missing or unknown
        raise TraceFormatError(f"{r.where}: `best` holds a malformed decision ({exc}); re-run `{r.command}`") from None


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
