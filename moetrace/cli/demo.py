"""``moetrace demo``: the whole pipeline on the embedded default, as the commands a user would type.

Each step is printed as its command line and run through the same CLI in this process, so the demo
is also a walkthrough: copy any line to repeat a step.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Annotated

import typer

from moetrace.cli.common import OutDir, Seed, err, friendly_errors
from moetrace.placement.strategies import RECOMMENDED

SYNTH_DATASETS = "gsm8k,math,mbpp,humaneval,lmsys-chat,xsum,tldr"


def register(app: typer.Typer) -> None:
    app.command("demo", short_help="Run the whole pipeline on CPU; write a dashboard.")(demo_cmd)


def compare_dir(out: Path) -> Path:
    """Where the demo's ``compare`` step writes its results."""
    return out / "results" / "synth-dsv3-compare"


def advice_dir(out: Path) -> Path:
    """Where the demo's ``advise`` step writes its results."""
    return out / "results" / "synth-dsv3-advice"


def demo_steps(out: Path, *, per_dataset: int, max_new_tokens: int, synth_requests: int, seed: int) -> list[list[str]]:
    """The demo's command lines (without the leading ``moetrace``)."""
    tiny, tiny_an = out / "traces" / "tiny-dsv3", out / "results" / "tiny-dsv3-analysis"
    syn, syn_an, cmp_ = (
        out / "traces" / "synth-dsv3",
        out / "results" / "synth-dsv3-analysis",
        compare_dir(out),
    )
    placement = out / "placement" / f"{RECOMMENDED}.json"
    return [
        [
            "collect",
            "--model",
            "deepseek-v3-tiny",
            "--dataset",
            "bundled",
            "--per-dataset",
            str(per_dataset),
            "--max-new-tokens",
            str(max_new_tokens),
            "--seed",
            str(seed),
            "-o",
            str(tiny),
            "--overwrite",
        ],
        ["validate", str(tiny)],
        ["analyze", str(tiny), "-o", str(tiny_an), "--seed", str(seed), "--overwrite"],
        [
            "synth",
            "--model",
            "deepseek-v3",
            "--datasets",
            SYNTH_DATASETS,
            "--requests",
            str(synth_requests),
            "--seed",
            str(seed),
            "-o",
            str(syn),
            "--overwrite",
        ],
        ["validate", str(syn)],
        ["analyze", str(syn), "-o", str(syn_an), "--seed", str(seed), "--overwrite"],
        [
            "compare",
            str(syn),
            "--config",
            "DP8TP8EP64",
            "--strategies",
            "linear,round_robin,eplb,data,joint",
            "--seed",
            str(seed),
            "-o",
            str(cmp_),
            "--overwrite",
        ],
        ["advise", str(syn), "--config", "DP8TP8EP64", "--seed", str(seed), "-o", str(advice_dir(out)), "--overwrite"],
        [
            "place",
            str(syn),
            "--config",
            "DP8TP8EP64",
            "--strategy",
            RECOMMENDED,
            "--seed",
            str(seed),
            "-o",
            str(placement),
            "--overwrite",
        ],
        [
            "export",
            str(placement),
            "--format",
            "sglang",
            "-o",
            str(out / "placement" / "sglang-init-expert-location.json"),
            "--overwrite",
        ],
        [
            "export",
            str(placement),
            "--format",
            "trtllm",
            "-o",
            str(out / "placement" / "trtllm-moe-load-balancer.yaml"),
            "--overwrite",
        ],
        [
            "dashboard",
            str(tiny),
            str(tiny_an),
            str(syn),
            str(syn_an),
            str(cmp_),
            str(advice_dir(out)),
            "-o",
            str(out / "report.html"),
            "--overwrite",
        ],
    ]


