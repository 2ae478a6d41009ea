"""`moetrace demo`: the README's main command runs every stage end to end (small sizes)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner


from moetrace.cli import app  # noqa: E402
from moetrace.tracer.trace.validate import find_problems  # noqa: E402


def test_demo_runs_the_whole_pipeline(tmp_path):
    out = tmp_path / "demo"
    res = CliRunner().invoke(app, ["demo", "-o", str(out), "--per-dataset", "2", "--max-new-tokens", "4",
                                   "--synth-requests", "420"])
    assert res.exit_code == 0, res.output
    report = out / "report.html"
    assert f"dashboard: {report.resolve()}" in res.output
    assert report.stat().st_size > 1_000_000  # plotly.js is embedded: the report opens offline
    for trace in ("tiny-dsv3", "synth-dsv3"):
        assert find_problems(out / "traces" / trace) == []
    assert (out / "results" / "synth-dsv3-analysis" / "manifest.json").exists()
    cmp_ = json.loads((out / "results" / "synth-dsv3-compare" / "compare.json").read_text())
    assert {"linear", "eplb", "data", "joint"} <= set(cmp_["strategies"])
    sg = json.loads((out / "placement" / "sglang-init-expert-location.json").read_text())
    assert len(sg["physical_to_logical_map"]) == 61  # one row per decoder layer of DeepSeek-V3
