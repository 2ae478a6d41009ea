"""What an import format declares (``ImportFormat``, one row of the registry) and what every format shares.

A format is one module of this package holding one ``ImportFormat``: its name, a one-line help,
``detect`` (does this input look like mine, from its first bytes) and ``parse`` (yield the requests
it reads, ``driver.Requests``; the driver checks, batches and writes them, ``driver.drive``), or, for
an aggregate dump (expert counts, no tokens), ``produces="profile"`` and
``read_profile`` (return a ``LoadProfile``, which ``import_profile`` writes). ``moetrace.tracer.importers`` lists the rows (``FORMATS``), detects, and owns the
output directory, the manifest and the clean-up after bad input.

Stages (``StagesMode``, ``--stages``): which stages a capture recorded. ``both`` (the default):
every request has its prompt's routing and its generated tokens'; ``decode-only``: generated
tokens only; ``prefill-only``: prompt tokens only. A format that honours the one-stage modes says
so (``stages_modes``; its module says how it keeps trace format v1's ``prompt_tokens >= 1``);
the manifest records the stages as ``collection.stages`` (``schema.stages_of`` reads it).

This module imports nothing heavy (the CLI builds its choices from the registry at start-up):
formats load numpy, polars and the writer inside ``read``.

Out of scope: any one format (its module), detection over all formats and writing the manifest
(``moetrace.tracer.importers``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

from moetrace.tracer.importers.options import ImportOptions

if TYPE_CHECKING:
    import numpy as np

    from moetrace.tracer.importers.ids import DescribeRow
    from moetrace.tracer.trace.profile import LoadProfile
    from moetrace.tracer.trace.schema import ModelInfo
    from moetrace.tracer.trace.writer import TraceWriter

#: what a format's input becomes: a trace (per-token routing) or a load profile (aggregate expert counts)
Produces = Literal["trace", "profile"]

#: which stages a capture recorded: the value of ``--stages``
StagesMode = Literal["both", "decode-only", "prefill-only"]
STAGES_MODES: tuple[str, ...] = get_args(StagesMode)
#: ``--stages`` -> what such a capture holds (the CLI's help)
STAGES_HELP: dict[str, str] = {
    "both": "every request has its prompt's routing, and decode records",
    "decode-only": "generated tokens only, e.g. captures that log no prompt",
    "prefill-only": "prompt tokens only",
}
#: ``--stages`` -> the manifest's ``collection.stages`` (``schema.STAGE_PREFILL``, ``STAGE_DECODE``)
RECORDED_STAGES: dict[str, list[str]] = {
    "both": ["prefill", "decode"],
    "decode-only": ["decode"],
    "prefill-only": ["prefill"],
}

#: how many bytes of the input ``detect`` sees (a format may read more from ``src`` itself)
HEAD_BYTES = 1 << 16

#: ``progress(done, total)``: after each committed batch, last with ``done == total`` (a format's own unit:
#: bytes of the input for the JSONL formats, which is what the CLI's bar shows)
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ReadResult:
    """What a format's ``read`` tells the manifest beyond the rows it wrote."""

    datasets: frozenset[str]  # the dataset labels of the requests written (``collection.datasets``)
    prompt_lengths_known: bool = True  # False: prompts are placeholders of unknown length (a decode-only capture)
    # what the import could not check or changed (ids.check_ids, a map applied), one sentence each: printed by
    # the CLI and kept as the manifest's ``collection.import_notes``
    notes: tuple[str, ...] = ()
    # more ``collection`` fields of the manifest (JSON values): how records became requests, a prompt span...
    collection: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Requests:
    """Requests a format parsed (one or many), whole, in the order they are written."""

    request_id_R: np.ndarray  # int [R], unique over the whole import
    prompt_tokens_R: np.ndarray  # int [R], >= 1
    output_tokens_R: np.ndarray  # int [R], >= 0
    topk_ids_TLK: np.ndarray  # int [T, L, K] as recorded (physical slot ids when a map applies); -1: none
    dataset_R: tuple[str, ...] | None = None  # None: the import's label for every request
    topk_weights_TX: np.ndarray | None = None  # float32 [T, X] (formats whose ``with_weights`` holds)
    physical_map_LP: np.ndarray | None = None  # int [L, P]: the map the input carries (--physical-map wins)
    describe_row: DescribeRow | None = None  # names row ``t`` and MoE layer ordinal ``l`` in the input
    context: str = ""  # what the ids checks' errors start with ("in.jsonl:12: request 3"); "": nothing
    place: str = ""  # where a repeated request id is reported ("in.jsonl:12"); "": the source's name
    progress: tuple[int, int] | None = None  # (done, total) of the input once these are parsed; None: no report
    flush: bool = False  # write everything held after these (e.g. a file's end, for its progress report)


