"""The screenshots of docs/dashboards.md, taken here: the card, the advice and the placement tables at
1400 and 800 px, and single figures (``tests/browser/shots.py``).

Slow tier (a small trace, its analyze, compare, advise and a2a, a dashboard: minutes). The PNGs go
to a temporary folder, or, with ``MOETRACE_SCREENSHOTS_OUT=docs/img``, into the docs; those the docs
show must be under 200 kB. Each is decoded in Chromium and checked: its window's width, what the page showed
in it (the card on the first screen; the advice's and the placement's tables), not blank.

Needs Debian's ``chromium`` (apt) and the ``playwright`` pip package, as the other browser tests:
without chromium they skip, unless ``CI=true``, where they fail.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest
from browser.harness import chromium_path, figure_parts, open_report, png_pixels
from browser.shots import ELEMENTS, FIGURES, HEIGHT, WIDTHS, Shot, make_report, shoot, too_big

pytestmark = pytest.mark.slow

_CI = os.environ.get("CI", "").lower() == "true"
DOCS = Path(__file__).resolve().parents[1] / "docs"
#: the docs' images: docs images stay small
MAX_KB = 200


def _need_browser() -> None:
    if chromium_path() is None:
        msg = "the screenshot test needs chromium (apt-get install -y chromium)"
        if _CI:
            pytest.fail(msg + "; CI=true, so this is an error")
        pytest.skip(msg)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """The report the screenshots show (``shots.make_report``: the commands a user types)."""
    _need_browser()
    return make_report(tmp_path_factory.mktemp("shots-work"))


@pytest.fixture(scope="module")
def taken(report, tmp_path_factory) -> tuple[list[Shot], dict[Path, dict]]:
    """Every screenshot, and each PNG as Chromium decodes it."""
    to = os.environ.get("MOETRACE_SCREENSHOTS_OUT")
    out = Path(to).resolve() if to else tmp_path_factory.mktemp("img")
    shots = shoot(report, out)
    return shots, dict(zip((s.path for s in shots), png_pixels([s.path for s in shots])))


def _one(shots: list[Shot], what: str, window: int) -> Shot:
    (shot,) = [s for s in shots if s.what == what and s.window == window]
    return shot


def _not_blank(px: dict) -> None:
    assert px["colors"] >= 16 and px["ink"] > 0.02, px  # text and rules on the page's background


@pytest.mark.parametrize("window", WIDTHS)
def test_first_screen_shows_the_card_with_the_decision(taken, window):
    shots, pixels = taken
    shot = _one(shots, "top", window)
    px = pixels[shot.path]
    assert (px["width"], px["height"]) == (window, HEIGHT)
    _not_blank(px)
    assert shot.box is not None
    left, top, right, _ = shot.box
    assert 0 <= left < right <= window and top < HEIGHT / 3, shot.box  # the card starts in the first third
    text = shot.text.lower()
    assert "decision per stage" in text and "best of the compared strategies" in text, shot.text[:300]
    assert "decode" in text and "prefill" in text


@pytest.mark.parametrize("window", WIDTHS)
@pytest.mark.parametrize("name", ELEMENTS)
def test_advice_and_placement_tables_at_each_width(taken, name, window):
    shots, pixels = taken
    shot = _one(shots, name, window)
    px = pixels[shot.path]
    assert shot.box is not None
    left, top, right, bottom = shot.box
    # the PNG is the element's box, within the window (the page never scrolls sideways)
    assert (px["width"], px["height"]) == (math.ceil(right) - math.floor(left), math.ceil(bottom) - math.floor(top))
    assert 0 <= left and right <= window and px["height"] > 150, shot.box
    _not_blank(px)
    if name == "advice":  # each stage's options on its own steps
        assert "prefill placement on prefill steps" in shot.text and "decode placement on decode steps" in shot.text
        assert "MoE-layer time" in shot.text and "linear" in shot.text
    else:
        assert "MoE" in shot.text and "joint" in shot.text and "linear" in shot.text


def test_single_figures(taken):
    shots, pixels = taken
    figs = {s.what: pixels[s.path] for s in shots if s.what in FIGURES}
    assert set(figs) == set(FIGURES)
    for key, px in figs.items():
        assert px["width"] > 300 and px["height"] > 200, key
        _not_blank(px)


@pytest.mark.parametrize("window", WIDTHS)
def test_figure_titles_are_inside_their_figures(report, window):
    """The single figures' titles and axis titles are drawn inside their figure, not clipped at its
    edges (a per-layer chart's long y title once was), at each width."""
    with open_report(report, width=window) as page:
        for key in FIGURES:
            parts = figure_parts(page, key)
            _, _, width, height = parts["div"]
            for part in ("title", "xtitle", "ytitle"):
                for left, top, right, bottom in parts[part]:
                    assert -1 <= left and right <= width + 1 and -1 <= top and bottom <= height + 1, (key, part)


def test_the_docs_show_each_screenshot(taken):
    """docs/dashboards.md shows every PNG taken here, and says it comes from this test."""
    shots, _ = taken
    doc = (DOCS / "dashboards.md").read_text()
    shown = set(re.findall(r"\]\(img/([\w.-]+\.png)\)", doc))
    assert shown == {s.path.name for s in shots}
    assert "tests/test_docs_screenshots.py" in doc and "MOETRACE_SCREENSHOTS_OUT=docs/img" in doc
    assert all((DOCS / "img" / name).is_file() for name in shown)


def test_docs_images_stay_small(taken):
    """Each PNG the docs show is under MAX_KB (those just written too, with MOETRACE_SCREENSHOTS_OUT=docs/img)."""
    shots, _ = taken
    big = [
        f"{p.name} ({p.stat().st_size / 1000:.0f} kB)"
        for p in (DOCS / "img").glob("*.png")
        if p.stat().st_size > MAX_KB * 1000
    ]
    assert big == []
    if os.environ.get("MOETRACE_SCREENSHOTS_OUT"):
        assert too_big(shots, MAX_KB) == []
