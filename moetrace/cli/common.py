"""Pieces shared by every CLI command: options defined once, clean domain errors, the one progress bar,
and the one rule for output paths (:func:`claim_output`).

Each command module registers its commands on the root app with ``register(app)``; a command is a
few lines over one library call.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import typer

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from moetrace.results import ResultKind

from moetrace.environ import environ
from moetrace.errors import MoetraceError, OutputExistsError, TraceValidationError, for_command, option_hint
from moetrace.sizes import human_bytes  # noqa: F401  (re-exported for the command modules)

F = TypeVar("F", bound=Callable)

# ---- options shared by several commands (defined once) -------------------------------------
TraceArg = Annotated[
    Path, typer.Argument(help="Trace directory (manifest.json, requests/, routing/).", show_default=False)
]
OutDir = Annotated[Path, typer.Option("--out", "-o", help="Output directory.", show_default=False)]
#: the largest seed every generator moetrace seeds takes (numpy's legacy and torch's: 2**32 - 1)
MAX_SEED = 2**32 - 1


def _check_seed(value: int) -> int:
    """The ``--seed`` of every command: 0 .. MAX_SEED, else one error line and exit 2 (before any work)."""
    if not 0 <= value <= MAX_SEED:
        err(f"--seed must be a whole number from 0 to {MAX_SEED}, got {value}")
        raise typer.Exit(2)
    return value


Seed = Annotated[
    int, typer.Option(help="Random seed (0 to 2**32-1); the same seed gives the same result.", callback=_check_seed)
]
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Model preset (see `moetrace models`), a local checkpoint directory, or a hub id.",
    ),
]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace what is already at -o (refused otherwise).")]
AllowIncomplete = Annotated[
    bool,
    typer.Option("--allow-incomplete", help="Read a trace whose collection has not finished (committed parts only)."),
]
Quiet = Annotated[
    bool,
    typer.Option(
        "--quiet", "-q", help="No progress bar and no step log lines on stderr (errors and the result still print)."
    ),
]
ModelConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--model-config",
        help="The served model's HF config.json (or its checkpoint directory): the experts' size "
        "(moe_intermediate_size, shared experts, quantization), over what the trace's model records.",
        show_default=False,
    ),
]


#: the largest --model-config file read (an HF config.json is a few KiB)
MAX_CONFIG_BYTES = 16 << 20


def read_model_config(path: Path | None) -> dict[str, Any] | None:
    """The ``--model-config`` file parsed (a JSON object; a directory: its ``config.json``), None without
    one; ``ConfigError`` naming the file and what is wrong with it (missing, unreadable, not JSON, not an object)."""
    from moetrace.errors import ConfigError
    from moetrace.inputs import read_input_json

    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model-config {path}: a directory without config.json; pass the model's config.json")
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"--model-config {path}: no such file (pass the model's config.json)")
    # a regular file only (a pipe never blocks), UTF-8 JSON of bounded size and bounded integers
    cfg = read_input_json(path, what=f"--model-config {path}", max_bytes=MAX_CONFIG_BYTES, error=ConfigError)
    if not isinstance(cfg, dict):
        raise ConfigError(f"--model-config {path}: an HF config.json is a JSON object, got {type(cfg).__name__}")
    return cfg


def err(message: str) -> None:
    """Print a one-line error (or several) to stderr in the CLI's style."""
    typer.secho(f"Error: {message}", fg=typer.colors.RED, err=True)


