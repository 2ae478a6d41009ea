"""``collect``: prompts → model → trace directory, resumable.

Builds the backend a run was given through its row in ``backends.registry`` and drives it through
the ``backends.base.CollectionBackend`` protocol only (check the environment, load the model,
describe it for the manifest, run the engine loop on one ``GenerationConfig``): no backend is
named here. It loads the prompts deterministically (request ids are stable across re-runs, so a
resumed run skips exactly the committed requests), opens the one ``TraceWriter``, finalizes the
manifest and says what was done (:meth:`CollectResult.summary_lines`). ``moetrace collect`` calls
``sharding.run_collection``, which picks the backend once (``registry.choose_backend``) and runs
:func:`collect` here or its shards on Ray.

Out of scope: which backends exist and which ``auto`` picks (``backends.registry``), how a backend
records routing (``backends.hf``, ``backends.vllm``), what a model name means
(``presets.resolve``), prompt sources (``datasets``), running several shards and merging them
(``sharding``), progress bars and printing (``moetrace.cli``).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from moetrace import lifetime
from moetrace.errors import ConfigError, ModelError, TraceBusyError
from moetrace.sizes import human_bytes
from moetrace.tracer.backends.base import GenerationConfig, OnProgress
from moetrace.tracer.backends.registry import BackendSettings, get_backend
from moetrace.tracer.trace.layout import REQUESTS_DIR, shard_manifest_name, shard_prefix
from moetrace.tracer.trace.lock import probe_lock
from moetrace.tracer.trace.writer import OnExisting, TraceWriter, WriterStats

if TYPE_CHECKING:  # pragma: no cover
    from moetrace.tracer.backends.vllm import VllmEngineConfig

T = TypeVar("T")

#: ``on_start(num_pending, num_total)``: requests still to run, and in this run (or shard)
OnStart = Callable[[int, int], None]


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
        _ = self.generation  # GenerationConfig refuses bad generation settings

    @property
    def generation(self) -> GenerationConfig:
        """The generation settings every backend runs with (one object, not loose keywords)."""
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            seed=self.seed,
            chat_template=self.chat_template,
            batch_size=self.batch_size,
            store_text=self.store_text,
            record_weights=self.record_weights,
        )

    def backend_settings(self, engine: VllmEngineConfig | None = None) -> BackendSettings:
        """What a backend is built from (``backends.registry``): this run's device and dtype, and ``engine``."""
        return BackendSettings(device=self.device, dtype=self.dtype, engine=engine)

    def manifest_section(self) -> dict[str, Any]:
        d = asdict(self)
        d["datasets"] = list(self.datasets)
        d["sampling"] = {"temperature": self.temperature, "greedy": self.temperature == 0}
        return d


@dataclass(frozen=True, kw_only=True)
class CollectResult:
    """What one collection did: a whole run, one shard of it, or all shards on Ray (merged)."""

    path: Path  # the trace directory
    model: str  # the model name as given
    backend: str  # the backend that ran (its name in backends.registry)
    stats: WriterStats  # what the trace holds now, earlier (resumed) runs included; one shard's files only for a shard
    num_new_requests: int  # requests this run added
    num_new_tokens: int  # tokens this run added
    seconds: float  # wall time from loading the model to the last commit, s
    shard: tuple[int, int] | None = None  # (s, n): only shard s of n was collected; merge-shards once all are done
    num_merged_shards: int = 0  # shards run on Ray and merged into manifest.json (0: no Ray run)

    def summary_lines(self) -> list[str]:
        """What ``moetrace collect`` prints: the run, what the trace holds, what to run next (plain text)."""
        s, out = self.stats, self.path
        rate = self.num_new_tokens / self.seconds if self.seconds > 0 else 0.0
        head = f"collected {out}" + (f" in {self.num_merged_shards} shards (merged)" if self.num_merged_shards else "")
        lines = [head]
        if self.shard is not None:
            lines.append(
                f"  shard {self.shard[0]}/{self.shard[1]}: when every shard is done, run: moetrace merge-shards {out}"
            )
        holds = "this shard" if self.shard is not None else "trace"
        lines += [
            f"  backend {self.backend}, model {self.model}",
            f"  {self.num_new_requests} new requests, {self.num_new_tokens} tokens in {self.seconds:.1f}s "
            f"({rate:,.0f} tokens/s)",
            f"  {holds}: {s.num_requests} requests, {s.num_tokens} tokens, {s.num_parts} parts, "
            f"{human_bytes(s.bytes_on_disk)}",
            f"  next: moetrace validate {out}   |   moetrace analyze {out} -o {analysis_dir(Path(out))}",
        ]
        return lines


