"""The trace writer: the one crash-safe writer every producer (HF, vLLM, synth, import) uses.

Crash safety. Rows are buffered and flushed as Parquet row groups into an open *part*, written under
a temporary name (``.<name>.parquet.tmp``). ``commit()`` closes the part: the routing file is renamed
to its final name first, then the matching requests file. A request is *committed* exactly when its
row is in a final ``requests/*.parquet``; a routing part without its requests part (a kill between
the two renames) is an orphan and is removed on resume. Readers only ever look at final names.
``manifest.json`` is written (atomically) with ``complete: false`` at start and finalized by
``close()``.

Speed. A routing part is assembled by ``_RoutingPartFile`` (end of this module): pyarrow encodes the narrow
columns, numpy encodes the ``experts`` ids (pyarrow's Parquet encoding, vectorized), so the writer runs at
about 1 M tokens/s of the DeepSeek-V3 shape instead of ~0.2 (benchmarks/bench_writer.py). The files are
the same trace format v1 to every reader.

Shape legend (docs/architecture.md): T tokens, R requests, L MoE layers, K top-k, X = L*K.

Out of scope: what the rows mean (``schema``), file names (``layout``), reading (``reader``), checking
(``validate``), producing the rows (``moetrace.tracer.backends``, ``synth``, ``importers``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.atomic import write_json_atomic
from moetrace.errors import OutputExistsError, TraceFormatError, WriteError
from moetrace.tracer.trace.lock import lock_trace
from moetrace.tracer.trace.layout import MANIFEST, PART_RE, REQUESTS_DIR, ROUTING_DIR, lock_name, part_name
from moetrace.tracer.trace.schema import (
    STAGE_DECODE,
    STAGE_PREFILL,
    ModelInfo,
    check_manifest_header,
    new_manifest,
    requests_schema,
    routing_schema,
)

OnExisting = Literal["refuse", "resume", "overwrite"]


@dataclass(frozen=True)
class WriterStats:
    """Totals of what a writer committed (this run and, on resume, before it)."""

    num_requests: int
    num_tokens: int
    num_parts: int
    bytes_on_disk: int


class TraceWriter:
    """Write a trace directory in format v1.

    Use as a context manager; leaving the ``with`` block normally finalizes the manifest
    (``complete: true``), leaving it by an exception commits what is buffered and leaves the trace
    incomplete (resumable).

    Parameters
    ----------
    path
        Trace directory (created if missing).
    model, backend, collection
        Manifest sections (SPEC §2).
    on_existing
        ``refuse`` (default): error if ``path`` already holds a trace; ``resume``: keep its committed
        requests (``completed_request_ids``) and append, after checking it is the same model and
        format; ``overwrite``: delete the existing trace first.
    with_weights
        Write the optional ``weights`` column.
    with_text
        Write ``prompt_text``/``output_text`` (privacy: only when the user opted in).
    part_prefix
        Part file prefix; distinct prefixes let several writers (shards) share a directory.
    row_group_tokens
        Tokens buffered before a row group is flushed (bounds memory).
    part_tokens
        A part is committed automatically once it holds this many tokens.
    compression
        Parquet codec (``zstd``, ``lz4``, ``snappy``, ``none``).
    manifest_name
        File name of this writer's manifest (sharded writers use ``manifests/<shard>.json``).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        model: ModelInfo,
        backend: dict[str, Any],
        collection: dict[str, Any],
        on_existing: OnExisting = "refuse",
        with_weights: bool = False,
        with_text: bool = False,
        part_prefix: str = "part",
        row_group_tokens: int = 131072,
        part_tokens: int = 4_194_304,
        compression: str = "lz4",
        manifest_name: str = MANIFEST,
    ) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_]+", part_prefix):
            raise ValueError(f"`part_prefix` must be letters, digits and '_', got {part_prefix!r}")
        self.path = Path(path)
        self.model = model
        self.with_weights = with_weights
        self.with_text = with_text
        self.part_prefix = part_prefix
        self.row_group_tokens = int(row_group_tokens)
        self.part_tokens = int(part_tokens)
        self.compression = None if compression == "none" else compression
        self._manifest_path = self.path / manifest_name
        # a shard writer (own manifest file) sees only its own part files: shards share the directory
        self._own_parts_glob = f"{part_prefix}-*.parquet" if manifest_name != MANIFEST else "*.parquet"
        self.routing_schema = routing_schema(model.ids_per_token, with_weights=with_weights)
        self._narrow_schema = pa.schema([f for f in self.routing_schema if f.name != "experts"])
        self.requests_schema = requests_schema(with_text=with_text)
        self._closed = False
        self._failed: BaseException | None = None  # the error that stopped this writer, if one did

        self.completed_request_ids: set[int] = set()
        self._prior_tokens = 0
        self._prior_parts = 0
        # one writer per trace (shards: one per shard), taken before anything on disk is touched
        self._lock = lock_trace(self.path, shard_lock=lock_name(manifest_name))
        try:
            self._prepare_directory(on_existing, backend=backend, collection=collection)
        except BaseException:
            self._lock.release()
            raise
        self._next_seq = self._first_free_seq()

        # the open part
        self._pq: _RoutingPartFile | None = None
        self._part_name: str | None = None
        self._part_tokens = 0
        # buffered rows of the next row group: every column but `experts`, and the `experts` ids (int16 [T_i, X])
        self._buf: list[tuple[pa.RecordBatch, np.ndarray]] = []
        self._buf_tokens = 0
        self._req_rows: list[dict[str, Any]] = []
        self._seen_in_run: set[int] = set()
        self.num_requests_written = 0
        self.num_tokens_written = 0

    # ------------------------------------------------------------------ directory handling
    def _prepare_directory(self, on_existing: OnExisting, *, backend: dict, collection: dict) -> None:
        if self._own_parts_glob == "*.parquet":
            exists = self._manifest_path.exists() or (self.path / ROUTING_DIR).exists()
        else:
            exists = self._manifest_path.exists() or any((self.path / ROUTING_DIR).glob(self._own_parts_glob))
        if exists and on_existing == "refuse":
            raise OutputExistsError(
                f"{self.path} already holds a trace. Re-run with --resume to continue it, or --overwrite "
                "to replace it (or choose another -o)."
            )
        if exists and on_existing == "overwrite":
            self._remove_trace_files()
            exists = False
        (self.path / ROUTING_DIR).mkdir(parents=True, exist_ok=True)
        (self.path / REQUESTS_DIR).mkdir(parents=True, exist_ok=True)
        self._manifest_path.parent.mkdir(parents=True, exist_ok=True)
        if exists:
            self._manifest = self._check_resumable(backend=backend, collection=collection)
            self._cleanup_uncommitted()
            self._load_committed()
            self._manifest["complete"] = False
        else:
            self._manifest = new_manifest(model=self.model, backend=backend, collection=collection)
        self._manifest["writer"] = {
            "with_weights": self.with_weights,
            "with_text": self.with_text,
            "compression": self.compression or "none",
        }
        write_json_atomic(self._manifest_path, self._manifest)

    def _remove_trace_files(self) -> None:
        for sub in (ROUTING_DIR, REQUESTS_DIR):
            d = self.path / sub
            if d.is_dir():
                for f in d.iterdir():
                    if self._own_parts_glob != "*.parquet" and not f.name.lstrip(".").startswith(f"{self.part_prefix}-"):
                        continue  # another shard's file
                    if f.name.endswith(".parquet") or f.name.endswith(".parquet.tmp"):
                        f.unlink()
        if self._manifest_path.exists():
            self._manifest_path.unlink()

    def _check_resumable(self, *, backend: dict, collection: dict) -> dict[str, Any]:
        if not self._manifest_path.exists():
            raise OutputExistsError(
                f"{self.path} has part files but no {self._manifest_path.name}; use --overwrite to start afresh"
            )
        manifest = json.loads(self._manifest_path.read_text())
        try:
            check_manifest_header(manifest, where=str(self._manifest_path))
        except TraceFormatError as exc:
            raise OutputExistsError(f"{exc}. Use --overwrite to replace it.") from exc
        old = manifest.get("model", {})
        new = self.model.to_dict()
        keys = ("source", "architecture", "moe_layers", "num_experts", "top_k")
        diff = [f"{k}: {old.get(k)!r} (on disk) vs {new.get(k)!r} (now)" for k in keys if old.get(k) != new.get(k)]
        if diff:
            raise OutputExistsError(
                f"{self.path} holds a trace of a different model ({'; '.join(diff)}). "
                "Use another -o, or --overwrite to replace it."
            )
        old_w = manifest.get("writer", {})
        for key, mine in (("with_weights", self.with_weights), ("with_text", self.with_text)):
            if key in old_w and bool(old_w[key]) != mine:
                raise OutputExistsError(
                    f"{self.path} was written with {key}={old_w[key]}, this run has {key}={mine}; "
                    "use the same options to resume, or --overwrite"
                )
        # everything that decides which prompt a request id is (or how it is rendered and sampled):
        # resuming with another value would skip or repeat requests under the wrong ids
        keys = ("datasets", "per_dataset", "num_requests", "prompt_field", "chat_template", "seed", "max_new_tokens",
                "sampling", "num_shards")
        for key in keys:
            if key in manifest.get("collection", {}) and key in collection and manifest["collection"][key] != collection[key]:
                raise OutputExistsError(
                    f"{self.path} was collected with {key}={manifest['collection'][key]!r}, this run asks for "
                    f"{key}={collection[key]!r}; resume with the same settings, or --overwrite"
                )
        return manifest

    def _cleanup_uncommitted(self) -> None:
        """Remove temporary files and orphan routing parts (no matching requests part)."""
        for sub in (ROUTING_DIR, REQUESTS_DIR):
            tmp_glob = ".*.tmp" if self._own_parts_glob == "*.parquet" else f".{self.part_prefix}-*.tmp"
            for f in (self.path / sub).glob(tmp_glob):
                f.unlink()
        committed = {f.name for f in (self.path / REQUESTS_DIR).glob("*.parquet")}
        for f in (self.path / ROUTING_DIR).glob("*.parquet"):
            if f.name not in committed and PART_RE.match(f.name) and PART_RE.match(f.name)["prefix"] == self.part_prefix:
                f.unlink()

    def _load_committed(self) -> None:
        for f in sorted((self.path / REQUESTS_DIR).glob(self._own_parts_glob)):
            ids = pq.read_table(f, columns=["request_id"]).column(0).to_numpy()
            self.completed_request_ids.update(int(x) for x in ids)
            self._prior_parts += 1
            meta = pq.read_metadata(self.path / ROUTING_DIR / f.name) if (self.path / ROUTING_DIR / f.name).exists() else None
            self._prior_tokens += meta.num_rows if meta is not None else 0

    def _first_free_seq(self) -> int:
        seqs = [
            int(m["seq"])
            for sub in (ROUTING_DIR, REQUESTS_DIR)
            for f in (self.path / sub).glob("*.parquet")
            if (m := PART_RE.match(f.name)) and m["prefix"] == self.part_prefix
        ]
        return max(seqs) + 1 if seqs else 0

    # ------------------------------------------------------------------ writing
    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.close(complete=False)

    def add_request(
        self,
        *,
        request_id: int,
        dataset: str,
        prompt_tokens: int,
        topk_ids_TX: np.ndarray,
        topk_weights_TX: np.ndarray | None = None,
        prompt_text: str | None = None,
        output_text: str | None = None,
    ) -> None:
        """Add one whole request.

        ``topk_ids_TX``: int16-castable ``[T, L*K]`` (or ``[T, L, K]``), T = prompt + output tokens,
        rows in position order; ``-1`` where nothing was recorded. ``output_tokens`` = T - prompt_tokens.
        """
        experts = np.asarray(topk_ids_TX)
        T = experts.shape[0]
        self.add_requests(
            request_id_R=np.array([request_id], dtype=np.int64),
            dataset_R=[dataset],
            prompt_tokens_R=np.array([prompt_tokens], dtype=np.int32),
            output_tokens_R=np.array([T - prompt_tokens], dtype=np.int32),
            topk_ids_TX=experts,
            topk_weights_TX=topk_weights_TX,
            prompt_text_R=None if prompt_text is None and output_text is None else [prompt_text],
            output_text_R=None if prompt_text is None and output_text is None else [output_text],
        )

    def add_requests(
        self,
        *,
        request_id_R: np.ndarray,
        dataset_R: Sequence[str] | pa.Array,
        prompt_tokens_R: np.ndarray,
        output_tokens_R: np.ndarray,
        topk_ids_TX: np.ndarray,
        topk_weights_TX: np.ndarray | None = None,
        prompt_text_R: Sequence[str | None] | None = None,
        output_text_R: Sequence[str | None] | None = None,
    ) -> None:
        """Add R whole requests at once (the fast path for synthetic and imported traces).

        ``topk_ids_TX`` holds the tokens of all R requests back to back, each request's prompt
        positions then its generated positions; ``sum(prompt_tokens_R + output_tokens_R) == T``.
        """
        if self._closed:
            raise RuntimeError("TraceWriter is closed")
        X = self.model.ids_per_token
        rid = np.ascontiguousarray(request_id_R, dtype=np.int64)
        ptok = np.ascontiguousarray(prompt_tokens_R, dtype=np.int32)
        otok = np.ascontiguousarray(output_tokens_R, dtype=np.int32)
        R = rid.shape[0]
        if not (ptok.shape == otok.shape == (R,)) or len(dataset_R) != R:
            raise ValueError("request arrays must all have length R")
        if np.any(ptok < 1) or np.any(otok < 0):
            raise ValueError("every request needs prompt_tokens >= 1 and output_tokens >= 0")
        lengths = ptok.astype(np.int64) + otok
        T = int(lengths.sum())
        experts = np.asarray(topk_ids_TX)
        if experts.ndim == 3:
            experts = experts.reshape(experts.shape[0], -1)
        if experts.shape != (T, X):
            raise ValueError(f"topk_ids_TX has shape {experts.shape}, expected ({T}, {X}) = (tokens, moe_layers*top_k)")
        experts = np.ascontiguousarray(experts, dtype=np.int16)
        dup = [int(r) for r in rid if int(r) in self.completed_request_ids or int(r) in self._seen_in_run]
        if dup or len(np.unique(rid)) != R:
            raise ValueError(f"request ids already written: {dup[:5] or 'duplicates within the batch'}")
        self._seen_in_run.update(int(r) for r in rid)

        # per-token columns, vectorized: request id, position within the request, stage
        starts = np.zeros(R, dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        req_T = np.repeat(rid, lengths)
        pos_T = (np.arange(T, dtype=np.int64) - np.repeat(starts, lengths)).astype(np.int32)
        is_decode_T = pos_T >= np.repeat(ptok, lengths)
        stage = _stage_strings(is_decode_T)
        cols = [pa.array(req_T, type=pa.int64()), pa.array(pos_T, type=pa.int32()), stage]
        if self.with_weights:
            if topk_weights_TX is None:
                raise ValueError("this writer has with_weights=True; pass topk_weights_TX")
            w = np.ascontiguousarray(np.asarray(topk_weights_TX, dtype=np.float32).reshape(T, X))
            cols.append(pa.FixedSizeListArray.from_arrays(pa.array(w.reshape(-1), type=pa.float32()), X))
        batch = pa.RecordBatch.from_arrays(cols, schema=self._narrow_schema)

        datasets = list(dataset_R) if not isinstance(dataset_R, pa.Array) else dataset_R.to_pylist()
        for i in range(R):
            row = {
                "request_id": int(rid[i]),
                "dataset": str(datasets[i]),
                "prompt_tokens": int(ptok[i]),
                "output_tokens": int(otok[i]),
            }
            if self.with_text:
                row["prompt_text"] = prompt_text_R[i] if prompt_text_R is not None else None
                row["output_text"] = output_text_R[i] if output_text_R is not None else None
            self._req_rows.append(row)

        self._buf.append((batch, experts))
        self._buf_tokens += T
        self._part_tokens += T
        self.num_requests_written += R
        self.num_tokens_written += T
        if self._buf_tokens >= self.row_group_tokens:
            self._flush_row_group()
        if self._part_tokens >= self.part_tokens:
            self.commit()

    def _open_part(self) -> None:
        self._part_name = part_name(self.part_prefix, self._next_seq)
        self._next_seq += 1
        tmp = self.path / ROUTING_DIR / f".{self._part_name}.tmp"
        self._pq = _RoutingPartFile(tmp, self.routing_schema, compression=self.compression)

    def _flush_row_group(self) -> None:
        if not self._buf:
            return
        with self._on_write_error():
            if self._pq is None:
                self._open_part()
            narrow = pa.Table.from_batches([b for b, _ in self._buf], schema=self._narrow_schema)
            self._pq.write_row_group(narrow, [ids for _, ids in self._buf])
        self._buf = []
        self._buf_tokens = 0

    def commit(self) -> None:
        """Close the open part: everything added so far becomes durable and visible to readers."""
        if self._failed is not None:
            raise RuntimeError("this TraceWriter failed to write a part and cannot go on; resume the trace instead")
        if not self._req_rows:
            return
        self._flush_row_group()
        assert self._pq is not None and self._part_name is not None
        rdir, qdir = self.path / ROUTING_DIR, self.path / REQUESTS_DIR
        req_tmp = qdir / f".{self._part_name}.tmp"
        with self._on_write_error():
            self._pq.close()
            _fsync_file(rdir / f".{self._part_name}.tmp")
            pq.write_table(pa.Table.from_pylist(self._req_rows, schema=self.requests_schema), req_tmp, compression="zstd")
            _fsync_file(req_tmp)
        os.replace(rdir / f".{self._part_name}.tmp", rdir / self._part_name)  # routing first
        os.replace(req_tmp, qdir / self._part_name)  # then requests: the commit point
        self.completed_request_ids.update(r["request_id"] for r in self._req_rows)
        self._pq = None
        self._part_name = None
        self._part_tokens = 0
        self._req_rows = []

    @contextlib.contextmanager
    def _on_write_error(self) -> Iterator[None]:
        """A failed write (disk full, I/O error) drops the open part, whose requests were never committed,
        and becomes one clean error naming the cause; the committed parts stay and the trace stays resumable."""
        try:
            yield
        except (OSError, pa.ArrowException) as exc:
            self._failed = exc
            name = self._part_name
            if self._pq is not None:
                with contextlib.suppress(OSError):  # the part is being discarded anyway
                    self._pq.abort()
            for sub in (ROUTING_DIR, REQUESTS_DIR):
                if name is not None:
                    (self.path / sub / f".{name}.tmp").unlink(missing_ok=True)
            self._pq, self._part_name, self._buf, self._req_rows = None, None, [], []
            raise WriteError(_describe_write_error(exc, self.path)) from exc

    def close(self, *, complete: bool = True, extra_manifest: dict[str, Any] | None = None) -> WriterStats:
        """Commit what is buffered and finalize the manifest (``complete`` as given)."""
        if self._closed:
            return self.stats()
        if self._failed is not None:  # nothing more can be written; the manifest on disk says incomplete
            self._closed = True
            self._lock.release()
            return self.stats()
        try:
            self.commit()
            self._closed = True
            stats = self.stats()
            self._manifest["complete"] = bool(complete)
            self._manifest["totals"] = {"num_requests": stats.num_requests, "num_tokens": stats.num_tokens}
            if extra_manifest:
                self._manifest.update(extra_manifest)
            write_json_atomic(self._manifest_path, self._manifest)
        finally:
            self._lock.release()  # also when the last commit failed (disk full): the trace stays resumable
        return stats

    def update_manifest(self, **sections: Any) -> None:
        """Merge keys into the manifest (written at ``close``)."""
        self._manifest.update(sections)

    def stats(self) -> WriterStats:
        own = self._own_parts_glob
        files = [*(self.path / ROUTING_DIR).glob(own), *(self.path / REQUESTS_DIR).glob(own)]
        return WriterStats(
            num_requests=len(self.completed_request_ids),
            num_tokens=self._prior_tokens + self.num_tokens_written,
            num_parts=len(list((self.path / REQUESTS_DIR).glob(own))),
            bytes_on_disk=sum(f.stat().st_size for f in files),
        )


#: the ``stage`` column's two words; ``take`` by ``is_decode`` builds the column
_STAGE_WORDS = pa.array([STAGE_PREFILL, STAGE_DECODE])


def _stage_strings(is_decode_T: np.ndarray) -> pa.StringArray:
    """The ``stage`` column (``prefill`` / ``decode`` per token): ``is_decode_T`` bool [T]."""
    return _STAGE_WORDS.take(pa.array(is_decode_T.view(np.int8)))


def _describe_write_error(exc: BaseException, path: Path) -> str:
    code = getattr(exc, "errno", None)
    if code == errno.ENOSPC or "No space left on device" in str(exc):
        cause = "no space left on device"
    elif code == errno.EDQUOT:
        cause = "disk quota exceeded"
    else:
        cause = str(exc).splitlines()[0]
    return (f"cannot write the trace {path}: {cause}. The requests committed so far are kept; free space, then run "
            "the same command again (with --resume where the command has it)")


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------------
# The routing part file. pyarrow's Parquet writer encodes the `experts` column at ~10 ns per id (per-value
# dictionary hashing, repetition/definition levels, bit packing), which caps the writer near 0.2 M tokens/s
# at 464 ids per token. The file is therefore assembled here: pyarrow writes the narrow columns (request_id,
# position, stage, weights) of each row group into memory, their column chunks are copied into the part, and
# the `experts` chunk is encoded with numpy in the same Parquet encoding pyarrow uses (a PLAIN int32
# dictionary page, then RLE_DICTIONARY data pages with RLE repetition/definition levels and bit-packed
# indices of at most 8 bits), so readers see the same Arrow schema, the same values and the same encodings.
# What the vectorized encoder does not cover (an id above 255; a row mixing -1 with recorded ids while id 255
# also occurs; codecs other than lz4, zstd, snappy and none) pyarrow encodes, copied the same way. The footer
# is pyarrow's own footer for the routing schema (schema elements, ARROW:schema, column orders) with this
# file's row groups; tests/test_writer_parquet.py checks the parts against what pyarrow writes for the same rows.

# Thrift compact protocol (the encoding of Parquet footers and page headers): type codes
_T_TRUE, _T_FALSE, _T_BYTE, _T_I16, _T_I32, _T_I64, _T_DOUBLE, _T_BINARY, _T_LIST, _T_SET, _T_MAP, _T_STRUCT = range(1, 13)
# a decoded struct: [(field id, type code, value)], in field order; a list value: (element type, [values])
_Struct = list


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _zigzag(n: int) -> int:
    return (n << 1) ^ (n >> 63)


class _ThriftReader:
    """Decode Thrift compact-protocol bytes into ``_Struct`` trees (no schema needed)."""

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data, self.pos = data, pos

    def _uvarint(self) -> int:
        shift = result = 0
        while True:
            b = self.data[self.pos]
            self.pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    def _value(self, t: int) -> Any:
        if t in (_T_I16, _T_I32, _T_I64):
            n = self._uvarint()
            return (n >> 1) ^ -(n & 1)
        if t == _T_BINARY:
            n = self._uvarint()
            self.pos += n
            return self.data[self.pos - n:self.pos]
        if t == _T_STRUCT:
            return self.struct()
        if t in (_T_LIST, _T_SET):
            h = self.data[self.pos]
            self.pos += 1
            size, et = h >> 4, h & 0x0F
            if size == 15:
                size = self._uvarint()
            if et in (_T_TRUE, _T_FALSE):
                raise TraceFormatError("unexpected list of booleans in a Parquet footer")
            return (et, [self._value(et) for _ in range(size)])
        if t == _T_BYTE:
            self.pos += 1
            return int.from_bytes(self.data[self.pos - 1:self.pos], "little", signed=True)
        if t == _T_DOUBLE:
            self.pos += 8
            return self.data[self.pos - 8:self.pos]
        raise TraceFormatError(f"unexpected Thrift type {t} in a Parquet footer")

    def struct(self) -> _Struct:
        fields: _Struct = []
        last = 0
        while True:
            b = self.data[self.pos]
            self.pos += 1
            if b == 0:
                return fields
            t, delta = b & 0x0F, b >> 4
            if delta:
                fid = last + delta
            else:
                n = self._uvarint()
                fid = (n >> 1) ^ -(n & 1)
            last = fid
            fields.append((fid, t, t == _T_TRUE) if t in (_T_TRUE, _T_FALSE) else (fid, t, self._value(t)))


def _thrift_value(out: bytearray, t: int, v: Any) -> None:
    if t in (_T_I16, _T_I32, _T_I64):
        out += _varint(_zigzag(v))
    elif t == _T_BINARY:
        out += _varint(len(v))
        out += v
    elif t == _T_STRUCT:
        _thrift_struct(out, v)
    elif t in (_T_LIST, _T_SET):
        et, items = v
        out.append((len(items) << 4 | et) if len(items) < 15 else (0xF0 | et))
        if len(items) >= 15:
            out += _varint(len(items))
        for item in items:
            _thrift_value(out, et, item)
    elif t == _T_BYTE:
        out += int(v).to_bytes(1, "little", signed=True)
    elif t == _T_DOUBLE:
        out += v
    else:
        raise ValueError(f"cannot encode Thrift type {t}")


def _thrift_struct(out: bytearray, fields: _Struct) -> None:
    last = 0
    for fid, t, v in fields:
        if t in (_T_TRUE, _T_FALSE):
            t = _T_TRUE if v else _T_FALSE
        if 0 < fid - last <= 15:
            out.append((fid - last) << 4 | t)
        else:
            out.append(t)
            out += _varint(_zigzag(fid))
        last = fid
        if t not in (_T_TRUE, _T_FALSE):
            _thrift_value(out, t, v)
    out.append(0)


def _thrift_bytes(fields: _Struct) -> bytes:
    out = bytearray()
    _thrift_struct(out, fields)
    return bytes(out)


def _get(fields: _Struct, fid: int, default: Any = None) -> Any:
    return next((v for f, _, v in fields if f == fid), default)


def _set(fields: _Struct, fid: int, t: int, v: Any) -> _Struct:
    """``fields`` with field ``fid`` set to ``v`` (added in field order if absent)."""
    out = [x for x in fields if x[0] != fid] + [(fid, t, v)]
    return sorted(out, key=lambda x: x[0])


def _footer(data: bytes) -> _Struct:
    """The decoded ``FileMetaData`` of a whole Parquet file held in ``data``."""
    if data[:4] != b"PAR1" or data[-4:] != b"PAR1":
        raise TraceFormatError("pyarrow produced a Parquet buffer without PAR1 magic")
    n = int.from_bytes(data[-8:-4], "little")
    return _ThriftReader(data, len(data) - 8 - n).struct()


# Parquet enums used below (parquet.thrift)
_PAGE_DATA, _PAGE_DICT = 0, 2
_ENC_PLAIN, _ENC_RLE, _ENC_RLE_DICT = 0, 3, 8
_CODEC_NONE, _CODEC_SNAPPY, _CODEC_LZ4_HADOOP, _CODEC_ZSTD, _CODEC_LZ4_RAW = 0, 1, 5, 6, 7
# ColumnChunk / ColumnMetaData fields that hold file offsets
_CC_FILE_OFFSET, _CC_META = 2, 3
_CM_CODEC, _CM_NUM_VALUES, _CM_UNCOMPRESSED, _CM_COMPRESSED, _CM_DATA_OFFSET, _CM_INDEX_OFFSET, _CM_DICT_OFFSET = 4, 5, 6, 7, 9, 10, 11
_CM_BLOOM_OFFSET = 14
#: indices per data page of the vectorized encoder (pyarrow's default data page holds ~1 MiB)
_PAGE_IDS = 1 << 20


def _page_compressor(codec: int):
    """For a Parquet codec id: ``body (uint8 array) -> list of byte chunks`` (the compressed page body), or None
    where the vectorized encoder does not support the codec."""
    if codec == _CODEC_NONE:
        return lambda body: [body]
    if codec == _CODEC_LZ4_HADOOP:  # Hadoop framing: big-endian raw size and compressed size, then an LZ4 block
        lz4 = pa.Codec("lz4_raw")

        def framed(body: np.ndarray) -> list:
            c = lz4.compress(body)
            return [body.size.to_bytes(4, "big") + c.size.to_bytes(4, "big"), c]

        return framed
    names = {_CODEC_SNAPPY: "snappy", _CODEC_ZSTD: "zstd", _CODEC_LZ4_RAW: "lz4_raw"}
    if codec in names:
        c = pa.Codec(names[codec])
        return lambda body: [c.compress(body)]
    return None


def _rle_run(count: int, value: int, width_bytes: int) -> bytes:
    """One run of the RLE/bit-packed hybrid: ``count`` copies of ``value``."""
    return _varint(count << 1) + value.to_bytes(width_bytes, "little")


def _pack_bits(idx: np.ndarray, width: int) -> np.ndarray:
    """Bit-pack ``idx`` (uint8 ``[8 * G]``, each < 2**width, ``width`` in 1..7) least significant bit first:
    every 8 values become ``width`` bytes; uint8 ``[G * width]``."""
    v = idx.reshape(-1, 8).T.astype(np.uint64)
    word = v[0].copy()
    for i in range(1, 8):
        word |= v[i] << np.uint64(width * i)
    return word.view(np.uint8).reshape(-1, 8)[:, :width].reshape(-1)


class _ExpertsEncoder:
    """Encode the ``experts`` column chunk (int16 ``[T, X]``) in pyarrow's encoding, vectorized with numpy.

    The dictionary page holds ids ``0..hi`` then ``-1`` (``hi``: the largest id of the row group, at most 255),
    PLAIN int32. Data pages (about 1 Mi ids each, whole rows) hold RLE repetition levels (one 0 then X-1 ones
    per row), one RLE run of definition level 1, and the dictionary indices as one bit-packed run of
    ``ceil(log2(hi + 2))`` bits (an index is the id itself, -1's is ``hi + 1``). When id 255 and -1 both occur
    (257 entries), rows without -1 are 8-bit pages and rows of only -1 are RLE pages of index 256; a row
    mixing both, an id above 255 or below -1 is not covered (``plan`` returns None).
    """

    def __init__(self, X: int, compress) -> None:
        self.X = X
        self.compress = compress
        self.rows_per_page = max(1, _PAGE_IDS // X)
        # repetition levels of one row: a run of one 0 then X-1 ones (bit width 1)
        self.rep_row = np.frombuffer(_rle_run(1, 0, 1) + (_rle_run(X - 1, 1, 1) if X > 1 else b""), np.uint8)

    def plan(self, ids_list: list[np.ndarray]) -> tuple[int, int, list[tuple[np.ndarray, bool]]] | None:
        """``(hi, width, segments)`` for the row group ``ids_list`` (C-contiguous int16 ``[T_i, X]`` arrays in
        row order; segments: runs of rows ``(ids [n, X], all -1?)``), or None if not covered."""
        row_min = [a.min(axis=1) for a in ids_list]  # int16 [T_i]: the smallest id of every row
        lo = min((int(m.min()) for m in row_min if m.size), default=0)
        hi = max((int(a.max()) for a in ids_list if a.size), default=0)
        if lo < -1 or hi > 255:
            return None
        hi = max(hi, -1)
        width = max(1, (hi + 1).bit_length())  # indices 0..hi+1
        if width <= 8 or lo >= 0:
            return hi, width, [(ids_TX, False) for ids_TX in ids_list]
        segments = []
        for ids_TX, m in zip(ids_list, row_min):
            neg_T = m < 0
            if neg_T.any() and (ids_TX[neg_T].max(axis=1) >= 0).any():
                return None  # a row mixes -1 and recorded ids: index 256 would need 9-bit packed pages
            bounds = np.concatenate([[0], np.flatnonzero(np.diff(neg_T.view(np.int8))) + 1, [neg_T.size]]).tolist()
            segments += [(ids_TX[a:b], bool(neg_T[a])) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        return hi, width, segments

    def _page(self, write, page_type: int, body: np.ndarray, sub_header: _Struct) -> tuple[int, int]:
        """Write one page (header, compressed body); returns (uncompressed, compressed) bytes with the header."""
        chunks = self.compress(body)
        size = sum(len(c) if isinstance(c, bytes) else c.size if isinstance(c, pa.Buffer) else c.nbytes for c in chunks)
        header = _thrift_bytes([(1, _T_I32, page_type), (2, _T_I32, body.nbytes), (3, _T_I32, size),
                                (5 if page_type == _PAGE_DATA else 7, _T_STRUCT, sub_header)])
        write(header)
        for c in chunks:
            write(c)
        return len(header) + body.nbytes, len(header) + size

    def write(self, plan: tuple[int, int, list[tuple[np.ndarray, bool]]], write) -> dict[str, int]:
        """Write the chunk of ``plan`` through ``write(bytes-like)``; returns its sizes and page count."""
        hi, width, segments = plan
        X = self.X
        dictionary = np.concatenate([np.arange(hi + 1, dtype="<i4"), np.array([-1], "<i4")]).view(np.uint8)
        dict_u, dict_c = self._page(write, _PAGE_DICT, dictionary, [(1, _T_I32, hi + 2), (2, _T_I32, _ENC_PLAIN)])
        sizes = {"uncompressed": dict_u, "compressed": dict_c, "dict_size": dict_c, "pages": 0, "num_values": 0}
        for ids_TX, all_neg in segments:
            flat = ids_TX.reshape(-1)
            for s in range(0, ids_TX.shape[0], self.rows_per_page):
                n = min(self.rows_per_page, ids_TX.shape[0] - s)
                rep = _rle_run(n, 0, 1) if X == 1 else None
                rep_size = len(rep) if rep is not None else n * self.rep_row.size
                dfn = _rle_run(n * X, 1, 1)
                if all_neg:
                    values = np.frombuffer(b"\x09" + _rle_run(n * X, hi + 2 - 1, 2), np.uint8)
                    w = values.size
                else:
                    bits = min(width, 8)
                    groups = -(-n * X // 8)
                    vhead = bytes([bits]) + _varint(groups << 1 | 1)
                    w = len(vhead) + groups * bits
                body = np.empty(4 + rep_size + 4 + len(dfn) + w, np.uint8)
                body[:4] = np.frombuffer(rep_size.to_bytes(4, "little"), np.uint8)
                o = 4
                if rep is not None:
                    body[o:o + rep_size] = np.frombuffer(rep, np.uint8)
                else:
                    body[o:o + rep_size].reshape(n, -1)[:] = self.rep_row
                o += rep_size
                body[o:o + 4] = np.frombuffer(len(dfn).to_bytes(4, "little"), np.uint8)
                body[o + 4:o + 4 + len(dfn)] = np.frombuffer(dfn, np.uint8)
                o += 4 + len(dfn)
                if all_neg:
                    body[o:] = values
                else:
                    body[o:o + len(vhead)] = np.frombuffer(vhead, np.uint8)
                    o += len(vhead)
                    ids = flat[s * X:(s + n) * X]
                    if bits == 8:
                        dst = body[o:o + n * X]
                        np.copyto(dst, ids, casting="unsafe")  # int16 -> uint8: -1 wraps to 255
                        body[o + n * X:] = 0
                    else:
                        dst = np.zeros(groups * 8, np.uint8)
                        np.copyto(dst[:n * X], ids, casting="unsafe")
                    if hi < 254 and ids.min() < 0:
                        dst[dst == 255] = hi + 1  # the index of -1
                    if bits < 8:
                        body[o:] = _pack_bits(dst, bits)
                u, c = self._page(write, _PAGE_DATA, body, [(1, _T_I32, n * X), (2, _T_I32, _ENC_RLE_DICT),
                                                            (3, _T_I32, _ENC_RLE), (4, _T_I32, _ENC_RLE)])
                sizes["uncompressed"] += u
                sizes["compressed"] += c
                sizes["pages"] += 1
                sizes["num_values"] += n * X
        return sizes


class _RoutingPartFile:
    """One routing part being written under its temporary name: row groups in, a Parquet file out.

    ``write_row_group(narrow, ids_list)`` appends one row group; ``close()`` writes the footer. A failed write
    (disk full) raises ``OSError`` or ``pa.ArrowException``, as ``pq.ParquetWriter`` does.
    """

    def __init__(self, path: Path, schema: pa.Schema, *, compression: str | None) -> None:
        self.schema = schema
        self.X = schema.field("experts").type.list_size
        self.options = dict(compression=compression, write_statistics=["request_id", "position"])
        # pyarrow's footer for this schema: schema elements, ARROW:schema, column orders
        empty = self._pyarrow_file(schema.empty_table())
        self.template = _footer(empty)
        self.leaf_paths = [c.path for c in pq.read_metadata(pa.BufferReader(empty)).schema]
        self.encoder: _ExpertsEncoder | None = None
        self.row_groups: list[_Struct] = []
        self.num_rows = 0
        self.f = open(path, "wb")
        try:
            self.f.write(b"PAR1")
        except BaseException:
            self.f.close()
            raise
        self.pos = 4

    def _pyarrow_file(self, table: pa.Table) -> bytes:
        sink = pa.BufferOutputStream()
        with pq.ParquetWriter(sink, table.schema, use_dictionary=["stage", "experts.list.element"], **self.options) as w:
            w.write_table(table, row_group_size=max(table.num_rows, 1))
        return sink.getvalue().to_pybytes()

    def _write(self, b) -> None:
        """Append a bytes-like object (bytes, numpy array, pa.Buffer)."""
        self.pos += self.f.write(b)

    def _copy_chunks(self, data: bytes) -> dict[str, _Struct]:
        """Append the column chunks of the one-row-group Parquet file ``data`` to the part; their ``ColumnChunk``
        structs by column path, with offsets moved to where the chunks now lie."""
        (rg,) = _get(_footer(data), 4)[1]
        chunks = {}
        for cc in _get(rg, 1)[1]:
            cm = _get(cc, _CC_META)
            if _get(cm, _CM_BLOOM_OFFSET) is not None or _get(cm, _CM_INDEX_OFFSET) is not None or any(
                    f not in (_CC_FILE_OFFSET, _CC_META) for f, _, _ in cc):
                raise RuntimeError("pyarrow wrote page indexes, bloom filters or file paths the routing part does not copy")
            start = min(x for x in (_get(cm, _CM_DICT_OFFSET), _get(cm, _CM_DATA_OFFSET)) if x is not None)
            shift = self.pos - start
            self._write(data[start:start + _get(cm, _CM_COMPRESSED)])
            for fid in (_CM_DICT_OFFSET, _CM_DATA_OFFSET):
                if _get(cm, fid) is not None:
                    cm = _set(cm, fid, _T_I64, _get(cm, fid) + shift)
            cc = _set(cc, _CC_META, _T_STRUCT, cm)
            if _get(cc, _CC_FILE_OFFSET):
                cc = _set(cc, _CC_FILE_OFFSET, _T_I64, _get(cc, _CC_FILE_OFFSET) + shift)
            chunks[".".join(x.decode() for x in _get(cm, 3)[1])] = cc
        return chunks

    def write_row_group(self, narrow: pa.Table, ids_list: list[np.ndarray]) -> None:
        """Append one row group: ``narrow`` holds every column but ``experts`` (>= 1 row), ``ids_list`` the
        ``experts`` ids of the same rows as int16 ``[T_i, X]`` arrays."""
        T = narrow.num_rows
        if T == 0:
            return
        chunks = self._copy_chunks(self._pyarrow_file(narrow))
        codec = _get(_get(chunks["request_id"], _CC_META), _CM_CODEC)
        if self.encoder is None:
            compress = _page_compressor(codec)
            self.encoder = _ExpertsEncoder(self.X, compress) if compress is not None else None
        plan = self.encoder.plan(ids_list) if self.encoder is not None else None
        if plan is None:  # not covered by the vectorized encoder: pyarrow encodes the column, copied the same way
            flat = np.concatenate([a.reshape(-1) for a in ids_list])
            experts = pa.FixedSizeListArray.from_arrays(pa.array(flat, type=pa.int16()), self.X)
            table = pa.Table.from_arrays([experts], schema=pa.schema([self.schema.field("experts")]))
            chunks.update(self._copy_chunks(self._pyarrow_file(table)))
        else:
            start = self.pos
            size = self.encoder.write(plan, self._write)
            cm = [
                (1, _T_I32, 1),  # physical type INT32
                (2, _T_LIST, (_T_I32, [_ENC_PLAIN, _ENC_RLE, _ENC_RLE_DICT])),
                (3, _T_LIST, (_T_BINARY, [b"experts", b"list", b"element"])),
                (_CM_CODEC, _T_I32, codec),
                (_CM_NUM_VALUES, _T_I64, size["num_values"]),
                (_CM_UNCOMPRESSED, _T_I64, size["uncompressed"]),
                (_CM_COMPRESSED, _T_I64, size["compressed"]),
                (_CM_DATA_OFFSET, _T_I64, start + size["dict_size"]),
                (_CM_DICT_OFFSET, _T_I64, start),
                (13, _T_LIST, (_T_STRUCT, [  # encoding_stats
                    [(1, _T_I32, _PAGE_DICT), (2, _T_I32, _ENC_PLAIN), (3, _T_I32, 1)],
                    [(1, _T_I32, _PAGE_DATA), (2, _T_I32, _ENC_RLE_DICT), (3, _T_I32, size["pages"])],
                ])),
            ]
            chunks["experts.list.element"] = [(_CC_FILE_OFFSET, _T_I64, 0), (_CC_META, _T_STRUCT, cm)]
        ordered = [chunks[p] for p in self.leaf_paths]
        metas = [_get(cc, _CC_META) for cc in ordered]
        self.row_groups.append([
            (1, _T_LIST, (_T_STRUCT, ordered)),
            (2, _T_I64, sum(_get(m, _CM_UNCOMPRESSED) for m in metas)),
            (3, _T_I64, T),
            (5, _T_I64, min(_get(m, _CM_DICT_OFFSET, _get(m, _CM_DATA_OFFSET)) for m in metas)),
            (6, _T_I64, sum(_get(m, _CM_COMPRESSED) for m in metas)),
            (7, _T_I16, len(self.row_groups)),
        ])
        self.num_rows += T
        self.f.flush()  # the row group is on disk (in the temporary file), as pq.ParquetWriter leaves it

    def close(self) -> None:
        """Write the footer and close the file (the caller fsyncs and renames it)."""
        from moetrace import __version__

        try:
            meta = _set(self.template, 3, _T_I64, self.num_rows)
            meta = _set(meta, 4, _T_LIST, (_T_STRUCT, self.row_groups))
            meta = _set(meta, 6, _T_BINARY, f"moetrace version {__version__} (build parquet-cpp-arrow {pa.__version__})".encode())
            footer = _thrift_bytes(meta)
            self._write(footer + len(footer).to_bytes(4, "little") + b"PAR1")
        finally:
            self.f.close()

    def abort(self) -> None:
        """Close the file without a footer (the caller removes it)."""
        self.f.close()
