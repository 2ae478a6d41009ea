"""The routing part files the writer assembles (vectorized `experts` encoder + pyarrow's narrow columns) hold
exactly what pyarrow itself writes for the same rows: same Arrow and Parquet schema, same encodings and codec,
same values through pyarrow, polars and the trace reader, and `validate` finds nothing."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import ModelInfo, routing_schema
from moetrace.tracer.trace.validate import find_problems
from moetrace.tracer.trace.writer import TraceWriter, _ExpertsEncoder, _page_compressor


def _model(num_experts: int, layers: int, top_k: int) -> ModelInfo:
    return ModelInfo(name="m", source="m", architecture="A", num_hidden_layers=layers, moe_layers=tuple(range(layers)),
                     num_experts=num_experts, top_k=top_k, num_shared_experts=0, hidden_size=8)


def _ids(rng, T: int, X: int, E: int, *, neg_rows=(), mixed=False) -> np.ndarray:
    ids = rng.integers(0, E, (T, X)).astype(np.int16)
    ids[list(neg_rows)] = -1  # whole rows not recorded (last generated token, prefix-cache hit)
    if mixed:
        ids[1, 0] = -1  # one slot of a recorded row
    return ids


CASES = {  # name: (num_experts, layers, top_k, neg_rows, mixed)
    "dsv3-shape, no -1": (256, 58, 8, (), False),
    "dsv3-shape, -1 rows": (256, 58, 8, (0, 7, 8, 59), False),
    "dsv3-shape, -1 inside a row (pyarrow encodes it)": (256, 4, 8, (5,), True),
    "8 experts, -1 rows and slots (4-bit indices)": (8, 3, 2, (2, 3), True),
    "128 experts (8-bit with -1)": (128, 5, 4, (9,), True),
    "300 experts (above 255: pyarrow encodes it)": (300, 2, 8, (1,), False),
    "one id per token": (4, 1, 1, (0,), False),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("compression", ["lz4", "zstd", "snappy", "none", "gzip"])
def test_parts_match_what_pyarrow_writes(tmp_path, case, compression):
    E, L, K, neg_rows, mixed = CASES[case]
    model, X = _model(E, L, K), L * K
    rng = np.random.default_rng(len(case))
    lengths = [(7, 5), (3, 0), (20, 13), (1, 1)] * 4
    T = sum(p + o for p, o in lengths)
    ids = _ids(rng, T, X, E, neg_rows=neg_rows, mixed=mixed)
    weights = rng.random((T, X)).astype(np.float32)
    out = tmp_path / "t"
    with TraceWriter(out, model=model, backend={"name": "synthetic"}, collection={}, with_weights=True,
                     compression=compression, row_group_tokens=40, part_tokens=120) as w:
        t = 0
        for r, (p, o) in enumerate(lengths):
            w.add_request(request_id=r, dataset="d", prompt_tokens=p, topk_ids_TX=ids[t:t + p + o],
                          topk_weights_TX=weights[t:t + p + o])
            t += p + o
    assert find_problems(out) == []
    trace = open_trace(out)
    files = trace.routing_files()
    assert len(files) > 1 and pq.ParquetFile(files[0]).metadata.num_row_groups > 1
    got = pa.concat_tables([pq.read_table(f) for f in files])
    assert got.schema.remove_metadata() == routing_schema(X, with_weights=True)
    # the same rows written by pyarrow alone, as the writer did before
    ref_path = tmp_path / "ref.parquet"
    codec = None if compression == "none" else compression
    pq.write_table(got, ref_path, compression=codec, use_dictionary=["stage", "experts.list.element"],
                   write_statistics=["request_id", "position"])
    ref = pq.read_table(ref_path)
    assert got.equals(ref)
    assert np.array_equal(np.asarray(got.column("experts").combine_chunks().flatten()).reshape(T, X), ids)
    assert np.array_equal(np.asarray(got.column("weights").combine_chunks().flatten()).reshape(T, X), weights)
    positions = np.concatenate([np.arange(p + o) for p, o in lengths])
    assert np.array_equal(got.column("position").to_numpy(), positions)
    assert got.column("stage").to_pylist() == ["prefill" if p_ < p else "decode" for p, o in lengths for p_ in range(p + o)]
    # every reader: pyarrow's Parquet schema and encodings, polars, the trace reader, statistics
    meta, ref_meta = pq.read_metadata(files[0]), pq.read_metadata(ref_path)
    assert meta.schema.equals(ref_meta.schema)
    for i in range(meta.num_columns):
        c, rc = meta.row_group(0).column(i), ref_meta.row_group(0).column(i)
        assert (c.path_in_schema, c.physical_type, c.compression) == (rc.path_in_schema, rc.physical_type, rc.compression)
        assert set(c.encodings) == set(rc.encodings), c.path_in_schema
    stats = meta.row_group(0).column(0).statistics
    assert stats.has_min_max and stats.min == 0
    polars_ids = np.concatenate([np.stack(pl.read_parquet(f)["experts"].to_numpy()) for f in files])
    assert np.array_equal(polars_ids, ids)
    arr = trace.token_arrays()
    assert np.array_equal(arr.topk_ids_TLK.reshape(T, X), ids)


def test_the_vectorized_encoder_covers_what_it_should():
    enc = _ExpertsEncoder(16, _page_compressor(0))
    rng = np.random.default_rng(0)
    full = rng.integers(0, 256, (50, 16)).astype(np.int16)
    assert enc.plan([full])[:2] == (255, 9)  # ids 0..255 then -1: 257 entries; pages without -1 are 8-bit
    rows = full.copy()
    rows[[3, 4]] = -1
    assert enc.plan([rows]) is not None  # -1 rows with id 255: 8-bit pages and runs of index 256
    rows[5, 0] = -1
    assert enc.plan([rows]) is None  # a row mixing -1 and id 255's index 256 needs 9-bit pages: pyarrow
    small = rng.integers(-1, 8, (50, 16)).astype(np.int16)
    assert enc.plan([small])[:2] == (7, 4)
    assert enc.plan([np.full((3, 16), 300, np.int16)]) is None
    assert enc.plan([np.full((3, 16), -2, np.int16)]) is None
    assert _page_compressor(2) is None  # gzip: pyarrow encodes the column
