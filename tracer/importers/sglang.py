"""Import format ``sglang``: JSONL of SGLang ``/generate`` responses carrying their routed experts.

The server is started with ``--enable-return-routed-experts`` and requests are sent with
``"return_routed_experts": true``. Each line is one response object (or a JSON list of them, as a
batched ``/generate`` returns). ``meta_info.routed_experts`` is base64 of little-endian ids,
flattened ``[rows, num_layers, top_k]`` covering positions ``[routed_experts_start_len, seqlen - 1)``
(``seqlen`` = ``prompt_tokens + completion_tokens``; the last generated token is never forwarded);
``num_layers`` is all decoder layers (dense ones hold zeros) or only the MoE ones. The ids are
int32 unless ``meta_info.routed_experts_dtype`` names ``int32``, ``uint16`` or ``uint8`` (SGLang's
optional compact encoding; released SGLang up to 0.5.23 sends int32 and no such key). Ids are
logical experts from SGLang 0.5.16 on; 0.5.7 and 0.5.9 captured after the logical-to-physical remap
(0.5.12 on some router paths), so their runs with EPLB, redundant experts or
``--init-expert-location`` returned physical slot ids (docs/collecting.md says how to tell).
Optional top-level ``request_id`` (int) and ``dataset`` keys, added by the user, are kept;
otherwise the request id is the response's order in the input and the dataset is ``--dataset``
or the file stem.

Detected by the first record's ``meta_info`` key. A response always carries both stages, so
``--stages`` stays at ``both``.

Shape legend: T tokens, H all decoder layers (or the MoE ones, as SGLang recorded), K top-k,
X = L*K with L MoE layers (legend: docs/architecture.md).

Out of scope: what a ``--model`` name means (the caller passes the ``ModelInfo``), SGLang's other
recorders (the ``per_token`` expert-distribution dumps carry physical ids and no request ids).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace.errors import TraceFormatError
from moetrace.tracer.importers.base import ImportFormat, Parsed, Requests, StagesMode
from moetrace.tracer.importers.jsonl import (
    MAX_REQUEST_BYTES,
    check_utf8,
    first_object,
    iter_json_lines,
    whole,
)
from moetrace.tracer.importers.options import PHYSICAL_MAP, ImportOptions, check_allocation

if TYPE_CHECKING:  # numpy and the writer load when a file is read, so `moetrace --help` stays light
    import numpy as np

    from moetrace.tracer.trace.schema import ModelInfo

#: SGLang's ``meta_info.routed_experts_dtype`` values -> the little-endian dtype of the payload's ids
SGLANG_ROUTED_EXPERTS_DTYPES: dict[str, str] = {"int32": "<i4", "uint16": "<u2", "uint8": "u1"}
#: the payload's dtype when a response has no ``routed_experts_dtype`` (every released SGLang)
SGLANG_DEFAULT_DTYPE = "int32"
#: responses per ``add_requests`` call (and per progress report; the driver also caps a batch's bytes)
BATCH_RESPONSES = 512


def detect(head: bytes, src: Path) -> bool:
    """A JSON-lines file whose first record is an object with ``meta_info``."""
    first = first_object(head, src)
    return first is not None and "meta_info" in first


def sglang_routed_experts_dtype(name: Any) -> np.dtype:
    """The id dtype named by ``meta_info.routed_experts_dtype`` (None: int32, what SGLang sends
    without the key). SGLang reads the name case-insensitively with surrounding spaces stripped."""
    import numpy as np

    if name is None:
        return np.dtype(SGLANG_ROUTED_EXPERTS_DTYPES[SGLANG_DEFAULT_DTYPE])
    if not isinstance(name, str) or name.strip().lower() not in SGLANG_ROUTED_EXPERTS_DTYPES:
        raise TraceFormatError(
            f"meta_info.routed_experts_dtype must be one of {', '.join(SGLANG_ROUTED_EXPERTS_DTYPES)}, got {name!r}"
        )
    return np.dtype(SGLANG_ROUTED_EXPERTS_DTYPES[name.strip().lower()])


def decode_sglang_routed_experts(
    payload: str, *, num_rows: int, top_k: int, dtype_name: str | None = None
) -> np.ndarray:
    """SGLang's base64 payload as ``[num_rows, H, top_k]`` ids (H = the layers it recorded: all, or
    only the MoE layers), in the dtype ``dtype_name`` names (a ``meta_info.routed_experts_dtype`` value;
    None: int32)."""
    import numpy as np

    ids_dtype = sglang_routed_experts_dtype(dtype_name)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (ValueError, TypeError) as exc:
        raise TraceFormatError(f"routed_experts is not base64 ({exc})") from exc
    if len(raw) % ids_dtype.itemsize:
        raise TraceFormatError(f"routed_experts holds {len(raw)} bytes, not a whole number of {ids_dtype.name} ids")
    flat = np.frombuffer(raw, dtype=ids_dtype)
    if num_rows == 0:
        return flat.reshape(0, 0, top_k)
    if flat.size % (num_rows * top_k):
        raise TraceFormatError(
            f"routed_experts holds {flat.size} ids, not a multiple of {num_rows} rows x top_k {top_k}"
        )
    return flat.reshape(num_rows, -1, top_k)


def sglang_response_rows(
    resp: dict[str, Any], *, info: ModelInfo, physical: bool = False, options: ImportOptions | None = None
) -> tuple[int, int, np.ndarray]:
    """``(prompt_tokens, output_tokens, topk_ids_TX)`` of one SGLang ``/generate`` response; ``physical``: the ids
    are physical slots (converted by the caller), so ids of ``E`` and more are kept for the map. What the
    conversion holds at once is estimated from the token counts the response declares and checked against
    the import's memory budget (``options``) first: a short line may declare a long request whose positions
    before ``routed_experts_start_len`` the payload leaves out."""
    import numpy as np

    from moetrace.tracer.backends.vllm_convert import routed_experts_to_rows
    from moetrace.tracer.trace.schema import NO_EXPERT

    meta = resp.get("meta_info")
    if not isinstance(meta, dict):
        raise TraceFormatError("no meta_info object (is this a /generate response?)")
    payload = meta.get("routed_experts")
    if payload is None:
        raise TraceFormatError(
            "meta_info has no routed_experts: start SGLang with --enable-return-routed-experts and send "
            '"return_routed_experts": true with each request'
        )
    P = whole(meta.get("prompt_tokens"), "meta_info.prompt_tokens", low=1)
    O = whole(meta.get("completion_tokens"), "meta_info.completion_tokens")
    start = whole(meta.get("routed_experts_start_len") or 0, "meta_info.routed_experts_start_len")
    T = P + O
    if T * info.ids_per_token * 2 > MAX_REQUEST_BYTES:
        raise TraceFormatError(
            f"a request of {P}+{O} tokens would take {T * info.ids_per_token * 2:,} bytes of "
            f"routing; more than {MAX_REQUEST_BYTES:,} for one request (check the token counts)"
        )
    if not 0 <= start <= T - 1:
        raise TraceFormatError(f"routed_experts_start_len {start} outside 0..{T - 1}")
    if not isinstance(payload, str):
        raise TraceFormatError(f"meta_info.routed_experts must be a base64 string, got {type(payload).__name__}")
    arr = decode_sglang_routed_experts(
        payload, num_rows=T - 1 - start, top_k=info.top_k, dtype_name=meta.get("routed_experts_dtype")
    )
    H = arr.shape[1] if arr.size else info.num_hidden_layers
    K, L = info.top_k, info.num_moe_layers
    # the padded ids (int32, H layers), their MoE layers (int32), the range check (bool), the rows (int16)
    peak = (T - 1) * K * (4 * H + 4 * L + L) + T * L * K * 2
    check_allocation(peak, f"a request of {P:,}+{O:,} tokens from position {start:,}", options=options)
    if start:  # positions before the start were not returned: nothing recorded
        padded = np.full((T - 1, H, K), NO_EXPERT, dtype=np.int32)
        padded[start:] = arr.reshape(-1, H, K)
        arr = padded
    try:
        rows = routed_experts_to_rows(
            arr,
            moe_layers=info.moe_layers,
            num_hidden_layers=info.num_hidden_layers,
            num_experts=int(np.iinfo(np.int16).max) if physical else info.num_experts,
            prompt_tokens=P,
            output_tokens=O,
        )
    except ValueError as exc:
        raise TraceFormatError(str(exc)) from exc
    return P, O, rows


def _describe(info: ModelInfo) -> Callable[[int, int], str]:
    """Names row ``t`` and MoE layer ordinal ``l`` of one response's ids, for an error."""
    return lambda t, layer: f"position {t}, layer {info.moe_layers[layer]}"


