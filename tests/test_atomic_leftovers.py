"""A write killed between its temporary and its rename leaves a hidden ``.<name>.<pid>.<random>.tmp``; the
next write of the same path removes it when that pid is gone, and never touches a live writer's
temporary, a link, a directory or another file's temporary (moetrace.atomic)."""

from __future__ import annotations

import os
import subprocess
import sys

from moetrace.atomic import remove_dead_temporaries, temp_file_beside, write_text_atomic


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_next_write_removes_a_dead_writers_temporary_only(tmp_path):
    out = tmp_path / "r.html"
    dead = _dead_pid()
    leftover = tmp_path / f".r.html.{dead}.abc123.tmp"
    leftover.write_text("half")
    live = temp_file_beside(out)  # this process's own temporary: a live writer's
    assert live.name.startswith(f".r.html.{os.getpid()}.")
    other = tmp_path / f".other.html.{dead}.abc123.tmp"  # another file's temporary
    other.write_text("x")
    link = tmp_path / f".r.html.{dead}.lnk999.tmp"
    link.symlink_to(other)
    folder = tmp_path / f".r.html.{dead}.dir999.tmp"
    folder.mkdir()
    write_text_atomic(out, "new")
    assert out.read_text() == "new"
    assert not leftover.exists()
    assert live.exists() and other.exists() and link.is_symlink() and folder.is_dir()


def test_a_running_writers_temporary_is_kept(tmp_path):
    out = tmp_path / "a.json"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        theirs = tmp_path / f".a.json.{child.pid}.zz9.tmp"
        theirs.write_text("{")
        assert remove_dead_temporaries(out) == []
        assert theirs.exists()
    finally:
        child.kill()
        child.wait()
    assert remove_dead_temporaries(out) == [theirs] and not theirs.exists()
