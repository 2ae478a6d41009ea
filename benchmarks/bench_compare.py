"""Benchmark: ``moetrace compare`` at the DeepSeek-V3 shape, this checkout against a baseline checkout.

Builds (once, into ``--workdir``) or takes (``--trace``) a DeepSeek-V3 synth trace of ``--requests``
requests (``moetrace synth --model deepseek-v3 --datasets gsm8k,math,mbpp,humaneval --seed 0``), then
runs ``moetrace compare TRACE --config DP8TP8EP64`` (the README's deployment, every default: six
strategies, both bounds, 500 decode batches, prefill steps) in a fresh child process per run, and
reports wall time and CPU time (user + system of the child and its threads) per side: medians and
minima, with the load average before and after each run.

With ``--baseline DIR`` (a whole checkout made before the change, e.g. ``git archive HEAD | tar -x -C
/tmp/sim_before``, put first on the child's ``PYTHONPATH`` and used as its working directory) the two
sides alternate for ``--reps`` repetitions each (this checkout first on even repetitions, the baseline
first on odd ones), after one untimed warm-up run per side (numba's on-disk cache), and every result
file of the two sides is compared: the Parquet files as decoded tables, ``compare.json`` as JSON with
the fields that name the run's own folder or time left out (``IGNORED_JSON_FIELDS``; none do today,
the list is explicit so that a new one shows up as a difference).

    .venv/bin/python benchmarks/bench_compare.py --baseline /tmp/sim_before --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATASETS = "gsm8k,math,mbpp,humaneval"
DEPLOYMENT = "DP8TP8EP64"
#: compare.json fields that may differ between two runs of the same inputs (paths of the run, times)
IGNORED_JSON_FIELDS: tuple[str, ...] = ()


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def make_trace(workdir: Path, requests: int) -> Path:
    """The synth trace (built once; reused when it exists)."""
    trace = workdir / f"synth-dsv3-{requests}"
    if not (trace / "manifest.json").exists():
        cmd = [sys.executable, "-m", "moetrace", "synth", "--model", "deepseek-v3", "--datasets", DATASETS]
        cmd += ["--requests", str(requests), "--seed", "0", "-o", str(trace), "--overwrite", "-q"]
        subprocess.run(cmd, check=True, cwd=ROOT)
    return trace


def run_compare(trace: Path, out: Path, *, tree: Path, batches: int) -> dict[str, float]:
    """One ``moetrace compare`` in a child process with ``tree`` first on its path: wall and CPU seconds."""
    cmd = [sys.executable, "-m", "moetrace", "compare", str(trace), "--config", DEPLOYMENT]
    cmd += ["--batches", str(batches), "-o", str(out), "--overwrite", "-q"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(tree), env.get("PYTHONPATH")) if x)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"compare failed in {tree}:\n{proc.stderr[-4000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "load0": load0, "load1": os.getloadavg()[0]}


def _json_without(doc: object, ignored: tuple[str, ...]) -> object:
    if isinstance(doc, dict):
        return {k: _json_without(v, ignored) for k, v in doc.items() if k not in ignored}
    if isinstance(doc, list):
        return [_json_without(v, ignored) for v in doc]
    return doc


def same_results(a: Path, b: Path) -> dict[str, bool]:
    """Each result file of either side: whether the other holds the same (Parquet: the same decoded
    table, column names, dtypes and values; JSON: the same document but ``IGNORED_JSON_FIELDS``)."""
    import polars as pl

    same = {}
    for name in sorted({f.name for f in a.iterdir()} | {f.name for f in b.iterdir()}):
        fa, fb = a / name, b / name
        if not (fa.exists() and fb.exists()):
            same[name] = False
        elif name.endswith(".parquet"):
            same[name] = pl.read_parquet(fa).equals(pl.read_parquet(fb), null_equal=True)
        elif name.endswith(".json"):
            ja, jb = (_json_without(json.loads(f.read_text()), IGNORED_JSON_FIELDS) for f in (fa, fb))
            same[name] = ja == jb
        else:
            same[name] = fa.read_bytes() == fb.read_bytes()
    return same


def _summary(runs: list[dict[str, float]]) -> str:
    walls, cpus = [r["wall"] for r in runs], [r["cpu"] for r in runs]
    loads = [r["load0"] for r in runs] + [r["load1"] for r in runs]
    return (
        f"wall median {statistics.median(walls):6.1f} s (min {min(walls):6.1f}), "
        f"CPU median {statistics.median(cpus):6.1f} s (min {min(cpus):6.1f}), load {min(loads):.1f}-{max(loads):.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, help="an existing trace (default: build the synth trace in --workdir)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_compare"))
    ap.add_argument("--batches", type=int, default=500)
    ap.add_argument("--baseline", type=Path, help="a checkout to time against (first on PYTHONPATH)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed first run per side")
    args = ap.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    trace = args.trace or make_trace(args.workdir, args.requests)
    sides = {"after": ROOT} | ({"before": args.baseline.resolve()} if args.baseline else {})
    print(f"trace {trace}; compare --config {DEPLOYMENT} --batches {args.batches}; load {_load()}", flush=True)
    if not args.no_warmup:
        for side, tree in sides.items():
            r = run_compare(trace, args.workdir / f"out-{side}", tree=tree, batches=args.batches)
            print(f"  warm-up {side:6s}: wall {r['wall']:6.1f} s, CPU {r['cpu']:6.1f} s (load {_load()})", flush=True)
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    for rep in range(args.reps):
        order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
        for side in order:
            r = run_compare(trace, args.workdir / f"out-{side}", tree=sides[side], batches=args.batches)
            runs[side].append(r)
            print(
                f"  rep {rep} {side:6s}: wall {r['wall']:6.1f} s, CPU {r['cpu']:6.1f} s "
                f"(load {r['load0']:.2f} -> {r['load1']:.2f})",
                flush=True,
            )
    for side in sides:
        print(f"{side:6s}: {_summary(runs[side])}")
    if "before" in sides:
        a, b = (statistics.median(r["wall"] for r in runs[s]) for s in ("after", "before"))
        c, d = (statistics.median(r["cpu"] for r in runs[s]) for s in ("after", "before"))
        print(f"after / before: wall {a / b:.2f}x, CPU {c / d:.2f}x")
        same = same_results(args.workdir / "out-after", args.workdir / "out-before")
        for name, ok in same.items():
            print(f"  {name}: {'identical' if ok else 'DIFFERENT'}")
        if not all(same.values()):
            sys.exit("the two sides' results differ")


if __name__ == "__main__":
    main()
