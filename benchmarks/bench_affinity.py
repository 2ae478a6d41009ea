"""The cross-layer affinity and co-activation kernel of ``moetrace analyze`` (``analysis.affinity``), before and after.

Reads the routing ids of a trace once into memory (int16 ``[T, L*K]``, at most --tokens tokens), then times
``pair_counts``' kernel on them, alternating this checkout's kernel and the one of another version of
``analysis/affinity.py`` (--baseline, e.g. ``git show HEAD~1:analysis/affinity.py > /tmp/affinity_before.py``),
loaded from its file under another module name, each warmed up (numba compilation) outside the measurement.
Checks that both produce the same four arrays, byte for byte. Reports the best of --reps for each and their
ratio (the anchor: the baseline kernel, measured in the same run).

    python benchmarks/bench_affinity.py TRACE --baseline /tmp/affinity_before.py [--tokens 500000] [--reps 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np


def _load(path: str):
    spec = importlib.util.spec_from_file_location("moetrace_bench_baseline_affinity", path)
    if spec is None or spec.loader is None:
        sys.exit(f"{path}: not a Python module this script can load")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--baseline", required=True, help="path of another analysis/affinity.py (the anchor)")
    ap.add_argument("--tokens", type=int, default=500_000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    from moetrace.analysis import affinity
    from moetrace.tracer.trace.reader import open_trace

    tr = open_trace(args.trace)
    m = tr.model
    L, K, E = m.num_moe_layers, m.top_k, m.num_experts
    parts, n = [], 0
    for ta in tr.iter_token_arrays():
        T = ta.row_T.shape[0]
        parts.append(ta.topk_ids_TLK.reshape(T, L * K)[: args.tokens - n].copy())
        n += parts[-1].shape[0]
        if n >= args.tokens:
            break
    ids_TX = np.ascontiguousarray(np.concatenate(parts))
    T = ids_TX.shape[0]
    keep_T = np.ones(T, bool)
    before = _load(args.baseline)

    def run(mod) -> tuple[float, tuple[np.ndarray, ...]]:
        out = (
            np.zeros((L - 1, E, E), np.int64),
            np.zeros((L, E, E), np.int64),
            np.zeros((L, E), np.int64),
            np.zeros(L, np.int64),
        )
        t0 = time.perf_counter()
        mod._run(ids_TX, keep_T, K, *out)
        return time.perf_counter() - t0, out

    small = ids_TX[:64]
    for mod in (affinity, before):  # numba compilation, outside the measurement
        mod._run(small, keep_T[:64], K, *(np.zeros(s, np.int64) for s in ((L - 1, E, E), (L, E, E), (L, E), (L,))))
    times: dict[str, list[float]] = {"after": [], "before": []}
    outs = {}
    for rep in range(args.reps):
        for name in ("after", "before") if rep % 2 == 0 else ("before", "after"):
            dt, outs[name] = run(affinity if name == "after" else before)
            times[name].append(dt)
    same = all(a.tobytes() == b.tobytes() for a, b in zip(outs["after"], outs["before"], strict=True))
    print(f"{T:,} tokens x {L * K} ids (L={L}, K={K}, E={E}), {args.reps} reps each, alternating")
    for name in ("before", "after"):
        print(f"  {name:<7} best {min(times[name]):7.3f} s   all {', '.join(f'{t:.3f}' for t in times[name])}")
    print(f"  after / before: {min(times['before']) / min(times['after']):.2f}x faster; outputs identical: {same}")
    if not same:
        sys.exit("the kernels disagree")


if __name__ == "__main__":
    main()
