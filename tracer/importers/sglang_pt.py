"""What SGLang's expert-distribution recorder dumps share, whatever their mode: the ``.pt`` files
(``torch.save`` of ``{"records": [...], "last_physical_to_logical_map": ...}``, one per rank, named
``expert_distribution_recorder_*.pt``), how detection peeks at their pickle, how they are loaded
(``torch.load(weights_only=True)`` only, sizes checked against the memory budget first, and each
tensor's declared shape before it is converted: ``check_tensor``) and how a
record's integer fields are read. Read from ``python/sglang/srt/eplb/expert_distribution.py``
(sgl-project/sglang, commit 02295fe5ac5c).

Used by ``sglang_dump`` (``per_token``: a trace) and ``sglang_pass`` (``per_pass``: a load profile).

Out of scope: what a record of one mode holds (those modules).
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any

from moetrace._deps import require
from moetrace.errors import TraceFormatError
from moetrace.tracer.importers.options import ImportOptions, check_allocation, check_declared_shape

__all__ = [
    "DUMP_NAME",
    "DETECT_BYTES",
    "check_declared_bytes",
    "check_tensor",
    "dump_files",
    "load_dump",
    "pickle_head",
    "record_int",
]

#: the dump files a directory holds
DUMP_NAME = re.compile(r"^expert_distribution_recorder_.*\.pt$")
#: bytes of the pickle detection reads
DETECT_BYTES = 1 << 16


def pickle_head(src: Path) -> bytes:
    """The first ``DETECT_BYTES`` of the ``data.pkl`` inside a torch zip ``src``; ``b""`` when it is not one."""
    try:
        with zipfile.ZipFile(src) as z:
            names = [n for n in z.namelist() if n.endswith("data.pkl")]
            if not names:
                return b""
            with z.open(names[0]) as f:
                return f.read(DETECT_BYTES)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError, NotImplementedError):
        return b""  # not a zip torch could have written: another format's input


def dump_files(src: Path) -> list[Path]:
    """The dump files of ``src``: the ``expert_distribution_recorder_*.pt`` of a directory, or ``src``."""
    if src.is_dir():
        return sorted(p for p in src.iterdir() if DUMP_NAME.match(p.name) and p.is_file())
    return [src]


def check_declared_bytes(path: Path, options: ImportOptions | None) -> None:
    """Refuse, before ``torch.load``, a ``.pt`` whose zip declares more bytes than the memory budget (twice
    what it declares: the loaded tensors and their conversion); ``path`` must be a regular file."""
    from moetrace.inputs import check_regular_input

    check_regular_input(path, what=path.name)  # a pipe or device is never opened
    try:
        with zipfile.ZipFile(path) as z:
            declared = sum(i.file_size for i in z.infolist())
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise TraceFormatError(f"{path.name}: not a torch .pt file ({exc})") from None
    check_allocation(2 * declared, f"{path.name} declares {declared:,} bytes of tensors", options=options)


def check_tensor(t: Any, where: str, options: ImportOptions | None, *, copies: int = 1) -> None:
    """Refuse a loaded tensor whose declared shape, read as ``copies`` int64 arrays, is over the budget
    (``options.check_declared_shape``: ``torch.save`` keeps views, so the shape may be far larger than the
    file); anything that is not a tensor is left to the caller's own check."""
    shape = getattr(t, "shape", None)
    if shape is not None and hasattr(t, "numel"):
        check_declared_shape(tuple(shape), where, options=options, copies=copies)


def load_dump(path: Path, options: ImportOptions, *, mode: str) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of one dump, its declared sizes checked against the budget first;
    ``mode`` (``per_token``, ``per_pass``) names what was expected in the refusal of anything else."""
    torch = require("torch", purpose="reading SGLang's .pt dumps")
    check_declared_bytes(path, options)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged or hostile file makes the unpickler raise anything; said, never a traceback
        raise TraceFormatError(
            f"{path.name}: cannot be read as a torch dump with weights_only=True ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''})"
        ) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("records"), list):
        raise TraceFormatError(
            f"{path.name}: not an expert-distribution {mode} dump (a dict with `records`); got "
            f"{sorted(map(str, obj))[:6] if isinstance(obj, dict) else type(obj).__name__}"
        )
    return obj


def record_int(rec: dict[str, Any], key: str, where: str, *, nonnegative: bool = False) -> int:
    """Integer field ``key`` of record ``rec`` (``nonnegative``: >= 0), or a ``TraceFormatError`` at ``where``."""
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or (nonnegative and v < 0):
        what = "a whole number >= 0" if nonnegative else "an integer"
        raise TraceFormatError(f"{where}: `{key}` must be {what}, got {type(v).__name__}")
    return v
