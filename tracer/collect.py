"""``collect``: prompts → model → trace directory, resumable.

Picks the backend (HF transformers on CPU/GPU, vLLM on GPUs), loads the prompts deterministically
(request ids are stable across re-runs, so a resumed run skips exactly the committed requests),
opens the one ``TraceWriter`` and finalizes the manifest.

Out of scope: how a backend records routing (``backends.hf``, ``backends.vllm``), prompt sources
(``datasets``), sharding over several engines (``sharding``).
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from moetrace.errors import ConfigError, ModelError
from moetrace.tracer.trace.layout import shard_manifest_name, shard_prefix
from moetrace.tracer.trace.writer import OnExisting, TraceWriter, WriterStats

Backend = Literal["auto", "hf", "vllm"]


@dataclass(frozen=True, kw_only=True)
class CollectConfig:
    """What to collect; recorded in the manifest's ``collection`` section."""

    model: str  # preset (e.g. deepseek-v3-tiny), local checkpoint directory or hub id
    datasets: tuple[str, ...]  # prompt sources: bundled set names, hub dataset names, local files
    per_dataset: int | None = None  # requests per dataset (equal representation)
    num_requests: int | None = None  # total requests, split evenly over datasets
    prompt_field: str | None = None  # field holding the prompt in local files
    max_new_tokens: int = 64  # generated tokens per request at most
    batch_size: int = 8  # requests per generation batch (HF backend)
    seed: int = 0  # sampling of prompts and, with temperature > 0, of tokens
    temperature: float = 0.0  # 0 = greedy
    chat_template: bool = True  # apply the tokenizer's chat template when it has one
    store_text: bool = False  # keep prompt and output text in the trace (privacy: off by default)
    record_weights: bool = False  # also store routing weights
    device: str = "cpu"  # torch device of the HF backend
    dtype: str = "auto"  # torch dtype of the HF backend (tiny models run in float32)

    def __post_init__(self) -> None:  # checked before anything is loaded or written
        for name in ("max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")

    def manifest_section(self) -> dict[str, Any]:
        d = asdict(self)
        d["datasets"] = list(self.datasets)
        d["sampling"] = {"temperature": self.temperature, "greedy": self.temperature == 0}
        return d


@dataclass(frozen=True)
class CollectResult:
    path: Path
    backend: str
    stats: WriterStats
    num_new_requests: int
    num_new_tokens: int
    seconds: float


def shard_prompts(prompts: Sequence[Any], *, shard: int, num_shards: int) -> list[Any]:
    """The prompts of shard ``shard`` of ``num_shards``: every ``num_shards``-th, starting at ``shard``."""
    if not 0 <= shard < num_shards:
        raise ConfigError(f"shard {shard} is outside 0..{num_shards - 1}")
    return list(prompts[shard::num_shards])


def resolve_backend(backend: Backend, *, device: str) -> Literal["hf", "vllm"]:
    """``auto`` picks vLLM when it is importable and CUDA is present, else HF transformers."""
    if backend != "auto":
        return backend
    if importlib.util.find_spec("vllm") is not None and device != "cpu":
        import torch

        if torch.cuda.is_available():
            return "vllm"
    return "hf"


def collect(
    config: CollectConfig,
    *,
    out: str | os.PathLike,
    backend: Backend = "auto",
    on_existing: OnExisting = "refuse",
    engine: Any = None,
    shard: tuple[int, int] | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> CollectResult:
    """Collect a trace into ``out``.

    ``shard=(s, n)`` collects only shard ``s`` of ``n`` of the run's prompts (request ids
    ``s, s+n, ...``) into ``shardSSS-*`` parts with its own ``manifests/shard-SSS.json``; see
    ``moetrace.tracer.sharding`` for running the shards and merging them.

    ``on_start(num_pending, num_total)`` is called once the prompts are known,
    ``on_progress(requests, tokens)`` after every committed batch. ``engine`` is the vLLM engine
    configuration (``moetrace.tracer.backends.vllm.VllmEngineConfig``) for the vLLM backend.
    """
    from moetrace.tracer.datasets import load_prompts

    chosen = resolve_backend(backend, device=config.device)
    prompts = load_prompts(
        list(config.datasets),
        per_dataset=config.per_dataset,
        num_requests=config.num_requests,
        seed=config.seed,
        prompt_field=config.prompt_field,
    )
    if not prompts:
        raise ModelError("no prompts to collect: check --dataset, --per-dataset and --num-requests")
    collection = config.manifest_section()
    writer_kw: dict[str, Any] = {}
    if shard is not None:
        s, n = shard
        collection.update(shard=s, num_shards=n, num_requests_in_run=len(prompts))
        prompts = shard_prompts(prompts, shard=s, num_shards=n)
        writer_kw = {"part_prefix": shard_prefix(s), "manifest_name": shard_manifest_name(s)}
    t0 = time.perf_counter()
    if chosen == "hf":
        from moetrace.tracer.backends import hf

        model, tokenizer, info = hf.load_model(config.model, seed=config.seed, device=config.device, dtype=config.dtype)
        backend_section = hf.backend_versions()
        backend_section["device"] = config.device
    else:
        from moetrace.tracer.backends import vllm as vllm_backend

        if engine is None:
            engine = vllm_backend.VllmEngineConfig()
        version = vllm_backend.check_environment(engine)  # fail before anything is written
        info = vllm_backend.model_info_for_vllm(config.model)
        backend_section = {"name": "vllm", "vllm": version}

    with TraceWriter(
        out,
        model=info,
        backend=backend_section,
        collection=collection,
        on_existing=on_existing,
        with_weights=config.record_weights,
        with_text=config.store_text,
        **writer_kw,
    ) as writer:
        pending = sum(p.request_id not in writer.completed_request_ids for p in prompts)
        if on_start is not None:
            on_start(pending, len(prompts))
        if chosen == "hf":
            hf.collect_with_hf(
                prompts,
                writer=writer,
                model=model,
                tokenizer=tokenizer,
                info=info,
                max_new_tokens=config.max_new_tokens,
                batch_size=config.batch_size,
                temperature=config.temperature,
                seed=config.seed,
                chat_template=config.chat_template,
                store_text=config.store_text,
                record_weights=config.record_weights,
                on_progress=on_progress,
            )
        else:
            vllm_backend.collect_with_vllm(
                prompts,
                writer=writer,
                model=config.model,
                engine=engine,
                max_new_tokens=config.max_new_tokens,
                seed=config.seed,
                temperature=config.temperature,
                chat_template=config.chat_template,
                on_progress=on_progress,
            )
    # the writer counts what this run added; stats() also covers what a resumed run had before
    return CollectResult(Path(out), chosen, writer.stats(), writer.num_requests_written, writer.num_tokens_written,
                         time.perf_counter() - t0)
