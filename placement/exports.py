"""Placement files: moetrace's own versioned JSON (validated on load) and engine exports (SPEC §7).

``moetrace.placement`` v1 JSON: model facts, deployment, strategy, ``phy2log`` [L, P],
``log2phy`` [L, E, M], ``logcnt`` [L, E] over the MoE layers, and (for grouped strategies) the
serving router in ``grouping``: a ``routers.Router`` written and read by its own class
(``to_json`` / ``routers.read_router``, which dispatch on the section's ``router_kind``). Engine exports (see docs/exports.md for the source each was checked
against): SGLang ``--init-expert-location`` JSON, TensorRT-LLM MoE load-balancer YAML, and for
vLLM the bare JSON list of physical→logical rows, one per MoE layer, that its open initial-placement
proposal reads (no released vLLM reads a placement file; checked through 0.33).

Shape legend (docs/architecture.md): L MoE layers, H all decoder layers, E logical experts,
P physical slots, M max replicas, C clusters, F features (L*E).

Out of scope: computing placements; routing requests (``routers``; the engine files hold no router, so
every router kind exports the same way); talking to a running engine.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from moetrace.atomic import write_json_atomic
from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.deployment import Deployment, parse_deployment
from moetrace.placement.maps import Placement, placement_problems
from moetrace.placement.routers import NoRouter, Router, read_router
from moetrace.results import PLACEMENT, check_result_json, json_header
from moetrace.tracer.trace.schema import ModelInfo

__all__ = ["PlacementFile", "save_placement", "load_placement", "export_placement", "ExportFormat"]

FORMAT = PLACEMENT.format  # the placement JSON's "format" (moetrace.results owns it)
VERSION = PLACEMENT.version  # the version this moetrace writes and reads
ExportFormat = Literal["sglang", "trtllm", "vllm"]


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
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TraceFormatError(f"{where}: no such placement file (write one with `moetrace place`)") from None
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc})") from exc
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
    if not all(isinstance(x, int) and x >= 1 for x in (E, H, num_ep)):
        raise TraceFormatError(
            f"{where}: model `num_experts`, `num_hidden_layers` and deployment `num_ep` must be "
            f"positive integers, got {E!r}, {H!r}, {num_ep!r}"
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
    problems = placement_problems(Placement(phy2log, log2phy, logcnt), num_experts=E, num_ranks=num_ep)
    if problems:
        raise TraceFormatError(f"{where}: invalid placement: " + "; ".join(problems))
    dep = _read_deployment(deployment, where)
    try:
        info = ModelInfo.from_dict(model)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{where}: {exc}") from None
    router = read_router(d.get("grouping"), where=where, num_groups=dep.num_groups, num_features=L * E)
    return PlacementFile(
        model=info,
        deployment=dep,
        strategy=str(d["strategy"]),
        placement=Placement(phy2log, log2phy, logcnt),
        router=router,
        source=d.get("source"),
    )


def _full_layer_map(pf: PlacementFile) -> np.ndarray:
    """phy2log over all H decoder layers; dense layers get the trivial map (slot p -> p mod E)."""
    H, E = pf.model.num_hidden_layers, pf.model.num_experts
    P = pf.num_slots
    full = np.broadcast_to(np.arange(P) % E, (H, P)).copy()
    full[np.asarray(pf.model.moe_layers)] = pf.placement.phy2log
    return full


def export_placement(pf: PlacementFile, *, fmt: ExportFormat) -> str:
    """The text of an engine's placement file for ``pf``."""
    layers = [int(x) for x in pf.model.moe_layers]
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
    raise ConfigError(f"unknown export format {fmt!r}; use sglang, trtllm or vllm")
