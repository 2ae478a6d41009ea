"""What starting local ranks costs a ``moetrace a2a`` run: this checkout against a baseline, alternating.

Each repetition runs the CLI as a user does (``python -m moetrace a2a TRACE --config DP4TP2EP8
--gpus-per-node 2 --backend gloo --no-emulate-nodes``: 8 gloo ranks on loopback) once with this
checkout and once with ``--baseline DIR`` first on ``PYTHONPATH`` (a ``git archive`` of an earlier
commit), in a fresh process each. Measured per run: wall seconds and the **machine's CPU seconds**
(user + system of every process, from ``/proc/stat``, Linux): ranks forked from a fork server are its
children, not the command's, so the command's own rusage would miss them. Run it with the machine to
itself; the load average is printed with each row.

The trace (made when ``--trace`` does not exist): ``moetrace synth --model olmoe-1b-7b-tiny
--requests 200``.

    python benchmarks/bench_a2a_start.py --baseline /tmp/before [--reps 3] [--trace /tmp/bench-a2a-start/trace]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

A2A = ["--config", "DP4TP2EP8", "--gpus-per-node", "2", "--strategies", "linear,eplb", "--batches", "4"]
A2A += ["--hidden-size", "1024", "--backend", "gloo", "--no-emulate-nodes", "-q"]


def machine_cpu_seconds() -> float:
    """User + nice + system seconds of every CPU since boot (``/proc/stat``'s first line)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return (int(fields[1]) + int(fields[2]) + int(fields[3])) / os.sysconf("SC_CLK_TCK")


def run(trace: Path, pythonpath: str) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=pythonpath)
    with tempfile.TemporaryDirectory(prefix="bench-a2a-start-") as d:
        cmd = [sys.executable, "-m", "moetrace", "a2a", str(trace.resolve()), *A2A, "-o", str(Path(d) / "out")]
        c0, t0 = machine_cpu_seconds(), time.perf_counter()
        # from the temporary directory: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, cwd=d)
        return time.perf_counter() - t0, machine_cpu_seconds() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--baseline", type=Path, required=True, help="an earlier checkout (git archive COMMIT | tar -x -C DIR)"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trace", type=Path, default=Path("/tmp/bench-a2a-start/trace"))
    args = ap.parse_args()
    if not args.trace.exists():
        synth = ["synth", "--model", "olmoe-1b-7b-tiny", "--requests", "200", "--seed", "0", "-q"]
        subprocess.run([sys.executable, "-m", "moetrace", *synth, "-o", str(args.trace.resolve())], check=True)
    sides = {"this checkout": str(Path(__file__).resolve().parents[1]), "baseline": str(args.baseline.resolve())}
    got: dict[str, list[tuple[float, float]]] = {s: [] for s in sides}
    for rep in range(args.reps):
        for side, path in sides.items():
            wall, cpu = run(args.trace, path)
            got[side].append((wall, cpu))
            print(f"rep {rep} {side}: {wall:.1f} s wall, {cpu:.1f} CPU-s (machine), load {os.getloadavg()[0]:.1f}")
    print("\n| side | median wall s | median machine CPU-s |\n|---|---|---|")
    for side, rows in got.items():
        print(f"| {side} | {statistics.median(w for w, _ in rows):.1f} | {statistics.median(c for _, c in rows):.1f} |")


if __name__ == "__main__":
    main()
