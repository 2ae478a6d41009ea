"""Placement files: moetrace's own versioned JSON (validated on load) and engine exports (docs/exports.md).

``moetrace.placement`` v1 JSON: model facts, deployment, strategy, ``phy2log`` [L, P],
``log2phy`` [L, E, M], ``logcnt`` [L, E] over the MoE layers, and (for grouped strategies) the
serving router in ``grouping``: a ``routers.Router`` written and read by its own class
(``to_json`` / ``routers.read_router``, which dispatch on the section's ``router_kind``). Engine exports (see docs/exports.md for the source each was checked
against): from a placement, SGLang ``--init-expert-location`` JSON, TensorRT-LLM MoE load-balancer
YAML, for vLLM the bare JSON list of physical→logical rows, one per MoE layer, that its open
initial-placement proposal reads (no released vLLM reads a placement file; checked through 0.33),
vllm-ascend's static expert map (``eplb_config.expert_map_path``) and llm-d-inference-sim's
``--moe-fixed-placement-path`` JSON (its MoE fork's ``physical_to_logical``); from a trace, SGLang's
``{"logical_count": [H, E]}`` (token counts, from which SGLang runs its own EPLB at start-up),
llm-d-inference-sim's binary ``.moetrace`` trace (``llmd_moetrace_bytes``: their name and format, magic
``MOETRC01``; the importer ``tracer/importers/llmd_moetrace.py`` reads it back) and, from a trace or a load
profile, aisimulate's expert-popularity bundle (``export_bundle``: ``metadata.yaml`` and
``model_expert_popularity.parquet``, schema version 1).

Shape legend (docs/architecture.md): L MoE layers, H all decoder layers, E logical experts,
P physical slots, M max replicas, W EP ranks, J slots of one rank (P / W in this module), C clusters,
F features (L*E).

Every placement file is checked by one function, :func:`check_placement_file` (``load_placement``
runs it; ``export_placement`` and ``a2a``'s replay of a file never see a file it refuses): the
JSON reads (UTF-8, bounded nesting, an object), shapes agree with the model (``moe_layers`` x slots),
ids are in range, every expert has a slot, the slots divide evenly over the EP ranks and agree
with the stated ``num_slots`` / ``num_redundant`` (``E + R``), ``logcnt`` / ``log2phy`` describe
``phy2log``, a grouped placement (one with a router) holds each expert at most once per node (its
router's model of a node), and the router's numbers are finite. Sizes are bounded before anything
is allocated: a file may not make ``export`` build more than :data:`MAX_EXPORT_IDS` ids.

Out of scope: computing placements; routing requests (``routers``; the engine files hold no router, so
every router kind exports the same way); talking to a running engine; vllm-ascend's ``mix_placement``
(shared experts placed as extra logical experts: a moetrace placement holds routed experts only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from moetrace.analysis.counts import count_trace
from moetrace.atomic import write_json_atomic
from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.deployment import Deployment, parse_deployment
from moetrace.placement.maps import Placement, placement_problems
from moetrace.placement.routers import NoRouter, Router, read_router
from moetrace.results import PLACEMENT, check_result_json, json_header
from moetrace.tracer.trace.profile import STAGE_MIXED, LoadProfile, is_profile, open_profile
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import ModelInfo, Stage, stages_of

__all__ = [
    "PlacementFile",
    "save_placement",
    "load_placement",
    "export_placement",
    "export_file",
    "trace_expert_counts",
    "sglang_logical_count",
    "llmd_moetrace_bytes",
    "aisimulate_popularity",
    "aisimulate_bundle_name",
    "export_bundle",
    "ExportFormat",
    "PlacementExportFormat",
    "TraceExportFormat",
    "CountStage",
    "PLACEMENT_EXPORTS",
    "TRACE_EXPORTS",
    "BUNDLE_EXPORTS",
    "BINARY_EXPORTS",
]

#: the most ids (decoder layers x slots) one engine file may hold: far above any model (DeepSeek-V3:
#: 61 x 288), far below what would exhaust memory (8 bytes per id, plus its text)
MAX_EXPORT_IDS = 1 << 24
#: the largest placement JSON read (DeepSeek-V3 with 32 redundant slots: about 0.3 MB)
MAX_PLACEMENT_BYTES = 256 << 20
#: the largest count (experts, layers, EP ranks) a placement file may state, as a trace manifest (schema)
_MAX_COUNT = 1 << 20
FORMAT = PLACEMENT.format  # the placement JSON's "format" (moetrace.results owns it)
VERSION = PLACEMENT.version  # the version this moetrace writes and reads
# made from a placement JSON
PlacementExportFormat = Literal["sglang", "trtllm", "vllm", "vllm-ascend", "llmd-fixed-placement"]
# made from a trace (counts, not a placement; llmd-moetrace: the routing itself, a trace only)
TraceExportFormat = Literal["sglang-logical-count", "llmd-moetrace", "aisimulate-popularity"]
ExportFormat = Literal[  # both kinds
    "sglang",
    "trtllm",
    "vllm",
    "vllm-ascend",
    "llmd-fixed-placement",
    "sglang-logical-count",
    "llmd-moetrace",
    "aisimulate-popularity",
]
PLACEMENT_EXPORTS: tuple[PlacementExportFormat, ...] = (
    "sglang",
    "trtllm",
    "vllm",
    "vllm-ascend",
    "llmd-fixed-placement",
)
TRACE_EXPORTS: tuple[TraceExportFormat, ...] = ("sglang-logical-count", "llmd-moetrace", "aisimulate-popularity")
#: the formats written as a folder of files (``export_bundle``), not one file
BUNDLE_EXPORTS: tuple[TraceExportFormat, ...] = ("aisimulate-popularity",)
#: the formats written as bytes (binary), not text
BINARY_EXPORTS: tuple[ExportFormat, ...] = ("llmd-moetrace",)
CountStage = Literal["decode", "prefill", "both"]  # which tokens a counts export counts


@dataclass(frozen=True, kw_only=True)
class PlacementFile:
    """Everything in a placement JSON."""

    model: ModelInfo  # the traced model (file: its to_dict())
    deployment: Deployment  # what it was placed for (file: config, gpus_per_node and the derived num_ep, num_nodes, ranks_per_node)
    strategy: str  # a name from placement.strategies.STRATEGIES
    placement: Placement  # over the MoE layers, in model.moe_layers order
    router: Router = field(
        default_factory=NoRouter
    )  # how requests find their node (file: `grouping`, null for NoRouter)
    source: dict[str, Any] | None = None  # trace path, train requests, seed (provenance)

    @property
    def num_slots(self) -> int:
        return int(self.placement.phy2log.shape[1])


def save_placement(pf: PlacementFile, path: str | os.PathLike) -> None:
    """Write ``pf`` as moetrace's placement JSON (atomically; callers check ``overwrite`` first with
    ``moetrace.results.check_output``)."""
    p = pf.placement
    obj = {
        **json_header(PLACEMENT),
        "model": pf.model.to_dict(),
        "deployment": _deployment_json(pf.deployment),
        "strategy": pf.strategy,
        "num_slots": pf.num_slots,
        "num_redundant": pf.num_slots - pf.model.num_experts,
        "moe_layers": list(pf.model.moe_layers),
        "phy2log": p.phy2log.tolist(),
        "log2phy": p.log2phy.tolist(),
        "logcnt": p.logcnt.tolist(),
        "grouping": pf.router.to_json(),
        "source": pf.source,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(path), obj, indent=None)  # never half-written; compact: phy2log has L x P ids


def _deployment_json(dep: Deployment) -> dict[str, Any]:
    return {
        "config": dep.name,
        "gpus_per_node": dep.num_gpus_per_node,
        "num_ep": dep.num_ep,
        "num_nodes": dep.num_nodes,
        "ranks_per_node": dep.ranks_per_node,
    }


def _read_deployment(d: dict[str, Any], where: str) -> Deployment:
    """The file's ``deployment``: ``config`` on nodes of ``gpus_per_node`` GPUs; the derived sizes it
    also holds must agree."""
    config, gpus = d.get("config"), d.get("gpus_per_node")
    if not isinstance(config, str) or not isinstance(gpus, int) or isinstance(gpus, bool):
        raise TraceFormatError(
            f'{where}: `deployment` needs `config` (e.g. "DP8TP8EP64") and `gpus_per_node`; '
            "re-create the file with `moetrace place`"
        )
    try:
        dep = parse_deployment(config, num_gpus_per_node=gpus)
    except ConfigError as exc:
        raise TraceFormatError(f"{where}: `deployment`: {exc}") from None
    stated = {k: d[k] for k in ("num_ep", "num_nodes", "ranks_per_node") if k in d}
    derived = {k: v for k, v in _deployment_json(dep).items() if k in stated}
    if stated != derived:
        raise TraceFormatError(
            f"{where}: `deployment` {stated} disagrees with {config} on nodes of {gpus} GPUs "
            f"({derived}); re-create the file with `moetrace place`"
        )
    return dep


def load_placement(path: str | os.PathLike) -> PlacementFile:
    """Read and validate a placement JSON; every problem raises ``TraceFormatError`` naming it.

    The router comes from ``routers.read_router`` (files of every moetrace version included)."""
    where = str(path)
    d = _read_json(Path(path), where)
    check_result_json(where, d, PLACEMENT)
    for key in ("model", "deployment", "strategy", "phy2log", "logcnt", "log2phy"):
        if key not in d:
            raise TraceFormatError(f"{where}: missing key `{key}`")
    model, deployment = d["model"], d["deployment"]
    for key, value in (("model", model), ("deployment", deployment)):
        if not isinstance(value, dict):
            raise TraceFormatError(f"{where}: `{key}` must be a JSON object; re-create the file with `moetrace place`")
    for key in ("num_experts", "moe_layers", "num_hidden_layers"):
        if key not in model:
            raise TraceFormatError(f"{where}: `model` lacks `{key}`")
    E, H, num_ep = model["num_experts"], model["num_hidden_layers"], deployment.get("num_ep", 1)
    layers = model["moe_layers"]
    if not all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= _MAX_COUNT for x in (E, H, num_ep)):
        raise TraceFormatError(
            f"{where}: model `num_experts`, `num_hidden_layers` and deployment `num_ep` must be "
            f"positive integers (at most {_MAX_COUNT:,}), got {E!r:.40}, {H!r:.40}, {num_ep!r:.40}"
        )
    if (
        not isinstance(layers, list)
        or not all(isinstance(x, int) and 0 <= x < H for x in layers)
        or layers != sorted(set(layers))
    ):
        raise TraceFormatError(f"{where}: model `moe_layers` must be ascending distinct layer indices in 0..{H - 1}")
    L = len(layers)
    arrays = {}
    for key in ("phy2log", "logcnt", "log2phy"):
        try:
            arrays[key] = np.asarray(d[key])
        except (ValueError, TypeError) as exc:
            raise TraceFormatError(f"{where}: `{key}` must be a rectangular integer array ({exc})") from None
        if arrays[key].size and arrays[key].dtype.kind not in "iu":
            raise TraceFormatError(
                f"{where}: `{key}` must be a rectangular array of 64-bit integers, got {arrays[key].dtype} values"
            )
        arrays[key] = arrays[key].astype(np.int64)
    phy2log, logcnt, log2phy = arrays["phy2log"], arrays["logcnt"], arrays["log2phy"]
    if phy2log.ndim != 2 or phy2log.shape[0] != L:
        raise TraceFormatError(f"{where}: phy2log has shape {phy2log.shape}, expected ({L} MoE layers, slots)")
    if phy2log.size > MAX_EXPORT_IDS or log2phy.size > 4 * MAX_EXPORT_IDS:
        raise TraceFormatError(f"{where}: a placement of {phy2log.size:,} slots is larger than any model's")
    for key in ("num_slots", "num_redundant"):
        stated = d.get(key)
        if stated is not None and (not isinstance(stated, int) or isinstance(stated, bool)):
            raise TraceFormatError(f"{where}: `{key}` must be a whole number, got {stated!r:.40}")
    P = phy2log.shape[1]
    if d.get("num_slots") not in (None, P):
        raise TraceFormatError(f"{where}: `num_slots` is {d['num_slots']} but phy2log holds {P} slots per layer")
    if d.get("num_redundant") not in (None, P - E):
        raise TraceFormatError(
            f"{where}: `num_redundant` is {d['num_redundant']} but phy2log holds {P} slots for {E} experts "
            f"({P - E} redundant)"
        )
    dep = _read_deployment(deployment, where)
    try:
        info = ModelInfo.from_dict(model)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{where}: {exc}") from None
    router = read_router(d.get("grouping"), where=where, num_groups=dep.num_groups, num_features=L * E)
    if not isinstance(d["strategy"], str):
        raise TraceFormatError(f"{where}: `strategy` must be a string, got {d['strategy']!r:.40}")
    pf = PlacementFile(
        model=info,
        deployment=dep,
        strategy=d["strategy"],
        placement=Placement(phy2log, log2phy, logcnt),
        router=router,
        source=d.get("source") if isinstance(d.get("source"), dict) else None,
    )
    check_placement_file(pf, where=where)
    return pf


def placement_file_problems(pf: PlacementFile) -> list[str]:
    """Every way ``pf`` cannot be served (empty: valid): shapes against the model, ids, coverage, slots
    dividing evenly over the EP ranks (``maps.placement_problems``), at least one slot per expert, and,
    for a grouped placement (one with a router), no expert twice on one node."""
    m, dep = pf.model, pf.deployment
    phy2log = np.asarray(pf.placement.phy2log)
    if phy2log.ndim != 2 or phy2log.shape[0] != m.num_moe_layers:
        return [f"phy2log has shape {phy2log.shape}, expected ({m.num_moe_layers} MoE layers, slots)"]
    L, P = phy2log.shape
    if P < m.num_experts:
        return [f"{P} slots per layer cannot hold {m.num_experts} experts"]
    problems = placement_problems(pf.placement, num_experts=m.num_experts, num_ranks=dep.num_ep)
    if problems or isinstance(pf.router, NoRouter):
        return problems
    G = dep.num_groups
    if P % G:
        return [f"{P} slots do not divide over {G} nodes"]
    per_node = np.sort(phy2log.reshape(L, G, P // G), axis=-1)
    twice_LGJ = per_node[..., 1:] == per_node[..., :-1]
    if twice_LGJ.any():
        l, g, j = (int(x[0]) for x in np.nonzero(twice_LGJ))
        problems.append(
            f"node {g} holds expert {int(per_node[l, g, j])} twice in MoE layer {l} ({int(twice_LGJ.sum())} repeats); "
            f"a {pf.router.kind} router sends each request to one node, which holds each expert once"
        )
    return problems


def check_placement_file(pf: PlacementFile, *, where: str) -> None:
    """Raise ``TraceFormatError`` naming the problems of ``pf`` (:func:`placement_file_problems`): the one
    check every placement passes before ``export`` writes it or ``a2a`` replays it."""
    problems = placement_file_problems(pf)
    if problems:
        raise TraceFormatError(
            f"{where}: invalid placement: " + "; ".join(problems) + "; re-create it with `moetrace place`"
        )


def _read_json(path: Path, where: str) -> Any:
    """The JSON of a placement file: a regular file (a pipe or device is refused, never read) of UTF-8
    text of a bounded size, integers of at most 4,300 digits, nested no deeper than Python parses
    (``moetrace.inputs``)."""
    from moetrace.inputs import read_input_json

    if not os.path.lexists(path):
        raise TraceFormatError(f"{where}: no such placement file (write one with `moetrace place`)")
    return read_input_json(path, what=where, max_bytes=MAX_PLACEMENT_BYTES)


def _full_layer_map(pf: PlacementFile) -> np.ndarray:
    """phy2log over all H decoder layers; dense layers get the trivial map (slot p -> p mod E)."""
    H, E = pf.model.num_hidden_layers, pf.model.num_experts
    P = pf.num_slots
    full = np.broadcast_to(np.arange(P) % E, (H, P)).copy()
    full[np.asarray(pf.model.moe_layers)] = pf.placement.phy2log
    return full


def export_placement(pf: PlacementFile, *, fmt: PlacementExportFormat) -> str:
    """The text of an engine's placement file for ``pf``.

    Raises ``ConfigError`` for a placement the engine cannot take (vllm-ascend: EP size 1, or an
    expert twice on one rank) and for a format that is not made from a placement.
    """
    check_placement_file(pf, where=f"placement ({pf.strategy})")
    layers = [int(x) for x in pf.model.moe_layers]
    if pf.model.num_hidden_layers * pf.num_slots > MAX_EXPORT_IDS:
        raise ConfigError(
            f"an engine file of {pf.model.num_hidden_layers:,} layers x {pf.num_slots:,} slots "
            f"({pf.model.num_hidden_layers * pf.num_slots:,} ids, about "
            f"{pf.model.num_hidden_layers * pf.num_slots * 16 >> 20:,} MiB) is larger than any model's "
            f"({MAX_EXPORT_IDS:,} ids at most); check the placement file's model section"
        )
    if fmt == "sglang":
        # init_by_mapping(**data) accepts exactly this key; rows = num_hidden_layers
        return json.dumps({"physical_to_logical_map": _full_layer_map(pf).tolist()}) + "\n"
    if fmt == "trtllm":
        import yaml

        assignments = {layer: [int(x) for x in row] for layer, row in zip(layers, pf.placement.phy2log)}
        body = {"num_slots": pf.num_slots, "initial_global_assignments": assignments, "layer_updates_per_iter": 0}
        return yaml.safe_dump(body, default_flow_style=None, sort_keys=False, width=1 << 20)
    if fmt == "vllm":
        # vLLM PR #49572 (eplb_config.initial_expert_map_path) reads a bare list: one phy2log row shared
        # by all MoE layers, or one row per MoE layer in model order; an object would be refused
        return json.dumps(pf.placement.phy2log.tolist()) + "\n"
    if fmt == "vllm-ascend":
        return json.dumps(_vllm_ascend_map(pf)) + "\n"
    if fmt == "llmd-fixed-placement":
        return json.dumps(_llmd_fixed_placement(pf)) + "\n"
    if fmt in TRACE_EXPORTS:
        raise ConfigError(
            f"--format {fmt} exports token counts from a trace, not a placement: pass the trace directory"
        )
    raise ConfigError(f"unknown export format {fmt!r}; use one of {', '.join(PLACEMENT_EXPORTS)}")


def _vllm_ascend_map(pf: PlacementFile) -> dict[str, Any]:
    """vllm-ascend's static expert map: ``layer_list[i]`` is MoE layer i (model order), its
    ``device_list[w].device_expert`` the logical experts in EP rank w's local slots, in slot order.

    vllm-ascend (``eplb_utils.expert_file_to_tensor`` / ``init_eplb_config``) indexes ``layer_list``
    by the MoE layer's construction order, numbers a device's physical experts ``w * J + local slot``
    (as our slots are numbered) and gives each expert one local slot per device, so a rank holding an
    expert twice cannot be written; with EP size 1 it never reads the file.
    """
    phy2log_LP = pf.placement.phy2log
    L, P = phy2log_LP.shape
    W = pf.deployment.num_ep
    if W == 1:
        raise ConfigError(
            f"vllm-ascend reads an expert map only with expert parallelism, and {pf.deployment.name} has EP size 1 "
            "(init_eplb_config returns before reading expert_map_path): place for an EP size above 1"
        )
    per_rank_LWJ = phy2log_LP.reshape(L, W, P // W)
    sorted_LWJ = np.sort(per_rank_LWJ, axis=-1)
    twice_LWJ = sorted_LWJ[..., 1:] == sorted_LWJ[..., :-1]
    if twice_LWJ.any():
        l, w, j = (int(x[0]) for x in np.nonzero(twice_LWJ))
        n = int(twice_LWJ.any(axis=-1).sum())
        raise ConfigError(
            f"vllm-ascend gives each expert at most one slot per device, but EP rank {w} holds expert "
            f"{int(sorted_LWJ[l, w, j])} twice in model layer {pf.model.moe_layers[l]} ({n} (layer, rank) pairs "
            f"repeat an expert; strategy {pf.strategy!r}): place again with another strategy or fewer redundant slots"
        )
    return {
        "moe_layer_count": L,
        "layer_list": [
            {
                "layer_id": i,  # the MoE ordinal, as vllm-ascend's own recorder writes it (the loader reads by position)
                "device_count": W,
                "device_list": [
                    {"device_id": w, "device_expert": [int(e) for e in per_rank_LWJ[i, w]]} for w in range(W)
                ],
            }
            for i in range(L)
        ],
    }


# ---------------------------------------------------------------------------------- from a trace
def trace_expert_counts(
    trace: str | os.PathLike,
    *,
    stage: CountStage = "decode",
    allow_incomplete: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, ModelInfo]:
    """Tokens routed to each (MoE layer, expert) over a whole trace: int64 ``[L, E]`` and the model.

    ``stage``: ``decode`` (what moetrace's placements are built from), ``prefill`` or ``both``
    (every routed token, as SGLang's own recorder counts them; of a single-stage trace, its one
    stage). ``decode`` or ``prefill`` on a trace that did not record it (manifest
    ``collection.stages``) is refused. ``progress(tokens_done, tokens_total)`` goes to
    ``count_trace``. Memory: R * L * E counts per stage (``count_trace``).
    """
    tr = open_trace(trace, require_complete=not allow_incomplete)
    recorded = stages_of(tr)
    wanted: tuple[Stage, ...] = ("prefill", "decode") if stage == "both" else (stage,)
    missing = [s for s in wanted if s not in recorded]
    if stage != "both" and missing:
        raise ConfigError(
            f"{trace}: recorded {', '.join(sorted(recorded))} routing only (manifest collection.stages), "
            f"so it holds no {stage} counts: pass --stage {next(iter(sorted(recorded)))}"
        )
    counts = count_trace(
        tr, stages=[s for s in wanted if s in recorded], allow_incomplete=allow_incomplete, progress=progress
    )
    return counts.counts_RSLE.sum(axis=(0, 1), dtype=np.int64), tr.model


def profile_counts(prof: LoadProfile, *, stage: CountStage | None) -> np.ndarray:
    """A load profile's tokens per (MoE layer, expert), int64 ``[L, E]``: ``stage`` as for a trace
    (default decode); a profile of ``mixed`` counts (prefill and decode not told apart) gives them for
    ``both`` or no ``stage``, and refuses a single stage."""
    if STAGE_MIXED in prof.stages:
        if stage in ("decode", "prefill"):
            raise ConfigError(
                f"the profile's counts mix prefill and decode (the recorder does not tell them apart): leave out "
                f"--stage or pass --stage both, not --stage {stage}"
            )
        return prof.total(STAGE_MIXED)
    wanted = ("prefill", "decode") if stage == "both" else (stage or "decode",)
    if stage != "both" and wanted[0] not in prof.stages:
        raise ConfigError(
            f"the profile holds {', '.join(prof.stages)} counts only: pass --stage {prof.stages[0]} or both"
        )
    return sum((prof.total(s) for s in wanted if s in prof.stages), start=np.zeros_like(prof.total(prof.stages[0])))


def sglang_logical_count(counts_LE: np.ndarray, *, model: ModelInfo) -> str:
    """SGLang's ``--init-expert-location`` counts file: ``{"logical_count": [H, E]}``, integers.

    counts_LE: integer ``[L, E]`` tokens per (MoE layer, logical expert), L in ``model.moe_layers``
    order. Rows are all ``num_hidden_layers`` decoder layers (SGLang's expert-location layer count);
    dense layers' rows are zero, as in SGLang's own recorder dumps.
    """
    L, E = len(model.moe_layers), model.num_experts
    if counts_LE.shape != (L, E) or counts_LE.dtype.kind not in "iu" or (counts_LE < 0).any():
        raise ConfigError(
            f"counts must be non-negative integers of shape ({L} MoE layers, {E} experts), "
            f"got {counts_LE.dtype} {counts_LE.shape}"
        )
    full_HE = np.zeros((model.num_hidden_layers, E), dtype=np.int64)
    full_HE[np.asarray(model.moe_layers)] = counts_LE
    return json.dumps({"logical_count": full_HE.tolist()}) + "\n"


def _counts_of(
    path: Path,
    fmt: str,
    *,
    stage: CountStage | None,
    allow_incomplete: bool,
    progress: Callable[[int, int], None] | None,
) -> tuple[np.ndarray, ModelInfo, str]:
    """``(counts_LE, model, stage counted)`` of a trace directory or a load profile, for the counts formats."""
    if is_profile(path):  # a load profile holds the counts already
        prof = open_profile(path)
        counted = "both" if STAGE_MIXED in prof.stages else (stage or "decode")
        return profile_counts(prof, stage=stage), prof.model, counted
    if not path.is_dir():
        raise ConfigError(
            f"{path}: --format {fmt} exports token counts from a trace or a load profile, not a placement: pass the "
            f"trace directory (e.g. `moetrace export traces/dsv3 --format {fmt} -o ...`)"
        )
    counts_LE, model = trace_expert_counts(
        path, stage=stage or "decode", allow_incomplete=allow_incomplete, progress=progress
    )
    return counts_LE, model, stage or "decode"


def export_file(
    source: str | os.PathLike,
    *,
    fmt: ExportFormat,
    stage: CountStage | None = None,
    allow_incomplete: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> str | bytes:
    """The content of an engine file made from ``source``: a placement JSON for the placement formats,
    a trace directory (or a load profile) for ``sglang-logical-count`` (``stage`` defaults to decode
    there), a trace directory for ``llmd-moetrace`` (bytes: a binary file; ``BINARY_EXPORTS``).
    ``aisimulate-popularity`` is a folder of files: :func:`export_bundle`.

    Raises ``ConfigError`` when ``source`` is the wrong kind of input for ``fmt``, or trace options
    (``stage``, ``allow_incomplete``) come with a placement format.
    """
    path = Path(source)
    if fmt in BUNDLE_EXPORTS:
        raise ConfigError(f"--format {fmt} writes a folder of files: use export_bundle")
    if fmt == "sglang-logical-count":
        counts_LE, model, _ = _counts_of(path, fmt, stage=stage, allow_incomplete=allow_incomplete, progress=progress)
        return sglang_logical_count(counts_LE, model=model)
    if fmt == "llmd-moetrace":
        if stage is not None:
            raise ConfigError(f"--format {fmt} writes every routed token of both stages; leave out --stage")
        if not path.is_dir() or is_profile(path):
            raise ConfigError(
                f"{path}: --format {fmt} writes the routing of every token: pass a trace directory (a load profile or "
                "a placement has no tokens)"
            )
        return llmd_moetrace_bytes(path, allow_incomplete=allow_incomplete, progress=progress)
    if stage is not None or allow_incomplete:
        raise ConfigError(f"--stage and --allow-incomplete read a trace; --format {fmt} converts a placement JSON")
    if path.is_dir():
        raise ConfigError(
            f"{path} is a directory; --format {fmt} converts a placement JSON: write one with "
            "`moetrace place TRACE --config ... -o placement.json`"
        )
    if fmt not in PLACEMENT_EXPORTS:
        raise ConfigError(f"unknown export format {fmt!r}")
    return export_placement(load_placement(path), fmt=fmt)


# ------------------------------------------------------------ llm-d-inference-sim (MoE fork)
#: llm-d-inference-sim's ``.moetrace`` (pkg/moetrace/format.go and writer.go; docs/exports.md)
_LLMD_MAGIC = b"MOETRC01"
_LLMD_HEADER, _LLMD_ENTRY, _LLMD_BLOCK_HEADER = 112, 32, 32


def _llmd_fixed_placement(pf: PlacementFile) -> dict[str, Any]:
    """llm-d-inference-sim's ``--moe-fixed-placement-path`` JSON (``fixedPlacementFile`` in
    ``pkg/simulator/moe_trace_fidelity.go``): one ``physical_to_logical`` row of P slots per MoE layer,
    slot p on GPU ``p // (P / W)``; its loader refuses an expert twice on one GPU."""
    phy2log_LP = pf.placement.phy2log
    L, P = phy2log_LP.shape
    W = pf.deployment.num_ep
    per_rank_LWJ = np.sort(phy2log_LP.reshape(L, W, P // W), axis=-1)
    twice_LWJ = per_rank_LWJ[..., 1:] == per_rank_LWJ[..., :-1]
    if twice_LWJ.any():
        l, w, j = (int(x[0]) for x in np.nonzero(twice_LWJ))
        raise ConfigError(
            f"llm-d-inference-sim refuses an expert placed twice on one GPU, but EP rank {w} holds expert "
            f"{int(per_rank_LWJ[l, w, j])} twice in model layer {pf.model.moe_layers[l]} (strategy {pf.strategy!r}): "
            "place again with another strategy or fewer redundant slots"
        )
    return {"physical_to_logical": phy2log_LP.tolist(), "num_layers": L, "num_physical_experts": P}


def _go_json(obj: Any) -> bytes:
    """Go's ``json.Marshal`` of ``obj`` (keys in the struct's order): compact, ``<``, ``>``, ``&``, U+2028 and
    U+2029 escaped as Go's HTML-safe encoder does (trace text is valid UTF-8, so Go's U+FFFD replacement never applies)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text.encode("utf-8", errors="replace")


def _request_texts(tr: Any, rid_R: np.ndarray) -> tuple[list[str], list[str]]:
    """Each request's stored prompt and output text (``--store-text``), ``""`` where none was stored."""
    cols = tr.requests().collect_schema().names()
    if "prompt_text" not in cols:
        return [""] * len(rid_R), [""] * len(rid_R)
    df = tr.requests().select("request_id", "prompt_text", "output_text").collect()
    texts = {int(r): (p or "", o or "") for r, p, o in df.iter_rows()}
    return [texts.get(int(r), ("", ""))[0] for r in rid_R], [texts.get(int(r), ("", ""))[1] for r in rid_R]


def llmd_moetrace_bytes(
    trace: str | os.PathLike,
    *,
    allow_incomplete: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> bytes:
    """A trace as llm-d-inference-sim's binary ``.moetrace`` (version 1; docs/exports.md).

    Request ``i`` in request-id order becomes prompt ``i``: its prompt rows the input tokens, its generated rows
    the decode tokens. The format stores a route for every token and layer: a ``-1`` anywhere but in a request's
    last row is refused; the last generated token (never fed back, ``-1`` in every trace) gets its previous row's
    route, which the simulator never charges. Token ids are written as 0 (a trace holds none), the texts stored
    with ``--store-text`` (else empty), the source JSON's size and SHA-256 as zeros (there is none). Memory: the
    whole trace's ids (``Trace.token_arrays``), and the file.
    """
    import struct

    tr = open_trace(trace, require_complete=not allow_incomplete)
    model = tr.model
    recorded = stages_of(tr)
    if set(recorded) != {"prefill", "decode"}:
        raise ConfigError(
            f"{trace}: recorded {', '.join(sorted(recorded))} routing only; the .moetrace format holds the route of "
            "every input and decode token"
        )
    L, K, E = model.num_moe_layers, model.top_k, model.num_experts
    if E > 65536:
        raise ConfigError(f"{model.name} has {E:,} experts; the .moetrace format stores ids of at most 65,536")
    width = 1 if E <= 256 else 2
    req = tr.request_arrays
    R = len(req.request_id_R)
    ta = tr.token_arrays()
    order = np.lexsort((ta.position_T, ta.row_T))
    ids_TLK = ta.topk_ids_TLK[order]
    T_R = req.prompt_tokens_R.astype(np.int64) + req.output_tokens_R
    start_R = np.concatenate([[0], np.cumsum(T_R)])
    prompt_text, output_text = _request_texts(tr, req.request_id_R)
    meta = {
        "format_version": 1,
        "model": model.source,
        "num_experts": E,
        "top_k": K,
        "sparse_layers": [int(x) for x in model.moe_layers],
        "num_prompts": R,
        "expert_id_bytes": width,
        "prompts": [
            {
                "index": i,
                "prompt": prompt_text[i],
                "input_tokens": int(req.prompt_tokens_R[i]),
                "decode_tokens": int(req.output_tokens_R[i]),
                "generated_text": output_text[i],
            }
            for i in range(R)
        ],
    }
    meta_bytes = _go_json(meta)
    dt = np.dtype("u1") if width == 1 else np.dtype("<u2")
    blocks: list[bytes] = []
    index: list[bytes] = []
    offset = _LLMD_HEADER + len(meta_bytes)
    for i in range(R):
        P, D = int(req.prompt_tokens_R[i]), int(req.output_tokens_R[i])
        rows_TLK = ids_TLK[start_R[i] : start_R[i + 1]].copy()
        if D and (rows_TLK[-1] < 0).all():  # the last generated token: never fed back, never charged
            rows_TLK[-1] = rows_TLK[-2]
        missing = rows_TLK < 0
        if missing.any():
            t, l, _ = (int(x) for x in np.argwhere(missing)[0])
            raise ConfigError(
                f"{trace}: request {int(req.request_id_R[i])}, position {t}, layer {model.moe_layers[l]} has no "
                "recorded expert (-1, e.g. a prefix-cache hit); the .moetrace format needs the route of every input "
                "and decode token in every layer"
            )
        counts_LE = np.stack([np.bincount(rows_TLK[:P, l].reshape(-1), minlength=E) for l in range(L)])
        block = b"".join(
            [
                struct.pack("<7I4x", i, P, D, L, E, K, width),
                bytes(4 * (P + D)),  # token ids: a trace holds none
                counts_LE.astype("<u4").tobytes(),
                rows_TLK[:P].transpose(1, 0, 2).astype(dt).tobytes(),  # [layer][position][top_k]
                rows_TLK[P:].astype(dt).tobytes(),  # [decode position][layer][top_k]
            ]
        )
        index.append(struct.pack("<I4xQQII", i, offset, len(block), P, D))
        blocks.append(block)
        offset += len(block)
        if progress is not None:
            progress(int(start_R[i + 1]), int(start_R[-1]))
    index_bytes = b"".join(index)
    header = _LLMD_MAGIC + struct.pack(
        "<IIQQQQQQIII4x32x",  # the source JSON's size and SHA-256: zeros, there is none
        1,
        _LLMD_HEADER,
        _LLMD_HEADER,
        len(meta_bytes),
        _LLMD_HEADER + len(meta_bytes),
        offset,
        len(index_bytes),
        0,
        R,
        width,
        _LLMD_ENTRY,
    )
    return header + meta_bytes + b"".join(blocks) + index_bytes


# ------------------------------------------------------------ aisimulate expert popularity
#: aisimulate's bundle files and schema (``aiconfigurator_core/sdk/expert_popularity.py``; docs/exports.md)
AISIMULATE_PARQUET = "model_expert_popularity.parquet"
AISIMULATE_METADATA = "metadata.yaml"
AISIMULATE_SCHEMA_VERSION = 1


def aisimulate_bundle_name(model_id: str) -> str:
    """aisimulate's folder name of a model's bundle: ``org/name`` -> ``org--name``."""
    parts = model_id.split("/")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"aisimulate names a bundle by the model's hub id <org>/<model>, got {model_id!r}: pass --model-id ORG/NAME"
        )
    return "--".join(parts)


def aisimulate_popularity(
    counts_LE: np.ndarray, *, model: ModelInfo, model_id: str, stage: str, provenance: dict[str, str]
) -> dict[str, bytes]:
    """aisimulate's expert-popularity bundle: ``{file name: bytes}`` of ``model_expert_popularity.parquet`` and
    ``metadata.yaml`` (schema version 1), from tokens per (MoE layer, expert) ``counts_LE``.

    One row per (MoE layer, expert), layer-major: ``layer_id`` (the model layer index), ``expert_id``,
    ``activation_count``, ``routed_token_count`` (the layer's tokens: its picks / top-k), ``token_hit_rate``
    (count / tokens), ``assignment_share`` (count / (tokens * top-k)) and ``popularity_rank`` (1 = most picked,
    ties by expert id), computed as aisimulate's validator recomputes them.
    """
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    L, E, K = model.num_moe_layers, model.num_experts, model.top_k
    if counts_LE.shape != (L, E) or counts_LE.dtype.kind not in "iu" or (counts_LE < 0).any():
        raise ConfigError(
            f"counts must be non-negative integers of shape ({L}, {E}), got {counts_LE.dtype} {counts_LE.shape}"
        )
    picks_L = counts_LE.sum(axis=1)
    for l in range(L):
        if picks_L[l] == 0:
            raise ConfigError(
                f"model layer {model.moe_layers[l]} has no routed token in the {stage} counts; aisimulate needs every "
                "MoE layer's popularity"
            )
        if picks_L[l] % K:
            raise ConfigError(
                f"model layer {model.moe_layers[l]}: {int(picks_L[l]):,} expert picks, not a whole number of tokens of "
                f"top-{K} (tokens with some slots unrecorded?); aisimulate checks picks = tokens x top-k"
            )
    tokens_L = picks_L // K
    layer_N = np.repeat(np.asarray(model.moe_layers, dtype=np.int32), E)
    expert_N = np.tile(np.arange(E, dtype=np.int32), L)
    count_N = counts_LE.reshape(-1).astype(np.uint64)
    routed_N = np.repeat(tokens_L.astype(np.uint64), E)
    hit_N = np.concatenate([counts_LE[l].astype(np.float64) / float(tokens_L[l]) for l in range(L)])
    share_N = np.concatenate([counts_LE[l].astype(np.float64) / float(tokens_L[l] * K) for l in range(L)])
    rank_LE = np.empty((L, E), dtype=np.int32)
    for l in range(L):
        order = np.lexsort((np.arange(E), -counts_LE[l].astype(np.int64)))
        rank_LE[l, order] = np.arange(1, E + 1, dtype=np.int32)
    schema = pa.schema(
        [
            pa.field("layer_id", pa.int32(), nullable=False),
            pa.field("expert_id", pa.int32(), nullable=False),
            pa.field("activation_count", pa.uint64(), nullable=False),
            pa.field("routed_token_count", pa.uint64(), nullable=False),
            pa.field("token_hit_rate", pa.float64(), nullable=False),
            pa.field("assignment_share", pa.float64(), nullable=False),
            pa.field("popularity_rank", pa.int32(), nullable=False),
        ]
    )
    table = pa.Table.from_arrays(
        [pa.array(a) for a in (layer_N, expert_N, count_N, routed_N, hit_N, share_N, rank_LE.reshape(-1))],
        schema=schema,
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    parquet = sink.getvalue().to_pybytes()
    phase = {"both": "prefill+decode"}.get(stage, stage)
    metadata = {
        "schema_version": AISIMULATE_SCHEMA_VERSION,
        "model": {"architecture": model.architecture, "id": model_id, "aliases": []},
        "routing": {
            "moe_layer_ids": [int(x) for x in model.moe_layers],
            "num_layers": model.num_hidden_layers,
            "num_routed_experts": E,
            "replication_factor": 1,
            "top_k": K,
        },
        "measurement": {
            "phase": phase,
            "count_semantics": "activation_count[layer, expert] is the number of recorded "
            f"{phase} tokens whose router selected that logical routed expert (exported by moetrace)",
            "token_hit_rate_denominator": "routed_token_count",
            "assignment_share_denominator": "routed_token_count * top_k",
            "popularity_rank_order": "activation_count descending, then expert_id ascending",
            "workload": {"total_routed_tokens": int(tokens_L.max())},
        },
        "provenance": provenance,
        "files": {
            "parquet": {"name": AISIMULATE_PARQUET, "sha256": hashlib.sha256(parquet).hexdigest(), "rows": L * E}
        },
    }
    text = yaml.safe_dump(metadata, sort_keys=False, allow_unicode=True)
    return {AISIMULATE_PARQUET: parquet, AISIMULATE_METADATA: text.encode("utf-8")}


def export_bundle(
    source: str | os.PathLike,
    *,
    fmt: TraceExportFormat,
    stage: CountStage | None = None,
    allow_incomplete: bool = False,
    model_id: str | None = None,
    folder_name: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, bytes]:
    """The files of a folder format (``BUNDLE_EXPORTS``) made from a trace or a load profile: ``{name: bytes}``.

    ``aisimulate-popularity``: ``model_id`` is the hub id aisimulate files the bundle under (default: the
    model's ``source`` when it is one); ``stage`` as for ``sglang-logical-count`` (default decode);
    ``folder_name``: the name of the folder the files will go to, refused unless it is aisimulate's name for
    ``model_id`` (``org--name``: aisimulate finds a bundle by it).
    """
    if fmt not in BUNDLE_EXPORTS:
        raise ConfigError(f"--format {fmt} writes one file: use export_file")
    path = Path(source)
    if model_id is not None:
        aisimulate_bundle_name(model_id)  # a malformed id is said before the trace is read
    model = open_profile(path).model if is_profile(path) else None
    if model is None and path.is_dir():
        model = open_trace(path, require_complete=not allow_incomplete).model
    if model is not None:
        model_id = model_id or model.source
        wanted = aisimulate_bundle_name(model_id)
        if folder_name is not None and folder_name != wanted:
            raise ConfigError(f"aisimulate finds a bundle by its folder name: name the output folder {wanted}")
    counts_LE, model, counted = _counts_of(path, fmt, stage=stage, allow_incomplete=allow_incomplete, progress=progress)
    model_id = model_id or model.source
    provenance = {"framework": "moetrace", "observation_source": _observation_source(path)}
    return aisimulate_popularity(counts_LE, model=model, model_id=model_id, stage=counted, provenance=provenance)


def _observation_source(path: Path) -> str:
    """Where the counts came from, without directories (aisimulate refuses private paths in metadata)."""
    if is_profile(path):
        return "moetrace load profile"
    tr = open_trace(path, require_complete=False)
    backend = tr.manifest.get("backend") if isinstance(tr.manifest.get("backend"), dict) else {}
    name = backend.get("name") if isinstance(backend, dict) else None
    fmt = backend.get("source_format") if isinstance(backend, dict) else None
    return f"moetrace trace ({name}{': ' + str(fmt) if fmt else ''})" if name else "moetrace trace"
