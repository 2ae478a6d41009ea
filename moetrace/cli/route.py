"""``moetrace route``: the placement's router in front of engines (docs/serving.md).

``route replay`` sends a trace's held-out requests through the library router (``moetrace.serving``)
as the engines would give them, and says whether it routes them as ``compare`` does, how a stream
of single arrivals compares, and how long one decision takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from moetrace.cli.common import friendly_errors

route_app = typer.Typer(
    name="route",
    help=(
        "Route requests to nodes and DP ranks with a placement's router, in front of real engines "
        "(docs/serving.md).\n\n\b\n"
        "Example:\n"
        "  moetrace route replay placement.json traces/dsv3"
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
)


def register(app: typer.Typer) -> None:
    app.add_typer(route_app, name="route", short_help="Route requests with a placement's router.")


@route_app.command(
    "replay",
    short_help="Replay a trace's held-out requests through the router.",
    help=(
        "Replay a trace's held-out requests (the placement's own split) through the library router: "
        "window routing against compare's offline routing, a stream of single arrivals, decision "
        "latency.\n\n\b\n"
        "Example:\n"
        "  moetrace route replay placement.json traces/dsv3"
    ),
)
@friendly_errors
def replay_cmd(
    placement: Annotated[Path, typer.Argument(help="Placement JSON from `moetrace place`.", metavar="placement")],
    trace: Annotated[Path, typer.Argument(help="The trace it was placed from.", metavar="trace")],
    fallback: Annotated[
        Literal["least_loaded", "error"],
        typer.Option(help="Requests without readable routing: the least-loaded rank, or an error."),
    ] = "least_loaded",
) -> None:
    from moetrace.serving import ExpertRouter
    from moetrace.serving.replay import replay

    router = ExpertRouter.from_placement(placement, fallback=fallback)
    res = replay(router, trace)
    G = router.num_nodes
    typer.echo(
        f"{placement}: {router.kind} router, {G} nodes, {router.num_ranks} DP ranks; "
        f"{res.num_requests} held-out requests of {trace}"
    )
    if router.kind == "none":
        typer.echo("  ungrouped placement: no router; requests go to the least-loaded rank")
        return
    same = "identical to" if res.window_equals_offline else "DIFFERENT from"
    typer.echo(
        f"  window (all at once): {same} compare's offline routing; busiest node {res.max_node_load_window:.2f}x even"
    )
    typer.echo(
        f"  stream (one arrival at a time, none released): {res.stream_agreement:.1%} on the window's node; "
        f"busiest node {res.max_node_load_stream:.2f}x even"
    )
    typer.echo(f"  decision latency per arrival: p50 {res.decision_p50_ms:.3f} ms, p99 {res.decision_p99_ms:.3f} ms")
