"""Import format ``vllm-responses``: JSONL of vLLM OpenAI-compatible server responses with routed experts.

The server runs with ``--enable-return-routed-experts`` (vLLM >= 0.21; from 0.31 an AuxOutput setting of the
same name). Each line is one response of ``/v1/completions`` or ``/v1/chat/completions`` as the server sent
it (``"object": "text_completion"`` or ``"chat.completion"``), or a JSON list of them; each choice becomes
one request. Read in vLLM's own source (files inside the ``vllm`` package):

- **0.21.0** (sdist): ``entrypoints/openai/completion/protocol.py`` and ``chat_completion/protocol.py``:
  the response's ``prompt_routed_experts`` (nested lists ``[prompt, layers, top_k]``, taken from the first
  prompt of the request, ``completion/serving.py``) and each choice's ``routed_experts`` (nested lists
  ``[output - 1, layers, top_k]``, ``output.routed_experts.tolist()``, None when empty). The layer axis is
  the MoE ordinal (``layer_axis="moe"``, as ``tracer/backends/vllm_convert.py`` reads it); positions the
  request took from the prefix cache come back as expert 0.
- **0.22.0** (wheel): each choice's ``routed_experts`` is ``base64`` of ``np.save(buf,
  output.routed_experts)`` (``completion/serving.py``, ``chat_completion/serving.py``), ``[prompt + output -
  1, num_hidden_layers, top_k]``, uint8 (<= 256 experts) or uint16.
- **0.33.0** (wheel): the same through ``utils/serial_utils.py`` ``numpy2base64`` (``np.save(...,
  allow_pickle=False)``); the protocol comment gives the shape "(num_tokens - 1, num_layers,
  num_experts_per_tok) dtype uint8/uint16/int32". The request may set ``routed_experts_prompt_start`` N
  (``sampling_params.py``): the first N prompt positions are left out of the array; this reader finds N from
  the array's length and records those positions as ``-1``.

The payload is decoded by ``vllm_convert.routed_experts_array`` (``.npy`` only, never a pickle) and turned
into rows by ``routed_experts_to_rows`` (MoE layers only, the last generated token ``-1``), the same
conversion the vLLM backend uses. Token counts come from the choice's ``token_ids`` and the prompt's
``prompt_token_ids`` (``return_token_ids: true``) when present, else from ``usage`` (one choice per response
only: ``usage`` sums over choices). Optional top-level ``request_id`` (int) and ``dataset`` keys, added by the
user, are kept (a response with several choices numbers them from its ``request_id``); otherwise requests
are numbered in file order and the dataset is ``--dataset`` or the file stem.

Refused, naming the line and the choice: a response without ``routed_experts`` (the server was not started
with the flag, or the request was aborted), token counts that the array does not match, ids outside the
model's experts, a vLLM 0.21 token whose top-k is all expert 0 (a prefix-cache hit: run 0.21 with prefix
caching off).

Shape legend: N rows returned, H the layer axis returned, T = prompt + output tokens, L MoE layers, K top-k,
X = L*K (legend: docs/architecture.md).

Out of scope: streamed responses (vLLM returns no routed experts while streaming in 0.21, and the chunks are
not saved whole by clients); TensorRT-LLM's ``CompletionOutput.routed_experts`` (PR NVIDIA/TensorRT-LLM#18397;
its code was not readable here, docs/collecting.md).
"""

from __future__ import annotations

from collections.abc import Generator
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
from moetrace.tracer.importers.options import ImportOptions, check_allocation

if TYPE_CHECKING:  # numpy and the writer load when a file is read, so `moetrace --help` stays light
    import numpy as np

    from moetrace.tracer.backends.vllm_convert import LayerAxis
    from moetrace.tracer.trace.schema import ModelInfo

#: the ``object`` of the responses read
OBJECTS = ("text_completion", "chat.completion")
#: responses per ``add_requests`` call (and per progress report)
BATCH_REQUESTS = 512


def detect(head: bytes, src: Path) -> bool:
    """A JSON-lines file whose first record is an OpenAI completion or chat-completion response."""
    first = first_object(head, src)
    return first is not None and first.get("object") in OBJECTS and isinstance(first.get("choices"), list)


