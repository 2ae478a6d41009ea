"""``moetrace profile``: reduce a trace to a load profile (expert counts per stage, layer, expert)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetrace.cli.common import AllowIncomplete, Overwrite, Quiet, TraceArg, claim_output, friendly_errors, progress_bar


def register(app: typer.Typer) -> None:
    app.command("profile", short_help="Reduce a trace to a load profile (expert counts).")(profile_cmd)


@friendly_errors
def profile_cmd(
    trace: TraceArg,
    *,
    out: Annotated[Path, typer.Option("--out", "-o", help="Load profile file to write (Parquet).", show_default=False)],
    window_tokens: Annotated[
        int | None,
        typer.Option(
            help="Also count per window of this many routing rows, in the trace's order (default: one window)."
        ),
    ] = None,
    allow_incomplete: AllowIncomplete = False,
    overwrite: Overwrite = False,
    quiet: Quiet = False,
) -> None:
    """Reduce a trace to a load profile: tokens per (stage, MoE layer, expert), per dataset and window.

    `info`, `analyze`, `compare`/`place` (ungrouped strategies) and `export --format sglang-logical-count`
    read the profile; docs/profile.md describes the file.

    Example: moetrace profile traces/dsv3 -o dsv3.profile.parquet
    """
    from moetrace.tracer.trace.profile import profile_from_trace, write_profile

    with (
        claim_output(out, kind="file", overwrite=overwrite, command="moetrace profile", inputs=[trace]),
        progress_bar("profile", "tokens", quiet=quiet) as bar,
    ):
        prof = profile_from_trace(trace, window_tokens=window_tokens, allow_incomplete=allow_incomplete, progress=bar)
        write_profile(prof, out, overwrite=overwrite)
    totals = ", ".join(f"{s} {int(prof.tokens_L(s).mean()):,}" for s in prof.stages)
    typer.echo(
        f"{out}: load profile of {prof.model.name} ({prof.num_windows} window(s), "
        f"{len(prof.dataset_labels)} dataset(s)); tokens per MoE layer: {totals}"
    )
