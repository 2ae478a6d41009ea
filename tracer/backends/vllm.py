"""vLLM backend: collect traces at serving batch sizes from vLLM's own routed-experts capture.

vLLM ≥ 0.14 records, with the engine argument ``enable_return_routed_experts=True``, the expert ids
every MoE router chose for every token, and hands them back with each finished request;
``vllm_convert`` turns what comes back (its layout differs by version) into trace rows.

Out of scope: what a model name means (``presets.resolve``), the array conversion (``vllm_convert``),
prompt loading (``datasets``), choosing the backend and opening the trace (``collect``), several
engines over several nodes (``sharding``).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import queue
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from moetrace.errors import ConfigError, ModelError, MoetraceError
from moetrace.tracer.backends.vllm_convert import ConvertedRequest, FailedRequest, convert_or_fail
from moetrace.tracer.trace.schema import NO_EXPERT, ModelInfo

if TYPE_CHECKING:  # pragma: no cover
    from moetrace.tracer.presets import ResolvedModel

#: first vLLM release with ``enable_return_routed_experts``
MIN_VLLM = (0, 14)


@dataclass(frozen=True, kw_only=True)
class VllmEngineConfig:
    """Settings of one vLLM engine (passed through to ``vllm.LLM``), and the submission loop."""

    tp: int = 1  # tensor-parallel GPUs per engine (tensor_parallel_size)
    ep: int = 1  # expert-parallel size; vLLM's EP spans TP x DP, so this is 1 (off) or tp*dp
    dp: int = 1  # data-parallel engine ranks on this node (one process each, vLLM's offline DP)
    max_model_len: int | None = None  # context length cap (None: the model's own)
    gpu_memory_utilization: float = 0.90  # fraction of each GPU's memory vLLM may take
    enforce_eager: bool = False  # no CUDA graphs (faster start, slower decode)
    max_num_seqs: int | None = None  # running-batch cap of the scheduler (None: vLLM's default)
    num_inflight: int = 4096  # requests submitted ahead of completion (keeps the batch full)
    commit_every: int = 1024  # finished requests per committed part
    dtype: str = "auto"  # weight dtype
    load_format: str = "auto"  # "dummy" = random weights of the right shapes (tests, dry runs)
    trust_remote_code: bool = False  # allow model code from the hub
    dp_master_port: int | None = None  # DP rendezvous port (None: a free one)

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "dp", "num_inflight", "commit_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.ep not in (1, self.tp * self.dp):
            raise ConfigError(
                f"ep={self.ep}: vLLM's expert parallelism spans all TP x DP ranks of an engine, so "
                f"--ep must be 1 (off) or tp*dp = {self.tp * self.dp}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.dp

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` for one engine rank (routed-experts capture on)."""
        kw: dict[str, Any] = {
            "tensor_parallel_size": self.tp,
            "enable_expert_parallel": self.ep > 1,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enforce_eager": self.enforce_eager,
            "dtype": self.dtype,
            "load_format": self.load_format,
            "trust_remote_code": self.trust_remote_code,
            "enable_return_routed_experts": True,
        }
        if self.max_model_len is not None:
            kw["max_model_len"] = self.max_model_len
        if self.max_num_seqs is not None:
            kw["max_num_seqs"] = self.max_num_seqs
        return kw


# ---------------------------------------------------------------------------- model and checks


def model_for_vllm(resolved: ResolvedModel) -> tuple[str, ModelInfo]:
    """``(what vLLM loads, ModelInfo)`` of a resolved model name (``presets.resolve``).

    A preset loads its hub id and takes its bundled topology; a local checkpoint or hub id is passed
    to vLLM as it is, its topology read from its HF config (transformers, which fills the
    architecture's defaults; a hub id downloads its ``config.json``). A ``-tiny`` preset is refused:
    it exists only in memory, in the HF backend.
    """
    if resolved.kind == "tiny-preset":
        raise ModelError(
            f"{resolved.name!r} is built in memory by the HF backend; vLLM needs a checkpoint. "
            f"Use --backend hf for {resolved.name!r}, or {resolved.preset.name!r} with --backend vllm"
        )
    hf_config = None if resolved.kind == "preset" else resolved.hf_config()
    return resolved.source, resolved.model_info(hf_config=hf_config)


def vllm_version() -> tuple[str, tuple[int, ...]]:
    """Installed vLLM version string and its leading numbers; raises if vLLM is missing."""
    from moetrace._deps import require

    require("vllm", purpose="the vLLM backend")
    text = importlib.metadata.version("vllm")
    nums = []
    for part in text.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        nums.append(int(digits))
    return text, tuple(nums)


