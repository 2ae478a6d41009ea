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
    for name in ("collect", "validate", "info", "models", "synth", "import", "analyze", "place", "compare",
                 "export", "dashboard", "demo"):
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


def test_built_wheel_has_the_stages_under_moetrace(tmp_path):
    """`pip wheel .` maps the top-level folders into moetrace.*; the wheel imports on its own."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".", "-w", str(tmp_path)],
                   check=True, cwd=__import__("pathlib").Path(__file__).parents[1])
    (whl,) = tmp_path.glob("moetrace-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"moetrace", whl.name.split("-")[0] + "-" + whl.name.split("-")[1] + ".dist-info"}
    for must in ("moetrace/tracer/store.py", "moetrace/analysis/counts.py", "moetrace/placement/eplb.py",
                 "moetrace/dashboards/report.py", "moetrace/data/models/deepseek-v3.json", "moetrace/data/prompts/code.jsonl"):
        assert must in names
    code = (
        f"import sys; sys.path.insert(0, {str(whl)!r}); import moetrace.tracer.store as s, moetrace.tracer.presets as p; "
        "assert '.whl' in s.__file__, s.__file__; print(p.model_info_for('deepseek-v3-tiny').num_moe_layers)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.strip() == "58"
