"""vLLM backend: collect traces at serving batch sizes from vLLM's own routed-experts capture.

vLLM ≥ 0.14 records, with the engine argument ``enable_return_routed_experts=True``, the expert ids
every MoE router chose for every token, and hands them back with each finished request;
``vllm_convert`` turns what comes back (its layout differs by version) into trace rows. What each
release range needs and returns is :func:`capture_facts` (``vllm_env``, which lists the ranges).

The parent process never initialises CUDA (GPUs are counted through NVML with
``torch.cuda.device_count()``), and vLLM's worker processes are started with ``spawn`` unless the
user chose otherwise (``VLLM_WORKER_MULTIPROC_METHOD``). Any failure of the engine's start becomes
one ``ModelError`` line naming its cause (:func:`engine_start_error`).

The backend itself is :class:`VllmBackend` (the ``backends.base.CollectionBackend`` protocol); its
manifest ``backend`` section is ``{"name": "vllm", "versions": {"vllm", "torch"}, "model_source",
"engine", "capture", "routed_experts"}``. This module holds it, :func:`check_environment` (the one
look at vLLM's version and the GPUs) and the parent's side of a run (:func:`collect_with_vllm`: the
writer thread ``_Sink``, one engine rank in this process or ``dp`` rank processes). Its parts live
beside it, and every name other modules import is re-exported here: the capture facts, engine
settings, version and GPU count (``vllm_env``), one engine rank and a data-parallel rank's process
(``vllm_engine``).

Out of scope: what a model name means (``presets.resolve``), the array conversion (``vllm_convert``),
prompt loading (``datasets``), choosing the backend (``registry``), opening the trace (``collect``),
several engines over several nodes (``sharding``).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from moetrace._deps import require
from moetrace.errors import ConfigError, ModelError, MoetraceError
from moetrace.tracer.backends.base import BackendDescription, GenerationConfig, OnProgress
from moetrace.tracer.backends.vllm_convert import ConvertedRequest, FailedRequest, LayerAxis, convert_or_fail
from moetrace.tracer.backends.vllm_engine import (
    _build_llm,
    _dp_worker,
    _encode_all,
    _free_port,
    _max_prompt,
    run_engine_loop,
    split_evenly,
)
from moetrace.tracer.backends.vllm_engine import _sampling_params as _sampling_params  # re-exported
from moetrace.tracer.backends.vllm_env import ENGINE_CORE_FAILED as ENGINE_CORE_FAILED  # re-exported
from moetrace.tracer.backends.vllm_env import MIN_VLLM as MIN_VLLM  # re-exported
from moetrace.tracer.backends.vllm_env import MULTIPROC_ENV as MULTIPROC_ENV  # re-exported
from moetrace.tracer.backends.vllm_env import V2_RUNNER_ENV as V2_RUNNER_ENV  # re-exported
from moetrace.tracer.backends.vllm_env import (
    CaptureFacts,
    VllmEngineConfig,
    capture_env_problem,
    capture_facts,
    model_for_vllm,
    visible_gpu_count,
    vllm_version,
)
from moetrace.tracer.backends.vllm_env import engine_start_error as engine_start_error  # re-exported
from moetrace.tracer.backends.vllm_env import parse_vllm_version as parse_vllm_version  # re-exported
from moetrace.tracer.trace.schema import NO_EXPERT, ModelInfo

if TYPE_CHECKING:  # pragma: no cover
    from moetrace.tracer.datasets import PromptRecord
    from moetrace.tracer.presets import ResolvedModel
    from moetrace.tracer.trace.writer import TraceWriter


# ---------------------------------------------------------------------------- the check
# here, not in vllm_env: it calls vllm_version and visible_gpu_count through this module's names


def check_environment(engine: VllmEngineConfig, *, record_weights: bool = False) -> tuple[str, CaptureFacts]:
    """Fail early: nothing asked that vLLM cannot record (routing weights), vLLM present and new
    enough to capture, its model-runner switch compatible with the capture, CUDA GPUs present and
    enough of them. Initialises no CUDA in this process.

    Returns the vLLM version string and the capture facts of that release.
    """
    if record_weights:
        raise ConfigError(
            "vLLM's routed-experts capture returns expert ids only, no routing weights; drop "
            "--weights, or use --backend hf"
        )
    text, nums = vllm_version()
    facts = capture_facts(nums)
    problem = capture_env_problem(facts, os.environ)
    if problem is not None:
        raise ConfigError(problem)
    have = visible_gpu_count()
    if have == 0:
        raise ModelError("no CUDA GPU is visible: the vLLM backend needs GPUs. On a CPU use --backend hf.")
    if engine.num_gpus > have:
        raise ConfigError(f"tp*dp = {engine.num_gpus} GPUs asked, {have} visible (CUDA_VISIBLE_DEVICES)")
    return text, facts


# ---------------------------------------------------------------------------- the backend


#: what the manifest says about the rows vLLM returns
ROUTED_EXPERTS_NOTE = "vLLM enable_return_routed_experts; final generated position recorded as -1"


@dataclass
class VllmBackend:
    """The vLLM backend behind the collection seam (``backends.base.CollectionBackend``).

    One object per run, built by its row in ``backends.registry``; ``collect`` calls
    :meth:`check_environment` (the one check of vLLM's version, environment and GPUs), :meth:`load`,
    :meth:`describe` and :meth:`run` in that order.
    """

    engine: VllmEngineConfig  # the engine settings, passed through to vllm.LLM
    _versions: dict[str, str] = field(default_factory=dict, init=False, repr=False)  # vllm and torch, once checked
    _capture: CaptureFacts | None = field(default=None, init=False, repr=False)  # the release's capture facts
    _source: str | None = field(default=None, init=False, repr=False)  # what vLLM loads, once loaded

    def check_environment(self, generation: GenerationConfig) -> None:
        """:func:`check_environment`: routing weights refused, vLLM >= 0.14 and its model-runner switch,
        enough visible GPUs. Initialises no CUDA in this process."""
        version, self._capture = check_environment(self.engine, record_weights=generation.record_weights)
        torch = require("torch", purpose="the vLLM backend")
        self._versions = {"vllm": version, "torch": torch.__version__}

    def load(self, resolved: ResolvedModel, generation: GenerationConfig) -> ModelInfo:
        """What vLLM will load and its topology (:func:`model_for_vllm`); the engine starts in :meth:`run`."""
        self._source, info = model_for_vllm(resolved)
        return info

    def describe(self) -> BackendDescription:
        source, capture = self._ready()
        return BackendDescription(
            versions=self._versions,
            settings={
                "model_source": source,
                "engine": dataclasses.asdict(self.engine),
                "capture": dataclasses.asdict(capture),
                "routed_experts": ROUTED_EXPERTS_NOTE,
            },
        )

    def run(
        self,
        prompts: Sequence[PromptRecord],
        *,
        writer: TraceWriter,
        generation: GenerationConfig,
        on_progress: OnProgress | None = None,
    ) -> None:
        """:func:`collect_with_vllm` with what :meth:`check_environment` and :meth:`load` found."""
        source, capture = self._ready()
        collect_with_vllm(
            prompts,
            writer=writer,
            source=source,
            engine=self.engine,
            capture=capture,
            generation=generation,
            on_progress=on_progress,
        )

    def _ready(self) -> tuple[str, CaptureFacts]:
        if self._source is None or self._capture is None:
            raise RuntimeError("VllmBackend: call check_environment and load first")
        return self._source, self._capture


# ---------------------------------------------------------------------------- the run loop


class _Sink:
    """Converts finished outputs and writes them on a thread of its own (off the engine's path).

    The engine loop calls :meth:`put` with raw ``RequestOutput`` lists; conversion, Parquet
    encoding and commits happen here. Errors surface on the next :meth:`put` or at :meth:`close`.
    """

    def __init__(
        self,
        writer: TraceWriter,
        *,
        info: ModelInfo,
        datasets: dict[int, str],
        commit_every: int,
        on_progress: Callable[[int, int], None] | None,
        prompt_texts: dict[int, str] | None,
        layer_axis: LayerAxis = "decoder",
    ) -> None:
        self.writer, self.info, self.datasets, self.layer_axis = writer, info, datasets, layer_axis
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
                out = convert_or_fail(out, info=self.info, layer_axis=self.layer_axis)
            if isinstance(out, FailedRequest):  # not written: a resumed run retries it
                self.failed.append((out.request_id, out.reason))
            else:
                done.append(out)
        if not done:
            return
        self.num_missing_rows += sum(int((c.topk_ids_TX[:-1] == NO_EXPERT).all(axis=1).sum()) for c in done)
        texts = self.prompt_texts if self.writer.with_text else None  # given exactly when the writer keeps text
        self.writer.add_requests(
            request_id_R=np.array([c.request_id for c in done], dtype=np.int64),
            dataset_R=[self.datasets[c.request_id] for c in done],
            prompt_tokens_R=np.array([c.prompt_tokens for c in done], dtype=np.int32),
            output_tokens_R=np.array([c.output_tokens for c in done], dtype=np.int32),
            topk_ids_TX=np.concatenate([c.topk_ids_TX for c in done]),
            prompt_text_R=[texts[c.request_id] for c in done] if texts is not None else None,
            output_text_R=[c.output_text for c in done] if texts is not None else None,
        )
        self._since_commit += len(done)
        if self._since_commit >= self.commit_every:
            self.writer.commit()
            self._since_commit = 0
            self._progress()

    def _progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.writer.num_requests_written, self.writer.num_tokens_written)


def collect_with_vllm(
    prompts: Sequence[PromptRecord],
    *,
    writer: TraceWriter,
    source: str,
    engine: VllmEngineConfig,
    capture: CaptureFacts,
    generation: GenerationConfig,
    on_progress: OnProgress | None = None,
) -> None:
    """Collect ``prompts`` with vLLM into ``writer``: the engine loop of :class:`VllmBackend`.

    ``source`` is what vLLM loads (:func:`model_for_vllm`); the routing topology is the writer's
    ``model``; ``capture`` the facts of the installed release (:func:`check_environment`, run once
    before). Requests already in ``writer.completed_request_ids`` are skipped (resume). With
    ``engine.dp`` > 1 the prompts are split over ``dp`` engine processes (vLLM's offline data
    parallelism, experts sharded over all ranks when ``ep`` > 1), which send converted requests back
    here. ``on_progress(requests, tokens)`` gets, after each commit, what this run has written so far.
    The manifest's ``vllm_run`` section records failed and truncated requests.
    """
    info = writer.model
    pending = [p for p in prompts if p.request_id not in writer.completed_request_ids]
    sink = _Sink(
        writer,
        info=info,
        datasets={p.request_id: p.dataset for p in prompts},
        commit_every=engine.commit_every,
        on_progress=on_progress,
        prompt_texts={p.request_id: p.text for p in prompts} if writer.with_text else None,
        layer_axis=capture.layer_axis,
    )
    try:
        if engine.dp == 1:
            _run_single(pending, sink=sink, source=source, engine=engine, capture=capture, generation=generation)
        else:
            _run_data_parallel(
                pending, sink=sink, source=source, info=info, engine=engine, capture=capture, generation=generation
            )
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


def _run_single(
    pending: list[PromptRecord],
    *,
    sink: _Sink,
    source: str,
    engine: VllmEngineConfig,
    capture: CaptureFacts,
    generation: GenerationConfig,
) -> None:
    import vllm

    if not pending:
        return
    llm = _build_llm(source, engine, capture=capture, seed=generation.seed)
    work = _encode_all(
        pending,
        llm.get_tokenizer(),
        chat_template=generation.chat_template,
        max_prompt=_max_prompt(llm, generation.max_new_tokens),
        truncated=sink.truncated,
    )
    run_engine_loop(llm, work, vllm=vllm, num_inflight=engine.num_inflight, generation=generation, emit=sink.put)


def _run_data_parallel(
    pending: list[PromptRecord],
    *,
    sink: _Sink,
    source: str,
    info: ModelInfo,
    engine: VllmEngineConfig,
    capture: CaptureFacts,
    generation: GenerationConfig,
) -> None:
    import multiprocessing as mp

    if not pending:
        return
    port = engine.dp_master_port or _free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue(maxsize=256)
    procs = [
        ctx.Process(
            target=_dp_worker,
            args=(rank, engine.dp, port, shard, source, info, engine, capture, generation, results),
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
