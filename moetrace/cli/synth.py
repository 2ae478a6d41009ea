"""``moetrace synth``: synthetic traces with planted structure (a thin layer over ``tracer.synth``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from moetrace.cli.common import (
    ModelOpt,
    OutDir,
    Overwrite,
    Quiet,
    Seed,
    claim_output,
    friendly_errors,
    human_bytes,
    request_progress,
)
from moetrace.errors import ConfigError

if TYPE_CHECKING:
    from moetrace.tracer.synth import SynthPlan


def register(app: typer.Typer) -> None:
    app.command("synth", short_help="Generate a synthetic trace with planted structure.")(synth_cmd)


def _read_knobs(text: str | None) -> dict:
    """``--knobs``: a JSON object inline (starting with ``{``) or the path of a JSON file."""
    if text is None:
        return {}
    raw = text if text.lstrip().startswith("{") else None
    if raw is None:
        p = Path(text)
        if not p.is_file():
            raise ConfigError(f"--knobs {text!r}: no such file (pass a JSON file or an inline JSON object)")
        raw = p.read_text()
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--knobs: not valid JSON ({exc})") from exc
    if not isinstance(d, dict):
        raise ConfigError("--knobs must be a JSON object of knob names to values")
    return d


@friendly_errors
def synth_cmd(
    out: OutDir,
    model: ModelOpt = "deepseek-v3",
    datasets: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated dataset names, requests assigned round robin. Default: the paper's seven "
            "(gsm8k, math, mbpp, humaneval, lmsys-chat, xsum, tldr); with --mix, the mix's names."
        ),
    ] = None,
    mix: Annotated[
        str | None,
        typer.Option(
            help="Share of the requests per dataset, summing to 1, e.g. gsm8k=0.6,mbpp=0.4 (names the datasets "
            "itself; every stretch of request ids from the first holds the mix within one request)."
        ),
    ] = None,
    requests: Annotated[int, typer.Option("--requests", "-n", help="Number of requests to generate.")] = 1000,
    seed: Seed = 0,
    workers: Annotated[int, typer.Option(help="Generator processes (the output is identical for any value).")] = (
        os.cpu_count() or 1
    ),
    calibration: Annotated[
        str | None,
        typer.Option(help="Knob preset (data/synth/*.json); default: the model's own, else 'generic'."),
    ] = None,
    knobs: Annotated[
        str | None,
        typer.Option(
            help='Knob overrides: a JSON file or inline JSON, e.g. \'{"pd_mix": 0.2, "zipf_exponent": 1.4}\'.'
        ),
    ] = None,
    structure: Annotated[
        Literal["planted", "none"],
        typer.Option(
            help="'none': a control with no dataset, domain, request or layer structure (load imbalance kept)."
        ),
    ] = "planted",
    overwrite: Overwrite = False,
    quiet: Quiet = False,
) -> None:
    """Generate a synthetic trace with known, planted structure (skew, domains, request clusters,
    prefill->decode relation, cross-layer affinity), written like a collected one.

    \b
    Example:
      moetrace synth --model deepseek-v3 --requests 10000 --seed 0 \\
        -o traces/synth-dsv3
    """
    from moetrace.tracer.presets import resolve
    from moetrace.tracer.synth import (
        PAPER_DATASETS,
        SynthKnobs,
        SynthPlan,
        default_calibration,
        load_calibration,
        parse_mix,
        synthesize,
    )

    names = tuple(d.strip() for d in datasets.split(",") if d.strip()) if datasets is not None else None
    shares = None
    if mix is not None:
        names, shares = parse_mix(mix, datasets=names)
    info = resolve(model).model_info()
    cal = calibration or default_calibration(model)
    plan = SynthPlan(
        datasets=names if names is not None else PAPER_DATASETS,
        num_requests=requests,
        seed=seed,
        knobs=SynthKnobs.from_dict(_read_knobs(knobs), base=load_calibration(cal)),
        calibration=cal,
        structure=structure,
        mix=shares,
    )
    with (
        claim_output(out, kind="trace", overwrite=overwrite, command="moetrace synth"),
        request_progress("synth", quiet=quiet) as bar,
    ):
        bar.start(plan.num_requests, plan.num_requests)
        summary = synthesize(
            out,
            model=info,
            plan=plan,
            workers=workers,
            on_existing="overwrite" if overwrite else "refuse",
            progress=bar.update,
        )
    typer.echo(
        f"{summary.path}: {summary.num_requests} requests, {summary.num_tokens} tokens, "
        f"{summary.num_ids / 1e6:.1f} M expert ids in {summary.seconds:.1f} s "
        f"({summary.num_ids / max(summary.seconds, 1e-9) / 1e6:.1f} M ids/s), {human_bytes(summary.bytes_on_disk)}; "
        f"model {info.name}, calibration {cal}, structure {structure}, seed {seed}"
        + (f", mix {_mix_text(plan)}" if plan.mix is not None else "")
        + f". Planted truth: {summary.path / 'truth.npz'}"
    )


def _mix_text(plan: SynthPlan) -> str:
    """``gsm8k 60 (60%), mbpp 40 (40%)``: each dataset's requests and share."""
    return ", ".join(
        f"{d} {n} ({100 * w:.3g}%)" for d, n, w in zip(plan.datasets, plan.requests_per_dataset(), plan.shares())
    )
