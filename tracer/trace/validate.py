"""Check a trace directory against format v1 (SPEC §2) and name every problem found.

Checks: manifest (format, version, model section, ``complete``), each part file is readable Parquet
with the required columns and types, every routing part has its requests part and vice versa, no
leftover temporary files, expert ids in ``0 <= id < E`` or ``-1``, ``(request_id, position)``
unique, ``request_id`` unique in the requests table, each request's positions are exactly
``0 .. prompt_tokens + output_tokens - 1`` with ``stage`` = prefill below ``prompt_tokens`` and
decode from there, no prompt/output text unless the manifest says it was asked for, in a
single-stage capture (manifest ``collection.stages``, see ``schema.stages_of``) no expert ids in
the rows of the stage it did not record, and, for a group-limited router (the model's
``n_group``/``topk_group``, DeepSeek-V3: 8/4), no (token, layer) whose experts span more than
``topk_group`` groups: the router never picks such a set, so ids that do are not its logical
expert ids (physical slots after an EPLB remap, another model's ids).

Streaming: one part at a time, so memory is bounded by a part, plus one int64 key per token for the
uniqueness check across parts.

Out of scope: whether the routing is *plausible* (that is what ``analysis`` is for).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

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
    STAGES,
    ModelInfo,
    check_manifest_header,
    stages_of,
)
from moetrace.tracer.trace.layout import MANIFEST, REQUESTS_DIR, ROUTING_DIR, read_manifest

MAX_REPORTED = 200
#: set bits of every byte value
_POPCOUNT8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)
#: routing rows read at a time (bounds memory: ~ BATCH_ROWS * (L*K*2 + 16) bytes)
BATCH_ROWS = 65536


def find_problems(path: str | os.PathLike, *, progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Return a list of human-readable problems with the trace at ``path`` (empty: valid).

    ``progress(rows_done, rows_total)`` is called after each batch of routing rows read (and once at
    the end with ``rows_done == rows_total``); the total is the row count in the parts' footers.
    """
    p = Path(path)
    problems: list[str] = []
    try:
        manifest = read_manifest(p)
        check_manifest_header(manifest, where=str(p / MANIFEST))
        model = ModelInfo.from_dict(manifest.get("model") or {})
        recorded = stages_of(manifest)
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

    # ---- routing, part by part and batch by batch (memory: one batch plus one byte per token)
    len_sorted = len_sorted.astype(np.int64)
    start_R = np.zeros(len(len_sorted), dtype=np.int64)
    np.cumsum(len_sorted[:-1], out=start_R[1:])
    claimed = int(len_sorted.sum())
    parts: dict[str, pq.ParquetFile] = {}  # each part's footer read once: row counts, schema, batches
    for n in sorted(rnames):
        try:
            parts[n] = pq.ParquetFile(rdir / n, pre_buffer=False)  # read column chunks as batches need them
        except (pa.ArrowException, OSError) as exc:
            problems.append(f"{ROUTING_DIR}/{n}: not readable as Parquet (truncated or corrupt?): {exc}")
    rows_on_disk = sum(pf.metadata.num_rows for pf in parts.values())
    seen_T: np.ndarray | None = None
    if claimed > 2 * rows_on_disk + (1 << 24):  # far more than exist: no bitmap of that size
        problems.append(f"requests: prompt_tokens + output_tokens add up to {claimed:,} tokens but the routing parts "
                        f"hold {rows_on_disk:,} rows")
    else:  # one byte per token the requests table says exists: bounded by the rows on disk
        seen_T = np.zeros(claimed, dtype=np.uint8)
    num_dup = 0
    dup_examples: list[tuple[int, int]] = []
    unrecorded = tuple(s for s in STAGES if s not in recorded)
    ids_in_unrecorded = dict.fromkeys(unrecorded, 0)  # rows of a stage the manifest says was not recorded
    router = _RouterCheck.of(model)
    rows_done = 0

    def tick(rows: int) -> None:
        nonlocal rows_done
        rows_done = min(rows_done + rows, rows_on_disk)
        if progress is not None:
            progress(rows_done, rows_on_disk)

    for n in list(parts):
        pf = parts.pop(n)  # a part's reader keeps what it read until closed: one part alive at a time
        where = f"{ROUTING_DIR}/{n}"
        if not _routing_schema_ok(pf.schema_arrow, where, problems, X=X, model=model):
            pf.close()
            continue
        try:
            for rb in pf.iter_batches(batch_size=BATCH_ROWS, columns=["request_id", "position", "stage", "experts"]):
                num_dup += _check_routing_batch(
                    rb, where, problems, E=E, rid_sorted=rid_sorted, p_sorted=p_sorted, len_sorted=len_sorted,
                    start_R=start_R, seen_T=seen_T, dup_examples=dup_examples, ids_in_unrecorded=ids_in_unrecorded,
                    router=router,
                )
                tick(rb.num_rows)
        except (pa.ArrowException, OSError) as exc:
            problems.append(f"{where}: not readable as Parquet (truncated or corrupt?): {exc}")
        finally:
            pf.close()
        if len(problems) > MAX_REPORTED:
            break
    tick(rows_on_disk)  # parts skipped (unreadable, bad schema, too many problems) count as done

    for stage, n in ids_in_unrecorded.items():
        if n:
            problems.append(
                f"routing: {n} {stage} rows hold expert ids but the manifest's `collection.stages` "
                f"{sorted(recorded, key=STAGES.index)} says {stage} was not recorded (its rows must be -1)"
            )
    if router is not None and router.num_bad:
        problems.append(router.problem())
    if num_dup:
        problems.append(f"routing: {num_dup} duplicate (request_id, position) rows, e.g. {dup_examples[:5]}")
    if seen_T is not None and len(len_sorted):
        seen_rows = np.add.reduceat(seen_T, start_R).astype(np.int64) if claimed else np.zeros(len(len_sorted), np.int64)
        seen_rows[len_sorted == 0] = 0
        short = np.flatnonzero(seen_rows != len_sorted)
        if len(short) and not num_dup:
            ex = [(int(rid_sorted[i]), int(seen_rows[i]), int(len_sorted[i])) for i in short[:5]]
            problems.append(
                f"routing: {len(short)} requests whose row count differs from prompt_tokens+output_tokens "
                f"(request, rows, expected): {ex}"
            )
    totals = manifest.get("totals")
    if isinstance(totals, dict) and req_tables and totals.get("num_requests") not in (None, len(rid_sorted)):
        problems.append(f"{MANIFEST}: totals.num_requests={totals['num_requests']} but the requests table has {len(rid_sorted)}")
    return problems


