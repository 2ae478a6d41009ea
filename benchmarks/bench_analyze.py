"""Benchmark: the full ``moetrace analyze`` on a DeepSeek-V3-shape synthetic trace, optionally against a baseline.

Generates the trace once (``bench_counts.make_trace``: 58 MoE layers, 256 experts, top-8, four
datasets, ~160 prompt + ~80 output tokens per request) into --workdir, then runs
``moetrace analyze`` in a child process and reports its wall time, CPU time (user + system of the
child and its threads), per-step timings (from the results manifest) and peak resident memory (the
child's ru_maxrss).

With ``--baseline DIR`` (a whole checkout, e.g. ``git archive HEAD | tar -x -C /tmp/head``, put first on
the child's ``PYTHONPATH``) the two sides alternate for ``--reps`` repetitions each (this checkout
first on even repetitions, the baseline first on odd ones), medians are reported, with the load
average before and after, and every result file of the two sides is compared byte for byte
(Parquet files by their decoded tables; the embedding's maps are expected to differ where the
t-SNE method changed).

    .venv/bin/python benchmarks/bench_analyze.py --requests 1000 [--baseline /tmp/head --reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_counts import make_trace


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _run(trace: Path, out: Path, *, pythonpath: str | None, only: str | None) -> dict:
    """One ``moetrace analyze`` in a child process: wall, CPU and peak RSS of that child."""
    cmd = [sys.executable, "-m", "moetrace", "analyze", str(trace), "-o", str(out), "--overwrite", "-q"]
    if only:
        cmd += ["--only", only]
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (pythonpath, env.get("PYTHONPATH")) if x)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # cwd: the baseline's checkout (or this one), so `-m moetrace` imports that side's package
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=pythonpath or None)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(proc.stderr)
    man = json.loads((out / "manifest.json").read_text())
    return {
        "wall": wall,
        "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "peak_gib": after.ru_maxrss / 2**20,  # the largest child so far (KiB -> GiB)
        "steps": man["timings_s"],
        "stdout": proc.stdout,
    }


def _same_results(a: Path, b: Path) -> dict[str, bool]:
    """Each result file of ``a``: whether ``b`` holds the same (Parquet: the same decoded table)."""
    import polars as pl

    same = {}
    for f in sorted(a.iterdir()):
        if f.suffix == ".parquet":
            same[f.name] = (b / f.name).exists() and pl.read_parquet(f).equals(pl.read_parquet(b / f.name))
        elif f.name not in ("manifest.json", "summary.json"):  # both hold timings and dates
            same[f.name] = (b / f.name).exists() and f.read_bytes() == (b / f.name).read_bytes()
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moetrace-bench"))
    ap.add_argument("--only", default=None, help="passed to moetrace analyze --only")
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout to measure as `before`")
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()

    trace = args.workdir / f"analyze-{args.model}-{args.requests}"
    if not (trace / "manifest.json").exists():
        t0 = time.perf_counter()
        make_trace(trace, num_requests=args.requests, model=args.model)
        print(f"generated {trace} in {time.perf_counter() - t0:.1f} s")
    here = str(Path(__file__).resolve().parent.parent)
    sides = [("after", here)] + ([("before", str(args.baseline.resolve()))] if args.baseline else [])
    runs: dict[str, list[dict]] = {name: [] for name, _ in sides}
    for _, root in sides:  # numba's on-disk kernel cache of each side filled before anything is timed
        warm = args.workdir / f"results-{args.model}-{args.requests}-warmup"
        _run(trace, warm, pythonpath=root, only="imbalance,embedding,affinity")
    loads = [_load()]
    for rep in range(args.reps):
        for name, root in sides if rep % 2 == 0 else sides[::-1]:
            out = args.workdir / f"results-{args.model}-{args.requests}-{name}"
            runs[name].append(_run(trace, out, pythonpath=root, only=args.only))
            loads.append(_load())
    print(
        f"{args.requests} requests, {args.reps} rep(s) per side, load average (1, 5, 15 min) before and after each run:"
    )
    print("  " + " | ".join(loads))
    for name, _ in sides:
        rs = runs[name]
        walls = sorted(r["wall"] for r in rs)
        cpus = sorted(r["cpu"] for r in rs)
        mid = len(rs) // 2
        steps = {k: round(sorted(r["steps"][k] for r in rs)[mid], 2) for k in rs[0]["steps"]}
        print(
            f"  {name:<7} wall median {walls[mid]:6.1f} s (min {walls[0]:.1f}), CPU median {cpus[mid]:6.1f} s "
            f"(min {cpus[0]:.1f}), peak RSS {max(r['peak_gib'] for r in rs):.2f} GiB; steps (median s): {steps}"
        )
    if args.baseline:
        a = args.workdir / f"results-{args.model}-{args.requests}-after"
        b = args.workdir / f"results-{args.model}-{args.requests}-before"
        same = _same_results(a, b)
        print("  identical results:", ", ".join(n for n, s in same.items() if s) or "none")
        print("  differing results:", ", ".join(n for n, s in same.items() if not s) or "none")
    else:
        print(runs["after"][0]["stdout"])


if __name__ == "__main__":
    main()
