"""Reading inputs so that no input can hang, exhaust or crash a command: the one helper per concern.

- :func:`open_input`: every file moetrace reads as an input is opened through it. Only a regular file
  is read: the path is checked with ``stat`` before it is opened (a device is never opened), opened
  with ``O_NONBLOCK`` (a named pipe swapped in meanwhile opens at once instead of waiting for a
  writer) and checked again with ``fstat`` on what was opened; a named pipe, a device, a socket or a
  directory is refused with one line. ``max_bytes`` bounds what is read.
- :func:`loads_json`: every JSON document an input holds is parsed through it: integers of more than
  4,300 digits (where Python's ``int`` gives up), nesting deeper than Python parses, and malformed
  text are refused with one line naming the file; each reader then bounds its fields by name.
- :func:`check_int_options`: the integer options of every command (``friendly_errors`` calls it) are
  refused at ``2**63`` or more in magnitude, before any work (typer itself refuses an ``int`` option
  written with other than ASCII digits).
- :func:`option_int`: a whole number written inside a text option (``--route-on first-decode:N``,
  ``--config DP8TP8EP64``): ASCII digits only (Python's ``int`` also takes ``'٣'`` and ``'３'``, and
  fails on ``'²'`` with a bare ``ValueError``), at most 19 of them, within the option's range.

Errors are ``moetrace.errors`` classes (``TraceFormatError`` by default), so the CLI prints one line.

Out of scope: what the file must hold (each reader's own checks), outputs (``moetrace.atomic``).
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from collections.abc import Mapping
from typing import Any, BinaryIO

from moetrace.errors import ConfigError, MoetraceError, TraceFormatError

#: the most digits a JSON integer may have (Python's own limit for converting text; each reader then
#: bounds its fields: counts within 2**20, sizes within 2**63, with the field named)
MAX_INT_DIGITS = 4300
#: integers read from inputs and options lie in -2**63 .. 2**63-1
INT_LIMIT = 1 << 63


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_regular_input(
    path: str | os.PathLike, *, what: str = "", error: type[MoetraceError] = TraceFormatError
) -> None:
    """Raise ``error`` unless ``path`` is a regular file (a symbolic link to one is fine)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise error(f"{what or path}: no such file") from None
    if not stat.S_ISREG(mode):
        raise error(f"{what or path} is {_kind(mode)}; moetrace reads inputs from regular files only")


def open_input(path: str | os.PathLike, *, what: str = "", error: type[MoetraceError] = TraceFormatError) -> BinaryIO:
    """Open the regular file ``path`` for reading (binary), never blocking and never reading a pipe or
    device (module docstring). ``what`` names the input in messages (default: the path)."""
    check_regular_input(path, what=what, error=error)  # before open: a device is never opened
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped between the stat and the open
            raise error(f"{what or path} is {_kind(mode)}; moetrace reads inputs from regular files only")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_input_bytes(
    path: str | os.PathLike,
    *,
    what: str = "",
    max_bytes: int | None = None,
    error: type[MoetraceError] = TraceFormatError,
) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_input`), refused when larger than ``max_bytes``."""
    with open_input(path, what=what, error=error) as f:
        if max_bytes is not None:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise error(f"{what or path}: {size:,} bytes, more than the {max_bytes:,} such a file may hold")
            # read what fstat says (a read of max_bytes would allocate that whole buffer first), then
            # whatever the file grew by meanwhile, up to one byte past the bound
            data = f.read(size + 1)
            if len(data) > size:
                data += f.read(max_bytes + 1 - len(data))
            if len(data) > max_bytes:  # grew while read
                raise error(f"{what or path}: more than the {max_bytes:,} bytes such a file may hold")
            return data
        return f.read()


def read_input_text(
    path: str | os.PathLike,
    *,
    what: str = "",
    max_bytes: int | None = None,
    error: type[MoetraceError] = TraceFormatError,
) -> str:
    """The UTF-8 text of the regular file ``path``; non-UTF-8 bytes are refused with one line."""
    data = read_input_bytes(path, what=what, max_bytes=max_bytes, error=error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what or path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def loads_json(text: str | bytes, *, where: str, error: type[MoetraceError] = TraceFormatError) -> Any:
    """``json.loads(text)`` with every integer bounded (module docstring); ``error`` naming ``where`` else."""

    def bounded_int(s: str) -> int:
        digits = len(s) - s.startswith("-")
        if digits > MAX_INT_DIGITS:  # int() itself would raise a bare ValueError
            raise error(f"{where}: an integer of {digits:,} digits; no number moetrace reads has more than 19")
        return int(s)

    try:
        return json.loads(text, parse_int=bounded_int)
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON ({str(exc)[:200]})") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply to be a moetrace input") from None


def read_input_json(
    path: str | os.PathLike,
    *,
    what: str = "",
    max_bytes: int | None = None,
    error: type[MoetraceError] = TraceFormatError,
) -> Any:
    """The JSON document of the regular file ``path``: :func:`read_input_text`, then :func:`loads_json`."""
    text = read_input_text(path, what=what, max_bytes=max_bytes, error=error)
    return loads_json(text, where=what or str(path), error=error)


def check_int_options(values: Mapping[str, object]) -> None:
    """Refuse (``ConfigError``) an integer option of ``2**63`` or more in magnitude, naming the option
    (``values``: a command's keyword arguments; booleans and other types are left alone)."""
    for name, v in values.items():
        items = v if isinstance(v, (list, tuple)) else (v,)
        for x in items:
            if isinstance(x, int) and not isinstance(x, bool) and not -INT_LIMIT < x < INT_LIMIT:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be below 2**63 in magnitude, got a {len(str(abs(x)))}-digit number"
                )


def option_int(text: str, *, option: str, low: int = 0, high: int = INT_LIMIT - 1, form: str = "") -> int:
    """The whole number ``text`` of a text option, ASCII digits only, in ``low..high``; ``ConfigError`` naming
    ``option`` (as the user wrote it, e.g. ``--route-on first-decode:N``) and ``form`` (what to write) else."""
    t = text.strip()
    if not (t.isascii() and t.isdigit()):
        what = "a whole number written with the digits 0-9" if not t.isascii() else "a whole number"
        raise ConfigError(f"{option}: {text[:40]!r} is not {what}{f'; write {form}' if form else ''}")
    if len(t.lstrip("0")) > 19 or not low <= int(t) <= high:
        raise ConfigError(f"{option}: {t[:24]}{'...' if len(t) > 24 else ''} is outside {low:,}..{high:,}")
    return int(t)


__all__ = [
    "MAX_INT_DIGITS",
    "check_int_options",
    "option_int",
    "check_regular_input",
    "loads_json",
    "open_input",
    "read_input_bytes",
    "read_input_json",
    "read_input_text",
]
