"""The typed a2a.json, advice.json and options.parquet the dashboard reads (``placement.a2a_manifest``,
``placement.advise_manifest``, ``placement.advise_option_row``, re-exported by
``moetrace.dashboards.records``): what the writers write reads into the records and back, byte for
byte, and a damaged file is a one-line error naming the key (the column).

a2a.json's round trip on a real gloo replay is in ``test_dashboard_a2a.py`` (slow tier).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from browser.fixtures import small_model
from typer.testing import CliRunner

from moetrace import results as rf
from moetrace.cli import app
from moetrace.dashboards import records
from moetrace.dashboards.inputs import detect
from moetrace.dashboards.report import write_dashboard
from moetrace.errors import TraceFormatError
from moetrace.placement.a2a_manifest import A2AManifest
from moetrace.placement.advise_manifest import AdviceManifest
from moetrace.placement.advise_option_row import OPTION_COLUMNS, OptionRow
from moetrace.tracer.trace.writer import TraceWriter


def skewed_trace(path, *, num_requests: int = 48, seed: int = 0):
    """Experts 0 and 1 of every layer win most tokens, on a model whose experts have a size (so
    advise predicts MoE-layer time and EPLB with redundant experts pays on prefill)."""
    m = dataclasses.replace(small_model(), hidden_size=7168, moe_intermediate_size=2048)
    E, K, L = m.num_experts, m.top_k, m.num_moe_layers
    rng = np.random.default_rng(seed)
    R = num_requests
    prompt = rng.integers(6, 24, size=R).astype(np.int32)
    output = rng.integers(2, 12, size=R).astype(np.int32)
    T = int((prompt + output).sum())
    weights = np.array([8.0, 6.0] + [1.0] * (E - 2))
    ids = np.argsort(-(rng.random((T, L, E)) ** (1.0 / weights)), axis=-1)[..., :K].astype(np.int16)
    ids[np.cumsum(prompt + output) - 1] = -1  # a request's last token is never forwarded
    with TraceWriter(path, model=m, backend={"name": "synthetic"}, collection={"seed": seed}) as w:
        w.add_requests(
            request_id_R=np.arange(R, dtype=np.int64),
            dataset_R=["chat", "code"] * (R // 2),
            prompt_tokens_R=prompt,
            output_tokens_R=output,
            topk_ids_TX=ids.reshape(T, L * K),
        )
    return path


@pytest.fixture(scope="module")
def advice(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("records")
    trace = skewed_trace(tmp / "trace")
    out = tmp / "advice"
    r = CliRunner().invoke(
        app,
        ["advise", str(trace), "--config", "DP4TP1EP4", "--gpus-per-node", "2", "--steps", "20", "-q", "-o", str(out)],
    )
    assert r.exit_code == 0, r.output
    return trace, out


def test_advice_json_reads_into_its_record_and_back_byte_for_byte(advice):
    _, out = advice
    text = (out / rf.ADVICE_MANIFEST).read_text()
    rec = AdviceManifest.from_json(json.loads(text), where="advice.json")
    assert json.dumps({**rf.json_header(rf.ADVICE), **rec.to_json()}, indent=2) + "\n" == text
    # every part typed, the recommended placement and its commands included (this trace has one)
    assert rec.recommended and rec.commands and rec.verdicts and rec.best
    assert {c.option for c in rec.commands} == {r.option for r in rec.recommended}
    assert all((out / r.placement).is_file() for r in rec.recommended)
    assert set(rec.best) <= set(rec.stages) and rec.model.num_experts == 8
    assert detect(out).advice == rec


def test_the_dashboard_draws_the_advice_from_its_record(advice, tmp_path):
    trace, out = advice
    rep = write_dashboard([trace, out], out=tmp_path / "r.html")
    assert rep.sections[0] == "advice" and rep.headlines[0] == "decision"
    text = rep.path.read_text()
    assert '<section id="advice"><h2>Advice</h2>' in text
    rec = detect(out).advice
    for c in rec.commands:  # the notes name every export command
        assert all(cmd.split(" -o ")[0] in text for cmd in c.export.values())
    assert rec.best["decode"].text().split(" (")[0] in text


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("deployment", None, r"advice.json: no `deployment`; re-run `moetrace advise`"),
        ("num_ep", "4", r"`num_ep` is '4', expected int; re-run"),
        ("redundancy_sweep", [0, "8"], r"`redundancy_sweep` must be a list of integers"),
        ("verdicts", [{"stage": "decode", "text": "x"}], r"verdicts\[0\]: no `verdict`"),
    ],
)
def test_a_damaged_advice_json_names_its_key(advice, key, value, message):
    _, out = advice
    obj = json.loads((out / rf.ADVICE_MANIFEST).read_text())
    if value is None:
        del obj[key]
    else:
        obj[key] = value
    with pytest.raises(TraceFormatError, match=message):
        AdviceManifest.from_json(obj, where="advice.json")


def test_an_older_advice_json_reads_with_its_later_keys_defaulted(advice):
    """Keys advice.json gained after its format was stamped (``best``, ``commands``, ...) mean what a
    file without them meant: no decision per stage, no commands."""
    _, out = advice
    obj = json.loads((out / rf.ADVICE_MANIFEST).read_text())
    for key in ("best", "commands", "strategies", "trace", "hardware", "drift_estimated"):
        del obj[key]
    rec = AdviceManifest.from_json(obj, where="advice.json")
    assert rec.best == {} and rec.commands == () and rec.strategies == () and rec.trace is None


def test_a_damaged_a2a_json_names_its_key():
    body = {"deployment": "DP2TP2EP4", "gpus_per_node": 2, "num_ep": 4, "num_nodes": 2, "ranks_per_node": 2}
    with pytest.raises(TraceFormatError, match=r"a2a.json: no `num_batches`; re-run `moetrace a2a`"):
        A2AManifest.from_json(body, where="a2a.json")
    with pytest.raises(TraceFormatError, match=r"`num_ep` is True, expected int"):
        A2AManifest.from_json({**body, "num_ep": True}, where="a2a.json")


def test_options_parquet_reads_into_its_rows_and_back_byte_for_byte(advice, tmp_path):
    """Every column of options.parquet is a field of ``OptionRow`` (in order); the rows read back
    (``from_row``) write the same file again (``to_row``)."""
    import polars as pl

    _, out = advice
    table = pl.read_parquet(out / rf.ADVICE_OPTIONS)
    assert tuple(table.columns) == OPTION_COLUMNS
    rows = [OptionRow.from_row(r) for r in table.iter_rows(named=True)]
    assert {r.measure for r in rows} == {"moe"}  # the experts have a size: MoE-layer time
    ref = next(r for r in rows if r.option == "linear" and r.stage == r.steps == "decode")
    assert ref.vs_ref("moe") == pytest.approx(1.0) and ref.seconds_per_step("moe") == ref.moe_seconds_per_step
    again = rf.write_result_table(tmp_path, rf.ADVICE, rf.ADVICE_OPTIONS, pl.DataFrame([r.to_row() for r in rows]))
    assert again.read_bytes() == (out / rf.ADVICE_OPTIONS).read_bytes()


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("moe_vs_ref", None, r"options.parquet: no `moe_vs_ref`; re-run `moetrace advise`"),
        ("router", "yes", r"`router` is 'yes', expected bool"),
        ("stage", "middle", r"`stage` 'middle' or `steps` 'prefill' names no stage"),
    ],
)
def test_a_damaged_options_row_names_its_column(advice, column, value, message):
    import polars as pl

    _, out = advice
    row = next(pl.read_parquet(out / rf.ADVICE_OPTIONS).iter_rows(named=True))
    if value is None:
        del row[column]
    else:
        row[column] = value
    with pytest.raises(TraceFormatError, match=message):
        OptionRow.from_row(row)


def test_the_dashboard_reads_the_records_its_writers_build():
    """``dashboards.records`` names the records the writers build, not copies of them."""
    assert records.A2AManifest is A2AManifest and records.AdviceManifest is AdviceManifest
    assert records.OptionRow is OptionRow
