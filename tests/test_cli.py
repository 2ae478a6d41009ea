"""The CLI: every command has help with an example; a bare import stays light."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from moetrace.cli import app

runner = CliRunner()
COMMANDS = sorted(c.name for c in __import__("typer").main.get_command(app).commands.values())


def test_the_design_commands_exist():
    for name in (
        "collect",
        "validate",
        "info",
        "models",
        "synth",
        "import",
        "analyze",
        "place",
        "compare",
        "export",
        "dashboard",
        "demo",
    ):
        assert name in COMMANDS


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help_with_an_example(name):
    res = runner.invoke(app, [name, "--help"])
    assert res.exit_code == 0, res.output
    assert "Example" in res.output and "moetrace " + name in res.output


@pytest.mark.parametrize("name", ["", *COMMANDS])
def test_help_is_readable_at_80_columns(name):
    """`COLUMNS=80 moetrace <cmd> --help`: no line overflows, nothing is cut with an ellipsis, every
    option name and command is shown whole, and none is split over two lines."""
    import typer

    res = runner.invoke(app, [*([name] if name else []), "--help"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    assert "\u2026" not in res.output  # rich's cut
    assert not [line for line in lines if re.search(r"\w\.\.\.$", line) and not line.startswith("Usage:")]  # click's
    group = typer.main.get_command(app)
    cmd = group.commands[name] if name else group
    names = [o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]
    names += list(getattr(cmd, "commands", {}))
    for n in names:
        assert re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", res.output), n
    assert not [line for line in lines if re.search(r"(^|\s)--?[\w-]*-$", line)]  # "--per-" + "dataset"


def test_place_defaults_to_the_recommended_strategy():
    import typer

    from moetrace.placement.strategies import RECOMMENDED, STRATEGY_NAMES

    (opt,) = [p for p in typer.main.get_command(app).commands["place"].params if p.name == "strategy"]
    assert opt.default == RECOMMENDED == "ours" and RECOMMENDED in STRATEGY_NAMES


def test_help_imports_nothing_heavy():
    code = (
        "import sys; from moetrace.cli import app; from typer.testing import CliRunner; "
        "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output; "
        "heavy = [m for m in ('torch', 'transformers', 'sklearn', 'umap', 'plotly', 'vllm', 'datasets', 'numba') if m in sys.modules]; "
        "print(heavy); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_generic_top_level_packages_installed():
    import importlib.util

    for generic in ("tracer", "analysis", "placement", "dashboards", "data"):
        spec = importlib.util.find_spec(generic)
        assert spec is None or "site-packages" not in str(spec.origin or ""), generic
    import moetrace.analysis
    import moetrace.dashboards
    import moetrace.placement
    import moetrace.tracer  # noqa: F401
