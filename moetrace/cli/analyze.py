"""``moetrace analyze``: a thin layer over ``moetrace.analysis.run.analyze``."""

from __future__ import annotations

from typing import Annotated

import typer

from moetrace.cli.common import (
    AllowIncomplete,
    OutDir,
    Overwrite,
    Quiet,
    Seed,
    TraceArg,
    claim_output,
    friendly_errors,
    log_lines,
    progress_bar,
)


def register(app: typer.Typer) -> None:
    app.command("analyze", short_help="Imbalance, correlations, embeddings, classifiers.")(analyze_cmd)


def _int_list(text: str | None, what: str) -> tuple[int, ...] | None:
    from moetrace.errors import ConfigError

    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, e.g. 0,1,2; got {text!r}") from None


@friendly_errors
def analyze_cmd(
    trace: TraceArg,
    *,
    out: OutDir,
    only: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated subset of: imbalance, correlation, embedding, classify, affinity, counts "
            "(counts = the tidy per-request table, opt-in). Default: all but counts."
        ),
    ] = None,
    batch_size: Annotated[
        int, typer.Option(help="Requests per serving batch for the batch imbalance distribution.")
    ] = 64,
    seed: Seed = 0,
    layers: Annotated[
        str | None,
        typer.Option(help="Comma-separated MoE-layer ordinals (0-based positions in moe_layers). Default: all."),
    ] = None,
    embedding_max_requests: Annotated[
        int, typer.Option(help="Requests embedded per stage (stratified by dataset).")
    ] = 4000,
    embedding_methods: Annotated[
        str, typer.Option(help="Comma-separated projections: tsne, umap (UMAP compiles numba kernels first, ~10 s).")
    ] = "tsne",
    max_requests: Annotated[
        int,
        typer.Option(help="Requests analysed: beyond it a seeded sample stratified by dataset (0: all)."),
    ] = 20_000,
    overwrite: Overwrite = False,
    allow_incomplete: AllowIncomplete = False,
    quiet: Quiet = False,
) -> None:
    """Characterize a trace: imbalance, correlations, embeddings, classifiers, cross-layer affinity.

    Writes one Parquet/JSON file per result plus manifest.json into -o and prints a summary.

    \b
    Example:
      moetrace analyze traces/dsv3 -o results/dsv3 \\
        --only imbalance,correlation --batch-size 128
    """
    from moetrace.analysis.run import DEFAULT_ANALYSES, AnalyzeConfig, analyze, format_summary
    from moetrace.atomic import replacing_directory
    from moetrace.results import ANALYSIS, ANALYSIS_MANIFEST

    config = AnalyzeConfig(
        only=tuple(x.strip() for x in only.split(",") if x.strip()) if only else DEFAULT_ANALYSES,
        seed=seed,
        layers=_int_list(layers, "--layers"),
        batch_size=batch_size,
        embedding_max_requests=embedding_max_requests,
        embedding_methods=tuple(m.strip() for m in embedding_methods.split(",") if m.strip()),  # type: ignore[misc]
        allow_incomplete=allow_incomplete,
        max_requests=max_requests,
    )
    log = log_lines(quiet)
    with (
        claim_output(
            out, kind="results", overwrite=overwrite, command="moetrace analyze", result=ANALYSIS, inputs=[trace]
        ),
        replacing_directory(out) as building,  # built beside -o, swapped in whole: a kill leaves old or new
        progress_bar("counting", "tokens", quiet=quiet) as bar,
    ):
        last = [-1]

        def progress(done: int, total: int) -> None:
            if bar.enabled:  # a terminal: the bar (rate, time left)
                bar(done, total)
                return
            pct = 100 * done // max(total, 1)  # a log file: a line every 10 %
            if pct // 10 != last[0]:
                last[0] = pct // 10
                log(f"  counted {done:,} / {total:,} tokens ({pct}%)")

        summary = analyze(trace, building, config=config, log=log, progress=None if quiet else progress)
    typer.echo(format_summary(summary))
    typer.echo(f"\nresults in {out} ({summary['seconds']:.1f} s); files are listed in {out / ANALYSIS_MANIFEST}")
