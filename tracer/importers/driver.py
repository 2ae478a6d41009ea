"""The one read loop of every trace format: physical maps, id checks, request ids, batching, progress, notes.

A format only parses (``ImportFormat.parse``): a generator that yields ``base.Requests`` (one request or
many, the ids as the input recorded them, with how to name a row in an error) and returns
``base.Parsed`` (its own notes and manifest fields). ``drive`` runs it into the trace writer, and for
every ``Requests``:

- converts physical slot ids to logical ones (``ids.to_logical``) through ``--physical-map`` (read
  once here) or, without it, the map the input carries itself (``Requests.physical_map_LP``);
- checks the ids against the model (``ids.check_ids``), keeping the largest id and the number of
  ids for ``ids.ids_notes``;
- refuses a request id seen before;
- holds the requests until ``ImportFormat.batch_requests`` of them or ``BATCH_BYTES`` of ids (or the
  format asks: ``Requests.flush``), then hands them to ``writer.add_requests`` together and reports
  progress (the last ``Requests.progress`` written; once more at the end, ``Parsed.progress_total``);
- writes the notes: the format's, then the map's, then the ids', then the format's closing ones.

The memory budget (``options.check_allocation``) is asked by a format before each large allocation of
its parsing; the driver holds at most ``BATCH_BYTES`` of ids beyond what a format yields at once.

Shape legend: R requests, T tokens (the requests' rows, back to back), L MoE layers, K top-k,
X = L*K, P physical slots (legend: docs/architecture.md).

Out of scope: detecting a format, the output directory and the manifest's other fields (the package's
``import_trace``), what any one input looks like (the formats).
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING

from moetrace.errors import TraceFormatError
from moetrace.tracer.importers.base import ImportFormat, Parsed, Progress, ReadResult, Requests, StagesMode
from moetrace.tracer.importers.ids import check_ids, ids_notes, read_physical_map, to_logical
from moetrace.tracer.importers.options import ImportOptions

if TYPE_CHECKING:  # numpy and the writer load when a file is read, so `moetrace --help` stays light
    import numpy as np

    from moetrace.tracer.trace.schema import ModelInfo
    from moetrace.tracer.trace.writer import TraceWriter

__all__ = ["BATCH_BYTES", "drive"]

#: the most bytes of ids the driver holds before handing them to the writer
BATCH_BYTES = 1 << 27


class _Held:
    """Checked requests waiting for ``writer.add_requests``."""

    def __init__(self) -> None:
        self.parts: list[tuple[Requests, np.ndarray, tuple[str, ...]]] = []
        self.nbytes = 0
        self.num_requests = 0

    def add(self, r: Requests, ids_TX: np.ndarray, datasets: tuple[str, ...]) -> None:
        self.parts.append((r, ids_TX, datasets))
        self.nbytes += ids_TX.nbytes
        self.num_requests += len(r.request_id_R)

    def write(self, writer: TraceWriter) -> None:
        import numpy as np

        parts = self.parts
        weights = [r.topk_weights_TX for r, _, _ in parts]
        writer.add_requests(
            request_id_R=np.concatenate([np.asarray(r.request_id_R, dtype=np.int64) for r, _, _ in parts]),
            dataset_R=[d for _, _, ds in parts for d in ds],
            prompt_tokens_R=np.concatenate([np.asarray(r.prompt_tokens_R, dtype=np.int32) for r, _, _ in parts]),
            output_tokens_R=np.concatenate([np.asarray(r.output_tokens_R, dtype=np.int32) for r, _, _ in parts]),
            topk_ids_TX=np.concatenate([x for _, x, _ in parts]) if len(parts) > 1 else parts[0][1],
            topk_weights_TX=None
            if weights[0] is None
            else (np.concatenate(weights) if len(weights) > 1 else weights[0]),  # type: ignore[arg-type]
        )
        self.parts, self.nbytes, self.num_requests = [], 0, 0


def _checked(r: Requests, map_LP: np.ndarray | None, info: ModelInfo) -> tuple[np.ndarray, int]:
    """``r``'s ids, logical (converted through ``map_LP`` when given) and checked, int16 [T, L, K], and the
    largest id; ``TraceFormatError`` starting with ``r.context``."""
    import numpy as np

    try:
        ids = r.topk_ids_TLK
        if map_LP is not None:
            ids = to_logical(ids, map_LP, describe_row=r.describe_row)
        max_id = check_ids(ids, info, describe_row=r.describe_row)
    except TraceFormatError as exc:
        if not r.context:
            raise
        raise TraceFormatError(f"{r.context}: {exc}") from exc
    return np.asarray(ids, dtype=np.int16), max_id


def drive(
    fmt: ImportFormat,
    src: Path,
    *,
    writer: TraceWriter,
    info: ModelInfo,
    label: str,
    stages: StagesMode,
    progress: Progress | None,
    options: ImportOptions,
) -> ReadResult:
    """Run ``fmt.parse`` on ``src`` into ``writer`` (module docstring); what the manifest records of it."""
    if fmt.parse is None:
        raise TypeError(f"import format {fmt.name!r} has no `parse`")
    user_map = read_physical_map(options.physical_map, info) if options.physical_map is not None else None
    parser: Generator[Requests, None, Parsed] = fmt.parse(
        src, info=info, label=label, stages=stages, options=options, with_weights=writer.with_weights
    )
    held = _Held()
    seen_ids: set[int] = set()
    datasets: set[str] = set()
    max_id, num_ids = -1, 0
    last: tuple[int, int] | None = None

    def flush(*, report: bool = False) -> None:
        """Write what is held; report ``last`` when something was written, or always with ``report``."""
        wrote = bool(held.parts)
        if wrote:
            held.write(writer)
        if progress is not None and last is not None and (wrote or report):
            progress(min(last[0], last[1]), last[1])

    while True:
        try:
            r = next(parser)
        except StopIteration as stop:
            parsed: Parsed = stop.value if stop.value is not None else Parsed()
            break
        ids_TLK, top = _checked(r, user_map if user_map is not None else r.physical_map_LP, info)
        max_id = max(max_id, top)
        num_ids += int((ids_TLK >= 0).sum())
        for rid in r.request_id_R.tolist():
            if rid in seen_ids:
                raise TraceFormatError(f"{r.place or src}: request_id {rid} appears twice; request ids must be unique")
            seen_ids.add(rid)
        ds = r.dataset_R if r.dataset_R is not None else (label,) * len(r.request_id_R)
        datasets.update(ds)
        if len(r.request_id_R):
            held.add(r, ids_TLK.reshape(len(ids_TLK), -1), ds)
        last = r.progress if r.progress is not None else last
        if r.flush:
            flush(report=True)
        elif held.num_requests >= fmt.batch_requests or held.nbytes >= BATCH_BYTES:
            flush()
    flush()
    if progress is not None:
        total = parsed.progress_total if parsed.progress_total is not None else _size(src)
        progress(total, total)
    notes = list(parsed.notes)
    collection = dict(parsed.collection)
    if options.physical_map is not None:
        notes.append(f"physical slot ids converted to logical experts with {options.physical_map.name}")
        collection["physical_map"] = options.physical_map.name
    notes.extend(ids_notes(info, max_id=max_id, num_ids=num_ids))
    notes.extend(parsed.closing_notes)
    return ReadResult(
        datasets=frozenset(datasets),
        prompt_lengths_known=parsed.prompt_lengths_known,
        notes=tuple(notes),
        collection=collection,
    )


def _size(src: Path) -> int:
    """Bytes of ``src``: a file's size, or every file's under a directory."""
    if src.is_dir():
        return sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    return src.stat().st_size
