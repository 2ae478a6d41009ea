"""`moetrace demo`: the README's main command runs every stage end to end (small sizes).

The demo runs once for the module (about a minute of CPU, most of it the analyses' embeddings and
the placement comparison); each test reads one part of its output. Slow tier (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.tracer.trace.validate import find_problems

# the demo's own knobs, turned down: 2 prompts per bundled set, 140 synthetic requests (20 per dataset)
ARGS = ["--per-dataset", "2", "--max-new-tokens", "4", "--synth-requests", "140"]


REPO = Path(__file__).resolve().parents[1]


def _repo_status() -> str | None:
    """``git status --porcelain`` of the checkout (None outside a git checkout)."""
    if not (REPO / ".git").exists():
        return None
    return subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=all"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[Path, str, dict[str, list[str] | None]]:
    """The demo run as the README runs it, ``-o`` a relative folder, from an empty working directory and
    with an empty home: its output folder, what it printed, and what it wrote outside ``-o``."""
    cwd, home = tmp_path_factory.mktemp("cwd"), tmp_path_factory.mktemp("home")
    before = _repo_status()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        res = CliRunner().invoke(app, ["demo", "-o", "out", *ARGS], env={"HOME": str(home)})
    finally:
        os.chdir(old)
    assert res.exit_code == 0, res.output
    outside = {
        "cwd": sorted(p.name for p in cwd.iterdir() if p.name != "out"),
        "home": sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file()),
        # new untracked files only: a tracked file edited meanwhile (a developer at work) is not the demo's
        "repo": None
        if before is None
        else sorted(l for l in set(_repo_status().splitlines()) - set(before.splitlines()) if l.startswith("??")),
    }
    return cwd / "out", res.output, outside


@pytest.fixture(scope="module")
def demo(demo_run) -> tuple[Path, str]:
    return demo_run[0], demo_run[1]


def test_writes_nothing_outside_out(demo_run):
    """Nothing in the working directory beside ``out/``, nothing in the home directory, nothing new in
    the checkout: every file the demo makes is under its ``-o``."""
    outside = demo_run[2]
    assert outside["cwd"] == [] and outside["home"] == [], outside
    assert not outside["repo"], outside["repo"]


def test_prints_each_step_as_a_command_to_copy_and_the_dashboard_path(demo):
    out, output = demo
    steps = [line.split("$ ", 1)[1] for line in output.splitlines() if line.startswith("[") and "] $ moetrace " in line]
    assert [shlex.split(s)[1] for s in steps] == [
        "collect",
        "validate",
        "analyze",
        "synth",
        "validate",
        "analyze",
        "compare",
        "advise",
        "place",
        "export",
        "export",
        "dashboard",
    ]
    assert f"dashboard: {(out / 'report.html').resolve()}" in output


def test_traces_are_valid_and_results_complete(demo):
    out, _ = demo
    for trace in ("tiny-dsv3", "synth-dsv3"):
        assert find_problems(out / "traces" / trace) == []
    for analysis in ("tiny-dsv3-analysis", "synth-dsv3-analysis"):
        manifest = json.loads((out / "results" / analysis / "manifest.json").read_text())
        assert all((out / "results" / analysis / f).exists() for f in manifest["files"])
    cmp_ = json.loads((out / "results" / "synth-dsv3-compare" / "compare.json").read_text())
    assert {"linear", "round_robin", "eplb", "data", "joint"} <= set(cmp_["strategies"])


def test_place_starts_from_what_compare_read(demo):
    """The demo's ``place`` does not read and cluster the trace again: it places ours from the counts and
    request clusters ``compare`` read (``cli.place.sharing_placements``), and says so; the file is the one
    ``place`` writes on its own (byte for byte: tests/test_place_reuse.py)."""
    out, output = demo
    place = output.split("] $ moetrace place ", 1)[1].split("\n[", 1)[0]
    assert "(the trace's counts and request clusters `moetrace compare` read above, not read again" in place
    assert json.loads((out / "placement" / "ours.json").read_text())["strategy"] == "ours"


def test_the_card_opens_with_the_decision_and_puts_random_weights_last(demo):
    """The report's first headline is the decision per stage (advise's), not an imbalance; the
    random-weight trace's imbalance comes last, said in its title."""
    import re

    out, _ = demo
    html = (out / "report.html").read_text()
    card = html.split('<div id="summary"', 1)[1].split("</div></div>", 1)[0]
    titles = re.findall(r'<div class="h-title">([^<]*)</div>', card)
    assert titles[0] == "Decision per stage (advise)", titles
    assert titles[-1].endswith("(random weights)") and "tiny-dsv3" in titles[-1], titles
    assert sum("(random weights)" in t for t in titles) == 1, titles


def test_exports_load_in_both_engines_formats(demo):
    out, _ = demo
    sg = json.loads((out / "placement" / "sglang-init-expert-location.json").read_text())
    assert len(sg["physical_to_logical_map"]) == 61  # one row per decoder layer of DeepSeek-V3
    trt = yaml.safe_load((out / "placement" / "trtllm-moe-load-balancer.yaml").read_text())
    assert trt["num_slots"] == 256 and sorted(trt["initial_global_assignments"]) == list(range(3, 61))  # MoE layers


def test_report_opens_offline(demo):
    out, _ = demo
    html = (out / "report.html").read_text()
    assert len(html) > 1_000_000 and "<script src=" not in html  # plotly.js is embedded, nothing fetched


def test_closes_with_the_decision_of_each_stage_and_how_compare_relates(demo):
    """The last lines name each stage's decision by the one rule (advise's options: advice.json
    ``best``), then compare's best of its strategies (compare.json ``verdict.stages``) with the copies
    each stage's kernel sends, and what place wrote."""
    from moetrace.placement.decision import StageChoice

    out, output = demo
    advised = json.loads((out / "results" / "synth-dsv3-advice" / "advice.json").read_text())["best"]
    tail = output.split("decision per stage (advise", 1)[1].splitlines()
    for stage in ("prefill", "decode"):
        assert f"  {StageChoice.from_json(advised[stage]).text()}" in tail
    compared = json.loads((out / "results" / "synth-dsv3-compare" / "compare.json").read_text())["verdict"]["stages"]
    rest = output.split("compare's best per stage among its strategies", 1)[1].splitlines()[1:3]
    assert rest[0].startswith("  decode (one copy per (token, expert)")
    assert rest[1].startswith("  prefill (one copy per node")
    for line, stage in zip(rest, ("decode", "prefill")):
        assert StageChoice.from_json(compared[stage]).text().removeprefix(stage) in line
    assert "place wrote" in output and "ours chose" in output