def _routing_schema_ok(schema: pa.Schema, where: str, problems: list[str], *, X: int, model: ModelInfo) -> bool:
    bad = _check_columns(schema, REQUIRED_ROUTING, where, problems)
    ftype = schema.field("experts").type if "experts" in schema.names else None
    if ftype is None:
        problems.append(f"{where}: missing column `experts`")
        bad = True
    elif not (pa.types.is_fixed_size_list(ftype) and ftype.value_type == pa.int16() and ftype.list_size == X):
        problems.append(
            f"{where}: column `experts` has type {ftype}, expected fixed_size_list<int16>[{X}] "
            f"({model.num_moe_layers} MoE layers x top-{model.top_k})"
        )
        bad = True
    if "weights" in schema.names:
        wt = schema.field("weights").type
        if not (pa.types.is_fixed_size_list(wt) and wt.value_type == pa.float32() and wt.list_size == X):
            problems.append(f"{where}: optional column `weights` has type {wt}, expected fixed_size_list<float32>[{X}]")
    return not bad


class _RouterCheck:
    """Counts (token, layer) rows whose experts span more groups than a group-limited router allows."""

    def __init__(self, model: ModelInfo) -> None:
        self.model = model
        self.K, self.L = model.top_k, model.num_moe_layers
        self.size = model.num_experts // model.n_group  # experts per group (consecutive ids)
        # bit of the group of every int16 id read as uint16 (-1 -> 65535 and ids >= E: no bit)
        self.dtype = np.uint8 if model.n_group <= 8 else np.uint64
        h = np.arange((1 << 16) // self.size + 1)
        self.bit_of = np.where(h < model.n_group, np.left_shift(1, np.minimum(h, 63).astype(np.uint64)), 0).astype(self.dtype)
        self.num_bad = 0
        self.example: tuple[int, int, int, list[int]] | None = None  # request, position, MoE layer, ids

    @classmethod
    def of(cls, model: ModelInfo) -> "_RouterCheck | None":
        return cls(model) if model.group_limited and model.n_group <= 64 else None

    def check(self, ids: np.ndarray, rb: pa.RecordBatch) -> None:
        """``ids``: the batch's expert ids, flat (``rb``'s rows × L × K)."""
        if ids.size != rb.num_rows * self.L * self.K or not rb.num_rows or ids.dtype != np.int16:
            return  # a shape or type problem the other checks report
        u = ids.view(np.uint16)
        g = u >> np.uint16(self.size.bit_length() - 1) if self.size & (self.size - 1) == 0 else u // self.size
        bits = self.bit_of[g].reshape(-1, self.K)  # [token-layer rows, K]
        if self.dtype is np.uint8 and self.K == 8:  # 8 bytes of a row as one uint64: OR-fold them
            v = np.ascontiguousarray(bits).view(np.uint64).reshape(-1)
            v |= v >> np.uint64(32)
            v |= v >> np.uint64(16)
            v |= v >> np.uint64(8)
            used = (v & np.uint64(0xFF)).astype(np.uint8)
        else:
            used = np.bitwise_or.reduce(bits, axis=1)
        count = _POPCOUNT8[used] if self.dtype is np.uint8 else _POPCOUNT8[used.view(np.uint8)].reshape(-1, 8).sum(1)
        bad = np.flatnonzero(count > self.model.topk_group)
        self.num_bad += len(bad)
        if len(bad) and self.example is None:
            t, layer = divmod(int(bad[0]), self.L)
            self.example = (int(rb.column("request_id")[t].as_py()), int(rb.column("position")[t].as_py()), layer,
                            ids.reshape(-1, self.K)[bad[0]].tolist())

    def problem(self) -> str:
        m = self.model
        r, pos, layer, ids = self.example or (-1, -1, -1, [])
        return (f"routing: {self.num_bad} (token, MoE layer) rows use experts of more than topk_group={m.topk_group} of the "
                f"router's n_group={m.n_group} groups, e.g. request {r} position {pos} MoE layer {layer}: experts {ids} "
                f"(groups {sorted({e // self.size for e in ids if e >= 0})}); {m.name}'s router never picks such a set, so "
                "these are not its logical expert ids (physical slots after an EPLB remap? another model's ids?): "
                "re-collect or re-import with logical ids, or correct n_group/topk_group in the manifest's model section "
                "if this model routes without a group limit")


def _check_routing_batch(rb: pa.RecordBatch, where: str, problems: list[str], *, E: int, rid_sorted: np.ndarray,
                         p_sorted: np.ndarray, len_sorted: np.ndarray, start_R: np.ndarray,
                         seen_T: np.ndarray | None, dup_examples: list[tuple[int, int]],
                         ids_in_unrecorded: dict[str, int], router: _RouterCheck | None = None) -> int:
    """Check one batch of routing rows against the requests table; returns its duplicate rows.

    ``ids_in_unrecorded``: per stage the manifest says was not recorded, rows holding an expert id
    (added to)."""
    for c in ("request_id", "position", "stage", "experts"):
        if rb.column(c).null_count:
            problems.append(f"{where}: `{c}` is null in {rb.column(c).null_count} row(s)")
            return 0
    ids = rb.column("experts").flatten()
    if ids.null_count:
        problems.append(f"{where}: `experts` lists hold {ids.null_count} null ids")
        return 0
    ids = ids.to_numpy(zero_copy_only=False)
    if router is not None:
        router.check(ids, rb)
    out = (ids != NO_EXPERT) & ((ids < 0) | (ids >= E))
    if out.any():
        problems.append(f"{where}: {int(out.sum())} expert ids out of range (0 <= id < {E}, or -1), e.g. {np.unique(ids[out])[:10].tolist()}")
    rid = rb.column("request_id").to_numpy()
    pos = rb.column("position").to_numpy().astype(np.int64)
    stage = rb.column("stage")
    if pa.types.is_dictionary(stage.type):
        stage = stage.cast(pa.string())
    is_pre = pc.equal(stage, STAGE_PREFILL).to_numpy(zero_copy_only=False)
    is_dec = pc.equal(stage, STAGE_DECODE).to_numpy(zero_copy_only=False)
    if (~(is_pre | is_dec)).any():
        vals = pc.unique(pc.filter(stage, pa.array(~(is_pre | is_dec)))).to_pylist()[:5]
        problems.append(f"{where}: `stage` values {vals} (allowed: prefill, decode)")
    if ids_in_unrecorded:
        has_id = (ids.reshape(rb.num_rows, -1) != NO_EXPERT).any(axis=1) if rb.num_rows else np.zeros(0, bool)
        for stage in ids_in_unrecorded:
            ids_in_unrecorded[stage] += int((has_id & (is_pre if stage == STAGE_PREFILL else is_dec)).sum())
    idx = np.searchsorted(rid_sorted, rid)
    idx_c = np.minimum(idx, max(len(rid_sorted) - 1, 0))
    known = (idx < len(rid_sorted)) & (rid_sorted[idx_c] == rid) if len(rid_sorted) else np.zeros(len(rid), bool)
    if (~known).any():
        problems.append(f"{where}: {int((~known).sum())} rows of request ids missing from the requests table, e.g. {np.unique(rid[~known])[:5].tolist()}")
    k, posk = idx_c[known], pos[known]
    inside = (posk >= 0) & (posk < len_sorted[k])
    if not inside.all():
        bad_r = np.unique(rid[known][~inside])[:5]
        problems.append(f"{where}: positions outside 0..prompt_tokens+output_tokens-1 for requests {bad_r.tolist()}")
    wrong = (posk >= p_sorted[k]) != is_dec[known]
    if wrong.any():
        bad_r = np.unique(rid[known][wrong])[:5]
        problems.append(
            f"{where}: {int(wrong.sum())} rows whose stage disagrees with prompt_tokens (prefill iff position < "
            f"prompt_tokens), requests {bad_r.tolist()}"
        )
    if seen_T is None:
        return 0
    token = start_R[k[inside]] + posk[inside]
    srt = np.sort(token)
    twice = np.concatenate([srt[1:][srt[1:] == srt[:-1]], token[seen_T[token] > 0]])
    for t in np.unique(twice)[: 5 - len(dup_examples)] if len(dup_examples) < 5 else []:
        r = int(np.searchsorted(start_R, t, side="right") - 1)
        dup_examples.append((int(rid_sorted[r]), int(t - start_R[r])))
    seen_T[token] = 1
    return int(len(twice))


def validate(path: str | os.PathLike, *, progress: Callable[[int, int], None] | None = None) -> None:
    """Raise ``TraceValidationError`` listing every problem, or return if the trace is valid."""
    problems = find_problems(path, progress=progress)
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
