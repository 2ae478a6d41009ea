"""``moetrace dashboard``: one self-contained HTML report from traces and result directories."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetrace.cli.common import Overwrite, Quiet, Seed, claim_output, friendly_errors, human_bytes, progress_bar
from moetrace.dashboards.sections import INPUT_KINDS, SECTIONS

#: what the inputs may be, from the dashboard's table of input kinds
_INPUTS_HELP = (
    "Trace directories and output directories of "
    + " / ".join(f"`{k.command}`" for k in INPUT_KINDS if k.kind != "trace")
    + ", in any mix."
)


def register(app: typer.Typer) -> None:
    app.command("dashboard", short_help="Write the interactive offline HTML report.")(dashboard_cmd)


def default_out(inputs: list[Path]) -> Path:
    """``report.html`` in the deepest folder holding every input (``out/`` for ``out/traces/x`` and
    ``out/results/y``), never the current directory unless the inputs are there."""
    import os

    parents = [str(p.resolve().parent) for p in inputs] or ["."]
    return Path(os.path.commonpath(parents)) / "report.html"


@friendly_errors
def dashboard_cmd(
    inputs: Annotated[
        list[Path],
        typer.Argument(
            help=_INPUTS_HELP,
            show_default=False,
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="The HTML file to write (default: report.html in the folder holding the inputs).",
            show_default=False,
        ),
    ] = None,
    max_points: Annotated[
        int, typer.Option(help="Most points drawn per scatter; larger clouds are sampled down (the cap is shown).")
    ] = 20_000,
    seed: Seed = 0,
    title: Annotated[str | None, typer.Option(help="Page title (default: names the model).")] = None,
    overwrite: Overwrite = False,
    quiet: Quiet = False,
) -> None:
    """Write an interactive, offline HTML report, a section for each result given: {sections}.

    \b
    Example:
      moetrace dashboard traces/dsv3 results/dsv3-analysis \\
        results/dsv3-compare -o report.html
    """
    from moetrace.dashboards.report import DashboardConfig, write_dashboard

    if out is None:
        out = default_out(inputs)
        typer.echo(f"no -o: writing {out} (beside the inputs)")
    with (
        claim_output(out, kind="file", overwrite=overwrite, command="moetrace dashboard", inputs=inputs),
        progress_bar("dashboard", "steps", quiet=quiet) as bar,
    ):
        rep = write_dashboard(
            inputs, out=out, config=DashboardConfig(max_points=max_points, seed=seed, title=title), progress=bar
        )
    typer.echo(f"wrote {rep.path} ({human_bytes(rep.size_bytes)}, {rep.num_figures} figures)")
    typer.echo(f"sections: {', '.join(rep.sections)}")
    for note in rep.omitted:
        typer.echo(f"not shown: {note}")


# the sections named in --help are the dashboard's table's (moetrace.dashboards.sections), in page order
dashboard_cmd.__doc__ = (dashboard_cmd.__doc__ or "").replace(
    "{sections}", ", ".join(row.title[0].lower() + row.title[1:] for row in SECTIONS)
)
