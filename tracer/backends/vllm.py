"""vLLM backend: collect traces at serving batch sizes from vLLM's own routed-experts capture.

vLLM ≥ 0.14 records, with the engine argument ``enable_return_routed_experts=True``, the expert ids
every MoE router chose for every token, and hands them back with each finished request;
``vllm_convert`` turns what comes back (its layout differs by version) into trace rows. What each
release range needs and returns is :func:`capture_facts` (read from each release's source; the file
and tag of every fact are in docs/collecting.md):

- 0.14–0.20: any prefix-caching setting; the V1 model runner (Model Runner V2 does not capture).
- 0.21: prefix caching is switched off here (positions served from the prefix cache would come
  back unrecorded); V1 model runner; a preempted request returns no routing (it is not written,
  and ``--resume`` retries it).
- 0.22–0.27: any prefix-caching setting (routing is kept per KV slot, so cached positions carry
  their stored routing); the V1 model runner (vLLM picks it when capture is on and refuses
  ``VLLM_USE_V2_MODEL_RUNNER=1``).
- 0.28–0.30: either model runner, any prefix-caching setting.
- ≥ 0.31 (checked through 0.33): Model Runner V2 and prefix caching are required (vLLM's
  AuxOutput connector); moetrace passes ``enable_prefix_caching=True``.

The parent process never initialises CUDA (GPUs are counted through NVML with
``torch.cuda.device_count()``), and vLLM's worker processes are started with ``spawn`` unless the
user chose otherwise (``VLLM_WORKER_MULTIPROC_METHOD``). Any failure of the engine's start becomes
one ``ModelError`` line naming its cause (:func:`engine_start_error`).

The backend itself is :class:`VllmBackend` (the ``backends.base.CollectionBackend`` protocol); its
manifest ``backend`` section is ``{"name": "vllm", "versions": {"vllm", "torch"}, "model_source",
"engine", "capture", "routed_experts"}``.

Out of scope: what a model name means (``presets.resolve``), the array conversion (``vllm_convert``),
prompt loading (``datasets``), choosing the backend (``registry``), opening the trace (``collect``),
several engines over several nodes (``sharding``).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from moetrace._deps import require
from moetrace.errors import ConfigError, ModelError, MoetraceError
from moetrace.tracer.backends.base import BackendDescription, GenerationConfig, OnProgress
from moetrace.tracer.backends.vllm_convert import ConvertedRequest, FailedRequest, LayerAxis, convert_or_fail
from moetrace.tracer.trace.schema import NO_EXPERT, ModelInfo

if TYPE_CHECKING:  # pragma: no cover
    from moetrace.tracer.datasets import PromptRecord
    from moetrace.tracer.presets import ResolvedModel
    from moetrace.tracer.trace.writer import TraceWriter

T = TypeVar("T")

#: first vLLM release with ``enable_return_routed_experts`` (``ModelConfig`` field and
#: ``CompletionOutput.routed_experts`` are in 0.14.0's source and in neither of 0.13.0's)
MIN_VLLM = (0, 14)

#: vLLM's switch between its V1 and V2 model runners (read as an integer, 0 or 1, by vLLM)
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
#: how vLLM starts its engine and worker processes (``fork`` by default in vLLM)
MULTIPROC_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


@dataclass(frozen=True, kw_only=True)
class CaptureFacts:
    """What one range of vLLM releases needs for, and returns from, the routed-experts capture."""

    releases: str  # the release range these facts hold for, e.g. "0.22-0.27"
    layer_axis: LayerAxis  # how the returned layer axis is indexed (vllm_convert.routed_experts_to_rows)
    enable_prefix_caching: bool | None  # what moetrace passes to vllm.LLM (None: vLLM's own default)
    model_runner_v2: bool | None  # True: capture needs Model Runner V2; False: needs V1; None: either


def capture_facts(version: tuple[int, ...]) -> CaptureFacts:
    """The routed-experts capture facts of vLLM ``version`` (leading numbers, e.g. ``(0, 22, 1)``).

    Raises ``ModelError`` for releases before :data:`MIN_VLLM`. Releases after the newest one read
    (0.33) are taken to behave like it.
    """
    v = tuple(version[:2])
    if v < MIN_VLLM:
        raise ModelError(
            f"vLLM {'.'.join(map(str, version))} cannot return routed experts (needs >= "
            f"{'.'.join(map(str, MIN_VLLM))}, engine argument enable_return_routed_experts). "
            "Upgrade: pip install -U 'vllm>=0.14'"
        )
    if v <= (0, 20):
        return CaptureFacts(
            releases="0.14-0.20", layer_axis="decoder", enable_prefix_caching=None, model_runner_v2=False
        )
    if v == (0, 21):  # cached positions are never written into 0.21's per-request host cache
        return CaptureFacts(releases="0.21", layer_axis="moe", enable_prefix_caching=False, model_runner_v2=False)
    if v <= (0, 27):
        return CaptureFacts(
            releases="0.22-0.27", layer_axis="decoder", enable_prefix_caching=None, model_runner_v2=False
        )
    if v <= (0, 30):
        return CaptureFacts(
            releases="0.28-0.30", layer_axis="decoder", enable_prefix_caching=None, model_runner_v2=None
        )
    return CaptureFacts(releases=">=0.31", layer_axis="decoder", enable_prefix_caching=True, model_runner_v2=True)


def capture_env_problem(facts: CaptureFacts, environ: Mapping[str, str]) -> str | None:
    """Why the environment ``environ`` keeps vLLM (of ``facts``) from capturing, or None.

    Checks ``VLLM_USE_V2_MODEL_RUNNER`` against the model runner the capture needs.
    """
    raw = environ.get(V2_RUNNER_ENV)
    if raw is None or facts.model_runner_v2 is None:
        return None
    try:
        v2 = bool(int(raw))
    except ValueError:
        return f"{V2_RUNNER_ENV}={raw!r}: vLLM reads it as 0 or 1"
    if v2 and facts.model_runner_v2 is False:
        return (
            f"vLLM {facts.releases} captures routed experts only with the V1 model runner; unset "
            f"{V2_RUNNER_ENV} (it is {raw!r})"
        )
    if not v2 and facts.model_runner_v2 is True:
        return (
            f"vLLM {facts.releases} captures routed experts only with Model Runner V2; unset "
            f"{V2_RUNNER_ENV} (it is {raw!r})"
        )
    return None


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

    def llm_kwargs(self, *, capture: CaptureFacts) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` for one engine rank (routed-experts capture on), for the
        vLLM release range of ``capture`` (:func:`capture_facts`)."""
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
        if capture.enable_prefix_caching is not None:
            kw["enable_prefix_caching"] = capture.enable_prefix_caching
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
        assert resolved.preset is not None  # set for every preset name
        raise ModelError(
            f"{resolved.name!r} is built in memory by the HF backend; vLLM needs a checkpoint. "
            f"Use --backend hf for {resolved.name!r}, or {resolved.preset.name!r} with --backend vllm"
        )
    hf_config = None if resolved.kind == "preset" else resolved.hf_config()
    return resolved.source, resolved.model_info(hf_config=hf_config)