def check_environment(engine: VllmEngineConfig, *, record_weights: bool = False) -> str:
    """Fail early: nothing asked that vLLM cannot record (routing weights), vLLM present and new
    enough to capture, CUDA GPUs present and enough of them.

    Returns the vLLM version string.
    """
    if record_weights:
        raise ConfigError(
            "vLLM's routed-experts capture returns expert ids only, no routing weights; drop "
            "--weights, or use --backend hf"
        )
    text, nums = vllm_version()
    if nums[:2] < MIN_VLLM:
        raise ModelError(
            f"vLLM {text} cannot return routed experts (needs >= {'.'.join(map(str, MIN_VLLM))}, "
            "engine argument enable_return_routed_experts). Upgrade: pip install -U 'vllm>=0.14'"
        )
    import torch

    if not torch.cuda.is_available():
        raise ModelError("no CUDA GPU is visible: the vLLM backend needs GPUs. On a CPU use --backend hf.")
    have = torch.cuda.device_count()
    if engine.num_gpus > have:
        raise ConfigError(f"tp*dp = {engine.num_gpus} GPUs asked, {have} visible (CUDA_VISIBLE_DEVICES)")
    return text


# ---------------------------------------------------------------------------- the run loop


class _Sink:
    """Converts finished outputs and writes them on a thread of its own (off the engine's path).

    The engine loop calls :meth:`put` with raw ``RequestOutput`` lists; conversion, Parquet
    encoding and commits happen here. Errors surface on the next :meth:`put` or at :meth:`close`.
    """

    def __init__(self, writer: Any, *, info: ModelInfo, datasets: dict[int, str], commit_every: int,
                 on_progress: Callable[[int, int], None] | None, prompt_texts: dict[int, str] | None) -> None:
        self.writer, self.info, self.datasets = writer, info, datasets
        self.commit_every, self.on_progress, self.prompt_texts = commit_every, on_progress, prompt_texts
        self.failed: list[tuple[int, str]] = []
        self.truncated: list[int] = []  # request ids whose prompt was cut to fit max_model_len
        self.num_missing_rows = 0
        self._q: queue.Queue = queue.Queue(maxsize=64)
        self._error: BaseException | None = None
        self._since_commit = 0
        self._thread = threading.Thread(target=self._run, name="moetrace-vllm-writer", daemon=True)
        self._thread.start()

    def put(self, item: Any) -> None:
        if self._error is not None:
            raise self._error
        self._q.put(item)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            while (item := self._q.get()) is not None:
                self._write(item)
            self.writer.commit()
            self._progress()
        except BaseException as exc:  # handed to the engine thread by put/close
            self._error = exc
            while self._q.get() is not None:  # drain so the producer never blocks
                pass

    def _write(self, outputs: list[Any]) -> None:
        done: list[ConvertedRequest] = []
        for out in outputs:
            if not isinstance(out, (ConvertedRequest, FailedRequest)):  # raw vLLM output
                out = convert_or_fail(out, info=self.info)
            if isinstance(out, FailedRequest):  # not written: a resumed run retries it
                self.failed.append((out.request_id, out.reason))
            else:
                done.append(out)
        if not done:
            return
        self.num_missing_rows += sum(int((c.topk_ids_TX[: -1] == NO_EXPERT).all(axis=1).sum()) for c in done)
        with_text = self.writer.with_text
        self.writer.add_requests(
            request_id_R=np.array([c.request_id for c in done], dtype=np.int64),
            dataset_R=[self.datasets[c.request_id] for c in done],
            prompt_tokens_R=np.array([c.prompt_tokens for c in done], dtype=np.int32),
            output_tokens_R=np.array([c.output_tokens for c in done], dtype=np.int32),
            topk_ids_TX=np.concatenate([c.topk_ids_TX for c in done]),
            prompt_text_R=[self.prompt_texts[c.request_id] for c in done] if with_text else None,
            output_text_R=[c.output_text for c in done] if with_text else None,
        )
        self._since_commit += len(done)
        if self._since_commit >= self.commit_every:
            self.writer.commit()
            self._since_commit = 0
            self._progress()

    def _progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.writer.num_requests_written, self.writer.num_tokens_written)


def _sampling_params(vllm: Any, *, request_id: int, max_new_tokens: int, temperature: float, seed: int,
                     detokenize: bool) -> Any:
    return vllm.SamplingParams(
        n=1,
        max_tokens=max_new_tokens,
        temperature=temperature,
        seed=None if temperature == 0 else seed * 1_000_003 + request_id,  # per-request, reproducible
        detokenize=detokenize,
    )


