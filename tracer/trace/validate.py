"""Check a trace directory against format v1 (docs/trace-format.md) and name every problem found.

``find_problems`` runs the checks of :data:`CHECKS` in order, each a small function that returns
the problems it finds; adding a check is adding one function to that list. They cover:

- the manifest: format, version, model section (``check_manifest``; nothing else is checked
  without it), ``complete``, the ``backend`` and ``collection`` sections, ``totals``;
- the files: both directories exist (nothing else is checked without them), no leftover
  temporary files, every routing part has its requests part and vice versa, a complete trace holds
  parts, every part is readable Parquet with the required columns and types, no prompt/output text
  unless the manifest says it was asked for;
- the requests table: no nulls, ``request_id`` unique, ``prompt_tokens >= 1``, ``output_tokens >= 0``;
- the routing rows, part by part and batch by batch, with the reader's own row checks
  (``checks.RowCheck``): expert ids in ``0 <= id < E`` or ``-1``, rows of known requests at
  positions inside them, ``(request_id, position)`` unique, ``stage`` = prefill below
  ``prompt_tokens`` and decode from there, in a single-stage capture (manifest
  ``collection.stages``, see ``schema.stages_of``) no expert ids in the rows of the stage it did not
  record, and, for a group-limited router (the model's ``n_group``/``topk_group``, DeepSeek-V3:
  8/4), no (token, layer) whose experts span more than ``topk_group`` groups: the router never
  picks such a set, so ids that do are not its logical expert ids (physical slots after an EPLB
  remap, another model's ids); then each request's row count.

Streaming: one part at a time, so memory is bounded by a part, plus one byte per token for the
uniqueness check across parts.

Out of scope: whether the routing is *plausible* (that is what ``analysis`` is for).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.errors import TraceFormatError, TraceValidationError
from moetrace.tracer.trace.checks import (
    RequestIndex,
    RowCheck,
    claimed_tokens,
    column_problems,
    duplicate_request_ids,
    null_problems,
    optional_routing_column_problems,
    request_lengths,
    routing_schema_problems,
    unreadable,
)
from moetrace.tracer.trace.layout import (
    MANIFEST,
    REQUESTS_DIR,
    ROUTING_DIR,
    read_manifest,
)
from moetrace.tracer.trace.schema import (
    REQUIRED_REQUESTS,
    ModelInfo,
    check_manifest_header,
    stages_of,
)

#: stop reading routing parts once this many problems are listed
MAX_REPORTED = 200
#: routing rows read at a time (bounds memory: ~ BATCH_ROWS * (L*K*2 + 16) bytes)
BATCH_ROWS = 65536


@dataclass
class _Run:
    """One run of ``find_problems``: what the checks found so far, for the checks after them."""

    path: Path
    progress: Callable[[int, int], None] | None
    problems: list[str] = field(default_factory=list)  # every problem so far, in check order
    stop: bool = False  # a check found what makes the later ones meaningless
    manifest: dict[str, Any] = field(default_factory=dict)
    model: ModelInfo | None = None
    recorded: frozenset[str] = frozenset()  # the stages the manifest says were recorded
    routing_names: list[str] = field(default_factory=list)  # routing/*.parquet, sorted
    requests_names: list[str] = field(default_factory=list)  # requests/*.parquet, sorted
    requests_table: pa.Table | None = None  # the valid requests parts' rows (the required columns)
    requests: RequestIndex | None = None  # the same, sorted by id
    parts: dict[str, pq.ParquetFile] = field(default_factory=dict)  # routing parts whose footer reads
    rows_on_disk: int = 0  # rows in those footers
    rows: RowCheck | None = None  # the pass over the routing rows


# ---------------------------------------------------------------------------------- the manifest
def check_manifest(run: _Run) -> list[str]:
    """The manifest is a format-v1 manifest with a valid model section (stops the run if not)."""
    try:
        run.manifest = read_manifest(run.path)
        check_manifest_header(run.manifest, where=str(run.path / MANIFEST))
        run.model = ModelInfo.from_dict(run.manifest.get("model") or {})
        run.recorded = stages_of(run.manifest)
    except (TraceFormatError, TypeError, ValueError) as exc:
        run.stop = True
        return [str(exc)]
    return []


def check_complete(run: _Run) -> list[str]:
    """The manifest says ``complete: true``: the collection finished."""
    if run.manifest["complete"]:  # a boolean: check_manifest_header made sure
        return []
    return [f"{MANIFEST}: `complete` is {run.manifest.get('complete')!r}: the collection did not finish (resume it)"]


def check_sections(run: _Run) -> list[str]:
    """The manifest has its ``backend`` and ``collection`` sections, and the backend its name."""
    m = run.manifest
    problems = [
        f"{MANIFEST}: missing section `{key}`" for key in ("backend", "collection") if not isinstance(m.get(key), dict)
    ]
    if isinstance(m.get("backend"), dict) and "name" not in m["backend"]:
        problems.append(f"{MANIFEST}: `backend.name` is missing")
    return problems


# ---------------------------------------------------------------------------------- the files
def check_directories(run: _Run) -> list[str]:
    """``routing/`` and ``requests/`` exist (stops the run if not) and hold no leftover temporary file."""
    problems = []
    for d in (run.path / ROUTING_DIR, run.path / REQUESTS_DIR):
        if not d.is_dir():
            problems.append(f"missing directory {d.name}/")
            run.stop = True
            continue
        problems += [
            f"{d.name}/{f.name}: leftover temporary file (an interrupted write; resume or delete it)"
            for f in d.iterdir()
            if f.name.endswith(".tmp")
        ]
    return problems


def check_part_pairs(run: _Run) -> list[str]:
    """Every routing part has its requests part and vice versa; a complete trace holds committed parts."""
    rnames = {f.name for f in (run.path / ROUTING_DIR).glob("*.parquet")}
    qnames = {f.name for f in (run.path / REQUESTS_DIR).glob("*.parquet")}
    run.routing_names, run.requests_names = sorted(rnames), sorted(qnames)
    problems = [
        f"{ROUTING_DIR}/{n}: no matching {REQUESTS_DIR}/{n} (uncommitted part)" for n in sorted(rnames - qnames)
    ]
    problems += [
        f"{REQUESTS_DIR}/{n}: no matching {ROUTING_DIR}/{n} (its routing rows are missing)"
        for n in sorted(qnames - rnames)
    ]
    if run.manifest["complete"] and not qnames:
        problems.append(
            f"{MANIFEST}: says `complete: true` but the trace holds no committed parts (no requests/*.parquet)"
        )
    return problems


def check_requests_parts(run: _Run) -> list[str]:
    """Each requests part reads, has the required columns and types and no nulls, and holds text
    only if the manifest records that it was opted in; the valid parts make the requests table."""
    m = run.manifest
    text_allowed = bool(m.get("writer", {}).get("with_text") or m.get("collection", {}).get("store_text"))
    problems: list[str] = []
    tables = []
    for n in run.requests_names:
        where = f"{REQUESTS_DIR}/{n}"
        try:
            t = pq.read_table(run.path / REQUESTS_DIR / n)
        except (pa.ArrowException, OSError) as exc:
            problems.append(f"{where}: {unreadable(exc)}")
            continue
        bad = column_problems(t.schema, REQUIRED_REQUESTS, exact=True)
        problems += [f"{where}: {p}" for p in bad]
        if not text_allowed:
            problems += [
                f"{where}: holds `{col}` but the manifest does not record that text was opted in"
                for col in ("prompt_text", "output_text")
                if col in t.column_names and t.column(col).null_count < t.num_rows
            ]
        nulls = [] if bad else null_problems({c: t.column(c) for c in REQUIRED_REQUESTS})
        problems += [f"{where}: {p}" for p in nulls]
        if not bad and not nulls:
            tables.append(t.select(list(REQUIRED_REQUESTS)))
    if tables:
        run.requests_table = pa.concat_tables(tables, promote_options="permissive")  # nullable or not: same values
    return problems


def check_requests_table(run: _Run) -> list[str]:
    """The valid requests parts together: request ids unique, ``prompt_tokens >= 1``, ``output_tokens >= 0``."""
    if run.requests_table is None:
        return []
    rid, ptok, otok = (
        run.requests_table.column(c).to_numpy() for c in ("request_id", "prompt_tokens", "output_tokens")
    )
    run.requests = RequestIndex.of(rid, ptok, otok)
    return duplicate_request_ids(rid) + request_lengths(rid, ptok, otok)


def check_routing_footers(run: _Run) -> list[str]:
    """Each routing part's Parquet footer reads (the row counts, the schema)."""
    problems = []
    for n in run.routing_names:
        try:
            run.parts[n] = pq.ParquetFile(
                run.path / ROUTING_DIR / n, pre_buffer=False
            )  # column chunks read as batches need them
        except (pa.ArrowException, OSError) as exc:
            problems.append(f"{ROUTING_DIR}/{n}: {unreadable(exc)}")
    run.rows_on_disk = sum(pf.metadata.num_rows for pf in run.parts.values())
    return problems


