"""Make the report screenshots of docs/dashboards.md from the command line (what the test takes).

The screenshots are taken by ``tests/test_docs_screenshots.py`` (slow tier), which checks that each
PNG has its window's width and shows the summary card, the advice and the placement tables; both
run ``tests/browser/shots.py``: a small synthetic trace (``moetrace synth``: OLMoE's 16 layers × 64
experts, 4 datasets, 240 requests), its ``analyze``, ``compare``, ``advise`` and ``a2a`` results
(a gloo replay of 8 local ranks, links not emulated) and ``moetrace dashboard``, run as the commands
a user would type in a temporary directory, then the report loaded in the browser tests' headless
Chromium (``tests/browser/harness.py``: Debian's ``chromium`` through the ``playwright`` package).

::

    MOETRACE_SCREENSHOTS_OUT=docs/img .venv/bin/python -m pytest -m slow tests/test_docs_screenshots.py
    .venv/bin/python docs/img/make_screenshots.py            # the same PNGs into docs/img/, unchecked
    .venv/bin/python docs/img/make_screenshots.py --keep work # also keeps trace, results and report.html in work/
    .venv/bin/python docs/img/make_screenshots.py --report work/report.html  # only the screenshots, again

Takes about three minutes on two cores (``analyze`` is most of it). The numbers on the page are
fixed by the seeds but the replay's times; the pixels depend on the fonts installed. ``--max-kb``
is checked: docs images stay small.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))

from browser.harness import chromium_path  # noqa: E402
from browser.shots import HEIGHT, make_report, shoot, too_big  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, default=HERE, help="where the PNGs go (default: docs/img)")
    ap.add_argument("--widths", default="1400,800", help="window widths, px")
    ap.add_argument("--height", type=int, default=HEIGHT, help="window height, px: the part of the page shown")
    ap.add_argument("--keep", type=Path, default=None, help="keep the trace, results and report here")
    ap.add_argument("--max-kb", type=int, default=200, help="fail when a PNG is larger than this, kB (1000 bytes)")
    ap.add_argument(
        "--report", type=Path, default=None, help="screenshot this report.html, made before (no commands run)"
    )
    args = ap.parse_args()
    if chromium_path() is None:
        sys.exit("needs chromium (apt-get install -y chromium) and the playwright package")
    work = Path(tempfile.mkdtemp(prefix="moetrace-shots-")) if args.keep is None else args.keep.resolve()
    try:
        report = args.report.resolve() if args.report is not None else make_report(work)
        widths = [int(x) for x in args.widths.split(",")]
        shots = shoot(report, args.out, widths=widths, height=args.height)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    for s in shots:
        print(f"wrote {s.path} ({s.path.stat().st_size / 1000:.0f} kB)")
    if over := too_big(shots, args.max_kb):
        sys.exit(f"over --max-kb {args.max_kb}: {', '.join(over)}")


if __name__ == "__main__":
    main()
