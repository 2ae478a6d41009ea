"""The trace reader: open a trace directory and stream its rows, checked against the manifest.

Readers trust nothing. :meth:`Trace.iter_token_arrays` (the one streaming path every analysis
uses) runs the row checks of ``checks`` (the very functions ``validate`` runs), part by part and
batch by batch:

- the ``experts`` list holds ``len(moe_layers) * top_k`` integer ids, as the manifest says;
- no row, request id, position or expert list is null;
- every id is ``-1`` (not recorded) or in ``0 .. num_experts-1``;
- every row belongs to a request of the requests table, at a position inside that request;
- no ``(request_id, position)`` row appears twice (a bitmap of one byte per token of the trace);
- the requests table holds no duplicate ids, prompt lengths >= 1, output lengths >= 0, and no more
  tokens than the routing parts hold rows (checked before anything is allocated).

Before any row, the trace is checked against its own manifest: :func:`open_trace` refuses a trace
whose manifest lists parts that are not on disk (naming them), or, when complete, holds parts it
does not list; :attr:`Trace.request_arrays` refuses a complete trace whose ``totals`` (requests,
tokens) are not what its parts hold (older traces carry no part list; their totals still catch a
lost part). ``require_complete=False`` (the CLI's ``--allow-incomplete``) reads what is there
instead. Every part is checked against the SHA-256 its writer recorded as it is read
(:class:`PartHashes`: the file hashed on a background thread beside the read; the requests parts by
:attr:`Trace.request_arrays`, each routing part by :meth:`Trace.iter_token_arrays` once its rows are
read, before any total is taken), so bit rot or an edit that keeps the rows valid stops the reader
with one line naming the part and ``moetrace validate``. :meth:`Trace.verify_checksums` hashes every
part at once.

Any violation raises :class:`~moetrace.errors.TraceFormatError` naming the file, the first
problem and ``moetrace validate``, so nothing is ever counted twice, as expert 0, or at a position
that does not exist. ``is_decode_T`` is derived from the position and the request's prompt length
(the ``stage`` column, the group-limited routing and each request's row count are checked by
``validate``). The reader accepts any integer width where the format says int16/int32/int64 (it
reads the values right); ``validate`` insists on the format's types.

Shape legend (docs/architecture.md): T tokens, R requests, L MoE layers, K top-k, X = L*K.

Out of scope: writing (``writer``), the full list of every problem at once (``validate``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.errors import TraceFormatError, option_hint
from moetrace.tracer.trace.arrays import numpy_of
from moetrace.tracer.trace.checks import (
    RequestIndex,
    RowCheck,
    claimed_tokens,
    column_problems,
    duplicate_request_ids,
    null_problems,
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
from moetrace.tracer.trace.read_ahead import read_ahead
from moetrace.tracer.trace.schema import (
    REQUIRED_REQUESTS,
    ModelInfo,
    check_manifest_header,
    requests_schema,
    routing_schema,
)

if TYPE_CHECKING:
    import polars as pl


#: the hints naming ``--allow-incomplete``, dropped by the CLI for a command without it (``errors.option_hint``)
_READ_WHAT_IS_THERE = option_hint("--allow-incomplete", " (pass --allow-incomplete to read what is there)")
_READ_COMMITTED = option_hint("--allow-incomplete", " Pass --allow-incomplete to read the committed part.")
_PASS_ALLOW_INCOMPLETE = option_hint("--allow-incomplete", " Pass --allow-incomplete to read what is there")


def _scan_parts(files: list[Path]) -> pl.LazyFrame:
    """The parts as one lazy frame over the union of their columns: a column only some parts hold (an extra
    text column, ``prompt_text`` written into one part) is null in the others, and an integer column of
    another width, or a string column large or dictionary-encoded, is read at the wider type, as the
    readers accept them; one ``scan_parquet`` of them all takes the first part's columns for every part and
    stops at the first that differs."""
    import polars as pl

    return pl.concat([pl.scan_parquet(f) for f in files], how="diagonal_relaxed")


def _decoded(table: pa.Table) -> pa.Table:
    """``table`` with its dictionary-encoded columns decoded (a part may store ``dataset`` dictionary-encoded
    and the next one plainly: the format allows both, and only decoded columns concatenate)."""
    for i, f in enumerate(table.schema):
        if pa.types.is_dictionary(f.type):
            table = table.set_column(i, f.with_type(f.type.value_type), table.column(i).cast(f.type.value_type))
    return table


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

    def __init__(self, path: Path, manifest: dict[str, Any], *, strict: bool = True) -> None:
        self.path = path
        self.manifest = manifest
        self.model = ModelInfo.from_dict(manifest.get("model"))
        #: refuse data that disagrees with the manifest's totals (False: read what is there)
        self.strict = strict

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

    def requests(self) -> pl.LazyFrame:
        """One row per request: ``request_id, dataset, prompt_tokens, output_tokens`` (+ extras)."""
        import polars as pl

        files = self.requests_files()
        if not files:
            empty = pl.from_arrow(requests_schema(with_text=False).empty_table())
            assert isinstance(empty, pl.DataFrame)  # from_arrow is typed DataFrame | Series; a Table gives a DataFrame
            return pl.LazyFrame(schema=pl.Schema(empty.schema))
        return _scan_parts(files)

    def routing(self) -> pl.LazyFrame:
        """One row per token: ``request_id, position, stage, experts`` (``Array[i16, L*K]``)."""
        import polars as pl

        files = self.routing_files()
        if not files:
            frame = pl.from_arrow(routing_schema(self.model.ids_per_token, with_weights=False).empty_table())
            assert isinstance(frame, pl.DataFrame)  # from_arrow is typed DataFrame | Series; a Table gives a DataFrame
            return frame.lazy()
        return _scan_parts(files)

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
        with PartHashes(self, REQUESTS_DIR, files) as hashes:  # hashed while read
            try:
                # ParquetFile.read, not read_table: no pyarrow.dataset (and pandas) to import; a column a part
                # lacks is left out, and named by column_problems below
                table = pa.concat_tables(
                    [_decoded(pq.ParquetFile(f).read(columns=cols)) for f in files], promote_options="permissive"
                )
            except (pa.ArrowException, OSError, KeyError) as exc:
                raise TraceFormatError(
                    f"{self.path}: a requests part cannot be read ({exc}); run `moetrace validate {self.path}`"
                ) from exc
            self._refuse(
                self.path,
                column_problems(table.schema, REQUIRED_REQUESTS, exact=False)
                or null_problems({c: table.column(c) for c in cols}),
            )
            rid = numpy_of(table.column("request_id")).astype(np.int64)  # numpy_of: no pandas to import
            ptok = numpy_of(table.column("prompt_tokens"))
            otok = numpy_of(table.column("output_tokens"))
            self._refuse(self.path, duplicate_request_ids(rid) or request_lengths(rid, ptok, otok))
            claimed = int(ptok.astype(np.int64).sum() + otok.astype(np.int64).sum())
            rows = self.num_tokens()
            self._refuse(
                self.path, claimed_tokens(claimed, rows, limit=rows)
            )  # before one byte per claimed token is allocated
            self._check_totals(num_requests=len(rid), num_tokens=None)
            for f in files:  # the specific problems above first, then the bytes against the manifest
                hashes.check(f)
        order = np.argsort(rid, kind="stable")
        dataset = np.asarray(table.column("dataset").to_pylist(), dtype=str)[order]
        return RequestArrays(rid[order], dataset, ptok[order].astype(np.int32), otok[order].astype(np.int32))

    def _check_totals(self, *, num_requests: int | None, num_tokens: int | None) -> None:
        """Refuse a complete trace whose manifest ``totals`` differ from what was read (unless not strict)."""
        if not (self.strict and self.complete):
            return
        totals = self.manifest.get("totals")
        if isinstance(totals, dict):
            totals = {
                k: v
                for k, v in totals.items()
                if (k == "num_requests" and num_requests is not None) or (k == "num_tokens" and num_tokens is not None)
            }
        self._refuse(
            self.path,
            [
                f"{p}; parts were lost or added after it was written{_READ_WHAT_IS_THERE}"
                for p in totals_problems(totals, num_requests=num_requests or 0, num_tokens=num_tokens or 0)
            ],
        )

    def verify_checksums(self) -> list[str]:
        """Compare every part the manifest lists with the SHA-256 its writer recorded at commit; returns
        the parts that differ (empty: all match, or an older trace that recorded none). Reads every byte."""
        from moetrace.tracer.trace.checksum import file_sha256

        parts = self.manifest.get("parts")
        bad = []
        for name, entry in (parts or {}).items() if isinstance(parts, dict) else ():
            for sub, key in ((ROUTING_DIR, "routing_sha256"), (REQUESTS_DIR, "requests_sha256")):
                f = self.path / sub / name
                if f.is_file() and isinstance(entry, dict) and file_sha256(f) != entry.get(key):
                    bad.append(f"{sub}/{name}")
        return bad

    def _refuse(self, where: Path, problems: list[str]) -> None:
        """Raise ``TraceFormatError`` for the first of ``problems`` (found in ``where``), if any."""
        if problems:
            raise TraceFormatError(f"{where}: {problems[0]}; the trace is damaged: run `moetrace validate {self.path}`")

    def iter_token_arrays(self, *, batch_tokens: int = 1 << 20) -> Iterator[TokenArrays]:
        """Stream the routing rows as checked numpy arrays, part by part, row group by row group.

        Memory: two batches of ``batch_tokens`` rows (the caller's and the next, decoded on a thread
        while the caller works: ``read_ahead``; one where a part holds one batch) plus one byte per
        token of the trace. Raises ``TraceFormatError`` at the first row that breaks the format (module docstring).
        """
        req = self.request_arrays
        rows = RowCheck(self.model, RequestIndex.of(req.request_id_R, req.prompt_tokens_R, req.output_tokens_R))
        L, K = self.model.num_moe_layers, self.model.top_k
        num_read = 0
        files = self.routing_files()
        with PartHashes(self, ROUTING_DIR, files) as hashes:  # hashed on a background thread while read
            for f in files:
                try:
                    # pre_buffer=False: read a column chunk when its batch needs it, not a whole row group's
                    # worth ahead (at 65,536 tokens per batch that halves the peak of reading a part)
                    pf = pq.ParquetFile(f, pre_buffer=False)
                    self._refuse(f, routing_schema_problems(pf.schema_arrow, self.model, exact=False))
                    batches = pf.iter_batches(batch_size=batch_tokens, columns=["request_id", "position", "experts"])
                    with read_ahead(batches) as ahead:  # the next batch decoded while the caller counts this one
                        for rb in ahead:
                            b, problems = rows.batch(rb)
                            self._refuse(f, problems or rows.totals())
                            assert b is not None  # a batch without arrays has problems
                            num_read += rb.num_rows
                            yield TokenArrays(
                                b.request_id_T,
                                b.position_T.astype(np.int32),
                                b.position_T >= req.prompt_tokens_R[b.row_T],
                                b.ids_N.astype(np.int16, copy=False).reshape(rb.num_rows, L, K),
                                b.row_T,
                            )
                except (pa.ArrowException, OSError, KeyError) as exc:
                    raise TraceFormatError(
                        f"{f}: {unreadable(exc)}; run `moetrace validate {self.path}` for details"
                    ) from exc
                hashes.check(f)  # the bytes just read are the ones the writer recorded
        self._check_totals(num_requests=None, num_tokens=num_read)

    def token_arrays(self) -> TokenArrays:
        """All routing rows as numpy arrays ``[T, L, K]`` (loads the whole trace into memory)."""
        parts = list(self.iter_token_arrays())
        if not parts:
            L, K = self.model.num_moe_layers, self.model.top_k
            return TokenArrays(
                np.zeros(0, np.int64),
                np.zeros(0, np.int32),
                np.zeros(0, bool),
                np.zeros((0, L, K), np.int16),
                np.zeros(0, np.int64),
            )
        return TokenArrays(*(np.concatenate(cols) for cols in zip(*parts)))


class PartHashes:
    """The SHA-256 of part files of ``trace`` (``sub``: ``routing`` or ``requests``), computed on one
    background thread while the caller reads the same files (``hashlib`` releases the GIL: the cost is a
    second core and a second read of bytes the page cache holds), checked part by part against what the
    manifest's ``parts`` recorded. Parts the manifest records nothing for (an older trace, a part
    committed after an incomplete trace's manifest was written) are not checked; ``validate`` says so."""

    def __init__(self, trace: Trace, sub: str, files: list[Path]) -> None:
        parts = trace.manifest.get("parts")
        parts = parts if isinstance(parts, dict) else {}
        key = f"{sub}_sha256"
        self._trace, self._sub = trace, sub
        self._expected: dict[Path, str] = {}
        for f in files:
            entry = parts.get(f.name)
            if isinstance(entry, dict) and isinstance(entry.get(key), str):
                self._expected[f] = entry[key]
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[Path, Future[str]] = {}

    def __enter__(self) -> PartHashes:
        if self._expected:
            self._pool, futures = hash_files(list(self._expected))
            self._futures = dict(zip(self._expected, futures))
        return self

    def check(self, f: Path) -> None:
        """Wait for ``f``'s hash; raise ``TraceFormatError`` naming the part and ``validate`` when it differs."""
        fut = self._futures.get(f)
        if fut is None:
            return
        try:
            digest = fut.result()
        except OSError as exc:
            raise TraceFormatError(f"{f}: {unreadable(exc)}; run `moetrace validate {self._trace.path}`") from None
        want = self._expected[f]
        if digest != want:
            raise TraceFormatError(
                f"{self._trace.path}: part {self._sub}/{f.name} is not the file its writer recorded (SHA-256 "
                f"{digest[:12]}..., the manifest says {want[:12]}...): bit rot, an edit or a bad copy; nothing "
                f"was written from it. Run `moetrace validate {self._trace.path}`"
            )

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _num_rows(f: Path, trace_path: Path) -> int:
    try:
        return pq.read_metadata(f).num_rows
    except (pa.ArrowException, OSError) as exc:
        raise TraceFormatError(f"{f}: {unreadable(exc)}; run `moetrace validate {trace_path}` for details") from exc


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
            "still running. Resume it with `moetrace collect --resume` (an import or a synth runs again)."
            f"{_READ_COMMITTED}"
        )
    requests = {f.name for f in (p / REQUESTS_DIR).glob("*.parquet")}
    routing = {f.name for f in (p / ROUTING_DIR).glob("*.parquet")}
    missing = [f"{ROUTING_DIR}/{n}" for n in sorted(requests - routing)]
    if missing:
        raise TraceFormatError(
            f"{p}: committed part(s) without their routing file: {missing[:3]}; the trace is damaged "
            f"(run `moetrace validate {p}`)"
        )
    parts = manifest.get("parts")
    problems = parts_entry_problems(parts)
    if problems:
        raise TraceFormatError(f"{p / MANIFEST}: {problems[0]}; run `moetrace validate {p}`")
    problems = part_list_problems(parts, requests=requests, routing=routing, complete=bool(manifest.get("complete")))
    if problems and require_complete:
        raise TraceFormatError(
            f"{p}: {problems[0]}; the trace is damaged (run `moetrace validate {p}`).{_PASS_ALLOW_INCOMPLETE}"
        )
    return Trace(p, manifest, strict=require_complete)
