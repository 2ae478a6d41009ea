"""``moetrace make-checkpoint``: a tiny checkpoint directory of a preset that the HF and vLLM backends both run."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from moetrace.cli.common import OutDir, Overwrite, Quiet, Seed, claim_output, friendly_errors, human_bytes


def register(app: typer.Typer) -> None:
    app.command("make-checkpoint", short_help="Write a tiny checkpoint both backends run.")(make_checkpoint_cmd)


@friendly_errors
def make_checkpoint_cmd(
    preset: Annotated[
        str, typer.Argument(help="Model preset (see `moetrace models`), e.g. deepseek-v3.", show_default=False)
    ],
    out: OutDir,
    seed: Seed = 0,
    dtype: Annotated[
        Literal["bfloat16", "float16", "float32"], typer.Option(help="Weight dtype on disk.")
    ] = "bfloat16",
    overwrite: Overwrite = False,
    quiet: Quiet = False,
) -> None:
    """Write a tiny checkpoint of a preset (config.json, tokenizer, safetensors) that both backends run.

    The preset's real architecture and routing topology (layers, experts, top-k, groups) and real
    attention head dims, with small widths and seeded random weights: vLLM's kernels accept it, and it
    builds on a CPU. Collect from the directory like any local checkpoint.

    \b
    Example:
      moetrace make-checkpoint deepseek-v3 -o ckpt/dsv3-tiny
    Then (on a GPU node: --backend vllm):
      moetrace collect --model ckpt/dsv3-tiny --backend hf \\
        --no-chat-template -o traces/dsv3-hf
    """
    from moetrace.tracer.checkpoint import make_checkpoint

    with claim_output(out, kind="directory", overwrite=overwrite, command="moetrace make-checkpoint"):
        info = make_checkpoint(preset, out=out, seed=seed, dtype=dtype, overwrite=overwrite, progress=not quiet)
    typer.echo(
        f"{info.path}: {info.preset} ({info.architecture}), {info.num_parameters / 1e6:.1f}M parameters, "
        f"{human_bytes(info.bytes_on_disk)} ({dtype})"
    )
