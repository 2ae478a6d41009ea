"""Commands over placements: ``place``, ``compare``, ``export``.

The strategy choices and their help come from the registry ``moetrace.placement.strategies``; the
printed text from ``moetrace.placement.report``. Inside ``sharing_placements()`` (what ``moetrace demo``
opens) ``place`` starts from the counts, request clusters and placements a ``compare`` before it in
the same process kept, and writes the file it would write on its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from moetrace.cli.common import (
    AllowIncomplete,
    ModelConfigOpt,
    Overwrite,
    Quiet,
    Seed,
    TraceArg,
    claim_output,
    friendly_errors,
    progress_bar,
    read_model_config,
)
from moetrace.errors import ConfigError
from moetrace.placement.legends import COMPARE_LEGEND, help_epilog
from moetrace.placement.strategies import RECOMMENDED, STRATEGIES, STRATEGY_NAMES

if TYPE_CHECKING:
    from moetrace.placement.compare import CompareConfig, PlacedStrategy, TraceData
    from moetrace.placement.eplb import Accumulate
    from moetrace.placement.grouping import Grouping

#: compare's strategies when none are named (on a load profile: its ungrouped ones)
DEFAULT_STRATEGIES = "linear,eplb,data,joint,joint_free,ours"

ConfigOpt = Annotated[str, typer.Option("--config", "-c", help="Deployment DPaTPbEPc[TPd], e.g. DP8TP8EP64.")]
GpusPerNode = Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node (NVLink domain).")]
Clusters = Annotated[
    int, typer.Option("--clusters", help="K-means request clusters of the grouped strategies (0: one per node).")
]
Redundancy = Annotated[
    int, typer.Option("--redundancy", help="Redundant expert slots per layer (E+R must divide over EP ranks).")
]
TestFraction = Annotated[float, typer.Option("--test-fraction", help="Share of requests held out from placement.")]
BatchRequests = Annotated[int, typer.Option(help="Requests per global batch (0: 32 per node).")]
DedupOpt = Annotated[
    Literal["rank", "expert", "node"],
    typer.Option(
        help="Copy model of the decode steps: a token is sent once per distinct destination GPU (rank), expert (DeepEP's low-latency kernels) or node (DeepEP's normal kernels)."
    ),
]
PrefillDedupOpt = Annotated[
    Literal["rank", "expert", "node"],
    typer.Option(help="Copy model of the prefill steps (node: DeepEP's normal kernels, one copy per remote node)."),
]
LinkOpt = Annotated[
    str | None,
    typer.Option(
        "--link",
        help="Step model hardware: a preset (h100, h200, b200, gb200; default h100), a links file from "
        "`moetrace calibrate`, or intra=BW[,LAT],inter=BW[,LAT] over the default (PRESET:intra=... over a "
        "preset); docs/placement.md.",
    ),
]
MaxNodeLoad = Annotated[
    float,
    typer.Option(
        help="Flag routers that send the busiest node more than this over an even share (bounds stay within it)."
    ),
]
PrefillTokens = Annotated[
    int, typer.Option(help="Chunked-prefill tokens per node and prefill step at an even share (0: decode only).")
]


def _route_on_text(text: str) -> str:
    """``--route-on`` with the N of ``first-decode:N`` checked (``moetrace.inputs.option_int``: ASCII digits,
    within 1..the compare's limit) before ``parse_route_on`` reads it."""
    from moetrace.inputs import option_int
    from moetrace.placement.compare import MAX_ROUTE_FIRST_DECODE

    head, sep, n = text.strip().partition(":")
    if head == "first-decode" and sep:
        n_ok = option_int(
            n, option="--route-on first-decode:N", low=1, high=MAX_ROUTE_FIRST_DECODE, form="e.g. first-decode:16"
        )
        return f"first-decode:{n_ok}"
    return text


RouteOnOpt = Annotated[
    str,
    typer.Option(
        help="What routers see: prefill (as deployed) or first-decode:N, a what-if for decode-only captures "
        "(each request's first N generated tokens; not deployable, said in every output)."
    ),
]
EplbSumOpt = Annotated[
    Literal["float64", "float32"],
    typer.Option(
        "--eplb-sum",
        help="How EPLB sums pack weights: float64 as SGLang and vLLM compute it (the placement they would load), "
        "float32 as DeepSeek's reference; the output names which.",
    ),
]
ReplicaPolicyOpt = Annotated[Literal["same_node", "even", "metro"], typer.Option(help="Which replica serves a token.")]
_GROUPED = ", ".join(s.name for s in STRATEGIES if s.grouped)
StrategyName = Literal[STRATEGY_NAMES]  # type: ignore[valid-type]  # the registry's names, built at run time
StrategyOpt = Annotated[
    StrategyName,
    typer.Option(
        metavar="STRATEGY",
        help=f"Placement strategy, one of {', '.join(STRATEGY_NAMES)} (default: the recommended one; "
        f"{_GROUPED} cluster requests first).",
    ),
]
StrategiesOpt = Annotated[str, typer.Option(help=f"Comma-separated, from: {', '.join(STRATEGY_NAMES)}.")]


def register(app: typer.Typer) -> None:
    app.command("place", short_help="Compute one expert placement (placement JSON).")(place_cmd)
    app.command(
        "compare",
        short_help="Rank placement strategies on held-out requests.",
        epilog=help_epilog(COMPARE_LEGEND, title="The table's columns (printed under it too):"),
    )(compare_cmd)
    app.command("export", short_help="Convert a placement to a serving engine's format.")(export_cmd)


def _cfg(config: str, gpus_per_node: int, **kw: Any) -> CompareConfig:
    from moetrace.placement.compare import CompareConfig
    from moetrace.placement.deployment import parse_deployment

    return CompareConfig(deployment=parse_deployment(config, num_gpus_per_node=gpus_per_node), **kw)


def check_before_reading(trace: Path, cfg: CompareConfig, *, allow_incomplete: bool) -> None:
    """The checks that need no trace data, run before the counting pass (which takes minutes at scale):
    the trace's manifest (its model's E) against ``--redundancy`` and the deployment's EP ranks."""
    from moetrace.errors import option_hint
    from moetrace.sizes import check_memory
    from moetrace.tracer.trace.profile import is_profile, open_profile
    from moetrace.tracer.trace.reader import open_trace

    if is_profile(trace):
        model = open_profile(trace).model
    else:
        model = open_trace(trace, require_complete=not allow_incomplete).model  # the manifest only
    cfg.deployment.check_slots(num_experts=model.num_experts, num_redundant=cfg.num_redundant)
    simulated = cfg.num_batches * cfg.batch_requests  # the simulated tokens' routed ids, int16 [T, L, K]
    check_memory(
        simulated * model.ids_per_token * 2,
        what=f"simulating {simulated:,} tokens of {model.num_moe_layers} layers x top-{model.top_k}",
        knob="free memory" + option_hint("--batches", ", or lower --batches or --batch-requests"),
    )


def load_data(
    trace: Path, cfg: CompareConfig, *, asked: bool, allow_incomplete: bool, quiet: bool, held_out: bool = False
) -> tuple[TraceData, CompareConfig]:
    """The placement input and the config to run: a trace's counts (a progress bar), or a load
    profile's loads with tokens drawn from them (``profile_batches``; grouped strategies refused when
    ``asked`` for, else left out). ``held_out``: the held-out tokens too, from the counting pass, when
    they fit ``compare.EARLY_HELD_OUT_BYTES`` (else ``run_compare`` reads them after placing)."""
    from dataclasses import replace

    from moetrace.placement.compare import EARLY_HELD_OUT_BYTES, load_trace_data
    from moetrace.tracer.trace.profile import is_profile

    if is_profile(trace):
        from moetrace.placement.profile_batches import load_profile_data, profile_strategies

        if cfg.route_first_decode:
            raise ConfigError(
                f"{trace} is a load profile (expert counts, no requests): --route-on first-decode:N needs a trace"
            )
        cfg = replace(cfg, strategies=profile_strategies(cfg.strategies, asked=asked))
        return load_profile_data(trace, seed=cfg.seed), cfg
    with progress_bar("counting", "tokens", quiet=quiet) as bar:
        data = load_trace_data(
            trace,
            test_fraction=cfg.test_fraction,
            seed=cfg.seed,
            allow_incomplete=allow_incomplete,
            progress=bar,
            held_out_tokens=held_out,
            held_out_max_bytes=EARLY_HELD_OUT_BYTES,
            route_first_decode=cfg.route_first_decode,
        )  # placing never reads them
    return data, cfg


# ------------------------------------------------------------------ what compare read and placed, shared with place
# Within ``sharing_placements()`` (the demo: ``compare`` then ``place`` on the same trace, in one process)
# ``compare`` keeps the trace's counts, its request clusters and the placements it computed, and ``place``
# starts from them instead of reading and clustering the trace again: a strategy ``compare`` placed is
# written as it was placed; another is placed from the kept counts and clusters. Only when the trace (same
# folder, unchanged) and every setting are the same. Outside the block (``moetrace place`` on its own)
# nothing is kept; with or without, ``place`` writes the same file.

#: what ``compare``'s simulation adds to a placement's ``extra`` (its held-out routing), never in a placement file
SIMULATION_KEYS = ("groups_without_routed_requests", "busiest_node_load", "node_load_limit")


@dataclass(frozen=True)
class _Computed:
    """What one ``compare`` run read and placed, and from what."""

    stamp: tuple[str, int, int]  # the trace: resolved path, its manifest's mtime and size
    cfg: CompareConfig  # compare's settings, the strategy list left out (``_settings``)
    allow_incomplete: bool
    data: TraceData  # the training requests' counts, as ``load_data`` read them
    grouping: Grouping | None  # the request clusters of the grouped strategies (one fit, shared)
    placed: dict[str, PlacedStrategy]  # strategy -> its placement, as ``make_placement`` built it


_shared: list[_Computed] | None = None


@contextlib.contextmanager
def sharing_placements() -> Iterator[None]:
    """Within the block, ``compare`` keeps what it read and placed and ``place`` starts from it (see above)."""
    global _shared
    outer, _shared = _shared, []
    try:
        yield
    finally:
        _shared = outer


def _settings(cfg: CompareConfig) -> CompareConfig:
    """``cfg`` with its strategy list left out: the settings a placement depends on (and a few it does not)."""
    return replace(cfg, strategies=("linear",))


def _stamp(trace: Path) -> tuple[str, int, int] | None:
    """A trace's identity: its resolved path, its manifest's mtime and size (None: not a trace folder,
    e.g. a load profile, whose strategies ``load_data`` still has to check)."""
    try:
        resolved = trace.resolve()
        st = os.stat(resolved / "manifest.json")
    except OSError:
        return None
    return str(resolved), st.st_mtime_ns, st.st_size


def _keep_for_place(
    trace: Path, cfg: CompareConfig, *, allow_incomplete: bool, data: TraceData, placed: dict[str, PlacedStrategy]
) -> None:
    """Keep what ``compare`` read and placed for ``place`` (only inside ``sharing_placements``); each
    placement's ``extra`` as the placer built it (what the simulation added is left out)."""
    stamp = _stamp(trace)
    if _shared is None or stamp is None:
        return
    kept = {
        s: replace(ps, extra={k: v for k, v in ps.extra.items() if k not in SIMULATION_KEYS})
        for s, ps in placed.items()
    }
    grouping = next((ps.grouping for ps in placed.values() if ps.grouping is not None), None)
    _shared.append(_Computed(stamp, _settings(cfg), allow_incomplete, data, grouping, kept))


def _kept(trace: Path, cfg: CompareConfig, *, allow_incomplete: bool) -> _Computed | None:
    """What a ``compare`` in this ``sharing_placements`` block kept from the same trace with the same
    settings, or None."""
    if not _shared:
        return None
    stamp, asked = _stamp(trace), _settings(cfg)
    for c in reversed(_shared):
        if c.stamp == stamp and c.cfg == asked and c.allow_incomplete == allow_incomplete:
            return c
    return None


def _place_from_kept(
    kept: _Computed, trace: Path, cfg: CompareConfig, strategy: str, *, eplb_sum: Accumulate
) -> tuple[TraceData, PlacedStrategy, str]:
    """``place``'s data and placement from what ``compare`` kept, and a line saying what was reused:
    compare's own placement of ``strategy`` (EPLB summed as compare sums it), else one placed from the
    kept counts (and clusters, for a grouped strategy)."""
    from moetrace.placement.compare import make_placement
    from moetrace.placement.eplb_place import place_with_sum
    from moetrace.placement.strategies import get_strategy

    data = replace(kept.data, trace_path=str(trace))  # recorded in the file as place names it
    if strategy in kept.placed and eplb_sum == "float64":
        return (
            data,
            kept.placed[strategy],
            (
                f"(the {strategy} placement `moetrace compare` computed above from the same trace and settings, "
                "not computed again; run alone, this command computes it)"
            ),
        )
    said = "(the trace's counts `moetrace compare` read above, not read again; run alone, this command reads them)"
    if get_strategy(strategy).grouped and kept.grouping is not None and eplb_sum == "float64":
        said = said.replace("counts", "counts and request clusters")
        return data, make_placement(data, cfg, strategy, grouping=kept.grouping), said
    return data, place_with_sum(data, cfg, strategy, eplb_sum=eplb_sum), said


@friendly_errors
def place_cmd(
    trace: TraceArg,
    *,
    config: ConfigOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Placement JSON to write.")],
    strategy: StrategyOpt = RECOMMENDED,
    gpus_per_node: GpusPerNode = 8,
    clusters: Clusters = 0,
    redundancy: Redundancy = 0,
    test_fraction: TestFraction = 0.2,
    seed: Seed = 0,
    link: LinkOpt = None,
    model_config: ModelConfigOpt = None,
    eplb_sum: EplbSumOpt = "float64",
    allow_incomplete: AllowIncomplete = False,
    overwrite: Overwrite = False,
    quiet: Quiet = False,
) -> None:
    """Compute an expert placement from a trace's training requests and write moetrace's placement JSON.

    \b
    Example:
      moetrace place traces/dsv3 --config DP8TP8EP64 -o placement.json
    """
    from moetrace.placement.compare import placement_file
    from moetrace.placement.eplb import ACCUMULATE_WHO
    from moetrace.placement.eplb_place import place_with_sum
    from moetrace.placement.exports import save_placement
    from moetrace.placement.hardware import load_hardware
    from moetrace.placement.report import format_placement_summary
    from moetrace.results import PLACEMENT

    cfg = _cfg(
        config,
        gpus_per_node,
        strategies=(strategy,),
        num_clusters=clusters,
        num_redundant=redundancy,
        test_fraction=test_fraction,
        seed=seed,
        hardware=load_hardware(link),
        model_config=read_model_config(model_config),
    )
    # before minutes of work
    inputs = [trace, *([model_config] if model_config is not None else [])]
    reused = None
    with claim_output(out, kind="file", overwrite=overwrite, command="moetrace place", result=PLACEMENT, inputs=inputs):
        kept = _kept(trace, cfg, allow_incomplete=allow_incomplete)
        if kept is None:
            check_before_reading(trace, cfg, allow_incomplete=allow_incomplete)
            data, cfg = load_data(trace, cfg, asked=True, allow_incomplete=allow_incomplete, quiet=quiet)
            ps = place_with_sum(data, cfg, strategy, eplb_sum=eplb_sum)
        else:
            data, ps, reused = _place_from_kept(kept, trace, cfg, strategy, eplb_sum=eplb_sum)
        save_placement(placement_file(data, cfg, ps, out=out), out)
    used = ps.extra.get("eplb_sum")
    summed = f" (EPLB summed in {used}, {ACCUMULATE_WHO[used]})" if used else ""
    typer.echo(f"{format_placement_summary(ps, deployment=cfg.deployment.name)}{summed} -> {out}")
    if reused is not None:
        typer.echo(reused)
    typer.echo(place_relation(strategy, redundancy))


def place_relation(strategy: str, redundancy: int) -> str:
    """How ``place``'s answer relates to ``compare``'s and ``advise``'s (``decision.relation``)."""
    from moetrace.placement.decision import relation

    if strategy == RECOMMENDED:
        return f"note: {relation(command='place', strategies=())}"
    return (
        f"note: the strategy you named ({strategy}{f', {redundancy} redundant' if redundancy else ''}), one "
        "placement for both "
        "stages; the best option per stage by the same objective: `moetrace advise` (or `moetrace compare`)"
    )


@friendly_errors
def compare_cmd(
    trace: TraceArg,
    *,
    config: ConfigOpt,
    strategies: StrategiesOpt = DEFAULT_STRATEGIES,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Results directory (Parquet + JSON for the dashboards).")
    ] = None,
    gpus_per_node: GpusPerNode = 8,
    clusters: Clusters = 0,
    redundancy: Redundancy = 0,
    test_fraction: TestFraction = 0.2,
    batches: Annotated[int, typer.Option(help="Global batches (decode steps) to simulate.")] = 500,
    batch_requests: BatchRequests = 0,
    dedup: DedupOpt = "expert",
    prefill_dedup: PrefillDedupOpt = "node",
    link: LinkOpt = None,
    model_config: ModelConfigOpt = None,
    max_node_load: MaxNodeLoad = 1.10,
    prefill_tokens: PrefillTokens = 1024,
    route_on: RouteOnOpt = "prefill",
    replica_policy: ReplicaPolicyOpt = "same_node",
    oracle: Annotated[
        bool, typer.Option(help="Also report the upper bounds: perfect routing and the test-set oracle.")
    ] = True,
    seed: Seed = 0,
    allow_incomplete: AllowIncomplete = False,
    overwrite: Overwrite = False,
    quiet: Quiet = False,
) -> None:
    """Place experts with several strategies on training requests; simulate all-to-all volume on held-out ones.

    Prints each strategy's predicted all-to-all and MoE-layer time per step and its inter-node
    bytes, normalized to the linear baseline's median (lower is better).

    \b
    Example:
      moetrace compare traces/dsv3 --config DP8TP8EP64 \\
        --strategies linear,eplb,data,joint -o results/dsv3-compare
    """
    from moetrace.placement.compare import parse_route_on, run_compare, write_results
    from moetrace.placement.hardware import load_hardware
    from moetrace.placement.report import compare_notes, format_compare_summary
    from moetrace.results import COMPARE

    cfg = _cfg(
        config,
        gpus_per_node,
        strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()),
        num_clusters=clusters,
        num_redundant=redundancy,
        test_fraction=test_fraction,
        num_batches=batches,
        num_batch_requests=batch_requests,
        dedup=dedup,
        prefill_dedup=prefill_dedup,
        hardware=load_hardware(link),
        model_config=read_model_config(model_config),
        max_node_load=max_node_load,
        prefill_tokens_per_node=prefill_tokens,
        replica_policy=replica_policy,
        oracle=oracle,
        seed=seed,
        route_first_decode=parse_route_on(_route_on_text(route_on)),
    )
    if out is None:  # said before minutes of work, and again at the end
        typer.secho("note: no -o: the results are printed, nothing is saved", fg=typer.colors.YELLOW, err=True)
    # before minutes of work
    inputs = [trace, *([model_config] if model_config is not None else [])]
    with claim_output(
        out, kind="results", overwrite=overwrite, command="moetrace compare", result=COMPARE, inputs=inputs
    ):
        check_before_reading(trace, cfg, allow_incomplete=allow_incomplete)
        data, cfg = load_data(
            trace,
            cfg,
            asked=strategies != DEFAULT_STRATEGIES,
            allow_incomplete=allow_incomplete,
            quiet=quiet,
            held_out=True,
        )
        with progress_bar("place+simulate", "steps", quiet=quiet) as bar:
            result = run_compare(data, cfg, progress=bar)
        # place never reads the held-out tokens: kept without them
        kept = replace(
            data, test_topk_ids_TLK=None, test_req_T=None, test_prefill_ids_TLK=None, test_prefill_req_T=None
        )
        _keep_for_place(trace, cfg, allow_incomplete=allow_incomplete, data=kept, placed=result.placed)
        typer.echo(format_compare_summary(result))
        for note in compare_notes(result):
            typer.secho(note, fg=typer.colors.YELLOW, err=True)
        if out is not None:
            from moetrace.atomic import replacing_directory

            with replacing_directory(out) as building:  # built beside -o, swapped in whole: a kill leaves old or new
                files = write_results(result, building)
            typer.echo(f"wrote {', '.join(f.name for f in files)} to {out}")
        else:
            typer.echo("nothing saved (no -o): add -o DIR to keep the results for `moetrace dashboard`")


