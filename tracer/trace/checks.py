"""The data checks of trace format v1, shared by the reader and ``validate``: one named function each.

Two callers run the same checks on the same arrays and get the same messages:

- the reader (``Trace.request_arrays``, ``Trace.iter_token_arrays``) runs them as it streams and
  raises ``TraceFormatError`` at the first problem, so nothing is ever counted twice, as expert 0,
  or at a position that does not exist;
- ``validate`` runs them on every part and batch and lists every problem (with its own manifest and
  file checks around them).

What is checked:

- the manifest against the files (:func:`parts_entry_problems`, :func:`part_list_problems`,
  :func:`totals_problems`): the ``parts`` it lists (each with its requests, tokens and SHA-256s)
  are all on disk, a complete trace holds no part it does not list, and its ``totals`` are what
  the parts hold;
- columns (one part's schema): :func:`column_problems`, :func:`routing_schema_problems`,
  :func:`optional_routing_column_problems` (``exact``: the types of format v1, as ``validate``
  demands; lenient: any integer width, any string kind, what the reader can still read right);
- nulls (:func:`null_problems`);
- the requests table: :func:`duplicate_request_ids`, :func:`request_lengths`,
  :func:`claimed_tokens` (lengths that claim more tokens than the parts hold: checked before one
  byte per claimed token is allocated);
- routing rows, batch by batch, against the requests table (:class:`RowCheck`; the checks listed in
  :data:`ROW_PRECONDITIONS` and :data:`ROW_CHECKS`, in that order): no null value or id, ids ``-1``
  or in ``0 .. num_experts-1``, ``stage`` values (when read), ids only in recorded stages (manifest
  ``collection.stages``), group-limited routing (the model's ``n_group``/``topk_group``: no
  (token, layer) spans more than ``topk_group`` groups), rows of known requests only, positions
  inside their request, ``stage`` agreeing with the position, no ``(request_id, position)`` twice
  (one byte per token of the trace); and, after the last batch, every request's row count.

Adding a row check is one function ``(batch, check) -> list[str]`` appended to :data:`ROW_CHECKS`;
a check that sums over the whole trace keeps its count on :class:`RowCheck` and reports it in
:meth:`RowCheck.totals`. Every check is vectorised (numpy over the batch, no loop over rows).

Messages name the problem, how many rows it hits and a few examples, without the file (the caller
prefixes it).

Shape legend (docs/architecture.md): T tokens (rows of a batch), R requests, L MoE layers, K top-k,
X = L*K, N flat ids of a batch (T*X).

Out of scope: reading files and directories, the manifest (``schema.check_manifest_header``,
``validate``), and what the data means (``analysis``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from moetrace.tracer.trace.arrays import numpy_of, string_scalar
from moetrace.tracer.trace.group_limit import GroupLimit
from moetrace.tracer.trace.layout import PART_RE, REQUESTS_DIR, ROUTING_DIR
from moetrace.tracer.trace.schema import (
    NO_EXPERT,
    REQUIRED_ROUTING,
    STAGE_DECODE,
    STAGE_PREFILL,
    STAGES,
    ModelInfo,
    is_whole,
)

#: offending values quoted in a message
SHOWN = 5
#: requests listed one by one for one kind of request-table problem
LISTED_REQUESTS = 20
_INT32_MAX = int(np.iinfo(np.int32).max)


# ---------------------------------------------------------------------------------- columns
# ---------------------------------------------------------------------------------- manifest vs. files
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
#: the keys of one entry of the manifest's ``parts`` and what each holds
PART_KEYS = ("num_requests", "num_tokens", "routing_sha256", "requests_sha256")
_LIMIT = 1 << 62  # counts a manifest may state (the int64 a reader sums them in)


def parts_entry_problems(parts: object) -> list[str]:
    """The manifest's ``parts`` (None: an older trace, which has none) is an object of committed part
    names -> ``{num_requests, num_tokens: whole numbers, routing_sha256, requests_sha256: 64 hex digits}``."""
    if parts is None:
        return []
    if not isinstance(parts, dict):
        return [f"`parts` must be an object of part name -> entry, got {type(parts).__name__}"]
    problems = []
    for name, entry in parts.items():
        if PART_RE.match(name) is None:
            problems.append(f"`parts` names {name[:80]!r}, which is not a part file name (<prefix>-NNNNNN.parquet)")
        elif not isinstance(entry, dict) or not set(PART_KEYS) <= set(entry):
            problems.append(f"`parts.{name}` must hold {', '.join(PART_KEYS)}")
        elif not all(is_whole(entry[k]) and 0 <= entry[k] < _LIMIT for k in PART_KEYS[:2]):
            problems.append(f"`parts.{name}`: num_requests and num_tokens must be whole, non-negative numbers")
        elif not all(isinstance(entry[k], str) and _SHA256_RE.match(entry[k]) for k in PART_KEYS[2:]):
            problems.append(f"`parts.{name}`: routing_sha256 and requests_sha256 must be 64 lowercase hex digits")
        if len(problems) >= 5:
            break
    return problems


def part_list_problems(
    parts: Mapping[str, Any] | None, *, requests: set[str], routing: set[str], complete: bool
) -> list[str]:
    """The manifest's part list against the committed files on disk (``requests``/``routing``: the file
    names under each): every listed part has both files; a complete trace has no unlisted part."""
    if parts is None:
        return []
    missing = [f"{REQUESTS_DIR}/{n}" for n in sorted(parts) if n not in requests]
    missing += [f"{ROUTING_DIR}/{n}" for n in sorted(parts) if n not in routing]
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} file(s) of parts the manifest lists are missing: {', '.join(missing[:4])}"
            + (" ..." if len(missing) > 4 else "")
        )
    extra = sorted(n for n in requests if n not in parts) if complete else []
    if extra:
        problems.append(
            f"{len(extra)} committed part(s) the manifest does not list: {', '.join(extra[:4])}"
            + (" ..." if len(extra) > 4 else "")
            + " (added after the trace was finished)"
        )
    return problems


def totals_problems(totals: object, *, num_requests: int, num_tokens: int) -> list[str]:
    """The manifest's ``totals`` (None: not written yet) against the requests and routing rows the
    committed parts hold."""
    if not isinstance(totals, dict):
        return []
    problems = []
    for key, have, what in (("num_requests", num_requests, "requests"), ("num_tokens", num_tokens, "routing rows")):
        want = totals.get(key)
        if want is not None and want != have:
            problems.append(f"the manifest's totals.{key} is {want} but the committed parts hold {have} {what}")
    return problems


def _type_ok(got: pa.DataType, want: pa.DataType, *, exact: bool) -> bool:
    if pa.types.is_string(want):
        strings = (pa.string(), pa.large_string())
        return got in strings or (pa.types.is_dictionary(got) and got.value_type in strings)
    if not exact and pa.types.is_integer(want):
        return pa.types.is_integer(got)
    return got == want


def column_problems(schema: pa.Schema, required: Mapping[str, pa.DataType], *, exact: bool) -> list[str]:
    """Required columns missing from ``schema`` or of another type.

    ``exact``: the type must be the format's (a string column may be large or dictionary-encoded);
    otherwise any integer width passes for an integer column.
    """
    problems = []
    for name, typ in required.items():
        if name not in schema.names:
            problems.append(f"missing column `{name}` ({typ})")
        elif not _type_ok(got := schema.field(name).type, typ, exact=exact):
            problems.append(f"column `{name}` has type {got}, expected {typ}")
    return problems


def routing_schema_problems(schema: pa.Schema, model: ModelInfo, *, exact: bool) -> list[str]:
    """A routing part's required columns: ``request_id``, ``position``, ``stage`` (``exact`` only: the
    reader derives the stage from the position) and ``experts``, a fixed-size list of
    ``len(moe_layers) * top_k`` int16 ids (lenient: ids of any integer width)."""
    required = REQUIRED_ROUTING if exact else {k: REQUIRED_ROUTING[k] for k in ("request_id", "position")}
    problems = column_problems(schema, required, exact=exact)
    L, K, X = model.num_moe_layers, model.top_k, model.ids_per_token
    want = f"fixed_size_list<int16>[{X}]"
    if "experts" not in schema.names:
        return [*problems, f"missing column `experts` ({want})"]
    t = schema.field("experts").type
    is_list = pa.types.is_fixed_size_list(t)
    if not (
        is_list and (t.value_type == pa.int16() if exact else pa.types.is_integer(t.value_type)) and t.list_size == X
    ):
        why = (
            f": {t.list_size} ids per token, but the manifest's moe_layers x top_k = {L} x {K} = {X}"
            if is_list and t.list_size != X
            else ""
        )
        problems.append(f"column `experts` has type {t}, expected {want} ({L} MoE layers x top-{K}){why}")
    return problems


def optional_routing_column_problems(schema: pa.Schema, model: ModelInfo) -> list[str]:
    """The optional ``weights`` column, when present: a fixed-size list of ``L*K`` float32 (the rows stay readable)."""
    if "weights" not in schema.names:
        return []
    X, wt = model.ids_per_token, schema.field("weights").type
    if pa.types.is_fixed_size_list(wt) and wt.value_type == pa.float32() and wt.list_size == X:
        return []
    return [f"optional column `weights` has type {wt}, expected fixed_size_list<float32>[{X}]"]


def unreadable(exc: BaseException) -> str:
    """The problem with a Parquet file that pyarrow cannot read (truncated, corrupt, or data this
    pyarrow cannot decode); the reader and ``validate`` both word it so."""
    return f"not readable as Parquet (truncated or corrupt?): {exc}"


def null_problems(columns: Mapping[str, pa.Array | pa.ChunkedArray]) -> list[str]:
    """Columns holding nulls (every column of the format is required)."""
    return [f"{col.null_count} row(s) have a null {name}" for name, col in columns.items() if col.null_count]


# ---------------------------------------------------------------------------------- the requests table
class RequestIndex(NamedTuple):
    """The requests table sorted by request id, as the row checks use it (R rows, int64 each).

    request_id_R ascending; prompt_tokens_R; length_R = prompt + output tokens; start_R = the first
    token of each request in a bitmap of every token of the trace (``cumsum`` of the lengths).
    """

    request_id_R: np.ndarray
    prompt_tokens_R: np.ndarray
    length_R: np.ndarray
    start_R: np.ndarray

    @classmethod
    def of(cls, request_id_R: np.ndarray, prompt_tokens_R: np.ndarray, output_tokens_R: np.ndarray) -> RequestIndex:
        """Sort a requests table (any order, any integer dtypes) by request id."""
        order = np.argsort(request_id_R, kind="stable")
        ptok = np.asarray(prompt_tokens_R, dtype=np.int64)[order]
        length = ptok + np.asarray(output_tokens_R, dtype=np.int64)[order]
        start = np.zeros(length.size, dtype=np.int64)
        np.cumsum(length[:-1], out=start[1:])
        return cls(np.asarray(request_id_R, dtype=np.int64)[order], ptok, length, start)

    @property
    def num_tokens(self) -> int:
        """Tokens the requests table claims (the sum of the lengths)."""
        return int(self.length_R.sum())


def duplicate_request_ids(request_id_R: np.ndarray) -> list[str]:
    """Request ids that appear more than once in the requests table (the first 20, one line each)."""
    uniq, counts = np.unique(request_id_R, return_counts=True)
    return [
        f"requests: request_id {int(r)} appears {int(n)} times"
        for r, n in zip(uniq[counts > 1][:LISTED_REQUESTS], counts[counts > 1][:LISTED_REQUESTS])
    ]


def request_lengths(request_id_R: np.ndarray, prompt_tokens_R: np.ndarray, output_tokens_R: np.ndarray) -> list[str]:
    """``prompt_tokens >= 1``, ``output_tokens >= 0``, both within int32 (the first 20 requests of each kind)."""
    rid, ptok, otok = request_id_R, np.asarray(prompt_tokens_R, np.int64), np.asarray(output_tokens_R, np.int64)
    problems = []
    for name, v, bad, why in (
        ("prompt_tokens", ptok, ptok < 1, "< 1"),
        ("output_tokens", otok, otok < 0, "< 0"),
        ("prompt_tokens", ptok, ptok > _INT32_MAX, "beyond int32"),
        ("output_tokens", otok, otok > _INT32_MAX, "beyond int32"),
    ):
        problems += [
            f"requests: request {int(rid[i])} has {name}={int(v[i])} ({why})"
            for i in np.flatnonzero(bad)[:LISTED_REQUESTS]
        ]
    return problems


def claimed_tokens(claimed: int, rows: int, *, limit: int) -> list[str]:
    """The requests table's lengths add up to more than ``limit`` tokens, where ``rows`` exist.

    Checked before one byte per claimed token is allocated: ``limit`` is the most the caller will
    allocate (the reader: the rows on disk).
    """
    if claimed <= limit:
        return []
    return [
        (
            f"requests: the requests table claims {claimed:,} tokens but the routing parts hold {rows:,} rows "
            "(its prompt_tokens + output_tokens add up to more)"
        )
    ]


# ---------------------------------------------------------------------------------- routing rows
class RowBatch:
    """One batch of routing rows as numpy arrays, and what the row checks derive from it (each once).

    ids_N: the batch's expert ids, flat ``[T*X]`` (int16 in a valid part; another integer width if
    the reader was lenient); request_id_T int64; position_T int64; ``stage``: the Arrow column
    (strings), when it was read.
    """

    def __init__(self, rb: pa.RecordBatch, ids: pa.Array, requests: RequestIndex) -> None:
        self.num_rows = rb.num_rows
        self.ids_N = numpy_of(ids)  # numpy_of, not to_numpy: that imports pandas (arrays module)
        self.request_id_T = numpy_of(rb.column("request_id")).astype(np.int64, copy=False)
        self.position_T = numpy_of(rb.column("position")).astype(np.int64, copy=False)
        self.stage = rb.column("stage") if "stage" in rb.schema.names else None
        self.requests = requests

    @cached_property
    def prefill_decode_T(self) -> tuple[np.ndarray, np.ndarray]:
        """(bool ``[T]`` stage == prefill, bool ``[T]`` stage == decode) of the ``stage`` column."""
        stage = self.stage
        if stage is None:
            raise ValueError("the batch was read without its `stage` column")
        if pa.types.is_dictionary(stage.type):
            stage = stage.cast(pa.string())
        return (
            numpy_of(pc.equal(stage, string_scalar(STAGE_PREFILL))),
            numpy_of(pc.equal(stage, string_scalar(STAGE_DECODE))),
        )

    @cached_property
    def row_T(self) -> np.ndarray:
        """int64 ``[T]``: each row's request (its index in the sorted requests table; 0 where unknown)."""
        rid_R = self.requests.request_id_R
        row = np.searchsorted(rid_R, self.request_id_T)
        return np.minimum(row, max(rid_R.size - 1, 0))

    @cached_property
    def known_T(self) -> np.ndarray:
        """bool ``[T]``: the row's request id is in the requests table."""
        rid_R = self.requests.request_id_R
        return rid_R[self.row_T] == self.request_id_T if rid_R.size else np.zeros(self.num_rows, bool)

    @cached_property
    def all_known(self) -> bool:
        return bool(self.known_T.all())

    def known(self, a_T: np.ndarray) -> np.ndarray:
        """``a_T`` restricted to the rows of known requests (no copy when all are known)."""
        return a_T if self.all_known else a_T[self.known_T]

    @cached_property
    def inside_K(self) -> np.ndarray:
        """bool, one per row of a known request (:meth:`known`): its position lies inside the request."""
        pos = self.known(self.position_T)
        return (pos >= 0) & (pos < self.requests.length_R[self.known(self.row_T)])


