"""Parquet's footer and page headers in the Thrift compact protocol, read and written by the fast encoder.

What it holds: the Thrift compact protocol (``_ThriftReader``, ``_thrift_bytes``: structs as lists of
``(field id, type code, value)`` in field order), the Parquet enums and ``RowGroup`` / ``ColumnChunk`` /
``ColumnMetaData`` field ids the encoder uses, the footer of a whole Parquet file (``_footer``) and its row
groups and column chunks, and the message every ``EncoderError`` of the fast encoder ends with (the escape
hatch, ``ENCODER_ENV``).

Out of scope: what to write (``parquet_encoder``: the part, the fence against pyarrow; ``parquet_pages``: the
``experts`` pages), Thrift types the footers pyarrow writes never hold (sets, maps, lists of booleans: an
``EncoderError``), the Thrift binary protocol.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from moetrace.errors import EncoderError

#: the environment variable that picks the encoder when the writer is not told
ENCODER_ENV = "MOETRACE_PARQUET_ENCODER"
ESCAPE_HATCH = f"set {ENCODER_ENV}=pyarrow to write through plain pyarrow (slower, same trace format)"

# Parquet enums used below (parquet.thrift)
_PAGE_DATA, _PAGE_DICT = 0, 2
_ENC_PLAIN, _ENC_RLE, _ENC_RLE_DICT = 0, 3, 8
_CODEC_NONE, _CODEC_SNAPPY, _CODEC_LZ4_HADOOP, _CODEC_ZSTD, _CODEC_LZ4_RAW = 0, 1, 5, 6, 7
# RowGroup, ColumnChunk and ColumnMetaData field ids
_RG_ORDINAL = 7
_CC_FILE_OFFSET, _CC_META = 2, 3
_CM_ENCODINGS, _CM_PATH, _CM_CODEC, _CM_NUM_VALUES, _CM_UNCOMPRESSED, _CM_COMPRESSED = 2, 3, 4, 5, 6, 7
_CM_DATA_OFFSET, _CM_INDEX_OFFSET, _CM_DICT_OFFSET, _CM_ENCODING_STATS = 9, 10, 11, 13
_CM_BLOOM_OFFSET, _CM_BLOOM_LENGTH, _CM_SIZE_STATS = 14, 15, 16
#: ColumnMetaData fields that differ between two encodings of the same rows (sizes, offsets)
_CM_LAYOUT_FIELDS = (_CM_UNCOMPRESSED, _CM_COMPRESSED, _CM_DATA_OFFSET, _CM_INDEX_OFFSET, _CM_DICT_OFFSET)


def _row_groups(footer: _Struct) -> list[_Struct]:
    return _get(footer, 4, (None, []))[1]


def _chunk_of(rg: _Struct, path: str) -> _Struct:
    """The ``ColumnChunk`` of the leaf column ``path`` (``experts.list.element``) in row group ``rg``."""
    for cc in _get(rg, 1)[1]:
        if ".".join(x.decode() for x in _get(_get(cc, _CC_META), _CM_PATH)[1]) == path:
            return cc
    raise EncoderError(f"pyarrow {pa.__version__} wrote no column chunk {path}; {ESCAPE_HATCH}")


def _ids(fields: _Struct) -> list[int]:
    return sorted(f for f, _, _ in fields)


# ---------------------------------------------------------------------------------------------------------------
# Thrift compact protocol (the encoding of Parquet footers and page headers): type codes
_T_TRUE, _T_FALSE, _T_BYTE, _T_I16, _T_I32, _T_I64, _T_DOUBLE, _T_BINARY, _T_LIST, _T_SET, _T_MAP, _T_STRUCT = range(
    1, 13
)
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
    """Decode Thrift compact-protocol bytes (pyarrow's footers) into ``_Struct`` trees (no schema needed)."""

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
            return self.data[self.pos - n : self.pos]
        if t == _T_STRUCT:
            return self.struct()
        if t in (_T_LIST, _T_SET):
            h = self.data[self.pos]
            self.pos += 1
            size, et = h >> 4, h & 0x0F
            if size == 15:
                size = self._uvarint()
            if et in (_T_TRUE, _T_FALSE):
                raise EncoderError(
                    f"pyarrow {pa.__version__} wrote a list of booleans in a Parquet footer, which the "
                    f"fast Parquet encoder does not read; {ESCAPE_HATCH}"
                )
            return (et, [self._value(et) for _ in range(size)])
        if t == _T_BYTE:
            self.pos += 1
            return int.from_bytes(self.data[self.pos - 1 : self.pos], "little", signed=True)
        if t == _T_DOUBLE:
            self.pos += 8
            return self.data[self.pos - 8 : self.pos]
        raise EncoderError(
            f"pyarrow {pa.__version__} wrote Thrift type {t} in a Parquet footer, which the fast "
            f"Parquet encoder does not read; {ESCAPE_HATCH}"
        )

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
        raise EncoderError(f"the fast Parquet encoder cannot write Thrift type {t}; {ESCAPE_HATCH}")


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
        raise EncoderError(f"pyarrow {pa.__version__} produced a Parquet buffer without PAR1 magic; {ESCAPE_HATCH}")
    n = int.from_bytes(data[-8:-4], "little")
    return _ThriftReader(data, len(data) - 8 - n).struct()