@friendly_errors
def export_cmd(
    source: Annotated[
        Path,
        typer.Argument(
            help="Placement JSON written by `moetrace place` (a trace directory or load profile for the trace formats).",
            show_default=False,
        ),
    ],
    *,
    fmt: Annotated[
        Literal[
            "sglang",
            "trtllm",
            "vllm",
            "vllm-ascend",
            "llmd-fixed-placement",
            "sglang-logical-count",
            "llmd-moetrace",
            "aisimulate-popularity",
        ],
        typer.Option(
            "--format",
            "-f",
            metavar="FORMAT",
            help="Engine file. From a placement JSON: sglang, trtllm, vllm, vllm-ascend, llmd-fixed-placement "
            "(llm-d-inference-sim's fixed-placement JSON). From a trace: sglang-logical-count (token counts; "
            "SGLang runs its own EPLB on them), llmd-moetrace (llm-d-inference-sim's binary .moetrace trace), "
            "aisimulate-popularity (aisimulate's expert-popularity bundle, a folder; also from a load profile). "
            "See docs/exports.md.",
        ),
    ],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="File to write (aisimulate-popularity: the bundle's folder).")
    ],
    stage: Annotated[
        Literal["decode", "prefill", "both"] | None,
        typer.Option(
            help="sglang-logical-count and aisimulate-popularity: the tokens counted (default decode).",
            show_default=False,
        ),
    ] = None,
    model_id: Annotated[
        str | None,
        typer.Option(
            "--model-id",
            help="aisimulate-popularity: the hub id ORG/NAME the bundle is filed under (default: the trace's model "
            "source); the folder -o must be named ORG--NAME.",
            show_default=False,
        ),
    ] = None,
    allow_incomplete: AllowIncomplete = False,
    overwrite: Overwrite = False,
    quiet: Quiet = False,
) -> None:
    """Convert a placement JSON to a serving engine's format (SGLang, TensorRT-LLM, vLLM proposal, vllm-ascend,
    llm-d-inference-sim), or export a trace for SGLang's start-up EPLB or a simulator.

    \b
    Example:
      moetrace export placement.json --format sglang -o expert_location.json
      moetrace export traces/dsv3 --format aisimulate-popularity \\
        -o bundles/deepseek-ai--DeepSeek-V3
    """
    from moetrace.atomic import atomic_path, replacing_directory, write_text_atomic
    from moetrace.errors import ConfigError
    from moetrace.placement.exports import BUNDLE_EXPORTS, export_bundle, export_file

    if model_id is not None and fmt not in BUNDLE_EXPORTS:
        raise ConfigError(f"--model-id applies to --format {', '.join(BUNDLE_EXPORTS)}")
    if fmt in BUNDLE_EXPORTS:
        with claim_output(out, kind="directory", overwrite=overwrite, command="moetrace export", inputs=[source]):
            with progress_bar("counting", "tokens", quiet=quiet) as bar:
                files = export_bundle(
                    source,
                    fmt=fmt,
                    stage=stage,
                    allow_incomplete=allow_incomplete,
                    model_id=model_id,
                    folder_name=out.name,
                    progress=bar,
                )
            with replacing_directory(out) as building:  # the bundle replaces -o whole, or not at all
                for name, data in files.items():
                    (building / name).write_bytes(data)
        typer.echo(f"wrote {fmt} bundle ({', '.join(files)}) to {out}")
        return
    with claim_output(out, kind="file", overwrite=overwrite, command="moetrace export", inputs=[source]):
        with progress_bar("counting", "tokens", quiet=quiet) as bar:
            content = export_file(source, fmt=fmt, stage=stage, allow_incomplete=allow_incomplete, progress=bar)
        if isinstance(content, bytes):
            with atomic_path(out) as tmp:
                tmp.write_bytes(content)
        else:
            write_text_atomic(out, content)
    what = {"sglang-logical-count": "expert counts", "llmd-moetrace": "trace"}.get(fmt, "placement")
    typer.echo(f"wrote {fmt} {what} to {out}")