def friendly_errors(fn: F) -> F:
    """Turn moetrace's domain errors into a message and exit code 2 instead of a traceback; refuse integer
    options of 2**63 or more in magnitude first (``moetrace.inputs.check_int_options``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from moetrace.inputs import check_int_options

        try:
            check_int_options(kwargs)  # --window-tokens 2**63 and the like: one line, before any work
            return fn(*args, **kwargs)
        except TraceValidationError as exc:
            err(f"{len(exc.problems)} problem(s) found:")
            for p in exc.problems:
                typer.echo(f"  - {for_command(p, _command_options(kwargs))}", err=True)
            raise typer.Exit(1) from None
        except MoetraceError as exc:
            err(for_command(str(exc), _command_options(kwargs)))  # no hint naming an option this command lacks
            raise typer.Exit(2) from None
        except OSError as exc:  # a path that cannot be read or written: say which, no traceback
            err(for_command(_describe_os_error(exc), _command_options(kwargs)))
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err(for_command("interrupted; committed work is kept" + _RERUN_WITH_RESUME, _command_options(kwargs)))
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _command_options(kwargs: dict[str, object]) -> set[str]:
    """The long options of the command running (``moetrace.errors.for_command``): its click command's where
    click has one current, else its keyword arguments' names (``allow_incomplete`` -> ``--allow-incomplete``)."""
    import click

    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        return {o for p in ctx.command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
    return {"--" + name.replace("_", "-") for name in kwargs}


#: dropped from the messages of a command without --resume (``moetrace.errors.option_hint``)
_WITH_RESUME = option_hint("--resume", " (with --resume)")
_RERUN_WITH_RESUME = option_hint("--resume", " (re-run with --resume)")


def _describe_os_error(exc: OSError) -> str:
    cause = (exc.strerror or str(exc)).rstrip(".")
    where = f": {exc.filename}" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{cause.lower()}{where}; free space, then run the command again{_WITH_RESUME}"
    return f"{cause}{where}"


# ---- the one rule for every output path ----------------------------------------------------------
#: what a command writes at -o: ``file`` (one file: export, place, dashboard), ``results`` (a results
#: folder: analyze, compare, a2a), ``directory`` (a directory replaced whole: make-checkpoint),
#: ``trace`` (a trace directory, by its writer: collect, import, synth)
OutputKind = Literal["file", "results", "directory", "trace"]


def _refuse_input_overlap(p: Path, inputs: Sequence[str | os.PathLike], command: str) -> None:
    """Refuse an -o equal to, inside or containing one of the command's inputs (whatever --overwrite says)."""
    out = Path(os.path.realpath(p))
    for i in inputs:
        src = Path(os.path.realpath(i))
        if out == src:
            how = "is"
        elif out.is_relative_to(src):
            how = "is inside"
        elif src.is_relative_to(out):
            how = "contains"
        else:
            continue
        raise OutputExistsError(
            f"-o {p} {how} the input {i} of `{command}`; a command never writes over its own input, "
            "--overwrite or not: choose another -o"
        )


def _refuse_foreign_output(p: Path, kind: OutputKind, result: ResultKind | None, command: str) -> None:
    """Refuse replacing what another kind of command wrote (``--overwrite`` replaces only one's own kind):
    a trace or another kind's results folder at a results -o, a results folder at a trace -o, a trace's or
    a results folder's file (or another kind's moetrace JSON) at a file -o."""
    from moetrace.results import TRACE_KIND, describe_foreign
    from moetrace.tracer.trace.layout import is_trace_directory

    def refuse(what: str) -> None:
        raise OutputExistsError(
            f"-o {p} holds {what}; `{command} --overwrite` replaces only its own output: choose another -o "
            "(or remove it yourself)"
        )

    if kind != "file" and p.is_dir():
        if is_trace_directory(p):
            if kind != "trace":
                refuse("a trace")
            return  # a trace's writer replaces a trace, even a damaged one
        own = TRACE_KIND if kind == "trace" else result
        other = describe_foreign(p, own)
        if other is not None:
            refuse(other)
    elif kind == "file" and p.is_file():
        for d in p.parents:
            if is_trace_directory(d):
                refuse(f"a file of the trace {d}")
        if describe_foreign(p.parent, None) is not None:
            refuse(f"a file of the results folder {p.parent}")
        other = describe_foreign(p, result)
        if other is not None:
            refuse(other)


def _owned_directory(start: Path) -> tuple[Path, bool] | None:
    """The nearest directory at or above ``start`` that a writer owns: ``(dir, True)`` for a trace
    directory, ``(dir, False)`` for a results folder with a writer lock; None when there is none."""
    from moetrace.tracer.trace.layout import is_trace_directory
    from moetrace.tracer.trace.lock import TRACE_LOCK

    for d in (start, *start.parents):
        if is_trace_directory(d):
            return d, True
        if os.path.lexists(d / TRACE_LOCK):
            return d, False
    return None


@contextlib.contextmanager
def claim_output(
    path: Path | None,
    *,
    kind: OutputKind,
    overwrite: bool,
    command: str,
    result: ResultKind | None = None,
    shard: bool = False,
    inputs: Sequence[str | os.PathLike] = (),
) -> Iterator[Path | None]:
    """Check that ``command`` may write ``path`` (its -o) and hold what keeps others out while it does.

    The one rule, before any work:

    - a symbolic link at ``path`` is refused (no write ever follows one), and so is what is not of
      ``kind`` (a file output that is a directory, a device node or a pipe; a directory output that is a file);
    - ``path`` inside a trace directory (or ``path`` holding one, except for ``kind="trace"``, whose
      writer decides) is refused without ``overwrite``, and always while that trace's writer lock is
      held; with ``overwrite`` the trace's lock is held for the block, so no collector starts under it;
    - an existing file, a non-empty directory, or results of ``result`` (a ``moetrace.results`` kind)
      are refused without ``overwrite``;
    - a results folder is locked for the block (``lock.lock_results``): two runs never mix their files;
      a trace output's lock is probed now (``collect`` then loads no model for a trace being written).

    - ``path`` equal to, inside or containing one of ``inputs`` (the command's input files and
      folders) is refused whatever ``overwrite`` says;
    - with ``overwrite``, only an output of the command's own kind is replaced: a trace or another
      kind's results folder at a results ``path``, results at a trace ``path``, a file of a trace or
      of a results folder (or another kind's moetrace JSON) at a file ``path`` are refused;

    Yields ``path``; ``path=None`` (a command writing nothing) checks nothing. A results folder this
    created and left holding nothing but its lock is removed again. Raises ``OutputExistsError`` /
    ``TraceBusyError`` with one line naming the fix.
    """
    from moetrace.atomic import check_regular_target, recover_directory
    from moetrace.results import check_output
    from moetrace.tracer.trace.lock import TRACE_LOCK, WriterLock, lock_results, lock_trace, probe_lock

    if path is None:
        yield None
        return
    p = Path(path)
    if kind != "file":
        recover_directory(p)  # a folder swap killed between its two renames (no exchange here): the old one back
    st = os.lstat(p) if os.path.lexists(p) else None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise OutputExistsError(f"{p} is a symbolic link; moetrace never writes through one: choose another -o")
    _refuse_input_overlap(p, inputs, command)  # first: no --overwrite and no kind changes it
    if kind == "file":
        check_regular_target(p)
    elif st is not None and not stat.S_ISDIR(st.st_mode):
        raise OutputExistsError(f"{p} exists and is not a directory; -o of `{command}` names a directory")
    here = Path(os.path.abspath(p))
    start = here.parent if kind in ("file", "trace") else here
    owner = _owned_directory(start)
    held: list[WriterLock] = []
    try:
        if owner is not None:
            d, is_trace = owner
            if is_trace and not overwrite:
                where = "holds a trace" if d == here else f"is inside the trace {d}"
                fix = (
                    "Choose another -o" if d == here else "Choose another -o, or pass --overwrite to write there anyway"
                )
                raise OutputExistsError(
                    f"{p} {where}; only the trace's own writer (collect, import, synth) writes there. {fix}"
                )
            probe_lock(d)
            if is_trace and d != here:
                held.append(lock_trace(d))
        if st is not None:  # after the lock probe: a running writer is named first
            _refuse_foreign_output(p, kind, result, command)
        if result is not None:  # first: its message names what is there
            check_output(p, result, overwrite=overwrite)
        if kind == "file" and st is not None and not overwrite:
            raise OutputExistsError(f"{p} already exists; choose another -o, or pass --overwrite to replace it")
        if kind == "directory" and st is not None and any(p.iterdir()) and not overwrite:
            raise OutputExistsError(f"{p} is not empty; pass --overwrite to replace it, or choose another -o")
        if kind == "results":
            held.append(lock_results(p, what=command))
        elif kind == "directory" and owner is not None and owner[0] == here and owner[1]:
            held.append(lock_trace(p))  # a trace replaced whole: no collector starts in it meanwhile
        elif kind == "trace":
            probe_lock(p, shared=shard)
        if kind == "file" and not p.parent.is_dir():
            p.parent.mkdir(parents=True, exist_ok=True)
        yield p
    finally:
        for lock in reversed(held):
            lock.release()
        if kind == "results" and st is None and p.is_dir() and [f.name for f in p.iterdir()] == [TRACE_LOCK]:
            (p / TRACE_LOCK).unlink()  # the run failed before writing anything: leave no empty folder
            p.rmdir()


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()


def show_progress(quiet: bool = False, *, tty: bool | None = None) -> bool:
    """The one decision for every command: draw progress bars only on a terminal (stderr) and not under ``--quiet``.

    ``tty`` overrides the check of stderr (tests).
    """
    if quiet:
        return False
    return stderr_is_tty() if tty is None else tty


def _rich_bar(label: str, unit: str) -> Progress:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )


