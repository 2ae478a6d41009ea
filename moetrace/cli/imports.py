"""``import``: routing recorded elsewhere (SGLang, per-token JSONL) → a moetrace trace."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from moetrace.cli.common import OutDir, Overwrite, Quiet, friendly_errors, human_bytes, progress_bar


def register(app: typer.Typer) -> None:
    app.command("import")(import_cmd)


@friendly_errors
def import_cmd(
    source: Annotated[Path, typer.Argument(help="JSONL file: SGLang /generate responses, or per-token records.",
                                           show_default=False)],
    *,
    out: OutDir,
    model: Annotated[str, typer.Option("--model", "-m", help="Model preset (see `moetrace models`) or an HF "
                                       "config.json / checkpoint directory: gives MoE layers, experts, top-k.",
                                       show_default=False)],
    source_format: Annotated[Literal["auto", "sglang", "tokens"], typer.Option(
        "--format", help="sglang: /generate responses with meta_info.routed_experts; tokens: "
        "{request, layer, position, stage, experts} records; auto: decide from the first record.")] = "auto",
    dataset: Annotated[str | None, typer.Option(help="Dataset label of requests that carry none "
                                                "(default: the file name).")] = None,
    overwrite: Overwrite = False,
    quiet: Quiet = False,
) -> None:
    """Convert routing recorded by another tool into a trace (format v1) that every analysis reads.

    Example: moetrace import sglang-responses.jsonl --model deepseek-v3 -o traces/dsv3-sglang
    """
    from moetrace.tracer.importers import import_trace
    from moetrace.tracer.presets import resolve

    info = resolve(model).model_info()
    with progress_bar("import", "bytes", quiet=quiet) as bar:
        stats = import_trace(source, out=out, model=info, source_format=source_format,
                             dataset=dataset, on_existing="overwrite" if overwrite else "refuse", progress=bar)
    typer.echo(f"{out}: {stats.num_requests} requests, {stats.num_tokens} tokens, "
               f"{human_bytes(stats.bytes_on_disk)} on disk")
