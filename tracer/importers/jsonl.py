"""Reading JSON-lines inputs, shared by the text formats: detection from the head, the UTF-8 check,
the line iterator, whole-number fields and the size limits.

A text format checks UTF-8 in its ``precheck`` (``check_utf8``), after detection and before the output is touched: detection
looks at bytes first, so a binary format is never turned away as "not UTF-8".

Out of scope: what a record means (each format's module), binary inputs, batching requests for the
writer (``driver``).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moetrace.errors import TraceFormatError

#: the most tokens one imported request may have, and the most bytes its rows may take: a short line
#: that claims a huge request is refused before anything is allocated
MAX_REQUEST_TOKENS = 1 << 20
MAX_REQUEST_BYTES = 1 << 29


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def first_line(head: bytes) -> tuple[int, bytes, bool]:
    """``(line number, bytes, complete)`` of the first line of ``head`` holding more than whitespace (the
    last line when none does); ``complete``: its newline is inside ``head``."""
    n, start = 1, 0
    while True:
        end = head.find(b"\n", start)
        line = head[start:] if end < 0 else head[start:end]
        if end < 0 or line.strip():
            return n, line, end >= 0
        n, start = n + 1, end + 1


def first_line_utf8_error(head: bytes, *, whole_file: bool) -> UnicodeDecodeError | None:
    """The error decoding the first non-blank line of ``head`` as UTF-8, None when it decodes. A character
    cut off where ``head`` ends is fine unless ``head`` is the ``whole_file``."""
    _, line, complete = first_line(head)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(line, final=complete or whole_file)
    except UnicodeDecodeError as exc:
        return exc
    return None


def looks_like_json_lines(head: bytes) -> bool:
    """Whether the first non-blank line of a file (from its first bytes ``head``) is UTF-8 text opening a
    JSON object or list. Later lines are not looked at: the reader's ``check_utf8`` names them."""
    _, line, _ = first_line(head)
    return line.lstrip()[:1] in (b"{", b"[") and first_line_utf8_error(head, whole_file=False) is None


def first_object(head: bytes, src: Path) -> dict[str, Any] | None:
    """For detection: the first record of a JSON-lines file (the first element when the line is a list),
    or None when ``src`` is not a file, does not look like JSON lines, its first record does not parse,
    or it is not an object. Reads only up to the end of the first non-blank line."""
    if not looks_like_json_lines(head) or not src.is_file():
        return None
    try:
        found = first_record(src)
    except TraceFormatError:
        return None
    if found is None:
        return None
    obj = found[1]
    first = obj[0] if isinstance(obj, list) and obj else obj
    return first if isinstance(first, dict) else None


def first_record(path: Path) -> tuple[int, Any] | None:
    """``(line number, record)`` of the first non-blank line, None when there is none; ``TraceFormatError``
    naming the line when it is not UTF-8 or not JSON."""
    for n, obj in iter_json_lines(path):
        return n, obj
    return None


def check_utf8(path: Path) -> None:
    """Raise ``TraceFormatError`` naming the line unless ``path`` is a file of UTF-8 text (streamed, bounded memory)."""
    if path.is_dir():
        raise TraceFormatError(f"{path}: a directory, not a JSON-lines file")
    dec = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            try:
                dec.decode(chunk)
            except UnicodeDecodeError as exc:
                at = line + chunk[: exc.start].count(b"\n")
                raise TraceFormatError(f"{path}:{at}: not UTF-8 text ({exc.reason}); save the file as UTF-8") from None
            line += chunk.count(b"\n")
        try:
            dec.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise TraceFormatError(f"{path}:{line}: not UTF-8 text ({exc.reason}); save the file as UTF-8") from None


def iter_json_lines(path: Path, consumed: list[int] | None = None) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` of each non-blank line; ``consumed[0]`` is kept at the bytes read so far."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if consumed is not None:
                consumed[0] += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(f"{path}:{n}: not UTF-8 text ({exc.reason}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line, parse_constant=_reject_constant)
            except RecursionError:
                raise TraceFormatError(f"{path}:{n}: JSON nested too deeply to be a record") from None
            except ValueError as exc:  # json.JSONDecodeError is a ValueError, as is NaN/Infinity
                raise TraceFormatError(f"{path}:{n}: not valid JSON ({exc})") from None
            yield n, obj


def whole(value: Any, name: str, *, low: int = 0, high: int = MAX_REQUEST_TOKENS) -> int:
    """``value`` as an int in ``low..high``: a JSON whole number, not a float, string or boolean."""
    # imported here: the schema loads pyarrow, and detection stays light
    from moetrace.tracer.trace.schema import is_whole

    if not is_whole(value) or not low <= value <= high:
        raise TraceFormatError(f"`{name}` must be a whole number in {low}..{high:,}, got {value!r}")
    return value
