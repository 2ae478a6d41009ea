"""The linters and the type checker that CI runs over the package, as developers run them by hand.

``ruff check`` (lint + import order), ``ruff format --check`` and ``mypy`` (its settings in
pyproject.toml) must be clean. They are the test set-up's own pinned tools, so a missing one fails
here rather than skipping.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})


def test_ruff_lint_is_clean() -> None:
    r = _run(str(BIN / "ruff"), "check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_is_clean() -> None:
    r = _run(str(BIN / "ruff"), "format", "--no-cache", "--check", ".")
    assert r.returncode == 0, "run `ruff format .`:\n" + r.stdout + r.stderr


@pytest.mark.slow
def test_mypy_is_clean(mypy_run: tuple[int, str]) -> None:
    code, out = mypy_run  # started when the tier's collection ended (tests/conftest.py), so it runs beside it
    assert code == 0, out


def test_package_declares_its_types() -> None:
    assert (ROOT / "moetrace" / "py.typed").is_file()
