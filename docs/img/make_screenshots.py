"""Make the report screenshots of docs/dashboards.md: the first screen, the placement table and single figures.

From a small synthetic trace (``moetrace synth``: OLMoE's 16 layers × 64 experts, 4 datasets, 240
requests), its ``moetrace analyze``, ``compare``, ``advise`` and ``a2a`` results (a gloo replay of 8
local ranks, links not emulated) and ``moetrace dashboard``, all run as the commands a user would
type, in a temporary directory (so the page names short relative paths). The report is then loaded
in the same headless Chromium the browser tests drive (``tests/browser/harness.py``: Debian's
``chromium`` through the ``playwright`` package) and saved as PNGs:

- ``report-<width>.png``: the first ``--height`` px at each ``--widths`` (the summary card and the
  advice);
- ``report-placement-<width>.png``: the placement section's tables at each width;
- ``report-<figure>.png``: single figures at the first width (the expert-load heatmap, a correlation
  matrix, and the per-layer line charts: advice's balancedness, placement's inter-node volume,
  measured collective time).

::

    .venv/bin/python docs/img/make_screenshots.py            # writes the PNGs into docs/img/
    .venv/bin/python docs/img/make_screenshots.py --keep work # also keeps trace, results and report.html in work/
    .venv/bin/python docs/img/make_screenshots.py --report work/report.html  # only the screenshots, again

Takes about three minutes on two cores (``analyze`` is most of it). The numbers on the page are
fixed by the seeds but the replay's times; the pixels depend on the fonts installed. Each PNG is
written with PNG's best compression (``--max-kb`` is checked: docs images stay small).

Out of scope: checking the page (the browser tests do that).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))

from browser.harness import chromium_path, open_report, screenshot_figures, screenshot_top  # noqa: E402

#: single figures shown in docs/dashboards.md: figure key -> PNG name
FIGURES = {
    "imbalance-expert-load": "report-expert-load.png",
    "correlation-datasets-prefill": "report-correlation.png",
    "advice-balancedness-decode": "report-advice-balancedness.png",
    "placement-layers-normalized": "report-placement-layers.png",
    "a2a-time": "report-a2a-time.png",
}


def screenshot_element(report: Path, selector: str, out: Path, *, width: int) -> Path:
    """A PNG of the page's element ``selector`` at a ``width`` px wide window."""
    with open_report(report, width=width, height=1000) as page:
        page.add_style_tag(content="nav { position: static !important; }")  # else it covers a scrolled element
        page.locator(selector).first.screenshot(path=str(out))
    return out


def shrink(png: Path) -> None:
    """Re-encode ``png`` with the best zlib compression and a palette when the image has few colours
    (Pillow, when installed; else left as Chromium wrote it)."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(png) as im:
        rgb = im.convert("RGB")
    small = rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(png, optimize=True)


def moetrace(*args: str, cwd: Path) -> None:
    """Run one ``moetrace`` command (this interpreter's), quiet, stopping on failure."""
    cmd = [sys.executable, "-m", "moetrace", *args]
    print("$ moetrace " + " ".join(args), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def shoot(report: Path, args: argparse.Namespace) -> None:
    """The PNGs of ``report`` into ``args.out``; exits naming those over ``args.max_kb``."""
    args.out.mkdir(parents=True, exist_ok=True)
    widths = [int(x) for x in args.widths.split(",")]
    pngs = [screenshot_top(report, args.out / f"report-{w}.png", width=w, height=args.height) for w in widths]
    pngs += [screenshot_element(report, "section#placement .tables", args.out / f"report-placement-{w}.png",
                                width=w) for w in widths]  # fmt: skip
    pngs += screenshot_figures(report, {k: args.out / v for k, v in FIGURES.items()}, width=widths[0])
    too_big = []
    for png in pngs:
        shrink(png)
        kb = png.stat().st_size / 1000
        print(f"wrote {png} ({kb:.0f} kB)")
        if kb > args.max_kb:
            too_big.append(f"{png.name} ({kb:.0f} kB)")
    if too_big:
        sys.exit(f"over --max-kb {args.max_kb}: {', '.join(too_big)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, default=HERE, help="where the PNGs go (default: docs/img)")
    ap.add_argument("--widths", default="1400,800", help="window widths, px")
    ap.add_argument("--height", type=int, default=860, help="window height, px: the part of the page shown")
    ap.add_argument("--keep", type=Path, default=None, help="keep the trace, results and report here")
    ap.add_argument("--max-kb", type=int, default=200, help="fail when a PNG is larger than this, kB (1000 bytes)")
    ap.add_argument(
        "--report", type=Path, default=None, help="screenshot this report.html, made before (no commands run)"
    )
    args = ap.parse_args()
    if chromium_path() is None:
        sys.exit("needs chromium (apt-get install -y chromium) and the playwright package")
    if args.report is not None:
        shoot(args.report.resolve(), args)
        return
    work = Path(tempfile.mkdtemp(prefix="moetrace-shots-")) if args.keep is None else args.keep.resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        moetrace("synth", "-m", "olmoe-1b-7b", "--datasets", "gsm8k,mbpp,lmsys-chat,xsum", "-n", "240", "--seed", "0",
                 "-q", "--overwrite", "-o", "traces/synth-olmoe", cwd=work)  # fmt: skip
        moetrace("analyze", "traces/synth-olmoe", "-q", "--overwrite", "-o", "results/olmoe-analysis", cwd=work)
        moetrace("compare", "traces/synth-olmoe", "--config", "DP8TP1EP8", "--gpus-per-node", "4", "--batches", "30",
                 "-q", "--overwrite", "-o", "results/olmoe-compare", cwd=work)  # fmt: skip
        moetrace("advise", "traces/synth-olmoe", "--config", "DP8TP1EP8", "--gpus-per-node", "4", "-q", "--overwrite",
                 "-o", "results/olmoe-advice", cwd=work)  # fmt: skip
        moetrace("a2a", "traces/synth-olmoe", "--config", "DP8TP1EP8", "--gpus-per-node", "4", "--strategies",
                 "linear,eplb,joint", "--batches", "2", "--batch-requests", "16", "--hidden-size", "16", "--backend",
                 "gloo", "--no-emulate-nodes", "-q", "--overwrite", "-o", "results/olmoe-a2a", cwd=work)  # fmt: skip
        moetrace("dashboard", "traces/synth-olmoe", "results/olmoe-analysis", "results/olmoe-compare",
                 "results/olmoe-advice", "results/olmoe-a2a", "-q", "--overwrite", "-o", "report.html", cwd=work)  # fmt: skip
        shoot(work / "report.html", args)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
