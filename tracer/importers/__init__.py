"""Import routing recorded by other tools into trace format v1, through one registry of formats.

``FORMATS`` lists the formats, one module each (its docstring describes the input):

- ``sglang`` (``sglang.py``): JSONL of SGLang ``/generate`` responses with ``meta_info.routed_experts``;
- ``tokens`` (``tokens.py``): JSONL of per-token, per-layer records; the only trace format honouring
  ``--stages`` decode-only / prefill-only, and the prompt span of a teacher-forced capture;
- ``sglang-dump`` (``sglang_dump.py``): SGLang's expert-distribution recorder ``per_token`` dumps (``.pt``);
- ``megatron-router`` (``megatron.py``): a directory of Megatron-Core router traces, one JSONL per rank;
- ``esft`` (``esft.py``): DeepSeek's ESFT expert logs (``expert_weights_<layer>.txt``, per-token routing of
  DeepSeek-V2-Lite, teacher-forced); the one format that names its model (``ImportFormat.model``);
- ``chaos`` (``chaos.py``): the "Patterns behind Chaos" expert-selection traces (one JSON per request:
  the prefill step, then one decode token per step; Llama-4-Maverick, DeepSeek-R1, Qwen3-235B on MMLU...);
- ``vllm-responses`` (``vllm_responses.py``): JSONL of vLLM OpenAI-compatible server responses carrying
  ``routed_experts`` (``enable_return_routed_experts``);
- ``llmd-moetrace`` (``llmd_moetrace.py``): llm-d-inference-sim's binary ``.moetrace`` trace (magic ``MOETRC01``;
  the name and format are theirs);
- ``sglang-stat`` (``sglang_stat.py``), ``sglang-pass`` (``sglang_pass.py``), ``trtllm-stats``
  (``trtllm.py``): aggregate expert counts (SGLang's stat and per_pass dumps, TensorRT-LLM's expert
  statistics), imported as a **load profile** (``produces="profile"``, written by ``import_profile``),
  not a trace.

The per-token formats check the ids against the model (``ids``) and convert physical ids
(``--physical-map``, also taken by ``sglang-pass``, whose counts are of physical slots); the options only some formats honour are ``options.ImportOptions``.

``import_trace`` is the one entry point: it finds the format (``--format``, or ``detect_format``:
each format looks at the input's first bytes, before anything is decoded as text, so a binary
format or a directory fits), opens the trace writer, runs the format's ``parse`` through
``driver.drive`` (physical maps, id checks, request ids, batching, progress, the ids' notes), and
writes the manifest (``backend.source_format``, ``collection.stages``, the datasets, the input's
file name, never its directories, and the format's ``collection`` fields and notes). Only regular
files and directories are read (a named pipe would block). Bad input leaves no partial trace behind.

Adding a format: a module here with ``detect``, ``parse`` (a generator of ``base.Requests``, returning
``base.Parsed``: parsing only) and one ``base.ImportFormat`` (name, help line, whether it honours
``--stages``), one row in ``FORMATS``, a test. (A format may instead fill the writer itself, ``read``,
owning its checks: ``tests/test_import_registry.py`` shows one.) The CLI's
``--format`` choices and help come from ``FORMATS``.

Out of scope: what a ``--model`` name means (``presets.resolve``; the caller passes the
``ModelInfo``), collecting (``collect``, ``backends``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace.errors import ConfigError, OutputExistsError, TraceFormatError
from moetrace.tracer.importers import (
    chaos,
    esft,
    llmd_moetrace,
    megatron,
    sglang,
    sglang_dump,
    sglang_pass,
    sglang_stat,
    tokens,
    trtllm,
    vllm_responses,
)
from moetrace.tracer.importers.base import (
    HEAD_BYTES,
    RECORDED_STAGES,
    STAGES_HELP,
    STAGES_MODES,
    ImportFormat,
    Progress,
    ReadResult,
    StagesMode,
)
from moetrace.tracer.importers.driver import drive
from moetrace.tracer.importers.jsonl import (
    MAX_REQUEST_BYTES,
    MAX_REQUEST_TOKENS,
    check_utf8,
    first_line,
    first_line_utf8_error,
    first_record,
)
from moetrace.tracer.importers.options import ImportOptions
from moetrace.tracer.importers.sglang import (
    SGLANG_DEFAULT_DTYPE,
    SGLANG_ROUTED_EXPERTS_DTYPES,
    decode_sglang_routed_experts,
    sglang_response_rows,
    sglang_routed_experts_dtype,
)
from moetrace.tracer.importers.tokens import decode_only_counts_generated, tokens_to_requests

if TYPE_CHECKING:  # the writer (pyarrow) loads in import_trace, so `moetrace --help` stays light
    from moetrace.tracer.trace.profile import LoadProfile
    from moetrace.tracer.trace.schema import ModelInfo
    from moetrace.tracer.trace.writer import OnExisting, WriterStats

__all__ = [
    "FORMATS",
    "ImportFormat",
    "ImportOptions",
    "MAX_REQUEST_BYTES",
    "MAX_REQUEST_TOKENS",
    "RECORDED_STAGES",
    "ReadResult",
    "SGLANG_DEFAULT_DTYPE",
    "SGLANG_ROUTED_EXPERTS_DTYPES",
    "STAGES_HELP",
    "STAGES_MODES",
    "StagesMode",
    "check_utf8",
    "decode_only_counts_generated",
    "decode_sglang_routed_experts",
    "detect_format",
    "get_format",
    "import_profile",
    "import_trace",
    "sglang_response_rows",
    "sglang_routed_experts_dtype",
    "tokens_to_requests",
]

#: the registry, in the order the CLI lists it and detection asks
FORMATS: tuple[ImportFormat, ...] = (
    sglang.FORMAT,
    tokens.FORMAT,
    sglang_dump.FORMAT,
    megatron.FORMAT,
    esft.FORMAT,
    chaos.FORMAT,
    vllm_responses.FORMAT,
    llmd_moetrace.FORMAT,
    sglang_stat.FORMAT,  # a load profile (aggregate counts)
    sglang_pass.FORMAT,  # a load profile (counts per forward pass and rank)
    trtllm.FORMAT,  # a load profile (aggregate counts)
)


def _listing() -> str:
    return ", ".join(f"{f.name} ({f.help})" for f in FORMATS)


def get_format(name: str) -> ImportFormat:
    """The registry row of ``name``; ``ConfigError`` naming the choices when there is none."""
    for f in FORMATS:
        if f.name == name:
            return f
    raise ConfigError(f"unknown import format {name!r}; choose from auto, {', '.join(f.name for f in FORMATS)}")


def _check_source(src: Path) -> None:
    """``TraceFormatError`` unless ``src`` is a regular file or a directory (a named pipe or a device would block
    or never end)."""
    import stat

    try:
        mode = src.stat().st_mode
    except FileNotFoundError:
        raise TraceFormatError(f"{src}: no such file") from None
    except OSError as exc:
        raise TraceFormatError(f"{src}: cannot be read ({exc.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise TraceFormatError(f"{src}: {kind}, not a regular file; save the capture to a file and import that")


def _head(src: Path) -> bytes:
    """The first ``HEAD_BYTES`` of a file; ``b""`` for a directory."""
    _check_source(src)
    if src.is_dir():
        return b""
    with open(src, "rb") as f:
        return f.read(HEAD_BYTES)


def _describe(src: Path, head: bytes) -> str:
    """What ``src`` looks like, for the error when no format recognises it (starts with the place)."""
    if src.is_dir():
        names = sorted(p.name for p in src.iterdir())
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        return f"{src}: a directory ({len(names)} entries{': ' + shown if names else ''})"
    bad = first_line_utf8_error(head, whole_file=len(head) < HEAD_BYTES)
    if bad is not None:  # said before reading a line, which in a binary file may have no end
        return f"{src}:{first_line(head)[0]}: binary data, not UTF-8 text ({bad.reason})"
    try:
        found = first_record(src)
    except TraceFormatError as exc:  # not UTF-8 or not JSON further on: says where
        return str(exc)
    if found is None:  # blank lines only, longer than the head
        return f"{src}: blank lines only"
    n, obj = found
    first = obj[0] if isinstance(obj, list) and obj else obj
    what = f"a record with keys {sorted(first)}" if isinstance(first, dict) else f"a JSON {type(first).__name__}"
    return f"{src}:{n}: {what}"


def detect_format(src: Path) -> ImportFormat:
    """The one registered format that recognises ``src`` (a file or a directory) from its first bytes.

    Raises ``TraceFormatError`` for an empty file, an input no format recognises (saying what it
    looks like and listing the formats), or one that several formats claim.
    """
    head = _head(src)
    if src.is_file() and not head.strip() and len(head) < HEAD_BYTES:  # nothing, or blank lines only
        raise TraceFormatError(f"{src}: empty file")
    found = [f for f in FORMATS if f.detect(head, src)]
    if len(found) > 1:
        raise TraceFormatError(
            f"{src}: reads as several formats ({', '.join(f.name for f in found)}); pass --format to say which"
        )
    if not found:
        raise TraceFormatError(
            f"{_describe(src, head)}, which is none of the formats moetrace imports: "
            f"{_listing()}. Pass --format to say which."
        )
    return found[0]


def _refuse_options(fmt: ImportFormat, options: ImportOptions) -> None:
    """``ConfigError`` naming the options given that ``fmt`` does not honour, and which formats take which."""
    wrong = [o for o in options.given() if o not in fmt.options]
    if wrong:
        takes = ", ".join(f"{f.name}: {' '.join(sorted(f.options))}" for f in FORMATS if f.options)
        raise ConfigError(
            f"{' and '.join(wrong)} {'does' if len(wrong) == 1 else 'do'} not apply to --format {fmt.name} "
            f"(options by format: {takes})"
        )


def import_trace(
    path: str | os.PathLike,
    *,
    out: str | os.PathLike,
    model: ModelInfo,
    source_format: str = "auto",
    dataset: str | None = None,
    stages: StagesMode = "both",
    on_existing: OnExisting = "refuse",
    progress: Progress | None = None,
    options: ImportOptions | None = None,
    notes: Callable[[str], None] | None = None,
) -> WriterStats:
    """Convert one input (a file, or a directory for a format that reads one) into the trace directory
    ``out``; returns what was written.

    ``source_format``: a name in ``FORMATS``, or ``auto`` (``detect_format``). ``stages``: which
    stages the capture recorded (``base.StagesMode``), for formats that honour it; recorded as
    ``collection.stages``. ``progress(done, total)`` is called after each committed batch of
    requests, last with ``done == total`` (bytes of the input for the JSONL formats).
    """
    from moetrace.tracer.trace.layout import MANIFEST
    from moetrace.tracer.trace.writer import TraceWriter

    src = Path(path)
    options = options or ImportOptions()
    _check_source(src)
    if stages not in RECORDED_STAGES:
        raise ConfigError(f"stages must be one of {', '.join(RECORDED_STAGES)}, got {stages!r}")
    fmt = detect_format(src) if source_format == "auto" else get_format(source_format)
    if fmt.produces != "trace":  # an aggregate dump: import_profile writes its load profile
        raise ConfigError(f"--format {fmt.name} holds expert counts, not tokens: it imports as a load profile")
    if stages != "both" and not fmt.stages_modes:
        honour = ", ".join(f.name for f in FORMATS if f.stages_modes and f.produces == "trace")
        raise ConfigError(
            f"--stages {stages} applies to --format {honour}; --format {fmt.name} ({fmt.help}) always "
            "carries both stages (leave --stages at both)"
        )
    _refuse_options(fmt, options)
    if fmt.precheck is not None:
        fmt.precheck(src)
    with_weights = fmt.with_weights is not None and fmt.with_weights(src)
    label = dataset or src.stem
    # the file's name only: the user's directories stay out of the trace (privacy)
    backend = {"name": "import", "source_format": fmt.name, "source_file": src.name}
    collection: dict[str, Any] = {
        "datasets": [label] if dataset else [],
        "imported_from": src.name,
        "stages": RECORDED_STAGES[stages],
    }
    created = not Path(out).exists()
    if on_existing == "refuse" and (Path(out) / MANIFEST).exists():
        raise OutputExistsError(f"{out} already holds a trace; choose another -o, or --overwrite to replace it")
    try:
        with TraceWriter(
            out,
            model=model,
            backend=backend,
            collection=collection,
            on_existing=on_existing,
            with_weights=with_weights,
        ) as writer:
            kw = dict(writer=writer, info=model, label=label, stages=stages, progress=progress, options=options)
            result: ReadResult = drive(fmt, src, **kw) if fmt.parse is not None else fmt.read(src, **kw)  # type: ignore[misc, arg-type]
            if not result.prompt_lengths_known:
                collection["prompt_lengths_known"] = False
            collection.update(result.collection)
            if result.notes:
                collection["import_notes"] = list(result.notes)
            writer.update_manifest(collection={**collection, "datasets": sorted(result.datasets)})
    except BaseException:
        if created:  # bad input (or an interrupt): no partial trace behind that would block a corrected re-run
            shutil.rmtree(out, ignore_errors=True)
        raise
    if notes is not None:
        for line in result.notes:
            notes(line)
    return writer.stats()


def import_profile(
    path: str | os.PathLike,
    *,
    out: str | os.PathLike,
    model: ModelInfo,
    source_format: str = "auto",
    dataset: str | None = None,
    stages: StagesMode = "both",
    overwrite: bool = False,
    progress: Progress | None = None,
    options: ImportOptions | None = None,
) -> LoadProfile:
    """Convert one aggregate dump (a format with ``produces="profile"``) into the load profile file
    ``out``; returns the profile written. ``dataset``: the dataset of the whole dump (None: the
    profile knows none). ``stages``: what the dump counted (``both``: prefill and
    decode together, the profile's ``mixed`` stage). ``options``: those the format honours
    (``ImportFormat.options``; others are refused). Bad input leaves ``out`` as it was.
    """
    from moetrace.tracer.trace.profile import write_profile

    src = Path(path)
    options = options or ImportOptions()
    if not src.exists():
        raise TraceFormatError(f"{src}: no such file")
    if stages not in RECORDED_STAGES:
        raise ConfigError(f"stages must be one of {', '.join(RECORDED_STAGES)}, got {stages!r}")
    fmt = detect_format(src) if source_format == "auto" else get_format(source_format)
    if fmt.read_profile is None:
        raise ConfigError(f"--format {fmt.name} holds tokens: it imports as a trace (import_trace)")
    _refuse_options(fmt, options)
    if fmt.precheck is not None:
        fmt.precheck(src)
    if Path(out).exists() and not overwrite:  # before the dump is read
        raise OutputExistsError(f"{out} already exists; choose another -o, or --overwrite to replace it")
    profile = fmt.read_profile(src, info=model, label=dataset, stages=stages, progress=progress, options=options)
    write_profile(profile, out, overwrite=overwrite)
    return profile