class RowCheck:
    """One pass over a trace's routing rows, batch by batch, against its requests table.

    ``recorded``: the stages the manifest says were recorded, when the batches carry the ``stage``
    column (``validate``); ``None``: the batches have no ``stage`` column (the reader derives the
    stage from the position) and the stage checks are skipped. ``group_limit``: count rows that
    break the model's group-limited routing (``validate``). ``track_rows``: keep one byte per token the
    requests table claims, for the duplicate and row-count checks (``False``: not checked, the
    claim was too large to allocate).
    """

    def __init__(
        self,
        model: ModelInfo,
        requests: RequestIndex,
        *,
        recorded: frozenset[str] | None = None,
        group_limit: bool = False,
        track_rows: bool = True,
    ) -> None:
        self.model, self.requests = model, requests
        self.E = model.num_experts
        self.recorded = recorded
        self.unrecorded_rows = dict.fromkeys((s for s in STAGES if recorded is not None and s not in recorded), 0)
        self.group_limit = GroupLimit.of(model) if group_limit else None
        self.seen_T: np.ndarray | None = np.zeros(requests.num_tokens, dtype=np.uint8) if track_rows else None
        self.num_duplicates = 0
        self.duplicate_examples: list[tuple[int, int]] = []

    @property
    def stage_read(self) -> bool:
        return self.recorded is not None

    def batch(self, rb: pa.RecordBatch) -> tuple[RowBatch | None, list[str]]:
        """Check one batch: its arrays (``None`` when a null leaves none to check) and its problems, in check order."""
        ids = rb.column("experts").flatten()
        for pre in ROW_PRECONDITIONS:
            if problems := pre(rb, ids):
                return None, problems
        b = RowBatch(rb, ids, self.requests)
        problems = []
        for check in ROW_CHECKS:
            problems += check(b, self)
        return b, problems

    def totals(self) -> list[str]:
        """Problems counted over the batches so far: ids in unrecorded stages, group-limited routing, duplicates."""
        problems = [
            f"routing: {n} {stage} rows hold expert ids but the manifest's `collection.stages` "
            f"{sorted(self.recorded or (), key=STAGES.index)} says {stage} was not recorded (its rows must be -1)"
            for stage, n in self.unrecorded_rows.items()
            if n
        ]
        if self.group_limit is not None and self.group_limit.num_bad:
            problems.append(self.group_limit.problem())
        if self.num_duplicates:
            problems.append(
                f"routing: {self.num_duplicates} duplicate (request_id, position) rows, e.g. "
                f"{self.duplicate_examples[:SHOWN]} (rows that appear twice would be counted twice)"
            )
        return problems

    def row_counts(self) -> list[str]:
        """After the last batch: requests whose rows on disk are not exactly ``prompt_tokens + output_tokens``
        (not checked without the bitmap, nor where duplicates were already named)."""
        req, seen = self.requests, self.seen_T
        if seen is None or not req.length_R.size or self.num_duplicates:
            return []
        nonempty = req.length_R > 0
        seen_R = np.zeros(req.length_R.size, np.int64)
        seen_R[nonempty] = np.add.reduceat(seen, req.start_R[nonempty], dtype=np.int64)
        short = np.flatnonzero(seen_R != req.length_R)
        if not len(short):
            return []
        ex = [(int(req.request_id_R[i]), int(seen_R[i]), int(req.length_R[i])) for i in short[:SHOWN]]
        return [
            (
                f"routing: {len(short)} requests whose row count differs from prompt_tokens+output_tokens "
                f"(request, rows, expected): {ex}"
            )
        ]


