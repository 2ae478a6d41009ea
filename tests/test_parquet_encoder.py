"""The Parquet encoder's seam: choosing it (argument, ``MOETRACE_PARQUET_ENCODER``), the escape hatch end to end,
pyarrow's writer options stated explicitly, and the fence: a pyarrow whose files the fast encoder cannot
reproduce is a clean ``EncoderError`` naming the escape hatch, before anything is written (or, if a layout
slips past the check, at the row group, with the trace left resumable).

tests/test_writer_parquet.py holds the file-level equivalence of the two encoders."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from factories import SMALL, write_small_trace
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ConfigError, EncoderError
from moetrace.tracer.trace import parquet_encoder
from moetrace.tracer.trace.parquet_encoder import ENCODER_ENV, resolve_encoder, writer_options
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.validate import find_problems
from moetrace.tracer.trace.writer import TraceWriter

PYARROW_MAJOR = int(pa.__version__.split(".")[0])


def _created_by(trace_path) -> set[str]:
    return {pq.read_metadata(f).created_by.split(" version")[0] for f in open_trace(trace_path).routing_files()}


def _same_trace(a, b) -> None:
    ta, tb = open_trace(a), open_trace(b)
    x, y = ta.token_arrays(), tb.token_arrays()
    assert np.array_equal(x.topk_ids_TLK, y.topk_ids_TLK)
    assert np.array_equal(x.request_id_T, y.request_id_T) and np.array_equal(x.position_T, y.position_T)
    assert ta.requests().sort("request_id").collect().equals(tb.requests().sort("request_id").collect())
    for f, g in zip(ta.routing_files(), tb.routing_files(), strict=True):
        assert pq.read_table(f).equals(pq.read_table(g), check_metadata=True)


def test_the_encoder_is_fast_unless_the_argument_or_the_environment_says_pyarrow(monkeypatch):
    monkeypatch.delenv(ENCODER_ENV, raising=False)
    assert resolve_encoder() == "fast" and resolve_encoder("pyarrow") == "pyarrow"
    monkeypatch.setenv(ENCODER_ENV, "pyarrow")
    assert resolve_encoder() == "pyarrow"
    assert resolve_encoder("fast") == "fast"  # the writer's argument wins over the environment
    monkeypatch.setenv(ENCODER_ENV, "")
    assert resolve_encoder() == "fast"


@pytest.mark.parametrize(
    "env,arg,match", [("arrow", None, "MOETRACE_PARQUET_ENCODER='arrow'"), (None, "numpy", "encoder='numpy'")]
)
def test_an_unknown_encoder_is_a_config_error(tmp_path, monkeypatch, env, arg, match):
    if env is None:
        monkeypatch.delenv(ENCODER_ENV, raising=False)
    else:
        monkeypatch.setenv(ENCODER_ENV, env)
    with pytest.raises(ConfigError, match=match + ".*fast, pyarrow"):
        TraceWriter(tmp_path / "t", model=SMALL, backend={"name": "synthetic"}, collection={}, encoder=arg)
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("how", ["environment", "argument"])
def test_the_escape_hatch_writes_through_pyarrow_and_reads_identically(tmp_path, monkeypatch, how):
    monkeypatch.delenv(ENCODER_ENV, raising=False)
    write_small_trace(tmp_path / "fast", num_requests=9)
    if how == "environment":
        monkeypatch.setenv(ENCODER_ENV, "pyarrow")
        write_small_trace(tmp_path / "pyarrow", num_requests=9)
    else:
        write_small_trace(tmp_path / "pyarrow", num_requests=9, encoder="pyarrow")
    assert _created_by(tmp_path / "fast") == {"moetrace"}
    assert _created_by(tmp_path / "pyarrow") == {"parquet-cpp-arrow"}
    assert find_problems(tmp_path / "pyarrow") == []
    _same_trace(tmp_path / "fast", tmp_path / "pyarrow")


def test_cli_synth_with_the_escape_hatch(tmp_path):
    args = ["synth", "--model", "deepseek-v3-tiny", "-n", "12", "--seed", "2", "--workers", "1", "--quiet"]
    r = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "fast")], env={ENCODER_ENV: ""})
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "pyarrow")], env={ENCODER_ENV: "pyarrow"})
    assert r.exit_code == 0, r.output
    assert _created_by(tmp_path / "pyarrow") == {"parquet-cpp-arrow"} and _created_by(tmp_path / "fast") == {"moetrace"}
    r = CliRunner().invoke(app, ["validate", str(tmp_path / "pyarrow")])
    assert r.exit_code == 0, r.output
    _same_trace(tmp_path / "fast", tmp_path / "pyarrow")


def test_cli_refuses_an_unknown_encoder_in_one_line(tmp_path):
    r = CliRunner().invoke(
        app,
        ["synth", "--model", "deepseek-v3-tiny", "-n", "2", "--workers", "1", "--quiet", "-o", str(tmp_path / "t")],
        env={ENCODER_ENV: "parquet"},
    )
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "MOETRACE_PARQUET_ENCODER='parquet'" in r.output


def test_writer_options_are_explicit_and_accepted_by_this_pyarrow(tmp_path):
    opts = writer_options("lz4", use_dictionary=["stage"], write_statistics=["request_id"])
    assert opts["write_page_index"] is False and opts["write_page_checksum"] is False
    assert opts["data_page_version"] == "1.0" and opts["version"] == "2.6"
    assert opts["write_statistics"] == ["request_id"] and opts["use_dictionary"] == ["stage"]
    # Bloom filters: pyarrow >= 24 takes the keyword (None: none); older ones refuse it, so it is left out
    assert ("bloom_filter_options" in opts) == (PYARROW_MAJOR >= 24)
    table = pa.table({"request_id": pa.array([1, 2], pa.int64()), "stage": ["prefill", "decode"]})
    pq.write_table(table, tmp_path / "x.parquet", **opts)
    col = pq.read_metadata(tmp_path / "x.parquet").row_group(0).column(0)
    assert col.is_stats_set and not pq.read_metadata(tmp_path / "x.parquet").row_group(0).column(1).is_stats_set
    assert pq.read_table(tmp_path / "x.parquet").equals(table)


def _pyarrow_writes(monkeypatch, **changes) -> None:
    """Make the options ask pyarrow for what a future default might turn on."""
    real = parquet_encoder.writer_options
    monkeypatch.setattr(parquet_encoder, "writer_options", lambda *a, **kw: {**real(*a, **kw), **changes})


PAGE_INDEX = {"write_page_index": True}
BLOOM = {"bloom_filter_options": {"request_id": True}}


@pytest.mark.parametrize(
    "changes",
    [
        PAGE_INDEX,
        pytest.param(
            BLOOM, marks=pytest.mark.skipif(PYARROW_MAJOR < 24, reason="pyarrow < 24 writes no Bloom filters")
        ),
    ],
    ids=["page index", "bloom filter"],
)
def test_a_pyarrow_writing_what_the_fast_encoder_cannot_copy_is_refused_before_writing(tmp_path, monkeypatch, changes):
    monkeypatch.delenv(ENCODER_ENV, raising=False)
    _pyarrow_writes(monkeypatch, **changes)
    with pytest.raises(EncoderError, match=f"pyarrow {pa.__version__}.*set MOETRACE_PARQUET_ENCODER=pyarrow"):
        TraceWriter(tmp_path / "t", model=SMALL, backend={"name": "synthetic"}, collection={})
    assert not (tmp_path / "t").exists()  # refused before the directory was touched
    write_small_trace(tmp_path / "t", encoder="pyarrow")  # the escape hatch writes it
    assert find_problems(tmp_path / "t") == []


def test_cli_names_the_escape_hatch_when_the_fast_encoder_refuses(tmp_path, monkeypatch):
    monkeypatch.delenv(ENCODER_ENV, raising=False)
    _pyarrow_writes(monkeypatch, **PAGE_INDEX)
    args = ["synth", "--model", "deepseek-v3-tiny", "-n", "3", "--workers", "1", "--quiet"]
    r = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "t")])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "set MOETRACE_PARQUET_ENCODER=pyarrow" in r.output
    r = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "t")], env={ENCODER_ENV: "pyarrow"})
    assert r.exit_code == 0, r.output


def test_a_layout_past_the_check_fails_at_the_row_group_and_the_trace_resumes(tmp_path, monkeypatch):
    """Second fence: should the open-time check miss a layout, the row group that meets it is an
    EncoderError too; the open part is dropped and the trace stays resumable (here through pyarrow)."""
    monkeypatch.delenv(ENCODER_ENV, raising=False)
    _pyarrow_writes(monkeypatch, **PAGE_INDEX)
    monkeypatch.setattr(parquet_encoder._FastSetup, "check_against_pyarrow", lambda self: None)
    path = tmp_path / "t"
    with pytest.raises(EncoderError, match="page indexes.*set MOETRACE_PARQUET_ENCODER=pyarrow"):
        write_small_trace(path, row_group_tokens=4)
    assert json.loads((path / "manifest.json").read_text())["complete"] is False
    assert not list(path.rglob("*.tmp")) and not list(path.rglob("*.parquet"))
    monkeypatch.undo()
    write_small_trace(path, on_existing="resume", encoder="pyarrow")
    assert find_problems(path) == []
    assert open_trace(path).manifest["totals"]["num_requests"] == 6
