"""The text ``moetrace place`` and ``moetrace compare`` print, as plain strings.

``format_compare_summary``: a header line (deployment, train/test split, batches, dedup unit) and
one aligned row per strategy (normalized inter-node median, p10, p90, inter-node bytes per batch,
router match rate, node load: held-out requests routed to the busiest node over an even share).
``compare_notes``: one line per strategy whose micro-batches had to draw from all test requests
because no held-out request was routed to some of its groups.
``format_placement_summary``: the one line ``place`` prints.

Out of scope: computing anything (``compare``); colours and streams (the CLI decides where notes go).
"""

from __future__ import annotations

from moetrace.placement.compare import CompareResult, PlacedStrategy
from moetrace.placement.strategies import get_strategy
from moetrace.sizes import human_bytes

__all__ = ["format_compare_summary", "compare_notes", "format_placement_summary"]


def format_compare_summary(result: CompareResult) -> str:
    """Header line, column titles, one row per strategy, then the bounds (lower normalized volume is
    better; ``node load``: held-out requests routed to the busiest node over an even share, for
    strategies that route requests; ``of oracle``: the share of the oracle's saving over linear a row
    reaches)."""
    c = result.manifest
    lines = [
        f"{c.deployment} ({c.num_nodes} nodes), {c.num_train_requests} train / {c.num_test_requests} "
        f"test requests, {c.num_batches} batches of {c.batch_requests} requests, dedup={c.dedup}",
        f"{'strategy':<16} {'inter-node (norm. median)':>26} {'p10':>6} {'p90':>6} {'inter/batch':>12} {'router':>7} "
        f"{'node load':>9} {'of oracle':>9}",
    ]
    rows = result.summary_rows()
    for i, r in enumerate(rows):
        if r["is_bound"] and (i == 0 or not rows[i - 1]["is_bound"]):
            kinds = sorted({k for k in c.bound_kinds.values() if k})
            lines.append(
                "upper bounds (they see the held-out requests' decode; not deployable"
                + (f"; from {', '.join(kinds)}" if kinds and kinds != ["joint"] else "")
                + "):"
            )
        router = f"{r['router_match_rate']:.0%}" if r["router_match_rate"] is not None else "-"
        load = f"{r['busiest_node_load']:.2f}" if r.get("busiest_node_load") is not None else "-"
        cap = r["oracle_captured"]
        # worse than linear: "<0%" (the ratio explodes when the oracle saves little); no "-0%"
        captured = "-" if cap is None else "<0%" if round(cap, 2) < 0 else f"{round(cap, 2) or 0.0:.0%}"
        lines.append(
            f"{r['strategy']:<16} {r['inter_node_normalized_median']:>26.3f} {r['inter_node_normalized_p10']:>6.3f} "
            f"{r['inter_node_normalized_p90']:>6.3f} {human_bytes(r['inter_node_bytes_per_batch_median']):>12} "
            f"{router:>7} {load:>9} {captured:>9}"
        )
    if c.expert_copy_floor is not None:  # dedup expert, no redundancy: a proven bound, not a placement
        J = result.model.num_experts // c.num_nodes
        lines.append(
            f"{'floor':<16} {c.expert_copy_floor:>26.3f}  proven for any placement with evenly loaded nodes: "
            f"each held-out request on a node of its own top {J} experts per layer"
        )
    return "\n".join(lines)


def compare_notes(result: CompareResult) -> list[str]:
    """``note: ...`` lines: groups that no held-out request was routed to; strategies that split a
    group-limited router's expert groups over nodes when copies are counted per node (empty when none)."""
    notes = [
        f"note: {r['strategy']}: {r['groups_without_routed_requests']} group(s) had no held-out request routed "
        "to them; their micro-batches drew from all test requests (more requests or fewer clusters avoid this)"
        for r in result.summary_rows()
        if r["groups_without_routed_requests"]
    ]
    m, c = result.model, result.manifest
    splitters = [s for s in c.strategies if not get_strategy(s).keeps_groups(num_redundant=c.num_redundant)]
    per_node = c.dedup == "node" or (c.dedup == "rank" and c.ranks_per_node == 1)  # one GPU a node
    if m.group_limited and per_node and splitters:
        notes.append(
            f"note: {m.name}'s router sends each token to at most {m.topk_group} of its {m.n_group} expert groups; "
            f"placements that keep each group on one node (EPLB's hierarchical policy, joint_aligned) bound the nodes a "
            f"token reaches, {', '.join(splitters)} place experts one by one and lose that bound (docs/placement.md)"
        )
    return notes


def format_placement_summary(ps: PlacedStrategy, *, deployment: str) -> str:
    """``<strategy> placement for <deployment>: <P> slots x <L> layers[, router match <rate>]``."""
    L, P = ps.placement.phy2log.shape
    router = f", router match {ps.router_match_rate:.1%}" if ps.router_match_rate is not None else ""
    return f"{ps.strategy} placement for {deployment}: {P} slots x {L} layers{router}"
