"""``compare.json``, typed: one compare run's configuration and facts, written and read here only.

``CompareManifest`` is what ``moetrace compare -o`` writes as ``compare.json`` (``to_json``; its
``format`` and ``version`` come from ``moetrace.results.COMPARE``) and what every reader gets back
(``from_json``, ``read_compare_manifest``): ``compare``'s printed summary and the dashboard read its
fields, never the JSON's keys. Its parts are records too: the clustering of each grouped strategy
(``GroupingRecord``), the ranking and decision per stage (``CompareVerdict``, built by
``compare_verdict.compare_verdict``) and the step model (``placement.hardware.Hardware``). Keys that
files written by older moetrace lack (``LATER_KEYS``, ``VERDICT_LATER_KEYS``) get their meaning from
before they existed, here and nowhere else.

Out of scope: the tables of a compare results directory (``compare.write_results``, docs/placement.md);
the run itself (``compare.run_compare``); file names, formats, versions (``moetrace.results``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace.errors import TraceFormatError
from moetrace.placement.decision import StageChoice
from moetrace.results import COMPARE, COMPARE_MANIFEST, ManifestFields, read_result_manifest
from moetrace.tracer.trace.schema import ModelInfo

if TYPE_CHECKING:
    from moetrace.placement.hardware import Hardware

__all__ = [
    "LATER_KEYS",
    "VERDICT_LATER_KEYS",
    "CompareManifest",
    "CompareVerdict",
    "GroupingRecord",
    "read_compare_manifest",
]

#: keys added to compare.json after its format was stamped -> their value in files that lack them
LATER_KEYS: dict[str, Any] = {
    "oracle": False,  # no bound rows then
    "bounds": (),
    "bound_kinds": {},
    "expert_copy_floor": None,
    # the cost model (issue: rank by predicted time per step); older files ranked by bytes alone
    "prefill_dedup": None,
    "max_node_load": None,
    "prefill_tokens_per_node": 0,
    "num_prefill_batches": 0,
    "links": None,
    "expert": None,
    "skipped": {},  # bounds left out and why (issue #26); older files did not say
    "route_first_decode": 0,  # routers saw the prefill (the what-if --route-on first-decode:N came later)
    "request_unit": "request",  # imports of forward passes without request ids came later
    "tokens_from": None,  # simulated tokens drawn from a load profile (issue #23); older files: the trace's requests
    # request caps (issue #27): older files fitted on every training request and drew from every held-out one
    "num_trace_requests": None,
    "num_trace_train_requests": None,
    "num_trace_test_requests": None,
    "max_train_requests": None,
    "max_test_requests": None,
    "model_config": None,  # --model-config came later
    "bound_failures": {},  # bounds beaten by a deployable row (issue #34); older files substituted the row
    "hardware": None,  # the step model's kernels (issue #33); older files: links only, combine = dispatch
    "verdict": None,  # the ranking by MoE-layer time (issue #34); older files ranked by all-to-all time, unwritten
}


#: the request caps' keys (issue #27), absent for a load profile
_CAP_KEYS = (
    "num_trace_requests",
    "num_trace_train_requests",
    "num_trace_test_requests",
    "max_train_requests",
    "max_test_requests",
)
#: keys compare.json leaves out while they hold their ``LATER_KEYS`` value (what a file without them means)
_LEFT_OUT_AT_DEFAULT = frozenset(
    {
        "expert_copy_floor",
        "skipped",
        "route_first_decode",
        "request_unit",
        "tokens_from",
        "hardware",
        "model_config",
        "bound_failures",
        "verdict",
        *_CAP_KEYS,
    }
)

#: the keys the cost model added (a manifest without ``links`` predates them all)
_COST_KEYS = frozenset(
    {"prefill_dedup", "links", "max_node_load", "prefill_tokens_per_node", "num_prefill_batches", "expert"}
)


@dataclass(frozen=True, kw_only=True)
class GroupingRecord:
    """What compare.json says of one grouped strategy's clustering and router."""

    num_clusters: int  # C K-means clusters of the training requests
    cluster_to_groups: tuple[tuple[int, ...], ...]  # [C] the groups (nodes) serving each cluster
    router_match_rate: float | None  # share of held-out requests routed from prefill as their decode would route them
    groups_without_routed_requests: tuple[int, ...]  # nodes no held-out request was routed to

    def to_json(self) -> dict[str, Any]:
        return {
            "num_clusters": self.num_clusters,
            "cluster_to_groups": [list(g) for g in self.cluster_to_groups],
            "router_match_rate": self.router_match_rate,
            "groups_without_routed_requests": list(self.groups_without_routed_requests),
        }


