"""The text ``moetrace place`` and ``moetrace compare`` print, as plain strings.

``format_compare_summary``: header lines (deployment, train/test split, steps, the copy model of
each stage and the links) and one aligned row per strategy: the verdict's measure first (predicted
MoE-layer time per step; all-to-all time when the expert size is unknown) with its p10 and p90, the
all-to-all time beside it, then inter-node bytes, router match rate, node load (held-out requests
routed to the busiest node over an even share) and GPU load; last, the verdict line (compare.json
``verdict``: the deployable strategies within the node-load limit in rank order).
``compare_notes``: one line per strategy whose micro-batches had to draw from all test requests
because no held-out request was routed to some of its groups; a caution when the traced model had
seeded random weights (a ``-tiny`` preset, the dashboard's banner); a warning below
``MIN_HELD_OUT_REQUESTS`` held-out requests; one line per bound left out, with its reason.
``format_placement_summary``: the one line ``place`` prints.

Out of scope: computing anything (``compare``); colours and streams (the CLI decides where notes go).
"""

from __future__ import annotations

import textwrap

from moetrace.placement.compare import MIN_HELD_OUT_REQUESTS, CompareResult, PlacedStrategy
from moetrace.placement.compare_manifest import CompareManifest, CompareVerdict
from moetrace.placement.compare_row import Measure
from moetrace.placement.cost import expert_unknown_reason
from moetrace.placement.decision import MIN_GAIN, objective, relation
from moetrace.placement.hardware import Hardware
from moetrace.placement.legends import COMPARE_LEGEND, WORSE, legend_lines
from moetrace.placement.strategies import get_strategy
from moetrace.sizes import human_bytes

__all__ = [
    "what_if_line",
    "format_compare_summary",
    "compare_notes",
    "format_placement_summary",
    "RANDOM_WEIGHTS_CAUTION",
]

#: printed by compare when the traced model had seeded random weights (the dashboard shows the same banner)
RANDOM_WEIGHTS_CAUTION = (
    "caution: {model} has seeded random weights ({source}): its routing says nothing about a real model, "
    "so neither do these savings; trace a real checkpoint to rank placements"
)


_COPIES = {
    "expert": "one copy per (token, expert), as DeepEP's low-latency kernels send",
    "node": "one copy per remote node, as DeepEP's normal kernels send",
    "rank": "one copy per destination GPU",
}


def copy_model_line(c: CompareManifest) -> str:
    """What the run assumed: each stage's copy model and the links (names the assumption the
    ranking depends on)."""
    parts = [f"decode: {_COPIES.get(c.dedup, c.dedup)}"]
    if c.num_prefill_batches:
        parts.append(f"prefill: {_COPIES.get(c.prefill_dedup or '', c.prefill_dedup or '?')}")
    line = "copies: " + "; ".join(parts)
    if c.cost is not None:
        lk = c.cost["links"]
        nic = "per node" if lk["inter_nic"] == "node" else "per GPU"
        if c.hardware is not None:
            line += "\n" + hardware_line(c.hardware, c.dedup)
        line += (
            f"\nlinks: NVLink {lk['intra_bytes_per_s'] / 1e9:.3g} GB/s, {lk['intra_latency_s'] * 1e6:.3g} us; "
            f"RDMA {lk['inter_bytes_per_s'] / 1e9:.3g} GB/s {nic}, {lk['inter_latency_s'] * 1e6:.3g} us"
        )
        ex = c.cost.get("expert")
        line += (
            f"; experts {ex['hidden_size']}x{ex['ffn_size']} at {ex['weight_bytes_per_value']:g} B/weight, "
            f"HBM {ex['hbm_bytes_per_s'] / 1e12:g} TB/s, {ex['peak_flops'] / 1e12:g} TFLOP/s"
            if ex
            else f"; {expert_unknown_reason(c.model) or f'expert size of {c.model.name} unknown: no MoE-layer time'}"
        )
    return line


def hardware_line(hw: Hardware, copies: str) -> str:
    """Which step model priced the run (the preset or links file; its ``source`` is in compare.json)
    and what the decode kernel sends: value types and fixed costs per collective."""
    k = hw.kernels.get(copies)
    kern = (
        f"; decode kernel {k.name}: dispatch {k.dispatch.value.name} +{k.dispatch.fixed_s * 1e6:.3g} us, "
        f"combine {k.combine.value.name} +{k.combine.fixed_s * 1e6:.3g} us"
        if k is not None
        else ""
    )
    measured = "fitted to measured tables" if hw.source.startswith("moetrace calibrate") else "hand-set"
    return f"step model: {hw.name} ({measured}){kern}"