def check_claimed_tokens(run: _Run) -> list[str]:
    """The requests' lengths do not claim far more tokens than the routing parts hold (else the
    per-token checks, which keep one byte per claimed token, are skipped)."""
    assert run.model is not None
    requests = run.requests or RequestIndex.of(*(np.zeros(0, np.int64),) * 3)
    problems = claimed_tokens(requests.num_tokens, run.rows_on_disk, limit=2 * run.rows_on_disk + (1 << 24))
    run.rows = RowCheck(run.model, requests, recorded=run.recorded, group_limit=True, track_rows=not problems)
    return problems


def check_routing_rows(run: _Run) -> list[str]:
    """Each routing part's columns and types, then its rows batch by batch (``checks.ROW_CHECKS``)."""
    assert run.model is not None and run.rows is not None
    problems: list[str] = []
    done = 0

    def tick(rows: int) -> None:
        nonlocal done
        done = min(done + rows, run.rows_on_disk)
        if run.progress is not None:
            run.progress(done, run.rows_on_disk)

    for n in list(run.parts):
        pf = run.parts.pop(n)  # a part's reader keeps what it read until closed: one part alive at a time
        where = f"{ROUTING_DIR}/{n}"
        bad = routing_schema_problems(pf.schema_arrow, run.model, exact=True)
        problems += [f"{where}: {p}" for p in bad + optional_routing_column_problems(pf.schema_arrow, run.model)]
        try:
            if not bad:
                for rb in pf.iter_batches(
                    batch_size=BATCH_ROWS, columns=["request_id", "position", "stage", "experts"]
                ):
                    problems += [f"{where}: {p}" for p in run.rows.batch(rb)[1]]
                    tick(rb.num_rows)
        except (pa.ArrowException, OSError) as exc:
            problems.append(f"{where}: {unreadable(exc)}")
        finally:
            pf.close()
        if len(run.problems) + len(problems) > MAX_REPORTED:
            break
    tick(run.rows_on_disk)  # parts skipped (unreadable, bad schema, too many problems) count as done
    return problems


