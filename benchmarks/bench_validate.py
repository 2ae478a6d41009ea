"""``moetrace validate`` against the read floor: a plain pyarrow read of the same parts, in one run.

Each repetition runs, in fresh child processes, alternating their order:

- ``floor``: ``python -c`` that imports ``pyarrow.parquet`` and reads every routing part
  (``ParquetFile(f).iter_batches(batch_size=65536)``, all columns) and every requests part
  (``read_table``): the anchor, what decoding the parts alone costs;
- ``after``: ``python -m moetrace validate TRACE`` of this checkout;
- ``before`` (with ``--baseline ROOT``): the same command with ROOT first on ``PYTHONPATH``, ROOT a copy of another
  version of the repository (``git archive HEAD~1 | tar -x -C /tmp/head``: its ``moetrace`` package imports instead).

Reported: best and median wall seconds (interpreter start-up included for all three), and each command's best as a
ratio to the floor's best. Validate must also say the trace is valid (exit 0). The children may write bytecode
(``PYTHONDONTWRITEBYTECODE`` is unset for them) and each command runs once before the measurement, so no
repetition compiles moetrace's modules, as none does where moetrace is installed.

    python benchmarks/bench_validate.py TRACE [--baseline /tmp/head] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

FLOOR = """
import sys
from pathlib import Path
import pyarrow.parquet as pq
p = Path(sys.argv[1])
for f in sorted((p / "routing").glob("*.parquet")):
    for b in pq.ParquetFile(f).iter_batches(batch_size=65536):
        pass
for f in sorted((p / "requests").glob("*.parquet")):
    pq.read_table(f)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--baseline", type=Path, help="root of another version of the repository (`before`)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    trace = str(args.trace.resolve())
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cmds = {
        "floor": ([sys.executable, "-c", FLOOR, trace], env),
        "after": ([sys.executable, "-m", "moetrace", "validate", trace], env),
    }
    if args.baseline:
        cmds["before"] = (
            [sys.executable, "-m", "moetrace", "validate", trace],
            {**env, "PYTHONPATH": str(args.baseline)},
        )
    names = list(cmds)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(-1, args.reps):  # -1: the warm-up (bytecode, page cache), not measured
        for n in names if rep % 2 == 0 else names[::-1]:
            cmd, e = cmds[n]
            t0 = time.perf_counter()
            r = subprocess.run(cmd, env=e, cwd="/", capture_output=True, text=True)
            if rep >= 0:
                times[n].append(time.perf_counter() - t0)
            if r.returncode != 0:
                sys.exit(f"{n} failed ({r.returncode}): {r.stdout[-500:]}{r.stderr[-2000:]}")
    size = sum(f.stat().st_size for f in args.trace.rglob("*.parquet"))
    print(f"{trace}: {size / 2**20:.0f} MiB of Parquet, {args.reps} reps, alternating; load {os.getloadavg()}")
    floor = min(times["floor"])
    for n in names:
        best = min(times[n])
        print(
            f"  {n:<6} best {best:6.2f} s  median {statistics.median(times[n]):6.2f} s  "
            f"best / floor {best / floor:5.2f}x   all {', '.join(f'{t:.2f}' for t in times[n])}"
        )


if __name__ == "__main__":
    main()
