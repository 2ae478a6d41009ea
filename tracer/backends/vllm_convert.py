"""vLLM's routed experts → trace rows: pure array conversion, no vLLM import.

What vLLM hands back with each finished request, by version (read from vLLM's source, each release's
sdist or wheel; the file and tag of every fact are in docs/collecting.md):

- 0.14–0.20: ``CompletionOutput.routed_experts`` ``[prompt+output-1, num_hidden_layers, top_k]``
  int32, read from a shared-memory buffer indexed by KV-cache slot; the layer axis is the decoder
  layer index (dense layers stay 0).
- 0.21: ``RequestOutput.prompt_routed_experts`` ``[prompt, H, K]`` plus
  ``CompletionOutput.routed_experts`` ``[output-1, H, K]`` (None when empty), int16, from a
  per-request host cache. The layer axis is the *MoE ordinal* (the order the MoE layers were
  built), sized by vLLM's own MoE-layer count, which for DeepSeek-style configs is all layers: the
  first L rows hold the MoE layers, the rest stay 0. Positions the request did not compute
  (prefix-cache hits) stay 0 in the code (its docs say -1); a preempted request returns None.
- ≥ 0.22 (checked through 0.33): ``CompletionOutput.routed_experts`` ``[prompt+output-1,
  num_hidden_layers, top_k]``, uint8 (≤ 256 experts) or uint16, assembled from per-step chunks;
  prefix-cached positions carry their stored routing.
- Over HTTP (OpenAI-compatible server, ≥ 0.22): ``routed_experts`` is base64 of an ``.npy`` file;
  0.21's server sends nested lists.

:func:`routed_experts_array` turns any of these payloads (array, nested list, base64 ``.npy`` text
as ``str`` or ``bytes``) into an integer array; :func:`routed_experts_to_rows` turns the array into
trace rows: MoE layers only, one row per position ``0..prompt+output-1``, ``-1`` where nothing was
recorded (the last generated token is sampled but never fed back through the model). SGLang's
import (``importers``) uses the same conversion.

Shape legend: N rows returned by the engine, H the layer axis returned by the engine (all decoder
layers, or only the MoE ones), T = prompt + output tokens, L MoE layers, K top-k, X = L*K
(legend: docs/architecture.md).

Out of scope: running the engine and the per-version engine facts (``vllm``), writing rows
(``moetrace.tracer.trace.writer``).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from moetrace.tracer.trace.schema import NO_EXPERT, ModelInfo

#: how the engine's layer axis is indexed: ``decoder`` by the model's decoder-layer index (dense
#: layers present as rows of zeros, or the axis holds only the MoE layers), ``moe`` by MoE ordinal
#: (the first L rows are the MoE layers in model order; vLLM 0.21)
LayerAxis = Literal["decoder", "moe"]


def routed_experts_array(payload: Any) -> np.ndarray:
    """The integer array of one routed-experts payload, whatever form it came in.

    ``payload``: a numpy array or nested lists (``[N, H, K]``, any integer dtype), or text (``str``,
    or ASCII ``bytes``) holding base64 of an ``.npy`` file (vLLM's HTTP server from 0.22 on). The
    ``.npy`` is read with ``allow_pickle=False``. Raises ``ValueError`` naming the problem for text
    that is not base64 of an ``.npy`` file and for anything that is not integers.
    """
    if isinstance(payload, (str, bytes, bytearray)):
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"routed experts text is not base64 ({exc})") from None
        try:  # an .npy file only (np.load would also open .npz archives)
            arr = np.lib.format.read_array(io.BytesIO(raw), allow_pickle=False)
        except (ValueError, OSError, EOFError, MemoryError) as exc:  # MemoryError: a header claiming a huge shape
            raise ValueError(f"routed experts text is base64 but not of a .npy array file ({exc})") from None
    else:
        try:
            arr = np.asarray(payload)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"routed experts are not a rectangular array ({exc})") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu":
        kind = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
        raise ValueError(f"routed experts must be integer expert ids, got {kind}")
    return arr


def routed_experts_to_rows(
    routed_NHK: Any,
    *,
    moe_layers: Sequence[int],
    num_hidden_layers: int,
    num_experts: int,
    prompt_tokens: int,
    output_tokens: int,
    layer_axis: LayerAxis = "decoder",
) -> np.ndarray:
    """Trace rows ``topk_ids_TX`` (int16 ``[T, L*K]``) of one request from an engine's routed experts.

    ``routed_NHK``: the array for the whole sequence (prompt rows then generated rows) in any form
    :func:`routed_experts_array` reads, any integer dtype, ``N`` = T-1 (the last generated token
    is never forwarded) or T (its row is then dropped as meaningless). With ``layer_axis="decoder"``
    ``H`` is ``num_hidden_layers`` (dense layers are rows of zeros and are dropped) or
    ``len(moe_layers)`` (only the MoE layers returned); with ``layer_axis="moe"`` (vLLM 0.21) the
    first ``len(moe_layers)`` rows are the MoE layers in order and any further rows must be zero.
    ``-1`` stays -1; the final generated position is always -1. Raises ``ValueError`` on any other
    shape, on data in rows that should be empty, and on ids outside ``0..num_experts-1``.
    """
    arr = routed_experts_array(routed_NHK)
    T = prompt_tokens + output_tokens
    L = len(moe_layers)
    if arr.ndim != 3:
        raise ValueError(f"routed experts must be [tokens, layers, top_k], got shape {arr.shape}")
    N, H, K = arr.shape
    if layer_axis == "moe":
        if H < L:
            raise ValueError(f"routed experts have {H} layers; the model has {L} MoE layers")
        if arr[:, L:].any():
            raise ValueError(f"routed experts hold data beyond the first {L} (MoE) layers of a MoE-ordinal layer axis")
        arr = arr[:, :L]
    elif layer_axis != "decoder":
        raise ValueError(f"layer_axis must be 'decoder' or 'moe', not {layer_axis!r}")
    elif H == num_hidden_layers:
        arr = arr[:, list(moe_layers), :]
    elif H != L:
        raise ValueError(
            f"routed experts have {H} layers; expected {num_hidden_layers} (all layers) or {L} (MoE layers)"
        )
    if N not in (T - 1, T):
        raise ValueError(
            f"routed experts cover {N} tokens; a request of {prompt_tokens}+{output_tokens} tokens needs {T - 1}"
        )
    if np.issubdtype(arr.dtype, np.signedinteger):
        bad = (arr < NO_EXPERT) | (arr >= num_experts)
    else:
        bad = arr >= num_experts
    if bad.any():
        raise ValueError(
            f"routed experts hold ids outside 0..{num_experts - 1}: {np.unique(arr[bad])[:5].tolist()} (ids of "
            "E and more are physical slots of a run with redundant experts (EPLB), or another model's ids)"
        )
    out = np.full((T, L * K), NO_EXPERT, dtype=np.int16)
    out[: T - 1] = arr[: T - 1].reshape(T - 1, L * K)
    return out


def request_routed_experts(output: Any) -> np.ndarray | None:
    """The whole-sequence routed-experts array ``[N, H, K]`` of a finished ``vllm.RequestOutput``
    (any version ≥ 0.14), or None when vLLM returned none for it.

    A ``RequestOutput`` with a ``prompt_routed_experts`` attribute is vLLM 0.21's split layout: the
    prompt rows there, the generated rows (None for a single generated token) in
    ``outputs[0].routed_experts``; a None prompt part means no routing (0.21 drops a preempted
    request's routing). Every part may be any form :func:`routed_experts_array` reads (an array,
    nested lists, base64 ``.npy`` text as ``str`` or ``bytes``).
    """
    gen = output.outputs[0].routed_experts
    if hasattr(output, "prompt_routed_experts"):  # vLLM 0.21: split into prompt and generated parts
        if output.prompt_routed_experts is None:
            return None
        prompt = routed_experts_array(output.prompt_routed_experts)
        if gen is None:
            return prompt
        gen_arr = routed_experts_array(gen)
        if gen_arr.size == 0:
            return prompt
        if gen_arr.ndim != prompt.ndim or gen_arr.shape[1:] != prompt.shape[1:]:
            raise ValueError(f"prompt routed experts {prompt.shape} and generated ones {gen_arr.shape} do not stack")
        return np.concatenate([prompt, gen_arr.astype(prompt.dtype, copy=False)])
    return None if gen is None else routed_experts_array(gen)


@dataclass(frozen=True)
class FailedRequest:
    """A finished request whose routed experts could not be converted (not written)."""

    request_id: int
    reason: str


@dataclass(frozen=True)
class ConvertedRequest:
    """One finished request, ready for ``TraceWriter.add_requests``."""

    request_id: int
    prompt_tokens: int
    output_tokens: int
    topk_ids_TX: np.ndarray
    output_text: str | None


def convert_output(output: Any, *, info: ModelInfo, layer_axis: LayerAxis = "decoder") -> ConvertedRequest:
    """Convert one finished ``vllm.RequestOutput`` (request id = our integer id as a string);
    ``layer_axis`` says how the engine's version indexes layers (``"moe"`` for vLLM 0.21)."""
    routed = request_routed_experts(output)
    if routed is None:
        raise ValueError(f"vLLM returned no routed experts for request {output.request_id}")
    completion = output.outputs[0]
    prompt_tokens = len(output.prompt_token_ids)
    output_tokens = len(completion.token_ids)
    rows = routed_experts_to_rows(
        routed,
        moe_layers=info.moe_layers,
        num_hidden_layers=info.num_hidden_layers,
        num_experts=info.num_experts,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        layer_axis=layer_axis,
    )
    return ConvertedRequest(int(output.request_id), prompt_tokens, output_tokens, rows, completion.text or None)


def convert_or_fail(
    output: Any, *, info: ModelInfo, layer_axis: LayerAxis = "decoder"
) -> ConvertedRequest | FailedRequest:
    """:func:`convert_output`, or a :class:`FailedRequest` naming why not (the run goes on; a resumed
    run retries it)."""
    try:
        return convert_output(output, info=info, layer_axis=layer_axis)
    except ValueError as exc:
        return FailedRequest(int(output.request_id), str(exc))
