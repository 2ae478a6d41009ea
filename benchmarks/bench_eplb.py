"""EPLB on the DeepSeek-V3 shape: 58 layers x 256 experts, 64 redundant (320 slots), 8 nodes x 8 GPUs.

Target: <= 5 ms per call on the 2-core dev machine. Reports the median of repeated calls for the
hierarchical policy (num_groups=8, as DeepSeek-V3's router) and the global one (num_groups=1).

Run: .venv/bin/python benchmarks/bench_eplb.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from moetrace.placement.eplb import rebalance


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    load = np.random.default_rng(0).gamma(0.5, size=(58, 256)) * 1000
    for groups, policy in ((8, "hierarchical"), (1, "global")):
        kw: dict[str, Any] = dict(num_replicas=320, num_groups=groups, num_nodes=8, num_gpus=64)
        rebalance(load, **kw)  # warm-up
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            rebalance(load, **kw)
            times.append(time.perf_counter() - t)
        print(
            f"eplb {policy:<12} 58x256 -> 320 slots, 8 nodes x 8 GPUs: median {np.median(times) * 1e3:.2f} ms, "
            f"min {min(times) * 1e3:.2f} ms over {args.repeats} calls"
        )


if __name__ == "__main__":
    main()
