"""``moetrace collect``: run a model on prompt sets and record every token's routed experts.

The ``--backend`` choices and their help come from the registry ``moetrace.tracer.backends.registry``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from moetrace.cli.common import (
    ModelOpt,
    OutDir,
    Overwrite,
    Quiet,
    Seed,
    claim_output,
    friendly_errors,
    request_progress,
    show_progress,
    third_party_bars,
)
from moetrace.tracer.backends.registry import AUTO, BACKENDS, backend_choices

_BACKEND_CHOICES = backend_choices()
BackendChoice = Literal[_BACKEND_CHOICES]  # type: ignore[valid-type]  # the registry's names, built at run time
_AUTO_HELP = ", ".join(f"{e.name} ({e.auto_when})" for e in BACKENDS.values())
BackendOpt = Annotated[
    BackendChoice,
    typer.Option(help=f"Collection backend, {', '.join(BACKENDS)} or {AUTO}, which picks {_AUTO_HELP}."),
]


def register(app: typer.Typer) -> None:
    app.command("collect", short_help="Collect a routing trace (Parquet) from a model.")(collect_cmd)
    app.command("merge-shards", short_help="Check a sharded collection and write its manifest.")(merge_shards_cmd)


@friendly_errors
def collect_cmd(
    model: ModelOpt,
    out: OutDir,
    dataset: Annotated[
        list[str],
        typer.Option(
            "--dataset",
            "-d",
            help="Prompt source, repeatable or comma-separated: a bundled set (math-word, math-competition, code, "
            "chat, summarize; 'bundled' = all five), a hub dataset (gsm8k, math, mbpp, humaneval, lmsys-chat, "
            "xsum, tldr) or a local .jsonl/.json/.parquet file.",
        ),
    ] = ["bundled"],  # noqa: B006 (typer needs a list default; it is never mutated)
    per_dataset: Annotated[int | None, typer.Option(help="Requests per dataset (equal representation).")] = None,
    num_requests: Annotated[int | None, typer.Option(help="Total requests, split evenly over datasets.")] = None,
    prompt_field: Annotated[str | None, typer.Option(help="Field holding the prompt in local files.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Generated tokens per request at most.")] = 64,
    batch_size: Annotated[int, typer.Option(help="Requests per generation batch (HF backend).")] = 8,
    seed: Seed = 0,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 = greedy.")] = 0.0,
    device: Annotated[str, typer.Option(help="Torch device for the HF backend (cpu, cuda, cuda:1, ...).")] = "cpu",
    backend: BackendOpt = AUTO,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted collection in OUT.")] = False,
    overwrite: Overwrite = False,
    store_text: Annotated[
        bool, typer.Option("--store-text", help="Keep prompt and output text in the trace (off: no text is stored).")
    ] = False,
    chat_template: Annotated[
        bool, typer.Option("--chat-template/--no-chat-template", help="Apply the tokenizer's chat template.")
    ] = True,
    record_weights: Annotated[bool, typer.Option("--weights", help="Also store routing weights.")] = False,
    tp: Annotated[int, typer.Option(help="vLLM: tensor-parallel size.")] = 1,
    ep: Annotated[
        int, typer.Option(help="vLLM: expert-parallel size: 1 (off) or tp*dp (experts sharded over all ranks).")
    ] = 1,
    dp: Annotated[int, typer.Option(help="vLLM: data-parallel size.")] = 1,
    max_model_len: Annotated[int | None, typer.Option(help="vLLM: maximum sequence length.")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(help="vLLM: fraction of GPU memory to use.")] = 0.9,
    enforce_eager: Annotated[bool, typer.Option("--enforce-eager", help="vLLM: disable CUDA graphs.")] = False,
    shard: Annotated[
        str | None,
        typer.Option(
            help="Collect only shard S of N ('S/N', e.g. 3/8) into OUT next to the other shards; "
            "then run `moetrace merge-shards OUT`."
        ),
    ] = None,
    ray_shards: Annotated[
        int | None,
        typer.Option(
            help="Split the run into N shards, one engine each, placed by Ray across the cluster, "
            "then merge (OUT must be on a file system every node mounts)."
        ),
    ] = None,
    quiet: Quiet = False,
) -> None:
    """Collect a trace: the experts every token of every request is routed to, as Parquet.

    \b
    Example:
      moetrace collect --model deepseek-v3-tiny --dataset bundled \\
        --per-dataset 8 -o traces/tiny
    On GPU nodes with vLLM:
      moetrace collect --backend vllm --model deepseek-v3 --dataset gsm8k \\
        --tp 8 --ep 8 -o traces/dsv3
    """
    from moetrace.tracer.backends.vllm import VllmEngineConfig
    from moetrace.tracer.collect import CollectConfig, parse_shard
    from moetrace.tracer.sharding import run_collection

    if resume and overwrite:
        raise typer.BadParameter("--resume and --overwrite exclude each other")
    config = CollectConfig(
        model=model,
        datasets=tuple(s.strip() for item in dataset for s in item.split(",") if s.strip()),
        per_dataset=per_dataset,
        num_requests=num_requests,
        prompt_field=prompt_field,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        seed=seed,
        temperature=temperature,
        chat_template=chat_template,
        store_text=store_text,
        record_weights=record_weights,
        device=device,
    )
    engine = VllmEngineConfig(
        tp=tp,
        ep=ep,
        dp=dp,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager,
    )
    with (
        # before any model is loaded: a trace being written is refused in a second, not after minutes
        claim_output(out, kind="trace", overwrite=overwrite, command="moetrace collect", shard=shard is not None),
        third_party_bars(show_progress(quiet)),
        request_progress("collect", quiet=quiet) as bar,
    ):
        result = run_collection(
            config,
            out=out,
            backend=backend,
            engine=engine,
            on_existing="resume" if resume else "overwrite" if overwrite else "refuse",
            shard=None if shard is None else parse_shard(shard),
            ray_shards=ray_shards,
            on_start=bar.start,
            on_progress=bar.update,
        )
    head, *rest = result.summary_lines()
    typer.secho(head, fg=typer.colors.GREEN)
    typer.echo("\n".join(rest))


@friendly_errors
def merge_shards_cmd(
    trace: Annotated[Path, typer.Argument(help="Trace directory the shards were collected into.")],
    allow_incomplete: Annotated[
        bool, typer.Option("--allow-incomplete", help="Write an incomplete manifest while shards are still running.")
    ] = False,
) -> None:
    """Check the shard manifests of a sharded collection agree, and write the trace's manifest.

    \b
    Example:
      moetrace merge-shards /shared/traces/dsv3
    """
    from moetrace.tracer.trace.merge import merge_shards

    m = merge_shards(trace, allow_incomplete=allow_incomplete)
    state = "complete" if m["complete"] else "INCOMPLETE"
    typer.secho(
        f"{trace}: {len(m['shards'])} shards merged ({state}): {m['totals']['num_requests']} requests, "
        f"{m['totals']['num_tokens']} tokens",
        fg=typer.colors.GREEN if m["complete"] else typer.colors.YELLOW,
    )
