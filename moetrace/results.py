"""Result files: the one owner of their names, format names and versions.

Five kinds of result, one entry each in ``KINDS``:

- ``analysis``: the directory ``moetrace analyze -o`` writes (docs/analysis.md);
- ``compare``: the directory ``moetrace compare -o`` writes (docs/placement.md);
- ``placement``: the JSON file ``moetrace place -o`` writes (docs/placement.md);
- ``a2a``: the directory ``moetrace a2a -o`` writes (docs/a2a.md);
- ``advice``: the directory ``moetrace advise -o`` writes (docs/advise.md).

Every result file says what it is. A JSON file carries top-level ``"format"`` and ``"version"``
keys; a Parquet table carries them as Arrow schema metadata (``b"moetrace.format"``,
``b"moetrace.version"``). A kind's *manifest* (``manifest.json``, ``compare.json``, the placement
file itself) carries the kind's format name (``"moetrace.compare"``); every other file the kind's
format name dotted with the file's stem (``"moetrace.compare.layers"`` for ``layers.parquet``).
Readers dispatch on that format, never on which keys a file happens to hold.

Adding a kind is one ``ResultKind`` entry (plus the names of its files) in ``KINDS``; write its
files with ``write_result_table`` / ``write_result_json`` and read its manifest with
``read_result_manifest``. A manifest's typed record (``placement.compare_manifest``,
``placement.a2a_manifest``, ``placement.advise_manifest``) reads its keys through ``ManifestFields``:
a missing key or one of the wrong type is one ``TraceFormatError`` naming it.

Out of scope: what the files hold (columns, keys: their writers and docs); the trace format
(``moetrace.tracer.trace``). A core module: imports no stage; pyarrow is imported when a table is
written or read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from moetrace.atomic import atomic_path, write_json_atomic
from moetrace.errors import MoetraceError, OutputExistsError, TraceFormatError

__all__ = [
    "recorded_path",
    "resolve_recorded",
    "ResultKind",
    "KINDS",
    "ANALYSIS",
    "COMPARE",
    "PLACEMENT",
    "A2A",
    "ADVICE",
    "file_format",
    "json_header",
    "check_output",
    "table_metadata",
    "write_result_table",
    "write_result_json",
    "check_result_json",
    "read_result_manifest",
    "read_table_format",
    "kind_of_format",
    "sniff_format",
    "describe_foreign",
    "TRACE_KIND",
    "ManifestFields",
]

_T = TypeVar("_T")

#: the largest result JSON read (a manifest, a placement file)
MAX_RESULT_JSON_BYTES = 256 << 20
#: Arrow schema metadata keys of a result table
FORMAT_KEY = b"moetrace.format"
VERSION_KEY = b"moetrace.version"


@dataclass(frozen=True, kw_only=True)
class ResultKind:
    """One kind of result: what writes it, its format name, version and file names."""

    name: str  # short name: "analysis", "compare", "placement"
    format: str  # the manifest's "format" value; other files: f"{format}.{stem}"
    version: int  # the version this moetrace writes and reads
    command: str  # the command that writes it, for messages ("moetrace compare")
    manifest: str | None  # the JSON file of a results directory that names the kind; None: the result is one JSON file
    files: tuple[str, ...] = ()  # every other file a results directory of this kind may hold


# ---- analysis: `moetrace analyze -o DIR` (docs/analysis.md, "Output files") ---------------------
ANALYSIS_MANIFEST = "manifest.json"
ANALYSIS_SUMMARY = "summary.json"
IMBALANCE = "imbalance.parquet"
EXPERT_LOAD = "expert_load.parquet"
BATCH_IMBALANCE = "batch_imbalance.parquet"
WINDOW_IMBALANCE = "window_imbalance.parquet"  # a load profile with windows only
DATASET_CORRELATION = "dataset_correlation.parquet"
DATASET_CORRELATION_MEAN = "dataset_correlation_mean.parquet"
PREFILL_DECODE_POOLED = "prefill_decode_pooled.parquet"
PREFILL_DECODE_PER_REQUEST_LAYERS = "prefill_decode_per_request_layers.parquet"
PREFILL_DECODE_PER_REQUEST = "prefill_decode_per_request.parquet"
PREFILL_DECODE_RECALL = "prefill_decode_recall.parquet"
CLASSIFY_ACCURACY = "classify_accuracy.parquet"
CLASSIFY_CONFUSION = "classify_confusion.parquet"
EMBEDDING = "embedding.parquet"
EMBEDDING_SCORES = "embedding_scores.parquet"
AFFINITY = "affinity.parquet"
COACTIVATION = "coactivation.parquet"
COUNTS = "counts.parquet"

# ---- compare: `moetrace compare -o DIR` (docs/placement.md, "compare -o RESULTS files") ---------
COMPARE_MANIFEST = "compare.json"
COMPARE_LAYERS = "layers.parquet"
COMPARE_BATCHES = "batches.parquet"
COMPARE_SUMMARY = "summary.parquet"
COMPARE_PLACEMENTS = "placements.parquet"

# ---- a2a: `moetrace a2a -o DIR` (docs/a2a.md, "Output files") ----------------------------------
A2A_MANIFEST = "a2a.json"
A2A_COLLECTIVES = "collectives.parquet"

# ---- advice: `moetrace advise -o DIR` (docs/advise.md, "Output files") --------------------------
ADVICE_MANIFEST = "advice.json"
ADVICE_OPTIONS = "options.parquet"
ADVICE_LAYERS = "layers.parquet"

ANALYSIS = ResultKind(
    name="analysis",
    format="moetrace.analysis",
    version=1,
    command="moetrace analyze",
    manifest=ANALYSIS_MANIFEST,
    files=(
        ANALYSIS_SUMMARY,
        IMBALANCE,
        EXPERT_LOAD,
        BATCH_IMBALANCE,
        WINDOW_IMBALANCE,
        DATASET_CORRELATION,
        DATASET_CORRELATION_MEAN,
        PREFILL_DECODE_POOLED,
        PREFILL_DECODE_PER_REQUEST_LAYERS,
        PREFILL_DECODE_PER_REQUEST,
        PREFILL_DECODE_RECALL,
        CLASSIFY_ACCURACY,
        CLASSIFY_CONFUSION,
        EMBEDDING,
        EMBEDDING_SCORES,
        AFFINITY,
        COACTIVATION,
        COUNTS,
    ),
)
COMPARE = ResultKind(
    name="compare",
    format="moetrace.compare",
    version=1,
    command="moetrace compare",
    manifest=COMPARE_MANIFEST,
    files=(COMPARE_LAYERS, COMPARE_BATCHES, COMPARE_SUMMARY, COMPARE_PLACEMENTS),
)
PLACEMENT = ResultKind(
    name="placement", format="moetrace.placement", version=1, command="moetrace place", manifest=None
)

A2A = ResultKind(
    name="a2a",
    format="moetrace.a2a",
    version=1,
    command="moetrace a2a",
    manifest=A2A_MANIFEST,
    files=(A2A_COLLECTIVES,),
)

ADVICE = ResultKind(
    name="advice",
    format="moetrace.advice",
    version=1,
    command="moetrace advise",
    manifest=ADVICE_MANIFEST,
    files=(ADVICE_OPTIONS, ADVICE_LAYERS),
)

#: every result kind; a new kind is one more entry
KINDS: tuple[ResultKind, ...] = (ANALYSIS, COMPARE, PLACEMENT, A2A, ADVICE)


#: a trace directory, as the owner of an output path (not a result: ``moetrace.tracer.trace`` owns its format)
TRACE_KIND = ResultKind(
    name="trace",
    format="moetrace.trace",
    version=1,
    command="moetrace collect / import / synth",
    manifest="manifest.json",
)
_FORMAT_RE = re.compile(rb'"format"\s*:\s*"([^"\\]{1,100})"')
_SNIFF_BYTES = 4096


def sniff_format(path: str | os.PathLike) -> str | None:
    """The ``format`` a moetrace JSON file names near its start (first 4 KiB); None for anything else
    (not a regular file, not a JSON object, no format). Never blocks (``moetrace.inputs.open_input``)."""
    from moetrace.errors import MoetraceError
    from moetrace.inputs import open_input

    try:
        with open_input(path) as f:
            head = f.read(_SNIFF_BYTES)
    except (OSError, MoetraceError):
        return None
    if not head.lstrip().startswith(b"{"):
        return None
    m = _FORMAT_RE.search(head)
    return m.group(1).decode("utf-8", "replace") if m else None


def describe_foreign(path: str | os.PathLike, own: ResultKind | None) -> str | None:
    """What stands at ``path`` that is not ``own``'s output (None: nothing foreign): for a directory, a
    results manifest of another kind, a trace's manifest, or a manifest by ``own``'s name that ``own``
    did not write; for a file, a moetrace JSON of another format. ``--overwrite`` never replaces it."""
    p = Path(path)
    if p.is_dir():
        names = dict.fromkeys(k.manifest for k in (*KINDS, TRACE_KIND) if k.manifest is not None)
        for name in names:
            f = p / name
            if not f.is_file():
                continue
            fmt = sniff_format(f)
            if own is not None and fmt == own.format:
                continue
            found = next((k for k in (*KINDS, TRACE_KIND) if k.format == fmt and k.manifest == name), None)
            if found is not None:
                return "a trace" if found is TRACE_KIND else f"`{found.command}` results ({name})"
            if own is not None and name == own.manifest:
                return f"a {name} that `{own.command}` did not write"
        return None
    if p.is_file():
        fmt = sniff_format(p)
        if fmt is not None and fmt.startswith("moetrace.") and (own is None or fmt != own.format):
            return f"a {fmt} file"
    return None


def kind_of_format(fmt: object) -> ResultKind | None:
    """The kind whose manifest has format ``fmt``, or None when no kind has it."""
    return next((k for k in KINDS if k.format == fmt), None)


def file_format(kind: ResultKind, name: str) -> str:
    """Format name of file ``name`` of ``kind``: the kind's own for its manifest, else ``<format>.<stem>``.

    Raises ``ValueError`` for a name the kind does not list (a writer bug: register it in ``KINDS``).
    """
    if name == kind.manifest:
        return kind.format
    if name not in kind.files:
        raise ValueError(f"{name!r} is not a file of {kind.format} results; list it in moetrace/results.py")
    return f"{kind.format}.{name.split('.', 1)[0]}"


def json_header(kind: ResultKind, name: str | None = None) -> dict[str, Any]:
    """``{"format": ..., "version": ...}``, the first keys of the JSON file ``name`` of ``kind``
    (``None``: the kind's manifest, or the whole result of a one-file kind)."""
    return {"format": kind.format if name is None else file_format(kind, name), "version": kind.version}


def table_metadata(kind: ResultKind, name: str) -> dict[bytes, bytes]:
    """Arrow schema metadata of the Parquet table ``name`` of ``kind``."""
    return {FORMAT_KEY: file_format(kind, name).encode(), VERSION_KEY: str(kind.version).encode()}


def write_result_table(
    directory: str | os.PathLike, kind: ResultKind, name: str, table: Any, *, compression: str = "zstd"
) -> Path:
    """Write ``table`` (a ``pyarrow.Table``, or anything with ``to_arrow()`` such as a polars
    DataFrame) as ``directory/name`` with its format and version in the schema metadata; through a
    temporary name and a rename, so a reader never sees half of it. Returns the path."""
    import pyarrow.parquet as pq

    t = table.to_arrow() if hasattr(table, "to_arrow") else table
    t = t.replace_schema_metadata({**(t.schema.metadata or {}), **table_metadata(kind, name)})
    path = Path(directory) / name
    with atomic_path(path) as tmp:
        pq.write_table(t, tmp, compression=compression)
    return path


def write_result_json(directory: str | os.PathLike, kind: ResultKind, name: str, obj: dict[str, Any]) -> Path:
    """Write ``obj`` as ``directory/name`` behind its ``format`` and ``version`` keys (atomically)."""
    path = Path(directory) / name
    write_json_atomic(path, {**json_header(kind, name), **obj})
    return path


def check_output(path: str | os.PathLike, kind: ResultKind, *, overwrite: bool) -> None:
    """Refuse, before any work, to replace results of ``kind`` at ``path`` unless ``overwrite``.

    ``path`` is the results directory of a directory kind (results exist when any of its files
    does) or the file of a one-file kind. Raises ``OutputExistsError`` naming the fix.
    """
    p = Path(path)
    if kind.manifest is None:
        exists = p.exists()
        if p.is_dir():
            raise OutputExistsError(f"{p} is a directory; -o of `{kind.command}` names the JSON file to write")
    else:
        if p.exists() and not p.is_dir():
            raise OutputExistsError(f"{p} is a file; -o of `{kind.command}` names a results directory")
        exists = any((p / n).exists() for n in (kind.manifest, *kind.files))
    if exists and not overwrite:
        raise OutputExistsError(
            f"{p} already holds {kind.name} results; choose another -o, or pass --overwrite to replace them"
        )


def check_result_json(path: str | os.PathLike, obj: object, kind: ResultKind | None = None) -> ResultKind:
    """The kind of the result JSON ``obj`` read from ``path``; raises ``TraceFormatError`` (one line)
    when it has no or an unknown ``format``, another kind's format than ``kind``, or a version this
    moetrace does not read."""
    where = str(path)
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: not a JSON object, so not a moetrace result")
    fmt = obj.get("format")
    if fmt is None:
        writers = [k.command for k in KINDS if k is kind or (kind is None and k.manifest == Path(path).name)]
        redo = f"; re-run `{'` / `'.join(writers)}`" if writers else ""
        raise TraceFormatError(
            f"{where} has no `format` key: it was written by an older moetrace (or is not a moetrace result){redo}"
        )
    found = kind_of_format(fmt)
    if found is None or (kind is not None and found is not kind):
        expected = repr(kind.format) if kind is not None else " or ".join(repr(k.format) for k in KINDS)
        raise TraceFormatError(
            f"{where}: format {fmt!r} is not a moetrace result this reader takes (expected {expected})"
        )
    if obj.get("version") != found.version:
        raise TraceFormatError(
            f"{where}: {found.format} version {obj.get('version')!r} is not supported (this moetrace "
            f"reads version {found.version}); re-run `{found.command}`"
        )
    return found


def read_result_manifest(path: str | os.PathLike) -> tuple[ResultKind, dict[str, Any]]:
    """``(kind, manifest)`` of a results directory (its ``manifest.json`` or ``compare.json``) or of
    a one-file result (a placement JSON); raises ``TraceFormatError`` naming the problem."""
    p = Path(path)
    if p.is_dir():
        names = list(dict.fromkeys(k.manifest for k in KINDS if k.manifest is not None))
        f = next((p / n for n in names if (p / n).is_file()), None)
        if f is None:
            raise TraceFormatError(f"{p}: holds no {' or '.join(names)}, so it is no moetrace results directory")
    elif os.path.exists(p):
        f = p  # a pipe or device is refused by the read, never opened
    else:
        raise TraceFormatError(f"{p}: no such file or directory")
    from moetrace.inputs import read_input_json

    try:
        obj = read_input_json(f, max_bytes=MAX_RESULT_JSON_BYTES)  # regular file, bounded size and integers
    except OSError as exc:
        raise TraceFormatError(f"{f}: unreadable ({exc.strerror or exc})") from None
    return check_result_json(f, obj), obj


def read_table_format(path: str | os.PathLike) -> tuple[str, int]:
    """``(format, version)`` from a result table's schema metadata; ``TraceFormatError`` without them."""
    import pyarrow.parquet as pq

    meta = pq.read_schema(path).metadata or {}
    if FORMAT_KEY not in meta or VERSION_KEY not in meta:
        raise TraceFormatError(
            f"{path}: no moetrace format in the table's schema metadata (written by an older moetrace?)"
        )
    return meta[FORMAT_KEY].decode(), int(meta[VERSION_KEY])


def recorded_path(source: str | os.PathLike, *, results_dir: str | os.PathLike) -> str:
    """How a result records the trace (or load profile) it was computed from: the path relative to the
    directory the result is written in (``..`` steps allowed), so that no absolute path of the user's
    machine is stored and results and trace can move together. ``resolve_recorded`` reads it back."""
    return os.path.relpath(os.path.abspath(source), os.path.abspath(results_dir))


def resolve_recorded(recorded: str, *, results_dir: str | os.PathLike) -> Path:
    """The path a result recorded (``recorded_path``), as a path from here: relative ones are taken from
    ``results_dir``; absolute ones (files written by an older moetrace) as they are."""
    p = Path(recorded)
    return p if p.is_absolute() else Path(os.path.normpath(Path(results_dir) / p))


class ManifestFields:
    """Typed access to the keys of one JSON object of a result manifest (what a record's ``to_json``
    wrote, read back): ``later`` maps the keys that files written before them lack to what such a file
    means; a key missing otherwise, or of another type, is a ``TraceFormatError`` naming ``where``, the
    key and the command that writes the file again (``kind.command``)."""

    def __init__(self, obj: object, where: str, *, kind: ResultKind, later: Mapping[str, Any] | None = None) -> None:
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected an object, got {type(obj).__name__}; re-run `{kind.command}`")
        self.obj: dict[str, Any] = obj
        self.where, self.command = where, kind.command
        self.later: Mapping[str, Any] = later or {}

    def get(self, key: str, typ: type | tuple[type, ...], *, optional: bool = False) -> Any:
        """The value at ``key``, of type ``typ`` (a bool is no int), or null when ``optional``."""
        if key not in self.obj:
            if key in self.later:
                return self.later[key]
            raise TraceFormatError(f"{self.where}: no `{key}`; re-run `{self.command}`")
        v = self.obj[key]
        types = typ if isinstance(typ, tuple) else (typ,)
        if (v is None and optional) or (isinstance(v, types) and (bool in types or not isinstance(v, bool))):
            return v
        raise TraceFormatError(
            f"{self.where}: `{key}` is {v!r}, expected {' or '.join(t.__name__ for t in types)}"
            f"{' or null' if optional else ''}; re-run `{self.command}`"
        )

    def integer(self, key: str) -> int:
        return int(self.get(key, int))

    def number(self, key: str, *, optional: bool = False) -> Any:
        """A float (an integer written as one too); None for null when ``optional``."""
        v = self.get(key, (int, float), optional=optional)
        return None if v is None else float(v)

    def text(self, key: str, *, optional: bool = False) -> Any:
        return self.get(key, str, optional=optional)

    def names(self, key: str) -> tuple[str, ...]:
        v = self.get(key, (list, tuple))
        if not all(isinstance(s, str) for s in v):
            raise TraceFormatError(f"{self.where}: `{key}` must be a list of names; re-run `{self.command}`")
        return tuple(v)

    def ints(self, key: str) -> tuple[int, ...]:
        v = self.get(key, (list, tuple))
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise TraceFormatError(f"{self.where}: `{key}` must be a list of integers; re-run `{self.command}`")
        return tuple(v)

    def numbers(self, key: str) -> dict[str, float]:
        """An object of numbers by name (NaN as written)."""
        v = self.get(key, dict)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v.values()):
            raise TraceFormatError(f"{self.where}: `{key}` must map names to numbers; re-run `{self.command}`")
        return {str(k): float(x) for k, x in v.items()}

    def parsed(self, key: str, parse: Callable[[Any], _T], *, typ: type | tuple[type, ...] = dict) -> _T:
        """``parse`` of the value at ``key`` (of type ``typ``, or its ``later`` value); what ``parse``
        refuses (a ``MoetraceError``, ``TypeError`` or ``ValueError``) is a ``TraceFormatError`` naming ``where``."""
        return self._parse(self.get(key, typ), parse)

    def parsed_or_none(self, key: str, parse: Callable[[Any], _T]) -> _T | None:
        """``parsed`` of an object that may be null (None then)."""
        v = self.get(key, dict, optional=True)
        return None if v is None else self._parse(v, parse)

    def _parse(self, v: Any, parse: Callable[[Any], _T]) -> _T:
        try:
            return parse(v)
        except (MoetraceError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{self.where}: {exc}") from None
