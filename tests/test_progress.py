"""Progress: the library reports (done, total) monotonically up to total; the CLI draws only on a TTY, never under --quiet."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from factories import write_small_trace
from typer.testing import CliRunner

from moetrace.cli import app, common
from moetrace.cli.common import ProgressBar, RequestProgress, show_progress

runner = CliRunner()


def _recorder():
    calls: list[tuple[int, int]] = []
    return calls, lambda done, total: calls.append((done, total))


def _assert_monotone_to_total(calls):
    assert calls, "progress was never called"
    dones = [d for d, _ in calls]
    totals = {t for _, t in calls}
    assert len(totals) == 1, totals
    (total,) = totals
    assert dones == sorted(dones) and all(0 <= d <= total for d in dones)
    assert dones[-1] == total


# ---- the one decision: a terminal and not --quiet
def test_show_progress_decision():
    assert show_progress(False, tty=True) is True
    assert show_progress(True, tty=True) is False
    assert show_progress(False, tty=False) is False
    assert show_progress(True, tty=False) is False


def test_bars_follow_the_decision(monkeypatch):
    monkeypatch.setattr(common, "stderr_is_tty", lambda: True)
    assert ProgressBar("x", "rows").enabled and RequestProgress("x").enabled
    assert not ProgressBar("x", "rows", quiet=True).enabled and not RequestProgress("x", quiet=True).enabled
    monkeypatch.setattr(common, "stderr_is_tty", lambda: False)
    assert not ProgressBar("x", "rows").enabled and not RequestProgress("x").enabled


def test_bar_draws_on_a_tty_and_clears_at_total(monkeypatch):
    monkeypatch.setattr(common, "stderr_is_tty", lambda: True)
    bar = ProgressBar("validate", "rows")
    bar(0, 10)
    assert bar._bar is not None
    bar(5, 10)
    bar(10, 10)
    assert bar._bar is None  # stopped (transient) once done
    bar.stop()


# ---- library callbacks
def test_validate_progress(tmp_path):
    from moetrace.tracer.trace.validate import find_problems

    trace = write_small_trace(tmp_path / "t", num_requests=8)
    calls, cb = _recorder()
    assert find_problems(trace, progress=cb) == []
    _assert_monotone_to_total(calls)
    assert calls[-1][1] == sum(3 + r + 2 + r % 3 for r in range(8))  # every routing row


def test_compare_load_progress(tmp_path):
    from moetrace.placement.compare import load_trace_data

    trace = write_small_trace(tmp_path / "t", num_requests=8)
    calls, cb = _recorder()
    load_trace_data(trace, test_fraction=0.5, seed=0, progress=cb)
    _assert_monotone_to_total(calls)


def test_compare_simulation_progress(tmp_path):
    from moetrace.placement.compare import CompareConfig, load_trace_data, run_compare
    from moetrace.placement.deployment import parse_deployment

    trace = write_small_trace(tmp_path / "t", num_requests=8)
    data = load_trace_data(trace, test_fraction=0.5, seed=0)
    cfg = CompareConfig(
        deployment=parse_deployment("DP2TP1EP2", num_gpus_per_node=1),
        num_batches=4,
        num_batch_requests=2,
        strategies=("round_robin",),
    )
    calls, cb = _recorder()
    run_compare(data, cfg, progress=cb)
    _assert_monotone_to_total(calls)
    assert calls[-1] == (8, 8)  # linear reference + round_robin + the two bounds, placed and simulated
    calls, cb = _recorder()
    run_compare(data, replace(cfg, oracle=False), progress=cb)
    _assert_monotone_to_total(calls)
    assert calls[-1] == (4, 4)  # without the bounds: linear + round_robin


def test_import_progress(tmp_path):
    from factories import MAV, planted_ids, sglang_response

    from moetrace.tracer.importers import import_trace

    shapes = [(3, 2)] * 600  # more than one committed batch of 512
    lines = [json.dumps(sglang_response(p, o, planted_ids(p + o - 1, MAV, i), MAV)) for i, (p, o) in enumerate(shapes)]
    src = tmp_path / "resp.jsonl"
    src.write_text("\n".join(lines) + "\n")
    calls, cb = _recorder()
    import_trace(src, out=tmp_path / "out", model=MAV, progress=cb)
    _assert_monotone_to_total(calls)
    assert len(calls) >= 2 and calls[-1][1] == src.stat().st_size


# ---- --quiet: no bar, no step log lines; the result line still prints
def test_quiet_validate_and_analyze(tmp_path):
    trace = write_small_trace(tmp_path / "t", num_requests=8)
    r = runner.invoke(app, ["validate", str(trace), "--quiet"])
    assert r.exit_code == 0, r.output
    assert r.stderr == "" and "valid" in r.stdout

    loud = runner.invoke(app, ["analyze", str(trace), "-o", str(tmp_path / "a1"), "--only", "imbalance"])
    assert loud.exit_code == 0, loud.output
    assert loud.stderr.strip()  # the step log lines (and counted-% lines) without --quiet
    r = runner.invoke(app, ["analyze", str(trace), "-o", str(tmp_path / "a2"), "--only", "imbalance", "-q"])
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    assert "results in" in r.stdout


def test_quiet_still_prints_errors(tmp_path):
    r = runner.invoke(app, ["validate", str(tmp_path / "nope"), "--quiet"])
    assert r.exit_code != 0
    assert r.stderr.strip() or r.output.strip()


@pytest.mark.parametrize("cmd", ["synth", "collect", "analyze", "compare", "place", "validate", "import"])
def test_every_long_command_has_quiet(cmd):
    r = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    assert r.exit_code == 0, r.output
    assert "--quiet" in r.output


# ---- a recorded terminal session: the real command under a pseudo-terminal draws the bar
def _run_in_pty(argv: list[str], *, timeout: float = 120.0) -> tuple[int, str]:
    """Run ``argv`` with stdout and stderr on a pseudo-terminal; (exit code, everything it drew)."""
    import os
    import pty
    import select
    import subprocess
    import sys
    import time

    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm-256color"}
    env.pop("CI", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetrace", *argv],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=env,
        close_fds=True,
    )
    os.close(slave)
    out, deadline = bytearray(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=10), out.decode("utf-8", "replace")


@pytest.mark.parametrize("quiet", [False, True])
def test_synth_draws_a_bar_with_rate_and_eta_on_a_terminal(tmp_path, quiet):
    argv = ["synth", "--model", "olmoe-1b-7b-tiny", "-n", "600", "--workers", "1", "-o", str(tmp_path / "t")]
    code, screen = _run_in_pty(argv + (["--quiet"] if quiet else []))
    assert code == 0, screen
    assert "600 requests" in screen  # the result line prints either way
    bar = "━" in screen and "requests" in screen and "/s" in screen
    assert bar is not quiet, screen[-2000:]