def winners_text(results: Path, advice: Path | None = None, placement: Path | None = None) -> str:
    """The closing lines: the decision of each stage by the one rule (``placement.decision``: MoE-layer
    time per step, under 3 % saved keep linear) over advise's options when ``advice`` is given, then
    compare's over its strategy list (each stage with the copy model it was simulated with), how the
    two relate, and what ``place`` wrote."""
    from moetrace.dashboards.inputs import detect
    from moetrace.dashboards.results import Results
    from moetrace.dashboards.summary import stage_winners
    from moetrace.placement.decision import relation

    lines = []
    decided: dict[str, str] = {}
    if advice is not None and (advice / "advice.json").is_file():
        from moetrace.placement.advise.files import read_advice

        best = read_advice(advice).best  # stage -> its decision (placement.decision.StageChoice)
        if best:
            lines.append("decision per stage (advise: every option, each fitted on the stage it serves):")
            for st, ch in best.items():
                decided[st] = ch.decision
                lines.append(f"  {ch.text()}")
    res = Results.from_input(detect(results))
    winners = stage_winners(res)
    head = "compare's best per stage among its strategies (held-out requests; each stage with its kernel's copies):"
    lines += [head, *(f"  {w.text()}" for w in winners)]
    differ = [
        w.stage
        for w in winners
        if w.choice is not None and w.stage in decided and w.choice.decision != decided[w.stage]
    ]
    if differ:
        v = res.compare
        lines.append(
            f"  they differ on {', '.join(differ)}: "
            + relation(command="compare", strategies=v.strategies, num_redundant=v.num_redundant)
        )
    if placement is not None and placement.is_file():
        from moetrace.inputs import read_input_json

        obj = read_input_json(placement)
        choice = (obj.get("provenance") or obj.get("source") or {}).get("ours_choice")
        lines.append(
            f"place wrote {placement}"
            + (f" (ours chose {choice})" if choice else "")
            + f": {relation(command='place', strategies=())}"
        )
    return "\n".join(lines)


@friendly_errors
def demo_cmd(
    out: OutDir = Path("demo-out"),
    per_dataset: Annotated[
        int, typer.Option(help="Requests per bundled prompt set for the tiny-model collection.")
    ] = 8,
    max_new_tokens: Annotated[int, typer.Option(help="Generated tokens per request in the collection.")] = 32,
    synth_requests: Annotated[int, typer.Option(help="Requests in the DeepSeek-V3-scale synthetic trace.")] = 2100,
    seed: Seed = 0,
) -> None:
    """Run the whole pipeline on the embedded default (CPU, nothing downloaded) and write a dashboard.

    Collects a trace with the tiny DeepSeek-V3 on the bundled prompts, validates and analyzes it,
    synthesizes a DeepSeek-V3-scale trace with planted domain structure, compares expert placements
    at DP8TP8EP64 on held-out requests, advises per stage (EPLB, redundant experts, ours), exports
    the recommended placement, writes report.html and names the decision of each stage (decode,
    prefill) by one rule: predicted MoE-layer time per step.

    Example: moetrace demo -o demo-out
    """
    from moetrace.cli import app
    from moetrace.cli.place import sharing_placements

    t_all = time.perf_counter()
    steps = demo_steps(
        out, per_dataset=per_dataset, max_new_tokens=max_new_tokens, synth_requests=synth_requests, seed=seed
    )
    with sharing_placements():  # `place` starts from the counts and clusters `compare` read, not reading them again
        for i, args in enumerate(steps, 1):
            typer.secho(f"\n[{i}/{len(steps)}] $ moetrace {shlex.join(args)}", fg=typer.colors.CYAN, bold=True)
            t0 = time.perf_counter()
            code = app(args, prog_name="moetrace", standalone_mode=False)
            if code not in (None, 0):
                err(f"step {i} failed (exit {code}); fix the problem above and re-run, or run the step alone")
                raise typer.Exit(code)
            typer.echo(f"  ({time.perf_counter() - t0:.1f}s)")
    report = (out / "report.html").resolve()
    typer.secho(f"\ndemo finished in {time.perf_counter() - t_all:.0f}s", fg=typer.colors.GREEN, bold=True)
    typer.echo(winners_text(compare_dir(out), advice_dir(out), out / "placement" / f"{RECOMMENDED}.json"))
    typer.echo(f"dashboard: {report}")
    typer.echo(f"open it in a browser: file://{report}")
