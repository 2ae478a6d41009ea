"""moetrace's own placement files: the versioned ``moetrace.placement`` v1 JSON, written
(``save_placement``), read and validated (``load_placement``).

``moetrace.placement`` v1 JSON: model facts, deployment, strategy, ``phy2log`` [L, P],
``log2phy`` [L, E, M], ``logcnt`` [L, E] over the MoE layers, and (for grouped strategies) the
serving router in ``grouping``: a ``routers.Router`` written and read by its own class
(``to_json`` / ``routers.read_router``, which dispatch on the section's ``router_kind``).

Every placement file is checked by one function, :func:`check_placement_file` (``load_placement``
runs it; ``exports.export_placement`` and ``a2a``'s replay of a file never see a file it refuses): the
JSON reads (UTF-8, bounded nesting, an object), shapes agree with the model (``moe_layers`` x slots),
ids are in range, every expert has a slot, the slots divide evenly over the EP ranks and agree
with the stated ``num_slots`` / ``num_redundant`` (``E + R``), ``logcnt`` / ``log2phy`` describe
``phy2log``, a grouped placement (one with a router) holds each expert at most once per node (its
router's model of a node), and the router's numbers are finite. Sizes are bounded before anything
is allocated: a file may not make ``export`` build more than :data:`MAX_EXPORT_IDS` ids.

Shape legend (docs/architecture.md): L MoE layers, E logical experts, P physical slots, M max
replicas, W EP ranks.

Out of scope: computing placements; the engine files made from them (``exports``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moetrace.atomic import write_json_atomic
from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.deployment import Deployment, parse_deployment
from moetrace.placement.maps import Placement, placement_problems
from moetrace.placement.routers import NoRouter, Router, read_router
from moetrace.results import PLACEMENT, check_result_json, json_header
from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "FORMAT",
    "MAX_EXPORT_IDS",
    "MAX_PLACEMENT_BYTES",
    "VERSION",
    "PlacementFile",
    "check_placement_file",
    "load_placement",
    "placement_file_problems",
    "save_placement",
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