def run_engine_loop(llm: Any, work: Iterator[tuple[int, list[int]]], *, vllm: Any, num_inflight: int,
                    max_new_tokens: int, temperature: float, seed: int, detokenize: bool,
                    emit: Callable[[list[Any]], None]) -> None:
    """Keep ``num_inflight`` requests in the engine, hand every finished batch of outputs to ``emit``.

    ``work`` yields ``(request_id, prompt_token_ids)``. Continuous submission (instead of one
    ``generate`` call per batch) keeps the running batch full; ``emit`` must not block for long.
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
            params = _sampling_params(vllm, request_id=rid, max_new_tokens=max_new_tokens,
                                      temperature=temperature, seed=seed, detokenize=detokenize)
            engine.add_request(str(rid), {"prompt_token_ids": ids}, params)
            inflight += 1
        if inflight == 0 and exhausted:
            return
        finished = [o for o in engine.step() if o.finished]
        if finished:
            inflight -= len(finished)
            emit(finished)


def collect_with_vllm(
    prompts: list[Any],
    *,
    writer: Any,
    source: str,
    engine: VllmEngineConfig,
    max_new_tokens: int,
    seed: int,
    temperature: float,
    chat_template: bool,
    on_progress: Callable[[int, int], None] | None = None,
) -> None:
    """Collect ``prompts`` (``PromptRecord``) with vLLM into ``writer`` (a ``TraceWriter``).

    ``source`` is what vLLM loads (:func:`model_for_vllm`); the routing topology is the writer's
    ``model``. Requests already in ``writer.completed_request_ids`` are skipped (resume). With
    ``engine.dp`` > 1 the prompts are split over ``dp`` engine processes (vLLM's offline data
    parallelism, experts sharded over all ranks when ``ep`` > 1), which send converted requests back
    here. ``on_progress(requests, tokens)`` gets, after each commit, what this run has written so far.
    """
    version = check_environment(engine, record_weights=writer.with_weights)
    info = writer.model
    pending = [p for p in prompts if p.request_id not in writer.completed_request_ids]
    import torch

    writer.update_manifest(
        backend={
            "name": "vllm",
            "vllm_version": version,
            "torch_version": torch.__version__,
            "model_source": source,
            "engine": dataclasses.asdict(engine),
            "routed_experts": "vLLM enable_return_routed_experts; final generated position recorded as -1",
        }
    )
    sink = _Sink(
        writer,
        info=info,
        datasets={p.request_id: p.dataset for p in prompts},
        commit_every=engine.commit_every,
        on_progress=on_progress,
        prompt_texts={p.request_id: p.text for p in prompts} if writer.with_text else None,
    )
    try:
        if engine.dp == 1:
            _run_single(pending, sink=sink, source=source, engine=engine, max_new_tokens=max_new_tokens,
                        seed=seed, temperature=temperature, chat_template=chat_template,
                        detokenize=writer.with_text)
        else:
            _run_data_parallel(pending, sink=sink, source=source, info=info, engine=engine,
                               max_new_tokens=max_new_tokens, seed=seed, temperature=temperature,
                               chat_template=chat_template, detokenize=writer.with_text)
    finally:
        sink.close()
    writer.update_manifest(
        vllm_run={
            "num_failed_requests": len(sink.failed),
            "failed_examples": [f"{rid}: {msg}" for rid, msg in sink.failed[:10]],
            "num_tokens_without_routing": sink.num_missing_rows,
            "num_truncated_prompts": len(sink.truncated),
        }
    )
    if sink.truncated:
        warnings.warn(
            f"{len(sink.truncated)} prompt(s) were longer than max_model_len - max_new_tokens and were cut "
            "to fit (their prompt_tokens is the length run); raise --max-model-len to keep them whole",
            stacklevel=2,
        )
    if sink.failed:
        warnings.warn(
            f"{len(sink.failed)} request(s) came back without usable routed experts and were not written "
            f"(first: {sink.failed[0][1]}); re-run with --resume to retry them",
            stacklevel=2,
        )


def _encode_all(prompts: Sequence[Any], tokenizer: Any, *, chat_template: bool, max_prompt: int,
                truncated: list[int]) -> Iterator[tuple[int, list[int]]]:
    """Token ids of each prompt; prompts longer than ``max_prompt`` keep their first ``max_prompt``
    tokens (their ids are appended to ``truncated``; ``prompt_tokens`` is the length actually run)."""
    from moetrace.tracer.datasets import render_prompt_ids

    for p in prompts:
        ids = render_prompt_ids(p, tokenizer, chat_template=chat_template)
        if len(ids) > max_prompt:
            ids = ids[:max_prompt]
            truncated.append(p.request_id)
        yield p.request_id, ids


def _build_llm(source: str, engine: VllmEngineConfig, *, seed: int) -> Any:
    """One engine rank: ``tp`` GPUs, expert parallel when ``ep`` > 1 (DP size comes from the env)."""
    import vllm

    try:
        return vllm.LLM(source, seed=seed, **engine.llm_kwargs())
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ModelError(f"vLLM could not start an engine for {source!r}: {exc}") from exc


def _max_prompt(llm: Any, max_new_tokens: int) -> int:
    max_len = int(llm.llm_engine.model_config.max_model_len)
    if max_len <= max_new_tokens:
        raise ConfigError(f"max_model_len {max_len} leaves no room for a prompt and {max_new_tokens} new tokens")
    return max_len - max_new_tokens


def _run_single(pending: list[Any], *, sink: _Sink, source: str, engine: VllmEngineConfig, max_new_tokens: int,
                seed: int, temperature: float, chat_template: bool, detokenize: bool) -> None:
    import vllm

    if not pending:
        return
    llm = _build_llm(source, engine, seed=seed)
    work = _encode_all(pending, llm.get_tokenizer(), chat_template=chat_template,
                       max_prompt=_max_prompt(llm, max_new_tokens), truncated=sink.truncated)
    run_engine_loop(llm, work, vllm=vllm, num_inflight=engine.num_inflight, max_new_tokens=max_new_tokens,
                    temperature=temperature, seed=seed, detokenize=detokenize, emit=sink.put)


def split_evenly(items: Sequence[Any], num_parts: int) -> list[list[Any]]:
    """``items`` in ``num_parts`` contiguous, near-equal parts (earlier parts get the remainder)."""
    base, rem = divmod(len(items), num_parts)
    out, start = [], 0
    for i in range(num_parts):
        n = base + (i < rem)
        out.append(list(items[start : start + n]))
        start += n
    return out


def _dp_worker(rank: int, dp: int, master_port: int, prompts: list[Any], source: str, info: ModelInfo,
               engine: VllmEngineConfig, max_new_tokens: int, seed: int, temperature: float, chat_template: bool,
               detokenize: bool, results: Any) -> None:
    """One DP engine rank (a process): generate its prompts, send converted requests back."""
    os.environ.update(VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank), VLLM_DP_SIZE=str(dp),
                      VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(master_port))
    try:
        import vllm

        from moetrace.tracer.datasets import PromptRecord

        llm = _build_llm(source, engine, seed=seed)
        # every rank must run a request, even with an empty shard (vLLM's DP ranks step together)
        todo = prompts or [PromptRecord(request_id=-1, dataset="placeholder", text="placeholder")]
        truncated: list[int] = []
        work = _encode_all(todo, llm.get_tokenizer(), chat_template=chat_template,
                           max_prompt=_max_prompt(llm, max_new_tokens), truncated=truncated)

        def emit(outputs: list[Any]) -> None:
            results.put(("rows", rank, [convert_or_fail(o, info=info) for o in outputs if int(o.request_id) >= 0]))

        run_engine_loop(llm, work, vllm=vllm, num_inflight=engine.num_inflight, max_new_tokens=max_new_tokens,
                        temperature=temperature, seed=seed, detokenize=detokenize, emit=emit)
        results.put(("done", rank, truncated))
    except BaseException as exc:
        results.put(("error", rank, f"{type(exc).__name__}: {exc}"))


def _run_data_parallel(pending: list[Any], *, sink: _Sink, source: str, info: ModelInfo, engine: VllmEngineConfig,
                       max_new_tokens: int, seed: int, temperature: float, chat_template: bool,
                       detokenize: bool) -> None:
    import multiprocessing as mp

    if not pending:
        return
    port = engine.dp_master_port or _free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue(maxsize=256)
    procs = [
        ctx.Process(
            target=_dp_worker,
            args=(rank, engine.dp, port, shard, source, info, engine, max_new_tokens, seed, temperature,
                  chat_template, detokenize, results),
            name=f"moetrace-vllm-dp{rank}",
        )
        for rank, shard in enumerate(split_evenly(pending, engine.dp))
    ]
    for p in procs:
        p.start()
    try:
        running = set(range(engine.dp))
        while running:
            kind, rank, payload = results.get()
            if kind == "rows":
                sink.put(payload)
            elif kind == "done":
                sink.truncated.extend(payload)
                running.discard(rank)
            else:
                raise MoetraceError(f"vLLM data-parallel rank {rank} failed: {payload}")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
