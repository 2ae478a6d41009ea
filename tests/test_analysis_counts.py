"""counts: the dense aggregation against a plain numpy reference, the tidy table, and bad input."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from factories import stage_mask, tiny_model, write_trace
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrace.analysis.counts import count_arrays, count_trace, write_counts_table
from moetrace.errors import ConfigError, TraceFormatError


def reference_counts(rows_T, dec_T, topk_ids_TLK, R, E):
    """Obvious numpy: one np.add.at per (token, layer, slot) id, -1 skipped."""
    T, L, K = topk_ids_TLK.shape
    out = np.zeros((R, 2, L, E), np.int64)
    t, l, k = np.nonzero(topk_ids_TLK >= 0)
    np.add.at(out, (rows_T[t], dec_T[t].astype(int), l, topk_ids_TLK[t, l, k]), 1)
    return out


def random_trace(tmp_path, *, R=13, L=3, E=7, K=2, seed=0, holes=0.1):
    rng = np.random.default_rng(seed)
    ptok = rng.integers(1, 40, size=R)
    otok = rng.integers(0, 30, size=R)
    T = int((ptok + otok).sum())
    ids = np.argsort(rng.random((T, L, E)), axis=-1)[..., :K].astype(np.int16)
    ids[rng.random((T, L)) < holes] = -1  # whole (token, layer) unrecorded
    rids = rng.choice(10_000, size=R, replace=False).astype(np.int64)  # unsorted, sparse ids
    path = write_trace(
        tmp_path / "t",
        model=tiny_model(num_layers=L, num_experts=E, top_k=K),
        dataset_R=[f"d{i % 3}" for i in range(R)],
        prompt_tokens_R=ptok,
        output_tokens_R=otok,
        topk_ids_TLK=ids,
        request_id_R=rids,
    )
    order = np.argsort(rids)
    row_of = np.empty(R, np.int64)
    row_of[order] = np.arange(R)
    rows_T = np.repeat(row_of, ptok + otok)
    ref = reference_counts(rows_T, stage_mask(ptok, otok), ids, R, E)
    return path, ref, rids


def test_count_trace_matches_reference(tmp_path):
    path, ref, rids = random_trace(tmp_path)
    res = count_trace(path, batch_tokens=50)  # many batches, requests split across batches
    assert res.counts_RSLE.dtype == np.uint8
    np.testing.assert_array_equal(res.counts_RSLE, ref)
    np.testing.assert_array_equal(res.request_id_R, np.sort(rids))
    assert res.stages == ("prefill", "decode") and res.layers == (0, 1, 2)


def test_stage_and_layer_selection(tmp_path):
    path, ref, _ = random_trace(tmp_path, seed=3)
    res = count_trace(path, stages=["decode"], layers=[2, 0])
    np.testing.assert_array_equal(res.counts_RSLE[:, 0], ref[:, 1][:, [2, 0]])
    np.testing.assert_array_equal(res.stage("decode"), ref[:, 1][:, [2, 0]])
    assert res.model_layers == (2, 0)
    with pytest.raises(ConfigError, match="prefill"):
        res.stage("prefill")
    with pytest.raises(ConfigError, match="0..2"):
        count_trace(path, layers=[3])
    with pytest.raises(ConfigError, match="stages"):
        count_trace(path, stages=["warmup"])


def test_dtype_grows_with_request_length(tmp_path):
    T = 300
    ids = np.zeros((T, 1, 1), np.int16)  # every token on expert 0: count = stage length
    path = write_trace(
        tmp_path / "t",
        model=tiny_model(num_layers=1, num_experts=2, top_k=1),
        dataset_R=["a"],
        prompt_tokens_R=np.array([T - 1]),
        output_tokens_R=np.array([1]),
        topk_ids_TLK=ids,
    )
    res = count_trace(path)
    assert res.counts_RSLE.dtype == np.uint16
    assert res.counts_RSLE[0, 0, 0, 0] == T - 1 and res.counts_RSLE[0, 1, 0, 0] == 1
    assert count_trace(path, stages=["decode"]).counts_RSLE.dtype == np.uint8


def test_repeated_id_within_a_token_is_reported(tmp_path):
    ids = np.zeros((256, 1, 2), np.int16)  # 255 prefill tokens -> uint8; 2 per token -> 510 wraps
    path = write_trace(
        tmp_path / "t",
        model=tiny_model(num_layers=1, num_experts=2, top_k=2),
        dataset_R=["a"],
        prompt_tokens_R=np.array([255]),
        output_tokens_R=np.array([1]),
        topk_ids_TLK=ids,
    )
    with pytest.raises(TraceFormatError, match="moetrace validate"):
        count_trace(path)


def test_tidy_table_roundtrip(tmp_path):
    path, ref, rids = random_trace(tmp_path, seed=5)
    res = count_trace(path)
    n = write_counts_table(res, tmp_path / "counts.parquet", chunk_requests=4)
    df = pl.read_parquet(tmp_path / "counts.parquet")
    assert df.columns == ["request_id", "dataset", "stage", "layer", "model_layer", "expert", "count"]
    assert n == df.height == int((ref > 0).sum())
    assert (df["count"] > 0).all()
    assert df["count"].sum() == ref.sum()
    # one cell by hand
    r = int(np.argmax(ref[:, 1, 1].sum(-1)))
    e = int(np.argmax(ref[r, 1, 1]))
    got = df.filter(
        (pl.col("request_id") == np.sort(rids)[r])
        & (pl.col("stage") == "decode")
        & (pl.col("layer") == 1)
        & (pl.col("expert") == e)
    )["count"]
    assert got.to_list() == [ref[r, 1, 1, e]]


@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 60), L=st.integers(1, 4), K=st.integers(1, 3), R=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_count_arrays_equals_reference(T, L, K, R, seed):
    rng = np.random.default_rng(seed)
    E = K + 3
    ids = np.argsort(rng.random((T, L, E)), axis=-1)[..., :K].astype(np.int16)
    ids[rng.random((T, L, K)) < 0.2] = -1
    rows = rng.integers(0, R, size=T)
    dec = rng.random(T) < 0.5
    counts = np.zeros((R, 2, L, E), np.uint16)
    count_arrays(
        counts,
        row_T=rows,
        stage_T=dec.astype(np.int8),
        topk_ids_TX=ids.reshape(T, L * K),
        layers_L=np.arange(L),
        top_k=K,
    )
    np.testing.assert_array_equal(counts, reference_counts(rows, dec, ids, R, E))


def test_id_out_of_range_is_an_error():
    counts = np.zeros((1, 1, 1, 4), np.uint8)
    with pytest.raises(TraceFormatError, match="num_experts=4"):
        count_arrays(
            counts, row_T=np.zeros(1), stage_T=np.zeros(1), topk_ids_TX=np.array([[5]]), layers_L=np.array([0]), top_k=1
        )


def test_corrupt_part_is_a_clean_error(tmp_path):
    """A truncated routing part gives a TraceFormatError naming the file, not a pyarrow traceback."""
    from factories import write_small_trace

    from moetrace.analysis.counts import count_trace
    from moetrace.errors import TraceFormatError

    path = write_small_trace(tmp_path / "t")
    part = sorted((path / "routing").glob("*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:200])
    with pytest.raises(TraceFormatError, match="validate"):
        count_trace(path)
