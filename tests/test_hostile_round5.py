"""Hostile inputs, round five (issue 38): the round-two leftovers and the last misleading messages, through the CLI.

- the dashboard of a trace whose parts carry an extra text column, or write one of its columns differently
  (another integer width, a dictionary-encoded ``dataset``): drawn right (it was a polars ``SchemaError``);
  a part whose column cannot be read as the format's is one error line;
- ``make-checkpoint`` on a full disk (a real tmpfs where the test can mount one; the Rust writers' own
  error under transformers; a quota): one line, nothing left at ``-o``, an old checkpoint kept;
- a ``synth`` worker killed by SIGKILL (the worker kills itself; an outside ``kill -9`` of a real
  worker): one line at once, no hang, and the trace at ``-o`` says ``complete: false``;
- messages of ``a2a`` and ``place``, which share ``compare``'s configuration, name only their own options;
- kill injection at each step of the dashboard's replacing write (the rename, the temporary's removal, a
  real SIGKILL) and of ``compare --overwrite``'s folder swap: afterwards exactly the old or the new output.

Each failing case runs through ``run_case`` (tests/hostile.py: exit code, one ``Error:`` line, no traceback,
every file under the case's folder hashing the same before and after, a 60 s alarm); the message cases
through ``run_case_naming_own_options`` (round four's option check). Kill injection: tests/kills.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from factories import tree_hashes, write_small_trace
from hostile import DEPLOY, Case, run_case, run_case_naming_own_options, trace_in, under_alarm
from kills import DyingOs, Killed, die_at_exchange, die_at_rmtree, no_exchange
from typer.testing import CliRunner

from moetrace import atomic
from moetrace.cli import app
from moetrace.tracer.trace.validate import find_problems

runner = CliRunner()
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def _ok(args: list[str], root: Path) -> str:
    """Run ``args`` under the 60 s alarm (``hostile.under_alarm``): exit 0, no traceback, no error line,
    nothing under ``root`` (the inputs) changed. Returns the output."""
    before = tree_hashes(root)
    with under_alarm(60):
        r = runner.invoke(app, args)
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "Traceback" not in r.output and not [x for x in r.output.splitlines() if x.startswith("Error:")], r.output
    assert tree_hashes(root) == before
    return r.output


# ============================================================ the dashboard of a trace with an extra text column
def _edit_part(t: Path, kind: str, edit, index: int = 1) -> Path:
    """Rewrite part ``index`` of ``kind`` (requests, routing) with ``edit(table)`` and record its new checksum:
    the trace another tool wrote so (``validate`` tells whether the format allows it)."""
    f = sorted((t / kind).glob("*.parquet"))[index]
    pq.write_table(edit(pq.read_table(f)), f)
    m = json.loads((t / "manifest.json").read_text())
    m["parts"][f.name][f"{kind}_sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
    (t / "manifest.json").write_text(json.dumps(m))
    return t


def _parts_trace(d: Path) -> Path:
    """The small trace in three parts (polars' scan takes the first part's columns for all of them)."""
    t = write_small_trace(d / "t", num_requests=8, part_tokens=20)
    assert len(list((t / "requests").glob("*.parquet"))) == 3
    return t


def _with_column(name: str, values: object = "a note"):
    return lambda table: table.append_column(name, pa.array([values] * table.num_rows))


def _retyped(name: str, typ: pa.DataType):
    def edit(table: pa.Table) -> pa.Table:
        i = table.schema.get_field_index(name)
        col = table.column(i)
        col = col.dictionary_encode() if pa.types.is_dictionary(typ) else col.cast(typ)
        return table.set_column(i, pa.field(name, col.type), col)

    return edit


DRAWN = {  # the edit, and whether validate calls the trace valid (the dashboard draws it either way)
    "an extra text column in the second requests part": ("requests", _with_column("note"), True),
    "an extra text column in the second routing part": ("routing", _with_column("note"), True),
    "prompt_text in the second requests part only": ("requests", _with_column("prompt_text", "hello"), False),
    "dataset dictionary-encoded in the second part": ("requests", _retyped("dataset", pa.dictionary(pa.int32(), pa.string())), True),
    "prompt_tokens as int64 in the second part": ("requests", _retyped("prompt_tokens", pa.int64()), False),
}  # fmt: skip


@pytest.mark.parametrize("name", DRAWN)
def test_dashboard_draws_a_trace_whose_parts_differ_in_their_columns(tmp_path, name):
    kind, edit, valid = DRAWN[name]
    t = _edit_part(_parts_trace(tmp_path / "in"), kind, edit)
    _ok(["dashboard", str(t), "-o", str(tmp_path / "r.html")], tmp_path / "in")
    html, tokens = (
        (tmp_path / "r.html").read_text(),
        json.loads((t / "manifest.json").read_text())["totals"]["num_tokens"],
    )
    assert 'requests</td><td class="num">8<' in html  # the whole trace: every part's requests and tokens
    assert f'tokens (prefill + decode)</td><td class="num">{tokens}<' in html
    assert (find_problems(t) == []) is valid  # validate never raises on it (it was a traceback for the dictionary)


def _text_prompt_tokens(d: Path) -> Path:
    return _edit_part(_parts_trace(d), "requests", _retyped("prompt_tokens", pa.string()))


UNREADABLE = {
    "dashboard of prompt_tokens written as text in one part": Case(
        lambda d: ["dashboard", str(_text_prompt_tokens(d)), "-o", str(d / "r.html")],
        r"a requests part cannot be read .*prompt_tokens.*int32 vs string.*moetrace validate",
    ),
    "analyze of prompt_tokens written as text in one part": Case(
        lambda d: ["analyze", str(_text_prompt_tokens(d)), "-o", str(d / "a")], r"a requests part cannot be read"
    ),
    "compare of prompt_tokens written as text in one part": Case(
        lambda d: ["compare", str(_text_prompt_tokens(d)), *DEPLOY, "--batches", "2"], r"a requests part cannot be read"
    ),
}


@pytest.mark.parametrize("name", UNREADABLE)
def test_a_part_whose_column_cannot_be_read_is_one_line(tmp_path, name):
    run_case(UNREADABLE[name], tmp_path, name)


@pytest.mark.slow  # analyze, then the dashboard
def test_dashboard_draws_analysis_results_whose_tables_carry_an_extra_text_column(tmp_path):
    t = _edit_part(_parts_trace(tmp_path / "in"), "requests", _with_column("note"))
    a = tmp_path / "in" / "a"
    r = runner.invoke(app, ["analyze", str(t), "-o", str(a), "--only", "imbalance", "-q"])
    assert r.exit_code == 0, r.output
    for f in a.glob("*.parquet"):
        pq.write_table(_with_column("note")(pq.read_table(f)), f)
    out = _ok(["dashboard", str(t), str(a), "-o", str(tmp_path / "r.html")], tmp_path / "in")
    assert "imbalance" in out.split("sections:")[1].splitlines()[0]


# ============================================================ make-checkpoint on a full disk
CKPT = "mixtral-8x7b"  # the fastest vLLM-sized checkpoint to build (tests/test_checkpoint.py)
NO_SPACE = r"cannot write the checkpoint .*: no space left on device; "


def _old_checkpoint(d: Path) -> Path:
    """What an earlier make-checkpoint left at -o (small: it fits the 3 MiB tmpfs)."""
    d.mkdir()
    (d / "moetrace-checkpoint.json").write_text(json.dumps({"format": "moetrace-checkpoint", "version": 1}))
    (d / "config.json").write_text("{}")
    return d


def _make_checkpoint(out: Path, *extra: str) -> list[str]:
    return ["make-checkpoint", CKPT, "-o", str(out), "-q", *extra]


@pytest.mark.slow
def test_make_checkpoint_on_a_full_disk_leaves_nothing(tiny_fs, tmp_path):
    pytest.importorskip("transformers")
    case = Case(lambda d: _make_checkpoint(tiny_fs / "ck"), NO_SPACE + r"nothing was written at .*ck.*free space")
    run_case(case, tmp_path, "make-checkpoint on a full tmpfs")  # nothing under tmp_path: no -o, no hidden copy


@pytest.mark.slow
def test_make_checkpoint_overwrite_on_a_full_disk_keeps_the_old_one(tiny_fs, tmp_path):
    pytest.importorskip("transformers")
    case = Case(
        lambda d: _make_checkpoint(_old_checkpoint(tiny_fs / "ck"), "--overwrite"),
        NO_SPACE + r"the checkpoint there before is kept as it was",
    )
    run_case(case, tmp_path, "make-checkpoint --overwrite on a full tmpfs")


@pytest.mark.slow
def test_make_checkpoint_full_at_the_tokenizer(tmp_path, monkeypatch):
    """The tokenizer is written by the Rust ``tokenizers``, whose error on a full disk is a bare
    ``Exception("No space left on device (os error 28)")`` (what it raises on a full tmpfs)."""
    pytest.importorskip("transformers")
    from moetrace.tracer.backends import hf

    def full(directory):
        (Path(directory) / "tokenizer.json").write_text('{"half": ')
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(hf, "save_tiny_tokenizer", full)
    case = Case(lambda d: _make_checkpoint(d / "ck"), NO_SPACE + r"nothing was written")
    run_case(case, tmp_path, "make-checkpoint full at the tokenizer")


@pytest.mark.slow
def test_make_checkpoint_over_quota_at_the_provenance_keeps_the_old_one(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from moetrace.tracer import checkpoint as ck

    real = ck._write_json

    def quota(path: Path, obj: dict) -> None:
        if path.name == ck.PROVENANCE_FILE:
            path.write_text("{")
            raise OSError(122, "Disk quota exceeded", str(path))
        real(path, obj)

    monkeypatch.setattr(ck, "_write_json", quota)
    case = Case(
        lambda d: _make_checkpoint(_old_checkpoint(d / "ck"), "--overwrite"),
        r"cannot write the checkpoint .*: disk quota exceeded; the checkpoint there before is kept as it was .*free space",
    )
    run_case(case, tmp_path, "make-checkpoint over quota")


# ============================================================ a synth worker killed
SYNTH = ["synth", "--model", "olmoe-1b-7b-tiny", "--requests", "130", "--workers", "2", "-q"]  # 3 chunks of 64
WORKER_DIED = r"a synth worker process ended abruptly .* is left an incomplete trace .*`complete: false`.*--overwrite"


def _workers_die_from(monkeypatch, chunk: int) -> None:
    """Every worker process SIGKILLs itself when it starts chunk ``chunk`` or a later one (the pool forks:
    the workers run this module's patched ``generate_chunk``)."""
    from moetrace.tracer import synth

    parent, real = os.getpid(), synth.generate_chunk

    def generate(sampler, c):
        if c >= chunk and os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(sampler, c)

    monkeypatch.setattr(synth, "generate_chunk", generate)


def _incomplete(out: Path) -> None:
    """What a killed synth leaves: a trace no reader takes for whole (``validate``: it did not finish)."""
    problems = find_problems(out)
    assert problems and all("did not finish" in p for p in problems), problems
    assert json.loads((out / "manifest.json").read_text())["complete"] is False


def _synth_beside_a_trace(out: Path, *extra: str) -> Case:
    """``synth -o out`` with a worker dying; a trace in the case's folder beside it, hashed before and after."""

    def build(d: Path) -> list[str]:
        trace_in(d, "neighbour")
        return [*SYNTH, "-o", str(out), *extra]

    return Case(build, WORKER_DIED)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 2], ids=["at its first chunk", "after chunks were written"])
