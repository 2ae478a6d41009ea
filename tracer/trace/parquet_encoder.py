"""Routing part files in Parquet: the fast encoder (default) and plain pyarrow (the escape hatch), one interface.

What it writes. A routing part (``routing/*.parquet``, trace format v1) row group by row group. With the
**fast** encoder (``encoder="fast"``, the default) pyarrow writes the narrow columns (``request_id``,
``position``, ``stage``, ``weights``) of each row group into memory, their column chunks are copied into the
part, and the ``experts`` column chunk is encoded with numpy in the encoding pyarrow itself writes: one PLAIN
int32 dictionary page (the ids 0..max, then -1 if it occurs), then RLE_DICTIONARY data pages (about 1 Mi ids
each, across request boundaries) with RLE (short rows: bit-packed) repetition levels, RLE definition levels
and bit-packed indices of at most 8 bits, the same codec, and the same column metadata (size statistics
where the installed pyarrow writes them). The footer is pyarrow's own footer for the routing schema (schema
elements, ``ARROW:schema``, column orders) holding this file's row groups. With **pyarrow**
(``encoder="pyarrow"`` or ``MOETRACE_PARQUET_ENCODER=pyarrow``) a plain ``pyarrow.parquet.ParquetWriter``
writes the part. Both take the same explicit writer options (``writer_options``), so both give the same
decoded table, the same column-metadata fields and, at real model shapes, file sizes within 1 %; where id
255 and -1 meet in a row group the fast encoder's parts are smaller (8-bit pages and runs of -1 rows where
pyarrow packs 9-bit indices). tests/test_writer_parquet.py checks this, also under the pyarrow floor
(tests/test_pyarrow_floor.py); tests/test_parquet_encoder.py the choice of encoder and the fence.

What it leaves out. Page indexes (ColumnIndex/OffsetIndex), Bloom filters, page checksums, statistics of
anything but ``request_id`` and ``position``, v2 data pages, and file paths in column chunks: the options
turn them off for both encoders, and the fast encoder refuses (``EncoderError``) a pyarrow that writes them
anyway. Nor the copy of each chunk's column metadata that pyarrow 16 and 17 write after it (deprecated;
``file_offset`` is 0, as pyarrow >= 18 writes it). Ids above 255, a row group where id 255 and a row mixing ``-1`` with recorded ids meet (9-bit
indices), and codecs other than lz4, zstd, snappy and none are encoded by pyarrow (the old speed), copied
the same way.

Why it exists. pyarrow encodes the ``experts`` column at about 10 ns per id (per-value dictionary hashing,
level encoding, bit packing), which caps the writer near 0.1 M tokens/s of the DeepSeek-V3 shape (464 ids
per token); the fast encoder writes about 1 M tokens/s, 10-13x the tokens per CPU-second
(docs/benchmarks.md, benchmarks/bench_writer.py).

Fenced. ``routing_part_opener`` checks once, when a writer opens and before anything is written, that the
fast encoder writes what the installed pyarrow writes for a small probe (same column-chunk and
column-metadata fields, same encodings, codec, size statistics, same decoded table); anything else it
cannot handle later is an ``EncoderError`` whose message names the escape hatch.

Where. This module writes the part (narrow columns copied from pyarrow, row groups, footer) and holds the
fence; ``parquet_pages`` encodes the ``experts`` pages, ``parquet_thrift`` reads and writes the Thrift structs
of footers and page headers.

Shape legend (docs/architecture.md): T tokens, X = L*K ids per token.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.errors import ConfigError, EncoderError
from moetrace.tracer.trace.parquet_pages import _Bytes, _ExpertsEncoder, _page_compressor
from moetrace.tracer.trace.parquet_thrift import (
    _CC_FILE_OFFSET,
    _CC_META,
    _CM_BLOOM_LENGTH,
    _CM_BLOOM_OFFSET,
    _CM_CODEC,
    _CM_COMPRESSED,
    _CM_DATA_OFFSET,
    _CM_DICT_OFFSET,
    _CM_ENCODING_STATS,
    _CM_ENCODINGS,
    _CM_INDEX_OFFSET,
    _CM_LAYOUT_FIELDS,
    _CM_NUM_VALUES,
    _CM_PATH,
    _CM_SIZE_STATS,
    _CM_UNCOMPRESSED,
    _ENC_PLAIN,
    _ENC_RLE,
    _ENC_RLE_DICT,
    _PAGE_DATA,
    _PAGE_DICT,
    _RG_ORDINAL,
    _T_BINARY,
    _T_I16,
    _T_I32,
    _T_I64,
    _T_LIST,
    _T_STRUCT,
    ENCODER_ENV,
    ESCAPE_HATCH,
    _chunk_of,
    _footer,
    _get,
    _ids,
    _row_groups,
    _set,
    _Struct,
    _thrift_bytes,
)

Encoder = Literal["fast", "pyarrow"]
ENCODERS: tuple[Encoder, ...] = ("fast", "pyarrow")

#: routing columns that are dictionary-encoded, and the only ones with statistics (Parquet column paths)
ROUTING_DICTIONARY = ["stage", "experts.list.element"]
ROUTING_STATISTICS = ["request_id", "position"]


def resolve_encoder(encoder: str | None = None) -> Encoder:
    """The encoder a writer uses: ``encoder`` when given, else ``$MOETRACE_PARQUET_ENCODER``, else ``"fast"``.

    An unknown name (argument or environment) is a ``ConfigError``."""
    if encoder is None:
        value = os.environ.get(ENCODER_ENV, "")
        if value == "":
            return "fast"
        where = f"{ENCODER_ENV}={value!r}"
    else:
        value, where = encoder, f"encoder={encoder!r}"
    for name in ENCODERS:
        if value == name:
            return name
    raise ConfigError(f"{where} names no Parquet encoder; use one of {', '.join(ENCODERS)}")


def writer_options(
    compression: str | None, *, use_dictionary: bool | Sequence[str], write_statistics: bool | Sequence[str]
) -> dict[str, Any]:
    """Keyword arguments of ``pq.ParquetWriter``/``pq.write_table``: every option that shapes the file, stated
    explicitly so a new pyarrow release with other defaults writes the same files. ``compression``: a Parquet
    codec name, or None for none."""
    options: dict[str, Any] = dict(
        version="2.6",  # Parquet logical types (pyarrow's default since 13)
        compression=compression,
        use_dictionary=list(use_dictionary) if not isinstance(use_dictionary, bool) else use_dictionary,
        write_statistics=list(write_statistics) if not isinstance(write_statistics, bool) else write_statistics,
        data_page_version="1.0",  # the fast encoder writes v1 data pages
        data_page_size=1 << 20,  # bytes per data page; the fast encoder's pages hold 1 Mi ids (_PAGE_IDS)
        write_page_index=False,  # no ColumnIndex/OffsetIndex: the fast encoder copies column chunks, not page indexes
        write_page_checksum=False,  # no page CRCs: the fast encoder's page headers carry none
        use_compliant_nested_type=True,  # the list's leaf is experts.list.element
        store_schema=True,  # ARROW:schema in the footer: readers get fixed_size_list<int16> back
        use_byte_stream_split=False,
    )
    # Bloom filters: pyarrow writes them only from 24 on, and only when `bloom_filter_options` asks; older
    # releases reject the keyword (ParquetWriter passes unknown options on and fails), so it is passed exactly
    # where it exists, as None (no filter)
    if _pyarrow_major() >= 24:
        options["bloom_filter_options"] = None
    return options


def _pyarrow_major() -> int:
    return int(pa.__version__.split(".")[0])


class OutputFile(Protocol):
    """An open binary output stream a routing part is written into (a file, the writer's ``HashingFile``)."""

    def write(self, b: Any, /) -> int:
        """Write the bytes-like ``b`` whole; returns its size."""

    def flush(self) -> None: ...

    def close(self) -> None: ...


class RoutingPart(Protocol):
    """One routing part being written under its temporary name: row groups in, a Parquet file out.

    A failed write (disk full) raises ``OSError`` or ``pa.ArrowException``, as ``pq.ParquetWriter`` does; what
    the fast encoder cannot write raises ``EncoderError``."""

    def write_row_group(self, narrow: pa.Table, ids_list: list[np.ndarray]) -> None:
        """Append one row group: ``narrow`` holds every column but ``experts``, ``ids_list`` the ``experts`` ids
        of the same rows as C-contiguous int16 ``[T_i, X]`` arrays, in row order."""

    def close(self) -> None:
        """Write the footer and close the file (the caller fsyncs and renames it)."""

    def abort(self) -> None:
        """Close the file, footer or not (the caller removes it)."""


def routing_part_opener(
    schema: pa.Schema, *, compression: str | None, encoder: Encoder
) -> Callable[[Path | OutputFile], RoutingPart]:
    """``open(path_or_file) -> RoutingPart`` for parts of ``schema`` (the routing schema) written by ``encoder``:
    into the file at a path (opened here), or into an open binary file (the writer's ``HashingFile``; the part's
    ``close`` and ``abort`` close it).

    For the fast encoder this checks, once, that it writes what the installed pyarrow writes for a probe
    (``EncoderError`` if not, before any file is opened). ``compression``: a codec pyarrow knows, or None."""
    if compression is not None and not pa.Codec.is_available(compression):
        raise ConfigError(
            f"compression {compression!r} is not a Parquet codec this pyarrow has "
            "(lz4, zstd, snappy, gzip, brotli or none)"
        )
    options = writer_options(compression, use_dictionary=ROUTING_DICTIONARY, write_statistics=ROUTING_STATISTICS)
    if encoder == "pyarrow":
        return lambda where: _PyarrowPart(where, schema, options)
    setup = _FastSetup(schema, options)
    setup.check_against_pyarrow()

    def open_fast(where: Path | OutputFile) -> RoutingPart:
        f = open(where, "wb") if isinstance(where, (str, os.PathLike)) else where
        try:
            return _FastPart(f, setup)
        except BaseException:
            f.close()
            raise

    return open_fast


def _experts_array(ids_list: list[np.ndarray], schema: pa.Schema) -> pa.ChunkedArray:
    """The ``experts`` column of ``schema`` for the rows ``ids_list`` (int16 ``[T_i, X]`` arrays), one chunk per
    array: pyarrow builds a chunk's levels and indices at once, so the chunks as added bound its memory."""
    t = schema.field("experts").type
    return pa.chunked_array(
        [pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1), type=pa.int16()), type=t) for a in ids_list], type=t
    )


