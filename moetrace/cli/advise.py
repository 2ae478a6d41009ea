"""``moetrace advise``: should I enable EPLB, with how many redundant experts, and what does ours add.

A thin layer over ``moetrace.placement.advise`` (docs/advise.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetrace.cli.common import (
    ModelConfigOpt,
    Overwrite,
    Quiet,
    Seed,
    claim_output,
    friendly_errors,
    progress_bar,
    read_model_config,
)
from moetrace.cli.place import ConfigOpt, GpusPerNode, LinkOpt


def register(app: typer.Typer) -> None:
    app.command("advise", short_help="Should I enable EPLB? With how many redundant experts?")(advise_cmd)


@friendly_errors
def advise_cmd(
    source: Annotated[Path, typer.Argument(help="Trace directory or load profile.", show_default=False)],
    *,
    config: ConfigOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Advice directory to write.", show_default=False)],
    gpus_per_node: GpusPerNode = 8,
    current: Annotated[
        Path | None,
        typer.Option(
            "--current",
            help="The placement served now: moetrace's placement JSON, SGLang's physical_to_logical_map, vLLM's "
            "list of rows or vllm-ascend's expert map (default: linear, vLLM's default).",
        ),
    ] = None,
    max_slots_per_gpu: Annotated[
        int, typer.Option(help="Slots per GPU and layer the EPLB sweep may use (0: ceil(E/EP) + 2).")
    ] = 0,
    steps: Annotated[int, typer.Option(help="Decode steps simulated on a trace.")] = 200,
    link: LinkOpt = None,
    model_config: ModelConfigOpt = None,
    seed: Seed = 0,
    overwrite: Overwrite = False,
    quiet: Quiet = False,
) -> None:
    """Advise per stage whether to enable EPLB and with how many redundant experts, in vLLM's terms
    (balancedness), with predicted step time, migration cost and the commands for your engine.

    Example: moetrace advise traces/dsv3 --config DP8TP8EP64 -o advice
    """
    from moetrace.placement.advise import AdviseConfig, advise_input, format_advice, write_advice
    from moetrace.placement.deployment import parse_deployment
    from moetrace.placement.hardware import load_hardware
    from moetrace.results import ADVICE

    dep = parse_deployment(config, num_gpus_per_node=gpus_per_node)
    cfg = AdviseConfig(
        deployment=dep,
        max_slots_per_gpu=max_slots_per_gpu,
        num_steps=steps,
        seed=seed,
        hardware=load_hardware(link),
        model_config=read_model_config(model_config),
    )
    with claim_output(out, kind="results", overwrite=overwrite, command="moetrace advise", result=ADVICE):
        with (
            progress_bar("counting", "tokens", quiet=quiet) as count_bar,
            progress_bar("options", "runs", quiet=quiet) as bar,
        ):
            advice = advise_input(source, cfg, current=current, progress=bar, count_progress=count_bar)
        write_advice(advice, out, deployment=dep)
    typer.echo(format_advice(advice, out=out))
    typer.echo(f"\nwrote {out}")
