"""Disk full on a real file system: one clean error naming the cause, no temporaries, a resumable trace.

The file system is a tmpfs of a few hundred KiB that the test mounts (root only; skipped elsewhere).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.tracer.trace.validate import find_problems


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.parametrize("requests, filler_kib", [(200, 2800), (400, 0)])  # full at the side files / inside a part
def test_disk_full(tiny_fs, requests, filler_kib):
    (tiny_fs / "filler").write_bytes(b"\0" * (filler_kib << 10))
    out = tiny_fs / "t"
    r = CliRunner().invoke(app, ["synth", "--model", "deepseek-v3-tiny", "--requests", str(requests), "-o", str(out)])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "no space left on device" in errors[0].lower(), r.output
    leftovers = [p.name for p in out.rglob("*") if p.name.endswith(".tmp") or ".tmp." in p.name]
    assert leftovers == [], leftovers
    if (out / "manifest.json").exists():  # what is there is an honest, incomplete trace
        problems = find_problems(out)
        assert problems and all("did not finish" in p for p in problems), problems
