"""Benchmark: the full ``moetrace analyze`` on a 10k-request DeepSeek-V3-shape synthetic trace.

Generates the trace once (``bench_counts.make_trace``: 58 MoE layers, 256 experts, top-8, four
datasets, ~160 prompt + ~80 output tokens per request) into --workdir, then runs
``moetrace analyze`` in a child process and reports its wall time, per-step timings (from the
results manifest) and peak resident memory (the child's ru_maxrss).

    .venv/bin/python benchmarks/bench_analyze.py --requests 10000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_counts import make_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moetrace-bench"))
    ap.add_argument("--only", default=None, help="passed to moetrace analyze --only")
    args = ap.parse_args()

    trace = args.workdir / f"analyze-{args.model}-{args.requests}"
    if not (trace / "manifest.json").exists():
        t0 = time.perf_counter()
        make_trace(trace, num_requests=args.requests, model=args.model)
        print(f"generated {trace} in {time.perf_counter() - t0:.1f} s")
    out = args.workdir / f"results-{args.model}-{args.requests}"
    cmd = [sys.executable, "-m", "moetrace", "analyze", str(trace), "-o", str(out), "--overwrite"]
    if args.only:
        cmd += ["--only", args.only]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(proc.stderr)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
    man = json.loads((out / "manifest.json").read_text())
    tot = json.loads((out / "summary.json").read_text())
    print(proc.stdout)
    print(f"requests {tot.get('num_requests')}, wall {wall:.1f} s (incl. interpreter start), peak RSS {peak:.2f} GiB")
    print("steps (s):", man["timings_s"])


if __name__ == "__main__":
    main()
