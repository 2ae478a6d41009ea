"""``moetrace advise``: should this deployment enable EPLB, with which policy and how many redundant
experts, and what does a data-based placement add, answered per stage in the engines' own terms.

For each recorded stage (prefill, decode, and both together) and each option (the placement served
now, ``--current``, or linear, vLLM's default; the strategies of ``advise_options``: by default
round robin, DeepSeek's EPLB under its hierarchical and its global policy with R redundant slots for
every R of ``advise_metrics.redundancy_sweep``, and ours, ``joint``, where per-request routing
allows; any registered strategy by name) this module measures, per MoE layer and step, then
summarised:

- balancedness as vLLM logs it, the busiest rank's (token, expert) pairs, activated experts per GPU,
  distinct destination ranks per token (``advise_metrics``), with the replicas an engine's dispatch
  picks (``eplb_replicas``: vLLM's hash, SGLang's local-first map, or moetrace's same-node model);
- inter-node bytes, predicted all-to-all and MoE-layer seconds per step from the cost model
  (``step_model`` with ``cost.CostModel`` on a trace's simulated steps; the cost model's formulas on
  expected traffic for a load profile), with the step-to-step spread;
- migration from the placement served now (``advise_metrics.migration``) and the memory the
  redundant slots take per GPU.

Then one verdict per stage in plain words (``advise_verdicts``), with the rearrangement's stall in
steps and whether the engine's schedule pays for it (``advise_rearrange``). Steps hold
``decode_tokens_per_gpu`` / ``prefill_tokens_per_gpu`` tokens per GPU (defaults 4 and 128).

Inputs: a trace (requests split into placement and held-out ones as ``compare`` splits them, so
``moetrace place --strategy eplb`` reproduces the decode EPLB placement advised; the held-out
requests' steps are drawn by ``compare.held_out_batches`` / ``prefill_batches``) or a load profile
(windows of expert counts in time order: the first half fits, the rest is evaluated; one window,
such as one engine statistics file, is fitted and evaluated in-sample, with no drift estimate, and
the output says so; no tokens, so no send-ranks-per-token and the per-(token, expert) copy model only).

Shape legend (docs/architecture.md): N windows, B steps, R requests, L MoE layers, E logical
experts, P physical slots, W EP ranks, G nodes, T tokens, K top-k slots, S stages.

This module runs the evaluation (``advise_arrays``) and the three entry points (``advise_trace``,
``advise_profile_counts`` / ``advise_profile``, ``advise_input``); its parts live beside it, and the
names other modules import are re-exported here: the config (``advise_config``), the records
(``advise_types``), the inputs read from a trace or a profile (``advise_inputs``), the options fitted
per stage (``advise_fit``), their evaluation (``advise_evaluate``), their rows (``advise_rows``), the
stages' correlation and the drift (``advise_drift``).

Out of scope: the placers (``eplb``, ``baselines``, ``joint``), the volume and cost models
(``simulate``, ``cost``), engine files (``exports``), the result files (``advise_files``);
time-varying rebalancing schedules beyond the stall's cost: every option is a static placement.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from moetrace.placement.advise_config import DECODE_TOKENS_PER_GPU, PREFILL_TOKENS_PER_GPU, AdviseConfig
from moetrace.placement.advise_drift import MIN_DRIFT_WINDOWS, stage_correlation, stage_drift, stage_weights
from moetrace.placement.advise_evaluate import evaluate_counts, evaluate_tokens
from moetrace.placement.advise_files import commands, format_advice, read_advice, write_advice
from moetrace.placement.advise_fit import stage_options
from moetrace.placement.advise_inputs import profile_inputs, trace_inputs
from moetrace.placement.advise_options import data_free_placement, resolve_strategies
from moetrace.placement.advise_rows import add_layer_rows, layer_arrays, migration_row, summary_row, weight_bytes
from moetrace.placement.advise_types import (
    STAGES,
    Advice,
    AdviseInputs,
    Option,
    Stage,
    StageInput,
    StepMetrics,
    Steps,
    StepTokens,
)
from moetrace.placement.advise_verdicts import stage_choices, verdicts
from moetrace.placement.decision import stage_choices_json
from moetrace.placement.eplb_replicas import slot_shares
from moetrace.placement.hardware import CostModel

if TYPE_CHECKING:
    from moetrace.placement.maps import Placement
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "AdviseConfig",
    "StepTokens",
    "StepMetrics",
    "StageInput",
    "AdviseInputs",
    "Option",
    "Advice",
    "evaluate_tokens",
    "evaluate_counts",
    "advise_arrays",
    "advise_trace",
    "advise_profile_counts",
    "write_advice",
    "read_advice",
    "format_advice",
    "advise_input",
    "commands",
    "STAGES",
    "DECODE_TOKENS_PER_GPU",
    "PREFILL_TOKENS_PER_GPU",
]


def advise_arrays(
    inputs: AdviseInputs, cfg: AdviseConfig, *, progress: Callable[[int, int], None] | None = None
) -> Advice:
    """Evaluate every option on every recorded stage of ``inputs``, then word the verdicts.

    ``progress(done, total)`` after each (option, steps) evaluation.
    """
    from moetrace.placement.cost import expert_compute_for

    m, dep = inputs.model, cfg.deployment
    E = m.num_experts
    sweep = cfg.sweep(E)
    expert = expert_compute_for(m, config=cfg.model_config)
    cost = CostModel(hardware=cfg.hardware, expert=expert)
    bytes_per_token = m.hidden_size * 2
    time_hidden = expert.hidden_size if expert is not None else m.hidden_size
    recorded: list[Steps] = [s for s in ("prefill", "decode") if s in inputs.stages]
    stages: list[Stage] = list(recorded)
    if len(recorded) == 2:
        stages.append("both")

    names, notes = resolve_strategies(
        cfg.strategies, model=m, deployment=dep, routable=inputs.routable, kind=inputs.kind
    )
    ref_opt = (
        Option(name="current", num_redundant=inputs.current.phy2log.shape[1] - E, placement=inputs.current)
        if inputs.current is not None
        else Option(
            name="linear",
            num_redundant=0,
            placement=data_free_placement("linear", model=m, deployment=dep, seed=cfg.seed),
        )
    )
    options: dict[Stage, list[Option]] = {}
    for st in stages:
        here = stage_options(inputs, cfg, names, stage=st, sweep=sweep)
        options[st] = [ref_opt, *(o for o in here if o.key != ref_opt.key)]
    shares: dict[tuple[str, str], np.ndarray] = {}  # a profile's slot shares under the replica rule, per option

    def slot_share(opt: Option) -> np.ndarray | None:
        if cfg.replica_policy != "sglang":  # the other rules split evenly on average
            return None
        k = (opt.fitted_on, opt.key)
        if k not in shares:
            shares[k] = slot_shares(
                opt.placement, rule=cfg.replica_policy, num_ranks=dep.num_ep, ranks_per_node=dep.ranks_per_node
            )
        return shares[k]

    def job_key(opt: Option, steps: Steps) -> tuple[str, str, Steps]:
        return (opt.fitted_on, opt.key, steps)

    def evaluate(job: tuple[Option, Steps]) -> StepMetrics:
        opt, steps = job
        si = inputs.stages[steps]
        toks = inputs.extra_tokens.get((opt.key, steps), si.tokens)
        if toks is not None:
            return evaluate_tokens(
                toks,
                opt.placement,
                deployment=dep,
                dedup=cfg.decode_dedup if steps == "decode" else cfg.prefill_dedup,
                cost=cost,
                bytes_per_token=bytes_per_token,
                hidden_size=time_hidden,
                rule=cfg.replica_policy,
            )
        assert si.counts_NLE is not None  # a profile stage
        return evaluate_counts(
            si.counts_NLE,
            opt.placement,
            deployment=dep,
            cost=cost,
            dedup=cfg.decode_dedup if steps == "decode" else cfg.prefill_dedup,
            pairs_per_step=si.pairs_per_step,
            bytes_per_token=bytes_per_token,
            hidden_size=time_hidden,
            slot_share_LP=slot_share(opt),
        )

    plan = [(st, steps) for st in stages for steps in (recorded if st == "both" else [st])]
    jobs: dict[tuple[str, str, Steps], tuple[Option, Steps]] = {}
    for st, steps in plan:
        for opt in [ref_opt, *options[st]]:
            jobs.setdefault(job_key(opt, steps), (opt, steps))
    evals: dict[tuple[str, str, Steps], StepMetrics] = {}
    # numpy's sorts and bincounts release the GIL: two threads keep two cores busy (results do not depend on it)
    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        for n, (k, em) in enumerate(zip(jobs, pool.map(evaluate, jobs.values())), start=1):
            evals[k] = em
            if progress is not None:
                progress(n, len(jobs))
    moved: dict[tuple[str, str], dict[str, Any]] = {}

    rows: list[dict[str, Any]] = []
    layer_cols: dict[str, list[Any]] = {
        k: []
        for k in (
            "stage",
            "steps",
            "option",
            "layer",
            "model_layer",
            "balancedness",
            "busiest_rank_tokens",
            "activated_experts_per_gpu_max",
            "send_ranks_per_token",
            "inter_node_bytes",
            "moe_seconds",
        )
    }
    for st, steps in plan:
        ref = evals[job_key(ref_opt, steps)]
        for opt in options[st]:
            em = evals[job_key(opt, steps)]
            row = summary_row(em, ref, option=opt, stage=st, steps=steps, model=m)
            if (opt.fitted_on, opt.key) not in moved:
                moved[(opt.fitted_on, opt.key)] = migration_row(
                    ref_opt, opt, dep=dep, model=m, weight_bytes=weight_bytes(cost)
                )
            row.update(moved[(opt.fitted_on, opt.key)])
            rows.append(row)
            add_layer_rows(layer_cols, em, stage=st, steps=steps, option=opt.key, model=m)

    correlation = stage_correlation(inputs)
    drift = {st: stage_drift(inputs, st, cfg=cfg, rows=rows) for st in stages}
    drift_estimated = all("skipped" not in d for d in drift.values())
    missing = [*inputs.missing, *notes]
    if not drift_estimated:
        n = min(len(inputs.stages[s].windows_NLE) for s in recorded)
        missing.append(
            f"No drift estimate: the input has {n} window(s) of counts (a drift estimate needs {MIN_DRIFT_WINDOWS}); "
            + (
                "placements are fitted and evaluated on the same counts (in-sample: an upper bound on what a placement "
                "fitted on past load keeps), and whether the load moves faster than a static placement follows is "
                "unknown. Record several windows (SGLang's expert distribution recorder per pass, or `moetrace "
                "profile --window-tokens`) to know."
                if n == 1
                else "whether the load moves faster than a static placement follows is unknown."
            )
        )
    verdict_list, recommended = verdicts(
        rows,
        stages=list(stages),
        ref_key=ref_opt.key,
        ref_label=ref_opt.label,
        drift={str(k): v for k, v in drift.items()},
        correlation=correlation,
        weights=stage_weights(inputs),
        missing=tuple(missing),
        rearrangement=cfg.rearrangement,
    )
    best = stage_choices(rows, stages=list(stages), ref_key=ref_opt.key)  # the one rule (decision.choose)
    recommended = list(
        dict.fromkeys([*recommended, *((c.stage, c.decision) for c in best if c.decision != ref_opt.key)])
    )
    placements = {
        f"{st}-{key}": next(o for o in options[st] if o.key == key) for st, key in recommended if st in options
    }
    manifest = {
        "input": inputs.source,
        "input_kind": inputs.kind,
        "trace": inputs.source if inputs.kind == "trace" else None,  # the dashboard shows its overview too
        "model": m.to_dict(),
        "deployment": dep.name,
        "gpus_per_node": dep.num_gpus_per_node,
        "num_ep": dep.num_ep,
        "num_nodes": dep.num_nodes,
        "reference": ref_opt.key,
        "current_format": inputs.current_format or None,
        "stages": list(stages),
        "recorded_stages": list(recorded),
        "missing": missing,
        "redundancy_sweep": sweep,
        "max_slots_per_gpu": cfg.slot_limit(E),
        "num_steps": {s: int(_num_steps(inputs, s)) for s in recorded},
        "decode_dedup": cfg.decode_dedup,
        "prefill_dedup": cfg.prefill_dedup,
        "hardware": cfg.hardware.to_json(),
        "expert": None if expert is None else expert.to_json(),
        "test_fraction": cfg.test_fraction,
        "seed": cfg.seed,
        "strategies": list(names),
        "eplb_sum": cfg.eplb_sum,
        "replica_policy": cfg.replica_policy,
        "step_tokens_per_gpu": {"decode": cfg.decode_tokens_per_gpu, "prefill": cfg.prefill_tokens_per_gpu},
        "rearrangement": {
            "stall_seconds": cfg.rearrangement.stall_seconds,
            "interval_steps": cfg.rearrangement.interval_steps,
        },
        "prefill_decode_correlation": correlation,
        "drift_estimated": drift_estimated,
        "drift": drift,
        "verdicts": verdict_list,
        "best": stage_choices_json(best),
        "recommended": [
            {"stage": st, "option": key, "placement": f"placements/{st}-{key}.json"} for st, key in recommended
        ],
    }
    return Advice(
        manifest=manifest,
        rows=rows,
        layer_rows=layer_arrays(layer_cols),
        placements=placements,
        options={f"{st}-{o.key}": o for st in stages for o in options[st]},
    )


def _num_steps(inputs: AdviseInputs, steps: Steps) -> int:
    si = inputs.stages[steps]
    if si.tokens is not None:
        return si.tokens.num_steps
    return 0 if si.counts_NLE is None else int(si.counts_NLE.shape[0])


def advise_trace(
    trace: str | os.PathLike,
    cfg: AdviseConfig,
    *,
    current: str | os.PathLike | None = None,
    progress: Callable[[int, int], None] | None = None,
    count_progress: Callable[[int, int], None] | None = None,
) -> Advice:
    """The advice on a trace: placements fitted on ``compare``'s training requests, evaluated on steps
    drawn from the held-out requests (decode: ``num_steps`` steps of ``step_requests`` tokens; prefill:
    ``prefill_tokens_per_node`` per node and step, one per 100 decode steps and at least 4)."""
    inputs = trace_inputs(trace, cfg, current=current, count_progress=count_progress)
    return advise_arrays(inputs, cfg, progress=progress)


def advise_profile_counts(
    model: ModelInfo,
    counts: dict[str, np.ndarray],
    cfg: AdviseConfig,
    *,
    source: str,
    window_tokens: float | dict[str, float] | None = None,
    current: Placement | None = None,
    current_format: str = "",
) -> Advice:
    """The advice on a load profile: per stage, windows of expert counts in time order (int [N, L, E]);
    the first half fits the placements, the later half is evaluated (balancedness per window; the
    per-step terms on each window scaled to one step of ``step_requests`` decode tokens or
    ``prefill_tokens_per_node`` prompt tokens per node). One window (one engine statistics file) is
    fitted and evaluated in-sample, with no drift estimate (said in the output). ``window_tokens``
    only documents the windows."""
    del window_tokens  # the windows' counts are what is evaluated; steps are the config's
    inputs = profile_inputs(model, counts, cfg, source=source, current=current, current_format=current_format)
    return advise_arrays(inputs, cfg)


def advise_profile(path: str | os.PathLike, cfg: AdviseConfig, *, current: str | os.PathLike | None = None) -> Advice:
    """The advice on a load profile file (``moetrace.tracer.trace.profile``, docs/profile.md)."""
    from moetrace.tracer.trace import profile as prof

    p = prof.open_profile(path)
    cur = None
    if current is not None:
        from moetrace.placement.advise_current import read_current

        cur = read_current(current, model=p.model, num_ranks=cfg.deployment.num_ep)
    return advise_profile_counts(
        p.model,
        dict(p.counts),
        cfg,
        source=str(path),
        current=None if cur is None else cur[0],
        current_format="" if cur is None else cur[1],
    )


def is_profile(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a load profile."""
    from moetrace.tracer.trace import profile as prof

    return bool(prof.is_profile(path))


def advise_input(
    path: str | os.PathLike,
    cfg: AdviseConfig,
    *,
    current: str | os.PathLike | None = None,
    progress: Callable[[int, int], None] | None = None,
    count_progress: Callable[[int, int], None] | None = None,
) -> Advice:
    """The advice on ``path``: a load profile when it is one, else a trace."""
    if is_profile(path):
        return advise_profile(path, cfg, current=current)
    return advise_trace(path, cfg, current=current, progress=progress, count_progress=count_progress)
