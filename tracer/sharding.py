"""Sharded collection: several engines (one per node or DP group) write one trace directory.

A run's prompts (``load_prompts``: deterministic, request ids 0..N-1) are split into ``num_shards``
shards by request id (shard ``s`` takes ids ``s, s+n, s+2n, ...``: every shard gets the same mix
of datasets). Shard ``s`` writes its parts as ``shardSSS-*.parquet`` and its own manifest
``manifests/shard-SSS.json``, so shards never touch each other's files and request ids never clash.
Each shard resumes on its own. ``moetrace.tracer.trace.merge`` then checks that the shard manifests agree and writes the
trace's ``manifest.json``; the trace is complete when every shard is.

Across nodes the shards run as Ray tasks (:func:`collect_sharded_with_ray`; Ray is what vLLM itself
uses for multi-node), each reserving its engine's GPUs; the trace directory must be on a file
system every node mounts. One node needs no Ray: run the shards one after another, or one per DP
group, with ``collect.collect(config, shard=(s, n), ...)`` (``moetrace collect --shard S/N``).

The entry point of ``moetrace collect`` lives here, on top of both: :func:`run_collection` picks
the backend once (``backends.registry.choose_backend``) and runs the whole collection, one shard of
it, or every shard on Ray. No backend is named here: a Ray shard reserves the GPUs its backend's
registry row asks for.

Out of scope: what one engine does (``backends.vllm``, ``backends.hf``), which backends exist
(``backends.registry``), prompt loading (``datasets``), opening the trace and summarizing a run
(``collect``), progress bars (``moetrace.cli``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from moetrace.errors import CollectionError, ConfigError
from moetrace.tracer.backends.base import OnProgress
from moetrace.tracer.backends.registry import AUTO, choose_backend, get_backend
from moetrace.tracer.collect import CollectConfig, CollectResult, OnStart, collect
from moetrace.tracer.trace.merge import merge_shards
from moetrace.tracer.trace.writer import OnExisting, WriterStats

if TYPE_CHECKING:  # pragma: no cover
    from moetrace.tracer.backends.vllm import VllmEngineConfig

#: how many times Ray runs a shard again after its worker process or node died (Ray's own default)
DEFAULT_SHARD_RETRIES = 3


def run_collection(
    config: CollectConfig,
    *,
    out: str | os.PathLike,
    backend: str = AUTO,
    engine: VllmEngineConfig | None = None,
    on_existing: OnExisting = "refuse",
    shard: tuple[int, int] | None = None,
    ray_shards: int | None = None,
    on_start: OnStart | None = None,
    on_progress: OnProgress | None = None,
) -> CollectResult:
    """Collect ``config`` into ``out``: the whole run here, shard ``shard=(s, n)`` of it here, or
    ``ray_shards`` shards as Ray tasks merged into one trace. The backend (``auto`` or a name in
    ``backends.registry``) is chosen once, here.

    ``engine`` holds the vLLM engine settings (default ``VllmEngineConfig()``; unused by other backends).
    ``on_start`` and ``on_progress`` report a run or shard collected here (see ``collect.collect``);
    Ray shards report nothing until they are merged. With ``ray_shards``, ``on_existing="refuse"``
    acts as ``"resume"``: Ray may retry a shard task, and re-running the same command continues every
    unfinished shard (``"overwrite"`` starts over).
    """
    if shard is not None and ray_shards is not None:
        raise ConfigError("--shard and --ray-shards exclude each other")
    chosen = choose_backend(backend, settings=config.backend_settings(engine), on_ray=ray_shards is not None)
    if ray_shards is not None:
        return collect_sharded_with_ray(
            config,
            out=out,
            num_shards=ray_shards,
            backend=chosen,
            engine=engine,
            on_existing="overwrite" if on_existing == "overwrite" else "resume",
        )
    return collect(
        config,
        out=out,
        backend=chosen,
        engine=engine,
        on_existing=on_existing,
        shard=shard,
        on_start=on_start,
        on_progress=on_progress,
    )


def collect_sharded_with_ray(
    config: CollectConfig,
    *,
    out: str | os.PathLike,
    num_shards: int,
    backend: str = AUTO,
    engine: VllmEngineConfig | None = None,
    num_gpus_per_shard: float | None = None,
    ray_address: str | None = "auto",
    on_existing: OnExisting = "resume",
    max_retries: int = DEFAULT_SHARD_RETRIES,
) -> CollectResult:
    """Run every shard as a Ray task (one engine each, ``num_gpus_per_shard`` GPUs reserved), then
    merge. ``out`` must be a path every Ray node can write (shared file system). Re-running resumes
    each unfinished shard. Returns the shards' results added up (``num_merged_shards`` = ``num_shards``).
    ``backend="auto"`` takes the registry's choice for Ray shards (vLLM).

    ``num_gpus_per_shard`` defaults to what the backend's registry row asks for one engine: the
    engine's ``tp*dp`` for vLLM; for HF 1 on a GPU device (``config.device`` not ``cpu``), else 0.
    A shard task also takes Ray's default 1 CPU. ``ray_address``: what ``ray.init(address=...)``
    takes (``"auto"``: the cluster ``ray start`` started on this machine, or ``RAY_ADDRESS``);
    ignored when Ray is already initialised in this process.

    Failures: a shard whose worker process or node dies is run again by Ray, up to ``max_retries``
    times (on any node with the resources free), and the new run resumes from the shard's committed
    parts (at most one batch per failure is collected twice, never written twice). Each task is
    named ``moetrace-shard-S-of-N`` (``ray list tasks``; the worker's process title is
    ``ray::moetrace-shard-S-of-N``). When a shard still fails, the other shards run to the end and
    ``CollectionError`` names the failed shards; re-running the same command resumes them, and
    nothing is merged until every shard is complete.
    """
    from moetrace._deps import require

    if num_shards < 1:
        raise ConfigError(f"--ray-shards must be at least 1, got {num_shards}")
    if max_retries < 0:
        raise ConfigError(f"max_retries must be at least 0, got {max_retries}")
    settings = config.backend_settings(engine)
    entry = get_backend(choose_backend(backend, settings=settings, on_ray=True))
    ray = require("ray", purpose="sharded collection over several nodes")
    if num_gpus_per_shard is None:
        num_gpus_per_shard = entry.num_gpus(settings)
    if not ray.is_initialized():
        ray.init(address=ray_address)
    out_abs = str(Path(out).resolve())

    @ray.remote(num_gpus=num_gpus_per_shard, max_retries=max_retries)
    def run_shard(shard: int) -> CollectResult:
        return collect(
            config, out=out_abs, backend=entry.name, engine=engine, on_existing=on_existing, shard=(shard, num_shards)
        )

    t0 = time.perf_counter()
    refs = [run_shard.options(name=shard_task_name(s, num_shards)).remote(s) for s in range(num_shards)]
    results: list[CollectResult] = []
    failed: list[str] = []
    for s, ref in enumerate(refs):  # every shard runs to its end before a failure is reported
        try:
            results.append(ray.get(ref))
        except ray.exceptions.RayError as exc:
            failed.append(f"shard {s}: {_first_line(exc)}")
    if failed:
        raise CollectionError(
            f"{len(failed)} of {num_shards} shards failed after {max_retries} retries each ({'; '.join(failed)}); "
            f"the other shards are complete in {out_abs}; re-run the same command to resume the failed ones"
        )
    merge_shards(out_abs)
    return CollectResult(
        path=Path(out),
        model=config.model,
        backend=entry.name,
        stats=WriterStats(
            num_requests=sum(r.stats.num_requests for r in results),
            num_tokens=sum(r.stats.num_tokens for r in results),
            num_parts=sum(r.stats.num_parts for r in results),
            bytes_on_disk=sum(r.stats.bytes_on_disk for r in results),
        ),
        num_new_requests=sum(r.num_new_requests for r in results),
        num_new_tokens=sum(r.num_new_tokens for r in results),
        seconds=time.perf_counter() - t0,
        num_merged_shards=num_shards,
    )


def shard_task_name(shard: int, num_shards: int) -> str:
    """The Ray task name of shard ``shard`` of ``num_shards`` (also its worker's process title after ``ray::``)."""
    return f"moetrace-shard-{shard}-of-{num_shards}"


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of a Ray error's message (the rest is the remote traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
