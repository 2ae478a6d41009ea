"""Measured all-to-all section, from ``moetrace a2a`` results (docs/a2a.md, "Output files").

Figures (file and columns as written by ``moetrace.placement.a2a_run.write_a2a_results``;
``collectives.parquet``: one row per strategy, batch, layer, phase (dispatch/combine) and EP rank,
with ``measured_{intra,inter}_bytes``, ``predicted_{intra,inter}_bytes`` and ``seconds``):

- Measured vs predicted inter-node bytes per strategy, grouped bars: for every global batch, the
  inter-node bytes summed over MoE layers, phases and ranks; the bar is the median over batches,
  divided by the median of ``linear`` when linear was replayed (else absolute bytes). Measured
  and predicted must be equal (the replay checks them); if any (collective, rank) differs, the
  section carries a warning note and the figure a red annotation.
- Collective wall time per layer, a line per strategy and phase (dispatch solid, combine dotted):
  the median over batches and ranks of ``seconds``.
- The per-strategy summary of ``a2a.json`` (``summary``) as a table above the figures.

``a2a.json`` is read as its typed record (``records.A2AManifest``, ``Results.a2a``), never by key.

Shape legend (docs/architecture.md): V strategies, B batches, L MoE layers, W EP ranks.

Out of scope: running collectives (``moetrace.placement.a2a_run``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from moetrace import results as rf
from moetrace.dashboards.figures import lines_by_layer
from moetrace.dashboards.page import Figure, Section, Table
from moetrace.dashboards.results import Results, layer_order
from moetrace.dashboards.section_placement import STRATEGY_NAMES, strategy_colours
from moetrace.dashboards.theme import REFERENCE_LINE, finish, plotly_go

if TYPE_CHECKING:
    from moetrace.placement.replay.network import Network

#: the colour of the mismatch warning drawn on the bytes figure
WARNING_COLOUR = "#D55E00"


def _strategies(res: Results, df: pl.DataFrame) -> list[str]:
    """Strategies in run order (``a2a.json`` ``strategies``), then any others the table holds."""
    have = df["strategy"].unique().to_list()
    order = [s for s in res.a2a.strategies if s in have]
    return order + sorted(s for s in have if s not in order)


def _label(s: str) -> str:
    return STRATEGY_NAMES.get(s, s)


def mismatches(df: pl.DataFrame) -> int:
    """Rows (collective, rank) whose measured intra- or inter-node bytes differ from the prediction."""
    return int(
        df.select(
            (
                (pl.col("measured_inter_bytes") != pl.col("predicted_inter_bytes"))
                | (pl.col("measured_intra_bytes") != pl.col("predicted_intra_bytes"))
            ).sum()
        ).item()
    )


def a2a_section(res: Results, *, key_prefix: str = "") -> tuple[Section | None, list[str]]:
    kp = f"{key_prefix}a2a"
    m = res.a2a
    df = res.table(rf.A2A_COLLECTIVES)
    if df is None or df.height == 0:
        return None, [f"all-to-all measurements vs predictions: no {rf.A2A_COLLECTIVES} in {res.path}"]
    c = m.config
    setup = (
        f"{c.deployment} on {c.num_nodes} node(s) of {c.gpus_per_node} GPUs, {m.world_size} EP ranks on "
        f"{m.backend} ({m.device}); {c.num_batches} global batches of {c.batch_requests} requests; token rows of "
        f"{m.hidden_size} {m.dtype} values ({m.bytes_per_token} bytes)."
    )
    notes: list[str] = []
    bad = mismatches(df)
    if bad or not m.bytes_match:
        first = m.first_mismatch
        notes.append(
            f"WARNING: measured all-to-all bytes differ from the simulator's prediction in {bad} (collective, rank) "
            f"pair(s) of {df.height}" + (f"; first: {first}" if first else "") + ". The predictions cannot be trusted."
        )

    tables: list[Table] = []
    if m.summary:
        from moetrace.sizes import human_bytes

        tables.append(
            Table(
                key=f"{kp}-summary",
                header=(
                    "strategy",
                    "measured inter-node (normalized median)",
                    "simulated",
                    "measured inter-node / batch",
                    "dispatch time (median)",
                    "combine time (median)",
                ),
                rows=tuple(
                    (
                        _label(r.strategy),
                        r.measured_inter_node_normalized_median,
                        r.simulated_inter_node_normalized_median,
                        human_bytes(r.measured_inter_node_bytes_per_batch_median),
                        f"{1e6 * r.dispatch_seconds_median:.1f} µs",
                        f"{1e6 * r.combine_seconds_median:.1f} µs",
                    )
                    for r in m.summary
                ),
                caption=f"Normalized to the median of {_label(m.reference)}. Times: median over batches and layers "
                "of the slowest rank of each collective.",
            )
        )

    figures = [_bytes_figure(df, res, key=f"{kp}-bytes", mismatched=bad), _time_figure(df, res, key=f"{kp}-time")]
    return (
        Section(
            key=kp,
            title="Measured all-to-all vs predictions",
            intro="Each placement replayed through real all_to_all_single collectives, one process per EP rank: the "
            f"bytes every rank actually sent against the simulator's prediction, and how long each collective took. {setup}",
            tables=tuple(tables),
            figures=tuple(figures),
            notes=tuple(notes),
        ),
        [],
    )


def _bytes_figure(df: pl.DataFrame, res: Results, *, key: str, mismatched: int) -> Figure:
    go = plotly_go()
    strategies = _strategies(res, df)
    colours = strategy_colours(strategies)
    per_batch = (
        df.group_by("strategy", "batch")
        .agg(
            pl.col("measured_inter_bytes").sum().alias("measured"),
            pl.col("predicted_inter_bytes").sum().alias("predicted"),
        )
        .group_by("strategy")
        .agg(pl.col("measured").median(), pl.col("predicted").median())
    )
    by = {r["strategy"]: r for r in per_batch.iter_rows(named=True)}
    ref = "linear" if "linear" in by else None
    scale = {c: (float(by[ref][c]) if ref is not None else 1.0) for c in ("measured", "predicted")}
    names = [_label(s) for s in strategies]
    fig = go.Figure()
    for col, label, pattern in (
        ("measured", "measured (collectives)", ""),
        ("predicted", "predicted (simulator)", "/"),
    ):
        raw = np.array([float(by[s][col]) for s in strategies])
        y = raw / scale[col] if scale[col] > 0 else np.full_like(raw, np.nan)
        fig.add_trace(
            go.Bar(
                x=names,
                y=y,
                name=label,
                customdata=raw,
                marker={
                    "color": [colours[s] for s in strategies],
                    "pattern": {"shape": pattern},
                    "line": {"color": "#222", "width": 1},
                },
                hovertemplate=f"%{{x}}<br>{label}<br>"
                + ("normalized %{y:.3f}<br>" if ref else "")
                + "%{customdata:,.0f} bytes per batch<extra></extra>",
            )
        )
    if ref is not None:
        fig.add_hline(
            y=1.0,
            line={"color": REFERENCE_LINE, "dash": "dot", "width": 1.5},
            annotation={"text": f"median of {_label(ref)}", "font": {"size": 11, "color": REFERENCE_LINE}},
            annotation_position="top left",
        )
    if mismatched:
        fig.add_annotation(
            text=f"⚠ measured ≠ predicted in {mismatched} (collective, rank) pair(s)",
            xref="paper", yref="paper", x=0.5, y=1.02, xanchor="center", yanchor="bottom", showarrow=False,
            font={"size": 13, "color": WARNING_COLOUR},
        )  # fmt: skip
    fig.update_layout(
        barmode="group",
        xaxis={"title": {"text": "placement strategy"}},
        yaxis={
            "title": {
                "text": f"inter-node bytes per batch / median of {_label(ref)}" if ref else "inter-node bytes per batch"
            },
            "rangemode": "tozero",
        },
        legend={"title": {"text": "bytes"}},
    )
    finish(fig, what="Inter-node all-to-all bytes per batch: measured vs predicted", source=res.label, height=440)
    verdict = (
        f"They differ in {mismatched} (collective, rank) pair(s): see the warning above."
        if mismatched
        else "Here they are equal for every collective and rank."
    )
    norm = f", divided by the median of {_label(ref)}" if ref else ""
    return res.figure(
        key, fig, file=rf.A2A_COLLECTIVES,
        caption="Per strategy: the median over global batches of the inter-node bytes (dispatch + combine, summed over "
        f"MoE layers and EP ranks){norm}. Solid bars: bytes the real collectives sent; hatched: the simulator's "
        f"prediction. Measured and predicted must be equal, the replay moves exactly the predicted rows. {verdict}",
    )  # fmt: skip


def _time_figure(df: pl.DataFrame, res: Results, *, key: str) -> Figure:
    m = res.a2a
    strategies = _strategies(res, df)
    colours_s = strategy_colours(strategies)
    _, model_L = layer_order(df)
    med = df.group_by("strategy", "layer", "phase").agg(pl.col("seconds").median().alias("s")).sort("layer")
    series: dict[str, np.ndarray] = {}
    colours: dict[str, str] = {}
    dash: dict[str, str] = {}
    for s in strategies:
        for phase in ("dispatch", "combine"):
            sub = med.filter((pl.col("strategy") == s) & (pl.col("phase") == phase)).sort("layer")
            if sub.height == 0:
                continue
            name = f"{_label(s)} {phase}"
            series[name] = 1e6 * sub["s"].to_numpy()
            colours[name] = colours_s[s]
            dash[name] = "solid" if phase == "dispatch" else "dot"
    fig = lines_by_layer(
        series,
        layers=model_L.tolist(),
        y_title="collective wall time (µs)",
        what="All-to-all collective time per layer (median over batches and ranks)",
        source=res.label,
        colours=colours,
        dash=dash,
    )
    fig.update_yaxes(rangemode="tozero")
    return res.figure(
        key, fig, file=rf.A2A_COLLECTIVES,
        caption="Per layer: the median over batches and EP ranks of each rank's all_to_all_single wall time (barrier "
        f"first); dispatch solid, combine dotted. {links_caption(backend=m.backend, device=m.device, network=m.network)}",
    )  # fmt: skip


def links_caption(*, backend: str, device: str, network: Network | None) -> str:
    """How the run's links between nodes were realized, from ``a2a.json``'s ``network.mode``:
    ``emulated`` (a network namespace per node, inter-node links shaped to ``network.link``),
    ``loopback`` (one machine, nothing shaped), ``torchrun`` (the job's own hosts); with the backend."""
    mode = "" if network is None else network.mode
    run = f"This run: {backend} on {device}"
    if network is not None and mode == "emulated":
        shaped = (network.link or "?") + (f", {network.qdisc}" if network.qdisc else "")
        return (
            f"{run}, each node a network namespace behind an emulated, shaped inter-node link ({shaped}); "
            "intra-node traffic stays inside a namespace (loopback), so only inter-node time is emulated."
        )
    if mode == "torchrun":
        return f"{run}, ranks of a torchrun job: the timings are those of its hosts' real links."
    if mode == "loopback" or backend == "gloo" or device == "cpu":
        return (
            f"{run}, every link local loopback: the timings are indicative only and do not separate intra- from "
            "inter-node traffic."
        )
    return f"{run}."
