"""compare.json's ``verdict`` (``compare_manifest.CompareVerdict``): the deployable strategies within the
node-load limit ranked by the verdict's measure (``compare_verdict``), and per stage the one decision
rule's choice (``compare_stage_choices``, ``decision.choose``: the rule ``advise`` applies too).

Shape legend (docs/architecture.md): B steps, L MoE layers (the metrics' arrays are [B, L]).

Out of scope: simulating the strategies (``compare``); the rule itself (``decision``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from moetrace.placement.compare_manifest import CompareVerdict
from moetrace.placement.compare_placing import PlacedStrategy
from moetrace.placement.compare_steps import Measure, inter_bytes_BL, seconds_median

if TYPE_CHECKING:
    from moetrace.placement.decision import StageChoice

__all__ = ["compare_stage_choices", "compare_verdict", "within_limit"]


def within_limit(ps: PlacedStrategy) -> bool:
    """Whether a simulated strategy kept its busiest node within the node-load limit (``node_load_limit``:
    the limit integer counts of the held-out requests can meet)."""
    return ps.extra["busiest_node_load"] <= ps.extra["node_load_limit"] + 1e-9


def compare_verdict(
    metrics: dict[str, dict[str, np.ndarray]],
    placed: dict[str, PlacedStrategy],
    strategies: Sequence[str],
    *,
    reference: str,
    measure: Measure,
    stages: dict[str, StageChoice] | None = None,
) -> CompareVerdict:
    """compare.json's ``verdict``: the deployable strategies (``strategies``, bounds never) within the
    node-load limit ranked by ``measure``'s median per step (ties: the recommended strategy first, then
    the given order), the first of them recommended; those over the limit listed apart. Each strategy's
    median in ``measure`` and in all-to-all time, over the reference's; ``stages``: the decision per
    stage (``compare_stage_choices``)."""
    from moetrace.placement.strategies import RECOMMENDED

    def ratio(s: str, what: Measure) -> float:
        ref = seconds_median(metrics[reference], what)
        return round(seconds_median(metrics[s], what) / ref, 6) if ref > 0 else float("nan")

    order = {s: i for i, s in enumerate(strategies)}
    within = [s for s in strategies if within_limit(placed[s])]
    ranking = sorted(within, key=lambda s: (round(seconds_median(metrics[s], measure), 15), s != RECOMMENDED, order[s]))
    return CompareVerdict(
        measure="moe_time" if measure == "moe" else "a2a_time",
        ranking=tuple(ranking),
        recommended=ranking[0] if ranking else None,
        over_node_load_limit=tuple(s for s in strategies if s not in within),
        time_normalized={s: ratio(s, measure) for s in strategies},
        a2a_time_normalized={s: ratio(s, "a2a") for s in strategies},
        stages=dict(stages or {}),
    )


def compare_stage_choices(
    decode: dict[str, dict[str, np.ndarray]],
    prefill: dict[str, dict[str, np.ndarray]],
    placed: dict[str, PlacedStrategy],
    strategies: Sequence[str],
    reference: str,
    measure: Measure,
    num_redundant: int,
) -> dict[str, StageChoice]:
    """compare.json's ``verdict.stages``: per simulated stage the decision over ``strategies`` (bounds
    never) by ``decision.choose``, the rule ``advise`` and the dashboard card apply too."""
    from moetrace.placement.decision import Candidate, choose, option_key

    def over(x: float, r: float) -> float:
        return x / r if r > 0 else float("nan")

    def inter(m: dict[str, np.ndarray]) -> float:
        return float(np.median(inter_bytes_BL(m).sum(1)))

    out = []
    for stage, metrics in (("decode", decode), ("prefill", prefill)):
        if reference not in metrics:
            continue
        ref = metrics[reference]
        cands = [
            Candidate(
                option=option_key(s, num_redundant),
                strategy=s,
                num_redundant=num_redundant,
                time=over(seconds_median(metrics[s], measure), seconds_median(ref, measure)),
                a2a=over(seconds_median(metrics[s], "a2a"), seconds_median(ref, "a2a")),
                inter=over(inter(metrics[s]), inter(ref)),
                deployable=within_limit(placed[s]),
            )
            for s in strategies
            if s in metrics
        ]
        what = "MoE-layer time" if measure == "moe" else "all-to-all time"
        out.append(choose(stage, cands, reference=option_key(reference, num_redundant), measure=what))
    return {c.stage: c for c in out}
