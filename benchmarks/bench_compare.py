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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sides import alternate, json_without, load, report, synth_trace, timed_child

ROOT = Path(__file__).resolve().parent.parent
DATASETS = "gsm8k,math,mbpp,humaneval"
DEPLOYMENT = "DP8TP8EP64"
#: compare.json fields that may differ between two runs of the same inputs (paths of the run, times)
IGNORED_JSON_FIELDS: tuple[str, ...] = ()


def run_compare(trace: Path, out: Path, *, tree: Path, batches: int) -> dict[str, float]:
    """One ``moetrace compare`` in a child process with ``tree`` first on its path: wall and CPU seconds."""
    cmd = [sys.executable, "-m", "moetrace", "compare", str(trace), "--config", DEPLOYMENT]
    cmd += ["--batches", str(batches), "-o", str(out), "--overwrite", "-q"]
    proc, timings = timed_child(cmd, tree=tree)
    if proc.returncode != 0:
        sys.exit(f"compare failed in {tree}:\n{proc.stderr[-4000:]}")
    return timings


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
            ja, jb = (json_without(json.loads(f.read_text()), IGNORED_JSON_FIELDS) for f in (fa, fb))
            same[name] = ja == jb
        else:
            same[name] = fa.read_bytes() == fb.read_bytes()
    return same


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
    trace = args.trace or synth_trace(args.workdir, args.requests, datasets=DATASETS, root=ROOT)
    sides = {"after": ROOT} | ({"before": args.baseline.resolve()} if args.baseline else {})
    print(f"trace {trace}; compare --config {DEPLOYMENT} --batches {args.batches}; load {load()}", flush=True)

    def run(side: str, tree: Path) -> dict[str, float]:
        return run_compare(trace, args.workdir / f"out-{side}", tree=tree, batches=args.batches)

    runs = alternate(sides, run, reps=args.reps, warmup=not args.no_warmup)
    outs = (args.workdir / "out-after", args.workdir / "out-before")
    report(runs, lambda: same_results(*outs), differ="the two sides' results differ")


if __name__ == "__main__":
    main()
