"""vLLM's routed experts → trace rows: pure array conversion, no vLLM import.

What vLLM hands back with each finished request, by version (read from vLLM's source; see
docs/collecting.md):

- 0.14–0.20: ``CompletionOutput.routed_experts`` ``[prompt+output-1, num_hidden_layers, top_k]``
  int32, read from a shared-memory buffer indexed by KV-cache slot.
- 0.21: ``RequestOutput.prompt_routed_experts`` ``[prompt, L, K]`` plus
  ``CompletionOutput.routed_experts`` for the generated tokens, int16, ``-1`` at prefix-cache hits.
- ≥ 0.22 (checked on 0.32): ``CompletionOutput.routed_experts`` ``[prompt+output-1,
  total_num_hidden_layers, top_k]``, uint8 (≤ 256 experts) or uint16, assembled from
  per-step chunks; prefix-cached positions carry their stored routing (prefix caching is required).

In every version the layer axis may be sized by *all* decoder layers, so dense layers appear as
rows of zeros, and the last generated token (sampled, never fed back through the model) has no row
or a meaningless one. :func:`routed_experts_to_rows` turns any of these layouts into trace rows:
MoE layers only, one row per position ``0..prompt+output-1``, ``-1`` where nothing was recorded.
SGLang's import (``importers``) uses the same conversion.

Shape legend: N rows returned by the engine, H the layer axis returned by the engine (all decoder
layers; in the versions that return only the MoE layers, its size is L), T = prompt + output tokens,
L MoE layers, K top-k, X = L*K (legend: docs/architecture.md).

Out of scope: running the engine (``vllm``), writing rows (``moetrace.tracer.trace.writer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from moetrace.tracer.trace.schema import NO_EXPERT, ModelInfo


def routed_experts_to_rows(
    routed_NHK: np.ndarray,
    *,
    moe_layers: Sequence[int],
    num_hidden_layers: int,
    num_experts: int,
    prompt_tokens: int,
    output_tokens: int,
) -> np.ndarray:
    """Trace rows ``topk_ids_TX`` (int16 ``[T, L*K]``) of one request from vLLM's routed experts.

    ``routed_NHK``: vLLM's array for the whole sequence (prompt rows then generated rows), any
    integer dtype, ``N`` = T-1 (the last generated token is never forwarded) or T (its row is
    then dropped as meaningless), ``H`` = ``num_hidden_layers`` (dense layers are rows of zeros
    and are dropped) or ``len(moe_layers)`` (only the MoE layers returned). ``-1`` (vLLM 0.21's prefix-cache sentinel) stays -1;
    the final generated position is always -1. Raises ``ValueError`` on any other shape or on ids
    outside ``0..num_experts-1``.
    """
    arr = np.asarray(routed_NHK)
    T = prompt_tokens + output_tokens
    L = len(moe_layers)
    if arr.ndim != 3:
        raise ValueError(f"routed experts must be [tokens, layers, top_k], got shape {arr.shape}")
    N, H, K = arr.shape
    if H == num_hidden_layers:
        arr = arr[:, list(moe_layers), :]
    elif H != L:
        raise ValueError(
            f"routed experts have {H} layers; expected {num_hidden_layers} (all layers) or {L} (MoE layers)"
        )
    if N not in (T - 1, T):
        raise ValueError(f"routed experts cover {N} tokens; a request of {prompt_tokens}+{output_tokens} tokens needs {T - 1}")
    if np.issubdtype(arr.dtype, np.signedinteger):
        bad = (arr < NO_EXPERT) | (arr >= num_experts)
    else:
        bad = arr >= num_experts
    if bad.any():
        raise ValueError(f"routed experts hold ids outside 0..{num_experts - 1}: {np.unique(arr[bad])[:5].tolist()}")
    out = np.full((T, L * K), NO_EXPERT, dtype=np.int16)
    out[: T - 1] = arr[: T - 1].reshape(T - 1, L * K)
    return out


def request_routed_experts(output: Any) -> np.ndarray | None:
    """The whole-sequence routed-experts array of a finished ``vllm.RequestOutput`` (any version
    ≥ 0.14), or None when vLLM returned none for it (e.g. a preempted request in 0.21)."""
    gen = output.outputs[0].routed_experts
    prompt = getattr(output, "prompt_routed_experts", None)
    if prompt is not None:  # vLLM 0.21: split into prompt and generated parts
        prompt = np.asarray(prompt)
        return prompt if gen is None or len(gen) == 0 else np.concatenate([prompt, np.asarray(gen, dtype=prompt.dtype)])
    return None if gen is None else np.asarray(gen)


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


def convert_output(output: Any, *, info: ModelInfo) -> ConvertedRequest:
    """Convert one finished ``vllm.RequestOutput`` (request id = our integer id as a string)."""
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
    )
    return ConvertedRequest(int(output.request_id), prompt_tokens, output_tokens, rows, completion.text or None)


def convert_or_fail(output: Any, *, info: ModelInfo) -> ConvertedRequest | FailedRequest:
    """:func:`convert_output`, or a :class:`FailedRequest` naming why not (the run goes on)."""
    try:
        return convert_output(output, info=info)
    except ValueError as exc:
        return FailedRequest(int(output.request_id), str(exc))