def parse_vllm_version(text: str) -> tuple[int, ...]:
    """The leading release numbers of a vLLM version string (``"0.22.1+cu130"`` -> ``(0, 22, 1)``)."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise ModelError(f"cannot read the vLLM version {text!r} (expected e.g. 0.22.1)")
    return tuple(int(g) for g in m.groups() if g is not None)


def vllm_version() -> tuple[str, tuple[int, ...]]:
    """Installed vLLM version string (the module's ``__version__``) and its leading numbers;
    raises if vLLM is missing."""
    vllm = require("vllm", purpose="the vLLM backend")
    text = getattr(vllm, "__version__", None)
    if not isinstance(text, str):
        raise ModelError("the installed `vllm` module has no __version__; reinstall it: pip install -U 'vllm>=0.14'")
    return text, parse_vllm_version(text)


def visible_gpu_count() -> int:
    """CUDA GPUs this process may use (``CUDA_VISIBLE_DEVICES`` applied), counted without
    initialising CUDA here: ``torch.cuda.device_count()`` asks NVML, and only where NVML fails does
    torch fall back to the CUDA runtime (which initialises the driver; harmless with ``spawn``
    workers). ``torch.cuda.is_available()`` is not used: by default it initialises the driver."""
    import torch

    return int(torch.cuda.device_count())


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


#: the start of the message vLLM's front end raises when its engine process died while starting
ENGINE_CORE_FAILED = "Engine core initialization failed"


def engine_start_error(source: str, exc: BaseException) -> str:
    """One line naming why vLLM could not start an engine for ``source``: the exception's type and
    message, and for vLLM's generic engine-core failure (whose cause the engine process logged
    above) or a GPU out-of-memory error, where to look and the usual causes."""
    msg = " ".join(str(exc).split()) or "(no message)"
    if len(msg) > 800:
        msg = msg[:800] + " ..."
    line = f"vLLM could not start an engine for {source!r}: {type(exc).__name__}: {msg}"
    if ENGINE_CORE_FAILED in msg:
        line += (
            ". The engine process's own error is in the log above. Usual causes: no attention backend "
            "for the model's head dimensions, not enough GPU memory for the weights and KV cache (raise "
            "--gpu-memory-utilization, lower --max-model-len, or add GPUs with --tp), --max-model-len above "
            "what the model or the memory allows"
        )
    elif "out of memory" in msg.lower():
        line += (
            ". Not enough GPU memory: raise --gpu-memory-utilization, lower --max-model-len, or spread "
            "the model over more GPUs (--tp)"
        )
    return line


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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