def _ratio(x: float) -> str:
    return "n/a" if x != x else f"{x:.3f}"


def what_if_line(n: int) -> str:
    """The line every output of a ``--route-on first-decode:N`` run carries."""
    return (
        f"what-if: routes on generated tokens, not deployable: routers saw each request's first {n} generated "
        "token(s), not its prompt (a serving engine places a request before it generates); the later tokens are simulated"
    )


def _mark(x: float, width: int) -> str:
    """A ratio over linear's, ``WORSE`` after it when worse (above 1.000 at three decimals)."""
    if x != x:
        return f"{'n/a':>{width}} "
    return f"{x:>{width}.3f}{WORSE if round(x, 3) > 1.0 else ' '}"


def _captured(cap: float | None) -> str:
    """``of oracle``: the share of the oracle's saving reached, never shown past 0-100 % without a mark
    (``>100%``: the bound was beaten; ``<0%``: slower than linear)."""
    if cap is None:
        return "-"
    c = round(cap, 2)
    return "<0%" if c < 0 else ">100%" if c > 1.0 else f"{c or 0.0:.0%}"


def format_compare_summary(result: CompareResult) -> str:
    """Header lines (deployment, split, steps, the copy model and links), then one table per simulated
    stage, each with every cost over linear's median: decode (MoE-layer time with p10 and p90, all-to-all
    time, inter-node bytes and the bytes themselves, router match rate, node load, GPU load, the share of
    the oracle's saving reached) and prefill (MoE-layer time, all-to-all time, inter-node bytes); a figure
    worse than linear's is marked ``WORSE``. Then the best option per stage by the one rule
    (``decision``), how it relates to ``advise``, the legend and the ranking (``verdict``)."""
    c = result.manifest
    pre = bool(result.prefill_metrics)
    measure = result.measure
    lead, beside = _MEASURES if measure == "moe" else _MEASURES[::-1]  # the decisions' measure first
    lines = [
        f"{c.deployment} ({c.num_nodes} nodes), "
        + (
            f"{c.num_train_requests} train / {c.num_test_requests} test requests"
            + (
                f" (samples of the trace's {c.num_trace_train_requests} / {c.num_trace_test_requests}: "
                f"caps {c.max_train_requests} / {c.max_test_requests})"
                if c.capped
                else ""
            )
            if c.tokens_from is None
            else "a load profile (tokens drawn from its loads)"
        )
        + f", {c.num_batches} decode steps of {c.batch_requests} requests"
        + (f", {c.num_prefill_batches} prefill steps of {c.prefill_tokens_per_node} tokens per node" if pre else ""),
        copy_model_line(c),
        *([what_if_line(c.route_first_decode)] if c.route_first_decode else []),
        f"every figure over linear's median (lower is better; {WORSE}: worse than linear); decisions rank by "
        f"{_MEASURE_WORDS[measure]}",
        "",
        "decode steps:",
        f"{'strategy':<16} {_NAME[lead]:>9} {'p10':>6} {'p90':>6} {_NAME[beside]:>9} {'inter B':>8} {'/step':>9} "
        f"{'router':>7} {'node load':>9} {'GPU load':>8} {'of oracle':>9}",
    ]
    rows = result.summary_rows()
    beaten = False
    for i, r in enumerate(rows):
        if r.is_bound and (i == 0 or not rows[i - 1].is_bound):
            lines.append(_bounds_header(c))
        router = f"{r.router_match_rate:.0%}" if r.router_match_rate is not None else "-"
        load = r.busiest_node_load
        load_s = "-" if load is None else f"{load:.2f}" + ("!" if r.over_node_load_limit else "")
        captured = _captured(r.oracle_captured)
        beaten |= captured == ">100%"
        lines.append(
            f"{r.strategy:<16} {_mark(r.time_normalized(lead), 8)}"
            f"{_ratio(r.time_normalized(lead, 'p10')):>6} {_ratio(r.time_normalized(lead, 'p90')):>6} "
            f"{_mark(r.time_normalized(beside), 8)}{_mark(r.inter_node_normalized_median, 7)}"
            f"{human_bytes(r.inter_node_bytes_per_batch_median):>9} "
            f"{router:>7} {load_s:>9} {r.busiest_gpu_load:>8.2f} {captured:>9}"
        )
    if c.expert_copy_floor is not None:  # dedup expert, no redundancy: a proven bound, not a placement
        J = result.model.num_experts // c.num_nodes
        lines.append(
            f"{'floor':<16} {'':>9} {'':>6} {'':>6} {'':>9} {max(c.expert_copy_floor, 0.0):>7.3f}  inter-node bytes, proven "
            f"for any placement: each held-out request on a node of its own top {J} experts per layer"
        )
    if pre:
        lines += ["", "prefill steps:", f"{'strategy':<16} {_NAME[lead]:>9} {_NAME[beside]:>9} {'inter B':>8}"]
        for i, r in enumerate(rows):
            if r.is_bound and (i == 0 or not rows[i - 1].is_bound):
                lines.append("the bounds above, on prefill steps (not deployable):")
            lines.append(
                f"{r.strategy:<16} {_mark(r.prefill_time_normalized(lead), 8)}"
                f"{_mark(r.prefill_time_normalized(beside), 8)}"
                f"{_mark(r.prefill_inter_node_normalized_median, 7)}"
            )
    over = [r.strategy for r in rows if r.over_node_load_limit and not r.is_bound]
    if over:
        lines.append(
            f"! node load over --max-node-load {c.max_node_load:g}: {', '.join(over)} (that node is every step's "
            "straggler, or its queue grows; bounds keep within the limit)"
        )
    if beaten:
        lines.append(
            "of oracle >100%: a deployable row beat the oracle bound (the best placement a solver found seeing the "
            "held-out decode, not a proof; small held-out sets make it overfit them)"
        )
    lines += ["", *legend_lines(COMPARE_LEGEND, indent="")]
    lines += ["", *decision_lines(c)]
    if c.verdict is not None:
        lines.append(verdict_line(c.verdict, reference=c.reference))
    return "\n".join(lines)


