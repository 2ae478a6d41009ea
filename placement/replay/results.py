"""A replay's records read back: bytes checked against the plan, the summary, and the result files.

Records are what ``rank.run_rank`` gathers on rank 0 (one ``rank.RankRecord`` per rank, read by
attribute). ``first_mismatch`` compares every rank's measured bytes per link class with the send
matrices' (exact); ``summary_rows`` / ``format_summary`` rank the strategies
(``a2a_manifest.A2ASummaryRow``); ``a2a_manifest`` builds the typed ``a2a.json``
(``placement.a2a_manifest.A2AManifest``) and ``write_a2a_results`` writes it through its ``to_json``,
with ``collectives.parquet`` (``moetrace.results.A2A``).

Shape legend (docs/architecture.md): B batches, L MoE layers, W EP ranks (GPUs), V strategies.

Out of scope: running the collectives (``rank``, ``launch``), the time prediction (``predict``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from moetrace import results as rf
from moetrace.placement.a2a_manifest import A2AManifest, A2ASummaryRow
from moetrace.placement.replay.network import Network, links_line
from moetrace.placement.replay.plan import A2APlan
from moetrace.placement.replay.predict import ReplayCost, predicted_seconds_VBL, replay_cost
from moetrace.placement.replay.rank import RankRecord
from moetrace.placement.replay.sends import PHASES, A2AMismatchError, rank_link_bytes
from moetrace.sizes import human_bytes

__all__ = [
    "a2a_manifest",
    "first_mismatch",
    "format_summary",
    "raise_on_mismatch",
    "result_table",
    "summary_rows",
    "write_a2a_results",
]


def _measured(plan: A2APlan, records: Sequence[RankRecord]) -> tuple[np.ndarray, np.ndarray]:
    """Measured (intra, inter) bytes each rank sent, int64 [V, B, L, 2, W] (phase axis: dispatch, combine)."""
    W = plan.world_size
    node_W = np.arange(W) // plan.ranks_per_node
    sent = np.stack([r.sent_VBL2W for r in sorted(records, key=lambda r: r.rank)], axis=-2)  # [V,B,L,2,W src,W dst]
    inter_WW = node_W[:, None] != node_W[None, :]
    return (sent * ~inter_WW).sum(-1), (sent * inter_WW).sum(-1)


def _predicted(plan: A2APlan) -> tuple[np.ndarray, np.ndarray]:
    """Predicted (intra, inter) bytes each rank sends, int64 [V, B, L, 2, W], from the send matrices."""
    out = [
        [
            rank_link_bytes(s, phase=p, ranks_per_node=plan.ranks_per_node, bytes_per_token=plan.bytes_per_token)
            for p in PHASES
        ]
        for s in plan.sends_VBLWW
    ]
    return (
        np.stack([np.stack([o[0] for o in v], axis=2) for v in out]),
        np.stack([np.stack([o[1] for o in v], axis=2) for v in out]),
    )


def first_mismatch(plan: A2APlan, records: Sequence[RankRecord]) -> str | None:
    """The first collective whose measured bytes (per rank and link class) differ from the prediction,
    or whose received rows came from the wrong rank, as one line; None when all match exactly."""
    errors = [e for r in records for e in r.payload_errors]
    if errors:
        return errors[0]
    mi, me = _measured(plan, records)
    pi, pe = _predicted(plan)
    for cls, got, want in (("intra", mi, pi), ("inter", me, pe)):
        bad = np.argwhere(got != want)
        if len(bad):
            v, b, l, p, w = (int(x) for x in bad[0])
            return (
                f"{plan.strategies[v]} batch {b} layer {l} {PHASES[p]} rank {w}: measured {int(got[v, b, l, p, w])} "
                f"{cls}-node bytes, predicted {int(want[v, b, l, p, w])} ({len(bad)} (collective, rank) pairs differ)"
            )
    return None


def result_table(plan: A2APlan, records: Sequence[RankRecord]):
    """One row per (strategy, batch, layer, phase, rank): measured and predicted bytes, seconds (polars)."""
    import polars as pl

    V, B, L, W = plan.sends_VBLWW.shape[:4]
    mi, me = _measured(plan, records)
    pi, pe = _predicted(plan)
    secs = np.stack([r.seconds_VBL2 for r in sorted(records, key=lambda r: r.rank)], axis=-1)  # [V,B,L,2,W]
    idx = np.indices((V, B, L, 2, W)).reshape(5, -1)
    return pl.DataFrame(
        {
            "strategy": np.asarray(plan.strategies)[idx[0]],
            "batch": idx[1],
            "layer": idx[2],
            "model_layer": np.asarray(plan.model_layers or range(L), dtype=np.int64)[idx[2]],
            "phase": np.asarray(PHASES)[idx[3]],
            "rank": idx[4],
            "measured_intra_bytes": mi.reshape(-1),
            "measured_inter_bytes": me.reshape(-1),
            "predicted_intra_bytes": pi.reshape(-1),
            "predicted_inter_bytes": pe.reshape(-1),
            "seconds": secs.reshape(-1),
        }
    )


def summary_rows(plan: A2APlan, records: Sequence[RankRecord], network: Network | None = None) -> list[A2ASummaryRow]:
    """Per strategy: measured and simulated inter-node bytes per batch normalized to the reference's
    median (``linear`` when present, else the first strategy), and the median collective times (the
    slowest rank of each collective): dispatch, combine, and both of one (batch, layer)
    (``layer_seconds_median``).

    Time per batch: dispatch + combine of every layer, summed over layers (seconds; measured: the
    slowest rank of each collective). ``measured_time_normalized_median``: its median over batches
    over the reference's; on emulated nodes (``replay_cost``) ``predicted_time_normalized_median``
    the same of the cost model's seconds (``predicted_seconds_VBL``) and ``predicted_over_measured``
    their ratio (None elsewhere).
    """
    _, me = _measured(plan, records)
    meas_VB = me.sum(axis=(2, 3, 4))
    sim_VB = 2 * plan.sim_inter_VBL.sum(2)  # dispatch + combine
    ref = plan.strategies.index("linear") if "linear" in plan.strategies else 0
    secs = np.stack([r.seconds_VBL2 for r in records], axis=-1).max(-1)  # [V,B,L,2]
    time_VB = secs.sum(axis=(2, 3))
    cost = replay_cost(plan, records, network)
    pred_VB = None if cost is None else 2 * predicted_seconds_VBL(plan, cost).sum(2)

    def norm(x_VB, v):
        m = np.median(x_VB[ref])
        return float(np.median(x_VB[v]) / m) if m > 0 else float("nan")

    rows = []
    for v, s in enumerate(plan.strategies):
        pred = None if pred_VB is None else norm(pred_VB, v)
        meas = norm(time_VB, v)
        rows.append(
            A2ASummaryRow(
                strategy=s,
                reference=plan.strategies[ref],
                measured_inter_node_normalized_median=norm(meas_VB, v),
                simulated_inter_node_normalized_median=norm(sim_VB, v),
                measured_inter_node_bytes_per_batch_median=float(np.median(meas_VB[v])),
                simulated_inter_node_bytes_per_batch_median=float(np.median(sim_VB[v])),
                dispatch_seconds_median=float(np.median(secs[v, ..., 0])),
                combine_seconds_median=float(np.median(secs[v, ..., 1])),
                layer_seconds_median=float(np.median(secs[v].sum(-1))),
                measured_seconds_per_batch_median=float(np.median(time_VB[v])),
                predicted_seconds_per_batch_median=None if pred_VB is None else float(np.median(pred_VB[v])),
                measured_time_normalized_median=meas,
                predicted_time_normalized_median=pred,
                predicted_over_measured=None if pred is None else pred / meas,
            )
        )
    return rows


def _cost_line(cost: ReplayCost | None, network: Network | None) -> str:
    if cost is None:
        return "time prediction: none (the cost model's link classes need emulated nodes; " + (
            "links here are the torchrun job's)"
            if network is not None and network.mode == "torchrun"
            else "links here are all local)"
        )
    return (
        f"cost model: inter {cost.links.inter.bytes_per_s * 8 / 1e6:.4g} Mbit/s of payload per node (the link's rate / "
        f"{cost.wire_overhead:.3f} wire bytes per payload byte: TCP/IP headers, ACKs), intra (loopback, probed) "
        f"{cost.links.intra.bytes_per_s / 1e9:.2f} GB/s, fixed {cost.fixed_seconds * 1e3:.2f} ms per collective (empty probe)"
        + (f"; {cost.note}" if cost.note else "")
    )


def format_summary(plan: A2APlan, records: Sequence[RankRecord], network: Network | None = None) -> str:
    """Header lines, column titles and one row per strategy (the time columns: dispatch + combine
    summed over layers per batch, median, over the reference's; predicted: the cost model, on
    emulated nodes only)."""
    c = plan.config
    lines = [
        f"{c.deployment} ({c.num_nodes} nodes), {plan.world_size} ranks on {plan.backend} ({records[0].device}), "
        f"{c.num_batches} batches x {plan.sends_VBLWW.shape[2]} layers, hidden {plan.hidden_size} {plan.dtype}",
        links_line(network),
        _cost_line(replay_cost(plan, records, network), network),
        f"{'strategy':<12} {'measured inter (norm.)':>23} {'simulated':>10} {'inter/batch':>12} {'dispatch s':>11} {'combine s':>10} "
        f"{'layer s':>9} {'time (norm.)':>13} {'predicted':>10} {'pred/meas':>10}",
    ]

    def opt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for r in summary_rows(plan, records, network):
        lines.append(
            f"{r.strategy:<12} {r.measured_inter_node_normalized_median:>23.3f} "
            f"{r.simulated_inter_node_normalized_median:>10.3f} "
            f"{human_bytes(r.measured_inter_node_bytes_per_batch_median):>12} "
            f"{r.dispatch_seconds_median:>11.2e} {r.combine_seconds_median:>10.2e} "
            f"{r.layer_seconds_median:>9.2e} {r.measured_time_normalized_median:>13.3f} "
            f"{opt(r.predicted_time_normalized_median):>10} {opt(r.predicted_over_measured):>10}"
        )
    return "\n".join(lines)


def a2a_manifest(
    plan: A2APlan, records: Sequence[RankRecord], network: Network | None = None, *, out: str | os.PathLike
) -> A2AManifest:
    """The ``a2a.json`` of a replay written to the results directory ``out`` (the trace's path is
    recorded relative to it): the plan's provenance (``config``), the run, the byte check, the summary
    (``summary_rows``), the links (``network``) and, on emulated nodes, the cost model as realized."""
    c = plan.config
    mismatch = first_mismatch(plan, records)
    cost = replay_cost(plan, records, network)
    return A2AManifest(
        config=replace(c, trace=rf.recorded_path(c.trace, results_dir=out)),  # the trace relative to the results
        strategies=tuple(plan.strategies),
        backend=plan.backend,
        world_size=plan.world_size,
        hidden_size=plan.hidden_size,
        dtype=plan.dtype,
        bytes_per_token=plan.bytes_per_token,
        device=records[0].device,
        hosts=tuple(sorted({r.host for r in records})),
        bytes_match=mismatch is None,
        first_mismatch=mismatch,
        summary=tuple(summary_rows(plan, records, network)),
        network=network,
        cost_model=None if cost is None else cost.to_json(),
    )


def write_a2a_results(
    out: str | os.PathLike, plan: A2APlan, records: Sequence[RankRecord], network: Network | None = None
) -> list[Path]:
    """Write ``collectives.parquet`` and ``a2a.json`` (``a2a_manifest``'s ``to_json``; names, format and
    version from ``moetrace.results.A2A``; ``network``: how the links were realized); ``a2a.json`` last.
    Returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = a2a_manifest(plan, records, network, out=out)
    return [
        rf.write_result_table(out, rf.A2A, rf.A2A_COLLECTIVES, result_table(plan, records)),
        rf.write_result_json(out, rf.A2A, rf.A2A_MANIFEST, manifest.to_json()),
    ]


def raise_on_mismatch(plan: A2APlan, records: Sequence[RankRecord]) -> None:
    """Raise ``A2AMismatchError`` naming the first mismatch between measured and predicted bytes."""
    mismatch = first_mismatch(plan, records)
    if mismatch is not None:
        raise A2AMismatchError(f"measured all-to-all bytes differ from the simulator: {mismatch}")
