"""Two sides of a before/after benchmark, timed in turn: this checkout (``after``) against a baseline
checkout (``before``), each run a fresh child process with its checkout first on ``PYTHONPATH``.

Shared by ``bench_compare.py`` and ``bench_advise_sim.py``; each keeps its own arguments, its own run
(``run(side, tree)``, usually over ``timed_child``) and its own comparison of the two sides' results.
A run's timings are a dict: ``wall`` and ``cpu`` in seconds (CPU: user + system of the child and its
threads), ``load0`` and ``load1`` the 1-minute load average before and after it.

    sides = {"after": ROOT} | ({"before": args.baseline.resolve()} if args.baseline else {})
    runs = alternate(sides, lambda side, tree: run_x(..., tree=tree), reps=args.reps, warmup=True)
    report(runs, lambda: same_results(out_after, out_before), differ="the two sides' results differ")
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["alternate", "json_without", "load", "report", "summary", "synth_trace", "timed_child"]


def load() -> str:
    """The 1-, 5- and 15-minute load averages, e.g. ``"0.52 0.61 0.70"``."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def timed_child(cmd: list[str], *, tree: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, float]]:
    """Runs ``cmd`` in ``tree`` with ``tree`` first on ``PYTHONPATH``, output captured: the finished
    process and its timings (``wall``, ``cpu`` in seconds; ``load0``, ``load1`` the load before and after)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(tree), env.get("PYTHONPATH")) if x)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc, {"wall": wall, "cpu": cpu, "load0": load0, "load1": os.getloadavg()[0]}


def alternate(
    sides: dict[str, Path],
    run: Callable[[str, Path], dict[str, float]],
    *,
    reps: int,
    warmup: bool,
) -> dict[str, list[dict[str, float]]]:
    """``run(side, tree)`` for every side: one untimed warm-up run each first (``warmup``), then ``reps``
    repetitions, the sides in their order on even repetitions and reversed on odd ones; prints each run's
    wall and CPU seconds and load. Returns each side's timed runs (seconds, see the module), in order."""
    if warmup:
        for side, tree in sides.items():
            r = run(side, tree)
            print(f"  warm-up {side:6s}: wall {r['wall']:6.1f} s, CPU {r['cpu']:6.1f} s (load {load()})", flush=True)
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    for rep in range(reps):
        order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
        for side in order:
            r = run(side, sides[side])
            runs[side].append(r)
            print(
                f"  rep {rep} {side:6s}: wall {r['wall']:6.1f} s, CPU {r['cpu']:6.1f} s "
                f"(load {r['load0']:.2f} -> {r['load1']:.2f})",
                flush=True,
            )
    return runs


def summary(runs: list[dict[str, float]]) -> str:
    """One side's runs in a line: median and minimum wall and CPU seconds, the range of the load."""
    walls, cpus = [r["wall"] for r in runs], [r["cpu"] for r in runs]
    loads = [r["load0"] for r in runs] + [r["load1"] for r in runs]
    return (
        f"wall median {statistics.median(walls):6.1f} s (min {min(walls):6.1f}), "
        f"CPU median {statistics.median(cpus):6.1f} s (min {min(cpus):6.1f}), load {min(loads):.1f}-{max(loads):.1f}"
    )


def report(
    runs: dict[str, list[dict[str, float]]],
    same_results: Callable[[], dict[str, bool]],
    *,
    differ: str,
) -> None:
    """Prints each side's ``summary``; with a ``before`` side also the after / before ratios of the
    median wall and CPU seconds and, per result file, whether ``same_results()`` found the two sides'
    the same, and exits with ``differ`` when one is not."""
    for side in runs:
        print(f"{side:6s}: {summary(runs[side])}")
    if "before" not in runs:
        return
    a, b = (statistics.median(r["wall"] for r in runs[s]) for s in ("after", "before"))
    c, d = (statistics.median(r["cpu"] for r in runs[s]) for s in ("after", "before"))
    print(f"after / before: wall {a / b:.2f}x, CPU {c / d:.2f}x")
    same = same_results()
    for name, ok in same.items():
        print(f"  {name}: {'identical' if ok else 'DIFFERENT'}")
    if not all(same.values()):
        sys.exit(differ)


def json_without(doc: object, ignored: tuple[str, ...]) -> object:
    """``doc`` (parsed JSON) without the object fields named in ``ignored``, at any depth."""
    if isinstance(doc, dict):
        return {k: json_without(v, ignored) for k, v in doc.items() if k not in ignored}
    if isinstance(doc, list):
        return [json_without(v, ignored) for v in doc]
    return doc


def synth_trace(workdir: Path, requests: int, *, datasets: str, root: Path) -> Path:
    """``moetrace synth --model deepseek-v3 --datasets DATASETS --requests N --seed 0`` into ``workdir``,
    built once (reused when its manifest exists; the folder is named by the request count and datasets)."""
    trace = workdir / f"synth-dsv3-{requests}-{datasets.replace(',', '-')}"
    if not (trace / "manifest.json").exists():
        cmd = [sys.executable, "-m", "moetrace", "synth", "--model", "deepseek-v3", "--datasets", datasets]
        cmd += ["--requests", str(requests), "--seed", "0", "-o", str(trace), "--overwrite", "-q"]
        subprocess.run(cmd, check=True, cwd=root)
    return trace