#: the two predicted times, MoE-layer time first
_MEASURES: tuple[Measure, Measure] = ("moe", "a2a")
#: the time columns' headers
_NAME = {"moe": "MoE time", "a2a": "a2a time"}


def _bounds_header(c: CompareManifest) -> str:
    kinds = sorted({k for k in c.bound_kinds.values() if k})
    return (
        "upper bounds (they see the held-out requests' decode; not deployable"
        + (f"; best found: from {', '.join(kinds)}" if kinds and kinds != ["joint"] else "")
        + "):"
    )


def decision_lines(c: CompareManifest) -> list[str]:
    """``best per stage ...``: compare.json's ``verdict.stages`` in words, and how it relates to advise."""
    if c.verdict is None or not c.verdict.stages:
        return []
    choices = list(c.verdict.stages.values())
    rule = objective(choices[0].measure)
    head = f"best per stage (the rule advise applies too: {rule}; under {MIN_GAIN:.0%} saved: keep linear):"
    texts = [ch.text() for ch in choices]
    texts.append(relation(command="compare", strategies=c.strategies, num_redundant=c.num_redundant))
    out = textwrap.wrap(head, width=100, subsequent_indent="  ")
    for t in texts:
        out += textwrap.wrap(t, width=100, initial_indent="  ", subsequent_indent="    ")
    return out


#: the verdict's measure in words
_MEASURE_WORDS = {
    "moe": "MoE-layer time (dispatch + the slowest GPU's experts + combine)",
    "a2a": "all-to-all time (the model's expert size is unknown: no MoE-layer time)",
}


def verdict_line(v: CompareVerdict, *, reference: str) -> str:
    """``verdict (MoE-layer time): ours 0.971 of linear (all-to-all 0.951), then eplb 0.980 (0.967), ...``:
    compare.json's ``verdict``, the deployable strategies within the node-load limit in rank order."""
    what = "MoE-layer time" if v.by_moe_time else "all-to-all time"
    t, a = v.time_normalized, v.a2a_time_normalized
    ranking = v.ranking
    if not ranking:
        return f"verdict ({what}): no deployable strategy within the node-load limit"
    best = ranking[0]
    beside = f" (all-to-all {a[best]:.3f})" if v.by_moe_time else ""
    rest = ", ".join(f"{s} {t[s]:.3f}" + (f" ({a[s]:.3f})" if v.by_moe_time else "") for s in ranking[1:])
    head = (
        f"verdict ({what}, deployable within the node-load limit): recommended {best} {t[best]:.3f} of {reference}{beside}"
        if best != reference
        else f"verdict ({what}): no deployable placement beats {reference}"
    )
    return head + (f"; then {rest}" if rest else "")


#: decode tokens a GPU per step under which ``compare_notes`` says that the all-to-all is mostly fixed cost
SMALL_DECODE_BATCH_PER_GPU = 8


