"""The hostile-input harness the rounds of issue 38 share (tests/test_hostile_round3.py, ...round4.py,
...round5.py): a case is a command line built under a temp dir and the one error line it must print.

- ``DEPLOY``: the small deployment every case deploys on; ``Case``: a case;
- ``trace_in``: the small trace (8 requests) the cases read, at ``tmp / name``;
- ``under_alarm``: a SIGALRM after 60 s turns a hang (a pipe read blocked, work on a declared shape)
  into a failure;
- ``run_case``: the checks every hostile case must hold (exit code, no traceback, exactly one ``Error:``
  line matching its message, nothing under the case's folder changed);
- ``run_case_naming_own_options``: ``run_case``, then every ``--option`` the error line names is an
  option of the command (``command_options``).

A helper module, not a test module: test modules import from here (``from hostile import ...``), never
from each other.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import click
import typer
from factories import tree_hashes, write_small_trace
from typer.testing import CliRunner

from moetrace.cli import app

runner = CliRunner()
DEPLOY = ["--config", "DP2TP1EP2", "--gpus-per-node", "1"]


@dataclass(frozen=True)
class Case:
    build: Callable[[Path], list[str]]  # makes the inputs under a temp dir, returns the command line
    message: str  # regex the one error line must match
    exit_code: int = 2


def trace_in(tmp: Path, name: str = "t") -> Path:
    """The small trace of 8 requests at ``tmp / name``."""
    return write_small_trace(tmp / name, num_requests=8)


def alarm(*_args: object) -> None:
    """The SIGALRM handler of ``under_alarm``."""
    raise TimeoutError("the command ran past 60 s (a pipe read blocked, or work on a declared shape)")


@contextmanager
def under_alarm(seconds: int = 60) -> Iterator[None]:
    """Run the block with ``alarm`` set to fire after ``seconds``; the old handler is restored after."""
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_case(case: Case, tmp_path: Path, name: str) -> tuple[list[str], str]:
    """Run ``case`` through the CLI under a 60 s alarm and check what every hostile case must hold: its
    exit code, no traceback, exactly one error line matching its message, nothing under ``tmp_path``
    changed. Returns the command's arguments and its error line."""
    args = case.build(tmp_path)
    before = tree_hashes(tmp_path)
    with under_alarm(60):
        r = runner.invoke(app, args)
    out = r.output
    assert r.exit_code == case.exit_code, f"{name}: exit {r.exit_code}\n{out}"
    assert "Traceback" not in out and (r.exception is None or isinstance(r.exception, SystemExit)), f"{name}\n{out}"
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, f"{name}: expected one error line\n{out}"
    assert re.search(case.message, errors[0]), f"{name}: {errors[0]!r} does not match {case.message!r}"
    after = tree_hashes(tmp_path)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert not changed, f"{name}: changed {sorted(changed)}"
    return args, errors[0]


@cache
def command_options() -> dict[str, frozenset[str]]:
    """Every command's long option names, as its --help lists them."""
    group = typer.main.get_command(app)
    ctx = click.Context(group)
    out = {}
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        out[name] = frozenset(o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--"))
    return out


def run_case_naming_own_options(case: Case, tmp_path: Path, name: str) -> tuple[list[str], str]:
    """``run_case``, then: every ``--option`` the error line names is one of its command's (an option
    inside a quoted `moetrace ...` command, e.g. `moetrace collect --resume`, is that command's)."""
    args, error = run_case(case, tmp_path, name)
    own = re.sub(r"`moetrace [a-z-]+[^`]*`", "", error)
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", own))
    foreign = named - command_options()[args[0]]
    assert not foreign, f"{name}: `moetrace {args[0]}` has no {sorted(foreign)}: {error!r}"
    return args, error
