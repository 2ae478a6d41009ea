"""Dashboard responsiveness: a large request scatter drawn capped vs uncapped, in one run.

Builds one WebGL scatter of N points in 7 datasets (the clusters figure's code path,
``dashboards.figures.scatter_by_category``), writes it as a self-contained report twice — sampled
down to ``--cap`` points (the default) and with every point — and loads each in headless Chromium
(``/usr/bin/chromium`` via playwright), timing file:// load until every figure is drawn.

    .venv/bin/python benchmarks/bench_dashboard.py --points 200000 --cap 20000 --reps 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def build(points: int, cap: int, out: Path) -> tuple[float, int]:
    from moetrace.dashboards.figures import scatter_by_category
    from moetrace.dashboards.page import Figure, Section, render_page

    rng = np.random.default_rng(0)
    names = np.array(["gsm8k", "math", "mbpp", "humaneval", "lmsys-chat", "xsum", "tldr"])
    cat = rng.integers(0, len(names), points)
    xy = rng.normal(size=(points, 2)) + cat[:, None] * 3.0
    t0 = time.perf_counter()
    fig = scatter_by_category(
        xy[:, 0], xy[:, 1], category_N=names[cat].tolist(), hover_N={"request": np.arange(points), "prompt tokens": rng.integers(1, 4000, points)},
        x_title="t-SNE 1", y_title="t-SNE 2", what="bench scatter", source="synthetic", max_points=cap, seed=0,
    )  # fmt: skip
    page = render_page(
        [Section(key="s", title="s", figures=(Figure(key="f", figure=fig, source="-"),))], title="b", subtitle=""
    )
    out.write_text(page)
    return time.perf_counter() - t0, out.stat().st_size


def load_seconds(path: Path) -> float:
    from browser.harness import LAUNCH_ARGS, chromium_path
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as prof, sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            prof, executable_path=chromium_path(), headless=True, args=LAUNCH_ARGS
        )
        page = ctx.new_page()
        t0 = time.perf_counter()
        page.goto(path.resolve().as_uri(), wait_until="load", timeout=300_000)
        page.wait_for_function("() => document.body.dataset.rendered !== undefined", timeout=300_000)
        dt = time.perf_counter() - t0
        ctx.close()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", type=int, default=200_000)
    ap.add_argument("--cap", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        rows = []
        for label, cap in (("capped", args.cap), ("every point", args.points)):
            path = Path(d) / f"{label.replace(' ', '_')}.html"
            write_s, size = build(args.points, cap, path)
            loads = sorted(load_seconds(path) for _ in range(args.reps))
            rows.append((label, min(cap, args.points), write_s, size, loads[len(loads) // 2]))
    print(f"{'report':<12} {'points':>8} {'write s':>8} {'size MiB':>9} {'load+draw s (median)':>21}")
    for label, n, w, size, load in rows:
        print(f"{label:<12} {n:>8,} {w:>8.2f} {size / 2**20:>9.1f} {load:>21.2f}")
    print(f"uncapped / capped: size x{rows[1][3] / rows[0][3]:.1f}, load+draw x{rows[1][4] / rows[0][4]:.1f}")


if __name__ == "__main__":
    main()