def compare_notes(result: CompareResult) -> list[str]:
    """``caution:``, ``warning:`` and ``note: ...`` lines (empty when none): a model with seeded random
    weights (model source ``moetrace:<preset>-tiny``); fewer than ``MIN_HELD_OUT_REQUESTS`` held-out
    requests; each bound the run left out (``manifest.skipped``) and why; groups that no held-out
    request was routed to; a decode batch under ``SMALL_DECODE_BATCH_PER_GPU`` tokens a GPU; strategies
    that split a group-limited router's expert groups over nodes when copies are counted per node."""
    m, c = result.model, result.manifest
    notes: list[str] = []
    if m.source.startswith("moetrace:"):
        notes.append(RANDOM_WEIGHTS_CAUTION.format(model=m.name, source=m.source))
    if c.num_test_requests < MIN_HELD_OUT_REQUESTS and c.tokens_from is None:  # a profile's tokens: said below
        notes.append(
            f"warning: {c.num_test_requests} held-out request(s) (fewer than {MIN_HELD_OUT_REQUESTS}): every step "
            "draws from the same few, so the figures are noise; trace more requests or raise --test-fraction"
        )
    per_gpu = c.batch_requests / c.num_ep
    if per_gpu < SMALL_DECODE_BATCH_PER_GPU:
        notes.append(
            f"note: {per_gpu:g} decode token{'' if per_gpu == 1 else 's'} a GPU per step ({c.batch_requests} "
            f"requests over {c.num_ep} EP ranks): "
            "an all-to-all this small is mostly its fixed cost per collective, which hides part of what a placement "
            "saves at a larger batch; set --batch-requests to your deployment's decode batch (DeepEP benchmarks its "
            "low-latency kernels at 128 tokens a GPU)"
        )
    notes += [f"note: no {b} row: {why}" for b, why in c.skipped.items()]
    notes += [
        f"warning: the {b} bound failed: {', '.join(rows)} (deployable, within the node-load limit) predicted faster; "
        "its row is the bound's own best placement, not theirs"
        for b, rows in c.bound_failures.items()
    ]
    if c.route_first_decode:
        notes.append(f"caution: {what_if_line(c.route_first_decode)}")
    if c.request_unit != "request":
        grouped = [s for s in c.strategies if get_strategy(s).grouped]
        notes.append(
            f"caution: the trace's requests are {c.request_unit}es of an import without request ids (manifest "
            f"collection.request_unit): held-out steps batch whole {c.request_unit}es"
            + (f", and {', '.join(grouped)} cluster and route them as if each were one request" if grouped else "")
            + "; read the figures as an illustration of the placement, not of a serving engine's requests"
        )
    notes += [f"note: {c.tokens_from}"] if c.tokens_from is not None else []
    few = c.num_test_requests < MIN_HELD_OUT_REQUESTS * c.num_nodes  # too few to reach every node by chance
    notes += [
        f"note: {r.strategy}: {r.groups_without_routed_requests} group(s) had no held-out request routed "
        "to them; those nodes idled in every step "
        + (
            "(more held-out requests or fewer clusters avoid this)"
            if few
            else f"although {c.num_test_requests} requests were held out: its router sends whole clusters to "
            "nodes and none chose these (fewer --clusters, or joint/ours, whose routers keep every node within "
            "--max-node-load)"
        )
        for r in result.summary_rows()
        if r.groups_without_routed_requests
    ]
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
    line = f"{ps.strategy} placement for {deployment}: {P} slots x {L} layers{router}"
    if "ours_choice" in ps.extra:  # what ours chose on the validation split, and what the router adds there
        v = ps.extra["ours_validation"]
        gain = ps.extra["ours_router_gain"]
        served = "with its price router" if ps.extra["served_router"] == "price" else "with no router in front"
        measure = ps.extra.get("ours_measure", "expected step link time")
        line += (
            f"\nours chose {ps.extra['ours_choice']} ({served}) on {ps.extra['ours_validation_requests']} validation "
            f"requests of the training set, by {measure}, over linear: "
            + ", ".join(f"{c} {x:.3f}" for c, x in v.items())
            + f"; the router saves {gain:+.1%} of the same placement's time served without it"
            + (
                ""
                if ps.extra["served_router"] == "price"
                else " (routing buys too little to pay for one: recommended router-free, as engines serve today)"
            )
        )
        if refused := ps.extra.get("ours_refused_slower_a2a"):
            line += (
                f"; not served though faster in MoE-layer time: {', '.join(refused)} "
                f"(slower than EPLB in all-to-all time on the validation requests)"
            )
    return line
