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
    stages: Annotated[Literal["both", "decode-only", "prefill-only"], typer.Option(
        "--stages", help="Stages the capture recorded (--format tokens): both (every request has its prompt's "
        "routing, and decode records); decode-only (generated tokens only, e.g. captures that log no prompt); "
        "prefill-only (prompt tokens only). Recorded in the manifest; analyses that need the missing stage "
        "are skipped with the reason.")] = "both",
    overwrite: Overwrite = False,
    quiet: Quiet = False,
) -> None:
    """Convert routing recorded by another tool into a trace (format v1) that every analysis reads.

    Example: moetrace import sglang-responses.jsonl --model deepseek-v3 -o traces/dsv3-sglang

    A capture of generated tokens only: moetrace import gen.jsonl --format tokens --stages decode-only -m mixtral-8x7b -o t
    """
    from moetrace.tracer.importers import import_trace
    from moetrace.tracer.presets import resolve

    info = resolve(model).model_info()
    with progress_bar("import", "bytes", quiet=quiet) as bar:
        stats = import_trace(source, out=out, model=info, source_format=source_format,
                             dataset=dataset, stages=stages, on_existing="overwrite" if overwrite else "refuse", progress=bar)
    only = "" if stages == "both" else f" ({stages.replace('-only', '')} stage only)"
    typer.echo(f"{out}: {stats.num_requests} requests, {stats.num_tokens} tokens{only}, "
               f"{human_bytes(stats.bytes_on_disk)} on disk")
