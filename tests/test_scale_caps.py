"""compare/place on a sample of the requests (issue 27): the training and held-out caps are applied
and recorded, only the sampled requests are counted, and below the caps nothing changes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moetrace.analysis.counts import count_trace
from moetrace.errors import ConfigError
from moetrace.placement.compare import (
    CompareConfig,
    load_trace_data,
    placement_file,
    run_compare,
    with_held_out_tokens,
)
from moetrace.placement.compare_manifest import CompareManifest
from moetrace.placement.deployment import parse_deployment
from moetrace.tracer.trace.schema import ModelInfo
from moetrace.tracer.trace.writer import TraceWriter

E, K, L = 16, 2, 2
MODEL = ModelInfo(
    name="capped",
    source="test",
    architecture="Test",
    num_hidden_layers=3,
    moe_layers=(1, 2),
    num_experts=E,
    top_k=K,
    num_shared_experts=0,
    hidden_size=8,
)
NUM_REQUESTS = 60  # split 0.25: 45 train, 15 held out


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """Two parity domains (domain d routes to experts e % 2 == d), lengths varying by request."""
    rng = np.random.default_rng(3)
    rows, ptok, otok = [], [], []
    for r in range(NUM_REQUESTS):
        pool = np.arange(r % 2, E, 2)
        p, o = 4 + r % 3, 6 + r % 5
        ids = np.stack([np.stack([rng.choice(pool, K, replace=False) for _ in range(L)]) for _ in range(p + o)])
        ids[-1] = -1  # the final generated token is never forwarded
        rows.append(ids.reshape(p + o, L * K))
        ptok.append(p)
        otok.append(o)
    path = tmp_path_factory.mktemp("t") / "capped"
    with TraceWriter(path, model=MODEL, backend={"name": "synthetic"}, collection={"planted": "parity"}) as w:
        w.add_requests(
            request_id_R=np.arange(100, 100 + NUM_REQUESTS),
            dataset_R=[f"d{r % 2}" for r in range(NUM_REQUESTS)],
            prompt_tokens_R=np.array(ptok),
            output_tokens_R=np.array(otok),
            topk_ids_TX=np.concatenate(rows),
        )
    return path


def _cfg(**kw) -> CompareConfig:
    return CompareConfig(
        deployment=parse_deployment("DP2TP4EP8", num_gpus_per_node=4),
        num_batches=20,
        num_batch_requests=8,
        strategies=("linear", "eplb", "data", "joint"),
        test_fraction=0.25,
        **kw,
    )


def test_count_trace_rows_counts_only_the_selected_requests(trace):
    full = count_trace(trace)
    rows = np.array([1, 4, 5, 30, 59])
    part = count_trace(trace, rows=rows)
    assert part.request_id_R.tolist() == full.request_id_R[rows].tolist()
    assert np.array_equal(part.counts_RSLE, full.counts_RSLE[rows])
    assert part.dataset_R.tolist() == full.dataset_R[rows].tolist()
    with pytest.raises(ConfigError, match="ascending"):
        count_trace(trace, rows=np.array([4, 1]))


def test_caps_sample_and_record(trace):
    full = with_held_out_tokens(load_trace_data(trace, test_fraction=0.25, seed=0))
    capped = with_held_out_tokens(
        load_trace_data(trace, test_fraction=0.25, seed=0, max_train_requests=10, max_test_requests=4)
    )
    assert (~capped.is_test_R).sum() == 10 and capped.is_test_R.sum() == 4
    assert capped.decode_RLE.shape[0] == 14  # only the sampled requests are counted
    rows = capped.trace_rows_R
    assert rows is not None and (np.diff(rows) > 0).all()
    # a sample of the same split: train rows come from the training requests, held-out from the held-out
    assert full.is_test_R[rows].tolist() == capped.is_test_R.tolist()
    assert np.array_equal(capped.decode_RLE, full.decode_RLE[rows])
    assert np.array_equal(capped.prefill_RLE, full.prefill_RLE[rows])
    # the held-out tokens are those of the sampled held-out requests only, row numbers in the sample
    assert capped.test_req_T is not None and full.test_req_T is not None
    assert set(capped.test_req_T.tolist()) == set(np.flatnonzero(capped.is_test_R).tolist())
    kept_full = np.isin(full.test_req_T, rows)
    assert capped.test_topk_ids_TLK is not None and full.test_topk_ids_TLK is not None
    assert np.array_equal(capped.test_topk_ids_TLK, full.test_topk_ids_TLK[kept_full])
    assert np.array_equal(rows[capped.test_req_T], full.test_req_T[kept_full])

    cfg = _cfg(max_train_requests=10, max_test_requests=4)
    res = run_compare(capped, cfg)
    m = res.manifest
    assert (m.num_train_requests, m.num_test_requests) == (10, 4)
    assert (m.num_trace_requests, m.num_trace_train_requests, m.num_trace_test_requests) == (60, 45, 15)
    assert (m.max_train_requests, m.max_test_requests) == (10, 4) and m.capped
    back = CompareManifest.from_json(json.loads(json.dumps(m.to_json())), where="compare.json")
    assert back == m
    source = placement_file(capped, cfg, res.placed["joint"]).source
    assert source["num_train_requests"] == 10 and source["max_train_requests"] == 10
    assert source["num_trace_train_requests"] == 45


def test_below_the_caps_nothing_changes(trace):
    default = load_trace_data(trace, test_fraction=0.25, seed=0)
    wide = load_trace_data(trace, test_fraction=0.25, seed=0, max_train_requests=45, max_test_requests=15)
    assert default.trace_rows_R is None and wide.trace_rows_R is None  # every request, in trace order
    assert np.array_equal(default.decode_RLE, wide.decode_RLE)
    a = run_compare(default, _cfg())
    b = run_compare(wide, _cfg(max_train_requests=45, max_test_requests=15))
    assert not a.manifest.capped and a.manifest.num_train_requests == 45
    for ra, rb in zip(a.summary_rows(), b.summary_rows()):
        assert ra.strategy == rb.strategy
        assert ra.inter_node_normalized_median == rb.inter_node_normalized_median
        assert ra.a2a_time_normalized_median == rb.a2a_time_normalized_median


def test_caps_must_match_the_config(trace):
    data = load_trace_data(trace, test_fraction=0.25, seed=0, held_out_tokens=False, max_train_requests=10)
    with pytest.raises(ConfigError, match="request caps"):
        run_compare(data, _cfg())
    with pytest.raises(ConfigError, match=">= 1"):
        _cfg(max_test_requests=0)
