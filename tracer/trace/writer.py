"""The trace writer: the one crash-safe writer every producer (HF, vLLM, synth, import) uses.

Crash safety. Rows are buffered and flushed as Parquet row groups into an open *part*, written under
a temporary name (``.<name>.parquet.tmp``). ``commit()`` closes the part: the routing file is renamed
to its final name first, then the matching requests file. A request is *committed* exactly when its
row is in a final ``requests/*.parquet``; a routing part without its requests part (a kill between
the two renames) is an orphan and is removed on resume. Readers only ever look at final names.
``manifest.json`` is written (atomically) with ``complete: false`` at start and finalized by
``close()``, which records every committed part in ``parts`` (its requests, its tokens and the SHA-256
of both files, computed from the bytes as they are written: ``checksum.HashingFile``) next to the ``totals``, so readers and
``validate`` can tell a part that went missing or changed. Temporary files get unpredictable names
(``.<part>.<random>.tmp``), created exclusively, so a symbolic link planted in a shared directory is
never followed. ``--overwrite`` removes the manifest first, then the requests parts (the commit
points), then the routing parts: an overwrite killed half-way leaves a directory that ``--resume``
refuses (no manifest) rather than a trace that looks complete with rows missing; a resume that
finds a part its manifest lists missing, or a requests part without its routing, refuses too.

Speed. Routing parts are encoded by ``parquet_encoder``: by default its fast encoder (pyarrow encodes the
narrow columns, numpy the ``experts`` ids in pyarrow's own encoding), about 1 M tokens/s of the DeepSeek-V3
shape instead of ~0.1 (benchmarks/bench_writer.py); ``encoder="pyarrow"`` or
``MOETRACE_PARQUET_ENCODER=pyarrow`` writes through plain pyarrow instead. The files are the same trace
format v1 to every reader.

Shape legend (docs/architecture.md): T tokens, R requests, L MoE layers, K top-k, X = L*K.

Out of scope: what the rows mean (``schema``), file names (``layout``), creating, syncing and resuming the
files on disk and replacing a whole trace (``writer_files``), the Parquet encoding of routing parts
(``parquet_encoder``), reading (``reader``), checking (``validate``), producing the rows (``moetrace.tracer.backends``, ``synth``, ``importers``).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.atomic import write_json_atomic
from moetrace.errors import EncoderError, OutputExistsError, WriteError
from moetrace.tracer.trace.checksum import SYNC_EVERY, HashingFile
from moetrace.tracer.trace.layout import MANIFEST, PART_RE, REQUESTS_DIR, ROUTING_DIR, lock_name, part_name
from moetrace.tracer.trace.lock import lock_trace
from moetrace.tracer.trace.parquet_encoder import (
    Encoder,
    RoutingPart,
    resolve_encoder,
    routing_part_opener,
    writer_options,
)
from moetrace.tracer.trace.schema import (
    STAGE_DECODE,
    STAGE_PREFILL,
    ModelInfo,
    new_manifest,
    requests_schema,
    routing_schema,
)
from moetrace.tracer.trace.writer_files import (
    _create_hashed,
    _describe_write_error,
    _fsync_dir,
    _fsync_file,
    _part_entry,
    check_resumable,
)
from moetrace.tracer.trace.writer_files import replacing_trace as replacing_trace  # its import name since issue 38

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
        Manifest sections (docs/trace-format.md).
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
    encoder
        How routing parts are encoded (``parquet_encoder``): ``"fast"`` (numpy, ~10x pyarrow's speed) or
        ``"pyarrow"`` (plain ``pyarrow.parquet``); the same files either way. None (default):
        ``$MOETRACE_PARQUET_ENCODER`` if set, else ``"fast"``. An unknown name is a ``ConfigError``; a pyarrow
        whose files the fast encoder cannot reproduce is an ``EncoderError`` here, before anything is written.
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
        encoder: Encoder | None = None,
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
        self.encoder: Encoder = resolve_encoder(encoder)
        # checks the fast encoder against the installed pyarrow once, before the directory is touched
        self._open_routing_part = routing_part_opener(
            self.routing_schema, compression=self.compression, encoder=self.encoder
        )
        self._closed = False
        self._failed: BaseException | None = None  # the error that stopped this writer, if one did

        self.completed_request_ids: set[int] = set()
        #: the manifest's ``parts``: committed part name -> its requests, tokens and files' SHA-256 (this run's
        #: parts hashed as written; a resumed trace's parts that lack them on a background thread, complete at close)
        self.parts: dict[str, dict[str, Any]] = {}
        self._hashing: dict[str, Future[dict[str, Any]]] = {}
        self._hasher: ThreadPoolExecutor | None = None
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

        # the open part and its temporary files (unpredictable names: see the module docstring)
        self._pq: RoutingPart | None = None
        self._routing_file: HashingFile | None = None  # the open part's routing file, hashed as it is written
        self._part_name: str | None = None
        self._tmp_token = ""
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
            self._manifest["parts"] = self.parts
        else:
            self._manifest = new_manifest(model=self.model, backend=backend, collection=collection)
        self._manifest["writer"] = {
            "with_weights": self.with_weights,
            "with_text": self.with_text,
            "compression": self.compression or "none",
        }
        write_json_atomic(self._manifest_path, self._manifest)

    def _remove_trace_files(self) -> None:
        """Delete this writer's trace: the manifest first (a directory without one is never resumed),
        then the requests parts (the commit points), then the routing parts and temporaries."""
        if os.path.lexists(self._manifest_path):
            self._manifest_path.unlink()
            _fsync_dir(self._manifest_path.parent)
        for sub in (REQUESTS_DIR, ROUTING_DIR):
            d = self.path / sub
            if d.is_dir():
                for f in d.iterdir():
                    if self._own_parts_glob != "*.parquet" and not f.name.lstrip(".").startswith(
                        f"{self.part_prefix}-"
                    ):
                        continue  # another shard's file
                    if f.name.endswith(".parquet") or f.name.endswith(".tmp"):
                        f.unlink()
                _fsync_dir(d)

    def _check_resumable(self, *, backend: dict, collection: dict) -> dict[str, Any]:
        """The manifest of the trace being resumed, refused unless it is this writer's model, options and
        collection settings (``writer_files.check_resumable``)."""
        return check_resumable(
            self.path,
            self._manifest_path,
            model=self.model,
            with_weights=self.with_weights,
            with_text=self.with_text,
            collection=collection,
        )

    def _cleanup_uncommitted(self) -> None:
        """Remove temporary files and orphan routing parts (no matching requests part)."""
        for sub in (ROUTING_DIR, REQUESTS_DIR):
            tmp_glob = ".*.tmp" if self._own_parts_glob == "*.parquet" else f".{self.part_prefix}-*.tmp"
            for f in (self.path / sub).glob(tmp_glob):
                f.unlink()
        committed = {f.name for f in (self.path / REQUESTS_DIR).glob("*.parquet")}
        for f in (self.path / ROUTING_DIR).glob("*.parquet"):
            part = PART_RE.match(f.name)
            if f.name not in committed and part is not None and part["prefix"] == self.part_prefix:
                f.unlink()

    def _load_committed(self) -> None:
        """Read the committed parts of a trace being resumed: their request ids, tokens and checksums
        (kept from the manifest where it lists them, else computed now). Refuses a trace that lost a
        part its manifest lists, or a requests part without its routing part."""
        parts = self._manifest.get("parts")
        listed: dict[str, Any] = parts if isinstance(parts, dict) else {}
        on_disk = {f.name for f in (self.path / REQUESTS_DIR).glob(self._own_parts_glob)}
        lost = sorted(n for n in listed if n not in on_disk)
        no_routing = sorted(n for n in on_disk if not (self.path / ROUTING_DIR / n).is_file())
        if lost or no_routing:
            what = [f"requests/{n} (listed in the manifest)" for n in lost]
            what += [f"routing/{n} (its requests part is committed)" for n in no_routing]
            raise OutputExistsError(
                f"{self.path} is missing {len(what)} committed file(s): {', '.join(what[:3])}; resuming would "
                "mark requests done whose rows are gone. Use --overwrite to start afresh (or another -o)"
            )
        for name in sorted(on_disk):
            f = self.path / REQUESTS_DIR / name
            ids = pq.read_table(f, columns=["request_id"]).column(0).to_numpy()
            self.completed_request_ids.update(int(x) for x in ids)
            self._prior_parts += 1
            tokens = pq.read_metadata(self.path / ROUTING_DIR / name).num_rows
            self._prior_tokens += tokens
            old = listed.get(name)
            if isinstance(old, dict) and {"routing_sha256", "requests_sha256"} <= old.keys():
                self.parts[name] = old
            else:  # committed by a run that was killed: hashed now, on the background thread
                self._hash_part(name, len(ids), tokens)

    def _first_free_seq(self) -> int:
        seqs = [
            int(m["seq"])
            for sub in (ROUTING_DIR, REQUESTS_DIR)
            for f in (self.path / sub).glob("*.parquet")
            if (m := PART_RE.match(f.name)) and m["prefix"] == self.part_prefix
        ]
        return max(seqs) + 1 if seqs else 0

    # ------------------------------------------------------------------ writing
    def __enter__(self) -> TraceWriter:
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

    def _tmp(self, sub: str) -> Path:
        """The temporary file of the open part under ``sub``: ``.<part>.<random>.tmp``."""
        assert self._part_name is not None
        return self.path / sub / f".{self._part_name}.{self._tmp_token}.tmp"

    def _open_part(self) -> None:
        self._part_name = part_name(self.part_prefix, self._next_seq)
        self._next_seq += 1
        self._tmp_token = secrets.token_hex(8)
        # the disk writes the part while it is encoded: the commit's fsync waits for the last few MiB only
        self._routing_file = _create_hashed(self._tmp(ROUTING_DIR), sync_every=SYNC_EVERY)
        self._pq = self._open_routing_part(self._routing_file)  # closes the file

    def _flush_row_group(self) -> None:
        if not self._buf:
            return
        with self._on_write_error():
            if self._pq is None:
                self._open_part()
            assert self._pq is not None
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
        routing_tmp, req_tmp = self._tmp(ROUTING_DIR), self._tmp(REQUESTS_DIR)
        assert self._routing_file is not None
        with self._on_write_error():
            self._pq.close()
            _fsync_file(routing_tmp)
            with _create_hashed(req_tmp) as req_file:
                pq.write_table(
                    pa.Table.from_pylist(self._req_rows, schema=self.requests_schema),
                    req_file,
                    **writer_options("zstd", use_dictionary=True, write_statistics=True),
                )
            _fsync_file(req_tmp)
            entry = {
                "num_requests": len(self._req_rows),
                "num_tokens": self._part_tokens,
                "routing_sha256": self._routing_file.hexdigest(),
                "requests_sha256": req_file.hexdigest(),
            }
        os.replace(routing_tmp, rdir / self._part_name)  # routing first
        os.replace(req_tmp, qdir / self._part_name)  # then requests: the commit point
        self.parts[self._part_name] = entry
        self.completed_request_ids.update(r["request_id"] for r in self._req_rows)
        self._pq = None
        self._routing_file = None
        self._part_name = None
        self._part_tokens = 0
        self._req_rows = []

    @contextlib.contextmanager
    def _on_write_error(self) -> Iterator[None]:
        """A failed write (disk full, I/O error) drops the open part, whose requests were never committed,
        and becomes one clean error naming the cause; the committed parts stay and the trace stays resumable.
        An ``EncoderError`` (what the fast encoder cannot write) drops the part the same way and stays itself."""
        try:
            yield
        except (OSError, pa.ArrowException, EncoderError) as exc:
            self._failed = exc
            if self._pq is not None:
                with contextlib.suppress(OSError):  # the part is being discarded anyway
                    self._pq.abort()
            if self._routing_file is not None:
                with contextlib.suppress(OSError):
                    self._routing_file.abort()
            for sub in (ROUTING_DIR, REQUESTS_DIR):
                if self._part_name is not None:
                    self._tmp(sub).unlink(missing_ok=True)
            self._pq, self._routing_file, self._part_name, self._buf, self._req_rows = None, None, None, [], []
            if isinstance(exc, EncoderError):
                raise
            raise WriteError(_describe_write_error(exc, self.path)) from exc

    def close(self, *, complete: bool = True, extra_manifest: dict[str, Any] | None = None) -> WriterStats:
        """Commit what is buffered and finalize the manifest (``complete`` as given)."""
        if self._closed:
            return self.stats()
        if self._failed is not None:  # nothing more can be written; the manifest on disk says incomplete
            self._closed = True
            self._stop_hashing()
            self._lock.release()
            return self.stats()
        try:
            self.commit()
            self._closed = True
            stats = self.stats()
            self.parts.update({name: f.result() for name, f in self._hashing.items()})
            self._hashing = {}
            self._manifest["complete"] = bool(complete)
            self._manifest["totals"] = {"num_requests": stats.num_requests, "num_tokens": stats.num_tokens}
            self._manifest["parts"] = dict(sorted(self.parts.items()))
            if extra_manifest:
                self._manifest.update(extra_manifest)
            write_json_atomic(self._manifest_path, self._manifest)
        finally:
            self._stop_hashing()
            self._lock.release()  # also when the last commit failed (disk full): the trace stays resumable
        return stats

    def _hash_part(self, name: str, num_requests: int, num_tokens: int) -> None:
        """Compute the manifest entry of part ``name``, committed by an earlier run that recorded no checksums
        (its files' SHA-256, read from disk) on a background thread; :meth:`close` collects the entries."""
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetrace-part-sha256")
        self._hashing[name] = self._hasher.submit(
            _part_entry, num_requests, num_tokens, self.path / ROUTING_DIR / name, self.path / REQUESTS_DIR / name
        )

    def _stop_hashing(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True, cancel_futures=True)
            self._hasher = None

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


def _stage_strings(is_decode_T: np.ndarray) -> pa.StringArray:
    """The ``stage`` column (``prefill`` / ``decode`` per token): ``is_decode_T`` bool [T]. (The two words'
    array is built on the first call: ``pa.array`` imports pandas, which a module that ``validate`` imports
    must not do at start-up.)"""
    words = pa.array([STAGE_PREFILL, STAGE_DECODE])
    return words.take(pa.array(is_decode_T.view(np.int8)))
