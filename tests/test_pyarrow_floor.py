"""The trace writer and reader under the oldest pyarrow the project declares (``pyarrow>=N`` in pyproject.toml).

The set-up installs the newest pyarrow (unpinned), so the rest of the suite tests that one; this test installs
the floor release into a cache under ``.venv/`` (``pip install --target``, reused by later runs; about 40 MB
the first time) and runs the writer and reader equivalence tests again in a subprocess that imports it first,
with the environment's own numpy. Where this Python is newer than the floor's wheels, the floor is the first
release with wheels for it (``FIRST_WHEELS``).

In CI (``CI=true``) a failed install fails the test; elsewhere (offline) it is skipped with pip's reason.
``MOETRACE_FLOOR_CACHE`` moves the cache.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the writer/reader equivalence tests, run again under the floor
FLOOR_TESTS = [
    "tests/test_writer_parquet.py",
    "tests/test_parquet_encoder.py",
    "tests/test_store.py",
    "tests/test_reader_checks.py",
]
#: the first pyarrow release with wheels for a Python the declared floor has none for (checked on PyPI)
FIRST_WHEELS = {(3, 13): "18.0.0", (3, 14): "22.0.0"}


def _version(v: str) -> tuple[int, ...]:
    parts = [int(x) for x in v.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def floor_version() -> str:
    """The pyarrow release this test installs: the declared floor, or the first with wheels for this Python."""
    m = re.search(r'"pyarrow>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert m, "pyproject.toml declares no `pyarrow>=` floor"
    floor = _version(m[1])
    first = FIRST_WHEELS.get(sys.version_info[:2])
    if first is not None and _version(first) > floor:
        floor = _version(first)
    return ".".join(map(str, floor))


def _install(version: str) -> Path:
    """The cache directory holding pyarrow ``version`` for this Python (installed on first use)."""
    base = Path(os.environ.get("MOETRACE_FLOOR_CACHE") or ROOT / ".venv" / "moetrace-test-cache")
    target = base / f"pyarrow-{version}-py{sys.version_info[0]}{sys.version_info[1]}"
    if (target / "INSTALLED").exists():
        return target
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--only-binary=:all:",
        "--target",
        str(tmp),
        f"pyarrow=={version}",
    ]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        failure = r.stderr.strip().splitlines()[-1] if r.returncode else None
    except subprocess.TimeoutExpired:
        failure = "pip took more than 300 s"
    if failure is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        why = f"cannot install pyarrow=={version} (the declared floor) with pip: {failure}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    (tmp / "INSTALLED").write_text(version)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


@pytest.mark.slow
def test_writer_and_reader_tests_pass_at_the_pyarrow_floor():
    version = floor_version()
    cache = _install(version)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cache), str(ROOT)])}
    env.pop("MOETRACE_PARQUET_ENCODER", None)
    # pyarrow is imported before pytest starts, so every test below runs against this one
    script = (
        "import sys, pyarrow, pytest\n"
        f"assert pyarrow.__version__ == {version!r}, pyarrow.__version__\n"
        f"assert pyarrow.__file__.startswith({str(cache)!r}), pyarrow.__file__\n"
        "print('pyarrow', pyarrow.__version__, 'from', pyarrow.__file__)\n"
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *{FLOOR_TESTS!r}]))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"the writer/reader tests fail under pyarrow {version}:\n{out[-6000:]}"
    assert f"pyarrow {version} from {cache}" in out and " passed" in out, out[-2000:]