def test_synth_with_a_killed_worker_fails_at_once(tmp_path, monkeypatch, chunk):
    _workers_die_from(monkeypatch, chunk)
    (tmp_path / "kept").mkdir()
    run_case(_synth_beside_a_trace(tmp_path / "out"), tmp_path / "kept", f"synth killed at chunk {chunk}")
    _incomplete(tmp_path / "out")


@pytest.mark.slow
def test_synth_overwrite_with_a_killed_worker_leaves_an_incomplete_trace(tmp_path, monkeypatch):
    out = tmp_path / "out"
    r = runner.invoke(app, ["synth", "--model", "olmoe-1b-7b-tiny", "--requests", "64", "-q", "-o", str(out)])
    assert r.exit_code == 0, r.output
    _workers_die_from(monkeypatch, 1)
    (tmp_path / "kept").mkdir()
    run_case(_synth_beside_a_trace(out, "--overwrite"), tmp_path / "kept", "synth --overwrite killed")
    _incomplete(out)  # the old whole trace is not shown as whole either


def _children(pid: int) -> list[int]:
    """The child processes of ``pid``, forked by any of its threads."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return out


@pytest.mark.slow
def test_synth_worker_killed_from_outside(tmp_path):
    """A real ``kill -9`` of one worker process of a running ``moetrace synth``."""
    if not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists():
        pytest.skip("needs /proc/PID/task/PID/children (Linux)")
    out = tmp_path / "out"
    args = ["synth", "--model", "olmoe-1b-7b-tiny", "--requests", "5000", "--workers", "2", "-q", "-o", str(out)]
    p = subprocess.Popen([sys.executable, "-m", "moetrace", *args], stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 90
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline and p.poll() is None:
            try:  # read each time: right after Popen the child may not have exec'd yet (pytest's cmdline)
                cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes()
                workers = [c for c in _children(p.pid) if Path(f"/proc/{c}/cmdline").read_bytes() == cmdline]
            except (FileNotFoundError, ProcessLookupError):  # a process ended between the reads
                workers = []
            time.sleep(0.05)
        assert len(workers) == 2, "the worker processes never started"
        time.sleep(0.5)
        os.kill(workers[-1], signal.SIGKILL)
        _, err = p.communicate(timeout=120)  # no hang
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and re.search(WORKER_DIED, errors[0]), err
    _incomplete(out)


# ============================================================ messages name only the command's options
def _decode_only(d: Path) -> Path:
    """The small trace, its manifest saying it recorded decode only (what `import --stages decode-only` writes)."""
    t = trace_in(d)
    m = json.loads((t / "manifest.json").read_text())
    m["collection"]["stages"] = ["decode"]
    (t / "manifest.json").write_text(json.dumps(m))
    return t


MANY_NODES = ["--config", "DP8192TP1EP8192", "--gpus-per-node", "1"]
MESSAGES = {
    "a2a of a decode-only trace": Case(
        lambda d: ["a2a", str(_decode_only(d)), *DEPLOY, "-o", str(d / "a")],
        r"recorded decode only .*`moetrace import --stages decode-only`.*or a trace with both stages$",
    ),
    "place --strategy data of a decode-only trace": Case(
        lambda d: ["place", str(_decode_only(d)), *DEPLOY, "--strategy", "data", "-o", str(d / "p.json")],
        r"recorded decode only .*or a trace with both stages$",
    ),
    "compare of a decode-only trace keeps its what-if": Case(
        lambda d: ["compare", str(_decode_only(d)), *DEPLOY, "--strategies", "data"],
        r"or a trace with both stages, or the what-if --route-on first-decode:N",
    ),
    "a2a on 8,192 nodes (prefill tokens per step)": Case(
        lambda d: ["a2a", str(trace_in(d)), *MANY_NODES, "-o", str(d / "a")],
        r"1,024 prefill tokens per node x 8,192 nodes = 8,388,608 .*\(512 per node\): deploy on fewer nodes$",
    ),
    "compare on 8,192 nodes keeps --prefill-tokens": Case(
        lambda d: ["compare", str(trace_in(d)), *MANY_NODES, "--batches", "2"],
        r"deploy on fewer nodes, or lower --prefill-tokens$",
    ),
    "place on 8,192 nodes (simulated tokens)": Case(
        lambda d: ["place", str(trace_in(d)), *MANY_NODES, "-o", str(d / "p.json")],
        r"500 batches x 262,144 requests per batch \(32 for each of 8,192 nodes\) = .*: deploy on fewer nodes$",
    ),
    "a2a --batches 10**7 keeps its own options": Case(
        lambda d: ["a2a", str(trace_in(d)), *DEPLOY, "--batches", str(10**7), "--batch-requests", "100", "-o", str(d / "a")],
        r"10,000,000 batches x 100 requests per batch = .*: lower --batches or --batch-requests$",
    ),
    "place --clusters -1": Case(
        lambda d: ["place", str(trace_in(d)), *DEPLOY, "--clusters", "-1", "-o", str(d / "p.json")],
        r"^Error: --clusters must be >= 0, got -1$",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", MESSAGES)
def test_messages_name_only_the_commands_options(tmp_path, name):
    run_case_naming_own_options(MESSAGES[name], tmp_path, name)  # run_case's checks, and every --option is its own


# ============================================================ kill injection: the dashboard's replacing write
OLD_REPORT = "<!doctype html><html><body>the old report</body></html>\n"


class _DyingReplace:
    """``os`` for moetrace.atomic whose ``replace`` (the rename of the finished temporary) dies; ``after``:
    the rename is made first, then the process dies."""

    def __init__(self, *, after: bool = False) -> None:
        self.after = after

    def __getattr__(self, name: str):
        return getattr(os, name)

    def replace(self, a, b) -> None:
        if self.after:
            os.replace(a, b)
        raise Killed("killed at the rename" + (" (made)" if self.after else ""))


class _FullFsync:
    """``os`` for moetrace.atomic whose ``fsync`` fails as on a full disk."""

    def __getattr__(self, name: str):
        return getattr(os, name)

    def fsync(self, fd) -> None:
        raise OSError(28, "No space left on device")


class _DyingUnlinkPath(type(Path())):  # type: ignore[misc]
    """``Path`` for moetrace.atomic whose ``unlink`` (of the temporary of a failed write) dies."""

    def unlink(self, missing_ok: bool = False) -> None:
        raise Killed("killed removing the temporary")


@pytest.fixture
def reported(tmp_path):
    t = trace_in(tmp_path)
    out = tmp_path / "r.html"
    out.write_text(OLD_REPORT)
    return t, out, ["dashboard", str(t), "-o", str(out), "--overwrite", "-q"]


def _report(out: Path) -> str:
    text = out.read_text()
    return "old" if text == OLD_REPORT else "new" if text.rstrip().endswith("</html>") else "half"


def _hidden(out: Path) -> list[str]:
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.parametrize("after", [False, True], ids=["at the rename", "right after the rename"])
def test_dashboard_overwrite_killed_at_its_rename(reported, monkeypatch, after):
    t, out, args = reported
    monkeypatch.setattr(atomic, "os", _DyingReplace(after=after))
    with pytest.raises(Killed):
        runner.invoke(app, args, catch_exceptions=False)
    monkeypatch.undo()
    assert _report(out) == ("new" if after else "old")
    if not after:
        assert out.read_text() == OLD_REPORT


def test_dashboard_overwrite_killed_removing_the_temporary_of_a_failed_write(reported, monkeypatch):
    t, out, args = reported
    monkeypatch.setattr(atomic, "os", _FullFsync())
    monkeypatch.setattr(atomic, "Path", _DyingUnlinkPath)
    with pytest.raises(Killed):
        runner.invoke(app, args, catch_exceptions=False)
    monkeypatch.undo()
    assert out.read_text() == OLD_REPORT  # the temporary is all a kill there leaves: hidden, never -o
    assert all(n.endswith(".tmp") for n in _hidden(out))


def test_dashboard_overwrite_on_a_full_disk_keeps_the_old_report(reported, monkeypatch):
    t, out, args = reported
    monkeypatch.setattr(atomic, "os", _FullFsync())
    case = Case(lambda d: args, r"no space left on device")
    run_case(case, out.parent, "dashboard --overwrite on a full disk")  # -o and the trace hash the same
    assert not _hidden(out)


_KILL_AT_RENAME = """
import os, signal, sys
import moetrace.atomic as atomic

