"""``moetrace advise --current FILE``: the placement a deployment serves now, from any file it may be in.

Read, by content (never by file name):

- moetrace's placement JSON (``"format": "moetrace.placement"``; ``exports.load_placement``);
- SGLang's ``--init-expert-location`` JSON ``{"physical_to_logical_map": [H or L rows of P ids]}``
  (what ``export --format sglang`` writes: one row per decoder layer, dense ones included, or one
  per MoE layer);
- vllm-ascend's static expert map (``{"moe_layer_count": L, "layer_list": [{"device_list":
  [{"device_expert": [...]}, ...]}, ...]}``, ``export --format vllm-ascend``): rank w's local
  slots in order, ranks in order;
- vLLM's bare list of physical-to-logical rows (``export --format vllm``): one row shared by every MoE
  layer, or one per MoE layer.

Every map is checked against the model (E experts, its MoE layers) and the deployment (slots divide
over the EP ranks, every expert placed): a wrong file is a one-line ``TraceFormatError``.

Shape legend (docs/architecture.md): H decoder layers, L MoE layers, P physical slots, W EP ranks.

Out of scope: TensorRT-LLM's YAML (read it back with ``moetrace place``' own file); writing maps
(``exports``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from moetrace.errors import TraceFormatError
from moetrace.placement.maps import Placement, placement_from_phy2log, placement_problems
from moetrace.results import PLACEMENT
from moetrace.tracer.trace.schema import ModelInfo

__all__ = ["read_current"]


def _rows(where: str, obj: Any, what: str) -> np.ndarray:
    try:
        arr = np.asarray(obj)
    except (ValueError, TypeError):
        arr = np.zeros(0)
    if arr.ndim == 1 and arr.size:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise TraceFormatError(f"{where}: {what} must be a rectangular array of integer expert ids")
    return arr.astype(np.int64)


def _moe_rows(where: str, rows: np.ndarray, model: ModelInfo) -> np.ndarray:
    """The MoE layers' rows of a map with one row per decoder layer, per MoE layer, or one for all."""
    L, H = model.num_moe_layers, model.num_hidden_layers
    if rows.shape[0] == L:
        return rows
    if rows.shape[0] == H:
        return rows[np.asarray(model.moe_layers)]
    if rows.shape[0] == 1:
        return np.repeat(rows, L, axis=0)
    raise TraceFormatError(
        f"{where}: {rows.shape[0]} rows, but {model.name} has {L} MoE layers of {H} decoder layers "
        "(a map has one row per MoE layer, per decoder layer, or one for all)"
    )


def _ascend_rows(where: str, obj: dict[str, Any]) -> np.ndarray:
    layers = obj.get("layer_list")
    if not isinstance(layers, list) or not layers:
        raise TraceFormatError(f"{where}: a vllm-ascend expert map needs a non-empty `layer_list`")
    out = []
    for i, layer in enumerate(layers):
        devices = layer.get("device_list") if isinstance(layer, dict) else None
        if not isinstance(devices, list) or not all(isinstance(d, dict) and "device_expert" in d for d in devices):
            raise TraceFormatError(f"{where}: layer_list[{i}] needs a `device_list` of objects with `device_expert`")
        out.append([e for d in devices for e in d["device_expert"]])
    return _rows(where, out, "`device_expert` lists")


def read_current(path: str | os.PathLike, *, model: ModelInfo, num_ranks: int) -> tuple[Placement, str]:
    """The placement in ``path`` over ``model``'s MoE layers and the name of the format it was read as.

    Raises ``TraceFormatError`` for a file that is none of the formats, or a map that does not fit the
    model (expert ids, layers) or ``num_ranks`` EP ranks (slots must divide evenly, every expert placed).
    """
    from moetrace.placement.exports import load_placement

    where = str(path)
    from moetrace.inputs import read_input_json
    from moetrace.placement.exports import MAX_PLACEMENT_BYTES

    if not os.path.lexists(path):
        raise TraceFormatError(f"{where}: no such file (--current takes a placement or an engine's expert map)")
    # a regular file only (a pipe never blocks), UTF-8 JSON of bounded size, integers of bounded digits
    obj = read_input_json(path, what=f"--current {where}", max_bytes=MAX_PLACEMENT_BYTES)
    if isinstance(obj, dict) and obj.get("format") == PLACEMENT.format:
        pf = load_placement(path)
        if pf.model.num_experts != model.num_experts or tuple(pf.model.moe_layers) != tuple(model.moe_layers):
            raise TraceFormatError(
                f"{where}: placed for {pf.model.name} ({pf.model.num_experts} experts, {pf.model.num_moe_layers} MoE "
                f"layers), not {model.name} ({model.num_experts} experts, {model.num_moe_layers} MoE layers)"
            )
        rows, fmt = pf.placement.phy2log, "moetrace"
    elif isinstance(obj, dict) and "physical_to_logical_map" in obj:
        rows = _moe_rows(where, _rows(where, obj["physical_to_logical_map"], "physical_to_logical_map"), model)
        fmt = "sglang"
    elif isinstance(obj, dict) and "layer_list" in obj:
        rows, fmt = _moe_rows(where, _ascend_rows(where, obj), model), "vllm-ascend"
    elif isinstance(obj, list):
        rows, fmt = _moe_rows(where, _rows(where, obj, "the list of rows"), model), "vllm"
    else:
        raise TraceFormatError(
            f"{where}: not a moetrace placement, SGLang physical_to_logical_map, vLLM list of rows or "
            "vllm-ascend expert map"
        )
    if rows.min() < 0 or rows.max() >= model.num_experts:
        raise TraceFormatError(f"{where}: expert ids outside 0..{model.num_experts - 1}")
    placement = placement_from_phy2log(rows, num_experts=model.num_experts)
    problems = placement_problems(placement, num_experts=model.num_experts, num_ranks=num_ranks)
    if problems:
        raise TraceFormatError(f"{where}: the {fmt} map does not fit: " + "; ".join(problems))
    return placement, fmt
