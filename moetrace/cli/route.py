"""``moetrace route``: the placement's router in front of engines (docs/serving.md).

``route replay`` sends a trace's held-out requests through the library router (``moetrace.serving``)
as the engines would give them, and says whether it routes them as ``compare`` does, how a stream
of single arrivals compares, and how long one decision takes. ``route serve`` runs the
prefill–decode proxy (``moetrace.serving.proxy``) in front of vLLM or SGLang servers.
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
        "  moetrace route replay placement.json traces/dsv3\n"
        "  moetrace route serve placement.json --engine vllm \\\n"
        "    --prefill http://p0:8100 --decode http://d0:8200"
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


@route_app.command(
    "serve",
    short_help="Run the prefill-decode proxy in front of vLLM or SGLang.",
    help=(
        "OpenAI-compatible proxy (/v1/completions, /v1/chat/completions, streamed or not) in front of "
        "prefill and decode servers: each request's prefill returns its routed experts, the placement's "
        "router picks the decode DP rank, the answer streams back. /metrics: Prometheus text. "
        "docs/serving.md.\n\n\b\n"
        "Example:\n"
        "  moetrace route serve placement.json --engine vllm \\\n"
        "    --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 --port 8000"
    ),
)
@friendly_errors
def serve_cmd(
    placement: Annotated[Path, typer.Argument(help="Placement JSON from `moetrace place`.", metavar="placement")],
    prefill: Annotated[list[str], typer.Option(help="A prefill server, http://HOST:PORT (repeat for several).")],
    decode: Annotated[
        list[str],
        typer.Option(
            help="A decode server, http://HOST:PORT (repeat; the placement's DP ranks split evenly, in order)."
        ),
    ],
    engine: Annotated[Literal["vllm", "sglang"], typer.Option(help="The engines' wire format.")] = "vllm",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    pd: Annotated[
        bool,
        typer.Option("--pd/--no-pd", help="Prefill-decode disaggregation (KV moves); --no-pd: prefill only probes."),
    ] = True,
    bootstrap_port: Annotated[
        int | None, typer.Option(help="SGLang PD: the prefill servers' --disaggregation-bootstrap-port.")
    ] = None,
    fallback: Annotated[
        Literal["least_loaded", "error"],
        typer.Option(help="Unreadable routing: the least-loaded rank, or HTTP 502."),
    ] = "least_loaded",
    first_byte_timeout: Annotated[
        float, typer.Option(help="Seconds to wait for a decode server's answer to begin.")
    ] = 60.0,
    prefill_timeout: Annotated[float, typer.Option(help="Seconds to wait for a prefill reply.")] = 60.0,
) -> None:
    import logging

    from moetrace.serving.proxy import Proxy, ProxyConfig, run_proxy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = ProxyConfig(
        placement=str(placement),
        engine=engine,
        prefill=tuple(prefill),
        decode=tuple(decode),
        host=host,
        port=port,
        pd=pd,
        bootstrap_port=bootstrap_port,
        fallback=fallback,
        first_byte_timeout_s=first_byte_timeout,
        prefill_timeout_s=prefill_timeout,
    )

    def ready(proxy: Proxy) -> None:
        r = proxy.router
        typer.echo(
            f"moetrace proxy on http://{host}:{proxy.port}: {r.kind} router, {r.num_nodes} nodes, {r.num_ranks} DP "
            f"ranks over {len(decode)} decode server(s), {len(prefill)} prefill server(s) ({engine}); /metrics"
        )

    run_proxy(cfg, ready=ready)
