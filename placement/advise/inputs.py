"""What ``moetrace advise`` evaluates, read into ``AdviseInputs``: from a trace (``trace_inputs``:
``compare``'s split, the grouped strategies fitted on its training requests, the steps drawn from its
held-out requests, whatever stages it recorded) or from a load profile's counts (``profile_inputs``:
windows in time order, the first half fits, the later half is evaluated).

Shape legend (docs/architecture.md): N windows, R requests, L MoE layers, E logical experts, T tokens,
K top-k slots.

Out of scope: evaluating the inputs (``run``); the trace's counts and split themselves (``compare_data``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.advise.config import AdviseConfig
from moetrace.placement.advise.options import resolve_strategies
from moetrace.placement.advise.types import AdviseInputs, Option, StageInput, Steps, StepTokens
from moetrace.placement.held_out import held_out_R
from moetrace.placement.maps import Placement

if TYPE_CHECKING:
    from moetrace.placement.compare import CompareConfig, TraceData
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = ["profile_inputs", "trace_inputs"]


def _windows(counts_RLE: np.ndarray, rows: np.ndarray, num_windows: int) -> np.ndarray:
    """``rows`` (arrival order) cut into ``num_windows`` contiguous windows, each summed, float64 [N, L, E]."""
    chunks = np.array_split(rows, min(num_windows, len(rows)))
    return np.stack([counts_RLE[c].sum(axis=0, dtype=np.float64) for c in chunks if len(c)])


def _sum_rows(counts_RLE: np.ndarray, rows: np.ndarray) -> np.ndarray:
    out = np.zeros(counts_RLE.shape[1:])
    for lo in range(0, len(rows), 1024):
        out += counts_RLE[rows[lo : lo + 1024]].sum(axis=0, dtype=np.float64)
    return out


def _load_trace(
    trace: str | os.PathLike, cfg: AdviseConfig, *, progress: Callable[[int, int], None] | None
) -> TraceData:
    """Counts, the compare split and the held-out tokens of a trace, whatever stages it recorded."""
    from moetrace.analysis.counts import count_trace
    from moetrace.placement.compare import EARLY_HELD_OUT_BYTES, load_trace_data
    from moetrace.tracer.trace.reader import open_trace
    from moetrace.tracer.trace.schema import stages_of

    tr = open_trace(trace)
    stages = stages_of(tr)
    if "decode" in stages:
        # the held-out tokens from the counting pass where they fit, as compare's (else read after fitting)
        return load_trace_data(
            trace,
            test_fraction=cfg.test_fraction,
            seed=cfg.seed,
            progress=progress,
            held_out_tokens=True,
            held_out_max_bytes=EARLY_HELD_OUT_BYTES,
        )
    from moetrace.placement.compare import TraceData

    counts = count_trace(tr, progress=progress)
    R = counts.num_requests
    if R < 4:
        raise TraceFormatError(f"{trace}: {R} requests; advise needs at least 4 (some to fit, some to evaluate)")
    is_test = held_out_R(R, test_fraction=cfg.test_fraction, seed=cfg.seed)  # compare's split: one seed, one split
    return TraceData(
        model=tr.model,
        trace_path=str(trace),
        prefill_RLE=counts.stage("prefill"),
        decode_RLE=counts.stage("decode"),
        is_test_R=is_test,
        test_topk_ids_TLK=None,
        test_req_T=None,
        stages=stages,
    )


def _prefill_tokens(data: TraceData) -> TraceData:
    """The held-out prompt tokens (a seeded sample, ``compare.MAX_PREFILL_TOKENS``) of a trace without decode."""
    from moetrace.placement.compare import MAX_PREFILL_TOKENS
    from moetrace.tracer.trace.reader import open_trace

    tr = open_trace(data.trace_path)
    req = tr.request_arrays
    bound = int(req.prompt_tokens_R[data.is_test_R].sum(dtype=np.int64))
    keep = min(1.0, MAX_PREFILL_TOKENS / max(bound, 1))
    rng = np.random.default_rng([len(data.is_test_R), 11])
    ids, rows = [], []
    for ta in tr.iter_token_arrays(batch_tokens=1 << 14):
        sel = ~ta.is_decode_T & data.is_test_R[ta.row_T] & (ta.topk_ids_TLK >= 0).any(axis=(1, 2))
        sel &= rng.random(len(sel)) < keep
        ids.append(ta.topk_ids_TLK[sel])
        rows.append(ta.row_T[sel])
    if not ids or sum(len(r) for r in rows) == 0:
        raise TraceFormatError(f"{data.trace_path}: the held-out requests have no recorded prompt tokens")
    p_ids, p_req = np.concatenate(ids), np.concatenate(rows)
    order = np.argsort(p_req, kind="stable")
    L, K = tr.model.num_moe_layers, tr.model.top_k
    return replace(
        data,
        test_topk_ids_TLK=np.zeros((0, L, K), np.int16),
        test_req_T=np.zeros(0, np.int64),
        test_prefill_ids_TLK=p_ids[order],
        test_prefill_req_T=p_req[order],
    )


def trace_inputs(
    trace: str | os.PathLike,
    cfg: AdviseConfig,
    *,
    current: str | os.PathLike | None = None,
    count_progress: Callable[[int, int], None] | None = None,
    on_ungrouped: Callable[[AdviseInputs], None] | None = None,
) -> AdviseInputs:
    """What ``advise_trace`` evaluates on a trace: the placements of the grouped strategies fitted on
    ``compare``'s training requests, and the steps drawn from the held-out requests (decode:
    ``num_steps`` steps of ``step_requests`` tokens; prefill: ``prefill_tokens_per_node`` per node and
    step, one per 100 decode steps and at least 4), through each grouped option's router too. The
    strategies and ``current`` are checked before minutes of counting.

    ``on_ungrouped(inputs)``: called with the same inputs but the grouped strategies (no ``extra``),
    before those are fitted, where the held-out tokens came with the counts (``advise_trace`` evaluates
    the other options meanwhile); not called otherwise."""
    from moetrace.placement.compare import (
        CompareConfig,
        held_out_batches,
        make_placement,
        prefill_batches,
        with_held_out_tokens,
    )
    from moetrace.placement.strategies import get_strategy
    from moetrace.tracer.trace.reader import open_trace
    from moetrace.tracer.trace.schema import stages_of

    dep = cfg.deployment
    tr = open_trace(trace)  # the manifest only: the checks below come before minutes of counting
    model = tr.model
    cfg.sweep(model.num_experts)
    recorded = stages_of(tr)
    names, _ = resolve_strategies(
        cfg.strategies,
        model=model,
        deployment=dep,
        routable="prefill" in recorded and "decode" in recorded,
        kind="trace",
    )
    grouped = [n for n in names if get_strategy(n).grouped]
    for n in grouped:
        get_strategy(n).check(model, num_nodes=dep.num_nodes)
    cur = None
    if current is not None:  # before minutes of counting
        from moetrace.placement.advise.current import read_current

        cur = read_current(current, model=model, num_ranks=dep.num_ep)
    data = _load_trace(trace, cfg, progress=count_progress)
    ccfg = CompareConfig(
        deployment=dep,
        strategies=("linear",),
        test_fraction=cfg.test_fraction,
        num_batches=cfg.num_steps,
        num_batch_requests=cfg.step_requests,
        dedup=cfg.decode_dedup,
        seed=cfg.seed,
        oracle=False,
        prefill_dedup=cfg.prefill_dedup,
        hardware=cfg.hardware,
        prefill_tokens_per_node=cfg.prefill_tokens_per_node,
    )
    has_p, has_d = "prefill" in data.stages, "decode" in data.stages
    missing: list[str] = []
    if not (has_p and has_d):
        missing.append(
            f"The trace recorded {'prefill' if has_p else 'decode'} routing only: no advice on "
            f"{'decode' if has_p else 'prefill'} steps, no prefill/decode correlation, and no joint placement "
            "(its router reads a request's prefill and places its decode)."
        )

    def inputs_of(
        stages: dict[Steps, StageInput],
        extra: tuple[Option, ...] = (),
        extra_tokens: dict[tuple[str, Steps], StepTokens] | None = None,
    ) -> AdviseInputs:
        return AdviseInputs(
            model=data.model,
            source=str(trace),
            kind="trace",
            stages=stages,
            current=None if cur is None else cur[0],
            current_format="" if cur is None else cur[1],
            extra=extra,
            extra_tokens={} if extra_tokens is None else extra_tokens,
            routable=has_p and has_d,
            missing=tuple(missing),
        )

    stages = None
    if data.test_topk_ids_TLK is not None or not has_d:  # the held-out tokens came with the counts (or no decode)
        data = with_held_out_tokens(data) if has_d else _prefill_tokens(data)
        stages = _stage_inputs(data, ccfg, cfg)
        if on_ungrouped is not None:
            on_ungrouped(inputs_of(stages))
    extra: list[Option] = []
    groups: dict[str, np.ndarray] = {}  # option key -> group of each request, where a router sends it
    if has_p and has_d:
        for n in grouped:  # fitted before large held-out tokens are read (memory; small ones came with the counts)
            ps = make_placement(data, ccfg, n)
            extra.append(Option(name=n, num_redundant=0, placement=ps.placement, fitted_on="decode", router=ps.router))
            if ps.group_of_test_R is not None:
                groups[n] = ps.group_of_test_R
    if stages is None:
        data = with_held_out_tokens(data)
        stages = _stage_inputs(data, ccfg, cfg)
    extra_tokens: dict[tuple[str, Steps], StepTokens] = {}
    pcfg = _prefill_cfg(ccfg, cfg, has_d=has_d)
    for key, group in groups.items():  # the steps each grouped option's router draws
        if has_d:
            assert data.test_topk_ids_TLK is not None
            jr, js, jsrc, _ = held_out_batches(data, ccfg, group)
            extra_tokens[(key, "decode")] = StepTokens(data.test_topk_ids_TLK[jr], js, jsrc, cfg.num_steps)
        if "prefill" in stages and (jd := prefill_batches(data, pcfg, group)) is not None:
            assert data.test_prefill_ids_TLK is not None
            extra_tokens[(key, "prefill")] = StepTokens(
                data.test_prefill_ids_TLK[jd[0]], jd[1], jd[2], pcfg.num_prefill_batches
            )
    return inputs_of(stages, tuple(extra), extra_tokens)


def _prefill_cfg(ccfg: CompareConfig, cfg: AdviseConfig, *, has_d: bool) -> CompareConfig:
    """The prefill steps' config: compare's with decode recorded, else one step per 100 decode steps (at least 4)."""
    return ccfg if has_d else replace(ccfg, num_batches=max(4, cfg.num_steps // 100))


def _stage_inputs(data: TraceData, ccfg: CompareConfig, cfg: AdviseConfig) -> dict[Steps, StageInput]:
    """Each recorded stage's fitting load, time windows and steps drawn from the held-out requests (no router)."""
    from moetrace.placement.compare import held_out_batches, prefill_batches

    has_d = "decode" in data.stages
    dep = cfg.deployment
    train = np.flatnonzero(~data.is_test_R)
    order = np.arange(len(data.is_test_R))  # counts rows are in request-id (arrival) order
    stages: dict[Steps, StageInput] = {}
    if has_d:
        assert data.test_topk_ids_TLK is not None
        rows, step, src, _ = held_out_batches(data, ccfg, None)
        stages["decode"] = StageInput(
            fit_LE=_sum_rows(data.decode_RLE, train),
            windows_NLE=_windows(data.decode_RLE, order, cfg.num_windows),
            tokens=StepTokens(data.test_topk_ids_TLK[rows], step, src, cfg.num_steps),
            pairs_per_step=float(cfg.step_requests * data.model.top_k),
        )
    if "prefill" in data.stages:
        pcfg = _prefill_cfg(ccfg, cfg, has_d=has_d)
        drawn = prefill_batches(data, pcfg, None)
        if drawn is not None:
            assert data.test_prefill_ids_TLK is not None
            prow, pstep, psrc = drawn
            stages["prefill"] = StageInput(
                fit_LE=_sum_rows(data.prefill_RLE, train),
                windows_NLE=_windows(data.prefill_RLE, order, cfg.num_windows),
                tokens=StepTokens(data.test_prefill_ids_TLK[prow], pstep, psrc, pcfg.num_prefill_batches),
                pairs_per_step=float(cfg.prefill_tokens_per_node * dep.num_groups * data.model.top_k),
            )
    return stages


