"""The trace reader: open a trace directory and stream its rows (polars frames or numpy arrays).

Shape legend: see docs/architecture.md (T tokens, L MoE layers, K top-k).

Out of scope: writing (``writer``), checking every invariant (``validate``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.errors import TraceFormatError
from moetrace.tracer.trace.layout import MANIFEST, REQUESTS_DIR, ROUTING_DIR, read_manifest
from moetrace.tracer.trace.schema import STAGE_DECODE, ModelInfo, check_manifest_header, requests_schema, routing_schema


class TokenArrays(NamedTuple):
    """Routing rows as numpy arrays (the fast path).

    request_id_T int64, position_T int32, is_decode_T bool, topk_ids_TLK int16 (-1: not recorded).
    """

    request_id_T: np.ndarray
    position_T: np.ndarray
    is_decode_T: np.ndarray
    topk_ids_TLK: np.ndarray


class Trace:
    """A trace directory opened for reading. Use :func:`open_trace`."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.model = ModelInfo.from_dict(manifest.get("model"))

    def __repr__(self) -> str:
        return f"Trace({str(self.path)!r}, model={self.model.name!r}, complete={self.manifest.get('complete')})"

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def part_names(self) -> list[str]:
        """Committed parts (a requests file exists), in name order."""
        return sorted(f.name for f in (self.path / REQUESTS_DIR).glob("*.parquet"))

    def routing_files(self) -> list[Path]:
        return [self.path / ROUTING_DIR / n for n in self.part_names()]

    def requests_files(self) -> list[Path]:
        return [self.path / REQUESTS_DIR / n for n in self.part_names()]

    def requests(self) -> "pl.LazyFrame":  # noqa: F821
        """One row per request: ``request_id, dataset, prompt_tokens, output_tokens`` (+ extras)."""
        import polars as pl

        files = self.requests_files()
        if not files:
            return pl.LazyFrame(schema=pl.Schema(pl.from_arrow(requests_schema(with_text=False).empty_table()).schema))
        return pl.scan_parquet(files)

    def routing(self) -> "pl.LazyFrame":  # noqa: F821
        """One row per token: ``request_id, position, stage, experts`` (``Array[i16, L*K]``)."""
        import polars as pl

        files = self.routing_files()
        if not files:
            empty = routing_schema(self.model.ids_per_token, with_weights=False).empty_table()
            return pl.from_arrow(empty).lazy()
        return pl.scan_parquet(files)

    def iter_token_arrays(self, *, batch_tokens: int = 1 << 20) -> Iterator[TokenArrays]:
        """Stream routing rows as numpy arrays, part by part, row group by row group (bounded memory)."""
        L, K = self.model.num_moe_layers, self.model.top_k
        for f in self.routing_files():
            try:
                pf = pq.ParquetFile(f)
                batches = pf.iter_batches(batch_size=batch_tokens, columns=["request_id", "position", "stage", "experts"])
                for rb in batches:
                    yield _batch_to_arrays(rb, L, K)
            except (pa.ArrowException, OSError, KeyError) as exc:
                raise TraceFormatError(
                    f"{f}: cannot read this routing part ({exc}); run `moetrace validate {self.path}` for details"
                ) from exc

    def token_arrays(self) -> TokenArrays:
        """All routing rows as numpy arrays ``[T, L, K]`` (loads the whole trace into memory)."""
        parts = list(self.iter_token_arrays())
        if not parts:
            L, K = self.model.num_moe_layers, self.model.top_k
            return TokenArrays(
                np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, bool), np.zeros((0, L, K), np.int16)
            )
        return TokenArrays(*(np.concatenate(cols) for cols in zip(*parts)))


def _batch_to_arrays(rb: pa.RecordBatch, L: int, K: int) -> TokenArrays:
    experts = rb.column("experts")
    flat = experts.values.to_numpy(zero_copy_only=False)
    if experts.offset:
        flat = flat[experts.offset * L * K :]
    stage = rb.column("stage")
    if pa.types.is_dictionary(stage.type):
        stage = stage.cast(pa.string())
    import pyarrow.compute as pc

    is_decode = pc.equal(stage, STAGE_DECODE).to_numpy(zero_copy_only=False)
    return TokenArrays(
        rb.column("request_id").to_numpy(),
        rb.column("position").to_numpy(),
        is_decode,
        flat[: rb.num_rows * L * K].reshape(rb.num_rows, L, K),
    )


def open_trace(path: str | os.PathLike, *, require_complete: bool = True) -> Trace:
    """Open the trace directory ``path`` for reading.

    Raises ``TraceFormatError`` if it is not a format-v1 trace, or (with ``require_complete``) if its
    collection has not finished; ``moetrace collect --resume`` completes it.
    """
    p = Path(path)
    manifest = read_manifest(p)
    check_manifest_header(manifest, where=str(p / MANIFEST))
    if require_complete and not manifest.get("complete"):
        raise TraceFormatError(
            f"{p}: the trace is incomplete (manifest `complete: false`): its collection was interrupted or is "
            "still running. Resume it by re-running the same command with --resume, or pass "
            "--allow-incomplete to read the committed part."
        )
    missing = [f"{ROUTING_DIR}/{f.name}" for f in sorted((p / REQUESTS_DIR).glob("*.parquet"))
               if not (p / ROUTING_DIR / f.name).is_file()]
    if missing:
        raise TraceFormatError(
            f"{p}: committed part(s) without their routing file: {missing[:3]}; the trace is damaged "
            f"(run `moetrace validate {p}`)"
        )
    return Trace(p, manifest)
