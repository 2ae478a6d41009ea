"""Commands over traces: ``validate``, ``info``, ``models``."""

from __future__ import annotations

from typing import Annotated

import typer

from moetrace.cli.common import Quiet, TraceArg, friendly_errors, progress_bar


def register(app: typer.Typer) -> None:
    app.command("validate", short_help="Check a trace against format v1; exit 1 on a problem.")(validate_cmd)
    app.command("info", short_help="Summarize a trace: model, requests, tokens, size.")(info_cmd)
    app.command("models", short_help="List the model presets (each has a -tiny variant).")(models_cmd)


@friendly_errors
def validate_cmd(trace: TraceArg, quiet: Quiet = False) -> None:
    """Check a trace against format v1 and name every problem; exit 1 if there is any.

    Example: moetrace validate traces/dsv3-gsm8k
    """
    from moetrace.tracer.trace.validate import validate

    with progress_bar("validate", "rows", quiet=quiet) as bar:
        notes = validate(trace, progress=bar)
    typer.secho(f"{trace}: valid moetrace trace (format v1)", fg=typer.colors.GREEN)
    for note in notes:
        typer.echo(f"note: {note}")


@friendly_errors
def info_cmd(
    trace: TraceArg,
    allow_incomplete: Annotated[
        bool, typer.Option("--allow-incomplete", help="Also show an unfinished trace.")
    ] = False,
) -> None:
    """Summarize a trace: model, backend, requests and recorded/unrecorded tokens per dataset and stage, size.
    On a load profile (`moetrace profile`, aggregate imports): model, windows, tokens per stage and dataset.

    Example: moetrace info traces/dsv3-gsm8k
    """
    from moetrace.tracer.trace.profile import is_profile, profile_summary
    from moetrace.tracer.trace.summary import trace_summary

    if is_profile(trace):
        typer.echo(profile_summary(trace))
        return
    typer.echo(trace_summary(trace, allow_incomplete=allow_incomplete))


def models_cmd() -> None:
    """List the model presets (each also has a CPU-sized -tiny variant).

    Example: moetrace models
    """
    from moetrace.tracer.presets import list_presets

    typer.echo(f"{'preset':<18} {'layers (MoE)':<14} {'experts':>7} {'top-k':>5} {'shared':>6} {'hidden':>6}  hub id")
    for p in list_presets():
        typer.echo(
            f"{p.name:<18} {f'{p.num_hidden_layers} ({len(p.moe_layers)})':<14} {p.num_experts:>7} {p.top_k:>5} "
            f"{p.num_shared_experts:>6} {p.hidden_size:>6}  {p.hub_id}"
        )
    typer.echo(
        "\nAppend -tiny (e.g. deepseek-v3-tiny) for the same routing topology with small hidden sizes on a CPU.\n"
        "For a checkpoint vLLM and HF both run (real head dims, small hidden size): moetrace make-checkpoint PRESET -o DIR"
    )
