"""The placement section's summary table, from compare's ``summary.parquet``.

The strategies' rows (the reference first) and, below them under the same columns, the bounds' rows:
predicted time per step first when the results have it (written with the cost model), then bytes,
node and GPU load; results written before the cost model show bytes alone, as they always did. A
column holding one value in every row is said in the caption instead.

Out of scope: the figures (``section_placement_figures``, ``section_placement_nodes``).
"""

from __future__ import annotations

from collections.abc import Callable

import polars as pl

from moetrace.dashboards.page import Table
from moetrace.dashboards.results import Results
from moetrace.dashboards.section_placement_strategies import BOUNDS_GROUP, STRATEGY_NAMES, is_bound, strategies_in_order
from moetrace.dashboards.section_placement_text import any_finite, finite, has_time, held_out, summary_rows
from moetrace.placement.compare_manifest import CompareManifest
from moetrace.placement.compare_row import CompareRow
from moetrace.placement.strategies import BOUNDS
from moetrace.results import COMPARE_SUMMARY

__all__ = ["node_load_text", "summary_tables"]


def _ratio(v: object) -> str:
    f = finite(v)
    return "-" if f is None else f"{f:.3f}"


def _ratio_of(value: Callable[[CompareRow], float]) -> Callable[[CompareRow], str]:
    """A column's cell: its ratio (3 decimals)."""
    return lambda r: _ratio(value(r))


def _span(lo: object, hi: object) -> str:
    """A p10–p90 range of ratios: ``0.912–1.034``."""
    a, b = finite(lo), finite(hi)
    return "-" if a is None or b is None else f"{a:.3f}–{b:.3f}"


def _seconds(v: object) -> str:
    """Seconds as shown in tables: ``412 µs``, ``1.23 ms``, ``2.5 s``."""
    f = finite(v)
    if f is None:
        return "-"
    if f >= 1.0:
        return f"{f:.3g} s"
    return f"{f * 1e3:.3g} ms" if f >= 1e-3 else f"{f * 1e6:.3g} µs"


def node_load_text(row: CompareRow, m: CompareManifest) -> str:
    """``busiest_node_load`` to 2 decimals, flagged when the row is over compare.json's ``max_node_load``."""
    load = finite(row.busiest_node_load)
    if load is None:
        return "-"
    if not row.over_node_load_limit:
        return f"{load:.2f}"
    limit = "" if m.max_node_load is None else f" {m.max_node_load:.2f}"
    return f"{load:.2f} ⚠ over{limit or ' the limit'}"


_Column = tuple[str, Callable[[CompareRow], object]]


def _bytes_columns() -> list[_Column]:
    """The table of results written before the cost model, column by column (as it always was)."""
    return [
        ("strategy", lambda r: STRATEGY_NAMES.get(r.strategy, r.strategy)),
        ("inter-node (normalized median)", lambda r: r.inter_node_normalized_median),
        ("p10", lambda r: r.inter_node_normalized_p10),
        ("p90", lambda r: r.inter_node_normalized_p90),
        ("inter-node / batch", lambda r: _kib(r.inter_node_bytes_per_batch_median)),
        ("intra-node / batch", lambda r: _kib(r.intra_node_bytes_per_batch_median)),
        ("largest rank send / layer", lambda r: _kib(r.max_rank_dispatch_send_bytes_mean)),
        ("max tokens per rank", lambda r: r.tokens_per_rank_max_mean),
        ("max activated experts per rank", lambda r: r.activated_experts_per_rank_max_mean),
        ("router match", _router_match),
        ("busiest node's requests / even share", lambda r: _load2(r.busiest_node_load)),
    ]


def _time_columns(m: CompareManifest, summary: pl.DataFrame) -> list[_Column]:
    """The table of results written with the cost model: predicted time first, then bytes and load."""
    cols: list[_Column] = [
        ("strategy", lambda r: STRATEGY_NAMES.get(r.strategy, r.strategy)),
        ("all-to-all / step", lambda r: _seconds(r.a2a_seconds_per_step_median)),
        (
            "all-to-all vs median (p10–p90)",
            lambda r: _with_span(r.a2a_time_normalized_median, r.a2a_time_normalized_p10, r.a2a_time_normalized_p90),
        ),
        ("MoE layers / step", lambda r: _seconds(r.moe_seconds_per_step_median)),
        (
            "MoE vs median (p10–p90)",
            lambda r: _with_span(r.moe_time_normalized_median, r.moe_time_normalized_p10, r.moe_time_normalized_p90),
        ),
        (
            "inter-node bytes vs median (p10–p90)",
            lambda r: _with_span(
                r.inter_node_normalized_median, r.inter_node_normalized_p10, r.inter_node_normalized_p90
            ),
        ),
        ("inter-node / batch", lambda r: _kib(r.inter_node_bytes_per_batch_median)),
        ("intra-node / batch", lambda r: _kib(r.intra_node_bytes_per_batch_median)),
        ("largest rank send / layer", lambda r: _kib(r.max_rank_dispatch_send_bytes_mean)),
        ("busiest node's requests / even share", lambda r: node_load_text(r, m)),
        ("busiest GPU's tokens / mean GPU's", lambda r: _load2(r.busiest_gpu_load)),
        ("max activated experts per rank", lambda r: r.activated_experts_per_rank_max_mean),
        ("router match", _router_match),
    ]
    prefill: list[tuple[str, str, Callable[[CompareRow], float]]] = [
        (
            "prefill all-to-all (normalized median)",
            "prefill_a2a_time_normalized_median",
            lambda r: r.prefill_time_normalized("a2a"),
        ),
        (
            "prefill MoE (normalized median)",
            "prefill_moe_time_normalized_median",
            lambda r: r.prefill_time_normalized("moe"),
        ),
        (
            "prefill inter-node bytes (normalized median)",
            "prefill_inter_node_normalized_median",
            lambda r: r.prefill_inter_node_normalized_median,
        ),
    ]
    for header, col, value in prefill:  # a decode-only trace has no prefill step: no empty columns
        if col in summary.columns and any_finite(summary[col]):
            cols.append((header, _ratio_of(value)))
    return cols