# ---- the checks, in the order they run: before the arrays exist (Arrow), then on them (numpy)
def no_null_values(rb: pa.RecordBatch, ids: pa.Array) -> list[str]:
    """No row has a null request id, position, stage or expert list."""
    return null_problems({name: rb.column(name) for name in rb.schema.names})


def no_null_ids(rb: pa.RecordBatch, ids: pa.Array) -> list[str]:
    """No id inside an ``experts`` list is null."""
    return [f"`experts` lists hold {ids.null_count} null ids"] if ids.null_count else []


def ids_in_range(b: RowBatch, rc: RowCheck) -> list[str]:
    """Every expert id is ``-1`` (not recorded) or in ``0 .. num_experts-1``."""
    ids, E = b.ids_N, rc.E
    if not ids.size or (int(ids.min()) >= NO_EXPERT and int(ids.max()) < E):
        return []
    out = (ids != NO_EXPERT) & ((ids < 0) | (ids >= E))
    return [
        (
            f"{int(out.sum())} expert ids out of range (outside -1 and 0..{E - 1}, num_experts = {E}), "
            f"e.g. {np.unique(ids[out])[:10].tolist()}"
        )
    ]


def stage_values(b: RowBatch, rc: RowCheck) -> list[str]:
    """``stage`` is ``prefill`` or ``decode`` (when the column was read)."""
    if not rc.stage_read:
        return []
    is_pre, is_dec = b.prefill_decode_T
    other = ~(is_pre | is_dec)
    if not other.any():
        return []
    assert b.stage is not None
    vals = pc.unique(pc.filter(b.stage, pa.array(other))).to_pylist()[:SHOWN]
    return [f"`stage` values {vals} (allowed: prefill, decode)"]


