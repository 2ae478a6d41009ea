"""The ``experts`` column chunk of a routing part, encoded with numpy in the encoding pyarrow writes.

What it holds: ``_ExpertsEncoder`` (``plan`` a row group's ids, ``write`` its dictionary page and data pages),
the page compressors of the codecs it supports (``_page_compressor``: none, lz4 with Hadoop framing, lz4_raw,
snappy, zstd) and the RLE / bit-packed hybrid it writes (``_rle_run``, ``_pack_bits``). The encoding is
described in ``parquet_encoder``'s docstring; ``tests/test_writer_parquet.py`` checks it against pyarrow's.

Out of scope: the other columns, the part's layout and footer and the fence against pyarrow
(``parquet_encoder``), the Thrift protocol (``parquet_thrift``), ids above 255, rows mixing -1 with ids where
257 dictionary entries meet, other codecs (``plan`` / ``_page_compressor`` return None: pyarrow encodes them).

Shape legend (docs/architecture.md): T tokens, X = L*K ids per token, G groups of 8 packed values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, TypeAlias

import numpy as np
import pyarrow as pa

from moetrace.tracer.trace.parquet_thrift import (
    _CODEC_LZ4_HADOOP,
    _CODEC_LZ4_RAW,
    _CODEC_NONE,
    _CODEC_SNAPPY,
    _CODEC_ZSTD,
    _ENC_PLAIN,
    _ENC_RLE,
    _ENC_RLE_DICT,
    _PAGE_DATA,
    _PAGE_DICT,
    _T_I32,
    _T_STRUCT,
    _Struct,
    _thrift_bytes,
    _varint,
)

#: what the encoder writes: page headers (bytes), page bodies (numpy's memoryview), compressed bodies (pa.Buffer)
_Bytes: TypeAlias = "bytes | memoryview | pa.Buffer"
#: indices per data page of the vectorized encoder (pyarrow's default data page holds ~1 MiB)
_PAGE_IDS = 1 << 20


def _page_compressor(codec: int) -> Callable[[np.ndarray], list[_Bytes]] | None:
    """For a Parquet codec id: ``body (uint8 array) -> list of byte chunks`` (the compressed page body), or None
    where the vectorized encoder does not support the codec."""
    if codec == _CODEC_NONE:
        return lambda body: [body.data]
    if codec == _CODEC_LZ4_HADOOP:  # Hadoop framing: big-endian raw size and compressed size, then an LZ4 block
        lz4 = pa.Codec("lz4_raw")

        def framed(body: np.ndarray) -> list[_Bytes]:
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


class _Plan(NamedTuple):
    """How the vectorized encoder writes one row group's ``experts`` chunk."""

    hi: int  # the largest id (-1 if none): the dictionary holds ids 0..hi
    neg: bool  # -1 occurs: the dictionary ends with -1, index hi + 1
    width: int  # bits of a dictionary index (at most 8 are packed; see _ExpertsEncoder)
    runs: list[tuple[list[np.ndarray], bool]]  # consecutive row blocks (int16 [n_i, X]) and whether all are -1


def _pages(blocks: list[np.ndarray], rows_per_page: int) -> list[list[np.ndarray]]:
    """Consecutive row blocks (int16 ``[n_i, X]``) cut into pages of ``rows_per_page`` rows (the last one
    shorter), each page the list of its row-block views."""
    pages: list[list[np.ndarray]] = []
    page: list[np.ndarray] = []
    n = 0
    for a in blocks:
        s = 0
        while s < a.shape[0]:
            take = min(rows_per_page - n, a.shape[0] - s)
            page.append(a[s : s + take])
            n, s = n + take, s + take
            if n == rows_per_page:
                pages.append(page)
                page, n = [], 0
    if page:
        pages.append(page)
    return pages


