"""The CLI: every command has help with an example; a bare import stays light."""

from __future__ import annotations

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
