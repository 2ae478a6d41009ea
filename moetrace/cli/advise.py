"""``moetrace advise``: should I enable EPLB, with how many redundant experts, and what does ours add.

A thin layer over ``moetrace.placement.advise`` (docs/advise.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

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
from moetrace.cli.place import ConfigOpt, EplbSumOpt, GpusPerNode, LinkOpt
from moetrace.errors import ConfigError
from moetrace.placement.legends import ADVISE_LEGEND, help_epilog
from moetrace.placement.strategies import STRATEGY_NAMES

#: advise's defaults, named once for the options' help (the library's: placement/advise*.py)
_DEFAULTS = "linear,round_robin,eplb,eplb_global,joint"


def register(app: typer.Typer) -> None:
    app.command(
        "advise",
        short_help="Should I enable EPLB? With how many redundant experts?",
        epilog=help_epilog(ADVISE_LEGEND, title="The tables' columns (printed under them too):"),
    )(advise_cmd)


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
    strategies: Annotated[
        str | None,
        typer.Option(
            help=f"Comma-separated strategies to evaluate, from: {', '.join(STRATEGY_NAMES)} (default {_DEFAULTS}, "
            "where they apply; EPLB's are swept over redundant slots, grouped ones need a trace with prefill and "
            "decode).",
            show_default=False,
        ),
    ] = None,
    decode_tokens_per_gpu: Annotated[
        int, typer.Option(help="Decode tokens (one per request) per GPU in one decode step.")
    ] = 4,
    prefill_tokens_per_gpu: Annotated[
        int, typer.Option(help="Chunked-prefill tokens per GPU in one prefill step.")
    ] = 128,
    replica_policy: Annotated[
        Literal["vllm", "sglang", "same_node"],
        typer.Option(
            help="Which replica serves a token: your engine's rule (vllm: vLLM 0.33's hash of the token's row; "
            "sglang: SGLang 0.5.23's local-first static map) or same_node (moetrace's model). docs/advise.md."
        ),
    ] = "same_node",
    stall_seconds: Annotated[
        float,
        typer.Option(
            help="Seconds one synchronous rearrangement stalls serving (vLLM, DeepSeek-R1 on 32 GB200s: 0.65-1.70 s, "
            "vllm#43219)."
        ),
    ] = 0.9,
    rearrange_every: Annotated[int, typer.Option(help="Steps between rearrangements (vLLM's step_interval).")] = 3000,
    eplb_sum: EplbSumOpt = "float64",
    link: LinkOpt = None,
    model_config: ModelConfigOpt = None,
    seed: Seed = 0,
    overwrite: Overwrite = False,
    quiet: Quiet = False,
) -> None:
    """Advise per stage whether to enable EPLB and with how many redundant experts, in vLLM's terms
    (balancedness), with predicted step time, migration cost and the commands for your engine.

    \b
    Example:
      moetrace advise traces/dsv3 --config DP8TP8EP64 -o advice
    One SGLang statistics file (no drift estimate), larger decode steps:
      moetrace import logical_count.json -m deepseek-v3 \\
        --stages decode-only -o dsv3.parquet
      moetrace advise dsv3.parquet -c DP8TP8EP64 \\
        --decode-tokens-per-gpu 128 -o advice
    """
    from moetrace.placement.advise import AdviseConfig, advise_input, format_advice, write_advice
    from moetrace.placement.advise.rearrange import Rearrangement
    from moetrace.placement.deployment import parse_deployment
    from moetrace.placement.hardware import load_hardware
    from moetrace.results import ADVICE

    dep = parse_deployment(config, num_gpus_per_node=gpus_per_node)
    cfg = AdviseConfig(
        deployment=dep,
        max_slots_per_gpu=max_slots_per_gpu,
        num_steps=steps,
        strategies=tuple(x.strip() for x in strategies.split(",") if x.strip()) if strategies is not None else (),
        decode_tokens_per_gpu=decode_tokens_per_gpu,
        prefill_tokens_per_gpu=prefill_tokens_per_gpu,
        replica_policy=replica_policy,
        rearrangement=Rearrangement(stall_seconds=stall_seconds, interval_steps=rearrange_every),
        eplb_sum=eplb_sum,
        seed=seed,
        hardware=load_hardware(link),
        model_config=read_model_config(model_config),
    )
    _check_sizes(cfg)
    inputs = [
        source,
        *([current] if current is not None else []),
        *([model_config] if model_config is not None else []),
    ]
    with claim_output(
        out, kind="results", overwrite=overwrite, command="moetrace advise", result=ADVICE, inputs=inputs
    ):
        with (
            progress_bar("counting", "tokens", quiet=quiet) as count_bar,
            progress_bar("options", "runs", quiet=quiet) as bar,
        ):
            advice = advise_input(source, cfg, current=current, progress=bar, count_progress=count_bar)
        from moetrace.atomic import replacing_directory

        with replacing_directory(out) as building:  # built beside -o, swapped in whole: a kill leaves old or new
            write_advice(advice, building, deployment=dep, final_dir=out)  # the commands name -o, not building
    typer.echo(format_advice(advice, out=out))
    typer.echo(f"\nwrote {out}")


def _check_sizes(cfg: Any) -> None:
    """Refuse, in advise's own options' names, the sizes the simulation (``CompareConfig``, shared with
    ``compare``, whose messages name compare's options) would refuse: the simulated decode tokens and the
    prefill tokens of one step."""
    from moetrace.placement.compare_config import MAX_SIMULATED_TOKENS

    dep = cfg.deployment
    simulated = cfg.num_steps * cfg.step_requests
    if simulated > MAX_SIMULATED_TOKENS:
        raise ConfigError(
            f"--steps {cfg.num_steps} x {cfg.step_requests:,} decode tokens per step (--decode-tokens-per-gpu "
            f"{cfg.decode_tokens_per_gpu} x {dep.num_ep} GPUs) = {simulated:,} simulated tokens; at most "
            f"{MAX_SIMULATED_TOKENS:,} per run: lower --steps or --decode-tokens-per-gpu"
        )
    most = (1 << 22) // (dep.ranks_per_node * dep.num_groups)
    if cfg.prefill_tokens_per_gpu > most:
        raise ConfigError(
            f"--prefill-tokens-per-gpu {cfg.prefill_tokens_per_gpu}: at most {most:,} on {dep.name} "
            f"({dep.ranks_per_node} GPUs per node, {dep.num_groups} node(s))"
        )