def _token_count(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise TraceFormatError(f"`{name}` must be a list of token ids, got {type(value).__name__}")
    return len(value)


def choice_rows(
    resp: dict[str, Any], c: int, *, info: ModelInfo, options: ImportOptions | None = None
) -> tuple[int, int, np.ndarray, str]:
    """``(prompt_tokens, output_tokens, topk_ids_TX, layer_axis)`` of choice ``c`` of one response. The
    conversion's memory, estimated from the declared token counts and the payload's layers, is checked
    against the import's budget (``options``) before the positions the payload leaves out are padded."""
    import numpy as np

    from moetrace.tracer.backends.vllm_convert import routed_experts_array, routed_experts_to_rows

    choices = resp["choices"]
    choice = choices[c]
    if not isinstance(choice, dict):
        raise TraceFormatError(f"choices[{c}] must be an object")
    usage: dict[str, Any] = resp["usage"] if isinstance(resp.get("usage"), dict) else {}
    O = _token_count(choice.get("token_ids"), "token_ids")
    P = _token_count(choice.get("prompt_token_ids", resp.get("prompt_token_ids")), "prompt_token_ids")
    if O is None or P is None:
        if len(choices) != 1:
            raise TraceFormatError(
                f"{len(choices)} choices and no token_ids/prompt_token_ids: `usage` sums over the choices; send "
                '"return_token_ids": true so each choice carries its token ids'
            )
        O = whole(usage.get("completion_tokens"), "usage.completion_tokens") if O is None else O
        P = whole(usage.get("prompt_tokens"), "usage.prompt_tokens", low=1) if P is None else P
    if P < 1:
        raise TraceFormatError("a prompt of 0 tokens")
    T = P + O
    if T * info.ids_per_token * 2 > MAX_REQUEST_BYTES:
        raise TraceFormatError(
            f"a request of {P}+{O} tokens would take {T * info.ids_per_token * 2:,} bytes of routing; more than "
            f"{MAX_REQUEST_BYTES:,} for one request (check the token counts)"
        )
    payload = choice.get("routed_experts")
    split = "prompt_routed_experts" in resp  # vLLM 0.21: prompt rows on the response, generated rows per choice
    if split:
        prompt = resp.get("prompt_routed_experts")
        if prompt is None:
            raise TraceFormatError(
                "prompt_routed_experts is null: vLLM 0.21 returns none for a preempted request, or the server was not "
                "started with --enable-return-routed-experts"
            )
        parts = [routed_experts_array(prompt)]
        if payload is not None:
            gen = routed_experts_array(payload)
            if gen.size:
                if gen.ndim != 3 or gen.shape[1:] != parts[0].shape[1:]:
                    raise TraceFormatError(
                        f"prompt_routed_experts {parts[0].shape} and routed_experts {gen.shape} do not stack"
                    )
                parts.append(gen.astype(parts[0].dtype, copy=False))
        arr = np.concatenate(parts) if len(parts) > 1 else parts[0]
        if arr.ndim != 3 or len(parts[0]) != P:
            raise TraceFormatError(f"prompt_routed_experts covers {len(parts[0])} positions; the prompt has {P}")
        layer_axis: LayerAxis = "moe"
    else:
        if payload is None:
            raise TraceFormatError(
                "routed_experts is null: start vLLM with --enable-return-routed-experts (the request may also have "
                "been aborted before any forward pass)"
            )
        arr = routed_experts_array(payload)
        if arr.ndim != 3:
            raise TraceFormatError(f"routed_experts must be [tokens, layers, top_k], got shape {arr.shape}")
        N = len(arr)
        start = T - 1 - N if N < T - 1 else 0
        if start > P:
            raise TraceFormatError(
                f"routed_experts covers {N} positions; a request of {P}+{O} tokens needs {T - 1} (or fewer by a "
                "routed_experts_prompt_start of at most the prompt)"
            )
        H, K, L = arr.shape[1], arr.shape[2], info.num_moe_layers
        # the padded ids (int32), their MoE layers (int32), the range check (bool), the rows (int16)
        peak = T * K * (4 * H + 4 * L + L) + T * L * info.top_k * 2
        check_allocation(peak, f"a request of {P:,}+{O:,} tokens of {H} layers x {K}", options=options)
        if start:  # routed_experts_prompt_start: the first `start` prompt positions were not returned
            arr = np.concatenate([np.full((start, *arr.shape[1:]), -1, dtype=np.int32), arr.astype(np.int32)])
        layer_axis = "decoder"
    rows = routed_experts_to_rows(
        arr,
        moe_layers=info.moe_layers,
        num_hidden_layers=info.num_hidden_layers,
        num_experts=info.num_experts,
        prompt_tokens=P,
        output_tokens=O,
        layer_axis=layer_axis,
    )
    if split and info.top_k > 1:
        ids_TLK = rows.reshape(T, info.num_moe_layers, info.top_k)
        zero_TL = (ids_TLK == 0).all(axis=2)
        if zero_TL.any():
            t, l = (int(x) for x in np.argwhere(zero_TL)[0])
            raise TraceFormatError(
                f"position {t}, layer {info.moe_layers[l]}: every top-k id is expert 0, what vLLM 0.21 returns for a "
                "position taken from the prefix cache; run 0.21 with prefix caching off (--no-enable-prefix-caching)"
            )
    return P, O, rows, layer_axis


def parse(
    src: Path,
    *,
    info: ModelInfo,
    label: str,
    stages: StagesMode = "both",
    options: ImportOptions,
    with_weights: bool = False,
) -> Generator[Requests, None, Parsed]:
    """Every choice of every response of ``src``, one ``Requests`` each (module docstring); progress in bytes."""
    import numpy as np

    del stages, with_weights  # a response carries both stages
    axes: set[str] = set()
    index = 0
    size = src.stat().st_size
    consumed = [0]
    for n, obj in iter_json_lines(src, consumed):
        for resp in obj if isinstance(obj, list) else [obj]:
            if (
                not isinstance(resp, dict)
                or resp.get("object") not in OBJECTS
                or not isinstance(resp.get("choices"), list)
            ):
                raise TraceFormatError(
                    f"{src}:{n}: expected a vLLM /v1/completions or /v1/chat/completions response (an object with "
                    f'"object": {" or ".join(repr(o) for o in OBJECTS)} and a "choices" list)'
                )
            try:
                base = whole(resp["request_id"], "request_id", high=2**63 - 1) if "request_id" in resp else index
            except TraceFormatError as exc:
                raise TraceFormatError(f"{src}:{n}: {exc}") from exc
            if not resp["choices"]:
                raise TraceFormatError(f"{src}:{n}: a response without choices")
            for c in range(len(resp["choices"])):
                rid = base + c
                try:
                    P, O, rows, axis = choice_rows(resp, c, info=info, options=options)
                except (TraceFormatError, KeyError, TypeError, ValueError) as exc:
                    raise TraceFormatError(f"{src}:{n}: request {rid} (choice {c}): {exc}") from exc
                axes.add(axis)
                yield Requests(
                    request_id_R=np.array([rid], dtype=np.int64),
                    prompt_tokens_R=np.array([P]),
                    output_tokens_R=np.array([O]),
                    topk_ids_TLK=rows.reshape(len(rows), info.num_moe_layers, info.top_k),
                    dataset_R=(str(resp.get("dataset", label)),),
                    describe_row=lambda t, l: f"position {t}, layer {info.moe_layers[l]}",
                    context=f"{src}:{n}: request {rid} (choice {c})",
                    place=f"{src}:{n}",
                    progress=(consumed[0], size),
                )
            index = max(index, base + len(resp["choices"]))
    notes = ("vLLM 0.21 responses (prompt_routed_experts): layers read by MoE ordinal",) if "moe" in axes else ()
    return Parsed(notes=notes)


FORMAT = ImportFormat(
    name="vllm-responses",
    help="JSONL of vLLM OpenAI-server responses (/v1/completions, /v1/chat/completions) with routed_experts",
    detect=detect,
    precheck=check_utf8,
    parse=parse,
    batch_requests=BATCH_REQUESTS,
)