def _with_experts(narrow: pa.Table, ids_list: list[np.ndarray], schema: pa.Schema) -> pa.Table:
    """The whole routing table: ``narrow``'s columns with ``experts`` in its place of ``schema``."""
    experts = _experts_array(ids_list, schema)
    cols = [experts if f.name == "experts" else narrow.column(f.name) for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)


class _PyarrowPart:
    """The escape hatch: a plain ``pq.ParquetWriter`` with the explicit options, one row group per call."""

    def __init__(self, where: Path | OutputFile, schema: pa.Schema, options: dict[str, Any]) -> None:
        self.schema = schema
        self.file = None if isinstance(where, (str, os.PathLike)) else where  # pyarrow never closes a stream
        self.writer = pq.ParquetWriter(where, schema, **options)

    def write_row_group(self, narrow: pa.Table, ids_list: list[np.ndarray]) -> None:
        if narrow.num_rows:
            self.writer.write_table(_with_experts(narrow, ids_list, self.schema), row_group_size=narrow.num_rows)

    def close(self) -> None:
        try:
            self.writer.close()
        finally:
            if self.file is not None:
                self.file.close()

    def abort(self) -> None:
        with contextlib.suppress(OSError, pa.ArrowException):  # the part is being removed: its footer is moot
            self.writer.close()
        if self.file is not None:
            self.file.close()


