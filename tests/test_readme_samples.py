"""The README's ``moetrace import`` lines run on the sample files the project ships (data/samples/).

The lines are read from README.md, so a README that names another file, format or option breaks
these tests; the samples must equal what benchmarks/make_samples.py writes.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.tracer.trace.reader import open_trace

ROOT = Path(__file__).resolve().parents[1]


def readme_import_lines() -> list[str]:
    """Every ``moetrace import ...`` command in README.md's bash blocks (continuations joined)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split(" #", 1)[0].strip()
            if command.startswith("moetrace import "):
                lines.append(command)
    return lines


IMPORT_LINES = readme_import_lines()


def test_the_readme_has_import_lines():
    assert len(IMPORT_LINES) >= 2, IMPORT_LINES


@pytest.mark.parametrize("line", IMPORT_LINES)
def test_readme_import_line_runs_on_a_shipped_sample(line, tmp_path, monkeypatch):
    argv = shlex.split(line)[1:]
    src = argv[1]
    assert src.startswith("data/samples/"), f"{src}: the README's import lines read the samples that ship"
    assert (ROOT / src).is_file(), f"{src} does not exist"
    out = argv.index("-o") + 1
    argv[out] = str(tmp_path / Path(argv[out]).name)  # the README writes under out/; the test under tmp
    monkeypatch.chdir(ROOT)  # the README's paths are relative to the checkout
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 0, res.output
    trace = open_trace(argv[out])
    assert trace.requests().collect().height == 3


def test_samples_ship_in_the_package_and_match_their_script():
    spec = importlib.util.spec_from_file_location("make_samples", ROOT / "benchmarks" / "make_samples.py")
    assert spec is not None and spec.loader is not None
    make_samples = importlib.util.module_from_spec(spec)
    sys.modules["make_samples"] = make_samples
    try:
        spec.loader.exec_module(make_samples)
        expected = make_samples.samples()
    finally:
        del sys.modules["make_samples"]
    packaged = importlib.resources.files("moetrace.data") / "samples"
    assert {p.name for p in packaged.iterdir() if p.name.endswith(".jsonl")} == set(expected)
    for name, text in expected.items():
        assert (packaged / name).read_text(encoding="utf-8") == text, f"{name}: run benchmarks/make_samples.py"
