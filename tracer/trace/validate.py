"""Check a trace directory against format v1 (SPEC §2) and name every problem found.

Checks: manifest (format, version, model section, ``complete``), each part file is readable Parquet
with the required columns and types, every routing part has its requests part and vice versa, no
leftover temporary files, expert ids in ``0 <= id < E`` or ``-1``, ``(request_id, position)``
unique, ``request_id`` unique in the requests table, each request's positions are exactly
``0 .. prompt_tokens + output_tokens - 1`` with ``stage`` = prefill below ``prompt_tokens`` and
decode from there, and no prompt/output text unless the manifest says it was asked for.

Streaming: one part at a time, so memory is bounded by a part, plus one int64 key per token for the
uniqueness check across parts.

Out of scope: whether the routing is *plausible* (that is what ``analysis`` is for).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from moetrace.errors import TraceFormatError, TraceValidationError
from moetrace.tracer.trace.schema import (
    NO_EXPERT,
    REQUIRED_REQUESTS,
    REQUIRED_ROUTING,
    STAGE_DECODE,
    STAGE_PREFILL,
    ModelInfo,
    check_manifest_header,
)
from moetrace.tracer.trace.layout import MANIFEST, REQUESTS_DIR, ROUTING_DIR, read_manifest

MAX_REPORTED = 200


def find_problems(path: str | os.PathLike) -> list[str]:
    """Return a list of human-readable problems with the trace at ``path`` (empty: valid)."""
    p = Path(path)
    problems: list[str] = []
    try:
        manifest = read_manifest(p)
        check_manifest_header(manifest, where=str(p / MANIFEST))
        model = ModelInfo.from_dict(manifest.get("model") or {})
    except (TraceFormatError, TypeError, ValueError) as exc:
        return [str(exc)]
    if not manifest["complete"]:  # a boolean: check_manifest_header made sure
        problems.append(f"{MANIFEST}: `complete` is {manifest.get('complete')!r}: the collection did not finish (resume it)")
    for key in ("backend", "collection"):
        if not isinstance(manifest.get(key), dict):
            problems.append(f"{MANIFEST}: missing section `{key}`")
    if isinstance(manifest.get("backend"), dict) and "name" not in manifest["backend"]:
        problems.append(f"{MANIFEST}: `backend.name` is missing")
    text_allowed = bool(manifest.get("writer", {}).get("with_text") or manifest.get("collection", {}).get("store_text"))

    rdir, qdir = p / ROUTING_DIR, p / REQUESTS_DIR
    for d in (rdir, qdir):
        if not d.is_dir():
            problems.append(f"missing directory {d.name}/")
        else:
            for f in d.iterdir():
                if f.name.endswith(".tmp"):
                    problems.append(f"{d.name}/{f.name}: leftover temporary file (an interrupted write; resume or delete it)")
    if problems and not (rdir.is_dir() and qdir.is_dir()):
        return problems
    rnames = {f.name for f in rdir.glob("*.parquet")}
    qnames = {f.name for f in qdir.glob("*.parquet")}
    for n in sorted(rnames - qnames):
        problems.append(f"{ROUTING_DIR}/{n}: no matching {REQUESTS_DIR}/{n} (uncommitted part)")
    for n in sorted(qnames - rnames):
        problems.append(f"{REQUESTS_DIR}/{n}: no matching {ROUTING_DIR}/{n} (its routing rows are missing)")
    if manifest["complete"] and not qnames:
        problems.append(f"{MANIFEST}: says `complete: true` but the trace holds no committed parts (no requests/*.parquet)")

    X = model.ids_per_token
    E = model.num_experts
    # ---- requests
    req_tables = []
    for n in sorted(qnames):
        t = _read(qdir / n, problems, f"{REQUESTS_DIR}/{n}")
        if t is None:
            continue
        bad = _check_columns(t.schema, REQUIRED_REQUESTS, f"{REQUESTS_DIR}/{n}", problems)
        if not text_allowed:
            for col in ("prompt_text", "output_text"):
                if col in t.column_names and t.column(col).null_count < t.num_rows:
                    problems.append(f"{REQUESTS_DIR}/{n}: holds `{col}` but the manifest does not record that text was opted in")
        nulls = [c for c in REQUIRED_REQUESTS if not bad and t.column(c).null_count]
        for c in nulls:
            problems.append(f"{REQUESTS_DIR}/{n}: `{c}` is null in {t.column(c).null_count} row(s)")
        if not bad and not nulls:
            req_tables.append(t.select(list(REQUIRED_REQUESTS)))
    if req_tables:
        req = pa.concat_tables(req_tables, promote_options="permissive")  # nullable or not: same values
        rid = req.column("request_id").to_numpy()
        uniq, counts = np.unique(rid, return_counts=True)
        for r in uniq[counts > 1][:20]:
            problems.append(f"requests: request_id {int(r)} appears {int(counts[uniq == r][0])} times")
        ptok = req.column("prompt_tokens").to_numpy().astype(np.int64)
        otok = req.column("output_tokens").to_numpy().astype(np.int64)
        for i in np.flatnonzero(ptok < 1)[:20]:
            problems.append(f"requests: request {int(rid[i])} has prompt_tokens={int(ptok[i])} (< 1)")
        for i in np.flatnonzero(otok < 0)[:20]:
            problems.append(f"requests: request {int(rid[i])} has output_tokens={int(otok[i])} (< 0)")
        order = np.argsort(rid, kind="stable")
        rid_sorted, p_sorted, len_sorted = rid[order], ptok[order], (ptok + otok)[order]
    else:
        rid_sorted = p_sorted = len_sorted = np.zeros(0, np.int64)

    # ---- routing, part by part
    seen_rows = np.zeros(len(rid_sorted), dtype=np.int64)
    keys: list[np.ndarray] = []
    for n in sorted(rnames):
        where = f"{ROUTING_DIR}/{n}"
        t = _read(rdir / n, problems, where)
        if t is None:
            continue
        bad = _check_columns(t.schema, REQUIRED_ROUTING, where, problems)
        ftype = t.schema.field("experts").type if "experts" in t.column_names else None
        if ftype is None:
            problems.append(f"{where}: missing column `experts`")
            bad = True
        elif not (pa.types.is_fixed_size_list(ftype) and ftype.value_type == pa.int16() and ftype.list_size == X):
            problems.append(
                f"{where}: column `experts` has type {ftype}, expected fixed_size_list<int16>[{X}] "
                f"({model.num_moe_layers} MoE layers x top-{model.top_k})"
            )
            bad = True
        if "weights" in t.column_names:
            wt = t.schema.field("weights").type
            if not (pa.types.is_fixed_size_list(wt) and wt.value_type == pa.float32() and wt.list_size == X):
                problems.append(f"{where}: optional column `weights` has type {wt}, expected fixed_size_list<float32>[{X}]")
        if bad:
            continue
        for c in ("request_id", "position", "stage", "experts"):
            if t.column(c).null_count:
                problems.append(f"{where}: `{c}` is null in {t.column(c).null_count} row(s)")
                bad = True
        if pc.list_flatten(t.column("experts")).null_count:
            problems.append(f"{where}: `experts` lists hold {pc.list_flatten(t.column('experts')).null_count} null ids")
            bad = True
        if bad:
            continue
        ids = pc.list_flatten(t.column("experts")).to_numpy()
        out = (ids != NO_EXPERT) & ((ids < 0) | (ids >= E))
        if out.any():
            vals = np.unique(ids[out])[:10]
            problems.append(
                f"{where}: {int(out.sum())} expert ids out of range (0 <= id < {E}, or -1), e.g. {vals.tolist()}"
            )
        rid = t.column("request_id").to_numpy()
        pos = t.column("position").to_numpy().astype(np.int64)
        stage = t.column("stage")
        if pa.types.is_dictionary(stage.type):
            stage = stage.cast(pa.string())
        is_pre = pc.equal(stage, STAGE_PREFILL).to_numpy(zero_copy_only=False)
        is_dec = pc.equal(stage, STAGE_DECODE).to_numpy(zero_copy_only=False)
        if (~(is_pre | is_dec)).any():
            vals = pc.unique(pc.filter(stage, pa.array(~(is_pre | is_dec)))).to_pylist()[:5]
            problems.append(f"{where}: `stage` values {vals} (allowed: prefill, decode)")
        keys.append((rid.astype(np.int64) << 32) | pos)
        # consistency with the requests table
        idx = np.searchsorted(rid_sorted, rid)
        idx_c = np.minimum(idx, max(len(rid_sorted) - 1, 0))
        known = (idx < len(rid_sorted)) & (rid_sorted[idx_c] == rid) if len(rid_sorted) else np.zeros(len(rid), bool)
        if (~known).any():
            problems.append(f"{where}: {int((~known).sum())} rows of request ids missing from the requests table, e.g. {np.unique(rid[~known])[:5].tolist()}")
        k = idx_c[known]
        posk = pos[known]
        if ((posk < 0) | (posk >= len_sorted[k])).any():
            bad_r = np.unique(rid[known][(posk < 0) | (posk >= len_sorted[k])])[:5]
            problems.append(f"{where}: positions outside 0..prompt_tokens+output_tokens-1 for requests {bad_r.tolist()}")
        want_dec = posk >= p_sorted[k]
        wrong = want_dec != is_dec[known]
        if wrong.any():
            bad_r = np.unique(rid[known][wrong])[:5]
            problems.append(
                f"{where}: {int(wrong.sum())} rows whose stage disagrees with prompt_tokens (prefill iff position < "
                f"prompt_tokens), requests {bad_r.tolist()}"
            )
        np.add.at(seen_rows, k, 1)
        if len(problems) > MAX_REPORTED:
            break

    if keys:
        allk = np.concatenate(keys)
        allk.sort()
        dup = allk[1:][allk[1:] == allk[:-1]]
        if len(dup):
            ex = [(int(d >> 32), int(d & 0xFFFFFFFF)) for d in np.unique(dup)[:5]]
            problems.append(f"routing: {len(dup)} duplicate (request_id, position) rows, e.g. {ex}")
    short = np.flatnonzero(seen_rows != len_sorted)
    if len(short) and not any("duplicate" in pr for pr in problems):
        ex = [(int(rid_sorted[i]), int(seen_rows[i]), int(len_sorted[i])) for i in short[:5]]
        problems.append(
            f"routing: {len(short)} requests whose row count differs from prompt_tokens+output_tokens "
            f"(request, rows, expected): {ex}"
        )
    totals = manifest.get("totals")
    if isinstance(totals, dict) and req_tables and totals.get("num_requests") not in (None, len(rid_sorted)):
        problems.append(f"{MANIFEST}: totals.num_requests={totals['num_requests']} but the requests table has {len(rid_sorted)}")
    return problems


def validate(path: str | os.PathLike) -> None:
    """Raise ``TraceValidationError`` listing every problem, or return if the trace is valid."""
    problems = find_problems(path)
    if problems:
        raise TraceValidationError(problems)


def _read(path: Path, problems: list[str], where: str) -> pa.Table | None:
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        problems.append(f"{where}: not readable as Parquet (truncated or corrupt?): {exc}")
        return None


def _check_columns(schema: pa.Schema, required: dict[str, pa.DataType], where: str, problems: list[str]) -> bool:
    bad = False
    for name, typ in required.items():
        if name not in schema.names:
            problems.append(f"{where}: missing column `{name}` ({typ})")
            bad = True
            continue
        got = schema.field(name).type
        ok = got == typ or (
            typ == pa.string() and (got == pa.large_string() or (pa.types.is_dictionary(got) and got.value_type in (pa.string(), pa.large_string())))
        )
        if not ok:
            problems.append(f"{where}: column `{name}` has type {got}, expected {typ}")
            bad = True
    return bad
