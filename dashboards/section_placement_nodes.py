"""What each node of a placement holds, from compare's ``placements.parquet`` and an analysis's expert load.

A table of the recommended strategy's nodes (their GPUs, the experts moved from linear's placement
and, with ``moetrace analyze`` results of the same trace, the datasets each serves and its tokens per
GPU), and two figures over every deployable strategy (a dropdown): the datasets each node serves and
the expected tokens per GPU.

Shape legend (docs/architecture.md): G nodes, W GPUs (EP ranks), D datasets, L MoE layers, E logical
experts, P physical slots.

Out of scope: placing (``moetrace.placement``); the analysis itself (``moetrace.analysis``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from moetrace.dashboards.page import Figure, Table
from moetrace.dashboards.results import Results
from moetrace.dashboards.section_placement_strategies import (
    STRATEGY_NAMES,
    is_bound,
    recommended_of,
    strategies_in_order,
)
from moetrace.dashboards.theme import DIVERGING, REFERENCE_LINE, category_colour, dropdown, finish, plotly_go
from moetrace.results import COMPARE_PLACEMENTS, EXPERT_LOAD

__all__ = ["NodeHoldings", "node_holdings", "holdings_section"]


@dataclass(frozen=True, kw_only=True)
class NodeHoldings:
    """What each node of one strategy's placement holds (``node_holdings``). Shape legend: G nodes,
    W GPUs, D datasets."""

    strategy: str  # compare's name of the strategy
    gpus_G: tuple[tuple[int, ...], ...]  # [G] the GPUs (EP ranks) of each node
    moved_G: (
        np.ndarray
    )  # float64 [G] experts per layer on the node that linear places on another node (mean over layers)
    tokens_W: np.ndarray | None  # float64 [W] expected decode tokens per GPU / an even share (None: no analysis)
    datasets: tuple[str, ...]  # [D] the datasets of the analysis (empty: no analysis)
    share_GD: np.ndarray | None  # float64 [G, D] share of dataset d's decode expert activations on node g's experts


def node_holdings(places: pl.DataFrame, strategy: str, *, load: pl.DataFrame | None) -> NodeHoldings:
    """What each node of ``strategy``'s placement holds, from ``placements.parquet`` (one row per
    strategy, layer and physical slot: its GPU, node and logical expert) and, when given, the
    analysis's ``expert_load.parquet`` rows of one stage (dataset, layer, expert, tokens).

    - moved: per layer, the experts on the node that linear's placement (``p mod E``) keeps on
      another node, mean over layers;
    - tokens per GPU: Σ over the GPU's slots of the slot's expert's tokens (dataset ``all``) split
      evenly over that expert's replicas, summed over layers, / an even share (all tokens / W): what
      the placement would give each GPU if traffic were the analysed trace's;
    - share: for each dataset, the tokens of its requests whose expert is on the node (replicas
      split evenly) / all its tokens, over every layer."""
    sub = places.filter(pl.col("strategy") == strategy).sort("layer", "slot")
    L = sub["layer"].n_unique()
    P = sub.height // L
    expert_LP = sub["expert"].to_numpy().reshape(L, P).astype(np.int64)
    gpu_P = sub["gpu"].to_numpy()[:P].astype(np.int64)
    node_P = sub["node"].to_numpy()[:P].astype(np.int64)
    G, W = int(node_P.max()) + 1, int(gpu_P.max()) + 1
    E = int(places["expert"].max()) + 1  # type: ignore[arg-type]  # polars types Series.max() as any Python literal
    # linear: slot p holds expert p mod E, on the same slots' nodes
    linear_nodes_E = [set(node_P[np.arange(P) % E == e].tolist()) for e in range(E)]
    moved_G = np.zeros(G)
    for g in range(G):
        on_g = expert_LP[:, node_P == g]
        moved_G[g] = np.mean([len({int(e) for e in row if g not in linear_nodes_E[int(e)]}) for row in on_g])
    tokens_W = share_GD = None
    datasets: tuple[str, ...] = ()
    if load is not None:
        replicas_LE = np.zeros((L, E))
        np.add.at(replicas_LE, (np.repeat(np.arange(L), P), expert_LP.ravel()), 1.0)
        names = sorted(set(load["dataset"].unique().to_list()) - {"all"})

        def tokens_LE(ds: str) -> np.ndarray:
            rows = load.filter(pl.col("dataset") == ds)
            out = np.zeros((L, E))
            np.add.at(out, (rows["layer"].to_numpy(), rows["expert"].to_numpy()), rows["tokens"].to_numpy())
            return out

        def per_slot(t_LE: np.ndarray) -> np.ndarray:  # [L, P] the slot's expert's tokens / its replicas
            return np.take_along_axis(t_LE / np.maximum(replicas_LE, 1.0), expert_LP, axis=1)

        every = per_slot(tokens_LE("all")).sum(axis=0)
        tokens_W = np.bincount(gpu_P, weights=every, minlength=W) / max(every.sum() / W, 1e-12)
        share_GD = np.zeros((G, len(names)))
        for d, ds in enumerate(names):
            s_P = per_slot(tokens_LE(ds)).sum(axis=0)
            share_GD[:, d] = np.bincount(node_P, weights=s_P, minlength=G) / max(s_P.sum(), 1e-12)
        datasets = tuple(names)
    gpus_G = tuple(tuple(sorted(set(gpu_P[node_P == g].tolist()))) for g in range(G))
    return NodeHoldings(
        strategy=strategy, gpus_G=gpus_G, moved_G=moved_G, tokens_W=tokens_W, datasets=datasets, share_GD=share_GD
    )


def _stage_load(res: Results, analyses: Sequence[Results]) -> tuple[pl.DataFrame | None, str]:
    """The decode rows (else prefill) of ``expert_load.parquet`` of an analysis of the same trace as
    these compare results, and the stage; (None, why) when none is given or matches."""
    tp = res.trace_path
    same = [
        a for a in analyses if tp is not None and a.trace_path is not None and a.trace_path.resolve() == tp.resolve()
    ]
    for a in same:
        load = a.table(EXPERT_LOAD)
        if load is None:
            continue
        for stage in ("decode", "prefill"):
            rows = load.filter(pl.col("stage") == stage)
            if rows.height and int(rows["expert"].max()) + 1 == res.compare.model.num_experts:  # type: ignore[arg-type]
                return rows, stage
    what = "load profile" if res.profile_path is not None else "trace"
    return (
        None,
        f"give `moetrace analyze` results of the same {what} to see the datasets each node serves and its tokens per GPU",
    )


def holdings_section(
    places: pl.DataFrame, res: Results, analyses: Sequence[Results], *, key: str
) -> tuple[list[Table], list[Figure], list[str]]:
    """A table of what each node of the recommended strategy holds, and, with an analysis of the same
    trace, two figures over every deployable strategy (a dropdown): the datasets each node serves
    and the expected tokens per GPU."""
    strategies = [s for s in strategies_in_order(res, places) if not is_bound(s)]
    if not strategies:
        return [], [], []
    load, stage_or_why = _stage_load(res, analyses)
    notes = [] if load is not None else [f"What each node holds: {stage_or_why}."]
    rec = recommended_of(strategies)
    first = [s for s in strategies if s == rec] + [s for s in strategies if s != rec]
    held = {s: node_holdings(places, s, load=load) for s in first}  # the recommended first: the dropdowns open on it
    shown = first[0]
    h = held[shown]
    header = ["node", "GPUs", "experts moved from linear (per layer)"]
    if h.share_GD is not None:
        header[2:2] = ["datasets it serves (share of each one's activations)", "tokens per GPU / even share"]

    def serves(g: int) -> str:
        assert h.share_GD is not None
        order = np.argsort(-h.share_GD[g])
        return ", ".join(f"{h.datasets[d]} {100 * h.share_GD[g, d]:.0f}%" for d in order[:3])

    rows = []
    for g, gpus in enumerate(h.gpus_G):
        row: list[object] = [g, f"{gpus[0]}–{gpus[-1]}" if len(gpus) > 1 else str(gpus[0])]
        if h.share_GD is not None and h.tokens_W is not None:
            t = h.tokens_W[list(gpus)]
            row += [serves(g), f"{t.mean():.2f} (busiest {t.max():.2f})"]
        row.append(f"{h.moved_G[g]:.1f} of {res.compare.model.num_experts}")
        rows.append(tuple(row))
    name = STRATEGY_NAMES.get(shown, shown)
    even = 100 / len(h.gpus_G)
    caption = (
        f"What each node of {name} holds. Experts moved: per layer, the experts on the node that linear keeps on "
        "another node (mean over layers)."
        + (
            f" From the analysis's {stage_or_why} expert load: a dataset's share is the part of its tokens' expert "
            f"activations whose expert sits on the node (top three; {even:.0f}% each is no specialisation); tokens per "
            "GPU: the tokens its experts would receive / an even share (mean over the node's GPUs, and its busiest)."
            if load is not None
            else ""
        )
    )
    tables = [Table(key=f"{key}-nodes", header=tuple(header), rows=tuple(rows), caption=caption)]
    figures = (
        []
        if load is None
        else [_share_figure(held, res, key=f"{key}-serves"), _tokens_figure(held, res, key=f"{key}-tokens")]
    )
    return tables, figures, notes


def _share_figure(held: dict[str, NodeHoldings], res: Results, *, key: str) -> Figure:
    """Node × dataset heatmap of the share of each dataset's activations on the node's experts, a
    strategy per dropdown entry (the recommended one first)."""
    go = plotly_go()
    names = list(held)
    first = held[names[0]]
    assert first.share_GD is not None
    G = len(first.gpus_G)
    fig = go.Figure()
    for i, s in enumerate(names):
        share = held[s].share_GD
        assert share is not None
        fig.add_trace(
            go.Heatmap(
                z=share,
                x=list(first.datasets),
                y=[f"node {g}" for g in range(G)],
                zmin=0.0,
                zmax=min(1.0, 2.0 / G),  # white at an even share (1/G), red above, blue below
                colorscale=DIVERGING,
                reversescale=True,
                texttemplate="%{z:.0%}",
                visible=i == 0,
                name=STRATEGY_NAMES.get(s, s),
                colorbar={
                    "title": {"text": f"share (even: {100 / G:.0f}%)", "side": "right"},
                    "thickness": 14,
                    "tickformat": ".0%",  # the cells' unit
                },
                hovertemplate=f"{STRATEGY_NAMES.get(s, s)}<br>%{{y}} holds the experts of %{{z:.1%}} of %{{x}}'s "
                "activations<extra></extra>",
            )
        )
    vis = [[j == i for j in range(len(names))] for i in range(len(names))]
    fig.update_layout(
        updatemenus=dropdown([STRATEGY_NAMES.get(s, s) for s in names], vis, prefix=""),
        xaxis={"title": {"text": "dataset"}, "type": "category"},
        yaxis={"title": {"text": "node"}, "type": "category", "autorange": "reversed"},
    )
    finish(fig, what="Datasets each node serves", source=res.label,
           height=max(380, 160 + 40 * G))  # fmt: skip
    return res.figure(
        key,
        fig,
        file=COMPARE_PLACEMENTS,
        caption=f"Each cell: the share of a dataset's expert activations (analysis of the same trace or profile) whose expert "
        f"this node holds, replicas split evenly; a column sums to 100%. An even spread ({100 / G:.0f}% each) "
        "means the node serves no dataset in particular; a data-based placement gathers a dataset's experts on its "
        "node, so its requests stay there.",
    )


def _tokens_figure(held: dict[str, NodeHoldings], res: Results, *, key: str) -> Figure:
    """Expected tokens per GPU / an even share, bars coloured by node, a strategy per dropdown entry."""
    go = plotly_go()
    names = list(held)
    fig = go.Figure()
    for i, s in enumerate(names):
        h = held[s]
        assert h.tokens_W is not None
        node_W = np.zeros(h.tokens_W.size, dtype=np.int64)
        for g, gpus in enumerate(h.gpus_G):
            node_W[list(gpus)] = g
        fig.add_trace(
            go.Bar(
                x=np.arange(h.tokens_W.size),
                y=h.tokens_W,
                marker_color=[category_colour(int(g)) for g in node_W],
                customdata=node_W,
                visible=i == 0,
                name=STRATEGY_NAMES.get(s, s),
                hovertemplate=f"{STRATEGY_NAMES.get(s, s)}<br>GPU %{{x}} (node %{{customdata}})<br>"
                "tokens / even share %{y:.2f}<extra></extra>",
            )
        )
    vis = [[j == i for j in range(len(names))] for i in range(len(names))]
    fig.add_hline(y=1.0, line={"color": REFERENCE_LINE, "dash": "dot", "width": 1.5})
    fig.update_layout(
        updatemenus=dropdown([STRATEGY_NAMES.get(s, s) for s in names], vis, prefix=""),
        showlegend=False,
        xaxis={"title": {"text": "GPU (EP rank), coloured by node"}},
        yaxis={"title": {"text": "expected tokens / even share"}, "rangemode": "tozero"},
    )
    finish(fig, what="Expected tokens per GPU", source=res.label, height=400)
    return res.figure(
        key,
        fig,
        file=COMPARE_PLACEMENTS,
        caption="Per GPU: the tokens its experts would receive if traffic were the analysed input's (each expert's "
        "tokens split evenly over its replicas, summed over layers) / an even share; 1 (dotted) is balanced. The "
        "busiest GPU sets the step's expert time.",
    )
