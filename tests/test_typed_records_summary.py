"""The typed records added last for issue 37: compare's ``summary.parquet`` rows
(``placement.compare_row.CompareRow``), advise's drift estimates (``advise_manifest.DriftEstimate``)
and ``read_advice`` returning ``AdviceManifest``.

Each: a round trip (``from_*(to_*(x)) == x``), the same bytes as the files the code wrote while these
were dicts (``tests/golden/typed_records/``, written by that code on the inputs built here, before the
types; the writers must still write them byte for byte), and a damaged field as a one-line
``TraceFormatError`` naming the file and the field.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from factories import ADVISE_MODEL, planted_trace, zipf_trace

from moetrace import results as rf
from moetrace.errors import TraceFormatError
from moetrace.placement.advise import AdviseConfig, advise_profile_counts, advise_trace, read_advice, write_advice
from moetrace.placement.advise_manifest import AdviceManifest, DriftEstimate
from moetrace.placement.compare import CompareConfig, load_trace_data, run_compare, write_results
from moetrace.placement.compare_row import SUMMARY_COLUMNS, CompareRow
from moetrace.placement.deployment import parse_deployment

GOLDEN = Path(__file__).parent / "golden" / "typed_records"
DEP = parse_deployment("DP2TP2EP4", num_gpus_per_node=2)
ADVISE_CFG = AdviseConfig(
    deployment=DEP, num_steps=20, decode_tokens_per_gpu=2, prefill_tokens_per_gpu=16, max_slots_per_gpu=6
)


def _advice_dirs(tmp: Path) -> dict[str, Path]:
    """advice.json of a trace (drift estimated per stage) and of one window of counts (drift skipped),
    as the goldens were written: the same inputs, the same paths relative to the results."""
    write_advice(advise_trace(zipf_trace(tmp / "zipf"), ADVISE_CFG), tmp / "adv", deployment=DEP)
    E, K, L = ADVISE_MODEL.num_experts, ADVISE_MODEL.top_k, ADVISE_MODEL.num_moe_layers
    one = np.random.default_rng(0).multinomial(4000 * K, np.full(E, 1.0 / E), size=(1, L)).astype(np.int64)
    adv = advise_profile_counts(ADVISE_MODEL, {"decode": one}, ADVISE_CFG, source=str(tmp / "mem"))
    write_advice(adv, tmp / "adv1", deployment=DEP)
    return {"advice_trace.json": tmp / "adv", "advice_one_window.json": tmp / "adv1"}


@pytest.fixture(scope="module")
def advice(tmp_path_factory) -> dict[str, Path]:
    return _advice_dirs(tmp_path_factory.mktemp("typed_advice"))


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("typed_compare")
    data = load_trace_data(planted_trace(tmp / "planted", structured=True), test_fraction=0.25, seed=0)
    cfg = CompareConfig(
        deployment=parse_deployment("DP2TP4EP8", num_gpus_per_node=4),
        num_batches=6,
        num_batch_requests=8,
        strategies=("linear", "round_robin", "eplb", "joint"),
        oracle=True,
    )
    res = run_compare(data, cfg)
    write_results(res, tmp / "cmp")
    return res, tmp / "cmp"


# ------------------------------------------------------------------ compare's summary rows
def test_compare_writes_its_summary_rows_byte_for_byte_as_before(compared):
    _, out = compared
    assert (out / rf.COMPARE_SUMMARY).read_bytes() == (GOLDEN / "compare_summary.parquet").read_bytes()


def test_summary_rows_are_typed_and_read_back_equal(compared, tmp_path):
    res, out = compared
    rows = res.summary_rows()
    assert all(isinstance(r, CompareRow) for r in rows) and [r.strategy for r in rows][-1] == "oracle"
    assert all(CompareRow.from_row(r.to_row()) == r for r in rows)  # the round trip, in memory
    table = pl.read_parquet(GOLDEN / "compare_summary.parquet")
    assert tuple(table.columns) == SUMMARY_COLUMNS
    back = [CompareRow.from_row(r) for r in table.iter_rows(named=True)]
    assert all(CompareRow.from_row(r.to_row()) == r for r in back)
    assert [r.strategy for r in back] == [r.strategy for r in rows]
    assert [r.is_bound for r in back] == [r.is_bound for r in rows]
    # read from the file and written again: the same bytes
    again = rf.write_result_table(tmp_path, rf.COMPARE, rf.COMPARE_SUMMARY, pl.DataFrame([r.to_row() for r in back]))
    assert again.read_bytes() == (GOLDEN / "compare_summary.parquet").read_bytes()
    # the figures as the reader sees them: the two times by measure
    j = next(r for r in back if r.strategy == "joint")
    assert np.isnan(j.time_normalized("moe")) and np.isnan(j.moe_time_normalized_median)  # no expert size
    assert j.time_normalized("a2a") == j.a2a_time_normalized_median < 1.01
    assert j.time_normalized("a2a", "p90") == j.a2a_time_normalized_p90
    assert j.prefill_time_normalized("a2a") == j.prefill_a2a_time_normalized_median


def test_a_summary_without_the_later_columns_reads_with_their_meaning_from_before():
    r = CompareRow.from_row({"strategy": "eplb", "inter_node_normalized_median": 0.8})
    assert r.inter_node_normalized_median == 0.8 and not r.is_bound and not r.over_node_load_limit
    assert np.isnan(r.a2a_time_normalized_median) and r.busiest_node_load is None
    assert r.groups_without_routed_requests == 0


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("a2a_time_normalized_median", "fast"),
        ("is_bound", 1),
        ("strategy", 3),
        ("groups_without_routed_requests", 1.5),
        ("busiest_node_load", [1.0]),
    ],
)
def test_a_damaged_summary_cell_names_the_file_and_the_column(compared, column, value):
    row = next(iter(pl.read_parquet(GOLDEN / "compare_summary.parquet").iter_rows(named=True)))
    with pytest.raises(TraceFormatError, match=rf"^cmp/summary.parquet row 0: `{column}` is .*re-run") as exc:
        CompareRow.from_row({**row, column: value}, where="cmp/summary.parquet row 0")
    assert "\n" not in str(exc.value)


def test_the_dashboard_reads_a_damaged_summary_as_one_line(compared, tmp_path):
    from moetrace.dashboards.inputs import detect
    from moetrace.dashboards.results import Results
    from moetrace.dashboards.summary import placement_headline

    _, out = compared
    bad = tmp_path / "cmp"
    shutil.copytree(out, bad)
    table = pl.read_parquet(bad / rf.COMPARE_SUMMARY)
    table.with_columns(pl.lit("x").alias("moe_time_normalized_median")).write_parquet(bad / rf.COMPARE_SUMMARY)
    with pytest.raises(TraceFormatError, match=r"summary.parquet row 0: `moe_time_normalized_median` is 'x'"):
        placement_headline(Results.from_input(detect(bad)))


# ------------------------------------------------------------------ advice.json: read_advice and the drift
@pytest.mark.parametrize("name", ["advice_trace.json", "advice_one_window.json"])
def test_advise_writes_advice_json_byte_for_byte_as_before(advice, name):
    assert (advice[name] / rf.ADVICE_MANIFEST).read_text() == (GOLDEN / name).read_text()


@pytest.mark.parametrize("name", ["advice_trace.json", "advice_one_window.json"])
def test_read_advice_returns_the_typed_manifest_and_writes_back_the_same_bytes(advice, name):
    man = read_advice(advice[name])
    assert isinstance(man, AdviceManifest) and all(isinstance(d, DriftEstimate) for d in man.drift.values())
    text = (GOLDEN / name).read_text()
    assert json.dumps({**rf.json_header(rf.ADVICE), **man.to_json()}, indent=2) + "\n" == text
    assert AdviceManifest.from_json(man.to_json(), where="x") == man


def test_drift_estimates_are_typed_estimated_or_skipped(advice):
    est = read_advice(advice["advice_trace.json"]).drift
    assert set(est) == {"prefill", "decode", "both"} and all(d.estimated for d in est.values())
    d = est["decode"]
    assert d.strategy in ("eplb", "eplb_global") and d.num_windows >= 4 and 0 < d.figure("static") <= 1
    skipped = read_advice(advice["advice_one_window.json"]).drift["decode"]
    assert not skipped.estimated and skipped.num_windows == 1 and "fewer than 4 windows" in (skipped.skipped or "")
    assert np.isnan(skipped.figure("lagged"))
    for x in (*est.values(), skipped):
        assert DriftEstimate.from_json(x.to_json(), where="x") == x


def test_an_unknown_drift_figure_is_none_written_as_null():
    d = DriftEstimate.of(
        num_windows=8, num_redundant=0, strategy="eplb", reference=0.5, static=float("nan"), lagged=0.6, own=0.7
    )
    assert d.static is None and np.isnan(d.figure("static")) and d.to_json()["static"] is None
    assert DriftEstimate.from_json(json.loads(json.dumps(d.to_json())), where="x") == d


def test_a_drift_estimate_from_before_the_policy_reads_and_writes_back_unchanged():
    old = {"num_windows": 8, "num_redundant": 0, "reference": 0.5, "static": 0.6, "lagged": 0.6, "own": 0.7}
    d = DriftEstimate.from_json(old, where="x")
    assert d.strategy is None and d.estimated and d.to_json() == old


@pytest.mark.parametrize(
    ("stage", "key", "value"),
    [("decode", "static", "high"), ("decode", "num_windows", 2.5), ("prefill", "strategy", 7)],
)
def test_a_damaged_drift_estimate_names_the_file_the_stage_and_the_key(advice, tmp_path, stage, key, value):
    obj = json.loads((GOLDEN / "advice_trace.json").read_text())
    obj["drift"][stage][key] = value
    (tmp_path / rf.ADVICE_MANIFEST).write_text(json.dumps(obj))
    with pytest.raises(TraceFormatError, match=rf"advice.json drift '{stage}': `{key}` is .*re-run") as exc:
        read_advice(tmp_path)
    assert str(tmp_path) in str(exc.value) and "\n" not in str(exc.value)


def test_read_advice_refuses_a_missing_or_foreign_file_in_one_line(tmp_path):
    with pytest.raises(TraceFormatError, match="no advice.json"):
        read_advice(tmp_path)
    (tmp_path / rf.ADVICE_MANIFEST).write_text(json.dumps({"format": "moetrace.compare", "version": 1}))
    with pytest.raises(TraceFormatError, match="format 'moetrace.compare'"):
        read_advice(tmp_path)
    (tmp_path / rf.ADVICE_MANIFEST).write_text("[1, 2")
    with pytest.raises(TraceFormatError):
        read_advice(tmp_path)
    obj = json.loads((GOLDEN / "advice_trace.json").read_text())
    obj["best"] = []
    (tmp_path / rf.ADVICE_MANIFEST).write_text(json.dumps(obj))
    with pytest.raises(TraceFormatError, match=r"`best` is \[\]"):
        read_advice(tmp_path)
