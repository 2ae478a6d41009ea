"""The placement section's words for compare results: copy models, links, held-out or in-sample.

What compare.json (``CompareManifest``) and ``summary.parquet`` say, as the page and the summary card
word it: each stage's copy model, the links the time was predicted for, whether the simulated batches
were held out, whether the results predict time at all, a table cell as a finite float, and
``summary.parquet``'s rows as their typed record (``summary_rows``: ``placement.compare_row.CompareRow``).

Out of scope: the tables and figures that use them (``section_placement_table`` and the others).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from moetrace.placement.compare_manifest import CompareManifest
from moetrace.placement.compare_row import CompareRow

__all__ = [
    "COPY_MODELS",
    "TIME_COLUMN",
    "has_time",
    "stage_copy_model",
    "held_out",
    "copy_models",
    "links_text",
    "finite",
    "any_finite",
    "summary_rows",
]


#: a dedup unit of compare.json (``dedup``: the decode stage's, ``prefill_dedup``: the prefill
#: stage's) -> the copies of a token the all-to-all sends, as the page words it
COPY_MODELS: dict[str, str] = {
    "expert": "one copy per (token, expert), as DeepEP's low-latency kernels send",
    "node": "one copy per node, as DeepEP's normal kernels send",
    "rank": "one copy per GPU",
}

#: the summary column only results written with the cost model (placement/cost.py) have
TIME_COLUMN = "a2a_time_normalized_median"


def has_time(summary: pl.DataFrame) -> bool:
    """The compare results predict time per step (``summary.parquet`` has the time columns);
    results written before the cost model hold bytes alone."""
    return TIME_COLUMN in summary.columns


def summary_rows(summary: pl.DataFrame, *, where: str) -> dict[str, CompareRow]:
    """``summary.parquet``'s rows read from ``where``, typed, by strategy (a column of another type:
    ``TraceFormatError`` naming ``where``, the row and the column)."""
    rows = (CompareRow.from_row(r, where=f"{where} row {i}") for i, r in enumerate(summary.iter_rows(named=True)))
    return {r.strategy: r for r in rows}


def _copy_model(dedup: str) -> str:
    return COPY_MODELS.get(dedup, f"one copy per distinct {dedup}")


def stage_copy_model(m: CompareManifest, stage: str) -> str:
    """The copy model a stage (``decode``, ``prefill``) was simulated with, in words."""
    return _copy_model(m.dedup if stage == "decode" else (m.prefill_dedup or "?"))


def held_out(m: CompareManifest) -> str:
    """What the simulated batches were drawn from, as an adjective: ``held-out`` (a trace's requests the
    placement never saw), ``in-sample`` (tokens drawn from the load profile the placement was made on)."""
    return "held-out" if m.tokens_from is None else "in-sample"


def copy_models(m: CompareManifest) -> str:
    """The copy model of each simulated stage, e.g. ``decode one copy per (token, expert), ...;
    prefill one copy per node, ...`` (prefill only when prefill steps were simulated)."""
    decode = f"decode {_copy_model(m.dedup)}"
    if m.prefill_dedup is None or not m.num_prefill_batches:
        return decode
    return f"{decode}; prefill {_copy_model(m.prefill_dedup)}"


def links_text(m: CompareManifest, *, latency: bool = False) -> str:
    """The links the time was predicted for, e.g. ``NVLink 155 GB/s, RDMA 50 GB/s per GPU`` (with
    ``latency``: each class's cost per message too); "" when the results have no cost model."""
    if m.cost is None:
        return ""
    links = m.cost["links"]

    def one(name: str, cls: str) -> str:
        lat = f" ({links[f'{cls}_latency_s'] * 1e6:.3g} µs per message)" if latency else ""
        return f"{name} {links[f'{cls}_bytes_per_s'] / 1e9:.3g} GB/s{lat}"

    per = "per GPU" if links["inter_nic"] == "gpu" else "per node, shared by its GPUs"
    hw = f"{m.hardware.name}: " if m.hardware is not None else ""
    return f"{hw}{one('NVLink', 'intra')}, {one('RDMA', 'inter')} {per}"


def finite(v: object) -> float | None:
    """A table cell ``v`` as a float, or None when it is missing (null), NaN or not a number."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) else None


def any_finite(col: pl.Series) -> bool:
    return bool(np.isfinite(col.cast(pl.Float64).fill_null(np.nan).to_numpy()).any())
