"""Placement section, from ``moetrace compare`` results (docs/placement.md, core paper Fig. 9).

Figures (files and columns as written by ``moetrace.placement.compare.write_results``):

- Predicted time per step, normalized, a box per strategy over the simulated global batches (results
  written with the cost model, ``placement/cost.py``): ``batches.parquet`` ``a2a_time_normalized``
  (decode all-to-all, dispatch + combine, all MoE layers, the busiest GPU of each collective
  charged) and ``moe_time_normalized`` (the MoE layer: dispatch + experts + combine; drawn when the
  model's expert size was known), each a batch's seconds / the reference's median.
- Predicted all-to-all time per layer: median over batches of ``layers.parquet``
  ``dispatch_seconds + combine_seconds``.
- Normalized inter-node volume per strategy, a box per strategy over the simulated global batches:
  ``batches.parquet`` ``inter_node_normalized`` = a batch's inter-node bytes (dispatch + combine,
  all MoE layers) / the median of the reference strategy's (linear). Lower is better; the dotted
  line is the reference median (1).
- Per-layer inter-node share, a line per strategy: for each layer, Σ over batches of inter-node
  bytes / Σ of all bytes (intra + inter, dispatch + combine), from ``layers.parquet``.
- Per-layer normalized inter-node volume: median over batches of ``layers.parquet``
  ``inter_node_normalized`` (per layer, to the reference's median of that layer).
- Placement map, layer × GPU: the logical expert in every physical slot, slots grouped by GPU
  (``placements.parquet``: strategy, layer, model_layer, slot, gpu, node, expert), a dropdown per
  strategy; node boundaries drawn as lines.
- The summary table (``summary.parquet``) above the figures: predicted time per step first (when
  the results have it), then bytes, node and GPU load; bound rows (not deployable) in a table of
  their own below it. Results written before the cost model have no time columns: the table and
  figures show bytes alone, as they always did.

Measured all-to-all (replayed through real collectives by ``moetrace a2a``) against these predictions
is drawn by ``section_a2a`` from that command's results directory.

Shape legend (docs/architecture.md): V strategies, B global batches, L MoE layers, P physical
slots, W GPUs (EP ranks).

This module builds the section (``placement_section``, the builder ``sections.SECTIONS`` names); its
parts live beside it, and the names other modules import are re-exported here: the strategies'
labels, colours and order (``section_placement_strategies``), the results in words
(``section_placement_text``), the summary table (``section_placement_table``), the figures of batches
and layers (``section_placement_figures``), what each node holds (``section_placement_nodes``).

Out of scope: placing or simulating (``moetrace.placement``).
"""

from __future__ import annotations

from collections.abc import Sequence

from moetrace.dashboards.page import Figure, Section, Table
from moetrace.dashboards.results import Results
from moetrace.dashboards.section_placement_figures import (
    A2A_TIME_BOX,
    BYTES_BOX,
    MOE_TIME_BOX,
    box_by_strategy,
    per_layer,
    ratio_range,
    time_per_layer,
)
from moetrace.dashboards.section_placement_nodes import NodeHoldings, holdings_section, node_holdings
from moetrace.dashboards.section_placement_strategies import (
    BOUNDS_GROUP,
    RECOMMENDED_COLOUR,
    STRATEGY_NAMES,
    is_bound,
    recommended_of,
    strategy_colours,
)
from moetrace.dashboards.section_placement_table import node_load_text, summary_tables
from moetrace.dashboards.section_placement_text import (
    COPY_MODELS,
    TIME_COLUMN,
    any_finite,
    copy_models,
    finite,
    has_time,
    held_out,
    links_text,
    stage_copy_model,
)
from moetrace.results import COMPARE_BATCHES, COMPARE_LAYERS, COMPARE_PLACEMENTS, COMPARE_SUMMARY

__all__ = [
    "BOUNDS_GROUP",
    "COPY_MODELS",
    "RECOMMENDED_COLOUR",
    "STRATEGY_NAMES",
    "TIME_COLUMN",
    "NodeHoldings",
    "copy_models",
    "finite",
    "has_time",
    "held_out",
    "is_bound",
    "links_text",
    "node_holdings",
    "node_load_text",
    "placement_section",
    "ratio_range",
    "recommended_of",
    "stage_copy_model",
    "strategy_colours",
]


