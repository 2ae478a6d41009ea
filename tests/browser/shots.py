"""The screenshots of docs/dashboards.md: a small report made by the commands a user types, then PNGs of it.

``make_report(work)`` runs, in ``work`` (so the page names short relative paths), on a small
synthetic trace (``moetrace synth``: OLMoE's 16 layers x 64 experts, 4 datasets, 240 requests), its
``moetrace analyze``, ``compare``, ``advise`` and ``a2a`` (a gloo replay of 8 local ranks, links not
emulated) and ``moetrace dashboard``. ``shoot(report, out)`` loads the report in the headless
Chromium of the browser tests (``harness``) and saves, at each window width (1400 and 800 px):

- ``report-<width>.png``: the first ``height`` px (the summary card, with the decision per stage);
- ``report-advice-<width>.png``: the advice section's first two tables (each stage's placement on
  its own steps);
- ``report-placement-<width>.png``: the placement section's tables;

and, at the first width, single figures (``FIGURES``). Each ``Shot`` records where on the page its
element was, so a test can check the PNG shows it. ``tests/test_docs_screenshots.py`` takes them
(slow tier); ``docs/img/make_screenshots.py`` is the same from the command line.

Out of scope: checking the page's numbers (``test_dashboard_browser``).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from browser.harness import open_report, screenshot_figures

#: window widths, px
WIDTHS = (1400, 800)
#: the part of the page the first-screen PNG shows, px
HEIGHT = 860

#: single figures shown in docs/dashboards.md: figure key -> PNG name
FIGURES = {
    "imbalance-expert-load": "report-expert-load.png",
    "correlation-datasets-prefill": "report-correlation.png",
    "advice-balancedness-decode": "report-advice-balancedness.png",
    "placement-layers-normalized": "report-placement-layers.png",
    "a2a-time": "report-a2a-time.png",
}

#: parts of the page shot at every width: name -> (CSS selector, how many of its first matches, shot together)
ELEMENTS = {
    "advice": ("section#advice .tables > div", 2),  # prefill options on prefill steps, decode on decode steps
    "placement": ("section#placement .tables", 1),
}

#: the summary card, which the first screen must show
CARD = "#summary"


@dataclass(frozen=True)
class Shot:
    """One PNG and what it shows."""

    path: Path
    what: str  # "top" (the first screen), a name of ELEMENTS, or a figure key of FIGURES
    window: int  # the window's width, px
    box: tuple[float, float, float, float] | None  # page box (left, top, right, bottom) of what it shows, px
    # (the card for "top"; None for figures)
    text: str = ""  # the text of what it shows (the card for "top"), as the page renders it


def moetrace(*args: str, cwd: Path) -> None:
    """Run one ``moetrace`` command (this interpreter's), stopping on failure."""
    print("$ moetrace " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "moetrace", *args], cwd=cwd, check=True)


def make_report(work: Path, *, run: Callable[..., None] = moetrace) -> Path:
    """The report the screenshots show, made in ``work`` by the commands a user types; its path."""
    work.mkdir(parents=True, exist_ok=True)
    deploy = ["--config", "DP8TP1EP8", "--gpus-per-node", "4"]
    run("synth", "-m", "olmoe-1b-7b", "--datasets", "gsm8k,mbpp,lmsys-chat,xsum", "-n", "240", "--seed", "0",
        "-q", "--overwrite", "-o", "traces/synth-olmoe", cwd=work)  # fmt: skip
    run("analyze", "traces/synth-olmoe", "-q", "--overwrite", "-o", "results/olmoe-analysis", cwd=work)
    run("compare", "traces/synth-olmoe", *deploy, "--batches", "30", "-q", "--overwrite",
        "-o", "results/olmoe-compare", cwd=work)  # fmt: skip
    run("advise", "traces/synth-olmoe", *deploy, "-q", "--overwrite", "-o", "results/olmoe-advice", cwd=work)
    run("a2a", "traces/synth-olmoe", *deploy, "--strategies", "linear,eplb,joint", "--batches", "2",
        "--batch-requests", "16", "--hidden-size", "16", "--backend", "gloo", "--no-emulate-nodes", "-q",
        "--overwrite", "-o", "results/olmoe-a2a", cwd=work)  # fmt: skip
    run("dashboard", "traces/synth-olmoe", "results/olmoe-analysis", "results/olmoe-compare",
        "results/olmoe-advice", "results/olmoe-a2a", "-q", "--overwrite", "-o", "report.html", cwd=work)  # fmt: skip
    return work / "report.html"


_BOXES_JS = """
([selector, count]) => Array.from(document.querySelectorAll(selector)).slice(0, count).map(e => {
  const r = e.getBoundingClientRect();
  return {box: [r.left + window.scrollX, r.top + window.scrollY, r.right + window.scrollX, r.bottom + window.scrollY],
          text: e.innerText};
})
"""


def _box(page, selector: str, count: int = 1) -> tuple[tuple[float, float, float, float], str]:
    """The page box (left, top, right, bottom) around the first ``count`` elements of ``selector``, and their text."""
    found = page.evaluate(_BOXES_JS, [selector, count])
    if not found:
        raise LookupError(f"the report has no {selector!r}")
    b = [f["box"] for f in found]
    box = (min(x[0] for x in b), min(x[1] for x in b), max(x[2] for x in b), max(x[3] for x in b))
    return box, "\n".join(f["text"] for f in found)


def shoot(
    report: Path, out: Path, *, widths: Sequence[int] = WIDTHS, height: int = HEIGHT, figures: bool = True
) -> list[Shot]:
    """The PNGs of ``report`` into ``out`` (module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    shots = []
    for w in widths:
        with open_report(report, width=w, height=height) as page:
            top = out / f"report-{w}.png"
            page.screenshot(path=str(top), full_page=False)
            shots.append(Shot(top, "top", w, *_box(page, CARD)))
            page.add_style_tag(content="nav { position: static !important; }")  # else it covers a scrolled element
            for name, (selector, count) in ELEMENTS.items():
                box, text = _box(page, selector, count)
                left, up, right, down = box
                x, y = math.floor(left), math.floor(up)
                clip = {"x": x, "y": y, "width": math.ceil(right) - x, "height": math.ceil(down) - y}
                png = out / f"report-{name}-{w}.png"
                page.screenshot(path=str(png), clip=clip, full_page=True)
                shots.append(Shot(png, name, w, box, text))
    if figures:
        pngs = screenshot_figures(report, {k: out / v for k, v in FIGURES.items()}, width=widths[0])
        shots += [Shot(p, k, widths[0], None) for k, p in zip(FIGURES, pngs)]
    for s in shots:
        shrink(s.path)
    return shots


def shrink(png: Path) -> None:
    """Re-encode ``png`` with the best zlib compression and a palette (Pillow, when installed; else
    left as Chromium wrote it)."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(png) as im:
        rgb = im.convert("RGB")
    small = rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(png, optimize=True)


def too_big(shots: Sequence[Shot], max_kb: float) -> list[str]:
    """``name (N kB)`` of each PNG over ``max_kb`` kB (1000 bytes): docs images stay small."""
    return [
        f"{s.path.name} ({os.path.getsize(s.path) / 1000:.0f} kB)"
        for s in shots
        if os.path.getsize(s.path) > max_kb * 1000
    ]