class _ExpertsEncoder:
    """Encode the ``experts`` column chunk (int16 ``[T, X]``) in pyarrow's encoding, vectorized with numpy.

    The dictionary page holds ids ``0..hi`` then, if it occurs, ``-1`` (``hi``: the largest id of the row group,
    at most 255), PLAIN int32. Data pages (about 1 Mi ids each, whole rows, across the row blocks it is given)
    hold repetition levels (one 0 then X-1 ones per row: RLE runs, or for short rows one bit-packed run), one
    RLE run of definition level 1, and the
    dictionary indices as one bit-packed run of as many bits as the largest index needs (an index is the id
    itself, -1's is ``hi + 1``), as pyarrow packs them. When id 255 and -1 both occur (257 entries), rows
    without -1 are 8-bit pages and rows of only -1 are RLE pages of index 256; a row mixing both, an id above
    255 or below -1 is not covered (``plan`` returns None).
    """

    def __init__(self, X: int, compress: Callable[[np.ndarray], list[_Bytes]]) -> None:
        self.X = X
        self.compress = compress
        self.rows_per_page = max(1, _PAGE_IDS // X)
        # repetition levels of one row: a run of one 0 then X-1 ones (bit width 1)
        self.rep_row = np.frombuffer(_rle_run(1, 0, 1) + (_rle_run(X - 1, 1, 1) if X > 1 else b""), np.uint8)

    def _rep_levels(self, n: int) -> bytes | None:
        """The repetition levels of ``n`` rows as one run where that is shorter than a pair of RLE runs per
        row (``rep_row``, written by the caller: None): all zeros for X = 1, else one bit-packed run (a 0 then
        X-1 ones per row, least significant bit first), which is shorter for short rows, as pyarrow chooses."""
        X = self.X
        if X == 1:
            return _rle_run(n, 0, 1)
        groups = -(-n * X // 8)
        head = _varint(groups << 1 | 1)
        if len(head) + groups >= n * self.rep_row.size:
            return None
        levels = np.ones(groups * 8, np.uint8)
        levels[: n * X : X] = 0
        levels[n * X :] = 0
        return head + np.packbits(levels, bitorder="little").tobytes()

    def plan(self, ids_list: list[np.ndarray]) -> _Plan | None:
        """The plan for the row group ``ids_list`` (C-contiguous int16 ``[T_i, X]`` arrays in row order), or
        None if not covered."""
        # the whole blocks' extremes (contiguous reductions); the rows' minima only where 257 entries need them
        lo = min((int(a.min()) for a in ids_list if a.size), default=0)
        hi = max((int(a.max()) for a in ids_list if a.size), default=0)
        if lo < -1 or hi > 255:
            return None
        hi, neg = max(hi, -1), lo < 0
        width = max(1, (hi + neg).bit_length())  # indices 0..hi, and hi+1 for -1
        if width <= 8 or not neg:
            return _Plan(hi, neg, width, [(list(ids_list), False)])
        runs: list[tuple[list[np.ndarray], bool]] = []
        for ids_TX in ids_list:
            neg_T = ids_TX.min(axis=1) < 0  # int16 [T_i] -> bool: the rows holding a -1
            if neg_T.any() and (ids_TX[neg_T].max(axis=1) >= 0).any():
                return None  # a row mixes -1 and recorded ids: index 256 would need 9-bit packed pages
            bounds = np.concatenate([[0], np.flatnonzero(np.diff(neg_T.view(np.int8))) + 1, [neg_T.size]]).tolist()
            for a, b in zip(bounds[:-1], bounds[1:]):
                if b > a:
                    if runs and runs[-1][1] == bool(neg_T[a]):
                        runs[-1][0].append(ids_TX[a:b])
                    else:
                        runs.append(([ids_TX[a:b]], bool(neg_T[a])))
        return _Plan(hi, neg, width, runs)

    def _page(
        self, write: Callable[[_Bytes], None], page_type: int, body: np.ndarray, sub_header: _Struct
    ) -> tuple[int, int]:
        """Write one page (header, compressed body); returns (uncompressed, compressed) bytes with the header."""
        chunks = self.compress(body)
        size = sum(
            c.size if isinstance(c, pa.Buffer) else c.nbytes if isinstance(c, memoryview) else len(c) for c in chunks
        )
        header = _thrift_bytes(
            [
                (1, _T_I32, page_type),
                (2, _T_I32, body.nbytes),
                (3, _T_I32, size),
                (5 if page_type == _PAGE_DATA else 7, _T_STRUCT, sub_header),
            ]
        )
        write(header)
        for c in chunks:
            write(c)
        return len(header) + body.nbytes, len(header) + size

    def write(self, plan: _Plan, write: Callable[[_Bytes], None]) -> dict[str, int]:
        """Write the chunk of ``plan`` through ``write(bytes-like)``; returns its sizes and page count."""
        hi, neg, width, runs = plan
        X = self.X
        dictionary = np.concatenate([np.arange(hi + 1, dtype="<i4"), np.array([-1] if neg else [], "<i4")])
        dict_u, dict_c = self._page(
            write, _PAGE_DICT, dictionary.view(np.uint8), [(1, _T_I32, dictionary.size), (2, _T_I32, _ENC_PLAIN)]
        )
        sizes = {"uncompressed": dict_u, "compressed": dict_c, "dict_size": dict_c, "pages": 0, "num_values": 0}
        for blocks, all_neg in runs:
            for page in _pages(blocks, self.rows_per_page):
                n = sum(a.shape[0] for a in page)
                rep = self._rep_levels(n)
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
                    body[o : o + rep_size] = np.frombuffer(rep, np.uint8)
                else:
                    body[o : o + rep_size].reshape(n, -1)[:] = self.rep_row
                o += rep_size
                body[o : o + 4] = np.frombuffer(len(dfn).to_bytes(4, "little"), np.uint8)
                body[o + 4 : o + 4 + len(dfn)] = np.frombuffer(dfn, np.uint8)
                o += 4 + len(dfn)
                if all_neg:
                    body[o:] = values
                else:
                    body[o : o + len(vhead)] = np.frombuffer(vhead, np.uint8)
                    o += len(vhead)
                    if bits == 8:
                        dst = body[o : o + n * X]
                        body[o + n * X :] = 0
                    else:
                        dst = np.zeros(groups * 8, np.uint8)
                    k = 0
                    for a in page:  # int16 -> uint8: -1 wraps to 255
                        np.copyto(dst[k : k + a.size], a.reshape(-1), casting="unsafe")
                        k += a.size
                    if neg and hi < 254 and min(int(a.min()) for a in page) < 0:
                        dst[dst == 255] = hi + 1  # the index of -1
                    if bits < 8:
                        body[o:] = _pack_bits(dst, bits)
                u, c = self._page(
                    write,
                    _PAGE_DATA,
                    body,
                    [(1, _T_I32, n * X), (2, _T_I32, _ENC_RLE_DICT), (3, _T_I32, _ENC_RLE), (4, _T_I32, _ENC_RLE)],
                )
                sizes["uncompressed"] += u
                sizes["compressed"] += c
                sizes["pages"] += 1
                sizes["num_values"] += n * X
        return sizes
