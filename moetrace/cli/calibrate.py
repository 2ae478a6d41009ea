"""``moetrace calibrate``: fit the step model's kernels to measured all-to-all tables (a links file);
``moetrace cost``: what one dispatch and combine cost at one shape (docs/placement.md, "Calibration").

Thin layers over ``moetrace.placement.calibrate`` and ``moetrace.placement.kernel_tables``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from moetrace.cli.common import Overwrite, Seed, claim_output, err, friendly_errors
from moetrace.cli.place import LinkOpt


def register(app: typer.Typer) -> None:
    app.command("calibrate", short_help="Fit the step model to measured all-to-all tables (a links file).")(
        calibrate_cmd
    )
    app.command("cost", short_help="Dispatch and combine time of one shape under a preset or links file.")(cost_cmd)


@friendly_errors
def calibrate_cmd(
    tables: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Measured tables: aiconfigurator .parquet (wideep_deepep_ll_perf, wideep_deepep_normal_perf, "
            "trtllm_alltoall_perf), DeepEP's table or your own .csv (kernel,gpu,ep_size,gpus_per_node,hidden,top_k,"
            "num_experts,tokens_per_rank,dispatch_type,combine_type,dispatch_us,combine_us). None: --gpu's bundled tables.",
            show_default=False,
        ),
    ] = None,
    *,
    gpu: Annotated[
        str | None,
        typer.Option(
            "--gpu",
            "--preset",
            help="GPU kind: without TABLES, fit its bundled tables (h100, h200, b200, gb200, h800 = DeepEP's); "
            "with TABLES, read aiconfigurator rows as this kind.",
        ),
    ] = None,
    hold_out: Annotated[
        str | None,
        typer.Option(
            "--hold-out",
            help="Rows kept out of the fit and predicted: FIELD OP VALUE terms joined by ',' (all must hold), "
            "alternatives by ';'; fields kernel gpu ep gpn nodes hidden topk experts tokens dispatch_type "
            "combine_type routing; or every=N. E.g. tokens>=256, gpu=h200, every=5.",
        ),
    ] = None,
    base: Annotated[
        str | None,
        typer.Option(
            "--base",
            help="Preset or links file for what the tables cannot show: kernels without rows, and the link class "
            "no row sends over (inter-node for single-node tables). Default: the default preset.",
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Name written in the links file (default: the -o file's stem).")
    ] = None,
    no_latency: Annotated[
        list[str] | None,
        typer.Option(
            "--no-latency",
            help="A per-message latency not to fit: intra, inter, or COPIES.CLASS (expert.inter); repeatable.",
        ),
    ] = None,
    rows: Annotated[bool, typer.Option("--rows/--no-rows", help="Print the per-row table.")] = True,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Links file to write (JSON; --link FILE.json reads it).", show_default=False),
    ] = None,
    seed: Seed = 0,
    overwrite: Overwrite = False,
) -> None:
    """Fit the step model's kernel parameters (fixed cost, NVLink and network bandwidth, per-message
    latencies where the data supports them) per kernel and phase to measured dispatch/combine times,
    print predicted vs measured per row and the median/worst relative error on fitted and held-out
    rows, and write the result as a links file for --link.

    \b
    Examples:
      moetrace calibrate --gpu h200 --hold-out every=5
      moetrace calibrate ll_perf.parquet mine.csv --base h100 -o mine.json
    """
    from moetrace.atomic import write_text_atomic
    from moetrace.placement.calibrate import calibrate, calibration_text, format_fit, format_rows
    from moetrace.placement.hardware import load_hardware
    from moetrace.placement.kernel_tables import read_table, vendored_tables

    skipped: list[str] = []
    if tables:
        measured = [r for t in tables for r in read_table(t, gpu=gpu, skipped=skipped)]
    elif gpu:
        measured = vendored_tables(gpu, skipped=skipped)
    else:
        err("give measured tables, or --gpu NAME for the bundled ones (h100, h200, b200, gb200, h800)")
        raise typer.Exit(2)
    hw_base = load_hardware(base)
    label = name or (out.stem if out is not None else (gpu or "calibrated"))
    with claim_output(out, kind="file", overwrite=overwrite, command="moetrace calibrate"):
        cal = calibrate(
            measured, hold_out=hold_out, base=hw_base, name=label, gpu=gpu, seed=seed, no_latency=no_latency or ()
        )
        if rows:
            typer.echo(format_rows(cal))
            typer.echo("")
        for s in skipped:
            typer.echo(f"skipped: {s}")
        typer.echo(format_fit(cal))
        if out is not None:
            write_text_atomic(out, calibration_text(cal))
            typer.echo(f"{out}: links file {label!r} ({', '.join(cal.hardware.kernels)}); use it with --link {out}")


@friendly_errors
def cost_cmd(
    *,
    ep: Annotated[int, typer.Option("--ep", help="EP size (GPUs exchanging tokens).")],
    hidden: Annotated[int, typer.Option(help="Hidden size (values per token).")],
    top_k: Annotated[int, typer.Option("--top-k", help="Routed experts per token.")],
    experts: Annotated[int, typer.Option(help="Routed experts (a multiple of --ep).")],
    tokens_per_gpu: Annotated[int, typer.Option("--tokens-per-gpu", help="Tokens each GPU dispatches.")],
    gpus_per_node: Annotated[
        int | None,
        typer.Option(
            help="GPUs per NVLink domain (default: 4 on GB200/GB300, else 8; at most --ep). GB200 NVL72's "
            "NVLink all-to-all (--copies rank, fitted to TensorRT-LLM's MNNVL kernels): up to 72."
        ),
    ] = None,
    copies: Annotated[
        Literal["expert", "node", "rank"],
        typer.Option(
            help="Copy model: per expert (DeepEP low latency, decode), per node (DeepEP normal, prefill), "
            "per rank (NVLink all-to-all)."
        ),
    ] = "expert",
    link: LinkOpt = None,
    loads: Annotated[
        Path | None,
        typer.Option(
            help="Per-expert loads (CSV: one count per expert, or expert,count lines; '#' comments): route in "
            "proportion to them instead of uniformly (e.g. one layer's counts of a load profile)."
        ),
    ] = None,
    dispatch_type: Annotated[
        Literal["fp8", "bf16", "nvfp4"] | None, typer.Option(help="Dispatch values (default: the kernel's).")
    ] = None,
    combine_type: Annotated[
        Literal["fp8", "bf16", "nvfp4"] | None, typer.Option(help="Combine values (default: the kernel's).")
    ] = None,
    seed: Seed = 0,
) -> None:
    """The step model's dispatch and combine time of one layer at one shape: uniform routing over
    linearly placed experts (or routing by --loads), the busiest GPU, averaged over a few draws.

    \b
    Example:
      moetrace cost --ep 32 --hidden 7168 --top-k 8 --experts 256 \\
        --tokens-per-gpu 128 --link h100
    """
    from moetrace.placement.calibrate import cost_of_shape, format_cost
    from moetrace.placement.hardware import load_hardware

    hw = load_hardware(link)
    loads_E = _read_loads(loads) if loads is not None else None
    result = cost_of_shape(
        hw,
        copies=copies,
        ep_size=ep,
        gpus_per_node=gpus_per_node,
        hidden=hidden,
        top_k=top_k,
        num_experts=experts,
        tokens_per_rank=tokens_per_gpu,
        dispatch_type=dispatch_type,
        combine_type=combine_type,
        loads_E=loads_E,
        seed=seed,
    )
    typer.echo(format_cost(result))


def _read_loads(path: Path) -> list[float]:
    """Per-expert loads from a small CSV (one value per line, or ``expert,count`` lines)."""
    from moetrace.errors import ConfigError

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--loads: cannot read {path}: {e}") from None
    vals: dict[int, float] = {}
    for no, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        cells = [c.strip() for c in line.split(",")]
        try:
            if len(cells) == 1:
                vals[len(vals)] = float(cells[0])
            elif len(cells) == 2:
                vals[int(cells[0])] = float(cells[1])
            else:
                raise ValueError
        except ValueError:
            if not vals:  # a header line
                continue
            raise ConfigError(f"--loads {path.name}:{no}: want a count, or expert,count; got {line!r}") from None
    if sorted(vals) != list(range(len(vals))):
        raise ConfigError(f"--loads {path.name}: experts must be 0..E-1, each once")
    return [vals[i] for i in range(len(vals))]
