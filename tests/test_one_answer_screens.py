"""Issue 39's "Why", on screen: what each command prints names only what that command has, the
figures say their units, a number past its scale is marked, and hints point where results go.

- ``advise`` and ``compare`` name only their own options, on a trace and on a load profile (a
  command line they print for another command, ``moetrace place ... --strategy``, is that command's);
- "of oracle" past 100 % (a bound beaten) is shown as ``>100%`` and explained on screen, never as
  180 %;
- every cost in compare's tables worse than linear's is marked, in both stages, with a slow link too;
- every heatmap whose cells are percentages has a colour bar in percentages;
- a per-layer line equal to another is drawn dashed and named, not hidden under it; long y titles wrap;
- ``collect``'s ``next:`` hint puts the analysis under ``out/results/``, not inside ``traces/``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from browser.figjson import figures_from_html
from browser.fixtures import make_trace, produced
from typer.testing import CliRunner

from moetrace.cli import app

DEPLOY = ["--config", "DP4TP1EP4", "--gpus-per-node", "2"]
#: a command line printed for the user to run: ``moetrace <command> ...`` up to a closing quote or the line's end
_COMMAND_LINE = re.compile(r"moetrace ([a-z][a-z-]*)([^`'\n]*)")
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _options(command: str) -> set[str]:
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}


def foreign_options(command: str, output: str) -> list[str]:
    """The ``--options`` in ``output`` that ``command`` lacks, outside the command lines it prints for
    other commands (whose options are checked against those commands)."""
    bad = []
    for m in _COMMAND_LINE.finditer(output):
        other, rest = m.group(1), m.group(2)
        if other in typer.main.get_command(app).commands:  # type: ignore[attr-defined]
            bad += [f"{o} (in `moetrace {other}`)" for o in _OPTION.findall(rest) if o not in _options(other)]
    outside = _COMMAND_LINE.sub("", output)
    return bad + [o for o in _OPTION.findall(outside) if o not in _options(command)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A trace with both stages and its load profile."""
    root = tmp_path_factory.mktemp("screens")
    trace = make_trace(root / "trace", datasets=("chat", "code", "math"), num_requests=60)
    prof = root / "trace.profile.parquet"
    res = CliRunner().invoke(app, ["profile", str(trace), "-q", "-o", str(prof)])
    assert res.exit_code == 0, res.output
    return trace, prof


@pytest.mark.parametrize("what", ["trace", "profile"])
def test_advise_and_compare_name_only_their_own_options(inputs, tmp_path, what):
    source = inputs[0] if what == "trace" else inputs[1]
    runs = {
        "advise": ["advise", str(source), *DEPLOY, "--steps", "40", "-q", "-o", str(tmp_path / "advice")],
        "compare": ["compare", str(source), *DEPLOY, "--batches", "20", "-q"],  # no -o: says nothing is saved
    }
    for command, args in runs.items():
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        assert foreign_options(command, res.output) == [], res.output


def test_foreign_options_finds_an_option_a_command_lacks():
    assert foreign_options("advise", "one copy per (token, expert) whatever --dedup says") == ["--dedup"]
    assert foreign_options("advise", "  moetrace place t --config X --strategy eplb -o p.json") == []
    assert foreign_options("advise", "  moetrace place t --dedup node") == ["--dedup (in `moetrace place`)"]


def test_of_oracle_past_its_scale_is_marked_and_explained():
    from moetrace.placement.legends import COMPARE_LEGEND
    from moetrace.placement.report import _captured

    assert [_captured(x) for x in (None, -0.4, 0.0, 0.853, 1.0, 1.004, 1.8, 2.4)] == [
        "-",
        "<0%",
        "0%",
        "85%",
        "100%",
        "100%",
        ">100%",
        ">100%",
    ]
    legend = dict(COMPARE_LEGEND)["of oracle"]
    assert ">100 % means the bound was beaten" in legend