def ids_in_recorded_stages(b: RowBatch, rc: RowCheck) -> list[str]:
    """Rows of a stage the manifest says was not recorded hold only ``-1`` (counted; reported in the totals)."""
    if not rc.unrecorded_rows:
        return []
    is_pre, is_dec = b.prefill_decode_T
    has_id = (b.ids_N.reshape(b.num_rows, -1) != NO_EXPERT).any(axis=1) if b.num_rows else np.zeros(0, bool)
    for stage in rc.unrecorded_rows:
        rc.unrecorded_rows[stage] += int((has_id & (is_pre if stage == STAGE_PREFILL else is_dec)).sum())
    return []


def group_limited_routing(b: RowBatch, rc: RowCheck) -> list[str]:
    """No (token, layer) uses experts of more than ``topk_group`` of a group-limited router's ``n_group``
    groups (counted; reported in the totals)."""
    if rc.group_limit is not None:
        rc.group_limit.add(b)
    return []


def rows_of_known_requests(b: RowBatch, rc: RowCheck) -> list[str]:
    """Every row's request id is in the requests table."""
    if b.all_known:
        return []
    unknown = ~b.known_T
    return [
        (
            f"{int(unknown.sum())} rows of request ids {np.unique(b.request_id_T[unknown])[:SHOWN].tolist()} have no "
            f"row in {REQUESTS_DIR}/*.parquet"
        )
    ]


