"""Dashboards in a real headless Chromium: loads offline, draws every figure, data equals its sources.

Needs Debian's ``chromium`` (apt) and the ``playwright`` pip package (driven with
``executable_path``; no browser download). Without them the tests skip, unless ``CI=true``, where
they fail: CI must install both.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from browser.checks import check_all
from browser.fixtures import produced
from browser.harness import chromium_path
from moetrace.dashboards.report import write_dashboard

_CI = os.environ.get("CI", "").lower() == "true"


def _need_browser() -> None:
    missing = []
    if chromium_path() is None:
        missing.append("chromium (apt-get install -y chromium)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        missing.append("playwright (pip install playwright)")
    if missing:
        msg = "headless browser tests need " + " and ".join(missing)
        if _CI:
            pytest.fail(msg + "; CI=true, so this is an error")
        pytest.skip(msg)


SECTIONS = ("overview", "imbalance", "correlation", "clusters", "classifiers", "placement")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """One report over a trace and the real ``analyze`` and ``compare`` results on it, loaded once."""
    _need_browser()
    pytest.importorskip("plotly")
    from browser.harness import load_report

    p = produced()
    d = tmp_path_factory.mktemp("dash-browser")
    inputs = [x for x in (p.trace, p.analysis, p.compare) if x is not None]
    rep = write_dashboard(inputs, out=d / "report.html")
    page = load_report(rep.path, screenshot=d / "report.png")
    return rep, page, p


def test_loads_offline_without_errors(loaded):
    rep, page, _ = loaded
    assert page.console_errors == []
    assert page.requests == []  # nothing but the file itself
    assert page.rendered == str(rep.num_figures)


def test_every_section_and_figure_renders(loaded):
    rep, page, p = loaded
    assert not p.missing, p.missing  # every producer ran: every section must be there
    assert tuple(page.sections) == rep.sections == SECTIONS
    assert page.nav == [f"#{s}" for s in rep.sections]
    assert len(page.figures) == rep.num_figures
    for f in page.figures:
        assert f["plotted"], f["key"]
        assert f["num_svg"] >= 1 and f["num_drawn"] >= 1, f["key"]
        assert f["title"], f["key"]
        if f["key"].startswith("clusters-"):
            assert f["num_canvas"] >= 1, f"{f['key']}: WebGL scatter drew no canvas"


def test_screenshot_png(loaded):
    _, page, _ = loaded
    data = page.screenshot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_drawn_data_equals_result_files(loaded):
    """What Chromium holds in every figure equals the analyze/compare files it claims to show."""
    _, page, p = loaded
    figs = {f["key"]: f["data"] for f in page.figures}
    checked = check_all(figs, p)
    drawn = {f["key"] for f in page.figures}
    # every figure except the per-layer normalized line (same file and code path as the share) is checked
    assert drawn - set(checked) <= {"overview-lengths", "correlation-recall", "placement-layers-normalized"}


def test_drawn_overview_data_equals_requests(loaded):
    from moetrace.tracer.trace.reader import open_trace

    _, page, _ = loaded
    (fig,) = [f for f in page.figures if f["key"] == "overview-lengths"]
    trace = open_trace(fig["source"].rsplit("/requests", 1)[0])
    req = trace.requests().collect().sort("request_id")
    drawn = {}
    for t in fig["data"]:
        drawn.setdefault(t["name"], []).append(np.asarray(t["y"]))
    for ds in req["dataset"].unique().to_list():
        sub = req.filter(req["dataset"] == ds)
        np.testing.assert_array_equal(np.sort(drawn[ds][0]), np.sort(sub["prompt_tokens"].to_numpy()))
        np.testing.assert_array_equal(np.sort(drawn[ds][1]), np.sort(sub["output_tokens"].to_numpy()))


def test_figures_reflow_on_window_resize(loaded, tmp_path):
    """Resizing the window (no reload) keeps every figure at its intended height and fits its width
    to the container: 1400x900 -> 900x700 -> 1400x900."""
    from browser.figjson import figures_from_html
    from browser.harness import figure_sizes_across_viewports

    rep, _, _ = loaded
    intended = {k: f["layout"].get("height", 450) for k, f in figures_from_html(rep.path.read_text()).items()}
    steps = figure_sizes_across_viewports(rep.path, [(1400, 900), (900, 700), (1400, 900)])
    # what a user dragging the window edge produces: many resize events in quick succession
    drag = [(1400 - 25 * i, 900) for i in range(1, 21)] + [(900, 700)] + [(900 + 25 * i, 900) for i in range(1, 21)]
    steps += figure_sizes_across_viewports(rep.path, [(1400, 900), *drag], settle_ms=15)[-1:]
    widths = []
    for step in steps:
        assert len(step) == rep.num_figures
        for f in step:
            want = intended[f["key"]]
            assert want > 300, f
            assert abs(f["div_height"] - want) <= 2 and abs(f["svg_height"] - want) <= 2, f
            assert abs(f["svg_width"] - f["parent_width"]) <= 2, f  # follows its container
        widths.append([f["svg_width"] for f in step])
    # narrower window, narrower figures; back to the first size, back to the first widths
    assert all(n < w - 200 for w, n in zip(widths[0], widths[1]))
    np.testing.assert_allclose(widths[2], widths[0], atol=2)
    np.testing.assert_allclose(widths[3], widths[0], atol=2)
