"""Every writer respects every trace, and nothing outlives a killed run (issue #25, items 2 and 5).

- While a collection runs (a real second process holds the trace's writer lock, as
  tests/test_writer_lock.py's holder), each command that writes into or next to a trace is refused
  with one line naming the holder, even with ``--overwrite``, and the trace is intact afterwards.
- A results folder is locked like a trace: a second run into it is refused.
- Data loss: an ``--overwrite`` stopped half-way is never resumed into a complete trace with rows
  missing; a failed ``import --overwrite`` keeps the old trace; a collector that loses a lock race
  never removes the winner's directory; ``collect`` refuses before it loads a model.
- Lifetime: a child that called ``die_with_parent`` and the processes and paths under a
  ``lifetime.guard`` go when their parent is killed by SIGKILL (and, slow, ``a2a``'s network
  namespaces and temporary directory).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from factories import finish_lock_holder, start_lock_holder, write_small_trace
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import TraceBusyError
from moetrace.tracer.trace import TraceWriter, open_trace
from moetrace.tracer.trace.validate import find_problems

runner = CliRunner()
DEPLOY = ["--config", "DP2TP1EP2", "--gpus-per-node", "1"]


def _line(experts: object, request: int = 0, stage: str = "prefill", position: int = 0) -> str:
    rec = {"request": request, "layer": 0, "position": position, "stage": stage, "experts": experts}
    return json.dumps(rec) + "\n"


#: command lines that write into or next to the trace T while its collection runs (S: another, whole trace)
WRITERS = {
    "dashboard": lambda t, s: ["dashboard", str(s), "-o", str(t / "report.html")],
    "export": lambda t, s: ["export", str(s), "--format", "sglang-logical-count", "-o", str(t / "counts.json")],
    "analyze": lambda t, s: ["analyze", str(s), "-o", str(t / "analysis")],
    "analyze into the trace": lambda t, s: ["analyze", str(s), "-o", str(t)],
    "place": lambda t, s: ["place", str(s), *DEPLOY, "-o", str(t / "placement.json")],
    "compare": lambda t, s: ["compare", str(s), *DEPLOY, "--batches", "2", "-o", str(t / "compare")],
    "a2a": lambda t, s: ["a2a", str(s), *DEPLOY, "--batches", "1", "-o", str(t / "a2a"), "--no-emulate-nodes"],
    "make-checkpoint": lambda t, s: ["make-checkpoint", "deepseek-v3", "-o", str(t)],
    "synth": lambda t, s: ["synth", "--model", "deepseek-v3-tiny", "--requests", "4", "-o", str(t)],
    "import": lambda t, s: ["import", str(_tokens_file(t.parent)), "--model", "olmoe-1b-7b-tiny", "-o", str(t)],
    "collect": lambda t, s: ["collect", "--model", "olmoe-1b-7b-tiny", "--backend", "hf", "-o", str(t)],
}


def _tokens_file(d: Path) -> Path:
    f = d / "in.jsonl"
    f.write_text(_line([1, 2, 3, 4, 5, 6, 7, 8]) + _line([1, 2, 3, 4, 5, 6, 7, 8], stage="decode", position=1))
    return f


@pytest.fixture(scope="module")
def other_trace(tmp_path_factory) -> Path:
    return write_small_trace(tmp_path_factory.mktemp("s") / "s", num_requests=12)


@pytest.mark.parametrize("command", WRITERS)
def test_no_command_writes_into_a_trace_being_collected(tmp_path, other_trace, command):
    trace = tmp_path / "t"
    holder = start_lock_holder(trace)
    try:
        t0 = time.perf_counter()
        r = runner.invoke(app, [*WRITERS[command](trace, other_trace), "--overwrite"])
        seconds = time.perf_counter() - t0
    finally:
        finish_lock_holder(holder)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"pid {holder.pid}" in errors[0], r.output
    assert seconds < 10  # refused before any work (collect: before a model loads)
    assert find_problems(trace) == []
    assert open_trace(trace).requests().collect()["request_id"].to_list() == [100]
    assert sorted(p.name for p in trace.iterdir()) == [".writer.lock", "manifest.json", "requests", "routing"]


def test_collect_is_refused_before_it_loads_a_model(planted_backend, tmp_path):
    trace = tmp_path / "t"
    holder = start_lock_holder(trace)
    try:
        r = runner.invoke(app, ["collect", "--model", "mixtral-8x7b", "-o", str(trace), "--resume"])
    finally:
        finish_lock_holder(holder)
    assert r.exit_code == 2 and f"pid {holder.pid}" in r.output, r.output
    assert all("load" not in b.calls for b in planted_backend.built)


def test_a_collector_that_loses_a_lock_race_leaves_the_winners_directory(planted_backend, tmp_path, monkeypatch):
    """The winner creates the directory between the loser's checks and its writer: the loser is refused
    and must not remove the directory as one it created and left empty."""
    from moetrace.tracer import collect as collect_mod
    from moetrace.tracer.collect import CollectConfig

    trace = tmp_path / "t"
    holders = []

    def racing_writer(*args, **kw):
        holders.append(start_lock_holder(trace))  # the winner appears just now
        return TraceWriter(*args, **kw)

    monkeypatch.setattr(collect_mod, "TraceWriter", racing_writer)
    config = CollectConfig(model="mixtral-8x7b", datasets=("chat",), num_requests=2)
    try:
        with pytest.raises(TraceBusyError, match=r"being written by pid"):
            collect_mod.collect(config, out=trace, backend="planted")
        assert (trace / "requests").is_dir() and (trace / "manifest.json").is_file()
    finally:
        for h in holders:
            finish_lock_holder(h)
    assert open_trace(trace).requests().collect()["request_id"].to_list() == [100]


def test_a_results_folder_has_one_writer(tmp_path, other_trace):
    out = tmp_path / "analysis"
    code = textwrap.dedent(
        f"""
        import sys
        from moetrace.tracer.trace.lock import lock_results
        lock = lock_results({str(out)!r}, what="moetrace analyze")
        print("holding", flush=True)
        sys.stdin.readline()
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        for args in (
            ["analyze", str(other_trace), "-o", str(out), "--overwrite"],
            ["compare", str(other_trace), *DEPLOY, "--batches", "2", "-o", str(out), "--overwrite"],
        ):
            r = runner.invoke(app, args)
            assert r.exit_code == 2 and f"pid {holder.pid}" in r.output, r.output
    finally:
        holder.communicate("go\n", timeout=30)
    assert [p.name for p in out.iterdir()] == [".writer.lock"]  # nothing of either run landed there
    r = runner.invoke(app, ["analyze", str(other_trace), "-o", str(out), "--only", "imbalance"])
    assert r.exit_code == 0, r.output  # free again once the holder is gone