def positions_inside_requests(b: RowBatch, rc: RowCheck) -> list[str]:
    """Every row's position lies in ``0 .. prompt_tokens + output_tokens - 1`` of its request."""
    inside = b.inside_K
    if inside.all():
        return []
    i = int(np.flatnonzero(~inside)[0])
    rid, pos, row = b.known(b.request_id_T), b.known(b.position_T), b.known(b.row_T)
    return [
        (
            f"{int((~inside).sum())} row(s) lie outside their request (positions 0..prompt_tokens+output_tokens-1) in "
            f"requests {np.unique(rid[~inside])[:SHOWN].tolist()}, e.g. request {rid[i]} position {pos[i]} (it has "
            f"{rc.requests.length_R[row[i]]} tokens)"
        )
    ]


def stage_matches_position(b: RowBatch, rc: RowCheck) -> list[str]:
    """``stage`` is prefill exactly below the request's ``prompt_tokens`` (when the column was read)."""
    if not rc.stage_read:
        return []
    wrong = (b.known(b.position_T) >= rc.requests.prompt_tokens_R[b.known(b.row_T)]) != b.known(b.prefill_decode_T[1])
    if not wrong.any():
        return []
    return [
        (
            f"{int(wrong.sum())} rows whose stage disagrees with prompt_tokens (prefill iff position < "
            f"prompt_tokens), requests {np.unique(b.known(b.request_id_T)[wrong])[:SHOWN].tolist()}"
        )
    ]


