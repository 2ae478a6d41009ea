"""Do imported expert ids fit the model, and are they logical? Shared by the per-token import formats.

``check_ids`` refuses ids a capture of ``--model`` cannot hold: ids outside ``-1..E-1`` (and says
when they look like physical slot ids of a capture with redundant experts: values ``>= E``), an
expert twice in one token's top-k, and, for a group-limited router (``n_group``/``topk_group``), a
token whose experts span more than ``topk_group`` groups (a router of that model never does that; an
EPLB-remapped capture's physical ids do). It returns what the ids could not show: a model of the same
top-k and expert count passes every check, and so do physical ids of a remap without redundant
experts on a router without groups.

``read_physical_map`` reads the map ``--physical-map`` names (SGLang's ``physical_to_logical_map``
JSON, as ``--init-expert-location`` takes it, or a moetrace placement file's ``phy2log``);
``physical_map_from_array`` checks one an input carries itself; ``to_logical`` converts.

Shape legend: T tokens, L MoE layers, H all decoder layers, K top-k, E logical experts, P physical
slots (legend: docs/architecture.md).

Out of scope: reading a capture (the formats), placement files' other fields (``placement.exports``
owns them; this reads only the map, as the tracer may not import placement).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace.errors import TraceFormatError

if TYPE_CHECKING:
    import numpy as np

    from moetrace.tracer.trace.schema import ModelInfo

#: tokens checked per step (bounds the temporaries of the checks to a few MB per layer and slot)
CHUNK_TOKENS = 1 << 15
#: the most bytes a map file may have (a DeepSeek-V3 map of 61 layers x 288 slots is ~100 KB)
MAX_MAP_BYTES = 1 << 26
#: the most physical slots per layer a map may have (physical ids are read into int16 rows: 0..32767)
MAX_SLOTS = 1 << 15


#: names row ``t`` of the ids and MoE layer ``l`` (its ordinal) in the input: "in.jsonl:12: request 3, position 7, layer 5"
DescribeRow = Callable[[int, int], str]


def _row(describe_row: DescribeRow | None, t: int, layer: int) -> str:
    return describe_row(t, layer) if describe_row is not None else f"token {t}, MoE layer {layer}"


def check_ids(
    topk_ids_TLK: np.ndarray,
    info: ModelInfo,
    *,
    describe_row: DescribeRow | None = None,
) -> int:
    """Refuse ids that do not fit ``info`` (module docstring); return the largest id seen (-1: none), for
    ``ids_notes``.

    ``topk_ids_TLK``: integer ids ``[T, L, K]`` (``-1`` = not recorded). ``describe_row(t, l)`` names row
    ``t``, MoE layer ordinal ``l`` in the input for the error. Raises ``TraceFormatError``.
    """
    import numpy as np

    T, L, K = topk_ids_TLK.shape
    E = info.num_experts
    if (L, K) != (info.num_moe_layers, info.top_k):
        raise TraceFormatError(
            f"ids of {L} MoE layers x top-k {K}; {info.name} has {info.num_moe_layers} x {info.top_k}"
        )
    group = E // info.n_group if info.n_group else 0
    seen_max = -1
    for lo in range(0, T, CHUNK_TOKENS):
        ids = np.asarray(topk_ids_TLK[lo : lo + CHUNK_TOKENS], dtype=np.int64)
        if not ids.size:
            continue
        seen_max = max(seen_max, int(ids.max()))
        low = ids < -1
        if low.any():
            t, layer, _ = (int(x) for x in np.argwhere(low)[0])
            raise TraceFormatError(
                f"{_row(describe_row, lo + t, layer)}: expert id {int(ids[low][0])}; ids are 0..{E - 1} or -1"
            )
        high = ids >= E
        if high.any():
            t, layer, _ = (int(x) for x in np.argwhere(high)[0])
            raise TraceFormatError(
                f"{_row(describe_row, lo + t, layer)}: expert id {int(ids[t, layer].max())}, "
                f"but {info.name} has {E} experts (0..{E - 1}). Ids >= {E} look like physical slot ids of a capture "
                "with redundant experts (EPLB): pass --physical-map FILE (SGLang's physical_to_logical_map, or a "
                "moetrace placement file) to convert them; otherwise --model names another model"
            )
        s = np.sort(ids, axis=2)
        dup = (s[:, :, 1:] == s[:, :, :-1]) & (s[:, :, 1:] >= 0)
        if dup.any():
            t, layer, k = (int(x) for x in np.argwhere(dup)[0])
            raise TraceFormatError(
                f"{_row(describe_row, lo + t, layer)}: expert {int(s[t, layer, k + 1])} appears twice in one token's "
                "top-k; a router picks {K} distinct experts: the ids are not "
                f"{info.name}'s logical experts (physical ids of replicas? pass --physical-map)"
            )
        if group and info.topk_group is not None and info.topk_group < (info.n_group or 0):
            g = np.where(s >= 0, s // group, -1)
            spans = (g[:, :, :1] >= 0).sum(axis=2) + ((g[:, :, 1:] != g[:, :, :-1]) & (g[:, :, 1:] >= 0)).sum(axis=2)
            over = spans > info.topk_group
            if over.any():
                t, layer = (int(x) for x in np.argwhere(over)[0])
                raise TraceFormatError(
                    f"{_row(describe_row, lo + t, layer)}: the experts {sorted(int(x) for x in s[t, layer] if x >= 0)} "
                    f"span {int(spans[t, layer])} expert groups, but {info.name}'s "
                    f"router picks from at most {info.topk_group} of its {info.n_group} groups of {group}: these look "
                    "like physical ids of an EPLB-remapped capture (pass --physical-map FILE to convert them), or "
                    "--model names another model"
                )
    return seen_max


def ids_notes(info: ModelInfo, *, max_id: int, num_ids: int) -> list[str]:
    """What ``check_ids`` could not check, one sentence each, given the largest id it saw over the whole input and
    the number of ids (slots) the input holds."""
    E, K, L = info.num_experts, info.top_k, info.num_moe_layers
    group = E // info.n_group if info.n_group else 0
    notes = [
        f"the ids fit {info.name} ({E} experts, top-k {K}, {L} MoE layers"
        + (f", at most {info.topk_group} of {info.n_group} groups" if group else "")
        + "); the ids cannot tell it from another model of the same top-k and expert count"
        + ("" if group else ", nor physical ids of a remap without redundant experts from logical ones")
        + ": check that --model is the model that served the capture"
    ]
    if num_ids >= 64 and 0 <= max_id < E // 2:
        notes.append(
            f"no id above {max_id} though {info.name} has {E} experts: a model with fewer experts, or a capture "
            "of one EP rank's local ids?"
        )
    return notes


def physical_map_from_array(value: Any, info: ModelInfo, *, where: str) -> np.ndarray:
    """A physical-to-logical map ``[H or L, P]`` (all decoder layers, or the MoE ones) as int64 ``[L, P]`` over
    the MoE layers; ``TraceFormatError`` (starting with ``where``) unless every MoE layer maps its ``P >= E``
    slots onto ``0..E-1`` with every logical expert present."""
    import numpy as np

    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise TraceFormatError(f"{where}: the physical-to-logical map must be a rectangular array ({exc})") from None
    if arr.ndim != 2 or arr.dtype.kind not in "iu" or arr.size == 0:
        raise TraceFormatError(
            f"{where}: the physical-to-logical map must be a 2-D integer array [layers, physical slots], got "
            f"shape {arr.shape} of {arr.dtype}"
        )
    H, L, E = info.num_hidden_layers, info.num_moe_layers, info.num_experts
    if arr.shape[1] > MAX_SLOTS:  # before the map is copied: a tensor view may declare any width
        raise TraceFormatError(
            f"{where}: the physical-to-logical map declares {arr.shape[1]:,} physical slots per layer, more than "
            f"the {MAX_SLOTS:,} physical ids a trace can hold; a map of {info.name} has {E} slots or a few more"
        )
    if arr.shape[0] == H:
        arr = arr[list(info.moe_layers)]
    elif arr.shape[0] != L:
        raise TraceFormatError(
            f"{where}: the physical-to-logical map has {arr.shape[0]} layers; {info.name} has {H} layers, {L} of "
            "them MoE (either count fits)"
        )
    map_LP = arr.astype(np.int64)
    if map_LP.shape[1] < E:
        raise TraceFormatError(
            f"{where}: the physical-to-logical map has {map_LP.shape[1]} slots per layer, fewer than {info.name}'s "
            f"{E} experts"
        )
    if ((map_LP < 0) | (map_LP >= E)).any():
        raise TraceFormatError(f"{where}: the physical-to-logical map holds ids outside 0..{E - 1}")
    for layer in range(L):
        if len(np.unique(map_LP[layer])) != E:
            raise TraceFormatError(
                f"{where}: MoE layer {info.moe_layers[layer]} of the physical-to-logical map does not hold every "
                f"one of the {E} logical experts"
            )
    return map_LP


def read_physical_map(path: Path, info: ModelInfo) -> np.ndarray:
    """The map of ``--physical-map``: a JSON object with ``physical_to_logical_map`` (SGLang) or ``phy2log`` (a
    moetrace placement file), as int64 ``[L, P]`` (``physical_map_from_array``)."""
    where = f"--physical-map {path.name}"
    if not path.is_file():
        raise TraceFormatError(f"{where}: not a regular file")
    if path.stat().st_size > MAX_MAP_BYTES:
        raise TraceFormatError(f"{where}: {path.stat().st_size:,} bytes, more than a map of any model takes")
    try:
        obj = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TraceFormatError(f"{where}: not a JSON map ({str(exc)[:200]})") from None
    if isinstance(obj, dict) and "physical_to_logical_map" in obj:
        return physical_map_from_array(obj["physical_to_logical_map"], info, where=where)
    if isinstance(obj, dict) and "phy2log" in obj:
        return physical_map_from_array(obj["phy2log"], info, where=where)
    raise TraceFormatError(
        f"{where}: a JSON object with `physical_to_logical_map` (SGLang) or `phy2log` (a moetrace placement "
        "file) was expected"
    )


def to_logical(topk_ids_TLK: np.ndarray, map_LP: np.ndarray, *, describe_row: DescribeRow | None = None) -> np.ndarray:
    """Physical slot ids ``[T, L, K]`` → logical ids (int16, same shape; ``-1`` stays ``-1``) through ``map_LP``
    (``[L, P]``). Raises ``TraceFormatError`` for an id outside ``-1..P-1``."""
    import numpy as np

    T, L, K = topk_ids_TLK.shape
    P = map_LP.shape[1]
    if map_LP.shape[0] != L:
        raise TraceFormatError(f"the physical-to-logical map has {map_LP.shape[0]} MoE layers, the ids {L}")
    out = np.empty((T, L, K), dtype=np.int16)
    offset_1L1 = (np.arange(L, dtype=np.int64) * P)[None, :, None]
    flat_map = map_LP.reshape(-1)
    for lo in range(0, T, CHUNK_TOKENS):
        ids = np.asarray(topk_ids_TLK[lo : lo + CHUNK_TOKENS], dtype=np.int64)
        bad = (ids < -1) | (ids >= P)
        if bad.any():
            t, layer, _ = (int(x) for x in np.argwhere(bad)[0])
            raise TraceFormatError(
                f"{_row(describe_row, lo + t, layer)}: physical id {int(ids[bad][0])} outside the map's 0..{P - 1} slots"
            )
        rec = ids >= 0
        out[lo : lo + CHUNK_TOKENS] = np.where(rec, flat_map[np.where(rec, ids, 0) + offset_1L1], -1)
    return out
