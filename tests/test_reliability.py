"""Disk full on a real file system: one clean error naming the cause, no temporaries, a resumable trace;
and fuzzing what issue #25 added: the manifest's part list, placement files, what stands at -o.

The file system is a 3 MiB tmpfs that the test mounts (conftest's ``tiny_fs``; root only, skipped elsewhere).
Hypothesis runs end in a clean exit with no traceback, and what must stay intact does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from factories import write_small_trace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.tracer.trace.validate import find_problems


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


# ---------------------------------------------------------------------------------- fuzzing (issue #25)
# Hypothesis over what round two added: the manifest's part list, placement files, and what stands at -o.
# Every run ends in a clean exit with no traceback; what must stay intact stays intact.

FUZZ = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=70),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10,
)


def _clean(r) -> None:
    assert r.exit_code in (0, 1, 2), r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output


@pytest.fixture(scope="module")
def fuzz_trace(tmp_path_factory) -> Path:
    return write_small_trace(tmp_path_factory.mktemp("fz") / "t", num_requests=12)


@FUZZ
@given(key=st.sampled_from(["parts", "entry", "num_requests", "num_tokens", "routing_sha256", "name"]), value=_values)
def test_fuzz_the_part_list(fuzz_trace, key, value):
    with tempfile.TemporaryDirectory() as d:
        t = Path(d) / "t"
        shutil.copytree(fuzz_trace, t)
        m = json.loads((t / "manifest.json").read_text())
        entry = m["parts"]["part-000000.parquet"]
        if key == "parts":
            m["parts"] = value
        elif key == "entry":
            m["parts"]["part-000000.parquet"] = value
        elif key == "name":
            m["parts"][str(value)[:60]] = m["parts"].pop("part-000000.parquet")
        else:
            entry[key] = value
        (t / "manifest.json").write_text(json.dumps(m))
        for args in (["validate", str(t)], ["info", str(t)]):
            _clean(CliRunner().invoke(app, args))


@pytest.fixture(scope="module")
def fuzz_placement(fuzz_trace, tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("fp") / "p.json"
    r = CliRunner().invoke(
        app,
        ["place", str(fuzz_trace), "--config", "DP2TP1EP2", "--gpus-per-node", "1", "--redundancy", "2", "-o", str(p)],
    )
    assert r.exit_code == 0, r.output
    return p


@FUZZ
@given(
    key=st.sampled_from(["phy2log", "logcnt", "log2phy", "num_slots", "num_redundant", "model", "deployment", "row"]),
    value=_values,
)
def test_fuzz_placement_files(fuzz_placement, key, value):
    from moetrace.placement.exports import load_placement

    with tempfile.TemporaryDirectory() as d:
        p, out = Path(d) / "p.json", Path(d) / "out.json"
        obj = json.loads(fuzz_placement.read_text())
        if key == "row":
            obj["phy2log"][0][0] = value
        else:
            obj[key] = value
        p.write_text(json.dumps(obj))
        r = CliRunner().invoke(app, ["export", str(p), "--format", "trtllm", "-o", str(out)])
        _clean(r)
        if r.exit_code == 0:  # exported: then the file passed every check
            load_placement(p)


_AT_O = ["nothing", "file", "empty dir", "full dir", "link to file", "link to dir", "dangling link", "fifo", "trace"]


def _make_at(path: Path, what: str, target: Path) -> None:
    if what == "file":
        path.write_text("mine")
    elif what == "empty dir":
        path.mkdir()
    elif what == "full dir":
        path.mkdir()
        (path / "keep.txt").write_text("mine")
    elif what == "link to file":
        path.symlink_to(target)
    elif what == "link to dir":
        path.symlink_to(target.parent)
    elif what == "dangling link":
        path.symlink_to(target.parent / "nowhere")
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "trace":
        write_small_trace(path, num_requests=4)


@FUZZ
@given(
    what=st.sampled_from(_AT_O),
    command=st.sampled_from(["dashboard", "export", "analyze", "place"]),
    over=st.booleans(),
)
def test_fuzz_what_stands_at_o(fuzz_trace, fuzz_placement, what, command, over):
    with tempfile.TemporaryDirectory() as d:
        target = Path(d) / "precious.txt"
        target.write_text("keep me")
        out = Path(d) / "out"
        _make_at(out, what, target)
        args = {
            "dashboard": ["dashboard", str(fuzz_trace), "-o", str(out)],
            "export": ["export", str(fuzz_placement), "--format", "sglang", "-o", str(out)],
            "analyze": ["analyze", str(fuzz_trace), "-o", str(out), "--only", "imbalance"],
            "place": ["place", str(fuzz_trace), "--config", "DP2TP1EP2", "--gpus-per-node", "1", "-o", str(out)],
        }[command]
        r = CliRunner().invoke(app, [*args, *(["--overwrite"] if over else [])])
        _clean(r)
        assert target.read_text() == "keep me"  # never written through a link
        if "link" in what or what == "fifo":
            assert r.exit_code == 2, r.output
        if what == "trace" and not over:
            assert r.exit_code == 2 and (out / "manifest.json").read_text().startswith("{"), r.output