def parse_shard(text: str) -> tuple[int, int]:
    """``"S/N"`` (e.g. ``"3/8"``, the ``--shard`` option) → ``(3, 8)``: shard S of N, ``0 <= S < N``.

    Raises ``ConfigError`` for anything else.
    """
    try:
        s, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConfigError(f"--shard must look like S/N (e.g. 3/8), got {text!r}") from None
    if not 0 <= s < n:
        raise ConfigError(f"--shard {text}: S must be in 0..N-1")
    return s, n


def shard_prompts(prompts: Sequence[T], *, shard: int, num_shards: int) -> list[T]:
    """The prompts of shard ``shard`` of ``num_shards``: every ``num_shards``-th, starting at ``shard``."""
    if not 0 <= shard < num_shards:
        raise ConfigError(f"shard {shard} is outside 0..{num_shards - 1}")
    return list(prompts[shard::num_shards])


def writer_committed_nothing(out: str | os.PathLike) -> bool:
    """True when the trace directory ``out`` holds no committed part (nothing a user would lose)."""
    return not any((Path(out) / REQUESTS_DIR).glob("*.parquet"))


def collect(
    config: CollectConfig,
    *,
    out: str | os.PathLike,
    backend: str,
    engine: VllmEngineConfig | None = None,
    on_existing: OnExisting = "refuse",
    shard: tuple[int, int] | None = None,
    on_start: OnStart | None = None,
    on_progress: OnProgress | None = None,
) -> CollectResult:
    """Collect a trace into ``out`` with ``backend``, a name in ``backends.registry`` (``auto`` is
    decided before, by ``registry.choose_backend``).

    ``shard=(s, n)`` collects only shard ``s`` of ``n`` of the run's prompts (request ids
    ``s, s+n, ...``) into ``shardSSS-*`` parts with its own ``manifests/shard-SSS.json``; see
    ``moetrace.tracer.sharding`` for running the shards and merging them.

    ``on_start(num_pending, num_total)`` is called once the model and prompts are loaded,
    ``on_progress(requests, tokens)`` after every commit with what this run has written so far.
    ``engine`` is the vLLM engine configuration (default ``VllmEngineConfig()``), unused by other
    backends. Everything that can be refused (settings, model, the backend's environment: packages,
    GPUs) is checked before anything is written; the backend's environment is checked once.
    """
    from moetrace.tracer.datasets import load_prompts
    from moetrace.tracer.presets import resolve

    entry = get_backend(backend)
    generation = config.generation
    resolved = resolve(config.model)  # an unknown name fails before any prompt is loaded
    runner = entry.build(config.backend_settings(engine))
    runner.check_environment(generation)
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
    probe_lock(out, shared=shard is not None)  # a trace being written is refused before the model loads
    # the engine's processes (vLLM's, its data-parallel ranks) die with this one, even by SIGKILL
    with lifetime.guard():
        t0 = time.perf_counter()
        info = runner.load(resolved, generation)
        backend_section = runner.describe().manifest_section(entry.name)

        fresh = shard is None and not Path(out).exists()
        try:
            with TraceWriter(
                out,
                model=info,
                backend=backend_section,
                collection=collection,
                on_existing=on_existing,
                with_weights=generation.record_weights,
                with_text=generation.store_text,
                **writer_kw,
            ) as writer:
                writer.update_manifest(backend=backend_section)  # a resumed trace records what ran last
                pending = sum(p.request_id not in writer.completed_request_ids for p in prompts)
                if on_start is not None:
                    on_start(pending, len(prompts))
                runner.run(prompts, writer=writer, generation=generation, on_progress=on_progress)
        except TraceBusyError:
            raise  # refused in a lock race: the directory is the other writer's, never ours to remove
        except BaseException:
            # a run that created the directory and committed nothing (the engine did not start, the
            # model did not load, Ctrl-C at once) leaves nothing behind that would need --overwrite
            if fresh and writer_committed_nothing(out):
                shutil.rmtree(out, ignore_errors=True)
            raise
    # the writer counts what this run added; stats() also covers what a resumed run had before
    return CollectResult(
        path=Path(out),
        model=config.model,
        backend=entry.name,
        stats=writer.stats(),
        num_new_requests=writer.num_requests_written,
        num_new_tokens=writer.num_tokens_written,
        seconds=time.perf_counter() - t0,
        shard=shard,
    )


def analysis_dir(trace: Path) -> Path:
    """Where ``collect``'s ``next:`` hint puts the analysis: ``out/results/NAME-analysis`` for a trace in
    ``out/traces/NAME`` (results beside the traces, as the README lays them out), else ``NAME-analysis``
    beside the trace."""
    if trace.parent.name == "traces":
        return trace.parent.parent / "results" / f"{trace.name}-analysis"
    return trace.with_name(f"{trace.name}-analysis")