#: keys compare.json's ``verdict`` gained after it was first written -> their value in files that lack them
VERDICT_LATER_KEYS: dict[str, Any] = {
    "stages": {},  # the decision per stage by the one rule (issue 39) came later
}


@dataclass(frozen=True, kw_only=True)
class CompareVerdict:
    """compare.json's ``verdict`` (``compare_verdict.compare_verdict``): the deployable strategies within
    the node-load limit ranked by the verdict's measure (median per step, over the reference's), and per
    simulated stage the decision by the one rule (``decision.choose``, the rule ``advise`` applies too)."""

    measure: str  # "moe_time" (MoE-layer time per step), or "a2a_time" (all-to-all time: expert size unknown)
    ranking: tuple[str, ...]  # the deployable strategies within the node-load limit, fastest first
    recommended: str | None  # the first of them; None: none within the limit
    over_node_load_limit: tuple[str, ...]  # the strategies whose router sends a node more than the limit
    time_normalized: dict[str, float]  # strategy -> its median in the measure over the reference's (NaN: ref 0)
    a2a_time_normalized: dict[str, float]  # strategy -> its median all-to-all time over the reference's
    stages: dict[str, StageChoice] = field(default_factory=dict)  # stage -> its decision; empty: an older file

    @property
    def by_moe_time(self) -> bool:
        """Ranked by MoE-layer time (else by all-to-all time: the expert size was unknown)."""
        return self.measure == "moe_time"

    def to_json(self) -> dict[str, Any]:
        return {
            "measure": self.measure,
            "ranking": list(self.ranking),
            "recommended": self.recommended,
            "over_node_load_limit": list(self.over_node_load_limit),
            "time_normalized": dict(self.time_normalized),
            "a2a_time_normalized": dict(self.a2a_time_normalized),
            "stages": {st: ch.to_json() for st, ch in self.stages.items()},
        }

    @classmethod
    def from_json(cls, obj: object, *, where: str) -> CompareVerdict:
        r = ManifestFields(obj, where, kind=COMPARE, later=VERDICT_LATER_KEYS)
        return cls(
            measure=r.text("measure"),
            ranking=r.names("ranking"),
            recommended=r.text("recommended", optional=True),
            over_node_load_limit=r.names("over_node_load_limit"),
            time_normalized=r.numbers("time_normalized"),
            a2a_time_normalized=r.numbers("a2a_time_normalized"),
            stages=r.parsed("stages", _choices),
        )


def _choices(obj: dict[str, Any]) -> dict[str, StageChoice]:
    """``verdict.stages``: stage -> its decision (``StageChoice.from_json``: null figures as NaN)."""
    try:
        return {str(st): StageChoice.from_json(ch) for st, ch in obj.items()}
    except (TypeError, AttributeError) as exc:  # a key missing or unknown, a decision not an object
        raise TypeError(f"`verdict.stages` holds a malformed decision ({exc}); re-run `{COMPARE.command}`") from None


def _hardware(obj: dict[str, Any]) -> Hardware:
    from moetrace.placement.hardware import hardware_from_json

    return hardware_from_json(obj, name="`hardware`")