class Os:
    def __getattr__(self, name):
        return getattr(os, name)

    def replace(self, a, b):
        os.kill(os.getpid(), signal.SIGKILL)

atomic.os = Os()
from moetrace.cli import main
sys.argv = ["moetrace", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_dashboard_overwrite_sigkilled_at_its_rename(reported):
    t, out, args = reported
    r = subprocess.run(
        [sys.executable, "-c", _KILL_AT_RENAME, *args], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert out.read_text() == OLD_REPORT  # byte for byte; the finished temporary waits hidden beside it
    assert len(_hidden(out)) == 1 and _hidden(out)[0].endswith(".tmp")
    # the next write of the same report removes the killed writer's temporary (its pid is gone)
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert _report(out) == "new" and _hidden(out) == []


# ============================================================ kill injection: compare --overwrite's folder swap
def _compare(t: Path, out: Path, batches: int, *extra: str) -> list[str]:
    return ["compare", str(t), *DEPLOY, "--strategies", "linear,eplb", "--no-oracle", "--batches", str(batches),
            "-q", "-o", str(out), *extra]  # fmt: skip


@pytest.fixture
def compared(tmp_path):
    t = trace_in(tmp_path)
    out = tmp_path / "c"
    r = runner.invoke(app, _compare(t, out, 2))
    assert r.exit_code == 0, r.output
    return t, out, tree_hashes(out)


def _is_new_compare(out: Path) -> bool:
    return json.loads((out / "compare.json").read_text())["num_batches"] == 3


def _beside(out: Path) -> list[str]:
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill, new", [(die_at_exchange, False), (die_at_rmtree, True)], ids=["at the exchange", "removing the old folder"]
)
def test_compare_overwrite_killed_at_each_step(compared, monkeypatch, kill, new):
    t, out, old = compared
    kill(monkeypatch)
    with pytest.raises(Killed):
        runner.invoke(app, _compare(t, out, 3, "--overwrite"), catch_exceptions=False)
    monkeypatch.undo()
    if new:
        assert _is_new_compare(out) and tree_hashes(out) != old
    else:
        assert tree_hashes(out) == old
    assert not _beside(out)


@pytest.mark.slow
@pytest.mark.parametrize("at", [1, 2])
def test_compare_overwrite_killed_at_each_rename_of_the_fallback(compared, monkeypatch, at):
    t, out, old = compared
    no_exchange(monkeypatch)
    monkeypatch.setattr(atomic, "os", DyingOs(at))
    with pytest.raises(Killed):
        runner.invoke(app, _compare(t, out, 3, "--overwrite"), catch_exceptions=False)
    monkeypatch.undo()
    atomic.recover_directory(out)  # what the next run does first
    assert tree_hashes(out) == old and not _beside(out)
    r = runner.invoke(app, _compare(t, out, 3, "--overwrite"))  # and the next run then replaces it
    assert r.exit_code == 0, r.output
    assert _is_new_compare(out) and not _beside(out)


@pytest.mark.parametrize("command", ["place", "compare"])
def test_memory_refusal_names_batches_only_where_the_command_has_them(tmp_path, monkeypatch, command):
    """The memory check before the counting pass: compare names --batches, place (which has none) only
    the memory to free."""
    import moetrace.sizes as sizes

    monkeypatch.setattr(sizes, "memory_available", lambda: 1)
    t = write_small_trace(tmp_path / "t", num_requests=8)
    args = [command, str(t), *DEPLOY, "-o", str(tmp_path / "out")]
    if command == "place":
        args += ["--strategy", "eplb"]
    r = runner.invoke(app, args)
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("Error:"))
    assert "free memory" in line
    assert ("--batches" in line) == (command == "compare"), line
