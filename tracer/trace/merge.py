"""Merging a sharded trace: several writers (shards) share one trace directory, then one manifest.

Shard ``s`` writes its parts as ``shardSSS-*.parquet`` and its own manifest
``manifests/shard-SSS.json`` (names in ``layout``), so shards never touch each other's files.
:func:`merge_shards` checks that the shard manifests agree (format, model, collection settings,
backend) and that no request id was written twice, and writes the trace's ``manifest.json`` with
the totals; the trace is complete when every shard is.

Out of scope: running the shards (``moetrace.tracer.sharding``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from moetrace.atomic import write_json_atomic
from moetrace.errors import TraceFormatError
from moetrace.tracer.trace.layout import (
    MANIFEST,
    MANIFESTS_DIR,
    REQUESTS_DIR,
    SHARD_MANIFEST_RE,
    shard_manifest_name,
    shard_prefix,
)
from moetrace.tracer.trace.lock import lock_trace, probe_lock
from moetrace.tracer.trace.schema import check_manifest_header

#: collection keys that differ between shards by design
SHARD_KEYS = ("shard", "num_shards")


def read_shard_manifests(path: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """``{shard index: manifest}`` of every ``manifests/shard-*.json`` in the trace directory."""
    d = Path(path) / MANIFESTS_DIR
    out: dict[int, dict[str, Any]] = {}
    for f in sorted(d.glob("shard-*.json")) if d.is_dir() else []:
        m = SHARD_MANIFEST_RE.match(f.name)
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
        for key, get in (
            ("version", lambda x: x.get("version")),
            ("model", lambda x: x.get("model")),
            ("backend name", lambda x: x.get("backend", {}).get("name")),
            ("collection", common),
        ):
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
    merged = {k: v for k, v in first.items() if k not in ("complete", "totals", "collection", "backend", "parts")}
    if all(isinstance(m.get("parts"), dict) for m in shards.values()):  # each shard's parts carry their own prefix
        merged["parts"] = dict(sorted(kv for m in shards.values() for kv in m["parts"].items()))
    merged.update(
        complete=not incomplete and len(shards) == num_shards,
        collection={**common(first), "num_shards": num_shards},
        backend=dict(first.get("backend", {})),
        totals=totals,
        shards=[
            {
                "shard": i,
                "manifest": shard_manifest_name(i),
                "complete": bool(m.get("complete")),
                "totals": m.get("totals", {}),
                "backend": m.get("backend", {}),
            }
            for i, m in sorted(shards.items())
        ],
    )
    return merged


def merge_shards(path: str | os.PathLike, *, allow_incomplete: bool = False) -> dict[str, Any]:
    """Check the shard manifests of trace directory ``path`` and write its ``manifest.json``.

    Also checks that no request id was written by two shards. Returns the written manifest.
    """
    p = Path(path)
    if allow_incomplete:  # shards may still run (they share the trace's lock); a whole-trace writer may not
        probe_lock(p, shared=True)
        lock = None
    else:  # a manifest saying complete: no shard and no other writer may be at work meanwhile
        lock = lock_trace(p)
    try:
        manifest = merge_manifests(read_shard_manifests(p), allow_incomplete=allow_incomplete)
        _check_disjoint(p, num_shards=manifest["collection"]["num_shards"])
        write_json_atomic(p / MANIFEST, manifest)
    finally:
        if lock is not None:
            lock.release()
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
