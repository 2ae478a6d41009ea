"""``moetrace advise`` on the README's 10,000-request DeepSeek-V3 trace at DP8TP8EP64.

Target: under 2 minutes on the 2-core development machine (docs/benchmarks.md). The trace is the
README's synth line; make it first (about 2 minutes, 2 GB):

    moetrace synth --model deepseek-v3 --datasets gsm8k,math,mbpp,humaneval,lmsys-chat,xsum,tldr \\
                   --requests 10000 --seed 0 -o traces/synth

Run: .venv/bin/python benchmarks/bench_advise.py traces/synth [-o /tmp/advice]

Prints the wall and CPU time of each step (counting, joint placement, evaluations), the whole call,
the peak RSS, the load average (the machine is shared) and the verdicts.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from moetrace.placement.advise import AdviseConfig, advise_trace, format_advice, write_advice
from moetrace.placement.deployment import parse_deployment


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--config", default="DP8TP8EP64")
    ap.add_argument("-o", "--out", default="/tmp/bench-advise")
    args = ap.parse_args()
    dep = parse_deployment(args.config)
    cfg = AdviseConfig(deployment=dep)
    marks: dict[str, float] = {}
    t0, c0 = time.perf_counter(), time.process_time()

    def counted(done: int, total: int) -> None:
        if done >= total:
            marks.setdefault("counted", time.perf_counter() - t0)

    def evaluated(done: int, total: int) -> None:
        marks.setdefault("first evaluation", time.perf_counter() - t0)

    advice = advise_trace(args.trace, cfg, progress=evaluated, count_progress=counted)
    write_advice(advice, args.out, deployment=dep)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    text = format_advice(advice, out=args.out)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    for k, v in marks.items():
        print(f"{k:<18} at {v:6.1f} s")
    print(
        f"advise {args.trace} --config {args.config}: wall {wall:.1f} s, CPU {cpu:.1f} s, peak RSS {peak:.2f} GiB, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print("\n".join(line for line in text.splitlines() if not line.startswith("  moetrace")))


if __name__ == "__main__":
    main()
