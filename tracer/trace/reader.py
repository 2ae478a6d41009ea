"""The trace reader: open a trace directory and stream its rows, checked against the manifest.

Readers trust nothing. :meth:`Trace.iter_token_arrays` (the one streaming path every analysis
uses) checks, part by part and batch by batch, that

- the ``experts`` list holds ``len(moe_layers) * top_k`` ids, as the manifest says;
- no row, request id, position or expert list is null;
- every id is ``-1`` (not recorded) or in ``0 .. num_experts-1``;
- every row belongs to a request of the requests table, at a position inside that request;
- no ``(request_id, position)`` row appears twice (a bitmap of one byte per token of the trace);
- the requests table holds no duplicate ids, prompt lengths >= 1, output lengths >= 0, and no more
  tokens than the routing parts hold rows (checked before anything is allocated).

Any violation raises :class:`~moetrace.errors.TraceFormatError` naming the file, the first
offending values and ``moetrace validate``, so nothing is ever counted twice, as expert 0, or at
a position that does not exist. ``is_decode_T`` is derived from the position and the request's
prompt length (the ``stage`` column is checked by ``validate``).

Shape legend (docs/architecture.md): T tokens, R requests, L MoE layers, K top-k, X = L*K.

Out of scope: writing (``writer``), the full list of every problem at once (``validate``).
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.errors import TraceFormatError
from moetrace.tracer.trace.layout import MANIFEST, REQUESTS_DIR, ROUTING_DIR, read_manifest
from moetrace.tracer.trace.schema import NO_EXPERT, ModelInfo, check_manifest_header, requests_schema, routing_schema

_SHOWN = 5  # offending values quoted in an error


class RequestArrays(NamedTuple):
    """The requests table as arrays sorted by request id (one row per request, R rows).

    request_id_R int64 (unique), dataset_R str, prompt_tokens_R int32 (>= 1), output_tokens_R int32 (>= 0).
    """

    request_id_R: np.ndarray
    dataset_R: np.ndarray
    prompt_tokens_R: np.ndarray
    output_tokens_R: np.ndarray


class TokenArrays(NamedTuple):
    """Routing rows as numpy arrays (the fast path), checked against the manifest.

    request_id_T int64, position_T int32, is_decode_T bool, topk_ids_TLK int16 (-1: not recorded),
    row_T int64 (the token's request: its row in :meth:`Trace.request_arrays`).
    """

    request_id_T: np.ndarray
    position_T: np.ndarray
    is_decode_T: np.ndarray
    topk_ids_TLK: np.ndarray
    row_T: np.ndarray


class Trace:
    """A trace directory opened for reading. Use :func:`open_trace`."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.model = ModelInfo.from_dict(manifest.get("model"))

    def __repr__(self) -> str:
        return f"Trace({str(self.path)!r}, model={self.model.name!r}, complete={self.manifest.get('complete')})"

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def part_names(self) -> list[str]:
        """Committed parts (a requests file exists), in name order."""
        return sorted(f.name for f in (self.path / REQUESTS_DIR).glob("*.parquet"))

    def routing_files(self) -> list[Path]:
        return [self.path / ROUTING_DIR / n for n in self.part_names()]

    def requests_files(self) -> list[Path]:
        return [self.path / REQUESTS_DIR / n for n in self.part_names()]

    def requests(self) -> "pl.LazyFrame":  # noqa: F821
        """One row per request: ``request_id, dataset, prompt_tokens, output_tokens`` (+ extras)."""
        import polars as pl

        files = self.requests_files()
        if not files:
            return pl.LazyFrame(schema=pl.Schema(pl.from_arrow(requests_schema(with_text=False).empty_table()).schema))
        return pl.scan_parquet(files)

    def routing(self) -> "pl.LazyFrame":  # noqa: F821
        """One row per token: ``request_id, position, stage, experts`` (``Array[i16, L*K]``)."""
        import polars as pl

        files = self.routing_files()
        if not files:
            empty = routing_schema(self.model.ids_per_token, with_weights=False).empty_table()
            return pl.from_arrow(empty).lazy()
        return pl.scan_parquet(files)

    def num_tokens(self) -> int:
        """Routing rows in the committed parts (from the Parquet footers; nothing is decoded)."""
        return sum(_num_rows(f, self.path) for f in self.routing_files())

    @cached_property
    def request_arrays(self) -> RequestArrays:
        """The requests table as arrays sorted by request id, checked (see the module docstring)."""
        files = self.requests_files()
        if not files:
            raise TraceFormatError(f"{self.path}: the trace holds no committed requests")
        cols = ["request_id", "dataset", "prompt_tokens", "output_tokens"]
        try:
            table = pa.concat_tables([pq.read_table(f, columns=cols) for f in files], promote_options="permissive")
        except (pa.ArrowException, OSError, KeyError) as exc:
            raise TraceFormatError(f"{self.path}: a requests part cannot be read ({exc}); run `moetrace validate {self.path}`") from exc
        for c in cols:
            col = table.column(c)
            if col.null_count:
                raise TraceFormatError(f"{self.path}: {col.null_count} request(s) have a null {c}; run `moetrace validate {self.path}`")
            integer = pa.types.is_integer(col.type)
            if (c != "dataset") != integer or (c == "dataset" and not pa.types.is_string(col.type) and not pa.types.is_large_string(col.type)):
                raise TraceFormatError(f"{self.path}: requests column {c} has type {col.type}; run `moetrace validate {self.path}`")
        rid = table.column("request_id").to_numpy().astype(np.int64)
        order = np.argsort(rid, kind="stable")
        rid = rid[order]
        dup = rid[1:][rid[1:] == rid[:-1]]
        if dup.size:
            raise TraceFormatError(f"{self.path}: request ids {np.unique(dup)[:_SHOWN].tolist()} appear twice in "
                                   f"requests/*.parquet; run `moetrace validate {self.path}`")
        ptok = table.column("prompt_tokens").to_numpy()[order]
        otok = table.column("output_tokens").to_numpy()[order]
        bad = (ptok < 1) | (otok < 0) | (ptok > np.iinfo(np.int32).max) | (otok > np.iinfo(np.int32).max)
        if bad.any():
            raise TraceFormatError(f"{self.path}: requests {rid[bad][:_SHOWN].tolist()} have prompt_tokens < 1, "
                                   f"output_tokens < 0 or lengths beyond int32; run `moetrace validate {self.path}`")
        rows = self.num_tokens()
        claimed = int(ptok.astype(np.int64).sum() + otok.astype(np.int64).sum())
        if claimed > rows:  # checked before one byte per claimed token is allocated
            raise TraceFormatError(
                f"{self.path}: the requests table claims {claimed:,} tokens but the routing parts hold {rows:,} rows; "
                f"the trace is damaged: run `moetrace validate {self.path}`"
            )
        dataset = np.asarray(table.column("dataset").to_pylist(), dtype=str)[order]
        return RequestArrays(rid, dataset, ptok.astype(np.int32), otok.astype(np.int32))

    def iter_token_arrays(self, *, batch_tokens: int = 1 << 20) -> Iterator[TokenArrays]:
        """Stream the routing rows as checked numpy arrays, part by part, row group by row group.

        Memory: one batch of ``batch_tokens`` rows plus one byte per token of the trace.
        Raises ``TraceFormatError`` at the first row that breaks the format (module docstring).
        """
        req = self.request_arrays
        check = _RowCheck(self, req)
        for f in self.routing_files():
            try:
                # pre_buffer=False: read a column chunk when its batch needs it, not a whole row group's
                # worth ahead (at 65,536 tokens per batch that halves the peak of reading a part)
                pf = pq.ParquetFile(f, pre_buffer=False)
                check.schema(f, pf.schema_arrow)
                batches = pf.iter_batches(batch_size=batch_tokens, columns=["request_id", "position", "experts"])
                for rb in batches:
                    yield check.batch(f, rb)
            except (pa.ArrowException, OSError, KeyError) as exc:
                raise TraceFormatError(
                    f"{f}: cannot read this routing part ({exc}); run `moetrace validate {self.path}` for details"
                ) from exc

    def token_arrays(self) -> TokenArrays:
        """All routing rows as numpy arrays ``[T, L, K]`` (loads the whole trace into memory)."""
        parts = list(self.iter_token_arrays())
        if not parts:
            L, K = self.model.num_moe_layers, self.model.top_k
            return TokenArrays(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, bool),
                               np.zeros((0, L, K), np.int16), np.zeros(0, np.int64))
        return TokenArrays(*(np.concatenate(cols) for cols in zip(*parts)))


