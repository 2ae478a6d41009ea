"""`moetrace validate` catches each kind of corruption and names it."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
from factories import SMALL
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.tracer.trace.validate import find_problems

runner = CliRunner()


def _part(trace, sub="routing"):
    return sorted((trace / sub).glob("*.parquet"))[0]


def test_valid_trace_passes_cli(small_trace):
    res = runner.invoke(app, ["validate", str(small_trace)])
    assert res.exit_code == 0, res.output
    assert "valid" in res.output


def test_truncated_file(small_trace):
    f = _part(small_trace)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    probs = find_problems(small_trace)
    assert any("not readable as Parquet" in p and f.name in p for p in probs)
    res = runner.invoke(app, ["validate", str(small_trace)])
    assert res.exit_code == 1 and "not readable as Parquet" in res.output


def test_out_of_range_id(small_trace):
    f = _part(small_trace)
    t = pq.read_table(f)
    flat = pa.compute.list_flatten(t.column("experts")).to_numpy().copy()
    flat[5] = SMALL.num_experts  # one past the end
    flat[7] = -3
    col = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.int16()), SMALL.ids_per_token)
    pq.write_table(t.set_column(3, "experts", col), f)
    probs = find_problems(small_trace)
    assert any("2 expert ids out of range" in p for p in probs), probs


def test_duplicate_rows(small_trace):
    f = _part(small_trace)
    t = pq.read_table(f)
    pq.write_table(pa.concat_tables([t, t.slice(0, 2)]), f)
    probs = find_problems(small_trace)
    assert any("duplicate (request_id, position)" in p for p in probs), probs


def test_wrong_schema(small_trace):
    f = _part(small_trace)
    t = pq.read_table(f)
    t = t.set_column(1, "position", t.column("position").cast(pa.int64()))
    pq.write_table(t, f)
    probs = find_problems(small_trace)
    assert any("`position` has type int64, expected int32" in p for p in probs), probs


def test_wrong_list_width(small_trace):
    f = _part(small_trace)
    t = pq.read_table(f)
    flat = pa.compute.list_flatten(t.column("experts")).combine_chunks()
    col = pa.FixedSizeListArray.from_arrays(flat.slice(0, t.num_rows * 3), 3)
    pq.write_table(t.set_column(3, "experts", col), f)
    assert any("expected fixed_size_list<int16>[6]" in p for p in find_problems(small_trace))


def test_stage_inconsistent_with_prompt_tokens(small_trace):
    f = _part(small_trace)
    t = pq.read_table(f)
    stage = t.column("stage").to_pylist()
    stage[0] = "decode"
    pq.write_table(t.set_column(2, "stage", pa.array(stage)), f)
    assert any("stage disagrees" in p for p in find_problems(small_trace))


def test_missing_rows_and_incomplete_manifest(small_trace):
    f = _part(small_trace)
    t = pq.read_table(f)
    pq.write_table(t.slice(1), f)
    m = json.loads((small_trace / "manifest.json").read_text())
    m["complete"] = False
    (small_trace / "manifest.json").write_text(json.dumps(m))
    probs = find_problems(small_trace)
    assert any("row count differs" in p for p in probs)
    assert any("`complete` is False" in p for p in probs)


def test_leftover_temporary_and_orphan(small_trace):
    (small_trace / "routing" / ".part-000009.parquet.tmp").write_bytes(b"x")
    os.remove(_part(small_trace, "requests"))
    probs = find_problems(small_trace)
    assert any("leftover temporary file" in p for p in probs)
    assert any("uncommitted part" in p for p in probs)


def test_text_without_opt_in(small_trace):
    f = _part(small_trace, "requests")
    t = pq.read_table(f)
    t = t.append_column("prompt_text", pa.array(["secret"] * t.num_rows))
    pq.write_table(t, f)
    assert any("`prompt_text`" in p for p in find_problems(small_trace))


def test_not_a_trace(tmp_path):
    res = runner.invoke(app, ["validate", str(tmp_path)])
    assert res.exit_code == 1 and "not a moetrace trace" in res.output
    res = runner.invoke(app, ["validate", str(tmp_path / "nope")])
    assert res.exit_code == 1 and "no such trace directory" in res.output


def _grouped_trace(path, *, E: int, K: int, n_group: int, topk_group: int, break_one: bool):
    """A trace of a group-limited router (3 MoE layers): every token keeps to ``topk_group`` groups,
    except (``break_one``) request 1's token 2 at MoE layer 1, whose experts span one group too many."""
    import numpy as np

    from moetrace.tracer.trace.schema import ModelInfo
    from moetrace.tracer.trace.writer import TraceWriter

    L, size = 3, E // n_group
    model = ModelInfo(
        name="grouped",
        source="test",
        architecture="Test",
        num_hidden_layers=L,
        moe_layers=tuple(range(L)),
        num_experts=E,
        top_k=K,
        num_shared_experts=0,
        hidden_size=8,
        n_group=n_group,
        topk_group=topk_group,
    )
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(3):
        ids = np.empty((8, L, K), np.int16)
        for t in range(8):
            for layer in range(L):
                groups = rng.choice(n_group, topk_group, replace=False)
                pool = np.concatenate([np.arange(g * size, (g + 1) * size) for g in groups])
                ids[t, layer] = rng.choice(pool, K, replace=False)
        ids[-1] = -1
        rows.append(ids)
    if break_one:
        rows[1][2, 1] = np.arange(K, dtype=np.int16) * size % E  # K experts in K distinct groups
    with TraceWriter(path, model=model, backend={"name": "synthetic"}, collection={}) as w:
        w.add_requests(
            request_id_R=np.arange(3),
            dataset_R=["d"] * 3,
            prompt_tokens_R=np.full(3, 4),
            output_tokens_R=np.full(3, 4),
            topk_ids_TX=np.concatenate(rows).reshape(24, L * K),
        )
    return path


def test_group_limited_router_ids_are_checked(tmp_path):
    # K = 8 of 64 experts in 8 groups, 4 per token (DeepSeek-V3's shape, small); K = 3 of 12 in 6 groups, 2 per
    # token; K = 4 of 32 in 16 groups, 3 per token (more than 8 groups: 64-bit group masks)
    for E, K, n_group, topk_group in ((64, 8, 8, 4), (12, 3, 6, 2), (32, 4, 16, 3)):
        ok = _grouped_trace(tmp_path / f"ok{E}", E=E, K=K, n_group=n_group, topk_group=topk_group, break_one=False)
        assert find_problems(ok) == []
        bad = _grouped_trace(tmp_path / f"bad{E}", E=E, K=K, n_group=n_group, topk_group=topk_group, break_one=True)
        probs = find_problems(bad)
        assert len(probs) == 1, probs
        assert (
            f"1 (token, MoE layer) rows use experts of more than topk_group={topk_group}" in probs[0]
            and "request 1 position 2 MoE layer 1" in probs[0]
            and "logical expert ids" in probs[0]
        ), probs
        res = runner.invoke(app, ["validate", str(bad)])
        assert res.exit_code == 1 and "EPLB remap" in res.output and "Traceback" not in res.output
