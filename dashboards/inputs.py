"""Recognise what each dashboard input directory is, by the ``format`` of its manifest only.

A directory is one of:

- a **trace** (``manifest.json`` with ``format: "moetrace.trace"``, docs/trace-format.md);
- an **analysis** result (``manifest.json`` with ``format: "moetrace.analysis"``, written by
  ``moetrace analyze``);
- a **placement** result (``compare.json`` with ``format: "moetrace.compare"``, written by
  ``moetrace compare``);
- an **a2a** result (``a2a.json`` with ``format: "moetrace.a2a"``, written by ``moetrace a2a``);
- an **advice** result (``advice.json`` with ``format: "moetrace.advice"``, written by ``moetrace advise``).

Result manifests are read and checked by ``moetrace.results.read_result_manifest`` (format name and
version; a ``compare.json`` without a format was written by an older moetrace and says so); a
``compare.json`` is then read into its typed record (``placement.compare_manifest.CompareManifest``),
an ``a2a.json`` or ``advice.json`` into theirs (``records``).
Anything else is an error that names the directory and what was expected, so a typo in a path
never yields a silently empty report.

Out of scope: reading the results themselves (``section_*``); the file names and formats
(``moetrace.results``, ``moetrace.tracer.trace``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from moetrace.dashboards.records import A2AManifest, AdviceManifest
from moetrace.errors import TraceFormatError
from moetrace.placement.compare_manifest import CompareManifest
from moetrace.results import A2A, ADVICE, ANALYSIS, COMPARE, KINDS, read_result_manifest
from moetrace.tracer.trace.layout import MANIFEST as TRACE_MANIFEST
from moetrace.tracer.trace.schema import FORMAT as TRACE_FORMAT

InputKind = Literal["trace", "analysis", "placement", "a2a", "advice"]

#: result kind (moetrace.results) -> the input kind the dashboard draws it as
DRAWN: dict[str, InputKind] = {
    ANALYSIS.name: "analysis",
    COMPARE.name: "placement",
    A2A.name: "a2a",
    ADVICE.name: "advice",
}


@dataclass(frozen=True, kw_only=True)
class Input:
    """One recognised input directory."""

    kind: InputKind  # what it holds
    path: Path  # the directory
    manifest: dict[str, Any]  # its manifest, parsed
    compare: CompareManifest | None = None  # a compare result's manifest, typed (None for other kinds)
    a2a: A2AManifest | None = None  # an a2a result's manifest, typed (None for other kinds)
    advice: AdviceManifest | None = None  # an advice result's manifest, typed (None for other kinds)


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is unreadable or not an object."""
    from moetrace.errors import MoetraceError
    from moetrace.inputs import read_input_json

    try:  # a regular file of bounded size and bounded integers (a 4,400-digit number is not a manifest)
        obj = read_input_json(path, max_bytes=256 << 20)
    except (OSError, MoetraceError):
        return None
    return obj if isinstance(obj, dict) else None


def detect(path: str | os.PathLike) -> Input:
    """Classify ``path`` by its manifest's ``format``; raise ``TraceFormatError`` if it is none of them."""
    p = Path(path)
    if not p.is_dir():
        raise TraceFormatError(
            f"{p}: {'not a directory' if p.exists() else 'no such directory'}. Pass trace directories and the output directories of "
            "`moetrace analyze` / `moetrace compare` / `moetrace a2a`."
        )
    names = list(dict.fromkeys([TRACE_MANIFEST, *(k.manifest for k in KINDS if k.manifest is not None)]))
    result_formats = {k.format for k in KINDS}
    seen: list[str] = []
    for name in names:
        f = p / name
        if not f.is_file():
            continue
        obj = _read_json(f)
        fmt = None if obj is None else obj.get("format")
        if obj is not None and fmt == TRACE_FORMAT:
            return Input(kind="trace", path=p, manifest=obj)
        if obj is not None and (fmt in result_formats or fmt is None):
            kind, manifest = read_result_manifest(f)  # raises: older moetrace (no format), unsupported version
            where = str(f)
            if kind is COMPARE:
                typed = CompareManifest.from_json(manifest, where=where)
                return Input(kind=DRAWN[kind.name], path=p, manifest=manifest, compare=typed)
            if kind is A2A:
                a2a = A2AManifest.from_json(manifest, where=where)
                return Input(kind=DRAWN[kind.name], path=p, manifest=manifest, a2a=a2a)
            if kind is ADVICE:
                advice = AdviceManifest.from_json(manifest, where=where)
                return Input(kind=DRAWN[kind.name], path=p, manifest=manifest, advice=advice)
            if kind.name in DRAWN:
                return Input(kind=DRAWN[kind.name], path=p, manifest=manifest)
        seen.append(f"{name} (format {fmt!r})" if obj is not None else f"{name} (unreadable)")
    expected = ", ".join(
        [f"{TRACE_MANIFEST} with format {TRACE_FORMAT!r}"]
        + [f"{k.manifest} with format {k.format!r}" for k in KINDS if k.name in DRAWN]
    )
    found = f"; found {', '.join(seen)}" if seen else ""
    raise TraceFormatError(
        f"{p}: not a trace, analysis or placement result directory (expected {expected}{found}). "
        "Pass the directory given to -o of `moetrace analyze`, `moetrace compare` or `moetrace a2a`, or a trace directory."
    )
