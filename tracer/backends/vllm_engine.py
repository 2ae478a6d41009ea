"""One vLLM engine rank: starting it, the prompts it runs, its submission loop, a data-parallel rank's process.

An engine rank is one ``vllm.LLM`` (``tp`` GPUs, expert parallel when ``ep`` > 1), started by
:func:`_build_llm` (``spawn`` workers unless the user chose otherwise; a failed start is one
``ModelError`` line). :func:`_encode_all` gives the token ids of each prompt, cut to what
:func:`_max_prompt` leaves room for; :func:`run_engine_loop` keeps ``num_inflight`` requests in the
engine, each sampled as the run's ``GenerationConfig`` says (:func:`_sampling_params`). With
``dp`` > 1 each rank is a spawned process (:func:`_dp_worker`: vLLM's ``VLLM_DP_*`` environment, a
placeholder request when its shard of :func:`split_evenly` is empty, since vLLM's DP ranks step
together) that converts its finished requests and sends ``("rows" | "done" | "error", rank,
payload)`` over a queue. ``backends.vllm`` re-exports every name.

Out of scope: the parent's side of a run (``vllm.collect_with_vllm``: the writer thread, one rank
in-process, reading the DP ranks' queue), the capture facts and engine settings (``vllm_env``), the
array conversion (``vllm_convert``), several engines over several nodes (``sharding``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from moetrace.errors import ConfigError, ModelError
from moetrace.tracer.backends.base import GenerationConfig
from moetrace.tracer.backends.vllm_convert import convert_or_fail
from moetrace.tracer.backends.vllm_env import MULTIPROC_ENV, CaptureFacts, VllmEngineConfig, engine_start_error
from moetrace.tracer.trace.schema import ModelInfo

if TYPE_CHECKING:  # pragma: no cover
    from moetrace.tracer.datasets import PromptRecord

T = TypeVar("T")


def _sampling_params(vllm: Any, *, request_id: int, generation: GenerationConfig) -> Any:
    g = generation
    return vllm.SamplingParams(
        n=1,
        max_tokens=g.max_new_tokens,
        temperature=g.temperature,
        seed=None if g.temperature == 0 else g.seed * 1_000_003 + request_id,  # per-request, reproducible
        detokenize=g.store_text,  # text is decoded only when the trace keeps it
    )


def run_engine_loop(
    llm: Any,
    work: Iterator[tuple[int, list[int]]],
    *,
    vllm: Any,
    num_inflight: int,
    generation: GenerationConfig,
    emit: Callable[[list[Any]], None],
) -> None:
    """Keep ``num_inflight`` requests in the engine, hand every finished batch of outputs to ``emit``.

    ``work`` yields ``(request_id, prompt_token_ids)``; each is sampled as ``generation`` says.
    Continuous submission (instead of one ``generate`` call per batch) keeps the running batch
    full; ``emit`` must not block for long.
    """
    engine = llm.llm_engine
    inflight = 0
    exhausted = False
    while True:
        while not exhausted and inflight < num_inflight:
            nxt = next(work, None)
            if nxt is None:
                exhausted = True
                break
            rid, ids = nxt
            params = _sampling_params(vllm, request_id=rid, generation=generation)
            engine.add_request(str(rid), {"prompt_token_ids": ids}, params)
            inflight += 1
        if inflight == 0 and exhausted:
            return
        finished = [o for o in engine.step() if o.finished]
        if finished:
            inflight -= len(finished)
            emit(finished)


def _encode_all(
    prompts: Sequence[PromptRecord], tokenizer: Any, *, chat_template: bool, max_prompt: int, truncated: list[int]
) -> Iterator[tuple[int, list[int]]]:
    """Token ids of each prompt; prompts longer than ``max_prompt`` keep their first ``max_prompt``
    tokens (their ids are appended to ``truncated``; ``prompt_tokens`` is the length actually run)."""
    from moetrace.tracer.datasets import render_prompt_ids

    for p in prompts:
        ids = render_prompt_ids(p, tokenizer, chat_template=chat_template)
        if len(ids) > max_prompt:
            ids = ids[:max_prompt]
            truncated.append(p.request_id)
        yield p.request_id, ids


def _build_llm(source: str, engine: VllmEngineConfig, *, capture: CaptureFacts, seed: int) -> Any:
    """One engine rank: ``tp`` GPUs, expert parallel when ``ep`` > 1 (DP size comes from the env).

    vLLM's worker processes are started with ``spawn`` unless the user set
    ``VLLM_WORKER_MULTIPROC_METHOD``: a forked worker cannot use CUDA once anything in this process
    initialised it. Any exception from the engine's start is raised as one ``ModelError`` line
    (:func:`engine_start_error`).
    """
    import vllm

    os.environ.setdefault(MULTIPROC_ENV, "spawn")
    try:
        return vllm.LLM(source, seed=seed, **engine.llm_kwargs(capture=capture))
    except Exception as exc:  # vLLM fails to start in many ways; each becomes one line naming its cause
        raise ModelError(engine_start_error(source, exc)) from exc


def _max_prompt(llm: Any, max_new_tokens: int) -> int:
    """The longest prompt that leaves room for ``max_new_tokens`` in the engine's ``max_model_len``."""
    max_len = int(llm.llm_engine.model_config.max_model_len)
    if max_len <= max_new_tokens:
        raise ConfigError(f"max_model_len {max_len} leaves no room for a prompt and {max_new_tokens} new tokens")
    return max_len - max_new_tokens