def _num_rows(f: Path, trace_path: Path) -> int:
    try:
        return pq.read_metadata(f).num_rows
    except (pa.ArrowException, OSError) as exc:
        raise TraceFormatError(f"{f}: cannot read this routing part ({exc}); run `moetrace validate {trace_path}`") from exc


class _RowCheck:
    """The state of one pass over the routing rows: which (request, position) rows were seen."""

    def __init__(self, trace: Trace, req: RequestArrays) -> None:
        m = trace.model
        self.path, self.L, self.K, self.E = trace.path, m.num_moe_layers, m.top_k, m.num_experts
        self.req = req
        length_R = req.prompt_tokens_R.astype(np.int64) + req.output_tokens_R
        self.length_R = length_R
        self.start_R = np.concatenate([[0], np.cumsum(length_R)[:-1]]).astype(np.int64)
        self.seen_T = np.zeros(int(length_R.sum()), dtype=bool)

    def _fail(self, f: Path, what: str) -> None:
        raise TraceFormatError(f"{f}: {what}; the trace is damaged: run `moetrace validate {self.path}`")

    def schema(self, f: Path, schema: pa.Schema) -> None:
        X = self.L * self.K
        for name in ("request_id", "position", "experts"):
            if schema.get_field_index(name) < 0:
                self._fail(f, f"no column {name!r}")
        t = schema.field("experts").type
        if not pa.types.is_fixed_size_list(t) or not pa.types.is_integer(t.value_type):
            self._fail(f, f"`experts` has type {t}, not fixed_size_list<int16>[{X}]")
        if t.list_size != X:
            self._fail(f, f"`experts` holds {t.list_size} ids per token, but the manifest's moe_layers x top_k = "
                          f"{self.L} x {self.K} = {X}")
        for name in ("request_id", "position"):
            if not pa.types.is_integer(schema.field(name).type):
                self._fail(f, f"`{name}` has type {schema.field(name).type}, not an integer")

    def batch(self, f: Path, rb: pa.RecordBatch) -> TokenArrays:
        T = rb.num_rows
        for name in ("request_id", "position", "experts"):
            if rb.column(name).null_count:
                self._fail(f, f"{rb.column(name).null_count} row(s) have a null {name}")
        values = rb.column("experts").flatten()
        if values.null_count:
            self._fail(f, f"{values.null_count} expert id(s) are null inside an `experts` list")
        flat = values.to_numpy(zero_copy_only=False)
        if flat.size and (int(flat.min()) < NO_EXPERT or int(flat.max()) >= self.E):
            bad = flat[(flat < NO_EXPERT) | (flat >= self.E)]
            self._fail(f, f"expert ids {np.unique(bad)[:_SHOWN].tolist()} are outside -1 and 0..{self.E - 1} (num_experts)")
        rid_T = rb.column("request_id").to_numpy().astype(np.int64, copy=False)
        pos_T = rb.column("position").to_numpy().astype(np.int64, copy=False)
        rid_R = self.req.request_id_R
        row_T = np.searchsorted(rid_R, rid_T)
        row_T[row_T >= rid_R.size] = 0
        unknown = rid_R[row_T] != rid_T if rid_R.size else np.ones(T, bool)
        if unknown.any():
            self._fail(f, f"routing rows of request ids {np.unique(rid_T[unknown])[:_SHOWN].tolist()} have no row in "
                          "requests/*.parquet")
        outside = (pos_T < 0) | (pos_T >= self.length_R[row_T])
        if outside.any():
            i = int(np.flatnonzero(outside)[0])
            self._fail(f, f"{int(outside.sum())} row(s) lie outside their request (e.g. request {rid_T[i]} position "
                          f"{pos_T[i]}; it has {self.length_R[row_T[i]]} tokens)")
        idx_T = self.start_R[row_T] + pos_T
        again = self.seen_T[idx_T]
        if not again.any():
            srt = np.sort(idx_T)
            twice = srt[1:][srt[1:] == srt[:-1]]
            again = np.isin(idx_T, twice[:1])
        if again.any():
            i = int(np.flatnonzero(again)[0])
            self._fail(f, f"(request_id, position) rows appear twice (e.g. request {rid_T[i]} position {pos_T[i]}); "
                          "a duplicate would be counted twice")
        self.seen_T[idx_T] = True
        return TokenArrays(rid_T, pos_T.astype(np.int32), pos_T >= self.req.prompt_tokens_R[row_T],
                           flat.astype(np.int16, copy=False).reshape(T, self.L, self.K), row_T)


def open_trace(path: str | os.PathLike, *, require_complete: bool = True) -> Trace:
    """Open the trace directory ``path`` for reading.

    Raises ``TraceFormatError`` if it is not a format-v1 trace, or (with ``require_complete``) if its
    collection has not finished; ``moetrace collect --resume`` completes it.
    """
    p = Path(path)
    manifest = read_manifest(p)
    check_manifest_header(manifest, where=str(p / MANIFEST))
    if require_complete and not manifest.get("complete"):
        raise TraceFormatError(
            f"{p}: the trace is incomplete (manifest `complete: false`): its collection was interrupted or is "
            "still running. Resume it by re-running the same command with --resume, or pass "
            "--allow-incomplete to read the committed part."
        )
    missing = [f"{ROUTING_DIR}/{f.name}" for f in sorted((p / REQUESTS_DIR).glob("*.parquet"))
               if not (p / ROUTING_DIR / f.name).is_file()]
    if missing:
        raise TraceFormatError(
            f"{p}: committed part(s) without their routing file: {missing[:3]}; the trace is damaged "
            f"(run `moetrace validate {p}`)"
        )
    return Trace(p, manifest)
