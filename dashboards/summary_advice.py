"""The summary card's decision headline, from ``moetrace advise`` results (``advice.json`` ``best``):
each stage's decision by the one rule (``placement.decision``: predicted MoE-layer time per step,
the straggler charged; under 3 % saved, keep the reference) over advise's options, with every cost
of the chosen option, and how ``compare``'s answer relates when compare results are on the page too.

Out of scope: computing the advice (``placement.advise``), the card's HTML (``page``).
"""

from __future__ import annotations

from moetrace import results as rf
from moetrace.dashboards.page import Headline
from moetrace.dashboards.results import Results
from moetrace.placement.decision import MIN_GAIN, StageChoice, label, objective, pct, relation

__all__ = ["advice_headline", "compare_relation_line"]


def advice_headline(res: Results, *, key_prefix: str = "", suffix: str = "") -> Headline | None:
    """``Decision per stage``: decode's decision as the number, one line per stage (None when the
    advice has no ``best``: written before it)."""
    m = res.advice
    choices = m.best
    if not choices:
        return None
    ref = m.reference
    lead = choices.get("decode") or next(iter(choices.values()))
    if lead.decision == ref or lead.best is None:
        value, label_ = f"keep {ref}", f"{lead.stage}: {lead.why}"
    else:
        value, label_ = pct(lead.time).replace(" ", ""), f"{lead.stage}: {label(lead.decision)}"
    detail = (
        f"Per stage, the option to deploy by one rule, the one compare applies too: {objective(lead.measure)}; "
        f"under {MIN_GAIN:.0%} saved, keep {ref}. Options: {', '.join(m.strategies)}, EPLB swept over "
        f"{list(m.redundancy_sweep)} redundant experts, each fitted on the stage it serves; {m.deployment} "
        f"on nodes of {m.gpus_per_node} GPUs."
    )
    return Headline(
        key=f"{key_prefix}decision",
        title="Decision per stage (advise)" + suffix,
        value=value,
        label=label_,
        detail=detail,
        href=f"{key_prefix}advice",
        link="Advice",
        source=res.source(rf.ADVICE_MANIFEST),
        lines=tuple(ch.text() for ch in choices.values()),
    )


def compare_relation_line(advice: Results, compare: Results) -> str:
    """One line for compare's card when advice is on the page too: where the two answers differ and
    why (the option sets), or that they agree."""
    best = advice.advice.best
    stages = compare_stage_choices(compare)
    differ = [st for st, ch in stages.items() if st in best and ch.decision != best[st].decision]
    if not differ:
        return "compare's best per stage agrees with the decision (advise)"
    c = compare.compare
    return f"differs from the decision (advise) on {', '.join(differ)}: " + relation(
        command="compare", strategies=c.strategies, num_redundant=c.num_redundant
    )


def compare_stage_choices(compare: Results) -> dict[str, StageChoice]:
    """compare.json's decision per stage (``verdict.stages``, ``placement.decision.StageChoice``);
    empty for results written before it."""
    v = compare.compare.verdict
    return {} if v is None else dict(v.stages)