def profile_inputs(
    model: ModelInfo,
    counts: dict[str, np.ndarray],
    cfg: AdviseConfig,
    *,
    source: str,
    current: Placement | None = None,
    current_format: str = "",
) -> AdviseInputs:
    """What ``advise_profile_counts`` evaluates on a load profile: per stage, windows of expert counts in
    time order (int [N, L, E]); the first half fits the placements, the later half is evaluated (one
    window: in-sample). Strategies a profile cannot build are refused here, before any evaluation."""
    stages: dict[Steps, StageInput] = {}
    K = model.top_k
    mixed = "mixed" in counts and "prefill" not in counts and "decode" not in counts
    if mixed:  # the engine's recorder counted both stages together (SGLang stat, TensorRT-LLM): one stage
        counts = {"decode": counts["mixed"]}
    for st in ("prefill", "decode"):
        if st not in counts:
            continue
        c = np.asarray(counts[st], dtype=np.float64)
        if c.ndim != 3 or c.shape[1:] != (model.num_moe_layers, model.num_experts) or len(c) < 1:
            raise ConfigError(
                f"profile counts of {st} must be [windows >= 1, {model.num_moe_layers} layers, {model.num_experts} experts], "
                f"got {c.shape}"
            )
        half = len(c) // 2
        fit, evaluated = (c[:half], c[half:]) if half else (c, c)  # one window: in-sample
        step_tokens = cfg.step_requests if st == "decode" else cfg.prefill_tokens_per_node * cfg.deployment.num_groups
        stages[st] = StageInput(
            fit_LE=fit.sum(axis=0), windows_NLE=c, counts_NLE=evaluated, pairs_per_step=float(step_tokens * K)
        )
    if not stages:
        raise ConfigError("the profile holds neither prefill nor decode counts")
    missing = [
        "A load profile holds counts, not tokens: distinct destination ranks per token are n/a, the copy model "
        "is one copy per (token, expert) in both stages (a trace's prefill steps count one per node), and ours (joint) and the other grouped strategies "
        "need per-request routing."
    ]
    if mixed:
        missing.append(
            "The profile's counts mix prefill and decode (the engine's recorder does not tell them apart): advised "
            "as one stage under the decode step model; the verdict labelled decode is for that mixed traffic."
        )
    elif len(stages) == 1:
        have = next(iter(stages))
        missing.append(
            f"The profile has {have} counts only: no advice on the other stage, no prefill/decode correlation."
        )
    inputs = AdviseInputs(
        model=model,
        source=source,
        kind="profile",
        stages=stages,
        current=current,
        current_format=current_format,
        missing=tuple(missing),
    )
    if cfg.strategies:  # refuse what a profile cannot build before any evaluation
        resolve_strategies(cfg.strategies, model=model, deployment=cfg.deployment, routable=False, kind="profile")
    return inputs