@pytest.mark.parametrize("stop_after", [1, 2, 3])  # unlinks done before the kill: manifest, then requests parts
def test_an_overwrite_stopped_half_way_is_never_resumed_as_complete(tmp_path, monkeypatch, stop_after):
    from factories import SMALL

    trace = write_small_trace(tmp_path / "t", num_requests=8, part_tokens=20)
    real_unlink, done = Path.unlink, []

    def dying_unlink(self, *a, **kw):
        if len(done) == stop_after:
            raise KeyboardInterrupt  # the kill, between two deletions
        done.append(self.name)
        return real_unlink(self, *a, **kw)

    monkeypatch.setattr(Path, "unlink", dying_unlink)
    with pytest.raises(KeyboardInterrupt):
        TraceWriter(trace, model=SMALL, backend={"name": "synthetic"}, collection={}, on_existing="overwrite")
    monkeypatch.setattr(Path, "unlink", real_unlink)
    assert done[0] == "manifest.json"  # the manifest goes first: what is left is never a trace to resume
    with pytest.raises(Exception, match=r"no manifest\.json .*--overwrite"):
        TraceWriter(trace, model=SMALL, backend={"name": "synthetic"}, collection={}, on_existing="resume")
    assert find_problems(trace)  # and nothing reads it as a valid trace


def test_resume_refuses_a_trace_that_lost_a_part(tmp_path):
    from factories import SMALL

    trace = write_small_trace(tmp_path / "t", num_requests=8, part_tokens=20)
    sorted((trace / "routing").glob("*.parquet"))[1].unlink()
    with pytest.raises(Exception, match=r"missing 1 committed file\(s\): routing/part-000001\.parquet"):
        TraceWriter(trace, model=SMALL, backend={"name": "synthetic"}, collection={"seed": 0}, on_existing="resume")


def test_a_failed_import_overwrite_keeps_the_old_trace(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(_line(list(range(8)), request=r) for r in range(3)))
    out = tmp_path / "t"
    args = ["--model", "olmoe-1b-7b-tiny", "-o", str(out), "--format", "tokens", "--stages", "prefill-only"]
    assert runner.invoke(app, ["import", str(good), *args]).exit_code == 0
    before = (out / "manifest.json").read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_line(list(range(8))) + _line("oops", request=1))
    r = runner.invoke(app, ["import", str(bad), *args, "--overwrite"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert (out / "manifest.json").read_bytes() == before and find_problems(out) == []
    assert sorted(open_trace(out).requests().collect()["request_id"].to_list()) == [0, 1, 2]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".t.")] == []  # no staging left behind
    assert runner.invoke(app, ["import", str(good), *args, "--overwrite"]).exit_code == 0  # a good one replaces it


