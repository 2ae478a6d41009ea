"""Recognise what each dashboard input directory is, by its manifest file.

A directory is one of:

- a **trace** (``manifest.json`` with ``format: "moetrace.trace"``, SPEC §2);
- an **analysis** result (written by ``moetrace analyze``);
- a **placement** result (written by ``moetrace compare``: ``compare.json`` beside ``layers.parquet``,
  ``batches.parquet``, ``summary.parquet``, ``placements.parquet``).

Anything else is an error that names the directory and what was expected, so a typo in a path
never yields a silently empty report.

Out of scope: reading the results themselves (``section_*``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from moetrace.errors import TraceFormatError

InputKind = Literal["trace", "analysis", "placement"]

#: (manifest file name, value of its ``format`` key, kind, keys it must have); the first match wins.
#: ``compare.json`` carries no ``format`` key (as of this writing), so it is known by its keys.
MANIFESTS: tuple[tuple[str, str | None, InputKind, tuple[str, ...]], ...] = (
    ("manifest.json", "moetrace.trace", "trace", ()),
    ("manifest.json", "moetrace.analysis", "analysis", ()),
    ("compare.json", "moetrace.compare", "placement", ()),
    ("compare.json", None, "placement", ("strategies", "reference", "num_ep")),
)


@dataclass(frozen=True, kw_only=True)
class Input:
    """One recognised input directory."""

    kind: InputKind  # what it holds
    path: Path  # the directory
    manifest: dict[str, Any]  # its manifest, parsed


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def detect(path: str | Path) -> Input:
    """Classify ``path`` by the manifest it holds; raise ``TraceFormatError`` if it is none of them."""
    p = Path(path)
    if not p.is_dir():
        raise TraceFormatError(
            f"{p}: {'not a directory' if p.exists() else 'no such directory'}. Pass trace directories and the output directories of "
            "`moetrace analyze` / `moetrace compare`."
        )
    seen: list[str] = []
    for name, fmt, kind, keys in MANIFESTS:
        f = p / name
        if not f.exists():
            continue
        manifest = _read_json(f)
        note = f"{name} (format {manifest.get('format')!r})" if manifest else f"{name} (unreadable)"
        if note not in seen:
            seen.append(note)
        if manifest is None:
            continue
        if (fmt is not None and manifest.get("format") == fmt) or (fmt is None and all(k in manifest for k in keys)):
            return Input(kind=kind, path=p, manifest=manifest)
    expected = ", ".join(sorted({f"{n} with format {f!r}" for n, f, _, _ in MANIFESTS if f}))
    found = f"; found {', '.join(seen)}" if seen else ""
    raise TraceFormatError(
        f"{p}: not a trace, analysis or placement result directory (expected {expected}, or a compare.json{found}). "
        "Pass the directory given to -o of `moetrace analyze` or `moetrace compare`, or a trace directory."
    )
