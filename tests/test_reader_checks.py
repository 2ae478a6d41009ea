"""Readers trust nothing: a trace whose data disagrees with its manifest is refused, never miscounted.

Each case damages a valid trace the way a hostile or broken file would, then reads it through the
one streaming path every analysis uses (``Trace.iter_token_arrays``) and through the CLI.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from factories import SMALL, write_small_trace
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import TraceFormatError
from moetrace.tracer.trace import open_trace
from moetrace.tracer.trace.validate import find_problems


def _rewrite_routing(path, fn):
    """Replace the first routing part's table by ``fn(table)`` (schema kept unless fn changes it)."""
    f = sorted((path / "routing").glob("*.parquet"))[0]
    pq.write_table(fn(pq.read_table(f)), f)


def _experts(table: pa.Table, new_flat: np.ndarray | None = None, *, list_size: int | None = None) -> pa.Table:
    col = table.column("experts").combine_chunks()
    flat = col.flatten().to_numpy(zero_copy_only=False).copy() if new_flat is None else new_flat
    size = list_size or col.type.list_size
    arr = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.int16()), size)
    return table.set_column(table.schema.get_field_index("experts"), "experts", arr)


def _damage_top_k(path):
    m = json.loads((path / "manifest.json").read_text())
    m["model"]["top_k"] = 1  # the parts hold 3 layers x 2 ids
    (path / "manifest.json").write_text(json.dumps(m))


def _damage_id_range(path):
    def fn(t):
        flat = t.column("experts").combine_chunks().flatten().to_numpy(zero_copy_only=False).copy()
        flat[4] = SMALL.num_experts  # one past the last expert
        return _experts(t, flat)

    _rewrite_routing(path, fn)


def _damage_null_list(path):
    """Row 1's `experts` list null. polars writes the part: pyarrow < 25 cannot write a null fixed-size list
    (and reads one only from 26 on: before, the reader's refusal is pyarrow's own error)."""
    f = sorted((path / "routing").glob("*.parquet"))[0]
    df = pl.read_parquet(f)
    df.with_columns(
        pl.when(pl.int_range(pl.len()) == 1).then(None).otherwise(pl.col("experts")).alias("experts")
    ).write_parquet(f)


def _damage_duplicate_row(path):
    _rewrite_routing(path, lambda t: pa.concat_tables([t, t.slice(2, 1)]).combine_chunks())


def _damage_unknown_request(path):
    def fn(t):
        rid = t.column("request_id").to_numpy().copy()
        rid[0] = 999
        return t.set_column(0, "request_id", pa.array(rid, pa.int64()))

    _rewrite_routing(path, fn)


def _damage_position(path):
    def fn(t):
        pos = t.column("position").to_numpy().copy()
        pos[0] = 10_000
        return t.set_column(1, "position", pa.array(pos, pa.int32()))

    _rewrite_routing(path, fn)


def _damage_claimed_length(path):
    f = sorted((path / "requests").glob("*.parquet"))[0]
    t = pq.read_table(f)
    out = t.column("output_tokens").to_numpy().copy()
    out[0] = 2_000_000_000  # a tiny file asking for gigabytes
    pq.write_table(
        t.set_column(t.schema.get_field_index("output_tokens"), "output_tokens", pa.array(out, pa.int32())), f
    )


CASES = {
    "top_k in the manifest vs the experts list": (
        _damage_top_k,
        "ids per token, but the manifest's moe_layers x top_k",
    ),
    "expert id out of range": (_damage_id_range, "outside -1 and 0..15"),
    "null expert list": (_damage_null_list, "null experts|Expected all lists to be of size"),  # pyarrow < 26
    "duplicate (request_id, position)": (_damage_duplicate_row, "appear twice"),
    "routing row of an unknown request": (_damage_unknown_request, r"request ids \[999\] have no row"),
    "position outside its request": (_damage_position, "lie outside their request"),
    "lengths that claim more tokens than exist": (
        _damage_claimed_length,
        "claims .* tokens but the routing parts hold",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_reader_refuses(tmp_path, case):
    damage, message = CASES[case]
    path = write_small_trace(tmp_path / "t")
    damage(path)
    with pytest.raises(TraceFormatError, match=message):
        open_trace(path).token_arrays()
    assert find_problems(path), "validate must name the same damage"


@pytest.mark.parametrize("case", CASES)
def test_reader_and_validate_word_a_damage_alike(tmp_path, case):
    # one checker (tracer/trace/checks.py): the reader's error is one of validate's problems, word for word
    damage, _ = CASES[case]
    path = write_small_trace(tmp_path / "t")
    damage(path)
    with pytest.raises(TraceFormatError) as exc:
        open_trace(path).token_arrays()
    problems = find_problems(path)
    assert any(p.split(": ", 1)[-1] in str(exc.value) for p in problems), (str(exc.value), problems)


@pytest.mark.parametrize("case", ["expert id out of range", "duplicate (request_id, position)", "null expert list"])
def test_cli_commands_refuse_cleanly(tmp_path, case):
    damage, message = CASES[case]
    path = write_small_trace(tmp_path / "t", num_requests=8)
    damage(path)
    for args in (
        ["analyze", str(path), "-o", str(tmp_path / "a"), "--only", "imbalance"],
        ["compare", str(path), "--config", "DP2TP1EP2", "--gpus-per-node", "1", "--batches", "2"],
    ):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert "Traceback" not in r.output and "moetrace validate" in r.output, r.output


def test_a_valid_trace_reads_every_row_once(tmp_path):
    path = write_small_trace(tmp_path / "t")
    t = open_trace(path)
    ta = t.token_arrays()
    req = t.request_arrays
    assert ta.topk_ids_TLK.shape[0] == int(req.prompt_tokens_R.sum() + req.output_tokens_R.sum())
    assert np.array_equal(req.request_id_R[ta.row_T], ta.request_id_T)
    assert np.array_equal(ta.is_decode_T, ta.position_T >= req.prompt_tokens_R[ta.row_T])