@dataclass(frozen=True, kw_only=True)
class CompareManifest:
    """One compare run (fields in the order compare.json holds them; the first fifteen are
    ``CompareConfig``'s, the deployment given by its name and sizes)."""

    strategies: tuple[
        str, ...
    ]  # the strategies asked for, in order, each once (the reference is simulated even when absent)
    num_clusters: int  # K-means clusters of grouped strategies (0: one per node)
    num_redundant: int  # redundant slots per layer
    test_fraction: float  # share of requests held out
    num_batches: int  # global batches simulated
    num_batch_requests: int  # requests per global batch as asked (0: 32 per node)
    dedup: str  # a token is sent once per distinct destination of this unit ("rank", "expert", "node")
    replica_policy: str  # which replica serves a token ("same_node", "even", "metro")
    bytes_per_value: int  # bytes per hidden value on the wire
    seed: int  # split, K-means, random placement, batch sampling
    oracle: bool  # the upper bounds were asked for
    prefill_dedup: str | None = None  # copy model of the prefill stage; None: written before the cost model
    # the step model's kernels per copy model (written as ``Hardware.to_json``); None: written before it
    hardware: Hardware | None = None
    max_node_load: float | None = None  # routers over this load (busiest node / even share) are flagged
    prefill_tokens_per_node: int = 0  # chunked-prefill tokens per node and step at an even share
    # N > 0: a what-if, not deployable: routers saw each request's first N generated tokens, not its prefill
    route_first_decode: int = 0
    max_train_requests: int | None = None  # placements fitted on at most this many training requests (a sample)
    max_test_requests: int | None = None  # batches drawn from at most this many held-out requests (a sample)
    model_config: dict[str, Any] | None = None  # the user's --model-config (parsed config.json); None: not given
    deployment: str  # DPaTPbEPc[TPd]
    gpus_per_node: int  # GPUs per node
    batch_requests: int  # requests per global batch used
    num_ep: int  # W EP ranks
    num_nodes: int  # G nodes (= node groups)
    ranks_per_node: int  # EP ranks per node
    bounds: tuple[str, ...]  # the bound rows of the results (strategies.BOUNDS), empty without them
    trace: str  # the trace's path
    num_train_requests: int  # requests the placements were built from
    num_test_requests: int  # held-out requests the batches were drawn from
    bound_kinds: dict[str, str | None]  # bound -> the strategy its best candidate derives from
    expert_copy_floor: float | None  # the proven floor (--dedup expert, no redundancy, bounds on); None: not proven
    reference: str  # the strategy whose median normalizes inter-node volume
    model: ModelInfo  # the traced model
    grouping: dict[str, GroupingRecord]  # grouped strategy -> its clustering and router
    num_prefill_batches: int = 0  # prefill steps simulated (0: none, e.g. a decode-only trace)
    expert: dict[str, Any] | None = None  # the cost model's expert (cost.ExpertCompute.to_json); None: size unknown
    skipped: dict[str, str] = field(default_factory=dict)  # bound (or "floor") -> why it has no row in this run
    # bound -> the deployable rows within the node-load limit that beat it: the bound failed (not hidden)
    bound_failures: dict[str, list[str]] = field(default_factory=dict)
    # the deployable strategies within the node-load limit ranked by MoE-layer time per step (all-to-all time
    # when the expert size is unknown), and the decision per stage (compare_verdict); None: a file from before it
    verdict: CompareVerdict | None = None
    # what one trace request is: "request", or "forward pass" (imports that carry no request ids)
    request_unit: str = "request"
    tokens_from: str | None = None  # None: held-out requests of the trace; else how the tokens were drawn (a profile)
    links: dict[str, Any] | None = (
        None  # the decode kernel's dispatch links (cost.Links.to_json); None: written before the cost model
    )
    # the trace's requests and its split before the caps (None: a load profile, or a file from before the caps)
    num_trace_requests: int | None = None
    num_trace_train_requests: int | None = None
    num_trace_test_requests: int | None = None

    @property
    def capped(self) -> bool:
        """Whether the placements or the batches used a sample of the trace's training or held-out requests."""
        return (self.num_trace_train_requests or 0) > self.num_train_requests or (
            self.num_trace_test_requests or 0
        ) > self.num_test_requests

    def to_json(self) -> dict[str, Any]:
        """compare.json's body (``moetrace.results.write_result_json`` puts format and version first)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _LEFT_OUT_AT_DEFAULT and v == LATER_KEYS[f.name]:
                continue  # nothing to say (no floor proven, nothing skipped, routed on the prefill, ...): LATER_KEYS reads it back
            if self.links is None and f.name in _COST_KEYS:
                continue  # a file written before the cost model: written back as it was
            if isinstance(v, tuple):
                v = list(v)
            elif f.name == "model":
                v = v.to_dict()
            elif f.name == "grouping":
                v = {s: g.to_json() for s, g in v.items()}
            elif f.name in ("verdict", "hardware") and v is not None:
                v = v.to_json()
            out[f.name] = v
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, where: str) -> CompareManifest:
        """The manifest in ``obj`` (compare.json read from ``where``, format and version already
        checked); ``TraceFormatError`` naming the first key that is missing or of the wrong type."""
        r = ManifestFields(obj, where, kind=COMPARE, later=LATER_KEYS)
        verdict = r.get("verdict", dict, optional=True)
        return cls(
            strategies=r.names("strategies"),
            num_clusters=r.integer("num_clusters"),
            num_redundant=r.integer("num_redundant"),
            test_fraction=r.number("test_fraction"),
            num_batches=r.integer("num_batches"),
            num_batch_requests=r.integer("num_batch_requests"),
            dedup=r.get("dedup", str),
            replica_policy=r.get("replica_policy", str),
            bytes_per_value=r.integer("bytes_per_value"),
            seed=r.integer("seed"),
            oracle=r.get("oracle", bool),
            deployment=r.get("deployment", str),
            gpus_per_node=r.integer("gpus_per_node"),
            batch_requests=r.integer("batch_requests"),
            num_ep=r.integer("num_ep"),
            num_nodes=r.integer("num_nodes"),
            ranks_per_node=r.integer("ranks_per_node"),
            bounds=r.names("bounds"),
            trace=r.get("trace", str),
            num_train_requests=r.integer("num_train_requests"),
            num_test_requests=r.integer("num_test_requests"),
            bound_kinds={str(k): (None if v is None else str(v)) for k, v in r.get("bound_kinds", dict).items()},
            expert_copy_floor=r.number("expert_copy_floor", optional=True),
            reference=r.get("reference", str),
            model=r.parsed("model", ModelInfo.from_dict),
            grouping={str(s): _grouping(g, where, s) for s, g in r.get("grouping", dict).items()},
            prefill_dedup=r.get("prefill_dedup", str, optional=True),
            max_node_load=r.number("max_node_load", optional=True),
            prefill_tokens_per_node=r.integer("prefill_tokens_per_node"),
            num_prefill_batches=r.integer("num_prefill_batches"),
            links=r.get("links", dict, optional=True),
            expert=r.get("expert", dict, optional=True),
            skipped={str(k): str(v) for k, v in r.get("skipped", dict).items()},
            bound_failures={str(k): [str(x) for x in v] for k, v in r.get("bound_failures", dict).items()},
            verdict=None if verdict is None else CompareVerdict.from_json(verdict, where=f"{where} verdict"),
            route_first_decode=r.integer("route_first_decode"),
            request_unit=r.get("request_unit", str),
            tokens_from=r.get("tokens_from", str, optional=True),
            hardware=r.parsed_or_none("hardware", _hardware),
            model_config=r.get("model_config", dict, optional=True),
            **{k: r.get(k, int, optional=True) for k in _CAP_KEYS},
        )

    @property
    def cost(self) -> dict[str, Any] | None:
        """The cost model as ``{"links": ..., "expert": ...}`` (None: written before it)."""
        return None if self.links is None else {"links": self.links, "expert": self.expert}

    @property
    def has_time(self) -> bool:
        """The run predicted time per step (written with the cost model)."""
        return self.links is not None


def read_compare_manifest(path: str | os.PathLike) -> CompareManifest:
    """The ``compare.json`` of the results directory ``path`` (or that file itself), its format and
    version checked; ``TraceFormatError`` naming the problem."""
    kind, obj = read_result_manifest(path)
    where = str(Path(path) / COMPARE_MANIFEST if Path(path).is_dir() else path)
    if kind is not COMPARE:
        raise TraceFormatError(f"{path}: {kind.format} results, not {COMPARE.format} (written by `{COMPARE.command}`)")
    return CompareManifest.from_json(obj, where=where)


def _grouping(g: object, where: str, strategy: str) -> GroupingRecord:
    if not isinstance(g, dict):
        raise TraceFormatError(f"{where}: `grouping` of {strategy!r} must be an object; re-run `{COMPARE.command}`")
    r = ManifestFields(g, f"{where} grouping {strategy!r}", kind=COMPARE, later=LATER_KEYS)
    c2g = r.get("cluster_to_groups", list)
    return GroupingRecord(
        num_clusters=r.integer("num_clusters"),
        cluster_to_groups=tuple(tuple(int(x) for x in gs) for gs in c2g),
        router_match_rate=r.number("router_match_rate", optional=True),
        groups_without_routed_requests=tuple(int(x) for x in r.get("groups_without_routed_requests", list)),
    )
