"""The advise run: ``advise_arrays`` evaluates every option on every recorded stage of an
``AdviseInputs`` in six named steps (``_prepare`` the options, ``_evaluate`` their evaluation,
``_rows`` the rows, ``_missing`` what the input lacks, ``_recommended`` the placements written,
``_manifest`` advice.json), and the entry points over it: ``advise_trace`` (a trace),
``advise_profile_counts`` / ``advise_profile`` (a load profile), ``advise_input`` (either, by what
the path is).

Out of scope: the parts it calls (the package's other modules: ``inputs``, ``fit``, ``evaluate``,
``rows``, ``drift``, ``verdicts``), the result files (``files``); what ``moetrace advise`` answers
and how (the package's docstring).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from moetrace.placement.advise.config import AdviseConfig
from moetrace.placement.advise.drift import MIN_DRIFT_WINDOWS, stage_correlation, stage_drift, stage_weights
from moetrace.placement.advise.evaluate import evaluate_counts, evaluate_tokens
from moetrace.placement.advise.fit import stage_options
from moetrace.placement.advise.inputs import profile_inputs, trace_inputs
from moetrace.placement.advise.options import data_free_placement, resolve_strategies
from moetrace.placement.advise.rows import (
    MigrationRow,
    add_layer_rows,
    layer_arrays,
    migration_row,
    summary_row,
    weight_bytes,
)
from moetrace.placement.advise.types import Advice, AdviseInputs, Option, Stage, StepMetrics, Steps
from moetrace.placement.advise.verdicts import stage_choices, verdicts
from moetrace.placement.advise_manifest import AdviceManifest, AdviceVerdict, DriftEstimate, Recommended, plain_json
from moetrace.placement.advise_option_row import OptionRow
from moetrace.placement.eplb_replicas import slot_shares
from moetrace.placement.hardware import CostModel

if TYPE_CHECKING:
    from moetrace.placement.cost import ExpertCompute
    from moetrace.placement.decision import StageChoice
    from moetrace.placement.maps import Placement
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "advise_arrays",
    "advise_input",
    "advise_profile",
    "advise_profile_counts",
    "advise_trace",
    "is_profile",
]


@dataclass(frozen=True, kw_only=True)
class _Run:
    """What one advise run fixes before evaluating: the stages, the options per stage and how a step is priced."""

    recorded: list[Steps]  # the recorded stages, whose steps are evaluated
    stages: list[Stage]  # the placements advised: each recorded stage, and both when two are
    sweep: list[int]  # redundant slots per layer EPLB is swept over
    names: tuple[str, ...]  # the strategies evaluated (``resolve_strategies``)
    notes: list[str]  # what the output must say about the strategies chosen
    expert: ExpertCompute | None  # the experts' size (None: unknown, no MoE-layer time)
    cost: CostModel  # kernels and expert computation
    bytes_per_token: int  # bytes of one token row on the wire
    time_hidden: int  # values per token row the step model prices
    ref: Option  # the reference every option is measured against (``--current`` or linear)
    options: dict[Stage, list[Option]]  # stage -> the reference, then the options fitted for it

    @property
    def plan(self) -> list[tuple[Stage, Steps]]:
        """(placement's stage, steps it is evaluated on): each stage on its own steps, both on each recorded one."""
        return [(st, steps) for st in self.stages for steps in (self.recorded if st == "both" else [st])]


#: an evaluation's key: (the stage the option was fitted on, its key, the steps)
_JobKey = tuple[str, str, Steps]


def _job_key(opt: Option, steps: Steps) -> _JobKey:
    return (opt.fitted_on, opt.key, steps)


def _prepare(inputs: AdviseInputs, cfg: AdviseConfig) -> _Run:
    """Step 1: the stages, the strategies, the cost model, the reference and every stage's options."""
    from moetrace.placement.cost import expert_compute_for

    m, dep = inputs.model, cfg.deployment
    E = m.num_experts
    sweep = cfg.sweep(E)
    expert = expert_compute_for(m, config=cfg.model_config)
    recorded: list[Steps] = [s for s in ("prefill", "decode") if s in inputs.stages]
    stages: list[Stage] = list(recorded)
    if len(recorded) == 2:
        stages.append("both")
    names, notes = resolve_strategies(
        cfg.strategies, model=m, deployment=dep, routable=inputs.routable, kind=inputs.kind
    )
    ref = (
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
        options[st] = [ref, *(o for o in here if o.key != ref.key)]
    return _Run(
        recorded=recorded,
        stages=stages,
        sweep=sweep,
        names=names,
        notes=notes,
        expert=expert,
        cost=CostModel(hardware=cfg.hardware, expert=expert),
        bytes_per_token=m.hidden_size * 2,
        time_hidden=expert.hidden_size if expert is not None else m.hidden_size,
        ref=ref,
        options=options,
    )


def _evaluate_one(
    job: tuple[Option, Steps],
    *,
    inputs: AdviseInputs,
    cfg: AdviseConfig,
    run: _Run,
    shares: dict[tuple[str, str], np.ndarray],
) -> StepMetrics:
    """One option on one recorded stage's steps: a trace's simulated steps (the steps its router draws
    for a grouped option), or a profile's windows of counts (``shares``: a cache of slot shares under
    SGLang's replica rule)."""
    opt, steps = job
    dep = cfg.deployment
    si = inputs.stages[steps]
    dedup = cfg.decode_dedup if steps == "decode" else cfg.prefill_dedup
    toks = inputs.extra_tokens.get((opt.key, steps), si.tokens)
    if toks is not None:
        return evaluate_tokens(
            toks,
            opt.placement,
            deployment=dep,
            dedup=dedup,
            cost=run.cost,
            bytes_per_token=run.bytes_per_token,
            hidden_size=run.time_hidden,
            rule=cfg.replica_policy,
        )
    assert si.counts_NLE is not None  # a profile stage
    share = None
    if cfg.replica_policy == "sglang":  # the other rules split evenly on average
        k = (opt.fitted_on, opt.key)
        if k not in shares:
            shares[k] = slot_shares(
                opt.placement, rule=cfg.replica_policy, num_ranks=dep.num_ep, ranks_per_node=dep.ranks_per_node
            )
        share = shares[k]
    return evaluate_counts(
        si.counts_NLE,
        opt.placement,
        deployment=dep,
        cost=run.cost,
        dedup=dedup,
        pairs_per_step=si.pairs_per_step,
        bytes_per_token=run.bytes_per_token,
        hidden_size=run.time_hidden,
        slot_share_LP=share,
    )


#: the most threads that evaluate options side by side
MAX_EVALUATION_THREADS = 2


def _evaluation_threads() -> int:
    return min(MAX_EVALUATION_THREADS, os.cpu_count() or 1)


def _jobs(run: _Run) -> dict[_JobKey, tuple[Option, Steps]]:
    """Every (option, steps) of the plan once (an option shared by stages too), in the plan's order."""
    jobs: dict[_JobKey, tuple[Option, Steps]] = {}
    for st, steps in run.plan:
        for opt in [run.ref, *run.options[st]]:
            jobs.setdefault(_job_key(opt, steps), (opt, steps))
    return jobs


def _evaluate(
    inputs: AdviseInputs,
    cfg: AdviseConfig,
    run: _Run,
    *,
    progress: Callable[[int, int], None] | None,
    pool: Executor | None = None,
    started: dict[_JobKey, Future[StepMetrics]] | None = None,
) -> dict[_JobKey, StepMetrics]:
    """Step 2: every (option, steps) of the plan evaluated once, on two threads (``pool``'s where given);
    ``started``: evaluations already under way (``advise_trace``'s, of the same options on the same
    steps); ``progress(done, total)`` after each."""
    jobs = _jobs(run)
    one = functools.partial(_evaluate_one, inputs=inputs, cfg=cfg, run=run, shares={})
    started = started or {}
    evals: dict[_JobKey, StepMetrics] = {}
    with contextlib.ExitStack() as stack:
        if pool is None:
            # numpy's sorts and bincounts release the GIL: two threads keep two cores busy (results do not depend on it)
            pool = stack.enter_context(ThreadPoolExecutor(max_workers=_evaluation_threads()))
        futures = {k: started[k] if k in started else pool.submit(one, job) for k, job in jobs.items()}
        for n, (k, fut) in enumerate(futures.items(), start=1):
            evals[k] = fut.result()
            if progress is not None:
                progress(n, len(jobs))
    return evals


#: the columns of layers.parquet, in order
_LAYER_COLUMNS = (
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


def _rows(
    inputs: AdviseInputs, cfg: AdviseConfig, run: _Run, evals: dict[_JobKey, StepMetrics]
) -> tuple[list[OptionRow], dict[str, np.ndarray]]:
    """Step 3: the summary row of every (stage, steps, option) against the reference on the same steps,
    with its migration from the reference (options.parquet), and the per-layer rows (layers.parquet)."""
    m = inputs.model
    moved: dict[tuple[str, str], MigrationRow] = {}
    rows: list[OptionRow] = []
    layer_cols: dict[str, list[Any]] = {k: [] for k in _LAYER_COLUMNS}
    for st, steps in run.plan:
        ref = evals[_job_key(run.ref, steps)]
        for opt in run.options[st]:
            em = evals[_job_key(opt, steps)]
            if (opt.fitted_on, opt.key) not in moved:
                moved[(opt.fitted_on, opt.key)] = migration_row(
                    run.ref, opt, dep=cfg.deployment, model=m, weight_bytes=weight_bytes(run.cost)
                )
            rows.append(summary_row(em, ref, option=opt, stage=st, steps=steps, moved=moved[(opt.fitted_on, opt.key)]))
            add_layer_rows(layer_cols, em, stage=st, steps=steps, option=opt.key, model=m)
    return rows, layer_arrays(layer_cols)


def _missing(inputs: AdviseInputs, run: _Run, *, drift_estimated: bool) -> list[str]:
    """Step 4: what the input lacks and what the strategies' choice leaves out, in words; without a
    drift estimate, why and what to record to get one."""
    missing = [*inputs.missing, *run.notes]
    if not drift_estimated:
        n = min(len(inputs.stages[s].windows_NLE) for s in run.recorded)
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
    return missing


def _recommended(recommended: list[tuple[str, str]], best: list[StageChoice], *, ref_key: str) -> list[tuple[str, str]]:
    """Step 5: the (stage, option key) pairs whose placements are written: the verdicts' recommendations,
    then each stage's decision by the one rule where it is not the reference, each once."""
    return list(dict.fromkeys([*recommended, *((c.stage, c.decision) for c in best if c.decision != ref_key)]))


def _manifest(
    inputs: AdviseInputs,
    cfg: AdviseConfig,
    run: _Run,
    *,
    missing: list[str],
    correlation: float | None,
    drift: dict[str, DriftEstimate],
    drift_estimated: bool,
    verdicts: list[AdviceVerdict],
    best: list[StageChoice],
    recommended: list[tuple[str, str]],
) -> AdviceManifest:
    """Step 6: advice.json (without the commands, which name where it is written: ``write_advice``)."""
    m, dep = inputs.model, cfg.deployment
    return AdviceManifest(
        input=inputs.source,
        input_kind=inputs.kind,
        trace=inputs.source if inputs.kind == "trace" else None,  # the dashboard shows its overview too
        model=m,
        deployment=dep.name,
        gpus_per_node=dep.num_gpus_per_node,
        num_ep=dep.num_ep,
        num_nodes=dep.num_nodes,
        reference=run.ref.key,
        current_format=inputs.current_format or None,
        stages=tuple(run.stages),
        recorded_stages=tuple(run.recorded),
        missing=tuple(missing),
        redundancy_sweep=tuple(plain_json(run.sweep)),
        max_slots_per_gpu=plain_json(cfg.slot_limit(m.num_experts)),
        num_steps={s: int(_num_steps(inputs, s)) for s in run.recorded},
        decode_dedup=cfg.decode_dedup,
        prefill_dedup=cfg.prefill_dedup,
        hardware=cfg.hardware,
        expert=None if run.expert is None else plain_json(run.expert.to_json()),
        test_fraction=cfg.test_fraction,
        seed=cfg.seed,
        strategies=run.names,
        eplb_sum=cfg.eplb_sum,
        replica_policy=cfg.replica_policy,
        step_tokens_per_gpu={"decode": cfg.decode_tokens_per_gpu, "prefill": cfg.prefill_tokens_per_gpu},
        rearrangement=cfg.rearrangement,
        prefill_decode_correlation=plain_json(correlation),
        drift_estimated=drift_estimated,
        drift=dict(drift),
        verdicts=tuple(verdicts),
        best={c.stage: c for c in best},
        recommended=tuple(
            Recommended(stage=st, option=key, placement=f"placements/{st}-{key}.json") for st, key in recommended
        ),
    )


def advise_arrays(
    inputs: AdviseInputs,
    cfg: AdviseConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
    pool: Executor | None = None,
    started: dict[_JobKey, Future[StepMetrics]] | None = None,
) -> Advice:
    """Evaluate every option on every recorded stage of ``inputs``, then word the verdicts, in six
    steps: the options (``_prepare``), their evaluation (``_evaluate``), the rows (``_rows``), what the
    input lacks (``_missing``), the recommended placements (``_recommended``) and advice.json (``_manifest``).

    ``progress(done, total)`` after each (option, steps) evaluation; ``pool``, ``started``: the
    evaluations' threads and those already under way (``advise_trace``).
    """
    run = _prepare(inputs, cfg)
    evals = _evaluate(inputs, cfg, run, progress=progress, pool=pool, started=started)
    rows, layer_rows = _rows(inputs, cfg, run, evals)
    correlation = stage_correlation(inputs)
    drift: dict[str, DriftEstimate] = {st: stage_drift(inputs, st, cfg=cfg, rows=rows) for st in run.stages}
    drift_estimated = all(d.estimated for d in drift.values())
    missing = _missing(inputs, run, drift_estimated=drift_estimated)
    best = stage_choices(rows, stages=list(run.stages), ref_key=run.ref.key)  # the one rule (decision.choose)
    verdict_list, recommended = verdicts(
        rows,
        stages=list(run.stages),
        ref_key=run.ref.key,
        ref_label=run.ref.label,
        drift=drift,
        correlation=correlation,
        weights=stage_weights(inputs),
        missing=tuple(missing),
        rearrangement=cfg.rearrangement,
        decisions={c.stage: c for c in best},
    )
    recommended = _recommended(recommended, best, ref_key=run.ref.key)
    manifest = _manifest(
        inputs,
        cfg,
        run,
        missing=missing,
        correlation=correlation,
        drift=drift,
        drift_estimated=drift_estimated,
        verdicts=verdict_list,
        best=best,
        recommended=recommended,
    )
    return Advice(
        manifest=manifest,
        rows=rows,
        layer_rows=layer_rows,
        placements={
            r.stem: next(o for o in run.options[r.stage] if o.key == r.option)
            for r in manifest.recommended
            if r.stage in run.options
        },
        options={f"{st}-{o.key}": o for st in run.stages for o in run.options[st]},
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
    ``prefill_tokens_per_node`` per node and step, one per 100 decode steps and at least 4).

    Where the held-out tokens come with the counts, the options that need no grouped strategy (EPLB's,
    the data-free ones) are evaluated while the grouped ones (joint) are fitted, on threads that yield
    their cores to the fitting (``compare.behind_the_placing``); each evaluation is the same whenever it
    runs."""
    from moetrace.placement.compare import behind_the_placing

    started: dict[_JobKey, Future[StepMetrics]] = {}
    pool = ThreadPoolExecutor(max_workers=_evaluation_threads(), initializer=behind_the_placing)

    def start(ungrouped: AdviseInputs) -> None:
        run = _prepare(ungrouped, cfg)
        one = functools.partial(_evaluate_one, inputs=ungrouped, cfg=cfg, run=run, shares={})
        started.update({k: pool.submit(one, job) for k, job in _jobs(run).items()})

    try:
        inputs = trace_inputs(trace, cfg, current=current, count_progress=count_progress, on_ungrouped=start)
        return advise_arrays(inputs, cfg, progress=progress, pool=pool, started=started)
    finally:  # an error: the evaluations not started are dropped, not waited for
        pool.shutdown(wait=True, cancel_futures=True)


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
        from moetrace.placement.advise.current import read_current

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