# ---------------------------------------------------------------------------------- lifetime
def _wait_gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux")
def test_a_child_dies_with_its_killed_parent():
    parent = textwrap.dedent(
        """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "from moetrace.lifetime import die_with_parent; import time; die_with_parent(); print('up', flush=True); time.sleep(120)"],
            stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "up"
        print(child.pid, flush=True)
        time.sleep(120)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    assert _wait_gone(child)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the supervisor reads /proc")
def test_a_guard_cleans_up_after_a_sigkill(tmp_path):
    scratch, marker = tmp_path / "scratch", tmp_path / "cleaned"
    scratch.mkdir()
    code = textwrap.dedent(
        f"""
        import subprocess, time
        from moetrace import lifetime
        with lifetime.guard(paths=[{str(scratch)!r}], commands=[["touch", {str(marker)!r}]]):
            child = subprocess.Popen(["sleep", "120"])
            print(child.pid, flush=True)
            time.sleep(120)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    time.sleep(1.5)  # the supervisor has seen the child
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    assert _wait_gone(child)
    deadline = time.monotonic() + 10
    while (scratch.exists() or not marker.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not scratch.exists() and marker.exists()


def test_a_guard_that_ends_normally_kills_nothing(tmp_path):
    from moetrace import lifetime

    with lifetime.guard(paths=[tmp_path / "gone"]):
        child = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.5)
        assert child.poll() is None  # still running: the block's own business
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and ip")
def test_a_killed_a2a_leaves_no_namespace_rank_or_temp_dir(tmp_path, request):
    from moetrace.placement import netemu

    ok, why = netemu.probe()
    if not ok:
        pytest.skip(f"no network namespaces here: {why}")
    trace = write_small_trace(tmp_path / "t", num_requests=40)
    tmp_before = {p.name for p in Path("/tmp").glob("moetrace-a2a-*")}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    err_file = open(tmp_path / "a2a.err", "wb")  # noqa: SIM115 - closed at the end of the test
    request.addfinalizer(err_file.close)
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moetrace",
            "a2a",
            str(trace),
            *DEPLOY,
            "--batches",
            "400",
            "--strategies",
            "linear",
            "-o",
            str(tmp_path / "a"),
            "--emulate-nodes",
            "-q",
        ],  # fmt: skip
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err_file,
    )

    def ours() -> list[str]:
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in listing.splitlines() if f"moetrace-{p.pid}-" in line]

    # a loaded CI machine may take a while to import torch and fit the placements: wait for the
    # namespaces or for the run to end, and say what it printed if it ended first
    deadline = time.monotonic() + 240
    while not ours() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not ours():
        p.kill()
        p.wait(timeout=10)
        err_file.flush()
        printed = (tmp_path / "a2a.err").read_text(errors="replace")
        # the machine refused namespaces, or an `ip`/`tc` step the probe does not try (veth, bridge, qdisc)
        if "network namespaces cannot be made here" in printed or re.search(r"`(ip|tc) [^`]*` failed:", printed):
            pytest.skip(f"the run could not make namespaces here: {printed.strip()[-300:]}")
        raise AssertionError(f"the namespaces never appeared (exit {p.returncode}); it printed:\n{printed[-2000:]}")
    time.sleep(3)  # the ranks are up
    ranks = [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()]
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    deadline = time.monotonic() + 20
    while ours() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ours() == []
    assert all(_wait_gone(r) for r in ranks)
    assert {p.name for p in Path("/tmp").glob("moetrace-a2a-*")} <= tmp_before


@pytest.mark.parametrize("allow_incomplete", [False, True])
def test_merge_shards_is_refused_while_a_whole_trace_writer_runs(tmp_path, allow_incomplete):
    """`merge-shards` writes the trace's manifest: under the trace's lock (shards, which share it, may
    run with --allow-incomplete; a whole-trace writer never)."""
    trace = tmp_path / "t"
    holder = start_lock_holder(trace)
    try:
        r = runner.invoke(app, ["merge-shards", str(trace), *(["--allow-incomplete"] if allow_incomplete else [])])
    finally:
        finish_lock_holder(holder)
    assert r.exit_code == 2 and f"pid {holder.pid}" in r.output and "Traceback" not in r.output, r.output
    assert open_trace(trace).requests().collect()["request_id"].to_list() == [100]  # its manifest untouched