def no_duplicate_rows(b: RowBatch, rc: RowCheck) -> list[str]:
    """No ``(request_id, position)`` row appears twice, in this batch or an earlier one (counted; reported
    in the totals). Memory: the one byte per token of :class:`RowCheck`."""
    seen = rc.seen_T
    if seen is None:
        return []
    inside = b.inside_K
    all_inside = bool(inside.all())
    row, pos = b.known(b.row_T), b.known(b.position_T)
    start = rc.requests.start_R
    token = start[row] + pos if all_inside else start[row[inside]] + pos[inside]
    srt = np.sort(token)
    twice = np.concatenate([srt[1:][srt[1:] == srt[:-1]], token[seen[token] > 0]])
    if len(twice) and len(rc.duplicate_examples) < SHOWN:
        for t in np.unique(twice)[: SHOWN - len(rc.duplicate_examples)]:
            r = int(np.searchsorted(start, t, side="right") - 1)
            rc.duplicate_examples.append((int(rc.requests.request_id_R[r]), int(t - start[r])))
    seen[token] = 1
    rc.num_duplicates += len(twice)
    return []


#: checks on the Arrow batch; the first with a problem ends the batch's checks (no arrays to check)
ROW_PRECONDITIONS: tuple[Callable[[pa.RecordBatch, pa.Array], list[str]], ...] = (no_null_values, no_null_ids)
#: checks on the batch's arrays, in order
ROW_CHECKS: tuple[Callable[[RowBatch, RowCheck], list[str]], ...] = (
    ids_in_range,
    group_limited_routing,
    stage_values,
    ids_in_recorded_stages,
    rows_of_known_requests,
    positions_inside_requests,
    stage_matches_position,
    no_duplicate_rows,
)
