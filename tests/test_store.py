"""The trace writer and reader: format v1 on disk, crash safety, resume."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from factories import SMALL, write_small_trace

from moetrace.errors import OutputExistsError, TraceFormatError
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import ModelInfo, requests_schema, routing_schema
from moetrace.tracer.trace.validate import find_problems
from moetrace.tracer.trace.writer import TraceWriter


def test_roundtrip_rows_and_arrays(tmp_path):
    rng = np.random.default_rng(1)
    want = {}
    with TraceWriter(tmp_path / "t", model=SMALL, backend={"name": "synthetic"}, collection={}) as w:
        for r, (P, O) in enumerate([(3, 2), (1, 0), (5, 4)]):
            ex = rng.integers(-1, SMALL.num_experts, (P + O, SMALL.num_moe_layers, SMALL.top_k))
            w.add_request(request_id=10 + r, dataset="d", prompt_tokens=P, topk_ids_TX=ex)
            want[10 + r] = (P, O, ex)
    t = open_trace(tmp_path / "t")
    arr = t.token_arrays()
    assert arr.topk_ids_TLK.shape == (sum(P + O for P, O, _ in want.values()), 3, 2)
    assert arr.topk_ids_TLK.dtype == np.int16
    for rid, (P, O, ex) in want.items():
        m = arr.request_id_T == rid
        assert np.array_equal(arr.position_T[m], np.arange(P + O))
        assert np.array_equal(arr.is_decode_T[m], np.arange(P + O) >= P)
        assert np.array_equal(arr.topk_ids_TLK[m], ex)
    req = t.requests().sort("request_id").collect()
    assert req["prompt_tokens"].to_list() == [3, 1, 5]
    assert req["output_tokens"].to_list() == [2, 0, 4]
    assert t.routing().filter(stage="decode").collect().height == 6
    assert find_problems(tmp_path / "t") == []


def test_files_carry_the_explicit_schema(small_trace):
    t = open_trace(small_trace)
    for f in t.routing_files():
        assert pq.read_schema(f).remove_metadata() == routing_schema(SMALL.ids_per_token, with_weights=False)
    for f in t.requests_files():
        assert pq.read_schema(f).remove_metadata() == requests_schema(with_text=False)


def test_manifest_is_incomplete_until_close(tmp_path):
    w = TraceWriter(tmp_path / "t", model=SMALL, backend={"name": "synthetic"}, collection={})
    w.add_request(request_id=0, dataset="d", prompt_tokens=2, topk_ids_TX=np.zeros((3, 3, 2)))
    w.commit()
    m = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert m["complete"] is False and m["format"] == "moetrace.trace" and m["version"] == 1
    with pytest.raises(TraceFormatError, match="incomplete"):
        open_trace(tmp_path / "t")
    assert open_trace(tmp_path / "t", require_complete=False).token_arrays().topk_ids_TLK.shape[0] == 3
    w.close()
    assert open_trace(tmp_path / "t").manifest["totals"] == {"num_requests": 1, "num_tokens": 3}


def test_uncommitted_rows_are_invisible_and_row_groups_flush(tmp_path):
    w = TraceWriter(tmp_path / "t", model=SMALL, backend={"name": "synthetic"}, collection={}, row_group_tokens=4)
    for r in range(5):
        w.add_request(request_id=r, dataset="d", prompt_tokens=3, topk_ids_TX=np.zeros((5, 3, 2)))
    # row groups were flushed into the temporary part, readers see nothing yet
    tmp = list((tmp_path / "t" / "routing").glob(".*.tmp"))
    assert len(tmp) == 1 and tmp[0].stat().st_size > 0
    assert open_trace(tmp_path / "t", require_complete=False).part_names() == []
    w.close()
    f = open_trace(tmp_path / "t").routing_files()[0]
    assert pq.ParquetFile(f).metadata.num_row_groups == 5


def test_refuses_existing_and_resumes_same_model(tmp_path):
    write_small_trace(tmp_path / "t", num_requests=3)
    with pytest.raises(OutputExistsError, match="--resume"):
        TraceWriter(tmp_path / "t", model=SMALL, backend={"name": "synthetic"}, collection={"seed": 0})
    other = ModelInfo(**{**SMALL.__dict__, "num_experts": 32, "source": "other"})
    with pytest.raises(OutputExistsError, match="different model"):
        TraceWriter(tmp_path / "t", model=other, backend={"name": "synthetic"}, collection={}, on_existing="resume")
    with TraceWriter(
        tmp_path / "t", model=SMALL, backend={"name": "synthetic"}, collection={"seed": 0}, on_existing="resume"
    ) as w:
        assert w.completed_request_ids == {0, 1, 2}
        with pytest.raises(ValueError, match="already written"):
            w.add_request(request_id=1, dataset="d", prompt_tokens=1, topk_ids_TX=np.zeros((1, 3, 2)))
        w.add_request(request_id=3, dataset="d", prompt_tokens=1, topk_ids_TX=np.zeros((1, 3, 2)))
    assert find_problems(tmp_path / "t") == []
    assert open_trace(tmp_path / "t").requests().collect().height == 4


def test_resume_removes_orphans_and_temporaries(tmp_path):
    w = TraceWriter(tmp_path / "t", model=SMALL, backend={"name": "synthetic"}, collection={})
    w.add_request(request_id=0, dataset="d", prompt_tokens=2, topk_ids_TX=np.zeros((3, 3, 2)))
    w.commit()
    w.add_request(request_id=1, dataset="d", prompt_tokens=2, topk_ids_TX=np.zeros((3, 3, 2)))
    w.commit()
    # simulate a kill between the two renames of part 1, and one in the middle of part 2
    (tmp_path / "t" / "requests" / "part-000001.parquet").unlink()
    (tmp_path / "t" / "routing" / ".part-000002.parquet.tmp").write_bytes(b"PAR1 half")
    w._lock.release()  # what the kernel does when the killed writer's process dies
    assert any("uncommitted part" in p for p in find_problems(tmp_path / "t"))
    with TraceWriter(
        tmp_path / "t", model=SMALL, backend={"name": "synthetic"}, collection={}, on_existing="resume"
    ) as w2:
        assert w2.completed_request_ids == {0}
        w2.add_request(request_id=1, dataset="d", prompt_tokens=2, topk_ids_TX=np.ones((3, 3, 2)))
    assert find_problems(tmp_path / "t") == []
    arr = open_trace(tmp_path / "t").token_arrays()
    assert sorted(arr.request_id_T.tolist()) == [0, 0, 0, 1, 1, 1]


def test_overwrite_replaces(tmp_path):
    write_small_trace(tmp_path / "t", num_requests=4)
    write_small_trace(tmp_path / "t", num_requests=2, on_existing="overwrite")
    assert open_trace(tmp_path / "t").requests().collect().height == 2


def test_weights_and_text_columns(tmp_path):
    with TraceWriter(
        tmp_path / "t", model=SMALL, backend={"name": "hf"}, collection={}, with_weights=True, with_text=True
    ) as w:
        w.add_request(
            request_id=0,
            dataset="d",
            prompt_tokens=1,
            topk_ids_TX=np.zeros((2, 3, 2)),
            topk_weights_TX=np.full((2, 6), 0.5),
            prompt_text="hi",
            output_text="there",
        )
    t = open_trace(tmp_path / "t")
    assert t.requests().collect()["prompt_text"].to_list() == ["hi"]
    assert t.routing().collect()["weights"].to_list()[0] == [0.5] * 6
    assert find_problems(tmp_path / "t") == []


def test_bad_shapes_are_refused(tmp_path):
    with TraceWriter(tmp_path / "t", model=SMALL, backend={"name": "synthetic"}, collection={}) as w:
        with pytest.raises(ValueError, match="expected"):
            w.add_request(request_id=0, dataset="d", prompt_tokens=2, topk_ids_TX=np.zeros((3, 4, 2)))
        with pytest.raises(ValueError, match="prompt_tokens >= 1"):
            w.add_request(request_id=0, dataset="d", prompt_tokens=0, topk_ids_TX=np.zeros((3, 3, 2)))


@pytest.mark.parametrize(
    "model, match",
    [
        (None, "no `model` section"),
        ("deepseek-v3", "must be an object"),
        ({"top_k": "8"}, "lacks"),
        ("wrong-type", "`top_k` must be a whole number"),
    ],
)
def test_bad_manifest_model_is_a_format_error(small_trace, model, match):
    m = json.loads((small_trace / "manifest.json").read_text())
    if model is None:
        del m["model"]
    elif model == "wrong-type":
        m["model"]["top_k"] = "2"
    else:
        m["model"] = model
    (small_trace / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TraceFormatError, match=match):
        open_trace(small_trace)
    assert find_problems(small_trace)  # validate names the problem too, without raising


def test_a_file_is_not_a_trace(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(TraceFormatError, match="is a file"):
        open_trace(tmp_path / "f")


def test_damaged_parts_are_format_errors(small_trace):
    t = open_trace(small_trace)
    part = t.routing_files()[0]
    part.write_bytes(part.read_bytes()[:100])  # truncated by something outside moetrace
    with pytest.raises(TraceFormatError, match="not readable as Parquet"):
        t.token_arrays()
    part.unlink()
    with pytest.raises(TraceFormatError, match="without their routing file"):
        open_trace(small_trace)


def test_resume_refuses_a_different_prompt_selection(tmp_path):
    # request ids index the interleaved sample: another --per-dataset (or --num-requests, --prompt-field)
    # maps the same id to another prompt, so resuming would skip some prompts and repeat others
    coll = {"datasets": ["a", "b"], "per_dataset": 3, "seed": 0}
    write_small_trace(tmp_path / "t", num_requests=2)
    m = json.loads((tmp_path / "t" / "manifest.json").read_text())
    m["collection"] = coll
    (tmp_path / "t" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(OutputExistsError, match="per_dataset=3"):
        TraceWriter(
            tmp_path / "t",
            model=SMALL,
            backend={"name": "hf"},
            collection={**coll, "per_dataset": 5},
            on_existing="resume",
        )
    TraceWriter(tmp_path / "t", model=SMALL, backend={"name": "hf"}, collection=coll, on_existing="resume").close()
