"""How much structure a trace needs before a placement reaches a given share of linear's inter-node volume.

Sweeps the skew of the deepseek-v3 preset (``zipf_exponent``; 1.5 is the calibrated value) and, for
each value, generates a ``moetrace synth`` trace (the preset's other knobs, its group-limited router,
the paper's 7 datasets, seed 1), measures the mean per-dataset top-1/8 share (the statistic of the
Dynamo figure the preset is calibrated to, ``synth_stats.top_share``) and the mean over datasets of
the 90th-percentile imbalance factor, then places linear, the paper's data-based placer and ours
(joint) on 80 % of the requests and simulates held-out batches at DP8TP8EP64 (dedup ``rank``, with
the upper bounds). ``--redundancy`` adds redundant slots (a comma-separated list: one row per skew and
redundancy). Printed: one JSON line per row.

The model is DeepSeek-V3 cut to its first ``--layers`` MoE layers (default 8): every statistic here
is a mean over layers, and at the calibrated skew 8 layers give the full model's ratios within
0.005 (docs/placement.md).

Run: .venv/bin/python benchmarks/bench_placement_structure.py [--zipf 1.5,2.0,2.5,3.0] [--root /tmp/sweep]
     [--layers 8] [--requests 2000] [--batches 200] [--redundancy 0,64,128,256]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from moetrace.placement.compare import CompareConfig, load_trace_data, run_compare
from moetrace.placement.deployment import parse_deployment
from moetrace.tracer.presets import model_info_for
from moetrace.tracer.synth import PAPER_DATASETS, SynthPlan, load_calibration, synthesize
from moetrace.tracer.synth_stats import measure_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zipf", default="1.5,2.0,2.5,3.0", help="comma-separated zipf_exponent values")
    ap.add_argument("--root", type=Path, default=Path("/tmp/sweep"), help="where the traces go (reused when present)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--redundancy", default="0", help="comma-separated numbers of redundant slots (per layer)")
    args = ap.parse_args()
    full = model_info_for("deepseek-v3")
    model = dataclasses.replace(full, moe_layers=full.moe_layers[: args.layers])
    base = load_calibration("deepseek-v3")
    for zipf in (float(z) for z in args.zipf.split(",")):
        plan = SynthPlan(
            datasets=PAPER_DATASETS,
            num_requests=args.requests,
            seed=1,
            knobs=dataclasses.replace(base, zipf_exponent=zipf),
            calibration="deepseek-v3",
        )
        path = args.root / f"dsv3-L{args.layers}-z{zipf}"
        if not path.exists():
            synthesize(path, model=model, workers=2, plan=plan)
        stats = measure_plan(model, dataclasses.replace(plan, num_requests=min(args.requests, 700)))
        data = load_trace_data(path, test_fraction=0.2, seed=0)
        for num_redundant in (int(r) for r in args.redundancy.split(",")):
            cfg = CompareConfig(
                deployment=parse_deployment("DP8TP8EP64"),
                strategies=("linear", "data", "joint"),
                num_batches=args.batches,
                num_redundant=num_redundant,
            )
            rows = [row.to_row() for row in run_compare(data, cfg).summary_rows()]
            ratios = {r["strategy"]: round(r["inter_node_normalized_median"], 3) for r in rows}
            print(
                json.dumps(
                    {
                        "zipf_exponent": zipf,
                        "redundancy": num_redundant,
                        "top_share_mean": round(float(np.mean(list(stats["top_share"].values()))), 3),
                        "imbalance_p90_mean": round(float(np.mean([v["p90"] for v in stats["imbalance"].values()])), 1),
                        **ratios,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
