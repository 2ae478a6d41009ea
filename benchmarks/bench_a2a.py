"""Measured all-to-all time of ``linear`` vs the best grouped placer on emulated nodes, next to the
simulator's inter-node byte ratio.

One ``moetrace a2a`` replay (library calls, one launch of all ranks for every strategy) of a
structured synthetic trace on an emulated 2-node CPU cluster: DP2TP2EP4 with 2 GPUs per node, so
4 gloo ranks, 2 per node; each node in its own network namespace, its link shaped to ``--link``
(``placement/netemu.py``; intra-node traffic is loopback). ``--link`` defaults to 200Mbit here, below
the CLI's 1Gbit: on 2 shared cores gloo's own CPU cost is about 20 ms a layer, which would hide the
few milliseconds a 1Gbit link adds. Per strategy: the median over
(batch, MoE layer) of dispatch + combine wall time (the slowest rank of each collective), and the
simulated inter-node bytes per batch (median). The grouped placer reported is the one of
``--strategies`` (grouped per ``placement/strategies.py``) with the fewest simulated inter-node
bytes; ratios are grouped / linear from the same run.

The trace (generated when ``--trace`` does not exist): ``moetrace synth --model olmoe-1b-7b-tiny``
(16 MoE layers, 64 experts, top-8), two datasets of different domains, knobs making the domain
structure dominant (``KNOBS``). The token rows are ``--hidden-size`` values (default 4096 bf16 =
8 KiB per token copy, scaled from DeepSeek-V3's 7168 so a batch's layer moves about a megabyte).

Needs root (network namespaces); without it the replay runs on loopback and says so, and its times
do not separate the link classes. Times on a shared 2-core machine carry scheduling noise.

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

import numpy as np

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
    from moetrace.placement import a2a_run as ar
    from moetrace.placement.compare import CompareConfig, load_trace_data
    from moetrace.placement.deployment import parse_deployment
    from moetrace.placement.netemu import parse_link
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
    ar.raise_on_mismatch(plan, records)

    rows = {r["strategy"]: r for r in ar.summary_rows(plan, records)}
    best = min(grouped, key=lambda s: rows[s]["simulated_inter_node_bytes_per_batch_median"])
    secs_VBL = (
        np.stack([r["seconds_VBL2"] for r in records], axis=-1).max(-1).sum(-1)
    )  # slowest rank, dispatch + combine
    lin, grp = names.index("linear"), names.index(best)
    B, L = secs_VBL.shape[1:]
    # link-bound prediction: the busiest node link direction of each collective at the link rate, dispatch + combine
    node_W = np.arange(plan.world_size) // plan.ranks_per_node
    G = int(node_W.max()) + 1
    onehot_WG = np.eye(G, dtype=np.int64)[node_W]
    node_VBLGG = np.einsum("vblsd,sg,dh->vblgh", plan.sends_VBLWW, onehot_WG, onehot_WG) * plan.bytes_per_token
    off_VBLGG = node_VBLGG * (1 - np.eye(G, dtype=np.int64))
    busiest_VBL = np.maximum(off_VBLGG.sum(-1).max(-1), off_VBLGG.sum(-2).max(-1))  # out of / into one node
    link_s_VBL = 2 * busiest_VBL * 8 / parse_link(args.link).rate_bit

    def line(s: str) -> str:
        r = rows[s]
        return (
            f"| {s} | {r['layer_seconds_median'] * 1e3:.2f} | {secs_VBL[names.index(s)].mean() * 1e3:.2f} | "
            f"{np.median(link_s_VBL[names.index(s)]) * 1e3:.2f} | "
            f"{r['simulated_inter_node_bytes_per_batch_median'] / 2**20:.2f} | "
            f"{r['simulated_inter_node_normalized_median']:.3f} |"
        )

    t_ratio = rows[best]["layer_seconds_median"] / rows["linear"]["layer_seconds_median"]
    mean_ratio = secs_VBL[grp].mean() / secs_VBL[lin].mean()
    b_ratio = (
        rows[best]["simulated_inter_node_bytes_per_batch_median"]
        / rows["linear"]["simulated_inter_node_bytes_per_batch_median"]
    )
    l_ratio = np.median(link_s_VBL[grp]) / np.median(link_s_VBL[lin])
    links = (
        f"emulated: one network namespace per node, each node link shaped to {net.link} ({net.qdisc})"
        + (f"; {net.note}" if net.note else "")
        if net.mode == "emulated"
        else f"NOT emulated ({net.note})"
    )
    c = plan.config
    out = [
        f"{c['deployment']} on {c['num_nodes']} emulated nodes of {args.gpus_per_node} GPUs: {plan.world_size} gloo ranks "
        f"(CPU), {B} held-out batches of {c['batch_requests']} requests x {L} MoE layers, token rows of {plan.hidden_size} "
        f"bf16 ({plan.bytes_per_token} B); links {links}",
        "",
        "| strategy | measured dispatch+combine per layer, median (ms) | mean (ms) | link-bound prediction per layer, "
        "median (ms) | simulated inter-node MiB per batch (median) | normalized to linear |",
        "|---|---|---|---|---|---|",
        *(line(s) for s in names),
        "",
        f"**{best} / linear**: measured time per layer (median) **{t_ratio:.3f}** (mean {mean_ratio:.3f}); "
        f"simulated inter-node bytes **{b_ratio:.3f}**; link-bound time prediction {l_ratio:.3f}. Measured bytes equal "
        "the simulator's for every collective. Link-bound prediction: the busiest node link direction's bytes / rate, "
        "dispatch + combine (no CPU or loopback cost, no latency).",
        f"One run, {wall:.0f} s wall for the replay (spawning the ranks included).",
    ]
    text = "\n".join(out)
    print(text)
    cmd = " ".join([".venv/bin/python", "benchmarks/bench_a2a.py", *sys.argv[1:]])
    args.md.write_text(
        "# All-to-all replay on emulated nodes: linear vs the best grouped placer\n\n"
        f"Machine: {machine}.\n\n{text}\n\n"
        f"Reproduce (as root, from the repository root):\n\n```\n{cmd}\n```\n\n"
        f"The trace it generates when missing:\n\n```\nmoetrace synth {' '.join(SYNTH)} --knobs '{json.dumps(KNOBS)}' "
        f"-o {args.trace}\n```\n"
    )
    print(f"wrote {args.md}")


if __name__ == "__main__":
    main()
