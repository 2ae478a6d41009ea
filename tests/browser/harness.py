"""Open a dashboard in headless Chromium and read back what the page really drew.

Used by ``tests/test_dashboard_browser.py``; also a script for a quick look::

    .venv/bin/python tests/browser/harness.py report.html --screenshot report.png

Chromium is Debian's ``chromium`` package (``/usr/bin/chromium``), driven through the
``playwright`` Python package with ``executable_path`` (no ``playwright install``: nothing is
downloaded). The page is loaded from ``file://``; every request the page makes other than the
report itself is recorded, as are console errors and uncaught exceptions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    from browser.figjson import decode
except ImportError:  # run as a script: tests/browser is the script's own directory
    from figjson import decode

LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# every figure div, with the traces plotly holds for it (``div.data``: every trace, shown or hidden by a
# slider; typed arrays become lists, base64 typed-array specs are decoded in Python by ``figjson.decode``)
_READ_FIGURES_JS = """
() => {
  const plain = (k, v) => (ArrayBuffer.isView(v) ? Array.from(v) : v);
  return Array.from(document.querySelectorAll('div.figure')).map(div => ({
    key: div.dataset.key,
    source: div.dataset.source,
    plotted: div.classList.contains('js-plotly-plot'),
    num_svg: div.querySelectorAll('.main-svg').length,
    num_canvas: div.querySelectorAll('canvas').length,
    num_drawn: div.querySelectorAll('.trace, .hm image, .heatmaplayer image, .gl-container canvas, .boxlayer path').length,
    title: div.layout && div.layout.title ? div.layout.title.text : null,
    annotations: div.layout && div.layout.annotations ? div.layout.annotations.map(a => a.text) : [],
    sliders: div.layout && div.layout.sliders ? div.layout.sliders.map(s => s.steps.map(st => st.label)) : [],
    data: JSON.parse(JSON.stringify(div.data || [], plain)),
  }));
}
"""


def chromium_path() -> str | None:
    """The Chromium binary to drive, or None when it is not installed."""
    for name in (os.environ.get("MOETRACE_CHROMIUM", ""), "chromium", "chromium-browser"):
        if name and (found := shutil.which(name)):
            return found
    return None


@dataclass
class PageLoad:
    """What one load of a report produced."""

    url: str  # the file:// URL loaded
    rendered: str | None  # body data-rendered: number of figures drawn, or "error"
    console_errors: list[str]  # console.error messages and uncaught exceptions
    requests: list[str]  # URLs requested other than the report itself
    figures: list[dict[str, Any]]  # per figure div: key, source, plotted, num_svg, num_canvas, data (decoded), ...
    nav: list[str]  # nav link targets
    sections: list[str]  # section ids
    screenshot: Path | None  # full-page PNG, when asked for


@contextlib.contextmanager
def open_report(
    path: str | os.PathLike, *, width: int = 1400, height: int = 900, timeout_s: float = 90
) -> Iterator[Any]:
    """A playwright page with ``path`` loaded at a ``width`` x ``height`` window and every figure drawn."""
    from playwright.sync_api import sync_playwright

    exe = chromium_path()
    if exe is None:
        raise RuntimeError("chromium is not installed (apt-get install -y chromium)")
    url = Path(path).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="moetrace-chromium-") as profile, sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile, executable_path=exe, headless=True, args=LAUNCH_ARGS, viewport={"width": width, "height": height}
        )
        try:
            page = ctx.new_page()
            page.goto(url, wait_until="load", timeout=timeout_s * 1000)
            page.wait_for_function("() => document.body.dataset.rendered !== undefined", timeout=timeout_s * 1000)
            yield page
        finally:
            ctx.close()


def screenshot_top(path: str | os.PathLike, out: str | os.PathLike, *, width: int, height: int) -> Path:
    """A PNG of the first ``height`` px of the report at a ``width`` px wide window (what a reader sees first)."""
    with open_report(path, width=width, height=height) as page:
        page.screenshot(path=str(out), full_page=False)
    return Path(out)


def screenshot_figures(
    path: str | os.PathLike, shots: dict[str, str | os.PathLike], *, width: int = 1400
) -> list[Path]:
    """PNGs of single figures: ``{figure key: PNG path}``, at a ``width`` px wide window."""
    out = []
    with open_report(path, width=width) as page:
        for key, png in shots.items():
            page.locator(f'div.figure[data-key="{key}"]').screenshot(path=str(png))
            out.append(Path(png))
    return out


# a PNG's size, colours and the share of its pixels not of its most common colour (the background)
_PNG_JS = """
async (src) => {
  const img = new Image();
  img.src = src;
  await img.decode();
  const c = document.createElement('canvas');
  c.width = img.naturalWidth;
  c.height = img.naturalHeight;
  const g = c.getContext('2d');
  g.drawImage(img, 0, 0);
  const d = g.getImageData(0, 0, c.width, c.height).data;
  const counts = new Map();
  for (let i = 0; i < d.length; i += 4) {
    const k = (d[i] << 16) | (d[i + 1] << 8) | d[i + 2];
    counts.set(k, (counts.get(k) || 0) + 1);
  }
  let top = 0;
  for (const v of counts.values()) top = Math.max(top, v);
  return {width: c.width, height: c.height, colors: counts.size, ink: 1 - top / (c.width * c.height)};
}
"""


def png_pixels(pngs: list[str | os.PathLike]) -> list[dict[str, Any]]:
    """Per PNG, decoded by Chromium: ``width``, ``height`` (px), ``colors`` (distinct RGB values) and
    ``ink`` (the share of pixels not of the most common colour: 0 for a blank image)."""
    import base64

    from playwright.sync_api import sync_playwright

    exe = chromium_path()
    if exe is None:
        raise RuntimeError("chromium is not installed (apt-get install -y chromium)")
    with tempfile.TemporaryDirectory(prefix="moetrace-chromium-") as profile, sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=exe, headless=True, args=LAUNCH_ARGS)
        try:
            page = ctx.new_page()
            return [
                page.evaluate(_PNG_JS, "data:image/png;base64," + base64.b64encode(Path(png).read_bytes()).decode())
                for png in pngs
            ]
        finally:
            ctx.close()


# bounding boxes (relative to the figure's div) of the parts of a plotly figure that must not overlap
_PARTS_JS = """
(key) => {
  const div = document.querySelector(`div.figure[data-key="${key}"]`);
  const r0 = div.getBoundingClientRect();
  const boxes = sel => Array.from(div.querySelectorAll(sel)).map(e => {
    const r = e.getBoundingClientRect();
    return [r.left - r0.left, r.top - r0.top, r.right - r0.left, r.bottom - r0.top];
  }).filter(b => b[2] > b[0] && b[3] > b[1]);
  return {
    div: [0, 0, r0.width, r0.height],
    title: boxes('.g-gtitle'), xtitle: boxes('.g-xtitle'), ytitle: boxes('.g-ytitle'),
    xticks: boxes('.xaxislayer-above'), yticks: boxes('.yaxislayer-above'), plot: boxes('.nsewdrag'),
    slider: boxes('.slider-container'), colorbar: boxes('.colorbar'), menus: boxes('.updatemenu-header-group, .updatemenu-button'),
  };
}
"""


def figure_parts(page: Any, key: str) -> dict[str, list[list[float]]]:
    """Bounding boxes ``[left, top, right, bottom]`` (px, relative to the figure's div) of the figure
    ``key``'s title, axis titles, tick labels, plot area, slider, colour bar and menus."""
    return page.evaluate(_PARTS_JS, key)


def load_report(
    path: str | os.PathLike, *, screenshot: str | os.PathLike | None = None, timeout_s: float = 90, width: int = 1400
) -> PageLoad:
    """Load ``path`` in headless Chromium, wait until every figure is drawn, and read the page."""
    from playwright.sync_api import sync_playwright

    exe = chromium_path()
    if exe is None:
        raise RuntimeError("chromium is not installed (apt-get install -y chromium)")
    url = Path(path).resolve().as_uri()
    errors: list[str] = []
    requests: list[str] = []
    with tempfile.TemporaryDirectory(prefix="moetrace-chromium-") as profile, sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile,
            executable_path=exe,
            headless=True,
            args=LAUNCH_ARGS,
            viewport={"width": width, "height": 900},
        )
        try:
            page = ctx.new_page()
            page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
            page.on("request", lambda r: requests.append(r.url) if r.url != url else None)
            page.goto(url, wait_until="load", timeout=timeout_s * 1000)
            page.wait_for_function("() => document.body.dataset.rendered !== undefined", timeout=timeout_s * 1000)
            rendered = page.evaluate("() => document.body.dataset.rendered")
            figures = page.evaluate(_READ_FIGURES_JS)
            for f in figures:
                f["data"] = [decode(t) for t in f["data"]]
            nav = page.evaluate("() => Array.from(document.querySelectorAll('nav a')).map(a => a.getAttribute('href'))")
            sections = page.evaluate("() => Array.from(document.querySelectorAll('section')).map(s => s.id)")
            shot = None
            if screenshot is not None:
                shot = Path(screenshot)
                page.screenshot(path=str(shot), full_page=True)
        finally:
            ctx.close()
    return PageLoad(
        url=url,
        rendered=rendered,
        console_errors=errors,
        requests=requests,
        figures=figures,
        nav=nav,
        sections=sections,
        screenshot=shot,
    )