def split_evenly(items: Sequence[T], num_parts: int) -> list[list[T]]:
    """``items`` in ``num_parts`` contiguous, near-equal parts (earlier parts get the remainder)."""
    base, rem = divmod(len(items), num_parts)
    out: list[list[T]] = []
    start = 0
    for i in range(num_parts):
        n = base + (i < rem)
        out.append(list(items[start : start + n]))
        start += n
    return out


def _dp_worker(
    rank: int,
    dp: int,
    master_port: int,
    prompts: list[PromptRecord],
    source: str,
    info: ModelInfo,
    engine: VllmEngineConfig,
    capture: CaptureFacts,
    generation: GenerationConfig,
    results: Any,
) -> None:
    """One DP engine rank (a process): generate its prompts, send converted requests back."""
    from moetrace.lifetime import die_with_parent

    die_with_parent()  # never outlives a killed `collect`
    os.environ.update(
        VLLM_DP_RANK=str(rank),
        VLLM_DP_RANK_LOCAL=str(rank),
        VLLM_DP_SIZE=str(dp),
        VLLM_DP_MASTER_IP="127.0.0.1",
        VLLM_DP_MASTER_PORT=str(master_port),
    )
    try:
        import vllm

        from moetrace.tracer.datasets import PromptRecord

        llm = _build_llm(source, engine, capture=capture, seed=generation.seed)
        # every rank must run a request, even with an empty shard (vLLM's DP ranks step together)
        todo = prompts or [PromptRecord(request_id=-1, dataset="placeholder", text="placeholder")]
        truncated: list[int] = []
        work = _encode_all(
            todo,
            llm.get_tokenizer(),
            chat_template=generation.chat_template,
            max_prompt=_max_prompt(llm, generation.max_new_tokens),
            truncated=truncated,
        )

        def emit(outputs: list[Any]) -> None:
            results.put(
                (
                    "rows",
                    rank,
                    [
                        convert_or_fail(o, info=info, layer_axis=capture.layer_axis)
                        for o in outputs
                        if int(o.request_id) >= 0
                    ],
                )
            )

        run_engine_loop(llm, work, vllm=vllm, num_inflight=engine.num_inflight, generation=generation, emit=emit)
        results.put(("done", rank, truncated))
    except BaseException as exc:
        results.put(("error", rank, f"{type(exc).__name__}: {exc}"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
