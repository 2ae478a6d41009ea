"""One self-contained HTML page: plotly.js inline, a nav, sections of figures, tables and notes.

The page needs no network: plotly.js (from the installed ``plotly`` package) is embedded once in a
``<script>``, every figure's JSON sits in its own ``<script type="application/json">`` block, and a
small loader draws them with ``Plotly.newPlot`` when the page loads. When every figure is drawn
the loader sets ``document.body.dataset.rendered = "<number of figures>"`` (the browser tests wait
for it); a figure that fails to draw is reported on the page and on the console.

Each figure's ``<div class="figure">`` carries ``data-key`` (stable id, e.g.
``imbalance-if-prefill``) and ``data-source`` (the result file its data was read from), so a reader
and a test can trace every number back to a file.

The page opens with a summary card (``<div id="summary">``, first in ``<main>``) of headline numbers
(``Headline``), each linking to the section it summarizes. Tables longer than ``COLLAPSE_ROWS`` rows
(a synthetic trace's settings, say) are folded into a ``<details>`` element with a one-line summary,
so the first figure stays near the top of the page.

Out of scope: what the figures show (``section_*``), which inputs exist (``inputs``).
"""

from __future__ import annotations

import datetime as _dt
import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from moetrace._deps import require


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One plotly figure of a section."""

    key: str  # stable id within the report, e.g. "imbalance-if-prefill"
    figure: Any  # plotly go.Figure (or a dict with data/layout)
    source: str  # the file its data comes from, shown under the figure
    caption: str = ""  # one or two sentences: how to read it, the exact definition
    max_width: int | None = None  # px; the div is never wider (square matrices keep their aspect)


#: tables with more rows than this are folded into a <details> element (its summary line stays visible)
COLLAPSE_ROWS = 12


@dataclass(frozen=True, kw_only=True)
class Table:
    """A small HTML table (overview facts, per-dataset counts)."""

    key: str  # stable id
    header: tuple[str, ...]  # column names
    rows: tuple[tuple[Any, ...], ...]  # cell values (escaped when written)
    caption: str = ""  # shown above the table
    summary: str = (
        ""  # the line shown while a long table (> COLLAPSE_ROWS rows) is folded; default: header and row count
    )
    nowrap: bool = False  # cells never wrap (a wide table of numbers scrolls sideways instead)


@dataclass(frozen=True, kw_only=True)
class Headline:
    """One headline number of the summary card, computed from one result file."""

    key: str  # stable id, e.g. "imbalance" (``data-key`` on the page)
    title: str  # what is measured, e.g. "Routing imbalance"
    value: str  # the number as shown, e.g. "1.34×"
    label: str  # a short line under the number: whose number it is, e.g. "prefill, mean over 58 layers"
    detail: str  # one sentence: exactly what the number is
    href: str  # the section it summarizes (a section key; the page links to it)
    link: str  # the link's text, e.g. "Load imbalance"
    source: str  # the file the number was read from
    warning: bool = False  # drawn as a warning (measured bytes differ from the prediction)
    note: str = ""  # one more line under the label, drawn as a caution (a faster placement that is not deployable)
    lines: tuple[str, ...] = ()  # one line each under the label (the winner of each simulated stage)


@dataclass(frozen=True, kw_only=True)
class Section:
    """A titled part of the report with its own nav entry."""

    key: str  # anchor id, e.g. "imbalance"
    title: str  # heading and nav label
    intro: str = ""  # a short paragraph under the heading
    tables: tuple[Table, ...] = ()  # shown before the figures
    figures: tuple[Figure, ...] = ()  # drawn in order
    notes: tuple[str, ...] = field(default=())  # e.g. "no classifier results in ..." (shown in grey)
    banner: str = ""  # a warning shown above everything else in the section (random-weight traces)


_CSS = """
:root { --fg:#222; --muted:#555; --rule:#ddd; --accent:#0072B2; }
* { box-sizing: border-box; }
body { margin:0; font-family: system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', sans-serif;
       color:var(--fg); background:#fafafa; line-height:1.45; }
header { background:#fff; border-bottom:1px solid var(--rule); padding:14px 28px; }
header h1 { margin:0 0 2px 0; font-size:22px; }
header .meta { color:var(--muted); font-size:13px; }
nav { position:sticky; top:0; z-index:10; background:#fff; border-bottom:1px solid var(--rule);
      padding:8px 28px; display:flex; flex-wrap:wrap; gap:6px 18px; font-size:14px; }
nav a { color:var(--accent); text-decoration:none; }
nav a:hover { text-decoration:underline; }
main { padding: 8px 28px 40px 28px; max-width: 1400px; }
section { scroll-margin-top: 44px; background:#fff; border:1px solid var(--rule); border-radius:6px; margin:20px 0; padding:8px 20px 16px 20px; }
section h2 { font-size:19px; margin:10px 0 4px 0; }
p.intro { color:var(--muted); font-size:14px; margin:4px 0 10px 0; max-width: 70em; }
.figure { margin: 14px 0 6px 0; width: 100%; min-width: 0; }
.caption { color:var(--muted); font-size:13px; margin: 0 0 14px 0; max-width: 70em; }
.caption code, .source code { font-size:12px; }
.source { color:#777; font-size:12px; }
.tables { display:flex; flex-wrap:wrap; gap: 0 36px; align-items:flex-start; }
.tables > div { min-width: 0; max-width: 100%; overflow-x:auto; }
.tables > details { min-width: 0; max-width: 100%; overflow-x:auto; }
table { border-collapse: collapse; font-size:13px; margin: 8px 0 14px 0; }
th, td { border-bottom:1px solid var(--rule); padding:3px 12px 3px 0; text-align:left; vertical-align:top; }
th { font-weight:600; max-width: 11em; }
table.nowrap td:first-child { white-space: normal; min-width: 7em; }
td:first-child, th:first-child { position: sticky; left: 0; background:#fff; }
table.nowrap td { white-space: nowrap; }
td.num, th.num { text-align:right; font-variant-numeric: tabular-nums; }
.note { color:var(--muted); font-style: italic; font-size:13px; }
.error { color:#D55E00; font-weight:bold; }
.banner { background:#FFF4E0; border-left:5px solid #E69F00; padding:8px 12px; margin:8px 0 12px 0; font-weight:bold; }
footer { color:var(--muted); font-size:12px; padding: 0 28px 30px 28px; }
#summary { scroll-margin-top: 44px; background:#fff; border:1px solid var(--rule); border-left:5px solid var(--accent);
           border-radius:6px; margin:20px 0; padding:8px 20px 14px 20px; }
#summary h2 { font-size:19px; margin:10px 0 8px 0; }
.headlines { display:flex; flex-wrap:wrap; gap:14px 28px; }
.headline { flex: 1 1 260px; max-width: 440px; min-width: 0; }
.headline .h-title { font-size:13px; color:var(--muted); text-transform:uppercase; letter-spacing:.03em; }
.headline .h-value { font-size:30px; font-weight:600; font-variant-numeric: tabular-nums; line-height:1.2; margin:2px 0; }
.headline .h-label { font-size:14px; font-weight:600; }
.headline .h-note { font-size:13px; color:#A34A00; margin: 2px 0 0 0; }
.headline .h-line { font-size:13px; margin: 2px 0 0 0; }
.headline .h-detail { font-size:13px; color:var(--muted); margin: 2px 0 4px 0; }
.headline a { font-size:13px; color:var(--accent); text-decoration:none; }
.headline a:hover { text-decoration:underline; }
.headline.warning .h-value { color:#D55E00; }
.tables > details { flex-basis:100%; margin: 4px 0 10px 0; }
details > summary { cursor:pointer; color:var(--accent); font-size:14px; }
"""

_LOADER = """
(function () {
  var blocks = document.querySelectorAll('script.figure-json');
  var jobs = [];
  blocks.forEach(function (block) {
    var div = document.getElementById(block.dataset.target);
    try {
      var fig = JSON.parse(block.textContent);
      jobs.push(Plotly.newPlot(div, fig.data, fig.layout, fig.config));
    } catch (e) {
      div.innerHTML = '<p class="error">could not draw this figure: ' + e + '</p>';
      console.error('moetrace dashboard: figure ' + block.dataset.target + ': ' + e);
    }
  });
  Promise.all(jobs).then(function () {
    document.body.dataset.rendered = String(jobs.length);
  }, function (e) {
    console.error('moetrace dashboard: ' + e);
    document.body.dataset.rendered = 'error';
  });
})();
"""


def plotlyjs_source() -> tuple[str, str]:
    """The minified plotly.js bundled with the installed ``plotly`` package, and its version."""
    plotly = require("plotly", purpose="writing dashboards")
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs()
    head = js[:200]
    version = head.split("plotly.js v", 1)[1].split()[0] if "plotly.js v" in head else "unknown"
    del plotly
    return js, version


def _figure_json(fig: Any, config: dict[str, Any]) -> str:
    """Plotly's own JSON encoder (numpy arrays become compact typed arrays), made safe for <script>."""
    import plotly.io as pio

    d = fig.to_plotly_json() if hasattr(fig, "to_plotly_json") else dict(fig)
    text = pio.json.to_json_plotly({"data": d.get("data", []), "layout": d.get("layout", {}), "config": config})
    # a literal "</" would end the <script> block early
    return text.replace("</", "<\\/")


DEFAULT_FIGURE_HEIGHT = 450  # plotly's own default layout height


def figure_height(fig: Any) -> int:
    """The height (px) a figure was built for: its ``layout.height``, else plotly's default."""
    layout = fig.to_plotly_json().get("layout", {}) if hasattr(fig, "to_plotly_json") else dict(fig).get("layout", {})
    h = (layout or {}).get("height")
    return int(h) if isinstance(h, (int, float)) and h > 0 else DEFAULT_FIGURE_HEIGHT


def _cell(value: object) -> str:
    if isinstance(value, bool):
        return f"<td>{'yes' if value else 'no'}</td>"
    if isinstance(value, int):
        return f'<td class="num">{value:,}</td>'
    if isinstance(value, float):
        return f'<td class="num">{value:,.4g}</td>'
    return f"<td>{html.escape(str(value))}</td>"


def _table_html(t: Table) -> str:
    parts = []
    if t.caption:
        parts.append(f'<p class="caption">{html.escape(t.caption)}</p>')
    cls = ' class="nowrap"' if t.nowrap else ""
    parts.append(f'<table data-key="{html.escape(t.key)}"{cls}><thead><tr>')
    parts.extend(f"<th>{html.escape(h)}</th>" for h in t.header)
    parts.append("</tr></thead><tbody>")
    for row in t.rows:
        parts.append("<tr>" + "".join(_cell(v) for v in row) + "</tr>")
    parts.append("</tbody></table>")
    body = "".join(parts)
    if len(t.rows) <= COLLAPSE_ROWS:
        return f"<div>{body}</div>"
    line = t.summary or f"{t.header[0]}: {len(t.rows)} rows"
    return f'<details data-key="{html.escape(t.key)}-details"><summary>{html.escape(line)}</summary>{body}</details>'


def _summary_html(headlines: Sequence[Headline]) -> str:
    """The summary card: one block per headline number, each with its explanation and a link."""
    out = ['<div id="summary" role="region" aria-label="Summary"><h2>Summary</h2><div class="headlines">']
    for h in headlines:
        cls = "headline warning" if h.warning else "headline"
        out.append(
            f'<div class="{cls}" data-key="{html.escape(h.key)}" data-source="{html.escape(h.source)}">'
            f'<div class="h-title">{html.escape(h.title)}</div>'
            f'<div class="h-value">{html.escape(h.value)}</div>'
            f'<div class="h-label">{html.escape(h.label)}</div>'
            + (f'<div class="h-note">{html.escape(h.note)}</div>' if h.note else "")
            + "".join(f'<div class="h-line">{html.escape(line)}</div>' for line in h.lines)
            + f'<p class="h-detail">{html.escape(h.detail)}</p>'
            f'<a href="#{html.escape(h.href)}">{html.escape(h.link)} \u2192</a></div>'
        )
    out.append("</div></div>")
    return "".join(out)


def render_page(
    sections: Sequence[Section],
    *,
    title: str,
    subtitle: str,
    footer_notes: Sequence[str] = (),
    headlines: Sequence[Headline] = (),
) -> str:
    """The whole report as one HTML string (plotly.js embedded). ``headlines``: the summary card's
    numbers (no card when empty); each must link to one of ``sections``."""
    from moetrace.dashboards.theme import PLOTLY_CONFIG

    js, js_version = plotlyjs_source()
    keys = [s.key for s in sections]
    if len(set(keys)) != len(keys):
        raise ValueError(f"section keys must be unique, got {keys}")
    fig_keys = [f.key for s in sections for f in s.figures]
    if len(set(fig_keys)) != len(fig_keys):
        dup = sorted({k for k in fig_keys if fig_keys.count(k) > 1})
        raise ValueError(f"figure keys must be unique, duplicates: {dup}")
    dangling = [h.href for h in headlines if h.href not in keys]
    if dangling:
        raise ValueError(f"summary headlines link to sections that are not on the page: {dangling} (sections: {keys})")

    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        # nothing on this page may reach the network
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; script-src 'unsafe-inline' "
        "'unsafe-eval'; style-src 'unsafe-inline'; img-src data: blob:; font-src data:\">",
        f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style>",
        f"<script>{js}</script>",
        "</head><body>",
        f'<header><h1>{html.escape(title)}</h1><div class="meta">{html.escape(subtitle)}</div></header>',
        "<nav>"
        + ('<a href="#summary">Summary</a>' if headlines else "")
        + "".join(f'<a href="#{html.escape(s.key)}">{html.escape(s.title)}</a>' for s in sections)
        + "</nav>",
        "<main>",
    ]
    if headlines:
        out.append(_summary_html(headlines))
    for s in sections:
        out.append(f'<section id="{html.escape(s.key)}"><h2>{html.escape(s.title)}</h2>')
        if s.banner:
            out.append(f'<p class="banner" role="alert">{html.escape(s.banner)}</p>')
        if s.intro:
            out.append(f'<p class="intro">{html.escape(s.intro)}</p>')
        if s.tables:
            out.append('<div class="tables">' + "".join(_table_html(t) for t in s.tables) + "</div>")
        for f in s.figures:
            div_id = f"fig-{f.key}"
            # a definite CSS height (the figure's own): plotly's responsive resize measures the div,
            # and a div sized only by its content collapses to nothing on the first window resize
            style = f"height:{figure_height(f.figure)}px" + (f"; max-width:{f.max_width}px" if f.max_width else "")
            out.append(
                f'<div class="figure" id="{html.escape(div_id)}" data-key="{html.escape(f.key)}" '
                f'data-source="{html.escape(f.source)}" style="{style}"></div>'
            )
            out.append(
                f'<script type="application/json" class="figure-json" data-target="{html.escape(div_id)}">'
                f"{_figure_json(f.figure, PLOTLY_CONFIG)}</script>"
            )
            cap = html.escape(f.caption)
            out.append(
                f'<p class="caption">{cap} <span class="source">Data: <code>{html.escape(f.source)}</code></span></p>'
            )
        out.extend(f'<p class="note">{html.escape(n)}</p>' for n in s.notes)
        out.append("</section>")
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    foot = [f"Written by moetrace on {now} with plotly.js {js_version} embedded (works offline)."]
    foot.extend(footer_notes)
    out.append("</main><footer>" + "<br>".join(html.escape(x) for x in foot) + "</footer>")
    out.append(f"<script>{_LOADER}</script>")
    out.append("</body></html>")
    return "\n".join(out)
