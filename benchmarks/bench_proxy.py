"""Latency the prefill–decode proxy adds (``moetrace route serve``), at DeepSeek-V3 shape.

Three processes on loopback: stand-in vLLM servers (moetrace/serving/standin.py: a prefill server
returning each prompt's routed experts as vLLM 0.33 does, base64 ``.npy`` uint8 ``[T, 61 layers, 8]``,
and a decode server with 64 DP ranks answering one token at once), the proxy (bench_router.py's
price-routed DeepSeek-V3 placement, DP64TP1EP64 on 8 nodes), and an open-loop client sending
``/v1/completions`` at ``--rate`` requests/s. The same client also makes the two engine calls itself,
prefill then decode, without the proxy: the **added latency** is the proxy's percentile minus that
direct path's. The proxy's own ``decision_seconds`` histogram (reading the routed experts and
``ExpertRouter.route``) is read from ``/metrics``. **Proxy CPU per request** (user + system time of
the proxy process over its run, /proc, Linux) is the figure least moved by other jobs on a shared
machine: one free core serves at most 1000 / that many requests per second. The CPU per request of
the stand-ins and of the client is printed beside it, and the load average (``os.getloadavg``) with
each row.

``--pin`` (Linux, two CPUs or more) gives the proxy CPU 0 to itself and puts the client and the
stand-ins on CPU 1, as in a deployment, where the engines and the clients are other machines: what
is measured is then the proxy's own latency, not its fight with the load generator for a core.
``--repeat N`` runs each prompt length N times (a fresh set of processes each) and ends with the
median of the runs' added p50 and p99 and how many runs stayed under 5 ms at the p99, added and whole.

    python benchmarks/bench_proxy.py [--rate 1000] [--seconds 5] [--tokens 32,128] [--pin] [--repeat 5]

A baseline tree: ``PYTHONPATH=/tmp/before python benchmarks/bench_proxy.py ...`` (this script
imports ``moetrace`` from there, in every process it starts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moetrace.serving import ExpertRouter
from moetrace.serving.http11 import Upstream
from moetrace.serving.proxy import Proxy, ProxyConfig
from moetrace.serving.standin import StandinEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_router import make_placement, prompts  # noqa: E402


def run_standins(placement: str, tokens: int, q: mp.Queue) -> None:
    async def main() -> None:
        router = ExpertRouter.from_placement(placement)
        pool = prompts(router, tokens=tokens, count=64, seed=tokens)
        model = router.placement_file.model
        routing = {f"prompt {i}": ids for i, ids in enumerate(pool)}
        pre = await StandinEngine("vllm", "prefill", model, routing).start()
        dec = await StandinEngine("vllm", "decode", model, dp_size=router.num_ranks, tokens=1).start()
        q.put((pre.url, dec.url))
        await asyncio.Event().wait()

    asyncio.run(main())


def run_proxy(placement: str, prefill: str, decode: str, q: mp.Queue) -> None:
    async def main() -> None:
        cfg = ProxyConfig(placement=placement, engine="vllm", prefill=(prefill,), decode=(decode,), port=0)
        proxy = Proxy(cfg)
        await proxy.start()
        q.put(proxy.port)
        await asyncio.Event().wait()

    asyncio.run(main())


async def one(up: list[Upstream], path: str, body: dict, *, direct: bool) -> float:
    s = time.perf_counter()
    data = json.dumps(body).encode()
    h = {"Content-Type": "application/json"}
    if direct:  # what a client pays without the proxy: the prefill call, then the decode call
        r = await up[0].request("POST", path, json.dumps(dict(body, max_tokens=1)).encode(), h)
        await r.read()
        r = await up[1].request("POST", path, data, dict(h, **{"X-data-parallel-rank": "0"}))
    else:
        r = await up[0].request("POST", path, data, h)
    await r.read()
    return time.perf_counter() - s if r.status == 200 else float("nan")  # an error: counted, not timed


async def open_loop(urls: list[str], *, rate: float, seconds: float, direct: bool) -> tuple[np.ndarray, float]:
    ups = [Upstream(u, max_idle=4096) for u in urls]
    n = int(rate * seconds)
    tasks, t0 = [], time.perf_counter()
    for i in range(n):
        due = t0 + i / rate
        if (wait := due - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        body = {"model": "m", "prompt": f"prompt {i % 64}", "max_tokens": 1}
        tasks.append(asyncio.create_task(one(ups, "/v1/completions", body, direct=direct)))
    lat = np.array(await asyncio.gather(*tasks)) * 1e3
    achieved = n / (time.perf_counter() - t0)
    if np.isnan(lat).any():
        print(f"  {int(np.isnan(lat).sum())} of {n} requests answered with an error (overload)")
        lat = lat[~np.isnan(lat)]
    for u in ups:
        u.close()
    return lat, achieved


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def histogram_quantile(text: str, q: float) -> float:
    """The bucket bound (ms) under which a share ``q`` of decisions fell, from /metrics."""
    rows = []
    for line in text.splitlines():
        if line.startswith("moetrace_proxy_decision_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            rows.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    total = rows[-1][1]
    return next(b for b, c in rows if c >= q * total) * 1e3


def one_run(placement: str, T: int, args: argparse.Namespace) -> dict[str, float]:
    """One set of processes (stand-ins, proxy), the direct path then the proxy at ``args.rate``."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    engines = ctx.Process(target=run_standins, args=(placement, T, q), daemon=True)
    engines.start()
    pre, dec = q.get(timeout=60)
    proxy = ctx.Process(target=run_proxy, args=(placement, pre, dec, q), daemon=True)
    proxy.start()
    port = q.get(timeout=60)
    proxy_pid, engines_pid = proxy.pid, engines.pid
    assert proxy_pid is not None and engines_pid is not None  # both started
    mine = os.sched_getaffinity(0)
    if args.pin:
        os.sched_setaffinity(proxy_pid, {0})
        os.sched_setaffinity(engines_pid, {1})
        os.sched_setaffinity(0, {1})
    try:
        url = f"http://127.0.0.1:{port}"
        n = int(args.rate * args.seconds)
        asyncio.run(open_loop([url], rate=100, seconds=1, direct=False))  # warm-up
        direct, ach_d = asyncio.run(open_loop([pre, dec], rate=args.rate, seconds=args.seconds, direct=True))
        load_d = os.getloadavg()[0]
        cpu0, eng0, me0 = cpu_seconds(proxy_pid), cpu_seconds(engines_pid), time.process_time()
        via, ach_p = asyncio.run(open_loop([url], rate=args.rate, seconds=args.seconds, direct=False))
        cpu_ms = (cpu_seconds(proxy_pid) - cpu0) * 1e3 / n
        eng_ms = (cpu_seconds(engines_pid) - eng0) * 1e3 / n
        client_ms = (time.process_time() - me0) * 1e3 / n
        load_p = os.getloadavg()[0]

        async def metrics() -> str:
            up = Upstream(url)
            r = await up.request("GET", "/metrics")
            text = (await r.read()).decode()
            up.close()
            return text

        m = asyncio.run(metrics())
    finally:
        os.sched_setaffinity(0, mine)
        proxy.terminate()
        engines.terminate()
        proxy.join()
        engines.join()
    dp50, dp99 = histogram_quantile(m, 0.5), histogram_quantile(m, 0.99)
    p = {k: (np.percentile(v, 50), np.percentile(v, 99)) for k, v in (("direct", direct), ("proxy", via))}
    print(
        f"| {T} | direct (prefill, then decode) | {p['direct'][0]:.2f} | {p['direct'][1]:.2f} | {ach_d:.0f} "
        f"| | | | | | | {load_d:.1f} |"
    )
    added = (p["proxy"][0] - p["direct"][0], p["proxy"][1] - p["direct"][1])
    print(
        f"| {T} | through the proxy | {p['proxy'][0]:.2f} | {p['proxy'][1]:.2f} | {ach_p:.0f} | "
        f"{added[0]:.2f} | {added[1]:.2f} | ≤ {dp50:g} / ≤ {dp99:g} "
        f"| {cpu_ms:.2f} | {eng_ms:.2f} | {client_ms:.2f} | {load_p:.1f} |",
        flush=True,
    )
    return {
        "added_p50": added[0],
        "added_p99": added[1],
        "proxy_p99": p["proxy"][1],
        "cpu_ms": cpu_ms,
        "achieved": ach_p,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--tokens", default="32,128", help="prompt lengths, comma-separated")
    ap.add_argument("--pin", action="store_true", help="the proxy on CPU 0 alone, the client and stand-ins on CPU 1")
    ap.add_argument("--repeat", type=int, default=1, help="runs per prompt length (fresh processes each)")
    args = ap.parse_args()
    if args.pin and (not hasattr(os, "sched_setaffinity") or not {0, 1} <= os.sched_getaffinity(0)):
        sys.exit("--pin needs Linux and CPUs 0 and 1 available to this process")
    print(f"open loop at {args.rate:.0f} requests/s for {args.seconds:.0f} s; latency in ms; pinned: {args.pin}")
    print(
        "| prompt tokens | path | p50 | p99 | achieved req/s | added p50 | added p99 | decision p50 / p99 (bucket) "
        "| proxy CPU ms / request | stand-ins CPU ms / request | client CPU ms / request | load (1 min) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    with tempfile.TemporaryDirectory() as d:
        placement = str(Path(d) / "placement.json")
        make_placement(Path(placement))
        for T in (int(t) for t in args.tokens.split(",")):
            runs = [one_run(placement, T, args) for _ in range(args.repeat)]
            summary.append((T, runs))
    if args.repeat > 1:
        print(
            "\n| prompt tokens | runs | added p50, median | added p99, median | runs under 5 ms added at p99 "
            "| through the proxy p99, median | runs under 5 ms through the proxy at p99 "
            "| proxy CPU ms / request, median |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for T, runs in summary:
            med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
            under = sum(r["added_p99"] < 5.0 for r in runs)
            whole = sum(r["proxy_p99"] < 5.0 for r in runs)
            print(
                f"| {T} | {len(runs)} | {med['added_p50']:.2f} | {med['added_p99']:.2f} | {under} of {len(runs)} "
                f"| {med['proxy_p99']:.2f} | {whole} of {len(runs)} | {med['cpu_ms']:.2f} |"
            )


if __name__ == "__main__":
    main()
