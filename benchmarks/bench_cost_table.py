"""docs/placement.md's time table: three calibrated presets, an unequal domain mix, 2, 4 and 8 nodes.

For each preset a ``moetrace synth`` trace is generated (if its directory is missing) with the
model's calibrated knobs and traffic mixed 0.6 gsm8k (math) / 0.2 mbpp (code) / 0.1 xsum
(summarization) / 0.1 lmsys-chat (chat), never 1/D each. ``run_compare`` then places linear, EPLB,
the paper's data-based placer, the improved placer and ours (joint) on 80 % of the requests and
simulates 500 decode steps (and 5 prefill steps) of held-out requests at 2, 4 and 8 nodes, with the
two upper bounds, under the default cost model (decode: one copy per (token, expert); prefill: one
copy per node; H100-class links). Printed per case, one markdown table: predicted decode
all-to-all time and MoE-layer time per step over linear's median, inter-node bytes over linear's,
node load (busiest node's share of held-out requests over an even share, ``!`` over 1.10), the
busiest GPU's tokens over the mean GPU's, the prefill steps' all-to-all time over linear's; and the
wall time of the comparison.

Run: .venv/bin/python benchmarks/bench_cost_table.py [--root /tmp/costtab] [--cases dsv3,qwen3,olmoe] [--nodes 2,4,8]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from moetrace.placement.compare import CompareConfig, load_trace_data, run_compare
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.strategies import LABELS
from moetrace.tracer.presets import model_info_for

MIX = "gsm8k=0.6,mbpp=0.2,xsum=0.1,lmsys-chat=0.1"
#: name -> (model preset, requests, GPUs per node, TP of the attention replicas)
CASES = {
    "dsv3": ("deepseek-v3", 1600, 8, 8),
    "qwen3": ("qwen3-235b-a22b", 1600, 8, 8),
    "olmoe": ("olmoe-1b-7b", 2000, 2, 2),
}
STRATEGIES = ("linear", "eplb", "eplb_global", "data", "improved", "joint", "joint_free", "ours")


def trace_for(root: Path, case: str) -> Path:
    from moetrace.tracer.synth import SynthPlan, default_calibration, load_calibration, parse_mix, synthesize

    model, n, _, _ = CASES[case]
    path = root / case
    if not path.exists():
        cal = default_calibration(model)
        datasets, mix = parse_mix(MIX)
        synthesize(
            path,
            model=model_info_for(model),
            workers=2,
            plan=SynthPlan(
                datasets=datasets, mix=mix, num_requests=n, seed=1, knobs=load_calibration(cal), calibration=cal
            ),
        )
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=Path("/tmp/costtab"))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--nodes", default="2,4,8")
    ap.add_argument("--batches", type=int, default=500)
    args = ap.parse_args()
    for case in args.cases.split(","):
        model, n, gpn, tp = CASES[case]
        trace = trace_for(args.root, case)
        t0 = time.perf_counter()
        data = load_trace_data(trace, test_fraction=0.2, seed=0, held_out_tokens=False)
        count_s = time.perf_counter() - t0
        for nodes in (int(x) for x in args.nodes.split(",")):
            config = f"DP{nodes * gpn // tp}TP{tp}EP{nodes * gpn}"
            cfg = CompareConfig(
                deployment=parse_deployment(config, num_gpus_per_node=gpn),
                strategies=STRATEGIES,
                num_batches=args.batches,
            )
            t1 = time.perf_counter()
            res = run_compare(data, cfg)
            t2 = time.perf_counter()
            print(
                f"\n#### {model}, {config} ({nodes} nodes of {gpn} GPUs), mix {MIX}: {n} requests (20% held out), "
                f"{args.batches} decode steps of {cfg.batch_requests} requests; count {count_s:.1f} s, compare {t2 - t1:.1f} s"
            )
            print(
                "| strategy | a2a time / linear (median [p10, p90]) | MoE-layer time / linear | inter-node bytes / linear "
                "| node load | busiest GPU / mean | prefill a2a time / linear |"
            )
            print("|---|---|---|---|---|---|---|")
            for r in (row.to_row() for row in res.summary_rows()):
                load = f"{r['busiest_node_load']:.2f}" + (" !" if r["over_node_load_limit"] else "")
                name = LABELS.get(r["strategy"], r["strategy"]) + (" (bound)" if r["is_bound"] else "")
                print(
                    f"| {name} | {r['a2a_time_normalized_median']:.3f} [{r['a2a_time_normalized_p10']:.3f}, "
                    f"{r['a2a_time_normalized_p90']:.3f}] | {r['moe_time_normalized_median']:.3f} | "
                    f"{r['inter_node_normalized_median']:.3f} | {load} | {r['busiest_gpu_load']:.2f} | "
                    f"{r['prefill_a2a_time_normalized_median']:.3f} |"
                )


if __name__ == "__main__":
    main()
