"""Make the report screenshots of docs/dashboards.md: the first screen of a report at two window widths.

From a small synthetic trace (``moetrace synth``: OLMoE's 16 layers × 64 experts, 4 datasets, 240
requests), its ``moetrace analyze`` and ``moetrace compare`` results and ``moetrace dashboard``,
all run as the commands a user would type, in a temporary directory (so the page names short
relative paths). The report is then loaded in the same headless Chromium the browser tests drive
(``tests/browser/harness.py``: Debian's ``chromium`` through the ``playwright`` package) and its
first ``--height`` px are saved at each ``--widths`` as ``report-<width>.png``, and two figures
alone (the expert-load heatmap, a correlation matrix) at the first width::

    .venv/bin/python docs/img/make_screenshots.py            # writes docs/img/report-1400.png, report-800.png,
                                                             # report-expert-load.png, report-correlation.png
    .venv/bin/python docs/img/make_screenshots.py --keep work # also keeps trace, results and report.html in work/

Takes about two minutes on two cores (``analyze`` is most of it). The numbers on the page are fixed
by the seeds; the pixels depend on the fonts installed.

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

from browser.harness import chromium_path, screenshot_figures, screenshot_top  # noqa: E402


def moetrace(*args: str, cwd: Path) -> None:
    """Run one ``moetrace`` command (this interpreter's), quiet, stopping on failure."""
    cmd = [sys.executable, "-m", "moetrace", *args]
    print("$ moetrace " + " ".join(args), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, default=HERE, help="where the PNGs go (default: docs/img)")
    ap.add_argument("--widths", default="1400,800", help="window widths, px")
    ap.add_argument("--height", type=int, default=1000, help="window height, px: the part of the page shown")
    ap.add_argument("--keep", type=Path, default=None, help="keep the trace, results and report here")
    args = ap.parse_args()
    if chromium_path() is None:
        sys.exit("needs chromium (apt-get install -y chromium) and the playwright package")
    work = Path(tempfile.mkdtemp(prefix="moetrace-shots-")) if args.keep is None else args.keep.resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        moetrace("synth", "-m", "olmoe-1b-7b", "--datasets", "gsm8k,mbpp,lmsys-chat,xsum", "-n", "240", "--seed", "0",
                 "-q", "--overwrite", "-o", "traces/synth-olmoe", cwd=work)  # fmt: skip
        moetrace("analyze", "traces/synth-olmoe", "-q", "--overwrite", "-o", "results/olmoe-analysis", cwd=work)
        moetrace("compare", "traces/synth-olmoe", "--config", "DP8TP1EP8", "--gpus-per-node", "4", "--batches", "30",
                 "-q", "--overwrite", "-o", "results/olmoe-compare", cwd=work)  # fmt: skip
        moetrace("dashboard", "traces/synth-olmoe", "results/olmoe-analysis", "results/olmoe-compare", "-q",
                 "-o", "report.html", cwd=work)  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        widths = [int(x) for x in args.widths.split(",")]
        pngs = [screenshot_top(work / "report.html", args.out / f"report-{w}.png", width=w, height=args.height)
                for w in widths]  # fmt: skip
        figures = {
            "imbalance-expert-load": "report-expert-load.png",
            "correlation-datasets-prefill": "report-correlation.png",
        }
        pngs += screenshot_figures(work / "report.html", {k: args.out / v for k, v in figures.items()}, width=widths[0])
        for png in pngs:
            print(f"wrote {png} ({png.stat().st_size / 1024:.0f} KiB)")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