def check_row_totals(run: _Run) -> list[str]:
    """What the row checks counted over all parts (ids in unrecorded stages, group-limited routing,
    duplicates), then each request's row count against its lengths."""
    assert run.rows is not None
    return run.rows.totals() + run.rows.row_counts()


def check_manifest_totals(run: _Run) -> list[str]:
    """The manifest's ``totals.num_requests`` matches the requests table."""
    totals = run.manifest.get("totals")
    if not isinstance(totals, dict) or run.requests is None:
        return []
    n = len(run.requests.request_id_R)
    if totals.get("num_requests") in (None, n):
        return []
    return [f"{MANIFEST}: totals.num_requests={totals['num_requests']} but the requests table has {n}"]


#: every check, in the order it runs (and its problems are listed)
CHECKS: tuple[Callable[[_Run], list[str]], ...] = (
    check_manifest,
    check_complete,
    check_sections,
    check_directories,
    check_part_pairs,
    check_requests_parts,
    check_requests_table,
    check_routing_footers,
    check_claimed_tokens,
    check_routing_rows,
    check_row_totals,
    check_manifest_totals,
)


def find_problems(path: str | os.PathLike, *, progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Return a list of human-readable problems with the trace at ``path`` (empty: valid).

    ``progress(rows_done, rows_total)`` is called after each batch of routing rows read (and once at
    the end with ``rows_done == rows_total``); the total is the row count in the parts' footers.
    """
    run = _Run(Path(path), progress)
    try:
        for check in CHECKS:
            run.problems += check(run)
            if run.stop:
                break
    finally:
        for pf in run.parts.values():  # parts left open when the run stopped early
            pf.close()
    return run.problems


def validate(path: str | os.PathLike, *, progress: Callable[[int, int], None] | None = None) -> None:
    """Raise ``TraceValidationError`` listing every problem, or return if the trace is valid."""
    problems = find_problems(path, progress=progress)
    if problems:
        raise TraceValidationError(problems)
