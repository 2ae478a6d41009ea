"""Decision latency and memory of the library router (moetrace.serving) at DeepSeek-V3 shape.

A price-routed placement of DeepSeek-V3 (58 MoE layers x 256 experts, top-8) for DP64TP1EP64 on
8 nodes of 8 GPUs (64 DP ranks), written as a placement file and loaded with
``ExpertRouter.from_placement``. Arrivals come open-loop at ``--rate`` requests/s (one client
thread sleeping to each arrival's time), each holding its prompt's routed experts ``[T, 58, 8]``
(int16, as the engines return them; a pool of synthetic prompts of ``--tokens`` tokens, skewed
towards one node's experts); each stays in flight for ``--hold`` seconds and is then released, so
the admission cap sees a live load. Reported: p50/p99/max of one ``route`` call (counting the ids,
scoring, admission), of ``route_counts`` (a caller that counts itself), and of a window of
``--window`` requests (``route_window``: the capacity-constrained assignment); the placement file's
size and the memory one loaded router holds (tracemalloc: what stays allocated after loading, and
the peak while loading).

    python benchmarks/bench_router.py [--rate 1000] [--seconds 5] [--tokens 128,512,2048]
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from moetrace.placement.deployment import parse_deployment
from moetrace.placement.exports import PlacementFile, save_placement
from moetrace.placement.maps import placement_from_phy2log
from moetrace.placement.routers import PriceRouter
from moetrace.serving import ExpertRouter
from moetrace.serving.router import warm_up_counting
from moetrace.tracer.presets import model_info_for


def make_placement(path: Path, *, seed: int = 0) -> None:
    model = model_info_for("deepseek-v3")
    dep = parse_deployment("DP64TP1EP64", num_gpus_per_node=8)
    L, E, G = model.num_moe_layers, model.num_experts, dep.num_groups
    rng = np.random.default_rng(seed)
    phy2log = np.stack([rng.permutation(E) for _ in range(L)])  # each node: 32 experts per layer
    router = PriceRouter(
        num_groups=G, node_prices_G=tuple(np.round(rng.normal(0, 0.02, G), 9).tolist()), max_node_load=1.1
    )
    pf = PlacementFile(
        model=model,
        deployment=dep,
        strategy="joint",
        placement=placement_from_phy2log(phy2log, num_experts=E),
        router=router,
        source={"trace": "synthetic (bench_router.py)", "seed": seed, "test_fraction": 0.2},
    )
    save_placement(pf, path)


def prompts(router: ExpertRouter, *, tokens: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` prompts of ``tokens`` tokens; each draws 70 % of its ids from one node's experts."""
    rng = np.random.default_rng(seed)
    L, E, K = router.num_layers, router.num_experts, 8
    phy2log = router.placement_file.placement.phy2log
    J = phy2log.shape[1] // router.num_nodes
    out = []
    for i in range(count):
        g = i % router.num_nodes
        home = phy2log[:, g * J : (g + 1) * J]  # [L, J] the node's experts
        ids = rng.integers(0, E, size=(tokens, L, K))
        local = rng.random((tokens, L, K)) < 0.7
        pick = home[np.arange(L)[None, :, None], rng.integers(0, J, size=(tokens, L, K))]
        out.append(np.where(local, pick, ids).astype(np.int16))
    return out


def open_loop(router: ExpertRouter, pool: list[np.ndarray], *, rate: float, seconds: float, hold: float, counts: bool):
    n = int(rate * seconds)
    pool_counts = [router.counts(p) for p in pool] if counts else None
    lat = np.empty(n)
    pending: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    late = 0
    for i in range(n):
        due = t0 + i / rate
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        else:
            late += 1
        while pending and pending[0][0] <= time.perf_counter():
            router.release(pending.pop(0)[1])
        s = time.perf_counter()
        d = router.route_counts(pool_counts[i % len(pool)]) if pool_counts else router.route(pool[i % len(pool)])
        lat[i] = time.perf_counter() - s
        pending.append((s + hold, d.rank))
    elapsed = time.perf_counter() - t0
    for _, rank in pending:
        router.release(rank)
    return lat * 1e3, n / elapsed, late / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--hold", type=float, default=0.2, help="seconds each request stays in flight")
    ap.add_argument("--tokens", default="128,512,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--window", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "placement.json"
        make_placement(path)
        size = os.path.getsize(path)
        # the counting kernel is loaded once per process (numba and its compiled code), not per router:
        # measured apart, before the router's own memory
        gc.collect()
        tracemalloc.start()
        t0 = time.perf_counter()
        warm_up_counting(58, 256)
        warm_s = time.perf_counter() - t0
        gc.collect()
        kernel_held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        gc.collect()
        tracemalloc.start()
        router = ExpertRouter.from_placement(path)
        gc.collect()
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    print(
        f"placement file (DeepSeek-V3, DP64TP1EP64, 8 nodes, 64 DP ranks): {size / 2**20:.2f} MiB; "
        f"a loaded router holds {held / 2**20:.2f} MiB (peak while loading {peak / 2**20:.2f} MiB); "
        f"the counting kernel, once per process: {kernel_held / 2**20:.1f} MiB, loaded in {warm_s:.2f} s"
    )
    print(f"open loop at {args.rate:.0f} requests/s for {args.seconds:.0f} s, each in flight {args.hold} s")
    print("| prompt tokens | what | p50 ms | p99 ms | max ms | achieved req/s | arrivals late |")
    print("|---|---|---|---|---|---|---|")
    for T in (int(t) for t in args.tokens.split(",")):
        pool = prompts(router, tokens=T, count=32, seed=T)
        for counts in (False, True):
            fresh = ExpertRouter(router.placement_file)
            lat, achieved, late = open_loop(
                fresh, pool, rate=args.rate, seconds=args.seconds, hold=args.hold, counts=counts
            )
            what = "route_counts (scores + admission)" if counts else "route (ids [T, 58, 8] in)"
            p50, p99, mx = np.percentile(lat, 50), np.percentile(lat, 99), lat.max()
            print(f"| {T} | {what} | {p50:.3f} | {p99:.3f} | {mx:.2f} | {achieved:.0f} | {late:.1%} |")
        fresh = ExpertRouter(router.placement_file)
        counts_RLE = np.stack([fresh.counts(p) for p in pool] * (args.window // len(pool) + 1))[: args.window]
        burst = np.repeat(counts_RLE[:1], args.window, axis=0)  # one kind: the cap binds, the LP runs
        for name, w in (("mixed", counts_RLE), ("one-kind burst", burst)):
            ts = []
            for _ in range(20):
                s = time.perf_counter()
                fresh.nodes_of_window(w)
                ts.append((time.perf_counter() - s) * 1e3)
            print(
                f"| {T} | window of {args.window}, {name} (nodes_of_window) | {np.percentile(ts, 50):.3f} | "
                f"{np.percentile(ts, 99):.3f} | {max(ts):.2f} | - | - |"
            )


if __name__ == "__main__":
    main()
