"""Benchmark: ``moetrace advise`` on a DeepSeek-V3 synth trace, this checkout against a baseline checkout
(advise's step simulation, ``advise.evaluate.evaluate_tokens``, on the fused kernel or not).

Builds (once, into ``--workdir``) or takes (``--trace``) the trace of ``moetrace demo``'s shape
(``moetrace synth --model deepseek-v3 --datasets gsm8k,math,mbpp,humaneval,lmsys-chat,xsum,tldr
--requests 2100 --seed 0``), then runs ``moetrace advise TRACE --config DP8TP8EP64 --seed 0`` (every
default: EPLB over the redundant-slot sweep, 200 decode steps, the prefill steps, ``same_node``
replicas; ``--replica-policy`` picks another rule) in a fresh child process per run, and reports wall
time and CPU time (user + system of the child and its threads) per side: medians and minima, with the
load average before and after each run.

With ``--baseline DIR`` (a whole checkout made before the change, e.g. ``git archive HEAD | tar -x -C
/tmp/adv_before``, put first on the child's ``PYTHONPATH`` and used as its working directory) the two
sides alternate for ``--reps`` repetitions each (this checkout first on even repetitions, the baseline
first on odd ones; ``--tree DIR`` times another checkout as `after`, e.g. the baseline with only the
change's files copied in, where the working tree holds others' edits too), after one untimed warm-up run
per side (numba's on-disk cache). Every run writes to the same folder (``WORKDIR/out``), moved to
``out-<side>`` afterwards, so the paths advice.json names are the same on both sides; then every file of
the two advice folders is compared: the Parquet tables decoded (column names, dtypes, values, nulls
equal), ``advice.json`` and the placement files as JSON with the fields that hold a time left out
(``IGNORED_JSON_FIELDS``; advice.json holds none today, the list is explicit so that a new one shows up
as a difference), anything else byte for byte.

    .venv/bin/python benchmarks/bench_advise_sim.py --trace /tmp/adv_trace --baseline /tmp/adv_before --reps 3
    # only this change, not the working tree's other edits: the baseline plus the change's files
    mkdir -p /tmp/adv_mine && git archive HEAD | tar -x -C /tmp/adv_mine && cp placement/advise_evaluate.py \
        placement/eplb_replicas.py placement/simulate_kernel.py /tmp/adv_mine/placement/
    .venv/bin/python benchmarks/bench_advise_sim.py --trace /tmp/adv_trace --baseline /tmp/adv_before \
        --tree /tmp/adv_mine --reps 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sides import alternate, json_without, load, report, synth_trace, timed_child

ROOT = Path(__file__).resolve().parent.parent
DATASETS = "gsm8k,math,mbpp,humaneval,lmsys-chat,xsum,tldr"
DEPLOYMENT = "DP8TP8EP64"
#: JSON fields that may differ between two runs of the same inputs (times); none today
IGNORED_JSON_FIELDS: tuple[str, ...] = ()


def run_advise(trace: Path, workdir: Path, side: str, *, tree: Path, extra: list[str]) -> dict[str, float]:
    """One ``moetrace advise`` in a child process with ``tree`` first on its path, written to
    ``workdir/out`` and moved to ``workdir/out-<side>``: wall and CPU seconds."""
    out = workdir / "out"
    cmd = [sys.executable, "-m", "moetrace", "advise", str(trace), "--config", DEPLOYMENT, "--seed", "0"]
    cmd += ["-o", str(out), "--overwrite", "-q", *extra]
    proc, timings = timed_child(cmd, tree=tree)
    if proc.returncode != 0:
        sys.exit(f"advise failed in {tree}:\n{proc.stderr[-4000:]}")
    dest = workdir / f"out-{side}"
    shutil.rmtree(dest, ignore_errors=True)
    out.rename(dest)
    return timings


def same_results(a: Path, b: Path) -> dict[str, bool]:
    """Each file of either advice folder (sub-folders included): whether the other holds the same
    (Parquet: the same decoded table; JSON: the same document but ``IGNORED_JSON_FIELDS``; else bytes)."""
    import polars as pl

    names = {p.relative_to(a) for p in a.rglob("*") if p.is_file()} | {
        p.relative_to(b) for p in b.rglob("*") if p.is_file()
    }
    same = {}
    for name in sorted(names, key=str):
        fa, fb = a / name, b / name
        if not (fa.exists() and fb.exists()):
            same[str(name)] = False
        elif fa.suffix == ".parquet":
            same[str(name)] = pl.read_parquet(fa).equals(pl.read_parquet(fb), null_equal=True)
        elif fa.suffix == ".json":
            ja, jb = (json_without(json.loads(f.read_text()), IGNORED_JSON_FIELDS) for f in (fa, fb))
            same[str(name)] = ja == jb
        else:
            same[str(name)] = fa.read_bytes() == fb.read_bytes()
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, help="an existing trace (default: build the synth trace in --workdir)")
    ap.add_argument("--requests", type=int, default=2100)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_advise_sim"))
    ap.add_argument("--baseline", type=Path, help="a checkout to time against (first on PYTHONPATH)")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout timed as `after` (default: this one)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replica-policy", choices=("same_node", "vllm", "sglang"), help="advise's (default: its own)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed first run per side")
    args = ap.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    trace = args.trace or synth_trace(args.workdir, args.requests, datasets=DATASETS, root=ROOT)
    extra = ["--replica-policy", args.replica_policy] if args.replica_policy else []
    sides = {"after": args.tree.resolve()} | ({"before": args.baseline.resolve()} if args.baseline else {})
    print(f"trace {trace}; advise --config {DEPLOYMENT} --seed 0 {' '.join(extra)}; load {load()}", flush=True)

    def run(side: str, tree: Path) -> dict[str, float]:
        return run_advise(trace, args.workdir, side, tree=tree, extra=extra)

    runs = alternate(sides, run, reps=args.reps, warmup=not args.no_warmup)
    outs = (args.workdir / "out-after", args.workdir / "out-before")
    report(runs, lambda: same_results(*outs), differ="the two sides' advice differs")


if __name__ == "__main__":
    main()
