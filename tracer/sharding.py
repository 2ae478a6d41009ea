"""Sharded collection: several engines (one per node or DP group) write one trace directory.

A run's prompts (``load_prompts``: deterministic, request ids 0..N-1) are split into ``num_shards``
shards by request id (shard ``s`` takes ids ``s, s+n, s+2n, ...``: every shard gets the same mix
of datasets). Shard ``s`` writes its parts as ``shardSSS-*.parquet`` and its own manifest
``manifests/shard-SSS.json``, so shards never touch each other's files and request ids never clash.
Each shard resumes on its own. :func:`merge_shards` then checks that the shard manifests agree
(format, model, collection settings, backend) and writes the trace's ``manifest.json`` with the
totals; the trace is complete when every shard is.

Across nodes the shards run as Ray tasks (:func:`collect_sharded_with_ray`; Ray is what vLLM itself
uses for multi-node), each reserving its engine's GPUs; the trace directory must be on a file
system every node mounts. One node needs no Ray: run the shards one after another, or one per DP
group, with :func:`collect_shard`.

Out of scope: what one engine does (``vllm_backend``, ``hf``), prompt loading (``datasets``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from moetrace.errors import ConfigError, TraceFormatError
from moetrace.tracer.schema import check_manifest_header
from moetrace.tracer.store import MANIFEST, REQUESTS_DIR, OnExisting, WriterStats, write_json_atomic

MANIFESTS_DIR = "manifests"
_SHARD_MANIFEST_RE = re.compile(r"^shard-(\d{3,})\.json$")
#: collection keys that differ between shards by design
SHARD_KEYS = ("shard", "num_shards")


def shard_prefix(shard: int) -> str:
    """Part-file prefix of shard ``shard`` (``shard003``)."""
    return f"shard{shard:03d}"


def shard_manifest_name(shard: int) -> str:
    """Manifest path of shard ``shard`` inside the trace directory (``manifests/shard-003.json``)."""
    return f"{MANIFESTS_DIR}/shard-{shard:03d}.json"


def shard_prompts(prompts: Sequence[Any], *, shard: int, num_shards: int) -> list[Any]:
    """The prompts of shard ``shard`` of ``num_shards``: every ``num_shards``-th, starting at ``shard``."""
    if not 0 <= shard < num_shards:
        raise ConfigError(f"shard {shard} is outside 0..{num_shards - 1}")
    return list(prompts[shard::num_shards])


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
    from moetrace.tracer.collect import collect

    result = collect(config, out=out, backend=backend, engine=engine, on_existing=on_existing,
                     shard=(shard, num_shards), on_progress=on_progress)
    return result.stats


def read_shard_manifests(path: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """``{shard index: manifest}`` of every ``manifests/shard-*.json`` in the trace directory."""
    d = Path(path) / MANIFESTS_DIR
    out: dict[int, dict[str, Any]] = {}
    for f in sorted(d.glob("shard-*.json")) if d.is_dir() else []:
        m = _SHARD_MANIFEST_RE.match(f.name)
        if m is None:
            continue
        try:
            manifest = json.loads(f.read_text())
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{f}: not valid JSON ({exc})") from exc
        check_manifest_header(manifest, where=str(f))
        out[int(m.group(1))] = manifest
    return out


def merge_manifests(shards: dict[int, dict[str, Any]], *, allow_incomplete: bool = False) -> dict[str, Any]:
    """The trace manifest of a sharded run from its shard manifests (pure; raises on disagreement).

    Every shard ``0..num_shards-1`` must be present and agree on format, version, model, backend
    name and the collection settings (all but :data:`SHARD_KEYS`). ``complete`` is true when every
    shard is complete; with ``allow_incomplete`` unfinished shards give an incomplete manifest
    instead of an error.
    """
    if not shards:
        raise TraceFormatError(f"no shard manifests ({MANIFESTS_DIR}/shard-*.json) to merge")
    first = shards[min(shards)]
    num_shards = first.get("collection", {}).get("num_shards")
    problems = []
    if not isinstance(num_shards, int):
        problems.append(f"shard {min(shards)}: collection.num_shards is missing")
    else:
        missing = sorted(set(range(num_shards)) - set(shards))
        extra = sorted(set(shards) - set(range(num_shards)))
        if missing:
            problems.append(f"shards {missing} of {num_shards} have no manifest (not started?)")
        if extra:
            problems.append(f"shard manifests {extra} are outside 0..{num_shards - 1}")

    def common(m: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in m.get("collection", {}).items() if k not in SHARD_KEYS}

    for i, m in sorted(shards.items()):
        for key, get in (("version", lambda x: x.get("version")), ("model", lambda x: x.get("model")),
                         ("backend name", lambda x: x.get("backend", {}).get("name")), ("collection", common)):
            if get(m) != get(first):
                problems.append(f"shard {i}: {key} differs from shard {min(shards)} ({get(m)!r} vs {get(first)!r})")
        if m.get("collection", {}).get("shard") != i:
            problems.append(f"shard {i}: its manifest says shard {m.get('collection', {}).get('shard')!r}")
    incomplete = sorted(i for i, m in shards.items() if not m.get("complete"))
    if incomplete and not allow_incomplete:
        problems.append(f"shards {incomplete} are not complete: resume them, or merge with --allow-incomplete")
    if problems:
        raise TraceFormatError("cannot merge the shards:\n" + "\n".join(f"  - {p}" for p in problems))
    totals = {
        "num_requests": sum(int(m.get("totals", {}).get("num_requests", 0)) for m in shards.values()),
        "num_tokens": sum(int(m.get("totals", {}).get("num_tokens", 0)) for m in shards.values()),
    }
    merged = {k: v for k, v in first.items() if k not in ("complete", "totals", "collection", "backend")}
    merged.update(
        complete=not incomplete and len(shards) == num_shards,
        collection={**common(first), "num_shards": num_shards},
        backend=dict(first.get("backend", {})),
        totals=totals,
        shards=[
            {"shard": i, "manifest": shard_manifest_name(i), "complete": bool(m.get("complete")),
             "totals": m.get("totals", {}), "backend": m.get("backend", {})}
            for i, m in sorted(shards.items())
        ],
    )
    return merged


def merge_shards(path: str | os.PathLike, *, allow_incomplete: bool = False) -> dict[str, Any]:
    """Check the shard manifests of trace directory ``path`` and write its ``manifest.json``.

    Also checks that no request id was written by two shards. Returns the written manifest.
    """
    p = Path(path)
    manifest = merge_manifests(read_shard_manifests(p), allow_incomplete=allow_incomplete)
    _check_disjoint(p, num_shards=manifest["collection"]["num_shards"])
    write_json_atomic(p / MANIFEST, manifest)
    return manifest


def _check_disjoint(path: Path, *, num_shards: int) -> None:
    import pyarrow.parquet as pq

    owner: dict[int, int] = {}
    clashes = []
    for s in range(num_shards):
        for f in sorted((path / REQUESTS_DIR).glob(f"{shard_prefix(s)}-*.parquet")):
            for rid in pq.read_table(f, columns=["request_id"]).column(0).to_pylist():
                if owner.setdefault(rid, s) != s:
                    clashes.append((rid, owner[rid], s))
    if clashes:
        rid, a, b = clashes[0]
        raise TraceFormatError(
            f"{len(clashes)} request id(s) were written by two shards (e.g. {rid} by shards {a} and {b}); "
            "the shards were not collected with the same prompts and --num-shards"
        )


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