def test_heatmap_colour_bars_speak_the_cells_unit(tmp_path):
    """A heatmap whose cells (text or hover) are formatted as percentages has a colour bar in
    percentages (``tickformat`` ending in ``%``), not fractions under cells reading 40 %."""
    from moetrace.dashboards.report import write_dashboard

    p = produced()
    figs = figures_from_html(
        write_dashboard([p.trace, p.analysis, p.compare], out=tmp_path / "r.html").path.read_text()
    )
    pct = re.compile(r"%\{z:[^}]*%\}")
    checked = []
    for key, fig in figs.items():
        for t in fig["data"]:
            if t.get("type") != "heatmap" or not pct.search(str(t.get("texttemplate")) + str(t.get("hovertemplate"))):
                continue
            bar = t.get("colorbar") or fig["layout"].get("coloraxis", {}).get("colorbar") or {}
            assert str(bar.get("tickformat", "")).endswith("%"), (key, bar)
            checked.append(key)
    assert checked, "no heatmap with percentage cells in the report"


def test_per_layer_lines_equal_to_another_are_drawn_dashed_and_named():
    """Two series equal at every layer: the later is drawn dashed with rings (not hidden under the
    first), the figure says which equals which; a long y title is wrapped, not cut off."""
    import numpy as np

    from moetrace.dashboards.figures import lines_by_layer, wrap_title

    s = {"eplb": np.array([1.0, 0.9, 0.8]), "joint": np.array([0.7, 0.6, 0.5]), "oracle": np.array([0.7, 0.6, 0.5])}
    fig = lines_by_layer(s, layers=[3, 4, 5], y_title="inter-node bytes over linear's", what="w", source="s")
    dash = {t.name: t.line.dash for t in fig.data}
    assert dash == {"eplb": "solid", "joint": "solid", "oracle": "dash"}
    assert any("oracle = joint" in a.text for a in fig.layout.annotations)
    long = "predicted MoE-layer time per step over linear's median"
    assert "<br>" in wrap_title(long) and max(len(x) for x in wrap_title(long).split("<br>")) <= len(long) // 2 + 8


@pytest.mark.parametrize(
    ("trace", "analysis"),
    [("out/traces/tiny", "out/results/tiny-analysis"), ("runs/tiny", "runs/tiny-analysis")],
)
def test_collects_next_hint_puts_the_analysis_beside_the_traces_folder(trace, analysis):
    """``collect``'s ``next:`` hint: results under ``out/results/`` for a trace in ``out/traces/``, not
    inside ``traces/``; else beside the trace."""
    from moetrace.tracer.collect import analysis_dir

    assert analysis_dir(Path(trace)) == Path(analysis)


def test_every_cost_worse_than_linear_is_marked_in_both_stages(tmp_path):
    """compare's decode and prefill tables: each MoE-layer time, all-to-all time and inter-node bytes
    figure above linear's (1.000) carries the mark, none at or below it does, with the README's slower
    inter-node link too (joint's prefill all-to-all once went past linear with no word)."""
    from moetrace.placement.legends import WORSE

    runner, trace = CliRunner(), tmp_path / "olmoe"  # a synth trace: its model knows its experts' size
    res = runner.invoke(app, ["synth", "-m", "olmoe-1b-7b", "--datasets", "gsm8k,mbpp,lmsys-chat,xsum", "-n", "80"]
                        + ["-q", "-o", str(trace)])  # fmt: skip
    assert res.exit_code == 0, res.output
    res = runner.invoke(
        app,
        ["compare", str(trace), "--config", "DP8TP1EP8", "--gpus-per-node", "4", "--batches", "20", "-q"]
        + ["--strategies", "linear,round_robin,eplb,data,joint", "--link", "h200:inter=25GB/s"],
    )
    assert res.exit_code == 0, res.output
    decode = res.output.split("decode steps:", 1)[1].split("prefill steps:", 1)[0]
    prefill = res.output.split("prefill steps:", 1)[1].split("legend:", 1)[0]
    marked = []
    for table, columns in ((decode, (0, 3, 4)), (prefill, (0, 1, 2))):  # decode rows: time, p10, p90, time, bytes
        rows = [r for r in table.splitlines() if re.match(r"(linear|round_robin|eplb|data|joint) ", r)]
        assert len(rows) == 5, table
        for row in rows:
            figures = re.findall(r"(\d+\.\d{3})(\+?)", row)
            for i in columns:
                value, mark = figures[i]
                assert (mark == WORSE) == (float(value) > 1.0), row
                marked.append(bool(mark))
    assert any(marked) and not all(marked)
