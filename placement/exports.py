"""Placement files: moetrace's own versioned JSON (validated on load) and engine exports (docs/exports.md).

Placement files (``placement_files``, re-exported here: ``PlacementFile``, ``save_placement``,
``load_placement``). Engine exports (see docs/exports.md for the source each was checked
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

The parts live beside this module, which chooses the format (``export_placement``, ``export_file``,
``export_bundle``) and re-exports their public names: ``placement_files`` (moetrace's own placement
JSON, validated on load), ``exports_counts`` (tokens per layer and expert; SGLang's counts file),
``exports_llmd`` (llm-d-inference-sim's files), ``exports_aisimulate`` (aisimulate's bundle).

Out of scope: computing placements; routing requests (``routers``; the engine files hold no router, so
every router kind exports the same way); talking to a running engine; vllm-ascend's ``mix_placement``
(shared experts placed as extra logical experts: a moetrace placement holds routed experts only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.exports_aisimulate import (
    AISIMULATE_METADATA,
    AISIMULATE_PARQUET,
    AISIMULATE_SCHEMA_VERSION,
    aisimulate_bundle_name,
    aisimulate_popularity,
    observation_source,
)
from moetrace.placement.exports_counts import (
    CountStage,
    counts_of,
    profile_counts,
    sglang_logical_count,
    trace_expert_counts,
)
from moetrace.placement.exports_llmd import llmd_fixed_placement, llmd_moetrace_bytes
from moetrace.placement.placement_files import (
    FORMAT,
    MAX_EXPORT_IDS,
    MAX_PLACEMENT_BYTES,
    VERSION,
    PlacementFile,
    check_placement_file,
    load_placement,
    placement_file_problems,
    save_placement,
)
from moetrace.tracer.trace.profile import is_profile, open_profile
from moetrace.tracer.trace.reader import open_trace

__all__ = [
    "PlacementFile",
    "save_placement",
    "load_placement",
    "check_placement_file",
    "placement_file_problems",
    "export_placement",
    "export_file",
    "trace_expert_counts",
    "profile_counts",
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
    "FORMAT",
    "VERSION",
    "MAX_EXPORT_IDS",
    "MAX_PLACEMENT_BYTES",
    "AISIMULATE_METADATA",
    "AISIMULATE_PARQUET",
    "AISIMULATE_SCHEMA_VERSION",
]


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
        return json.dumps(llmd_fixed_placement(pf)) + "\n"
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
        counts_LE, model, _ = counts_of(path, fmt, stage=stage, allow_incomplete=allow_incomplete, progress=progress)
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
    counts_LE, model, counted = counts_of(path, fmt, stage=stage, allow_incomplete=allow_incomplete, progress=progress)
    model_id = model_id or model.source
    provenance = {"framework": "moetrace", "observation_source": observation_source(path)}
    return aisimulate_popularity(counts_LE, model=model, model_id=model_id, stage=counted, provenance=provenance)