def _with_span(median: float, p10: float, p90: float) -> str:
    """A normalized figure's cell: its median and p10–p90 in one, ``0.912 (0.880–0.950)``."""
    med, span = _ratio(median), _span(p10, p90)
    return med if span == "-" else f"{med} ({span})"


def _router_match(r: CompareRow) -> str:
    return "-" if r.router_match_rate is None else f"{100 * r.router_match_rate:.0f}%"


def _load2(v: object) -> str:
    f = finite(v)
    return "-" if f is None else f"{f:.2f}"


def summary_tables(res: Results, summary: pl.DataFrame, *, key: str) -> list[Table]:
    """The summary table (the reference, then the strategies) and, when there are bound rows, a
    table of those below it under the same columns."""
    m = res.compare
    ref = STRATEGY_NAMES.get(m.reference, m.reference)
    timed = has_time(summary)
    columns = _time_columns(m, summary) if timed else _bytes_columns()
    by = summary_rows(summary, where=res.source(COMPARE_SUMMARY))
    strategies = strategies_in_order(res, summary)
    deployable = [s for s in strategies if not is_bound(s)]
    bounds = [s for s in strategies if is_bound(s)]

    def rows(names: list[str], cols: list[_Column]) -> tuple[tuple[object, ...], ...]:
        return tuple(tuple(f(by[s]) for _, f in cols) for s in names)

    if timed:
        limit = (
            "" if m.max_node_load is None else f" (deployable up to {m.max_node_load:.2f}; ⚠ marks a router over it)"
        )
        caption = (
            f"Predicted per decode step, all MoE layers: all-to-all = dispatch + combine, the busiest GPU of each "
            f"collective charged; MoE = dispatch + experts + combine (- when the model's expert size is unknown). "
            f"Medians over {m.num_batches} {held_out(m)} batches; vs median = / {ref}'s median, lower is better, with "
            f"p10–p90 over batches in brackets. Inter-node bytes are what the time comes from, not the verdict. Busiest node: held-out "
            f"requests its router sends the busiest node / an even share{limit}. Busiest GPU: its tokens / the mean "
            f"GPU's, mean over batches and layers."
        )
    else:
        caption = (
            f"Normalized to the median of {ref}; lower is better. Byte columns are medians (per batch) or means "
            "(per layer and batch)."
        )
    shown, dropped = _varying_columns(columns, [by[s] for s in strategies])
    header = tuple(h for h, _ in shown)
    if dropped:
        caption += " The same in every row, so not a column: " + "; ".join(f"{h} {v}" for h, v in dropped) + "."
    tables = [Table(key=key, header=header, rows=rows(deployable, shown), caption=caption, nowrap=timed)]
    if bounds:
        described = {b.name: b.description for b in BOUNDS}
        what = "; ".join(f"{STRATEGY_NAMES.get(s, s)}: {described[s]}" for s in bounds if s in described)
        tables.append(
            Table(
                key=f"{key}-bounds",
                header=header,
                rows=rows(bounds, shown),
                caption=f"{BOUNDS_GROUP.capitalize()} (same columns): " + (what or ", ".join(bounds)) + ".",
                nowrap=timed,
            )
        )
    return tables


def _varying_columns(columns: list[_Column], rows: list[CompareRow]) -> tuple[list[_Column], list[tuple[str, object]]]:
    """The columns whose cells differ between ``rows`` (the first, the row's name, always), and the
    (header, value) of each column that holds one value in every row (none dropped for one row)."""
    if len(rows) < 2:
        return columns, []
    shown: list[_Column] = [columns[0]]
    dropped: list[tuple[str, object]] = []
    for header, f in columns[1:]:
        cells = [f(r) for r in rows]
        if all(c == cells[0] for c in cells):
            dropped.append((header, cells[0]))
        else:
            shown.append((header, f))
    return shown, dropped


def _kib(v: float | None) -> str:
    from moetrace.sizes import human_bytes

    return "-" if v is None else human_bytes(float(v))
