"""``moetrace a2a``: replay placements through real all-to-all collectives (``placement.replay``).

Out of scope: the replay itself and its result files (``moetrace.placement.replay``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import typer

from moetrace.cli.common import (
    AllowIncomplete,
    Overwrite,
    Quiet,
    Seed,
    TraceArg,
    claim_output,
    friendly_errors,
    progress_bar,
)
from moetrace.cli.place import (
    BatchRequests,
    Clusters,
    ConfigOpt,
    DedupOpt,
    GpusPerNode,
    Redundancy,
    ReplicaPolicyOpt,
    TestFraction,
    check_before_reading,
)
from moetrace.errors import ConfigError
from moetrace.placement.netemu import DEFAULT_LINK, parse_link


def register(app: typer.Typer) -> None:
    app.command("a2a", short_help="Replay all-to-all through real collectives.")(a2a_cmd)


@friendly_errors
def a2a_cmd(
    trace: TraceArg,
    *,
    config: ConfigOpt,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Results directory (a2a.json, collectives.parquet); not with --smoke.",
            show_default=False,
        ),
    ] = None,
    placement: Annotated[
        list[Path] | None,
        typer.Option("--placement", help="Placement JSON (repeat for several); instead of --strategies."),
    ] = None,
    strategies: Annotated[
        str, typer.Option(help="Comma-separated strategies to place from the trace (when no --placement).")
    ] = "linear,eplb,data,joint",
    gpus_per_node: GpusPerNode = 8,
    batches: Annotated[int, typer.Option(help="Global batches (decode steps) to replay.")] = 8,
    batch_requests: BatchRequests = 0,
    hidden_size: Annotated[int, typer.Option(help="Values per token row (0: the model's hidden size).")] = 0,
    dtype: Annotated[
        Literal["bfloat16", "float16", "float32"], typer.Option(help="Dtype of the token rows on the wire.")
    ] = "bfloat16",
    backend: Annotated[
        Literal["gloo", "nccl", "auto"], typer.Option(help="gloo (CPU), nccl (one GPU per rank) or auto.")
    ] = "auto",
    torchrun: Annotated[
        bool, typer.Option("--torchrun", help="This process is one rank of a torchrun job (RANK/WORLD_SIZE set).")
    ] = False,
    emulate_nodes: Annotated[
        bool | None,
        typer.Option(
            "--emulate-nodes/--no-emulate-nodes",
            show_default="when root and `ip netns` work",
            help="Local gloo run: one network namespace per node, inter-node links shaped to --link.",
        ),
    ] = None,
    link: Annotated[
        str,
        typer.Option(help="Emulated node link RATE[,LATENCY], each direction (tc units: bit/kbit/mbit/gbit; s/ms/us)."),
    ] = DEFAULT_LINK,
    smoke: Annotated[
        bool,
        typer.Option("--smoke", help="1-rank NCCL check on cuda:0 (fewer GPUs than ranks); prints, writes nothing."),
    ] = False,
    clusters: Clusters = 0,
    redundancy: Redundancy = 0,
    test_fraction: TestFraction = 0.2,
    dedup: DedupOpt = "expert",
    replica_policy: ReplicaPolicyOpt = "same_node",
    seed: Seed = 0,
    allow_incomplete: AllowIncomplete = False,
    overwrite: Overwrite = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Start more local ranks than this machine's cores and memory can run (refused otherwise)."
        ),
    ] = False,
    quiet: Quiet = False,
) -> None:
    """Send the traced tokens' all-to-all through real torch.distributed collectives; compare bytes with the simulator.

    \b
    Example (as root, the 2 nodes are emulated: --link 1Gbit,50us):
      moetrace a2a traces/dsv3 --config DP2TP2EP4 --gpus-per-node 2 \\
        --strategies linear,eplb,data,joint -o a2a-out
    On 8 GPUs:
      torchrun --nproc-per-node 8 -m moetrace a2a ... --torchrun
    """
    from moetrace.atomic import replacing_directory
    from moetrace.placement import replay as rp
    from moetrace.placement.compare import CompareConfig, load_trace_data
    from moetrace.placement.deployment import parse_deployment
    from moetrace.results import A2A

    lead = not torchrun or os.environ.get("RANK", "0") == "0"
    if smoke and out is not None:
        raise ConfigError("--smoke prints its check and writes no results; drop -o")
    if not smoke and out is None:
        raise ConfigError("-o/--out RESULTS is required (except with --smoke)")
    parse_link(link)  # a bad --link fails before any work
    if torchrun and emulate_nodes:
        raise ConfigError("--emulate-nodes is for a local run; under --torchrun the ranks use the real nodes' links")
    # before any work; held while the ranks run: no second run writes into the same folder
    inputs = [trace, *(placement or [])]
    with claim_output(
        out if lead else None, kind="results", overwrite=overwrite, command="moetrace a2a", result=A2A, inputs=inputs
    ):
        names = tuple(s.strip() for s in strategies.split(",") if s.strip())
        cfg = CompareConfig(
            deployment=parse_deployment(config, num_gpus_per_node=gpus_per_node),
            strategies=names,
            num_clusters=clusters,
            num_redundant=redundancy,
            test_fraction=test_fraction,
            num_batches=batches,
            num_batch_requests=batch_requests,
            dedup=dedup,
            replica_policy=replica_policy,
            seed=seed,
        )
        local = not torchrun and not smoke  # this process starts the ranks
        if local and (warning := rp.check_local_capacity(cfg.deployment.num_ep, force=force)):
            typer.secho(warning, fg=typer.colors.YELLOW, err=True)
        check_before_reading(trace, cfg, allow_incomplete=allow_incomplete)
        resolved, note = rp.choose_backend(backend, world_size=cfg.deployment.num_ep, torchrun=torchrun, smoke=smoke)
        if note:
            typer.echo(note, err=True)
        if cfg.deployment.num_ep_tp > 1 and lead:
            typer.echo(
                f"note: {cfg.deployment.name}: TP{cfg.deployment.num_ep_tp} after EP is replayed as one process per EP rank "
                "(the EP all-to-all, as the simulator counts it; not the tensor-parallel traffic inside an EP rank)",
                err=True,
            )
        with progress_bar("counting", "tokens", quiet=quiet or not lead) as bar:
            data = load_trace_data(
                trace, test_fraction=test_fraction, seed=seed, allow_incomplete=allow_incomplete, progress=bar
            )
        placed = rp.placed_from_files(data, cfg, placement) if placement else None
        plan = rp.build_plan(data, cfg=cfg, placed=placed, hidden_size=hidden_size, dtype=dtype, backend=resolved)
        if smoke:
            typer.echo(rp.format_smoke(plan, rp.run_smoke(plan)))
            return
        with progress_bar("replaying", "batches", quiet=quiet) as bar:
            run = rp.replay(
                plan,
                torchrun=torchrun,
                emulate=emulate_nodes,
                link=link,
                force=force,
                log=lambda msg: typer.echo(msg, err=True),
                progress=bar,
            )
        if run is None:  # a torchrun rank other than 0: rank 0 reports
            return
        assert out is not None  # required without --smoke (checked above)
        with replacing_directory(out) as building:  # built beside -o, swapped in whole: a kill leaves old or new
            files = run.write(building)
        typer.echo(run.summary())
        typer.echo(f"wrote {', '.join(f.name for f in files)} to {out}")
        run.check()
        typer.echo("measured bytes equal the simulator's for every collective, rank and link class")