# ---------------------------------------------------------------------------------------------------------------
# The fast encoder.


class _FastSetup:
    """What every fast part of one writer shares: pyarrow's options, footer template and codec for ``schema``."""

    def __init__(self, schema: pa.Schema, options: dict[str, Any]) -> None:
        self.schema = schema
        self.options = options
        self.X = schema.field("experts").type.list_size
        # pyarrow's footer for this schema: schema elements, ARROW:schema, column orders
        empty = self.pyarrow_file(schema.empty_table())
        self.template = _footer(empty)
        self.leaf_paths = [c.path for c in pq.read_metadata(pa.BufferReader(empty)).schema]
        experts_paths = [p for p in self.leaf_paths if p.split(".")[0] == "experts"]
        if len(experts_paths) != 1:
            raise EncoderError(
                f"pyarrow {pa.__version__} lays the experts column out as {experts_paths}, not one "
                f"leaf column; {ESCAPE_HATCH}"
            )
        self.experts_path = experts_paths[0]
        # what pyarrow writes for a small probe: the codec id, and whether column metadata carry size statistics
        self.probe = _probe_table(schema)
        self.reference = self.pyarrow_file(self.probe)
        ref_rg = _row_groups(_footer(self.reference))[0]
        ref_cm = _get(_chunk_of(ref_rg, self.experts_path), _CC_META)
        self.codec: int = _get(ref_cm, _CM_CODEC)
        self.size_statistics = _get(ref_cm, _CM_SIZE_STATS) is not None
        self.row_group_ordinal = _get(ref_rg, _RG_ORDINAL) is not None
        compress = _page_compressor(self.codec)
        self.encoder = _ExpertsEncoder(self.X, compress) if compress is not None else None

    def pyarrow_file(self, table: pa.Table) -> bytes:
        """``table`` written by pyarrow with the options, as one row group, in memory."""
        sink = pa.BufferOutputStream()
        with pq.ParquetWriter(sink, table.schema, **self.options) as w:
            w.write_table(table, row_group_size=max(table.num_rows, 1))
        return sink.getvalue().to_pybytes()

    def check_against_pyarrow(self) -> None:
        """Raise ``EncoderError`` unless the fast encoder writes the probe as pyarrow does: the same column-chunk
        and column-metadata fields, encodings, codec, size statistics and row-group fields, the same table."""
        buf = io.BytesIO()
        part = _FastPart(buf, self)
        part.write_row_group(self.probe.drop_columns(["experts"]), [_probe_ids(self.X)])
        part.close_footer()
        data = buf.getvalue()
        ours, ref = _row_groups(_footer(data))[0], _row_groups(_footer(self.reference))[0]
        problems = []
        if {f for f, _, _ in ours} != {f for f, _, _ in ref}:
            problems.append(f"row-group fields {_ids(ours)} vs {_ids(ref)}")
        for path in self.leaf_paths:
            cc, rcc = _chunk_of(ours, path), _chunk_of(ref, path)
            if _ids(cc) != _ids(rcc):
                problems.append(f"{path}: column-chunk fields {_ids(cc)} vs {_ids(rcc)}")
            cm, rcm = _get(cc, _CC_META), _get(rcc, _CC_META)
            if _ids(cm) != _ids(rcm):
                problems.append(f"{path}: column-metadata fields {_ids(cm)} vs {_ids(rcm)}")
            for fid, _, v in rcm:
                if fid in _CM_LAYOUT_FIELDS:
                    continue
                mine = _get(cm, fid)
                if fid in (_CM_ENCODINGS, _CM_ENCODING_STATS):
                    mine, v = sorted(map(repr, mine[1])) if mine else None, sorted(map(repr, v[1]))
                if mine != v:
                    problems.append(
                        f"{path}: column-metadata field {fid} is {repr(mine)[:60]}, pyarrow writes {repr(v)[:60]}"
                    )
        if not problems and not pq.read_table(pa.BufferReader(data)).equals(
            pq.read_table(pa.BufferReader(self.reference))
        ):
            problems.append("the decoded tables differ")
        if problems:
            raise EncoderError(
                f"the fast Parquet encoder does not write what pyarrow {pa.__version__} writes for a "
                f"routing part ({'; '.join(problems[:3])}); {ESCAPE_HATCH}"
            )