_SIZES_JS = """
() => Array.from(document.querySelectorAll('div.figure')).map(div => {
  const svg = div.querySelector('.main-svg');
  const r = div.getBoundingClientRect();
  const ps = getComputedStyle(div.parentElement);
  return {
    key: div.dataset.key,
    div_width: r.width,
    div_height: r.height,
    svg_width: svg ? svg.getBoundingClientRect().width : 0,
    svg_height: svg ? svg.getBoundingClientRect().height : 0,
    parent_width: div.parentElement.clientWidth - parseFloat(ps.paddingLeft) - parseFloat(ps.paddingRight),
    max_width: div.style.maxWidth ? parseFloat(div.style.maxWidth) : null,
    intended_height: div.layout ? div.layout.height : null,
  };
})
"""


def figure_sizes_across_viewports(
    path: str | os.PathLike, viewports: list[tuple[int, int]], *, timeout_s: float = 90, settle_ms: int = 600
) -> list[list[dict[str, Any]]]:
    """Load ``path`` at ``viewports[0]``, then resize the window to each viewport in turn (as a user
    dragging the window would: a ``resize`` event, no reload) and read every figure's rendered size
    after each step (``_SIZES_JS``: the div's and its plotly SVG's width and height, the width of the
    figure's container)."""
    (w0, h0), out = viewports[0], []
    with open_report(path, width=w0, height=h0, timeout_s=timeout_s) as page:
        out.append(page.evaluate(_SIZES_JS))
        for w, h in viewports[1:]:
            page.set_viewport_size({"width": w, "height": h})
            page.wait_for_timeout(settle_ms)  # plotly's responsive resize runs after a debounce
            out.append(page.evaluate(_SIZES_JS))
        page.wait_for_timeout(600)  # the last resize settles
        out[-1] = page.evaluate(_SIZES_JS)
    return out


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="Load a moetrace dashboard in headless Chromium and summarize it.")
    ap.add_argument("report")
    ap.add_argument("--screenshot", default=None)
    args = ap.parse_args()
    res = load_report(args.report, screenshot=args.screenshot)
    print(
        json.dumps(
            {
                "rendered": res.rendered,
                "errors": res.console_errors,
                "requests": res.requests,
                "sections": res.sections,
            },
            indent=1,
        )
    )
    for f in res.figures:
        print(
            f["key"],
            "plotted" if f["plotted"] else "NOT PLOTTED",
            f"svg={f['num_svg']} canvas={f['num_canvas']}",
            f"drawn={f['num_drawn']}",
            f"traces={len(f['data'])}",
            f["annotations"],
        )