class ProgressBar:
    """A ``progress(done, total)`` callback for the library that draws done/total, rate and time left (rich, stderr).

    Draws only when :func:`show_progress` says so; starts on the first call, clears itself when the
    work is done (``done >= total``) so that later lines print cleanly. Use through :func:`progress_bar`.
    """

    def __init__(self, label: str, unit: str, *, quiet: bool = False) -> None:
        self._label, self._unit = label, unit
        self.enabled = show_progress(quiet)
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            self._bar = _rich_bar(self._label, self._unit)
            self._task = self._bar.add_task(self._label, total=max(total, 1), rate="")
            self._bar.start()
        assert self._task is not None  # added together with the bar
        elapsed = self._bar.tasks[self._task].elapsed or 1e-9
        self._bar.update(self._task, completed=done, total=max(total, 1), rate=f"{done / elapsed:,.0f} {self._unit}/s")
        if done >= total:
            self.stop()

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextlib.contextmanager
def progress_bar(label: str, unit: str, *, quiet: bool = False) -> Iterator[ProgressBar]:
    """A :class:`ProgressBar` that is stopped (and cleared) however the block is left."""
    bar = ProgressBar(label, unit, quiet=quiet)
    try:
        yield bar
    finally:
        bar.stop()


#: what silences other libraries' tqdm bars: huggingface_hub's (and transformers', which follows it), and
#: tqdm's own default (read when tqdm is imported: engine subprocesses, Ray workers)
_QUIET_BARS_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


