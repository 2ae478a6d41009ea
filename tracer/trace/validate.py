"""Check a trace directory against format v1 (docs/trace-format.md) and name every problem found.

``find_problems`` runs the checks of :data:`CHECKS` in order, each a small function that returns
the problems it finds; adding a check is adding one function to that list. They cover:

- the manifest: format, version, model section (``check_manifest``; nothing else is checked
  without it), the type of every field (``version: true`` or ``1.0`` is not ``1``), ``complete``,
  the ``backend`` and ``collection`` sections, ``totals`` against the parts' rows, and the part
  list (``parts``) against the files, each part's row counts and SHA-256 against what its writer
  recorded at commit (an older trace without ``parts`` validates, with a note that it carries none;
  the files are hashed on a background thread while the rows are read, and their problems listed
  after the rows');
- the files: both directories exist (nothing else is checked without them), no leftover
  temporary files, each Parquet footer's row count equal to its row groups' and to the rows its
  pages hold, every routing part has its requests part and vice versa, a complete trace holds
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.errors import TraceFormatError, TraceValidationError
from moetrace.tracer.trace.arrays import numpy_of
from moetrace.tracer.trace.checks import (
    PART_KEYS,
    RequestIndex,
    RowCheck,
    claimed_tokens,
    column_problems,
    duplicate_request_ids,
    null_problems,
    optional_routing_column_problems,
    part_list_problems,
    parts_entry_problems,
    request_lengths,
    routing_schema_problems,
    totals_problems,
    unreadable,
)
from moetrace.tracer.trace.checksum import hash_files
from moetrace.tracer.trace.layout import (
    MANIFEST,
    REQUESTS_DIR,
    ROUTING_DIR,
    read_manifest,
)
from moetrace.tracer.trace.schema import (
    REQUIRED_REQUESTS,
    VERSION,
    ModelInfo,
    check_manifest_header,
    is_whole,
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
    notes: list[str] = field(default_factory=list)  # what is worth saying of a valid trace (no checksums)
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
    rows_read: dict[str, int] = field(default_factory=dict)  # routing part -> rows its pages held
    requests_rows: dict[str, int] = field(default_factory=dict)  # requests part -> rows read
    rows: RowCheck | None = None  # the pass over the routing rows
    hasher: ThreadPoolExecutor | None = None  # hashes the parts' files in the background (check_checksums)
    digests: list[tuple[str, str, Future[str]]] = field(default_factory=list)  # (file, recorded SHA-256, its hash)


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


#: the manifest's top-level fields and the JSON type each must have (``model``: ``ModelInfo`` checks it)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "format": (str,),
    "moetrace_version": (str,),
    "backend": (dict,),
    "collection": (dict,),
    "writer": (dict,),
    "totals": (dict,),
    "parts": (dict,),
    "shards": (list,),
}


def check_manifest_fields(run: _Run) -> list[str]:
    """Every manifest field has its type: ``version`` the whole number 1 (not ``true`` or ``1.0``), the
    sections objects, the ``writer`` flags booleans, ``parts`` entries whole counts and SHA-256s."""
    m = run.manifest
    problems = []
    if not is_whole(m.get("version")) or m.get("version") != VERSION:
        problems.append(f"{MANIFEST}: `version` must be the whole number {VERSION}, got {m.get('version')!r}")
    for key, types in _FIELD_TYPES.items():
        if key in m and not isinstance(m[key], types):
            problems.append(f"{MANIFEST}: `{key}` must be a JSON {_json_type(types[0])}, got {m[key]!r:.80}")
    writer = m.get("writer")
    if isinstance(writer, dict):
        problems += [
            f"{MANIFEST}: `writer.{k}` must be true or false, got {writer[k]!r:.40}"
            for k in ("with_weights", "with_text")
            if k in writer and not isinstance(writer[k], bool)
        ]
        if "compression" in writer and not isinstance(writer["compression"], str):
            problems.append(f"{MANIFEST}: `writer.compression` must be a string, got {writer['compression']!r:.40}")
    problems += [f"{MANIFEST}: {p}" for p in parts_entry_problems(m.get("parts"))]
    return problems


def _json_type(t: type) -> str:
    names: dict[type, str] = {str: "string", dict: "object", list: "array"}
    return names.get(t, t.__name__)


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
    parts = run.manifest.get("parts")
    if not isinstance(parts, dict):
        run.notes.append(
            f"{MANIFEST} lists no parts and no checksums (written by an older moetrace): lost or changed parts "
            "are caught only through the totals"
        )
    elif not parts_entry_problems(parts):
        problems += [
            f"{MANIFEST}: {p}"
            for p in part_list_problems(parts, requests=qnames, routing=rnames, complete=run.manifest["complete"])
        ]
    return problems


def start_checksums(run: _Run) -> list[str]:
    """Start hashing every file of the parts the manifest lists, on a background thread (``check_checksums``
    compares the digests once the rows are read: sha256 releases the GIL, so the hash overlaps the reading)."""
    parts = run.manifest.get("parts")
    if not isinstance(parts, dict) or parts_entry_problems(parts):
        return []
    files = [
        (f"{sub}/{name}", entry[key], run.path / sub / name)
        for name, entry in sorted(parts.items())
        for sub, key in ((ROUTING_DIR, "routing_sha256"), (REQUESTS_DIR, "requests_sha256"))
        if (run.path / sub / name).is_file()  # check_part_pairs names a missing one
    ]
    run.hasher, futures = hash_files([f for _, _, f in files])
    run.digests = [(where, want, fut) for (where, want, _), fut in zip(files, futures, strict=True)]
    return []


def check_checksums(run: _Run) -> list[str]:
    """Each part the manifest lists has the SHA-256 its writer recorded at commit (both files)."""
    problems = []
    for where, want, fut in run.digests:
        try:
            digest = fut.result()
        except OSError as exc:
            problems.append(f"{where}: {unreadable(exc)}")
            continue
        if digest != want:
            problems.append(
                f"{where}: its SHA-256 differs from the one recorded when it was committed (the file "
                "changed since: a bit flip, an edit, or a damaged copy)"
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
            # ParquetFile, not read_table: read_table goes through pyarrow.dataset, which imports pandas
            with pq.ParquetFile(run.path / REQUESTS_DIR / n) as pf:
                t = pf.read()
                meta = pf.metadata
            problems += [f"{where}: {p}" for p in _row_count_problems(meta)]
        except (pa.ArrowException, OSError) as exc:
            problems.append(f"{where}: {unreadable(exc)}")
            continue
        run.requests_rows[n] = t.num_rows
        meta_rows = meta.num_rows
        if t.num_rows != meta_rows:
            problems.append(f"{where}: the footer says {meta_rows} rows but its pages hold {t.num_rows}")
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
        if not bad and not nulls:  # `dataset` as plain strings: parts may encode it differently (large, dictionary)
            t = t.select(list(REQUIRED_REQUESTS))
            i = t.schema.get_field_index("dataset")
            tables.append(t.set_column(i, t.schema.field(i).with_type(pa.string()), t.column(i).cast(pa.string())))
    if tables:
        run.requests_table = pa.concat_tables(tables, promote_options="permissive")  # nullable or not: same values
    return problems


def check_requests_table(run: _Run) -> list[str]:
    """The valid requests parts together: request ids unique, ``prompt_tokens >= 1``, ``output_tokens >= 0``."""
    if run.requests_table is None:
        return []
    rid, ptok, otok = (numpy_of(run.requests_table.column(c)) for c in ("request_id", "prompt_tokens", "output_tokens"))
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
            continue
        problems += [f"{ROUTING_DIR}/{n}: {p}" for p in _row_count_problems(run.parts[n].metadata)]
    run.rows_on_disk = sum(pf.metadata.num_rows for pf in run.parts.values())
    return problems


def _row_count_problems(meta: pq.FileMetaData) -> list[str]:
    """The footer's row count against its row groups', and each row group's against its column chunks'
    value counts (a flat column: one value per row; a list column: at least one)."""
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    problems = []
    in_groups = sum(rg.num_rows for rg in groups)
    if in_groups != meta.num_rows:
        problems.append(f"the footer says {meta.num_rows} rows but its row groups hold {in_groups}")
    for i, rg in enumerate(groups):
        for c in range(rg.num_columns):
            col = rg.column(c)
            flat = "." not in col.path_in_schema
            if (flat and col.num_values != rg.num_rows) or (not flat and col.num_values < rg.num_rows):
                problems.append(
                    f"row group {i} says {rg.num_rows} rows but column `{col.path_in_schema}` holds "
                    f"{col.num_values} values"
                )
                break
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
        read = 0
        try:
            if not bad:
                for rb in pf.iter_batches(
                    batch_size=BATCH_ROWS, columns=["request_id", "position", "stage", "experts"]
                ):
                    problems += [f"{where}: {p}" for p in run.rows.batch(rb)[1]]
                    read += rb.num_rows
                    tick(rb.num_rows)
                run.rows_read[n] = read
                if read != pf.metadata.num_rows:
                    problems.append(f"{where}: the footer says {pf.metadata.num_rows} rows but its pages hold {read}")
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
    """The manifest's ``totals`` (requests, tokens) match the parts of a complete trace, and each part's
    entry in ``parts`` its rows."""
    problems = []
    if run.manifest["complete"] and run.requests is not None and len(run.rows_read) == len(run.routing_names):
        problems += [
            f"{MANIFEST}: {p}"
            for p in totals_problems(
                run.manifest.get("totals"),
                num_requests=len(run.requests.request_id_R),
                num_tokens=sum(run.rows_read.values()),
            )
        ]
    parts = run.manifest.get("parts")
    if isinstance(parts, dict) and not parts_entry_problems(parts):
        for name, entry in sorted(parts.items()):
            for key, have in ((PART_KEYS[0], run.requests_rows.get(name)), (PART_KEYS[1], run.rows_read.get(name))):
                if have is not None and have != entry[key]:
                    problems.append(f"{MANIFEST}: parts.{name}.{key} is {entry[key]} but the part holds {have} rows")
    return problems


#: every check, in the order it runs (and its problems are listed)
CHECKS: tuple[Callable[[_Run], list[str]], ...] = (
    check_manifest,
    check_manifest_fields,
    check_complete,
    check_sections,
    check_directories,
    check_part_pairs,
    start_checksums,
    check_requests_parts,
    check_requests_table,
    check_routing_footers,
    check_claimed_tokens,
    check_routing_rows,
    check_row_totals,
    check_checksums,
    check_manifest_totals,
)


def find_problems(path: str | os.PathLike, *, progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Return a list of human-readable problems with the trace at ``path`` (empty: valid).

    ``progress(rows_done, rows_total)`` is called after each batch of routing rows read (and once at
    the end with ``rows_done == rows_total``); the total is the row count in the parts' footers.
    """
    return _run_checks(Path(path), progress).problems


def _run_checks(path: Path, progress: Callable[[int, int], None] | None) -> _Run:
    run = _Run(path, progress)
    try:
        for check in CHECKS:
            run.problems += check(run)
            if run.stop:
                break
    finally:
        for pf in run.parts.values():  # parts left open when the run stopped early
            pf.close()
        if run.hasher is not None:  # a run that stopped early drops the hashing it no longer needs
            run.hasher.shutdown(wait=True, cancel_futures=True)
    return run


def validate(path: str | os.PathLike, *, progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Raise ``TraceValidationError`` listing every problem; if the trace is valid, return the notes
    worth printing with it (an older trace that records no checksums says so)."""
    run = _run_checks(Path(path), progress)
    if run.problems:
        raise TraceValidationError(run.problems)
    return run.notes
