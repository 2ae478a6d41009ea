"""The "Advice" section, from ``moetrace advise`` results (docs/advise.md, "Output files").

Shown first when present: the verdicts of ``advice.json`` (one per stage, in plain words, with the
numbers behind them), a table per stage of every option (balancedness as vLLM logs it, the busiest
rank, activated experts per GPU, destination ranks per token, predicted time and inter-node bytes
over the reference, weights that move), and one figure: balancedness per MoE layer, a line per
option, for each stage's own steps (``layers.parquet``).

``advice.json`` is read as its typed record (``records.AdviceManifest``, ``Results.advice``), never by
key; ``options.parquet`` as its typed rows (``records.OptionRow.from_row``), ``layers.parquet`` by its
columns.

Shape legend (docs/architecture.md): L MoE layers, V options.

Out of scope: computing the advice (``moetrace.placement.advise``).
"""

from __future__ import annotations

import math
from typing import Any

import polars as pl

from moetrace import results as rf
from moetrace.dashboards.figures import lines_by_layer
from moetrace.dashboards.page import Figure, Section, Table
from moetrace.dashboards.records import Measure, OptionRow
from moetrace.dashboards.results import Results
from moetrace.dashboards.section_placement import strategy_colours


def _num(x: Any, fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _change(x: Any) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{(x - 1) * 100:+.1f} %"


def _option_rows(res: Results, table: pl.DataFrame) -> list[OptionRow]:
    """``options.parquet``'s rows, typed (a column missing or of another type: ``TraceFormatError``)."""
    where = res.source(rf.ADVICE_OPTIONS)
    return [OptionRow.from_row(r, where=where) for r in table.iter_rows(named=True)]


def _stage_table(res: Results, rows: list[OptionRow], *, stage: str, steps: str, kp: str, time: Measure) -> Table:
    sub = [r for r in rows if r.stage == stage and r.steps == steps]
    what = "MoE-layer time" if time == "moe" else "all-to-all time"
    return Table(
        key=f"{kp}-{stage}-{steps}",
        header=(
            "option",
            "balancedness (vLLM)",
            "balancedness min / p50 / p90 over layers",
            "busiest rank's tokens",
            "activated experts / GPU (max)",
            "ranks / token",
            f"{what} vs reference [p10, p90]",
            "inter-node bytes vs reference",
            "weights moved",
            "extra per GPU",
        ),
        rows=tuple(
            (
                r.label,
                _num(r.balancedness_vllm, ".3f"),
                " / ".join(_num(x, ".2f") for x in (r.balancedness_min, r.balancedness_p50, r.balancedness_p90)),
                _num(r.busiest_rank_tokens, ".1f"),
                _num(r.activated_experts_per_gpu_max, ".2f"),
                _num(r.send_ranks_per_token, ".2f"),
                f"{_change(r.vs_ref(time))} [{_change(r.vs_ref_p10(time))}, {_change(r.vs_ref_p90(time))}]",
                _change(r.inter_node_vs_ref),
                "n/a" if r.bytes_moved is None else f"{r.bytes_moved / 1e9:.1f} GB",
                "n/a" if r.extra_bytes_per_gpu is None else f"{r.extra_bytes_per_gpu / 1e9:.1f} GB",
            )
            for r in sub
        ),
        caption=f"{stage} placement on {steps} steps (from {res.source(rf.ADVICE_OPTIONS)}): medians over steps; "
        "changes over the reference's median.",
        nowrap=True,
    )


def _figure(res: Results, layers: pl.DataFrame, *, stage: str, kp: str) -> Figure:
    sub = layers.filter((pl.col("stage") == stage) & (pl.col("steps") == stage)).sort("layer")
    options = list(dict.fromkeys(sub["option"].to_list()))
    strategies = {o: o.split("-")[0] if o.startswith("eplb") else o for o in options}
    base = strategy_colours(list(dict.fromkeys(strategies.values())))
    colours = {o: base[strategies[o]] for o in options}
    dash = {
        o: ("solid", "dash", "dot", "dashdot", "longdash")[i % 5] if o.startswith("eplb") else "solid"
        for i, o in enumerate(options)
    }
    model_layers = sub.filter(pl.col("option") == options[0])["model_layer"].to_list()
    series = {o: sub.filter(pl.col("option") == o)["balancedness"].to_numpy() for o in options}
    fig = lines_by_layer(
        series,
        layers=model_layers,
        y_title="balancedness (mean / max tokens per EP rank)",
        what=f"Balancedness per layer, {stage} steps",
        source=res.label,
        reference={"balanced": 1.0},
        colours=colours,
        dash=dash,
    )
    return res.figure(
        f"{kp}-balancedness-{stage}",
        fig,
        file=rf.ADVICE_LAYERS,
        caption="Per MoE layer and option: the mean over steps of (mean over EP ranks / max over EP ranks) of the "
        "(token, expert) pairs each rank computes, as vLLM's EPLB logs it; 1.0 is every rank equally loaded.",
    )


def advice_section(res: Results, *, key_prefix: str = "") -> tuple[Section | None, list[str]]:
    """The Advice section of one ``moetrace advise`` results directory, or None and why."""
    kp = f"{key_prefix}advice"
    m = res.advice
    table = res.table(rf.ADVICE_OPTIONS)
    if table is None or table.height == 0:
        return None, [f"advice: no {rf.ADVICE_OPTIONS} in {res.path}"]
    rows = _option_rows(res, table)
    layers = res.table(rf.ADVICE_LAYERS)
    time: Measure = "moe" if m.expert else "a2a"
    tables = [
        _stage_table(res, rows, stage=st, steps=steps, kp=kp, time=time)
        for st in m.stages
        for steps in dict.fromkeys(r.steps for r in rows if r.stage == st)
    ]
    figures = [] if layers is None else [_figure(res, layers, stage=st, kp=kp) for st in m.recorded_stages]
    from moetrace.placement.advise.files import best_lines  # the words `moetrace advise` prints, said once

    decision = " ".join(line.strip() for line in best_lines(m))  # the decision per stage, then why
    verdicts = [decision, *(v.text for v in m.verdicts)]
    intro = (
        f"{m.deployment} on nodes of {m.gpus_per_node} GPUs; reference: {m.reference}; EPLB swept over "
        f"{list(m.redundancy_sweep)} redundant experts (at most {m.max_slots_per_gpu} slots per GPU); input: "
        f"{m.input} ({m.input_kind}). " + " ".join(verdicts)
    )
    notes = [f"{c.stage}: {c.option}: " + "; ".join(c.export.values()) for c in m.commands]
    return Section(
        key=kp, title="Advice", intro=intro, tables=tuple(tables), figures=tuple(figures), notes=tuple(notes)
    ), []
