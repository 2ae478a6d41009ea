"""``moetrace advise``'s verdicts: one per stage in plain words from the evaluated options' summary
rows (``advise_option_row.OptionRow``, from ``advise.advise_arrays``), and which options to recommend.

- **enable**: the best EPLB option over both policies (``best_eplb``: the fewest redundant slots
  within ``WITHIN_BEST`` of the best predicted time, then the faster), when it gains at least
  ``MIN_GAIN``; the other policy's figure beside it; the rearrangement's stall and whether the
  engine's schedule pays for it (``rearrange``).
- **no gain**, with the reason (already balanced, load that moves, small-batch noise, or balance
  that does not shorten the step); without a drift estimate (fewer than 4 windows: one statistics
  file) the moving-load reasons are not claimed.
- every other data-based strategy (``joint``, ``data``, ``ours``...) is compared with that EPLB.

Shape legend (docs/architecture.md): S stages.

Out of scope: evaluating options (``run``), the drift check's numbers (``drift``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moetrace.placement.advise.options import EPLB_STRATEGIES
from moetrace.placement.advise.rearrange import Rearrangement, rearrangement_cost, rearrangement_text
from moetrace.placement.advise_manifest import AdviceVerdict, DriftEstimate, plain_json
from moetrace.placement.advise_option_row import Measure, OptionRow
from moetrace.placement.decision import MIN_GAIN, WITHIN_BEST, Candidate, StageChoice, choose, pct

__all__ = [
    "BALANCED",
    "DRIFT_GAP",
    "MIN_GAIN",
    "SEPARATE_BELOW",
    "WITHIN_BEST",
    "best_eplb",
    "pct",
    "stage_choices",
    "verdicts",
]

#: a reference at least this balanced (vLLM's figure, median over steps) is "already balanced"
BALANCED = 0.90
#: balancedness a placement refitted on the window before must gain over a static one to call the load moving
DRIFT_GAP = 0.02
#: prefill and decode loads correlating below this are better balanced separately
SEPARATE_BELOW = 0.80
#: strategies that need no load (never "recommended" beyond the table)
DATA_FREE = ("current", "linear", "round_robin", "random")


def best_eplb(cand: list[OptionRow]) -> OptionRow | None:
    """The smallest sweep point within ``WITHIN_BEST`` of the best predicted MoE-layer time (all-to-all
    time when the expert size is unknown; balancedness when neither is known), the faster on equal
    slots (EPLB's two policies); None without candidates."""
    if not cand:
        return None
    tk: Measure = "moe" if all(np.isfinite(r.moe_vs_ref) for r in cand) else "a2a"
    if not all(np.isfinite(r.vs_ref(tk)) for r in cand):
        top = max(r.balancedness_vllm for r in cand)
        return min(
            (r for r in cand if r.balancedness_vllm >= top - WITHIN_BEST),
            key=lambda r: (r.num_redundant, -r.balancedness_vllm),
        )
    best = min(r.vs_ref(tk) for r in cand)
    return min(
        (r for r in cand if r.vs_ref(tk) <= best * (1 + WITHIN_BEST)), key=lambda r: (r.num_redundant, r.vs_ref(tk))
    )


def _gb(x: float | None) -> str:
    return "n/a (expert size unknown)" if x is None else f"{x / 1e9:.1f} GB"


def _time_key(r0: OptionRow) -> tuple[Measure, str]:
    """The time a verdict ranks by: MoE-layer time, or all-to-all time when the expert size is unknown."""
    if r0.measure == "moe":
        return "moe", "predicted MoE-layer time"
    return "a2a", "predicted all-to-all time"


def _eplb_name(r: OptionRow) -> str:
    return f"EPLB's {r.eplb_policy} policy"


def _enable_text(who: str, best: OptionRow, b0: float, change: str) -> str:
    red = (
        f"with {best.num_redundant} redundant experts"
        if best.num_redundant
        else "without redundant experts (a rearrangement only)"
    )
    return (
        f"{who}: enable {_eplb_name(best)} {red}: balancedness {b0:.2f} → {best.balancedness_vllm:.2f}, {change}, "
        f"{_gb(best.bytes_moved)} of weights move once ({best.experts_moved} expert copies), "
        f"{_gb(best.extra_bytes_per_gpu)} more per GPU for the redundant slots."
    )


def _other_policy(cand: list[OptionRow], best: OptionRow, tk: Measure) -> str:
    """The other EPLB policy's best point, for comparison ("" when only one policy was evaluated)."""
    other = best_eplb([r for r in cand if r.eplb_policy != best.eplb_policy])
    if other is None:
        return ""
    return (
        f" ({str(other.eplb_policy).capitalize()} policy at its best, {other.num_redundant} redundant: balancedness "
        f"{other.balancedness_vllm:.2f}, {pct(other.vs_ref(tk))}.)"
    )


def _fewer_slots_reason(cand: list[OptionRow], best: OptionRow, tk: Measure) -> str:
    """Why the chosen sweep point has fewer redundant experts than the best-balanced one, where it does:
    each redundant slot is one more expert a GPU may read per step ("" otherwise)."""
    balanced = max(cand, key=lambda r: (r.balancedness_vllm, -r.num_redundant))
    if balanced.num_redundant <= best.num_redundant or tk != "moe":
        return ""
    if not balanced.activated_experts_per_gpu_max > best.activated_experts_per_gpu_max:
        return ""
    return (
        f" Why not more redundant experts: {balanced.num_redundant} balance tokens better (balancedness "
        f"{balanced.balancedness_vllm:.2f}) but each redundant slot is one more expert a GPU may read per step "
        f"(activated experts on the busiest GPU {best.activated_experts_per_gpu_max:.1f} → "
        f"{balanced.activated_experts_per_gpu_max:.1f}): MoE-layer time {pct(balanced.vs_ref(tk))} against "
        f"{pct(best.vs_ref(tk))}."
    )


def _no_gain_reason(b0: float, best: OptionRow, drift: DriftEstimate | None) -> str:
    static, lagged, own = (float("nan") if drift is None else drift.figure(k) for k in ("static", "lagged", "own"))
    if np.isfinite(b0) and b0 >= BALANCED:
        return f"already balanced (balancedness {b0:.2f} ≥ {BALANCED:.2f})"
    if all(np.isfinite(x) for x in (static, lagged, own)):
        seen = (
            f"on the later windows EPLB fitted on the first half reaches balancedness {static:.2f}, refitted on "
            f"the window before {lagged:.2f}, fitted on each window itself {own:.2f}"
        )
        if lagged - static > DRIFT_GAP:
            return f"the imbalance moves from window to window: a static placement cannot follow it ({seen}); rebalance periodically instead"
        if own - max(static, lagged) > 2 * DRIFT_GAP + 0.05:
            return f"the imbalance moves from window to window faster than any placement can follow ({seen})"
    if best.balancedness_vllm - b0 < 0.05:
        return "the step-to-step imbalance is noise of small batches that no static placement removes"
    return "better balance does not shorten the step here (the all-to-all or the activated experts decide it)"


def _others_text(
    here: list[OptionRow],
    *,
    st: str,
    tk: Measure,
    what: str,
    best: OptionRow,
    enabled: bool,
    ref_key: str,
    ref_label: str,
) -> tuple[str, list[str]]:
    """The sentences on the data-based strategies beyond EPLB (joint, data, ours...), and those to recommend."""
    text, keys = "", []
    r0 = next(r for r in here if r.option == ref_key and r.steps == st)
    for r in here:
        if r.strategy in EPLB_STRATEGIES or r.strategy in DATA_FREE or r.option == ref_key:
            continue
        name = "Ours (joint)" if r.strategy == "joint" else r.label[:1].upper() + r.label[1:]
        jt = r.vs_ref(tk)
        base = best if enabled else r0
        ib = base.inter_node_bytes_per_step
        dbytes = r.inter_node_bytes_per_step / ib if ib else float("nan")
        vs = f"that EPLB's {pct(best.vs_ref(tk))}" if enabled else ref_label
        if np.isfinite(jt) and 1.0 - jt >= MIN_GAIN and jt < best.vs_ref(tk):
            router = (
                f", but needs the prefill router (placement file: placements/{st}-{r.option}.json)"
                if r.router
                else f" (placement file: placements/{st}-{r.option}.json)"
            )
            text += f" {name} reaches {what} {pct(jt)} (against {vs}) with {pct(dbytes)} inter-node bytes{router}."
            keys.append(r.option)
        else:
            worth = "not worth its router here" if r.router else "no better here"
            text += f" {name}: {what} {pct(jt)}, inter-node bytes {pct(dbytes)}: {worth}."
    return text, keys


def verdicts(
    rows: list[OptionRow],
    *,
    stages: list[str],
    ref_key: str,
    ref_label: str,
    drift: dict[str, DriftEstimate],
    correlation: float | None,
    weights: dict[str, float],
    missing: tuple[str, ...],
    rearrangement: Rearrangement,
    decisions: dict[str, StageChoice] | None = None,
) -> tuple[list[AdviceVerdict], list[tuple[str, str]]]:
    """One verdict per stage in plain words, with the numbers behind it; and the recommended (stage,
    option key) pairs (their placement files and commands). The placement of ``both`` serves prefill
    and decode steps, weighed by ``weights`` (the steps each stage's traffic takes). ``decisions``:
    each stage's decision by the one rule (``stage_choices``); where it is an option other than EPLB's
    best point (ours, with its router), the verdict leads with it and EPLB's sentence follows as the
    alternative, so the words say the decision the table and the card show."""
    out: list[AdviceVerdict] = []
    recommended: list[tuple[str, str]] = []
    for st in stages:
        here = [r for r in rows if r.stage == st]
        r0_by: dict[str, OptionRow] = {r.steps: r for r in here if r.option == ref_key}
        tk, what = _time_key(next(iter(r0_by.values())))
        if not any(r.strategy in EPLB_STRATEGIES for r in here):  # --strategies left EPLB out
            text = f"{st.capitalize() if st != 'both' else 'Both stages'}: EPLB not evaluated (not in --strategies)."
            if st != "both":
                r0 = r0_by[st]
                more, keys = _others_text(
                    here, st=st, tk=tk, what=what, best=r0, enabled=False, ref_key=ref_key, ref_label=ref_label
                )
                text += more
                recommended += [(st, k) for k in keys]
            out.append(AdviceVerdict(stage=st, verdict="not evaluated", option=None, text=text))
            continue
        if st == "both":
            # one row per option: its step time weighed over both stages, over the reference's
            def weighed(key: str, here: list[OptionRow] = here, tk: Measure = tk) -> float:
                return sum(weights[r.steps] * r.seconds_per_step(tk) for r in here if r.option == key)

            total0 = weighed(ref_key)
            cand = [  # each EPLB option's decode row, its time weighed over both stages' steps
                r.with_vs_ref(tk, weighed(r.option) / total0 if total0 > 0 else float("nan"))
                for r in here
                if r.strategy in EPLB_STRATEGIES and r.steps == "decode"
            ]
            best = best_eplb(cand)
            assert best is not None
            per = {r.steps: r for r in here if r.option == best.option}
            change = (
                f"{what} weighed over both stages {pct(best.vs_ref(tk))} ("
                + ", ".join(f"{s} steps {pct(per[s].vs_ref(tk))}" for s in ("decode", "prefill") if s in per)
                + ")"
            )
            b0 = r0_by["decode"].balancedness_vllm
            who, own_steps = "Both stages with one placement", "decode"
            best_row = per["decode"]
        else:
            r0 = r0_by[st]
            cand = [r for r in here if r.strategy in EPLB_STRATEGIES]
            best = best_eplb(cand)
            assert best is not None
            spread = f"p10–p90 {pct(best.vs_ref_p10(tk))}…{pct(best.vs_ref_p90(tk))}"
            change = f"{what} {pct(best.vs_ref(tk))} ({spread})"
            b0 = r0.balancedness_vllm
            who, own_steps, best_row = st.capitalize(), st, best
        gain = 1.0 - best.vs_ref(tk)
        info: dict[str, Any] = {}
        if gain >= MIN_GAIN:
            verdict, option = "enable", best.option
            text = _enable_text(who, best, b0, change) + _other_policy(cand, best, tk)
            text += _fewer_slots_reason(cand, best, tk)
            recommended.append((st, best.option))
            d = drift.get(st)
            lagged, static = (float("nan"), float("nan")) if d is None else (d.figure("lagged"), d.figure("static"))
            if lagged - static > DRIFT_GAP:
                text += (
                    f" The load also moves between windows: refitted on the window before, EPLB keeps balancedness "
                    f"{lagged:.2f} against {static:.2f} fitted once: rebalance periodically (vLLM's "
                    "--eplb-config step_interval)."
                )
            ref_row = r0_by[own_steps]
            cost = rearrangement_cost(ref_row.seconds_per_step(tk), best_row.seconds_per_step(tk), r=rearrangement)
            text += rearrangement_text(cost, steps=own_steps, what=what)
            info["rearrangement"] = cost
        else:
            verdict, option = "no gain", None
            text = (
                f"{who}: no gain from EPLB: the best sweep point ({_eplb_name(best)}, {best.num_redundant} "
                f"redundant) gives {change} (balancedness {b0:.2f} → {best.balancedness_vllm:.2f}); "
                f"{_no_gain_reason(b0, best, drift.get(st))}."
            )
        if st != "both":
            more, keys = _others_text(
                here,
                st=st,
                tk=tk,
                what=what,
                best=best,
                enabled=verdict == "enable",
                ref_key=ref_key,
                ref_label=ref_label,
            )
            text += more
            recommended += [(st, k) for k in keys]
            c = (decisions or {}).get(st)
            if c is not None and c.decision not in (ref_key, option):  # the decision is not EPLB's point
                row = next(r for r in here if r.option == c.decision and r.steps == st)
                name = "ours (joint)" if row.strategy == "joint" else row.label
                text = (
                    f"{who}: deploy {name}, the decision ({what} {pct(row.vs_ref(tk))}, the lowest within the "
                    f"node-load limit; placement file placements/{st}-{row.option}.json). EPLB alone: "
                    + text.removeprefix(f"{who}: ")
                )
                verdict, option = "deploy", c.decision
                recommended = [(st, c.decision), *recommended]
        out.append(AdviceVerdict(stage=st, verdict=verdict, option=option, text=text, info=plain_json(info)))
    if correlation is not None and "both" in stages:
        sep = correlation < SEPARATE_BELOW
        gains = any(v.verdict in ("enable", "deploy") for v in out)
        advice = (
            "balance them separately (one placement per stage, as with prefill/decode disaggregation)."
            if sep and gains
            else "one placement can serve both."
            if gains
            else "neither stage gains from a placement, so there is nothing to balance separately."
        )
        sep = sep and gains
        text = f"Prefill and decode loads correlate {correlation:.2f}: {advice}"
        out.append(AdviceVerdict(stage="both", verdict="separate" if sep else "together", option=None, text=text))
    for miss in missing:
        out.append(AdviceVerdict(stage=None, verdict="missing", option=None, text=miss))
    return out, list(dict.fromkeys(recommended))


def stage_choices(rows: list[OptionRow], *, stages: list[str], ref_key: str) -> list[StageChoice]:
    """Per stage (prefill, decode: each placement fitted on the stage it serves, on that stage's steps),
    the decision over every evaluated option by ``decision.choose``: the rule ``compare`` and the
    dashboard card use (MoE-layer time per step; all-to-all time when the expert size is unknown)."""
    out = []
    for st in (s for s in stages if s != "both"):
        here = [r for r in rows if r.stage == st and r.steps == st]
        if not here:
            continue
        tk, what = _time_key(next(r for r in here if r.option == ref_key))
        cands = [
            Candidate(
                option=r.option,
                strategy=r.strategy,
                num_redundant=int(r.num_redundant),
                time=float(r.vs_ref(tk)),
                a2a=float(r.a2a_vs_ref),
                inter=float(r.inter_node_vs_ref),
            )
            for r in here
        ]
        out.append(choose(st, cands, reference=ref_key, measure=what.removeprefix("predicted ")))
    return out