def _probe_ids(X: int) -> np.ndarray:
    """int16 [4, X]: recorded ids 0..2, a row of -1 (not recorded), one more recorded row."""
    ids = (np.arange(4 * X, dtype=np.int16) % 3).reshape(4, X)
    ids[2] = -1
    return ids


def _probe_table(schema: pa.Schema) -> pa.Table:
    """A 4-row routing table of ``schema``: the rows the fast encoder is checked on."""
    T, X = 4, schema.field("experts").type.list_size
    cols = {
        "request_id": pa.array(np.zeros(T, np.int64)),
        "position": pa.array(np.arange(T, dtype=np.int32)),
        "stage": pa.array(["prefill", "prefill", "decode", "decode"]),
        "experts": _experts_array([_probe_ids(X)], schema),
    }
    if "weights" in schema.names:
        w = pa.array(np.linspace(0, 1, T * X, dtype=np.float32))
        cols["weights"] = pa.FixedSizeListArray.from_arrays(w, X)
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


class _FastPart:
    """A routing part written by the fast encoder into the open binary file ``f`` (it closes it)."""

    def __init__(self, f: OutputFile, setup: _FastSetup) -> None:
        self.setup = setup
        self.f = f
        self.row_groups: list[_Struct] = []
        self.num_rows = 0
        self.f.write(b"PAR1")
        self.pos = 4

    def _write(self, b: _Bytes) -> None:
        """Append a bytes-like object."""
        self.pos += self.f.write(b)

    def _copy_chunks(self, data: bytes) -> dict[str, _Struct]:
        """Append the column chunks of the one-row-group Parquet file ``data`` to the part; their ``ColumnChunk``
        structs by column path, with offsets moved to where the chunks now lie."""
        (rg,) = _row_groups(_footer(data))
        chunks = {}
        for cc in _get(rg, 1)[1]:
            cm = _get(cc, _CC_META)
            path = ".".join(x.decode() for x in _get(cm, _CM_PATH)[1])
            extra = [f for f, _, _ in cc if f not in (_CC_FILE_OFFSET, _CC_META)] + [
                f for f in (_CM_INDEX_OFFSET, _CM_BLOOM_OFFSET, _CM_BLOOM_LENGTH) if _get(cm, f) is not None
            ]
            if extra:
                raise EncoderError(
                    f"pyarrow {pa.__version__} wrote page indexes, Bloom filters or file paths (Thrift fields {extra} "
                    f"of column {path}) that the fast Parquet encoder does not copy; {ESCAPE_HATCH}"
                )
            start = min(x for x in (_get(cm, _CM_DICT_OFFSET), _get(cm, _CM_DATA_OFFSET)) if x is not None)
            shift = self.pos - start
            self._write(data[start : start + _get(cm, _CM_COMPRESSED)])
            for fid in (_CM_DICT_OFFSET, _CM_DATA_OFFSET):
                if _get(cm, fid) is not None:
                    cm = _set(cm, fid, _T_I64, _get(cm, fid) + shift)
            # file_offset 0, as pyarrow >= 18 writes it: pyarrow 16 and 17 point it at a copy of the column
            # metadata after the chunk (deprecated in Parquet), which is not copied
            cc = _set(_set(cc, _CC_META, _T_STRUCT, cm), _CC_FILE_OFFSET, _T_I64, 0)
            chunks[path] = cc
        return chunks

    def write_row_group(self, narrow: pa.Table, ids_list: list[np.ndarray]) -> None:
        """Append one row group (see ``RoutingPart``)."""
        setup = self.setup
        T = narrow.num_rows
        if T == 0:
            return
        chunks = self._copy_chunks(setup.pyarrow_file(narrow))
        plan = setup.encoder.plan(ids_list) if setup.encoder is not None else None
        if setup.encoder is None or plan is None:
            # not covered by the vectorized encoder: pyarrow encodes the column, copied the same way
            experts = pa.Table.from_arrays(
                [_experts_array(ids_list, setup.schema)], schema=pa.schema([setup.schema.field("experts")])
            )
            chunks.update(self._copy_chunks(setup.pyarrow_file(experts)))
        else:
            start = self.pos
            size = setup.encoder.write(plan, self._write)
            cm: _Struct = [
                (1, _T_I32, 1),  # physical type INT32
                (_CM_ENCODINGS, _T_LIST, (_T_I32, [_ENC_PLAIN, _ENC_RLE, _ENC_RLE_DICT])),
                (_CM_PATH, _T_LIST, (_T_BINARY, [x.encode() for x in setup.experts_path.split(".")])),
                (_CM_CODEC, _T_I32, setup.codec),
                (_CM_NUM_VALUES, _T_I64, size["num_values"]),
                (_CM_UNCOMPRESSED, _T_I64, size["uncompressed"]),
                (_CM_COMPRESSED, _T_I64, size["compressed"]),
                (_CM_DATA_OFFSET, _T_I64, start + size["dict_size"]),
                (_CM_DICT_OFFSET, _T_I64, start),
                (
                    _CM_ENCODING_STATS,
                    _T_LIST,
                    (
                        _T_STRUCT,
                        [
                            [(1, _T_I32, _PAGE_DICT), (2, _T_I32, _ENC_PLAIN), (3, _T_I32, 1)],
                            [(1, _T_I32, _PAGE_DATA), (2, _T_I32, _ENC_RLE_DICT), (3, _T_I32, size["pages"])],
                        ],
                    ),
                ),
            ]
            if setup.size_statistics:  # level histograms: every row one level-0 and X-1 level-1 repetitions, no nulls
                X = setup.X
                cm.append(
                    (
                        _CM_SIZE_STATS,
                        _T_STRUCT,
                        [(2, _T_LIST, (_T_I64, [T, T * (X - 1)])), (3, _T_LIST, (_T_I64, [0, T * X]))],
                    )
                )
            chunks[setup.experts_path] = [(_CC_FILE_OFFSET, _T_I64, 0), (_CC_META, _T_STRUCT, cm)]
        ordered = [chunks[p] for p in setup.leaf_paths]
        metas = [_get(cc, _CC_META) for cc in ordered]
        rg = [
            (1, _T_LIST, (_T_STRUCT, ordered)),
            (2, _T_I64, sum(_get(m, _CM_UNCOMPRESSED) for m in metas)),
            (3, _T_I64, T),
            (5, _T_I64, min(_get(m, _CM_DICT_OFFSET, _get(m, _CM_DATA_OFFSET)) for m in metas)),
            (6, _T_I64, sum(_get(m, _CM_COMPRESSED) for m in metas)),
        ]
        if setup.row_group_ordinal:
            rg.append((_RG_ORDINAL, _T_I16, len(self.row_groups)))
        self.row_groups.append(rg)
        self.num_rows += T
        self.f.flush()  # the row group is on disk (in the temporary file), as pq.ParquetWriter leaves it

    def close_footer(self) -> None:
        """Write the footer (the file stays open)."""
        from moetrace import __version__

        meta = _set(self.setup.template, 3, _T_I64, self.num_rows)
        meta = _set(meta, 4, _T_LIST, (_T_STRUCT, self.row_groups))
        meta = _set(
            meta, 6, _T_BINARY, f"moetrace version {__version__} (build parquet-cpp-arrow {pa.__version__})".encode()
        )
        footer = _thrift_bytes(meta)
        self._write(footer + len(footer).to_bytes(4, "little") + b"PAR1")

    def close(self) -> None:
        try:
            self.close_footer()
        finally:
            self.f.close()

    def abort(self) -> None:
        self.f.close()
