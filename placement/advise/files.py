"""``moetrace advise``'s result files and printed text: ``advice.json`` (the typed
``advise_manifest.AdviceManifest`` with the commands that reproduce and export each recommended
placement, written through its ``to_json``), ``options.parquet`` (``advise_option_row.OptionRow``
rows, written through their ``to_row``), ``layers.parquet``, the placements, and the table and
verdicts the command prints.

Out of scope: computing the advice (``run``), its verdicts (``verdicts``), the record
itself (``advise_manifest``).
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moetrace import results as rf
from moetrace.errors import TraceFormatError
from moetrace.placement.advise_manifest import AdviceCommand, AdviceManifest
from moetrace.placement.deployment import Deployment
from moetrace.placement.eplb import ACCUMULATE_WHO
from moetrace.placement.legends import ADVISE_LEGEND, legend_lines

if TYPE_CHECKING:
    from moetrace.placement.advise.types import Advice

__all__ = ["best_lines", "commands", "format_advice", "read_advice", "write_advice"]


# ------------------------------------------------------------------------------ commands
def commands(advice: Advice, *, out: str | os.PathLike) -> list[AdviceCommand]:
    """The ``moetrace place`` / ``moetrace export`` commands of every recommended option, per engine
    (``out``: the advice directory holding its placement files)."""
    from moetrace.placement.advise.options import EPLB_STRATEGIES
    from moetrace.placement.exports import PLACEMENT_EXPORTS
    from moetrace.placement.strategies import STRATEGY_NAMES, get_strategy

    out_cmds = []
    suffix = {"sglang": "json", "trtllm": "yaml", "vllm": "json", "vllm-ascend": "json", "llmd-fixed-placement": "json"}
    man = advice.manifest
    input_path, config = man.input, man.deployment
    gpn = f" --gpus-per-node {man.gpus_per_node}" if man.gpus_per_node != 8 else ""
    for rec in man.recommended:
        st, key = rec.stage, rec.option
        opt = advice.placements[rec.stem]
        path = f"{out}/{rec.placement}"
        exported = f"{out}/exports/{rec.stem}"  # beside the results they come from, one name per (stage, option)
        place = None
        eplb = opt.name in EPLB_STRATEGIES
        grouped = opt.name in STRATEGY_NAMES and get_strategy(opt.name).grouped
        if man.input_kind == "trace" and (st == "decode" and eplb or grouped):
            red = f" --redundancy {opt.num_redundant}" if opt.num_redundant else ""
            esum = f" --eplb-sum {man.eplb_sum}" if eplb and man.eplb_sum != "float64" else ""
            place = (
                f"moetrace place {input_path} --config {config}{gpn} --strategy {opt.name}{red}{esum} "
                f"--test-fraction {man.test_fraction} --seed {man.seed} -o {exported}.place.json"
            )
        exports: dict[str, str] = {
            fmt: f"moetrace export {path} --format {fmt} -o {exported}.{fmt}.{suffix[fmt]}" for fmt in PLACEMENT_EXPORTS
        }
        if man.input_kind == "trace" and eplb:
            stage_arg = "both" if st == "both" else st
            exports["sglang (counts; SGLang runs its own EPLB)"] = (
                f"moetrace export {input_path} --format sglang-logical-count --stage {stage_arg} "
                f"-o {out}/exports/{st}-logical_count.json"
            )
        out_cmds.append(AdviceCommand(stage=st, option=key, placement=path, place=place, export=exports))
    return out_cmds


# ------------------------------------------------------------------------------ result files
def write_advice(
    advice: Advice, out: str | os.PathLike, *, deployment: Deployment, final_dir: str | os.PathLike | None = None
) -> list[Path]:
    """Write the advice directory (``moetrace.results.ADVICE``): ``options.parquet``, ``layers.parquet``,
    the recommended placements under ``placements/``, and ``advice.json`` (with the ``commands``) last.
    Returns the paths.

    ``final_dir``: where the files will be read from when ``out`` is a folder built beside it and
    swapped in later (``moetrace.atomic.replacing_directory``); the commands and the recorded input
    paths name it, never ``out``. None: ``out`` itself."""
    import polars as pl

    from moetrace.placement.exports import PlacementFile, save_placement
    from moetrace.placement.routers import NoRouter

    out = Path(out)
    final = out if final_dir is None else Path(final_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    man = advice.manifest
    for stem, opt in advice.placements.items():
        p = out / "placements" / f"{stem}.json"
        pf = PlacementFile(
            model=man.model,
            deployment=deployment,
            strategy=opt.name,
            placement=opt.placement,
            router=opt.router if opt.router is not None else NoRouter(),
            source={
                "advise": rf.recorded_path(man.input, results_dir=final / "placements"),
                "fitted_on": opt.fitted_on or None,
                "option": opt.key,
            },
        )
        save_placement(pf, p)
        written.append(p)
    options = pl.DataFrame([r.to_row() for r in advice.rows])
    written.append(rf.write_result_table(out, rf.ADVICE, rf.ADVICE_OPTIONS, options))
    written.append(rf.write_result_table(out, rf.ADVICE, rf.ADVICE_LAYERS, pl.DataFrame(advice.layer_rows)))
    body = dataclasses.replace(
        man,
        # relative to the results: no absolute path of the user's machine
        input=rf.recorded_path(man.input, results_dir=final),
        trace=None if man.trace is None else rf.recorded_path(man.trace, results_dir=final),
        commands=tuple(commands(advice, out=final)),
    )
    written.append(rf.write_result_json(out, rf.ADVICE, rf.ADVICE_MANIFEST, body.to_json()))
    return written


def format_advice(advice: Advice, *, out: str | os.PathLike) -> str:
    """The verdicts, a table of the options per stage and the commands, as ``moetrace advise`` prints them."""
    man = advice.manifest
    step_tokens = man.step_tokens_per_gpu or {}
    lines = [
        f"moetrace advise: {man.input} ({man.input_kind}), {man.deployment}, reference {man.reference}",
        f"EPLB summed in {man.eplb_sum} ({ACCUMULATE_WHO[man.eplb_sum or 'float64']}); replica policy {man.replica_policy}; "
        f"steps of {step_tokens['decode']} decode and {step_tokens['prefill']} prefill tokens per GPU; "
        + ("drift estimated over the windows" if man.drift_estimated else "no drift estimate (fewer than 4 windows)"),
    ]
    if man.expert is None:  # the time column is then all-to-all time; say why and how to give the size
        from moetrace.placement.cost import expert_unknown_reason

        reason = expert_unknown_reason(man.model)
        lines.append(reason or "MoE-layer time n/a: the expert size is unknown")
    for st in man.stages:
        for steps in dict.fromkeys(r.steps for r in advice.rows if r.stage == st):
            lines.append(f"\n{st} placement, {steps} steps:")
            lines.append(
                f"  {'option':<28} {'balanced':>8} {'busiest':>8} {'act/GPU':>7} {'ranks/tok':>9} {'MoE time':>9} "
                f"{'[p10, p90]':>15} {'inter B':>8} {'moved':>9}"
            )
            for r in (r for r in advice.rows if r.stage == st and r.steps == steps):
                moved = "—" if r.bytes_moved is None else f"{r.bytes_moved / 1e9:.1f} GB"
                tk = r.measure  # MoE-layer time; all-to-all time when the expert size is unknown
                t, t10, t90 = r.vs_ref(tk), r.vs_ref_p10(tk), r.vs_ref_p90(tk)
                sr = "n/a" if np.isnan(r.send_ranks_per_token) else f"{r.send_ranks_per_token:.2f}"
                lines.append(
                    f"  {r.label:<28} {r.balancedness_vllm:>8.3f} {r.busiest_rank_tokens:>8.1f} "
                    f"{r.activated_experts_per_gpu_max:>7.2f} {sr:>9} {t:>9.3f} [{t10:.3f}, {t90:.3f}] "
                    f"{r.inter_node_vs_ref:>8.3f} {moved:>9}"
                )
    lines += ["", *legend_lines(ADVISE_LEGEND, indent="")]
    lines += ["", *best_lines(man)]
    lines.append("\nWhy, per stage (EPLB's sweep, the other strategies, what a rearrangement costs):")
    lines += advice.verdicts
    cmds = commands(advice, out=out)
    if cmds:
        lines.append(f"\ncommands (each writes under {out}/exports/):")
    for c in cmds:
        lines.append(f"\n{c.stage}: {c.option} (placement file {c.placement})")
        if c.place:
            lines.append(f"  {c.place}")
        lines += [f"  {cmd}" for cmd in c.export.values()]
    return "\n".join(lines)


def best_lines(man: AdviceManifest) -> list[str]:
    """``Decision per stage ...``: advice.json's ``best`` (``decision.choose`` over every option) in words,
    with how it relates to ``compare``."""
    from moetrace.placement.decision import MIN_GAIN, objective, relation

    if not man.best:
        return []
    ref = man.reference
    choices = list(man.best.values())
    rule = objective(choices[0].measure)
    head = f"Decision per stage (the rule compare applies too: {rule}; under {MIN_GAIN:.0%} saved: keep {ref}):"
    texts = [ch.text() for ch in choices]
    texts.append(relation(command="advise", strategies=man.strategies))
    out = textwrap.wrap(head, width=100, subsequent_indent="  ")
    for t in texts:
        out += textwrap.wrap(t, width=100, initial_indent="  ", subsequent_indent="    ")
    return out


def read_advice(path: str | os.PathLike) -> AdviceManifest:
    """The ``advice.json`` of an advice directory, its format and version checked, as its typed record;
    ``TraceFormatError`` naming the file and the problem (absent, unreadable, a key missing or of the
    wrong type)."""
    from moetrace.inputs import read_input_json

    p = Path(path) / rf.ADVICE_MANIFEST
    if not p.is_file():
        raise TraceFormatError(f"{path}: no {rf.ADVICE_MANIFEST} (write one with `moetrace advise`)")
    try:  # a regular file of bounded size and bounded integers
        obj = read_input_json(p, max_bytes=rf.MAX_RESULT_JSON_BYTES)
    except OSError as exc:
        raise TraceFormatError(f"{p}: unreadable ({exc.strerror or exc})") from None
    rf.check_result_json(p, obj, rf.ADVICE)
    return AdviceManifest.from_json(obj, where=str(p))