@dataclass(frozen=True)
class Parsed:
    """What a format's ``parse`` returns once its input is read: what only it knows for the manifest."""

    notes: tuple[str, ...] = ()  # its sentences before the driver's (map, ids)
    closing_notes: tuple[str, ...] = ()  # its sentences after the driver's
    collection: dict[str, Any] = field(default_factory=dict)  # more ``collection`` fields of the manifest
    prompt_lengths_known: bool = True  # False: prompts are placeholders of unknown length
    progress_total: int | None = None  # the last report's total (``Requests.progress``'s unit); None: bytes of src


class Detect(Protocol):
    def __call__(self, head: bytes, src: Path, /) -> bool:
        """Whether ``src`` is in this format, from ``head`` (its first ``HEAD_BYTES`` bytes; ``b""`` for a
        directory or an empty file). Never assumes text; returns False, never raises, for inputs of other
        formats: binary files, directories, text that is not this format."""
        ...


class Read(Protocol):
    def __call__(
        self,
        src: Path,
        /,
        *,
        writer: TraceWriter,
        info: ModelInfo,
        label: str,
        stages: StagesMode,
        progress: Progress | None,
        options: ImportOptions,
    ) -> ReadResult:
        """Add every request of ``src`` to ``writer`` (``add_requests``), labelling requests that carry no
        dataset with ``label``; ``stages`` is what the capture recorded (always ``both`` for a format whose
        ``stages_modes`` is False); ``options`` the user's options (only those in ``ImportFormat.options`` are
        set). Raises ``TraceFormatError`` naming the place in ``src``, the problem and the fix."""
        ...


class Parse(Protocol):
    def __call__(
        self,
        src: Path,
        /,
        *,
        info: ModelInfo,
        label: str,
        stages: StagesMode,
        options: ImportOptions,
        with_weights: bool,
    ) -> Generator[Requests, None, Parsed]:
        """Yield every request of ``src`` (``Requests``, in the order to write them), then return what only the
        format knows (``Parsed``); ``driver.drive`` checks the ids, batches and writes. Requests carrying no
        dataset get ``label``; ``stages`` is what the capture recorded; ``options`` the user's (only those in
        ``ImportFormat.options`` are set); ``with_weights`` whether the trace takes weights (``ImportFormat
        .with_weights``). Raises ``TraceFormatError`` naming the place in ``src``, the problem and the fix."""
        ...


class ReadProfile(Protocol):
    def __call__(
        self,
        src: Path,
        /,
        *,
        info: ModelInfo,
        label: str | None,
        stages: StagesMode,
        progress: Progress | None,
        options: ImportOptions,
    ) -> LoadProfile:
        """The load profile of the aggregate dump ``src`` (``label``: the dataset the user named for
        the whole dump, None: unknown); ``stages`` is what the capture counted (``both``: prefill and decode together, the
        profile's ``mixed`` stage); ``options`` the user's options (only those in
        ``ImportFormat.options`` are set). Raises ``TraceFormatError`` naming the place in ``src``, the
        problem and the fix (ids or shapes that do not fit ``info`` included)."""
        ...


@dataclass(frozen=True)
class ImportFormat:
    """One import format (a row of ``moetrace.tracer.importers.FORMATS``)."""

    name: str  # the --format value and the manifest's backend.source_format
    help: str  # one line: what the input holds (the CLI's --format help and the error for an unknown input)
    detect: Detect  # recognises the input from its first bytes
    # fills the trace writer itself, owning its checks (a format outside this package may; the formats here parse)
    read: Read | None = None
    stages_modes: bool = False  # honours --stages decode-only / prefill-only; False: the input always carries both
    # whole-input checks that need no model or writer (e.g. a text format's UTF-8 check), run before the
    # output directory is touched, so bad input never costs an existing trace under --overwrite; None: none
    precheck: Callable[[Path], None] | None = None
    # the ``options.ImportOptions`` it honours (``options.PHYSICAL_MAP``, ``options.PROMPT_SPAN``); others are refused
    options: frozenset[str] = frozenset()
    # whether the input carries routing weights (the writer's ``with_weights``, decided before ``read``); None: never
    with_weights: Callable[[Path], bool] | None = None
    produces: Produces = "trace"  # a trace (``read``) or a load profile (``read_profile``: aggregate dumps)
    read_profile: ReadProfile | None = None  # the dump's load profile (formats that produce a profile)
    # the model every input of this format comes from (a capture of one published model, e.g. ``esft``'s
    # DeepSeek-V2-Lite): ``import`` uses it when --model is left out; None: the input does not say, --model is needed
    model: Callable[[], ModelInfo] | None = None
    # yields the requests of the input for ``driver.drive`` (formats that produce a trace; instead of ``read``)
    parse: Parse | None = None
    batch_requests: int = 512  # requests per ``add_requests`` call (and per progress report) under ``parse``

    def __post_init__(self) -> None:
        trace = (self.read is not None) + (self.parse is not None)
        if (
            trace > 1
            or (self.produces == "trace") != (trace == 1)
            or (self.produces == "profile") != (self.read_profile is not None)
        ):
            raise TypeError(
                f"import format {self.name!r}: a trace format has `parse` (or `read`), a profile format `read_profile`"
            )
