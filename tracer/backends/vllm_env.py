"""vLLM's environment for the routed-experts capture: what each release needs and returns, the engine settings.

vLLM ≥ 0.14 records, with the engine argument ``enable_return_routed_experts=True``, the expert ids
every MoE router chose for every token. What each release range needs and returns is
:func:`capture_facts` (read from each release's source; the file and tag of every fact are in
docs/collecting.md):

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

This module holds those facts (:class:`CaptureFacts`, :func:`capture_facts`,
:func:`capture_env_problem`), the engine settings (:class:`VllmEngineConfig`), what vLLM loads for a
model name (:func:`model_for_vllm`), the installed version (:func:`vllm_version`), the GPUs counted
without initialising CUDA (:func:`visible_gpu_count`) and the one line an engine's failed start
becomes (:func:`engine_start_error`). ``backends.vllm`` re-exports every name.

Out of scope: the one check that runs these before a collection (``vllm.check_environment``, beside
the backend), starting and running an engine rank (``vllm_engine``), the run itself (``vllm``),
the array conversion (``vllm_convert``), what a model name means (``presets.resolve``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetrace._deps import require
from moetrace.errors import ConfigError, ModelError
from moetrace.tracer.backends.vllm_convert import LayerAxis
from moetrace.tracer.trace.schema import ModelInfo

if TYPE_CHECKING:  # pragma: no cover
    from moetrace.tracer.presets import ResolvedModel

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