def placement_section(
    res: Results, *, key_prefix: str = "", analyses: Sequence[Results] = ()
) -> tuple[Section | None, list[str]]:
    """The placement section of one compare results directory; ``analyses``: analyze results, of which
    one of the same trace (if any) tells which datasets each node serves."""
    kp = f"{key_prefix}placement"
    figures: list[Figure] = []
    notes: list[str] = []
    tables: list[Table] = []
    m = res.compare
    ref = m.reference
    summary = res.table(COMPARE_SUMMARY)
    timed = summary is not None and has_time(summary)
    placed = f"{m.deployment} on {m.num_nodes} node(s) of {m.gpus_per_node} GPUs; " + (
        f"{m.num_train_requests} requests placed, {m.num_test_requests} held out for evaluation; "
        if m.tokens_from is None
        else f"{m.tokens_from}; "
    )
    steps = "" if m.tokens_from is not None else f" (global batches of {m.batch_requests} requests)"
    if timed:
        prefill = f" and {m.num_prefill_batches} prefill steps" if m.num_prefill_batches else ""
        setup = (
            f"{placed}{m.num_batches} decode steps{steps}{prefill}; "
            f"copies: {copy_models(m)}; links: {links_text(m, latency=True)}; "
            f"replica policy {m.replica_policy}, {m.num_redundant} redundant slot(s) per layer."
        )
    else:
        setup = (
            f"{placed}{m.num_batches} global batches of {m.batch_requests} requests; "
            f"dedup per {m.dedup}, replica policy {m.replica_policy}, "
            f"{m.num_redundant} redundant slot(s) per layer."
        )
    if summary is not None:
        tables.extend(summary_tables(res, summary, key=f"{kp}-summary"))

    batches = res.table(COMPARE_BATCHES)
    if batches is not None:
        if "a2a_time_normalized" in batches.columns:
            figures.append(box_by_strategy(batches, res, ref=ref, key=f"{kp}-time", view=A2A_TIME_BOX))
        if "moe_time_normalized" in batches.columns and any_finite(batches["moe_time_normalized"]):
            figures.append(box_by_strategy(batches, res, ref=ref, key=f"{kp}-moe-time", view=MOE_TIME_BOX))
        figures.append(box_by_strategy(batches, res, ref=ref, key=f"{kp}-normalized", view=BYTES_BOX))
    else:
        notes.append("batches.parquet absent: no normalized-volume figure")

    layers = res.table(COMPARE_LAYERS)
    if layers is not None:
        if {"dispatch_seconds", "combine_seconds"} <= set(layers.columns):
            figures.append(time_per_layer(layers, res, key=f"{kp}-layers-time"))
        figures.extend(per_layer(layers, res, ref=ref, key=f"{kp}-layers"))
    else:
        notes.append("layers.parquet absent: no per-layer figures")

    places = res.table(COMPARE_PLACEMENTS)
    if places is not None:
        node_tables, node_figures, node_notes = holdings_section(places, res, analyses, key=kp)
        tables.extend(node_tables)
        figures[1:1] = node_figures  # after the time per step: what the winner's nodes hold
        notes.extend(node_notes)
    else:
        notes.append("placements.parquet absent: no table of what each node holds")

    if not figures and not tables:
        return None, [f"placement: no compare results in {res.path}"]
    return (
        Section(
            key=kp,
            title="Placement and all-to-all volume",
            intro=(_TIMED_INTRO if timed else _BYTES_INTRO).replace(
                "on requests it never saw",
                "on the load profile's tokens" if m.tokens_from is not None else "on requests it never saw",
            )
            + setup,
            tables=tuple(tables),
            figures=tuple(figures),
            notes=tuple(notes),
        ),
        [],
    )


_BYTES_INTRO = (
    "Which experts live on which GPU, and how much all-to-all traffic each placement causes on requests it never saw. "
)
_TIMED_INTRO = (
    "Which experts live on which GPU, and what each placement costs per step on requests it never saw: predicted "
    "all-to-all and MoE-layer time first, then the bytes they come from. "
)
