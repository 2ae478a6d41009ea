"""Where the parts of a trace directory live (trace format v1), and reading its manifest.

A trace directory::

    manifest.json                 the manifest (docs/trace-format.md); ``complete: true`` once finished
    requests/<prefix>-NNNNNN.parquet   one row per request of a committed part
    routing/<prefix>-NNNNNN.parquet    one row per token of the same part
    manifests/shard-SSS.json      only in sharded collections: one manifest per shard

A part is committed when its requests file exists under its final name; temporary files start with
a dot and end in ``.tmp``. These names are owned here; writer, reader, validator and merge use them.

Out of scope: the columns (``schema``), writing (``writer``), reading rows (``reader``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from moetrace.errors import TraceFormatError
from moetrace.inputs import loads_json, read_input_text

MANIFEST = "manifest.json"
ROUTING_DIR = "routing"
REQUESTS_DIR = "requests"
MANIFESTS_DIR = "manifests"
#: a committed part's file name: ``<prefix>-<6-digit sequence>.parquet``
PART_RE = re.compile(r"^(?P<prefix>[A-Za-z0-9_]+)-(?P<seq>\d{6})\.parquet$")
SHARD_MANIFEST_RE = re.compile(r"^shard-(\d{3,})\.json$")


def part_name(prefix: str, seq: int) -> str:
    """File name of part ``seq`` of writer ``prefix`` (same name under ``routing/`` and ``requests/``)."""
    return f"{prefix}-{seq:06d}.parquet"


def shard_prefix(shard: int) -> str:
    """Part-file prefix of shard ``shard`` (``shard003``)."""
    return f"shard{shard:03d}"


def lock_name(manifest_name: str) -> str | None:
    """The writer lock beside a shard's manifest (``manifests/.shard-003.lock``); None for the
    trace's own ``manifest.json`` (whole-trace writers lock ``.writer.lock``, see ``lock``)."""
    if manifest_name == MANIFEST:
        return None
    m = Path(manifest_name)
    return str(m.with_name(f".{m.stem}.lock"))


def shard_manifest_name(shard: int) -> str:
    """Manifest path of shard ``shard`` inside the trace directory (``manifests/shard-003.json``)."""
    return f"{MANIFESTS_DIR}/shard-{shard:03d}.json"


#: how much of a manifest :func:`is_trace_directory` reads to find its format
_HEAD_BYTES = 4096
#: the largest manifest.json read (a part list of a million parts is about 200 MiB)
MAX_MANIFEST_BYTES = 1 << 30
_TRACE_FORMAT_RE = re.compile(rb'"format"\s*:\s*"moetrace\.trace"')


def is_trace_directory(path: str | os.PathLike) -> bool:
    """True when directory ``path`` holds a trace (or the start of one): a ``manifest.json`` whose
    format is ``moetrace.trace``, or both ``routing/`` and ``requests/``. Reads at most 4 KiB;
    follows no symbolic link to a manifest."""
    p = Path(path)
    if (p / ROUTING_DIR).is_dir() and (p / REQUESTS_DIR).is_dir():
        return True
    m = p / MANIFEST
    if m.is_symlink() or not m.is_file():
        return False
    try:
        with open(m, "rb") as f:
            head = f.read(_HEAD_BYTES)
    except OSError:
        return False
    return _TRACE_FORMAT_RE.search(head) is not None


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Read ``manifest.json`` of the trace directory ``path``."""
    mpath = Path(path) / MANIFEST
    if Path(path).is_file():
        raise TraceFormatError(f"{path} is a file; a trace is a directory (manifest.json, requests/, routing/)")
    if not Path(path).is_dir():
        raise TraceFormatError(f"{path}: no such trace directory")
    if not os.path.lexists(mpath):
        raise TraceFormatError(f"{path}: no {MANIFEST}; not a moetrace trace directory")
    # a regular file only (a named pipe never blocks), bounded size, bounded integers
    text = read_input_text(mpath, max_bytes=MAX_MANIFEST_BYTES)
    manifest = loads_json(text, where=str(mpath))
    if not isinstance(manifest, dict):
        raise TraceFormatError(f"{mpath}: expected a JSON object")
    return manifest
