"""docs/placement.md's evidence table: every shape × structure, strategies and upper bounds, held-out requests.

For each case a ``moetrace synth`` trace is generated (if its directory is missing) with the
model's calibrated preset (``--structure planted``) or the no-structure control (``--structure
none``), then ``run_compare`` places linear, EPLB, the paper's data-based placer and ours (joint) on
80 % of the requests and simulates 500 global batches of held-out requests, with the two upper
bounds (perfect routing, test-set oracle). Printed per case: the median normalized inter-node
volume (dispatch + combine, all layers, / linear's median) and the largest per-GPU token load
(distinct tokens received by the busiest GPU, mean over batches × layers, / linear's), and the
wall time of the comparison.

Run: .venv/bin/python benchmarks/bench_placement_table.py [--root /tmp/pltab] [--cases dsv3,qwen3,small]
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path
from typing import Literal

from moetrace.placement.compare import CompareConfig, load_trace_data, run_compare
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.step_model import DedupUnit
from moetrace.placement.strategies import LABELS
from moetrace.tracer.presets import model_info_for

DATASETS = ("gsm8k", "math", "mbpp", "humaneval", "lmsys-chat", "xsum", "tldr")
#: name -> (model preset, requests, deployment, GPUs per node)
CASES = {
    "dsv3": ("deepseek-v3", 2000, "DP8TP8EP64", 8),
    "qwen3": ("qwen3-235b-a22b", 1200, "DP8TP8EP64", 8),
    "small": ("olmoe-1b-7b", 2000, "DP4TP2EP8", 2),
}
STRATEGIES = ("linear", "eplb", "data", "joint")


def trace_for(root: Path, case: str, structure: Literal["planted", "none"]) -> Path:
    from moetrace.tracer.synth import SynthPlan, default_calibration, load_calibration, synthesize

    model, n, _, _ = CASES[case]
    path = root / f"{case}-{structure}"
    if not path.exists():
        cal = default_calibration(model)
        synthesize(
            path,
            model=model_info_for(model),
            workers=2,
            plan=SynthPlan(
                datasets=DATASETS,
                num_requests=n,
                seed=1,
                knobs=load_calibration(cal),
                calibration=cal,
                structure=structure,
            ),
        )
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=Path("/tmp/pltab"))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--batches", type=int, default=500)
    args = ap.parse_args()
    for case in args.cases.split(","):
        model, n, config, gpn = CASES[case]
        grouped_router = model_info_for(model).n_group is not None
        strategies = (*STRATEGIES, "joint_aligned") if grouped_router else STRATEGIES
        # a group-limited router (DeepSeek-V3) also under per-node copies, where keeping its groups whole pays
        structures: tuple[Literal["planted", "none"], ...] = ("planted", "none")
        dedups: tuple[DedupUnit, ...] = ("rank", "node") if grouped_router else ("rank",)
        for structure, dedup in itertools.product(structures, dedups):
            trace = trace_for(args.root, case, structure)
            cfg = CompareConfig(
                deployment=parse_deployment(config, num_gpus_per_node=gpn),
                strategies=strategies,
                num_batches=args.batches,
                dedup=dedup,
            )
            t0 = time.perf_counter()
            data = load_trace_data(trace, test_fraction=cfg.test_fraction, seed=cfg.seed)
            t1 = time.perf_counter()
            res = run_compare(data, cfg)
            t2 = time.perf_counter()
            rows = [row.to_row() for row in res.summary_rows()]
            lin_load = next(r for r in rows if r["strategy"] == "linear")["tokens_per_rank_max_mean"]
            print(
                f"\n### {model}, {config} ({gpn} GPUs/node), structure {structure}, dedup {dedup}: {n} requests "
                f"({cfg.test_fraction:.0%} held out), {args.batches} batches of {cfg.batch_requests}; "
                f"count {t1 - t0:.1f} s, compare {t2 - t1:.1f} s"
            )
            print(
                "| strategy | inter-node volume / linear (median [p10, p90]) | busiest GPU's tokens / linear | of oracle |"
            )
            print("|---|---|---|---|")
            for r in rows:
                cap = "-" if r["oracle_captured"] is None else f"{r['oracle_captured']:.0%}"
                print(
                    f"| {LABELS.get(r['strategy'], r['strategy'])} | {r['inter_node_normalized_median']:.3f} "
                    f"[{r['inter_node_normalized_p10']:.3f}, {r['inter_node_normalized_p90']:.3f}] | "
                    f"{r['tokens_per_rank_max_mean'] / lin_load:.3f} | {cap} |"
                )


if __name__ == "__main__":
    main()
