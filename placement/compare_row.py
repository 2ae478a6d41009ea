"""``summary.parquet``'s row, typed: one strategy (or upper bound) of a ``moetrace compare`` run.

``CompareRow`` is what ``compare_result.CompareResult.summary_rows`` builds, what the printed table
(``report``) reads, and what ``compare_result.write_results`` writes as ``summary.parquet``
(``to_row``: one column per field, in field order, values as built, so the file is the same bytes as
when the rows were dicts) and every reader gets back (``from_row``: the dashboard's placement section,
its card and the demo's closing lines read its fields, never the table's column names). The two
predicted times are read through ``time_normalized`` / ``prefill_time_normalized`` with a
``Measure`` (``"moe"``: dispatch + experts + combine; ``"a2a"``: dispatch + combine).

Ratios ``*_normalized_*`` are over the reference strategy's median over steps (NaN when that median is
0 or a term is unknown); ``*_p10`` / ``*_p90`` are the 10th and 90th percentile over steps of the same
ratio. Time columns are of decode steps unless prefixed ``prefill_``.

``summary.parquet`` gained columns over time (the cost model, the node-load limit, the oracle's share,
prefill steps): ``from_row`` reads a file without them with their meaning from before
(``COMPARE_ROW_LATER_KEYS``: NaN for a figure not computed then, None or False for what was not said).

Out of scope: computing the row (``compare_result``); compare.json (``compare_manifest``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from moetrace.results import COMPARE, COMPARE_SUMMARY, ManifestFields

__all__ = ["COMPARE_ROW_LATER_KEYS", "SUMMARY_COLUMNS", "CompareRow", "Measure", "Quantile"]

#: a predicted time per step: MoE layers (dispatch + experts + combine) or the all-to-all (dispatch + combine)
Measure = Literal["moe", "a2a"]
#: a statistic over steps of a normalized figure
Quantile = Literal["median", "p10", "p90"]

_NAN = float("nan")


@dataclass(frozen=True, kw_only=True)
class CompareRow:
    """One strategy or bound of ``summary.parquet`` (fields in the order of its columns)."""

    strategy: str  # the strategy's registry name, or the bound's (strategies.BOUNDS)
    is_bound: bool  # an upper bound (what the trace's structure allows), not a deployable strategy
    a2a_time_normalized_median: float  # predicted dispatch + combine per decode step / the reference's median
    a2a_time_normalized_p10: float  # its 10th percentile over steps
    a2a_time_normalized_p90: float  # its 90th percentile over steps
    moe_time_normalized_median: float  # dispatch + experts + combine per step, likewise (NaN: expert size unknown)
    moe_time_normalized_p10: float  # its 10th percentile over steps
    moe_time_normalized_p90: float  # its 90th percentile over steps
    a2a_seconds_per_step_median: float  # predicted seconds of dispatch + combine per decode step, median
    moe_seconds_per_step_median: float  # predicted seconds of the MoE layers per decode step, median
    busiest_node_load: (
        float | None
    )  # held-out requests its router sends the busiest node / an even share; None: no router
    over_node_load_limit: bool  # that load is over compare's ``--max-node-load``: not deployable
    busiest_gpu_load: float  # the busiest GPU's tokens / the mean GPU's, mean over steps and layers
    oracle_captured: float | None  # share of the oracle's saving over linear it reaches; None: no oracle, or noise
    inter_node_normalized_median: float  # inter-node bytes of a decode step / the reference's median
    inter_node_normalized_p10: float  # its 10th percentile over steps
    inter_node_normalized_p90: float  # its 90th percentile over steps
    inter_node_bytes_per_batch_median: float  # inter-node bytes per step (dispatch + combine, all layers), median
    intra_node_bytes_per_batch_median: float  # intra-node bytes per step, median
    max_rank_dispatch_send_bytes_mean: float  # bytes the busiest rank sends in one layer's dispatch, mean
    tokens_per_rank_max_mean: float  # tokens of the busiest rank per (step, layer), mean
    activated_experts_per_rank_max_mean: float  # activated experts of the busiest rank per (step, layer), mean
    router_match_rate: (
        float | None
    )  # share of held-out requests routed from prefill as their decode would be; None: no router
    groups_without_routed_requests: int  # nodes no held-out request was routed to (they idle every step)
    prefill_a2a_time_normalized_median: (
        float  # predicted dispatch + combine per prefill step / the reference's (NaN: none)
    )
    prefill_moe_time_normalized_median: float  # the MoE layers per prefill step, likewise
    prefill_inter_node_normalized_median: float  # inter-node bytes of a prefill step, likewise

    # ---------------------------------------------------------------- the two predicted times
    def time_normalized(self, measure: Measure, quantile: Quantile = "median") -> float:
        """``measure`` per decode step over the reference's median: its median over steps (``p10``,
        ``p90``: those percentiles)."""
        if measure == "moe":
            return {
                "median": self.moe_time_normalized_median,
                "p10": self.moe_time_normalized_p10,
                "p90": self.moe_time_normalized_p90,
            }[quantile]
        return {
            "median": self.a2a_time_normalized_median,
            "p10": self.a2a_time_normalized_p10,
            "p90": self.a2a_time_normalized_p90,
        }[quantile]

    def prefill_time_normalized(self, measure: Measure) -> float:
        """``measure`` per prefill step over the reference's median, median over steps (NaN: no prefill step)."""
        return self.prefill_moe_time_normalized_median if measure == "moe" else self.prefill_a2a_time_normalized_median

    # ---------------------------------------------------------------- summary.parquet
    def to_row(self) -> dict[str, Any]:
        """The row as the Parquet writer takes it: column -> value, in column order, values as built."""
        return {name: getattr(self, name) for name in SUMMARY_COLUMNS}

    @classmethod
    def from_row(cls, row: Mapping[str, Any], *, where: str = COMPARE_SUMMARY) -> CompareRow:
        """The row read back (``polars.DataFrame.iter_rows(named=True)``); a column of another type is a
        ``TraceFormatError`` naming ``where`` and the column; a column the file predates reads as
        ``COMPARE_ROW_LATER_KEYS`` says (a null figure as NaN)."""
        r = ManifestFields(dict(row), where, kind=COMPARE, later=COMPARE_ROW_LATER_KEYS)
        figures = {k: _nan_if_none(r.number(k, optional=True)) for k in _FIGURES}
        return cls(
            strategy=r.text("strategy"),
            is_bound=bool(r.get("is_bound", bool, optional=True)),
            busiest_node_load=r.number("busiest_node_load", optional=True),
            over_node_load_limit=bool(r.get("over_node_load_limit", bool, optional=True)),
            oracle_captured=r.number("oracle_captured", optional=True),
            router_match_rate=r.number("router_match_rate", optional=True),
            groups_without_routed_requests=int(r.get("groups_without_routed_requests", int, optional=True) or 0),
            **figures,
        )


def _nan_if_none(v: float | None) -> float:
    return _NAN if v is None else v


#: summary.parquet's columns, in order (``CompareRow``'s fields)
SUMMARY_COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CompareRow))
#: the columns ``from_row`` reads one by one; every other is a figure (null or absent: NaN)
_NOT_FIGURES = (
    "strategy",
    "is_bound",
    "busiest_node_load",
    "over_node_load_limit",
    "oracle_captured",
    "router_match_rate",
    "groups_without_routed_requests",
)
_FIGURES: tuple[str, ...] = tuple(c for c in SUMMARY_COLUMNS if c not in _NOT_FIGURES)
#: columns summary.parquet gained after its format was stamped -> their value in files that lack them
#: (the bytes columns too: a table holding only some columns, as tests and hand-made files do, still reads)
COMPARE_ROW_LATER_KEYS: dict[str, Any] = {
    **{c: _NAN for c in _FIGURES},  # a figure not computed then (the time columns came with the cost model)
    "is_bound": False,  # the bounds' rows came later
    "busiest_node_load": None,  # the node-load limit came later: not said
    "over_node_load_limit": False,
    "oracle_captured": None,
    "router_match_rate": None,
    "groups_without_routed_requests": 0,
}
