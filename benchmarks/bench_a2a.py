"""The cost model against the replay: predicted vs measured all-to-all time per strategy on emulated
nodes, each as a ratio to ``linear``'s.

One ``moetrace a2a`` replay (library calls, one launch of all ranks for every strategy) of a
structured synthetic trace on an emulated 2-node CPU cluster: DP2TP2EP4 with 2 GPUs per node, so
4 gloo ranks, 2 per node; each node in its own network namespace, its link shaped to ``--link``
(``placement/netemu.py``; intra-node traffic is loopback). ``--link`` defaults to 200Mbit here, below
the CLI's 1Gbit: on 2 shared cores gloo's own CPU cost is a few ms a collective, which would hide
much of what a 1Gbit link adds. Copy model: compare's decode default, one copy per (token, expert).

Per strategy: the simulated inter-node bytes per batch, and the time per batch (dispatch + combine
of every MoE layer; measured: the slowest rank of each collective), median over batches, predicted
by the cost model (``replay.replay_cost`` / ``predicted_seconds_VBL``: the shaped node link shared
by its ranks, loopback's probed rate, gloo's fixed cost per collective from empty probes) and
measured, each over linear's, and their ratio (docs/a2a.md, "The cost model against the replay").

The trace (generated when ``--trace`` does not exist): ``moetrace synth --model olmoe-1b-7b-tiny``
(16 MoE layers, 64 experts, top-8), two datasets of different domains, knobs making the domain
structure dominant (``KNOBS``). The token rows are ``--hidden-size`` values (default 4096 bf16 =
8 KiB per token copy, scaled from DeepSeek-V3's 7168 so a batch's layer moves about a megabyte).

Needs root (network namespaces); without it the replay runs on loopback and says so, its times
do not separate the link classes and there is no time prediction. Times on a shared 2-core machine carry scheduling noise.

Run: .venv/bin/python benchmarks/bench_a2a.py [--trace /tmp/bench-a2a/trace] [--strategies linear,eplb,data,joint]
     [--link 200Mbit] [--batches 8] [--hidden-size 4096] [--md /tmp/bench_a2a.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

KNOBS = {
    "shared_weight": 0.0,
    "domain_weight": 0.9,
    "request_spread": 0.05,
    "zipf_exponent": 1.5,
    "layer_skew_spread": 0.1,
    "layer_affinity": 0.0,
}
SYNTH = ["--model", "olmoe-1b-7b-tiny", "--requests", "400", "--seed", "0", "--datasets", "gsm8k,mbpp"]


def _machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "?",
    )
    load = os.getloadavg()[0]
    return (
        f"{platform.node()}: {os.cpu_count()} CPU cores ({cpu}), Linux {platform.release()}, Python "
        f"{platform.python_version()}; load average at start {load:.1f}"
    )


def main() -> None:
    from moetrace.placement import replay as ar
    from moetrace.placement.compare import CompareConfig, load_trace_data
    from moetrace.placement.deployment import parse_deployment
    from moetrace.placement.strategies import get_strategy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=Path("/tmp/bench-a2a/trace"))
    ap.add_argument("--strategies", default="linear,eplb,data,joint")
    ap.add_argument("--config", default="DP2TP2EP4")
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--link", default="200Mbit")  # below the CLI default: on 2 shared cores gloo costs ~20 ms a layer
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-requests", type=int, default=0)
    ap.add_argument("--hidden-size", type=int, default=4096)
    ap.add_argument("--md", type=Path, default=Path("/tmp/bench_a2a.md"))
    args = ap.parse_args()
    names = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    grouped = [s for s in names if get_strategy(s).grouped]
    if "linear" not in names or not grouped:
        sys.exit("--strategies needs linear and at least one grouped placer (e.g. data)")
    synth_cmd = [
        sys.executable,
        "-m",
        "moetrace",
        "synth",
        *SYNTH,
        "--knobs",
        json.dumps(KNOBS),
        "-o",
        str(args.trace),
        "-q",
    ]
    if not args.trace.exists():
        subprocess.run(synth_cmd, check=True)

    machine = _machine()
    cfg = CompareConfig(
        deployment=parse_deployment(args.config, num_gpus_per_node=args.gpus_per_node),
        strategies=names,
        num_batches=args.batches,
        num_batch_requests=args.batch_requests,
    )
    data = load_trace_data(args.trace, test_fraction=cfg.test_fraction, seed=cfg.seed)
    plan = ar.build_plan(data, cfg=cfg, hidden_size=args.hidden_size, dtype="bfloat16", backend="gloo")
    t0 = time.perf_counter()
    records, net = ar.run_a2a(plan, emulate=None, link=args.link, log=print)
    wall = time.perf_counter() - t0
    assert records is not None  # local ranks: the records come back to this process
    ar.raise_on_mismatch(plan, records)

    rows = {r.strategy: r for r in ar.summary_rows(plan, records, net)}
    cost = ar.replay_cost(plan, records, net)
    # the shapers' counters (everything that crossed, barriers and probes included) over the inter-node payload
    counted = sum(out for out, _ in net.link_bytes_G2) / max(2 * float(plan.sim_inter_VBL.sum()), 1.0)
    best = min(grouped, key=lambda s: rows[s].simulated_inter_node_bytes_per_batch_median)
    B, L = plan.sends_VBLWW.shape[1:3]

    def opt(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    def line(s: str) -> str:
        r = rows[s]
        return (
            f"| {s} | {r.simulated_inter_node_bytes_per_batch_median / 2**20:.2f} | "
            f"{r.simulated_inter_node_normalized_median:.3f} | "
            f"{opt(r.predicted_seconds_per_batch_median, '.3f')} | {r.measured_seconds_per_batch_median:.3f} | "
            f"{opt(r.predicted_time_normalized_median, '.3f')} | {r.measured_time_normalized_median:.3f} | "
            f"{opt(r.predicted_over_measured, '.3f')} |"
        )

    links = (
        f"emulated: one network namespace per node, each node link shaped to {net.link} ({net.qdisc})"
        + (f"; {net.note}" if net.note else "")
        if net.mode == "emulated"
        else f"NOT emulated ({net.note}): no time prediction"
    )
    model = (
        "no cost model (links not emulated)"
        if cost is None
        else (
            f"cost model as the replay realised it: inter {cost.links.inter.bytes_per_s * 8 / 1e6:.1f} Mbit/s of "
            f"payload per node link ({net.link} / {cost.wire_overhead:.3f} wire bytes per payload byte: TCP/IP headers, "
            f"ACKs; the shapers counted {counted:.3f}), shared by the node's ranks; intra (loopback, probed) {cost.links.intra.bytes_per_s / 1e9:.2f} "
            f"GB/s; {cost.fixed_seconds * 1e3:.2f} ms fixed per collective (median empty all_to_all)"
        )
    )
    c = plan.config
    out = [
        f"{c.deployment} on {c.num_nodes} emulated nodes of {args.gpus_per_node} GPUs: {plan.world_size} gloo ranks "
        f"(CPU), {B} held-out batches of {c.batch_requests} requests x {L} MoE layers, copy model {c.dedup}, "
        f"token rows of {plan.hidden_size} bf16 ({plan.bytes_per_token} B); links {links}; {model}",
        "",
        "| strategy | simulated inter-node MiB per batch | bytes / linear | predicted s per batch | measured s per batch "
        "| predicted time / linear | measured time / linear | predicted / measured |",
        "|---|---|---|---|---|---|---|---|",
        *(line(s) for s in names),
        "",
        f"Time per batch: dispatch + combine of all {L} MoE layers (measured: the slowest rank of each collective), "
        f"median over batches; ratios to linear from the same run. Best grouped placer by bytes: {best}. "
        "Measured bytes equal the simulator's for every collective.",
        f"One run, {wall:.0f} s wall for the replay (spawning the ranks included).",
    ]
    text = "\n".join(out)
    print(text)
    cmd = " ".join([".venv/bin/python", "benchmarks/bench_a2a.py", *sys.argv[1:]])
    args.md.write_text(
        "# The cost model against the all-to-all replay on emulated nodes\n\n"
        f"Machine: {machine}.\n\n{text}\n\n"
        f"Reproduce (as root, from the repository root):\n\n```\n{cmd}\n```\n\n"
        f"The trace it generates when missing:\n\n```\nmoetrace synth {' '.join(SYNTH)} --knobs '{json.dumps(KNOBS)}' "
        f"-o {args.trace}\n```\n"
    )
    print(f"wrote {args.md}")


if __name__ == "__main__":
    main()
