"""Benchmark: how `validate`, `analyze`, `compare` and `place` scale with the trace (issue 27).

For each request count, the README's DeepSeek-V3 synth trace (`moetrace synth --model deepseek-v3
--datasets gsm8k,math,mbpp,humaneval,lmsys-chat,xsum,tldr --requests N --seed 0`) is generated
into --workdir when missing; then each command runs once in a child process under
`/usr/bin/time -v`, with this checkout or an older one (--checkout, e.g. a `git archive` of the
commit before), and one markdown row per (command, trace) is printed: requests, tokens, wall
seconds, peak RSS. Traces of 100,000 requests take about 20 GB: pass --delete-traces to remove
each trace after its rows.

    .venv/bin/python benchmarks/bench_scale.py --requests 10000,100000 --commands validate,analyze,compare,place
    .venv/bin/python benchmarks/bench_scale.py --requests 10000 --commands analyze --checkout /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATASETS = "gsm8k,math,mbpp,humaneval,lmsys-chat,xsum,tldr"
#: each command's arguments after the trace; OUT is replaced by a fresh output path
COMMANDS: dict[str, list[str]] = {
    "validate": [],
    "analyze": ["-o", "OUT"],
    "compare": ["--config", "DP8TP8EP64", "--strategies", "linear,eplb,data,joint", "-o", "OUT"],
    "place": ["--config", "DP8TP8EP64", "--strategy", "joint", "-o", "OUT.json"],
}


def timed(cmd: list[str], *, checkout: Path) -> tuple[float, float, int]:
    """(wall s, peak RSS MiB, exit status) of ``cmd`` under /usr/bin/time -v, importing ``checkout``."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], env=env, cwd=checkout, capture_output=True, text=True)
    err = proc.stderr
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", err).group(1)) / 1024  # type: ignore[union-attr]
    wall_text = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", err).group(1)  # type: ignore[union-attr]
    wall = 0.0
    for part in wall_text.split(":"):
        wall = wall * 60 + float(part)
    if proc.returncode != 0:
        print(err[-2000:], file=sys.stderr)
    return wall, rss, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="10000", help="comma-separated request counts")
    ap.add_argument("--commands", default="validate,analyze,compare,place")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moetrace-scale"))
    ap.add_argument("--checkout", type=Path, default=ROOT, help="the moetrace checkout to run (default this one)")
    ap.add_argument("--trace", type=Path, default=None, help="an existing trace instead of synthesizing one")
    ap.add_argument("--delete-traces", action="store_true", help="remove each generated trace after its rows")
    args = ap.parse_args()
    py = sys.executable
    args.workdir.mkdir(parents=True, exist_ok=True)
    print("| command | requests | tokens | wall | peak RSS |")
    print("|---|---|---|---|---|")
    for n in [int(x) for x in args.requests.split(",")]:
        trace = args.trace or args.workdir / f"synth-dsv3-{n}"
        made = False
        if not (trace / "manifest.json").exists():
            wall, rss, rc = timed(
                [py, "-m", "moetrace", "synth", "--model", "deepseek-v3", "--datasets", DATASETS]
                + ["--requests", str(n), "--seed", "0", "-o", str(trace), "-q"],
                checkout=args.checkout,
            )
            made = rc == 0
            print(f"| synth | {n:,} | | {wall:.0f} s | {rss:,.0f} MiB |", flush=True)
        totals = json.loads((trace / "manifest.json").read_text())["totals"]
        for name in args.commands.split(","):
            with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
                rest = [a.replace("OUT", str(Path(tmp) / "out")) for a in COMMANDS[name]]
                wall, rss, rc = timed([py, "-m", "moetrace", name, str(trace), *rest, "-q"], checkout=args.checkout)
            status = "" if rc == 0 else f" (exit {rc})"
            print(
                f"| {name} | {totals['num_requests']:,} | {totals['num_tokens']:,} | {wall:.1f} s{status} | {rss:,.0f} MiB |",
                flush=True,
            )
        if made and args.delete_traces:
            shutil.rmtree(trace)


if __name__ == "__main__":
    main()
