"""The full placement comparison on a DeepSeek-V3-shape trace: every strategy, 58 layers, 500 batches.

Times (one run, same trace): reading + counting the trace, then placing all six strategies on the
training requests and simulating 500 global batches of 256 held-out requests at DP8TP8EP64.
Target for the comparison: <= 60 s on the 2-core dev machine. The trace is a ``moetrace synth``
DeepSeek-V3 trace (generated here if the path does not exist).

Run: .venv/bin/python benchmarks/bench_placement.py /tmp/pl/dsv3-1600 [--requests 1600] [--batches 500]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from moetrace.placement.compare import CompareConfig, load_trace_data, run_compare
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.strategies import STRATEGY_NAMES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path)
    ap.add_argument("--requests", type=int, default=1600)
    ap.add_argument("--batches", type=int, default=500)
    args = ap.parse_args()
    if not args.trace.exists():
        from moetrace.tracer.presets import model_info_for
        from moetrace.tracer.synth import SynthPlan, default_calibration, load_calibration, synthesize

        ds = ("gsm8k", "math", "mbpp", "humaneval", "lmsys-chat", "xsum", "tldr")
        synthesize(
            args.trace,
            model=model_info_for("deepseek-v3"),
            workers=2,
            plan=SynthPlan(
                datasets=ds,
                num_requests=args.requests,
                seed=1,
                knobs=load_calibration(default_calibration("deepseek-v3")),
                calibration="deepseek-v3",
            ),
        )
    cfg = CompareConfig(deployment=parse_deployment("DP8TP8EP64"), strategies=STRATEGY_NAMES, num_batches=args.batches)
    t0 = time.perf_counter()
    data = load_trace_data(args.trace, test_fraction=cfg.test_fraction, seed=cfg.seed)
    t1 = time.perf_counter()
    res = run_compare(data, cfg)
    t2 = time.perf_counter()
    print(f"trace {args.trace}: {len(data.is_test_R)} requests, {int(data.is_test_R.sum())} held out")
    print(
        f"load + count: {t1 - t0:.1f} s; place {len(STRATEGY_NAMES)} strategies + simulate {args.batches} batches x "
        f"{cfg.batch_requests} requests x {data.model.num_moe_layers} layers: {t2 - t1:.1f} s"
    )
    for r in (row.to_row() for row in res.summary_rows()):
        print(f"  {r['strategy']:<12} inter-node normalized median {r['inter_node_normalized_median']:.3f}")


if __name__ == "__main__":
    main()
