"""``import``: routing recorded elsewhere → a moetrace trace.

The ``--format`` choices and their help come from the registry ``moetrace.tracer.importers.FORMATS``,
the ``--stages`` choices from its one ``StagesMode``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from moetrace.cli.common import OutDir, Overwrite, Quiet, claim_output, friendly_errors, human_bytes, progress_bar
from moetrace.tracer.importers import FORMATS, STAGES_HELP, StagesMode

FORMAT_CHOICES: tuple[str, ...] = ("auto", *(f.name for f in FORMATS))
FormatName = Literal[FORMAT_CHOICES]  # type: ignore[valid-type]  # the registry's names, built at run time
_FORMAT_HELP = "; ".join(f"{f.name}: {f.help}" for f in FORMATS) + "; auto: decide from the input's first bytes."
_STAGES_FORMATS = ", ".join(f.name for f in FORMATS if f.stages_modes)
_STAGES_HELP = (
    f"Stages the capture recorded (--format {_STAGES_FORMATS}): "
    + "; ".join(f"{mode} ({what})" for mode, what in STAGES_HELP.items())
    + ". Recorded in the manifest; analyses that need the missing stage are skipped with the reason."
)


def register(app: typer.Typer) -> None:
    app.command("import")(import_cmd)


@friendly_errors
def import_cmd(
    source: Annotated[
        Path,
        typer.Argument(help="The input: a file (or a directory) in one of the --format formats.", show_default=False),
    ],
    *,
    out: OutDir,
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="Model preset (see `moetrace models`) or an HF "
            "config.json / checkpoint directory: gives MoE layers, experts, top-k.",
            show_default=False,
        ),
    ],
    source_format: Annotated[FormatName, typer.Option("--format", help=_FORMAT_HELP)] = "auto",
    dataset: Annotated[
        str | None, typer.Option(help="Dataset label of requests that carry none (default: the file name).")
    ] = None,
    stages: Annotated[StagesMode, typer.Option("--stages", help=_STAGES_HELP)] = "both",
    overwrite: Overwrite = False,
    quiet: Quiet = False,
) -> None:
    """Convert routing recorded by another tool into a trace (format v1) that every analysis reads.

    Example: moetrace import sglang-responses.jsonl --model deepseek-v3 -o traces/dsv3-sglang

    A capture of generated tokens only: moetrace import gen.jsonl --format tokens --stages decode-only -m mixtral-8x7b -o t
    """
    from moetrace.tracer.importers import import_trace
    from moetrace.tracer.presets import resolve
    from moetrace.tracer.trace.writer import replacing_trace

    info = resolve(model).model_info()
    with (
        claim_output(out, kind="trace", overwrite=overwrite, command="moetrace import"),
        replacing_trace(out, overwrite=overwrite) as target,  # a failed import leaves the old trace whole
        progress_bar("import", "bytes", quiet=quiet) as bar,
    ):
        stats = import_trace(
            source,
            out=target,
            model=info,
            source_format=source_format,
            dataset=dataset,
            stages=stages,
            on_existing="overwrite" if overwrite else "refuse",
            progress=bar,
        )
    only = "" if stages == "both" else f" ({stages.replace('-only', '')} stage only)"
    typer.echo(
        f"{out}: {stats.num_requests} requests, {stats.num_tokens} tokens{only}, "
        f"{human_bytes(stats.bytes_on_disk)} on disk"
    )
