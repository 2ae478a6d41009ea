"""llm-d-inference-sim's files (its MoE fork; docs/exports.md): the ``--moe-fixed-placement-path``
JSON made from a placement (``llmd_fixed_placement``, its ``physical_to_logical``), and the binary
``.moetrace`` trace made from a trace (``llmd_moetrace_bytes``: their name and format, magic
``MOETRC01``; the importer ``tracer/importers/llmd_moetrace.py`` reads it back).

Shape legend (docs/architecture.md): L MoE layers, P physical slots, W EP ranks, J slots of one rank
(P / W), R requests, T tokens, K top-k slots.

Out of scope: choosing the format (``exports``); reading the files back (the importer).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.placement_files import PlacementFile
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import stages_of

__all__ = ["llmd_fixed_placement", "llmd_moetrace_bytes"]


#: llm-d-inference-sim's ``.moetrace`` (pkg/moetrace/format.go and writer.go; docs/exports.md)
_LLMD_MAGIC = b"MOETRC01"


_LLMD_HEADER, _LLMD_ENTRY, _LLMD_BLOCK_HEADER = 112, 32, 32


def llmd_fixed_placement(pf: PlacementFile) -> dict[str, Any]:
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