def parse(
    src: Path,
    *,
    info: ModelInfo,
    label: str,
    stages: StagesMode = "both",
    options: ImportOptions,
    with_weights: bool = False,
) -> Generator[Requests, None, Parsed]:
    """Every response of ``src``, one ``Requests`` each, progress in bytes of ``src``; ``--physical-map``:
    the ids are physical slots (the driver converts them)."""
    import numpy as np

    del stages, with_weights  # a response carries both stages and no weights
    physical = options.physical_map is not None
    index = 0
    size = src.stat().st_size
    consumed = [0]
    for n, obj in iter_json_lines(src, consumed):
        for resp in obj if isinstance(obj, list) else [obj]:
            if not isinstance(resp, dict):
                raise TraceFormatError(f"{src}:{n}: expected a response object, got {type(resp).__name__}")
            try:
                rid = whole(resp["request_id"], "request_id", high=2**63 - 1) if "request_id" in resp else index
            except TraceFormatError as exc:
                raise TraceFormatError(f"{src}:{n}: {exc}") from exc
            try:
                P, O, rows = sglang_response_rows(resp, info=info, physical=physical, options=options)
            except (TraceFormatError, KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"{src}:{n}: request {rid}: {exc}") from exc
            yield Requests(
                request_id_R=np.array([rid], dtype=np.int64),
                prompt_tokens_R=np.array([P]),
                output_tokens_R=np.array([O]),
                topk_ids_TLK=rows.reshape(len(rows), info.num_moe_layers, info.top_k),
                dataset_R=(str(resp.get("dataset", label)),),
                describe_row=_describe(info),
                context=f"{src}:{n}: request {rid}",
                place=f"{src}:{n}",
                progress=(consumed[0], size),
            )
            index += 1
    return Parsed()


FORMAT = ImportFormat(
    name="sglang",
    help="JSONL of SGLang /generate responses with meta_info.routed_experts",
    detect=detect,
    precheck=check_utf8,
    parse=parse,
    batch_requests=BATCH_RESPONSES,
    stages_modes=False,
    options=frozenset({PHYSICAL_MAP}),
)
