"""``import``: routing recorded elsewhere → a moetrace trace.

The ``--format`` choices and their help come from the registry ``moetrace.tracer.importers.FORMATS``,
the ``--stages`` choices from its one ``StagesMode``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from moetrace.cli.common import OutDir, Overwrite, Quiet, claim_output, friendly_errors, human_bytes, progress_bar
from moetrace.errors import ConfigError
from moetrace.tracer.importers import FORMATS, STAGES_HELP, StagesMode
from moetrace.tracer.importers.options import PHYSICAL_MAP, PROMPT_SPAN

FORMAT_CHOICES: tuple[str, ...] = ("auto", *(f.name for f in FORMATS))
FormatName = Literal[FORMAT_CHOICES]  # type: ignore[valid-type]  # the registry's names, built at run time
_FORMAT_HELP = "; ".join(f"{f.name}: {f.help}" for f in FORMATS) + "; auto: decide from the input's first bytes."
_STAGES_FORMATS = ", ".join(f.name for f in FORMATS if f.stages_modes)
_STAGES_HELP = (
    f"Stages the capture recorded (--format {_STAGES_FORMATS}): "
    + "; ".join(f"{mode} ({what})" for mode, what in STAGES_HELP.items())
    + ". Recorded in the manifest; analyses that need the missing stage are skipped with the reason."
)


_FORMATS_WITH_MODEL = ", ".join(f.name for f in FORMATS if f.model is not None)


def _formats_taking(option: str) -> str:
    return ", ".join(f.name for f in FORMATS if option in f.options)


def register(app: typer.Typer) -> None:
    app.command("import", short_help="Convert another tool's routing into a trace.")(import_cmd)


@friendly_errors
def import_cmd(
    source: Annotated[
        Path,
        typer.Argument(help="The input: a file (or a directory) in one of the --format formats.", show_default=False),
    ],
    *,
    out: OutDir,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="Model preset (see `moetrace models`) or an HF "
            "config.json / checkpoint directory: gives MoE layers, experts, top-k. Required, but for "
            f"--format {_FORMATS_WITH_MODEL}, whose captures name their model.",
            show_default=False,
        ),
    ] = None,
    source_format: Annotated[FormatName, typer.Option("--format", metavar="FORMAT", help=_FORMAT_HELP)] = "auto",
    dataset: Annotated[
        str | None, typer.Option(help="Dataset label of requests that carry none (default: the file name).")
    ] = None,
    stages: Annotated[StagesMode, typer.Option("--stages", help=_STAGES_HELP)] = "both",
    physical_map: Annotated[
        Path | None,
        typer.Option(
            "--physical-map",
            help="The capture holds physical slot ids or counts (EPLB, redundant experts): convert them with this map, "
            "SGLang's physical_to_logical_map JSON or a moetrace placement file (--format "
            f"{_formats_taking(PHYSICAL_MAP)}).",
            show_default=False,
        ),
    ] = None,
    prompt_tokens: Annotated[
        int | None,
        typer.Option(
            "--prompt-tokens",
            min=1,
            help="Teacher-forced capture (one pass over prompt+response): the first N positions of every request "
            f"are its prompt, the rest decode (--format {_formats_taking(PROMPT_SPAN)}).",
            show_default=False,
        ),
    ] = None,
    prompt_fraction: Annotated[
        float | None,
        typer.Option(
            "--prompt-fraction",
            min=0.0,
            max=1.0,
            help="Teacher-forced capture: the first round(F x length) positions of every request are its prompt.",
            show_default=False,
        ),
    ] = None,
    max_memory: Annotated[
        float | None,
        typer.Option(
            "--max-memory",
            min=1e-6,
            help="GiB one allocation of the import may take (default: half the memory available now); an input "
            "asking for more is refused before anything is allocated.",
            show_default=False,
        ),
    ] = None,
    overwrite: Overwrite = False,
    quiet: Quiet = False,
) -> None:
    """Convert routing recorded by another tool into a trace (format v1) that every analysis reads.

    \b
    Example:
      moetrace import sglang-responses.jsonl --model deepseek-v3 \\
        -o traces/dsv3-sglang
    A capture of generated tokens only:
      moetrace import gen.jsonl --format tokens --stages decode-only \\
        -m mixtral-8x7b -o traces/gen-only
    A teacher-forced capture (the first 512 tokens of each are the prompt):
      moetrace import tf.jsonl --prompt-tokens 512 -m olmoe-1b-7b \\
        -o traces/tf
    DeepSeek's ESFT expert logs (DeepSeek-V2-Lite; no --model needed):
      moetrace import ESFT/results/expert_scores --format esft \\
        -o traces/esft
    vLLM server responses, and llm-d-inference-sim's binary .moetrace:
      moetrace import vllm-responses.jsonl -m qwen3-30b-a3b -o traces/q3
      moetrace import instructcoder.moetrace -m Qwen1.5-MoE-A2.7B/config.json \\
        -o traces/llmd
    Expert counts (sglang-stat, sglang-pass, trtllm-stats) become a load profile:
      moetrace import expert_stats/ -m deepseek-v3 \\
        -o dsv3.profile.parquet
    """
    from moetrace.tracer.importers import ImportOptions, detect_format, get_format, import_profile, import_trace
    from moetrace.tracer.presets import resolve
    from moetrace.tracer.trace.writer import replacing_trace

    inputs = [source, *[p for p in (physical_map, model) if p is not None and Path(p).exists()]]
    options = ImportOptions(
        physical_map=physical_map,
        prompt_tokens=prompt_tokens,
        prompt_fraction=prompt_fraction,
        max_memory_bytes=None if max_memory is None else int(max_memory * 2**30),
    )
    fmt = get_format(source_format) if source_format != "auto" else detect_format(source) if source.exists() else None
    if model is None:  # only a format whose captures name their model (esft) goes without
        named = fmt or detect_format(source)  # a missing input is said first
        if named.model is None:
            raise ConfigError(
                f"--format {named.name} needs --model (a preset, or an HF config.json / checkpoint directory): its "
                f"input does not say which model recorded it (only --format {_FORMATS_WITH_MODEL} name theirs)"
            )
        info = named.model()
    else:
        info = resolve(model).model_info()
    if fmt is not None and fmt.produces == "profile":  # aggregate counts: a load profile file, not a trace directory
        with (
            claim_output(out, kind="file", overwrite=overwrite, command="moetrace import", inputs=inputs),
            progress_bar("import", "files", quiet=quiet) as bar,
        ):
            prof = import_profile(
                source,
                out=out,
                model=info,
                source_format=fmt.name,
                dataset=dataset,
                stages=stages,
                overwrite=overwrite,
                progress=bar,
                options=options,
            )
        typer.echo(
            f"{out}: load profile ({fmt.name}: expert counts, no requests; stage {', '.join(prof.stages)}, "
            f"{prof.num_windows} window(s)); `moetrace info {out}` shows it, analyze/compare/place/export read it"
        )
        return
    with (
        claim_output(out, kind="trace", overwrite=overwrite, command="moetrace import", inputs=inputs),
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
            options=options,
            notes=lambda line: typer.echo(f"note: {line}", err=True),
        )
    only = "" if stages == "both" else f" ({stages.replace('-only', '')} stage only)"
    typer.echo(
        f"{out}: {stats.num_requests} requests, {stats.num_tokens} tokens{only}, "
        f"{human_bytes(stats.bytes_on_disk)} on disk"
    )