@contextlib.contextmanager
def third_party_bars(enabled: bool) -> Iterator[None]:
    """Leave third-party progress bars (transformers, huggingface_hub, tqdm in engine processes) as they
    are when ``enabled``; else silence them for the block: the environment variables they read (so
    processes started in it inherit them) and, for libraries this process already imported, their
    switches. Everything is restored on leaving. Pass ``show_progress(quiet)``: silent under ``--quiet``
    and when stderr is not a terminal, as moetrace's own bars."""
    if enabled:
        yield
        return
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None and hub.are_progress_bars_disabled():
        hub = None  # already off: nothing to turn back on
    with environ(_QUIET_BARS_ENV):
        if hub is not None:
            hub.disable_progress_bars()
        try:
            yield
        finally:
            if hub is not None:
                hub.enable_progress_bars()


def log_lines(quiet: bool = False) -> Callable[[str], None]:
    """Where a command's per-step log lines go: stderr, or nowhere under ``--quiet``."""
    if quiet:
        return lambda _msg: None
    return lambda msg: typer.echo(msg, err=True)


class RequestProgress:
    """The one progress bar of the CLI: requests done of a total, tokens/s, time left (rich, on stderr).

    Draws nothing when stderr is not a terminal or under ``--quiet`` (:func:`show_progress`).
    Pass :meth:`start` and :meth:`update` to the library
    as its ``on_start``/``on_progress`` callbacks; use it through :func:`request_progress`.
    """

    def __init__(self, label: str, *, quiet: bool = False) -> None:
        self._label = label
        self.enabled = show_progress(quiet)
        self._bar: Progress | None = None  # rich Progress, once started on a terminal
        self._task: TaskID | None = None
        self._done_before = 0  # requests already done when the run started (resume)

    def start(self, pending: int, total: int) -> None:
        """The work is known: ``total`` requests, ``pending`` of them still to run."""
        if not self.enabled:
            return
        self._done_before = total - pending
        self._bar = _rich_bar(self._label, "requests")
        self._task = self._bar.add_task(self._label, total=total, completed=self._done_before, rate="")
        self._bar.start()

    def update(self, requests: int, tokens: int) -> None:
        """What this run has done so far (cumulative requests and tokens)."""
        if self._bar is None or self._task is None:
            return
        elapsed = self._bar.tasks[self._task].elapsed or 1e-9
        self._bar.update(self._task, completed=self._done_before + requests, rate=f"{tokens / elapsed:,.0f} tok/s")

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextlib.contextmanager
def request_progress(label: str, *, quiet: bool = False) -> Iterator[RequestProgress]:
    """A :class:`RequestProgress` that is stopped (and cleared) however the block is left."""
    bar = RequestProgress(label, quiet=quiet)
    try:
        yield bar
    finally:
        bar.stop()
