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
group, with :func:`collect_shard`.

Out of scope: what one engine does (``backends.vllm``, ``backends.hf``), prompt loading (``datasets``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Literal

from moetrace.tracer.collect import collect
from moetrace.tracer.trace.merge import merge_shards
from moetrace.tracer.trace.writer import OnExisting, WriterStats


def collect_shard(
    config: Any,
    *,
    out: str | os.PathLike,
    shard: int,
    num_shards: int,
    backend: Literal["hf", "vllm"],
    engine: Any = None,
    on_existing: OnExisting = "refuse",
    on_progress: Callable[[int, int], None] | None = None,
) -> WriterStats:
    """Collect shard ``shard`` of ``num_shards`` of ``config`` (a ``collect.CollectConfig``) into ``out``.

    Writes only ``shard<SSS>-*`` parts and ``manifests/shard-SSS.json``. ``on_existing="resume"``
    continues this shard. Call :func:`merge_shards` once every shard is done.
    """
    result = collect(config, out=out, backend=backend, engine=engine, on_existing=on_existing,
                     shard=(shard, num_shards), on_progress=on_progress)
    return result.stats


def collect_sharded_with_ray(
    config: Any,
    *,
    out: str | os.PathLike,
    num_shards: int,
    backend: Literal["hf", "vllm"] = "vllm",
    engine: Any = None,
    num_gpus_per_shard: float | None = None,
    ray_address: str | None = "auto",
    on_existing: OnExisting = "resume",
) -> dict[str, Any]:
    """Run every shard as a Ray task (one engine each, ``num_gpus_per_shard`` GPUs reserved), then
    merge. ``out`` must be a path every Ray node can write (shared file system). Re-running resumes
    each unfinished shard. Returns the merged manifest."""
    from moetrace._deps import require

    ray = require("ray", purpose="sharded collection over several nodes")
    if num_gpus_per_shard is None:
        num_gpus_per_shard = float(engine.num_gpus) if engine is not None else 0.0
    if not ray.is_initialized():
        ray.init(address=ray_address)
    out_abs = str(Path(out).resolve())

    @ray.remote(num_gpus=num_gpus_per_shard)
    def run_shard(shard: int) -> int:
        stats = collect_shard(config, out=out_abs, shard=shard, num_shards=num_shards, backend=backend,
                              engine=engine, on_existing=on_existing)
        return stats.num_requests

    ray.get([run_shard.remote(s) for s in range(num_shards)])
    return merge_shards(out_abs)
