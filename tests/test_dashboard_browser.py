"""Dashboards in a real headless Chromium: loads offline, draws every figure, data equals its sources.

Needs Debian's ``chromium`` (apt) and the ``playwright`` pip package (driven with
``executable_path``; no browser download). Without chromium the tests skip, unless ``CI=true``, where
they fail: CI must install it. playwright comes with the test set-up: without it they fail.
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
    if missing:
        msg = "headless browser tests need " + " and ".join(missing)
        if _CI:
            pytest.fail(msg + "; CI=true, so this is an error")
        pytest.skip(msg)


#: the decision first: placement, then load, structure, and the trace
SECTIONS = ("placement", "imbalance", "correlation", "clusters", "classifiers", "overview")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """One report over a trace and the real ``analyze`` and ``compare`` results on it, loaded once."""
    _need_browser()
    from browser.harness import load_report

    p = produced()
    d = tmp_path_factory.mktemp("dash-browser")
    rep = write_dashboard([p.trace, p.analysis, p.compare], out=d / "report.html")
    page = load_report(rep.path, screenshot=d / "report.png")
    return rep, page, p


def test_loads_offline_without_errors(loaded):
    rep, page, _ = loaded
    assert page.console_errors == []
    assert page.requests == []  # nothing but the file itself
    assert page.rendered == str(rep.num_figures)


def test_every_section_and_figure_renders(loaded):
    rep, page, p = loaded
    assert tuple(page.sections) == rep.sections == SECTIONS
    assert page.nav == ["#summary", *(f"#{s}" for s in rep.sections)]
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
            fit = min(f["parent_width"], f["max_width"] or np.inf)  # square matrices stop at their own width
            assert abs(f["svg_width"] - fit) <= 2, f  # follows its container
        widths.append([f["svg_width"] for f in step])
    # narrower window, narrower figures (but the square matrices, narrower than either); back to the
    # first size, back to the first widths
    wide = [f["max_width"] is None for f in steps[0]]
    assert sum(wide) >= 10
    assert all(n < w - 200 for w, n, ok in zip(widths[0], widths[1], wide) if ok)
    np.testing.assert_allclose(widths[2], widths[0], atol=2)
    np.testing.assert_allclose(widths[3], widths[0], atol=2)


def test_the_decision_comes_first(loaded):
    """Below the card, the placement section starts the page: its table on the first screens, before
    any load or structure figure; the trace overview comes last."""
    from browser.harness import open_report

    rep, _, _ = loaded
    with open_report(rep.path, width=1400, height=900) as page:
        tops = page.evaluate("""() => Array.from(document.querySelectorAll('main > section')).map(
            s => [s.id, s.getBoundingClientRect().top + window.scrollY])""")
        table_top = page.evaluate("""() => document.querySelector('table[data-key="placement-summary"]')
            .getBoundingClientRect().top + window.scrollY""")
    assert [k for k, _ in tops] == list(SECTIONS)
    assert [y for _, y in tops] == sorted(y for _, y in tops)
    assert table_top < 2 * 900  # the placement table within two screens of the top


def test_placement_table_fits_800_px(loaded):
    """At an 800 px window nothing is cut off: the page does not scroll sideways, the placement tables
    stay inside their section (a wide one scrolls in its own box, its strategy column stays in view),
    and the bounds are a table of their own."""
    from browser.harness import open_report

    rep, _, _ = loaded
    with open_report(rep.path, width=800, height=900) as page:
        got = page.evaluate("""() => {
          const sec = document.getElementById('placement').getBoundingClientRect();
          const boxes = Array.from(document.querySelectorAll('#placement table')).map(t => {
            const box = t.parentElement.getBoundingClientRect();
            const first = t.querySelector('tbody td').getBoundingClientRect();
            return {key: t.dataset.key, left: box.left, right: box.right, first_right: first.right,
                    scroll: t.parentElement.scrollWidth, client: t.parentElement.clientWidth,
                    overflow: getComputedStyle(t.parentElement).overflowX};
          });
          return {page: document.documentElement.scrollWidth, sec_left: sec.left, sec_right: sec.right, boxes};
        }""")
    assert got["page"] <= 800, got
    keys = [b["key"] for b in got["boxes"]]
    assert {"placement-summary", "placement-summary-bounds", "placement-nodes"} <= set(keys)
    for b in got["boxes"]:
        assert got["sec_left"] <= b["left"] and b["right"] <= got["sec_right"], b
        assert b["first_right"] <= b["right"], b  # the strategy (node) column is in view
        assert b["scroll"] <= b["client"] or b["overflow"] == "auto", b  # wider than its box: it scrolls there


# ---------------------------------------------------------------- summary card, layout
def _boxes_overlap(a, b, *, tol: float = 1.0) -> bool:
    return a[0] < b[2] - tol and b[0] < a[2] - tol and a[1] < b[3] - tol and b[1] < a[3] - tol


def test_summary_card_comes_first_with_the_results_numbers(loaded):
    """The card is the first thing in the report's main column, visible without scrolling, and shows
    the headline numbers of the analysis and compare results, each linking to its section."""
    import json

    import polars as pl
    from browser.harness import open_report

    rep, _, p = loaded
    imb = pl.read_parquet(p.analysis / "imbalance.parquet").filter(
        (pl.col("dataset") == "all") & (pl.col("stage") == "prefill")
    )
    mean_if = float(imb["imbalance_factor"].mean())
    # the same number analyze itself reports
    summary = json.loads((p.analysis / "summary.json").read_text())
    assert mean_if == pytest.approx(summary["imbalance"]["mean_if"]["all"]["prefill"])
    worst = imb.sort("imbalance_factor", descending=True).row(0, named=True)
    from moetrace.placement.strategies import STRATEGIES

    placers = [st.name for st in STRATEGIES if st.name != "linear"]  # bound rows (an oracle) are never "best"
    cmp = pl.read_parquet(p.compare / "summary.parquet").filter(pl.col("strategy").is_in(placers))
    timed = "a2a_time_normalized_median" in cmp.columns  # compare wrote predicted time per step
    if timed:  # the fastest strategy within the node-load limit
        row = cmp.filter(~pl.col("over_node_load_limit")).sort("a2a_time_normalized_median").row(0, named=True)
        best = float(row["a2a_time_normalized_median"])
    else:
        best = float(cmp["inter_node_normalized_median"].min())
    with open_report(rep.path) as page:
        card = page.evaluate("""() => {
          const main = document.querySelector('main'), card = document.getElementById('summary');
          const firstSection = document.querySelector('main section');
          return {first: main.firstElementChild.id, top: card.getBoundingClientRect().top,
                  bottom: card.getBoundingClientRect().bottom, section_top: firstSection.getBoundingClientRect().top,
                  text: card.innerText,
                  headlines: Array.from(card.querySelectorAll('.headline')).map(h => ({key: h.dataset.key,
                     value: h.querySelector('.h-value').innerText, label: h.querySelector('.h-label').innerText,
                     detail: h.querySelector('.h-detail').innerText, href: h.querySelector('a').getAttribute('href'),
                     source: h.dataset.source}))};
        }""")
        assert card["first"] == "summary"
        assert card["bottom"] <= card["section_top"] and 0 <= card["top"] < 900  # first, on the first screen
        by = {h["key"]: h for h in card["headlines"]}
        assert list(by) == ["placement", "imbalance"] == list(rep.headlines)  # decision first; no a2a: no a2a headline
        assert by["imbalance"]["value"] == f"{mean_if:.2f}×"
        assert f"worst layer {worst['model_layer']}: {worst['imbalance_factor']:.2f}×" in by["imbalance"]["detail"]
        assert f"median {summary['imbalance']['batch_if']['all']['prefill']:.2f}×" in by["imbalance"]["detail"]
        if timed:
            from moetrace.dashboards.section_placement import STRATEGY_NAMES

            stages = (json.loads((p.compare / "compare.json").read_text()).get("verdict") or {}).get("stages") or {}
            dec = stages.get("decode") or {}
            if dec.get("decision") == "linear" and dec.get("best") not in (None, "linear"):
                # the one rule (placement.decision): under 3 % saved the card says to keep linear, closest named
                assert by["placement"]["value"] == "keep linear"
                assert f"closest: {STRATEGY_NAMES[dec['strategy']]}" in by["placement"]["label"]
            elif best < 1.0:
                assert by["placement"]["value"] == by["placement"]["label"].split(": ", 1)[1].split()[0]
                assert by["placement"]["value"].startswith("−")
                # the fastest row names the card, with the rows tied with it ("joint (ours) = ours")
                names, _, saving = by["placement"]["label"].partition(": ")
                assert STRATEGY_NAMES[row["strategy"]] in names.split(" = ") and saving.startswith("−")
                assert f"node load {row['busiest_node_load']:.2f}" in by["placement"]["label"]
            else:
                assert by["placement"]["value"] == "none"
            assert "predicted all-to-all time" in by["placement"]["label"]
        else:
            assert by["placement"]["value"] == f"{best:.2f}×"
            assert f"{100 * (1 - best):.0f}% fewer inter-node bytes" in by["placement"]["label"]
        assert by["placement"]["source"] == str(p.compare / "summary.parquet")
        for h in by.values():  # each link lands on its section
            page.click(f'#summary a[href="{h["href"]}"]')
            page.wait_for_timeout(100)
            top = page.evaluate(f"() => document.getElementById('{h['href'][1:]}').getBoundingClientRect().top")
            assert 0 <= top < 120, (h["href"], top)


def test_matrices_are_square_and_nothing_overlaps(loaded):
    """Correlation and confusion matrices: a square plot area; title, axis titles, tick labels, plot,
    colour bar and slider never overlap (at a wide and a narrow window)."""
    from browser.harness import figure_parts, open_report

    rep, _, _ = loaded
    keys = ["correlation-datasets-prefill", "correlation-datasets-decode", "classifiers-confusion"]
    for width in (1400, 800):
        with open_report(rep.path, width=width) as page:
            for key in keys:
                parts = figure_parts(page, key)
                (plot,) = parts["plot"]
                assert abs((plot[2] - plot[0]) - (plot[3] - plot[1])) <= 2, (key, width, plot)  # square
                assert plot[2] - plot[0] > 200, (key, width, plot)
                named = [(n, b) for n in ("title", "xtitle", "ytitle", "xticks", "yticks", "plot", "slider", "colorbar")
                         for b in parts[n]]  # fmt: skip
                assert {n for n, _ in named} >= {"title", "xtitle", "xticks", "plot", "slider", "colorbar"}, key
                for i, (n1, b1) in enumerate(named):
                    assert all(0 <= v for v in b1[:2]) and b1[2] <= parts["div"][2] + 1, (key, width, n1, b1)
                    for n2, b2 in named[i + 1 :]:
                        assert not _boxes_overlap(b1, b2), (key, width, n1, b1, n2, b2)
                # the slider sits below the plot, the x-axis title above it
                (slider,) = parts["slider"]
                assert slider[1] >= plot[3] and parts["xtitle"][0][3] <= plot[1], key


def test_expert_load_colour_views_toggle(loaded):
    """The expert-load heatmap opens on the log colour scale; the buttons switch to linear and per-layer
    colours (the exact load stays in the hover data), and the dataset · stage menu still works."""
    import polars as pl
    from browser.harness import figure_parts, open_report

    rep, _, p = loaded
    load = pl.read_parquet(p.analysis / "expert_load.parquet")
    allp = load.filter((pl.col("dataset") == "all") & (pl.col("stage") == "prefill")).sort("model_layer", "expert")
    L, E = allp["model_layer"].n_unique(), allp["expert"].n_unique()
    want = allp["load"].to_numpy().reshape(L, E)
    hi = load["load"].max()
    read = """() => { const d = document.querySelector('div.figure[data-key="imbalance-expert-load"]');
      const t = d._fullData.find(t => t.visible === true);
      return {name: t.name, z: Array.from(t.z, r => Array.from(r)), title: d._fullLayout.coloraxis.colorbar.title.text}; }"""
    with open_report(rep.path) as page:
        first = page.evaluate(read)
        assert first["name"] == "all · prefill" and "log scale" in first["title"]
        page.click('div.figure[data-key="imbalance-expert-load"] g.updatemenu-button:has-text("linear")')
        lin = page.evaluate(read)
        assert lin["title"] == "expert load, × balanced"
        np.testing.assert_allclose(lin["z"], 1 + np.rint(254 * want / hi), atol=1)
        page.click('div.figure[data-key="imbalance-expert-load"] g.updatemenu-button:has-text("per layer")')
        per = page.evaluate(read)
        assert per["title"] == "load / the layer's busiest expert"
        np.testing.assert_allclose(per["z"], 1 + np.rint(254 * want / want.max(axis=1, keepdims=True)), atol=1)
        assert np.all(np.max(per["z"], axis=1) == 255)  # every layer's busiest expert gets the top colour
        assert first["z"] != lin["z"] != per["z"]
        # the menus and the title do not overlap
        parts = figure_parts(page, "imbalance-expert-load")
        for b in parts["menus"]:
            assert not _boxes_overlap(b, parts["title"][0]) and not _boxes_overlap(b, parts["plot"][0])


def test_first_figure_near_the_top_for_a_synthetic_trace(tmp_path):
    """A synthetic trace's long settings table is folded: the first figure starts on the first screen."""
    from browser.harness import open_report
    from typer.testing import CliRunner

    from moetrace.cli import app

    _need_browser()
    trace = tmp_path / "synth"
    r = CliRunner().invoke(app, ["synth", "-m", "mixtral-8x7b", "--datasets", "gsm8k,mbpp,lmsys-chat", "-n", "12",
                                 "--workers", "1", "-q", "-o", str(trace)])  # fmt: skip
    assert r.exit_code == 0, r.output
    rep = write_dashboard([trace], out=tmp_path / "r.html")
    with open_report(rep.path, width=1400, height=900) as page:
        got = page.evaluate("""() => {
          const d = document.querySelector('details[data-key="overview-provenance-details"]');
          return {fig_top: document.querySelector('div.figure').getBoundingClientRect().top + window.scrollY,
                  open: d.open, summary: d.querySelector('summary').innerText,
                  summary_visible: d.querySelector('summary').getBoundingClientRect().height > 0,
                  rows: d.querySelectorAll('tr').length}; }""")
        assert got["fig_top"] < 900, got
        assert not got["open"] and got["summary_visible"] and "Provenance:" in got["summary"] and got["rows"] > 13
        page.click('details[data-key="overview-provenance-details"] summary')  # one click shows the table
        assert page.evaluate("() => document.querySelector('details[data-key=\"overview-provenance-details\"]').open")
        assert (
            page.evaluate("() => document.querySelector('div.figure').getBoundingClientRect().top + window.scrollY")
            > 900
        )
