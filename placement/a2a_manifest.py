"""``a2a.json``, typed: one ``moetrace a2a`` run's configuration, checks and summary, written and read
here only.

``A2AConfig`` is the replay plan's provenance (``replay.plan.build_plan`` builds it as
``A2APlan.config``): the deployment, the held-out batches, the copy model and the trace, the first
thirteen keys of ``a2a.json``.

``A2AManifest`` is what ``placement.replay.results.write_a2a_results`` writes as ``a2a.json``
(``to_json``; ``format`` and ``version`` from ``moetrace.results.A2A``, put first by
``moetrace.results.write_result_json``) and what every reader gets back (``from_json``; the
dashboard's a2a section reads its fields, never the JSON's keys). Its summary rows are
``A2ASummaryRow`` (``replay.results.summary_rows`` builds them), its links
``placement.replay.network.Network``. ``from_json`` takes exactly what the writer writes and raises
``TraceFormatError`` naming the first key that is missing or of the wrong type; ``to_json`` gives the
body back key for key, so a file read and written again is the same bytes. Keys added after the
format was stamped (``A2A_LATER_KEYS``) get their meaning from before they existed, here and nowhere else.

Out of scope: running the replay and its summary's figures (``placement.replay``); the replay's cost
model, kept as the JSON it was written as (``replay.predict.ReplayCost.to_json``);
``collectives.parquet``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetrace.errors import TraceFormatError
from moetrace.results import A2A, ManifestFields
from moetrace.tracer.trace.schema import ModelInfo

if TYPE_CHECKING:  # imported where an a2a.json is read: the replay package is 0.3 s of imports
    from moetrace.placement.replay.network import Network

__all__ = ["A2A_LATER_KEYS", "A2AConfig", "A2AManifest", "A2ASummaryRow"]

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


@dataclass(frozen=True, kw_only=True)
class A2AConfig:
    """The replay plan's provenance (``A2APlan.config``; a2a.json's first thirteen keys, in this order)."""

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
    trace: str  # the trace's path: as the plan read it; in a2a.json relative to the results directory
    model: ModelInfo  # the traced model

    def to_json(self) -> dict[str, Any]:
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
        }

    @classmethod
    def from_json(cls, obj: object, *, where: str) -> A2AConfig:
        """The provenance in ``obj`` (a2a.json, or any object holding its thirteen keys)."""
        r = ManifestFields(obj, where, kind=A2A)
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
            model=r.parsed("model", ModelInfo.from_dict),
        )


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
        r = ManifestFields(obj, where, kind=A2A, later=A2A_LATER_KEYS)
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
    """One ``moetrace a2a`` run (fields in the order a2a.json holds them; its first thirteen keys are
    the replay plan's ``A2AConfig``, flattened)."""

    config: A2AConfig  # the replay plan's provenance, the trace's path relative to the results directory
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
            **self.config.to_json(),
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
        r = ManifestFields(obj, where, kind=A2A, later=A2A_LATER_KEYS)
        return cls(
            config=A2AConfig.from_json(obj, where=where),
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
    r = ManifestFields(obj, where, kind=A2A, later={"link": "", "qdisc": "", "note": "", "link_bytes": []})
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
