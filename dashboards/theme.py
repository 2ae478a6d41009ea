"""The dashboards' one look: colours, fonts, titles, layer sliders and downsampling.

Every figure in a report goes through :func:`finish` so that titles, fonts, margins and colour
scales agree. Colour choices survive the common forms of colour blindness: Okabe-Ito for
categories (datasets, strategies), viridis/cividis for magnitudes, ColorBrewer RdBu (a diverging
scale safe for red-green deficiency) centred on 0 for correlations.

Shape legend (docs/architecture.md): none; no shape-suffixed names here.

Out of scope: what a figure shows (the ``section_*`` modules), the page around it (``page``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: Okabe & Ito (2008) categorical palette, black last (used for baselines and reference lines)
OKABE_ITO = (
    "#E69F00",  # orange
    "#56B4E9",  # sky blue
    "#009E73",  # bluish green
    "#F0E442",  # yellow
    "#0072B2",  # blue
    "#D55E00",  # vermillion
    "#CC79A7",  # reddish purple
    "#000000",  # black
)
SEQUENTIAL = "Viridis"  # loads, counts, shares
SEQUENTIAL_ALT = "Cividis"  # a second magnitude on the same page (placement maps)
DIVERGING = "RdBu"  # correlations, centred on 0 (reversed so positive is red)
REFERENCE_LINE = "#555555"  # chance levels, balanced load, medians of baselines

FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', sans-serif"

#: shared plotly config: no logo, no link to the cloud editor, PNG export named after the figure
PLOTLY_CONFIG = {
    "displaylogo": False,
    "responsive": True,
    "showLink": False,
    "modeBarButtonsToRemove": ["sendDataToCloud"],
}


#: category order: Okabe-Ito without black, yellow last (it is faint on white)
_CATEGORY_ORDER = (0, 1, 2, 4, 5, 6, 3)
#: after Okabe-Ito's seven: dark colours of Paul Tol's muted scheme, apart from those seven and from the
#: greys of bounds, so the registry's eleven strategies never share a colour (joint was linear's orange)
MORE_CATEGORIES = ("#332288", "#882255", "#999933", "#661100")


def category_colour(i: int) -> str:
    """Colour of the i-th category (datasets, strategies): Okabe-Ito without black, then
    ``MORE_CATEGORIES``, then again from the start."""
    palette = [OKABE_ITO[j] for j in _CATEGORY_ORDER] + list(MORE_CATEGORIES)
    return palette[i % len(palette)]


def category_colours(names: Sequence[str]) -> dict[str, str]:
    """A stable colour per name: sorted names get Okabe-Ito colours in order."""
    return {n: category_colour(i) for i, n in enumerate(sorted(set(names)))}


def title(what: str, *, source: str) -> dict[str, Any]:
    """A figure title: what it shows, and a smaller line naming the trace (and result) it comes from."""
    return {
        "text": f"{what}<br><span style='font-size:12px;color:#555'>{source}</span>",
        "x": 0.0,
        "xref": "paper",
        "xanchor": "left",
        "font": {"size": 16},
    }


def finish(fig: Any, *, what: str, source: str, height: int = 420) -> Any:
    """Apply the report's layout to a plotly ``go.Figure`` in place and return it."""
    fig.update_layout(
        title=title(what, source=source),
        template="simple_white",
        font={"family": FONT, "size": 13, "color": "#222"},
        height=height,
        margin={"l": 70, "r": 30, "t": 80, "b": 60},
        hoverlabel={"font": {"family": FONT}},
        legend={"title": {"font": {"size": 12}}},
        paper_bgcolor="white",
        plot_bgcolor="white",
    )
    return fig


def layer_slider(
    num_layers: int,
    *,
    traces_per_layer: int,
    layer_labels: Sequence[str],
    extra_visible: int = 0,
    prefix: str = "layer ",
) -> list[dict[str, Any]]:
    """Plotly ``sliders`` that show one layer's traces at a time.

    The figure's traces must be ordered layer by layer (``traces_per_layer`` each), followed by
    ``extra_visible`` traces that stay visible on every step (reference lines).
    """
    steps = []
    total = num_layers * traces_per_layer + extra_visible
    for i in range(num_layers):
        visible = [False] * total
        for j in range(traces_per_layer):
            visible[i * traces_per_layer + j] = True
        for j in range(extra_visible):
            visible[num_layers * traces_per_layer + j] = True
        steps.append({"method": "restyle", "args": [{"visible": visible}], "label": str(layer_labels[i])})
    return [
        {
            "active": 0,
            "steps": steps,
            "currentvalue": {"prefix": prefix, "font": {"size": 13}},
            "pad": {"t": 50},
            "len": 1.0,
        }
    ]


def downsample(n: int, *, cap: int, seed: int) -> tuple[np.ndarray, str]:
    """Indices of at most ``cap`` of ``n`` points (uniform without replacement, sorted) and a note.

    The note (empty when nothing was dropped) is meant to be printed on the figure so a reader knows
    the scatter is a sample.
    """
    if n <= cap:
        return np.arange(n), ""
    idx = np.sort(np.random.default_rng(seed).choice(n, size=cap, replace=False))
    return idx, f"showing {cap:,} of {n:,} points (uniform sample, seed {seed}; raise --max-points to show more)"


def note_annotation(text: str) -> dict[str, Any]:
    """A small grey note in the figure's top-right corner (e.g. the downsampling cap)."""
    return {
        "text": text,
        "xref": "paper",
        "yref": "paper",
        "x": 1.0,
        "y": 1.02,
        "xanchor": "right",
        "yanchor": "bottom",
        "showarrow": False,
        "font": {"size": 11, "color": "#444"},
    }


def plotly_go():
    """``plotly.graph_objects``, imported lazily with an install hint when plotly is missing."""
    from moetrace._deps import require

    require("plotly", purpose="writing dashboards")
    import plotly.graph_objects as go

    return go


def dropdown(
    labels: Sequence[str], visible: Sequence[Sequence[bool]], *, prefix: str, y: float = 1.12
) -> list[dict[str, Any]]:
    """Plotly ``updatemenus``: a dropdown whose i-th entry shows the traces flagged in ``visible[i]``
    (its bottom at ``y``, in the plot area's height; 1 = the top of the plot area)."""
    return [
        {
            "type": "dropdown",
            "direction": "down",
            "active": 0,
            "x": 1.0,
            "xanchor": "right",
            "y": y,
            "yanchor": "bottom",
            "showactive": True,
            "buttons": [
                {"label": f"{prefix}{lab}", "method": "restyle", "args": [{"visible": list(vis)}]}
                for lab, vis in zip(labels, visible)
            ],
        }
    ]


def height_for_rows(num_rows: int, *, per_row: int = 14, low: int = 380, high: int = 1100) -> int:
    """Figure height (px) that keeps ``num_rows`` heatmap rows readable."""
    return int(min(max(140 + per_row * num_rows, low), high))


def typed_array(a: np.ndarray) -> dict[str, str]:
    """``a`` as plotly.js's typed-array spec (base64 ``bdata``, ``dtype``, ``shape``).

    Plotly encodes numpy arrays in a trace this way by itself; inside ``updatemenus`` arguments it
    writes nested lists instead, several times larger. plotly.js decodes a spec wherever a data
    array is set, ``Plotly.restyle`` included.
    """
    import base64

    a = np.ascontiguousarray(a)
    if a.dtype.kind not in "iuf" or a.dtype.itemsize > 8 or (a.dtype.kind == "f" and a.dtype.itemsize < 4):
        raise ValueError(f"plotly.js typed arrays hold int8..int32, uint8..uint32, float32, float64; got {a.dtype}")
    return {
        "dtype": a.dtype.str.lstrip("<|="),
        "bdata": base64.b64encode(a.tobytes()).decode("ascii"),
        "shape": ", ".join(str(n) for n in a.shape),
    }


#: heatmap colour levels: 1..LEVELS map a value onto the colour scale; level 0 = no value (NaN)
LEVELS = 255
NO_VALUE_COLOUR = "#e8e8e8"


def level_colorscale(name: str = SEQUENTIAL) -> list[list[Any]]:
    """A plotly colour scale over levels 0..``LEVELS``: level 0 (no value) light grey, 1..LEVELS
    the named scale (``cmin=0, cmax=LEVELS``)."""
    import plotly.colors

    colours = getattr(plotly.colors.sequential, name)
    first = 1 / LEVELS
    out: list[list[Any]] = [[0.0, NO_VALUE_COLOUR], [0.5 / LEVELS, NO_VALUE_COLOUR]]
    out += [[first + (1 - first) * i / (len(colours) - 1), c] for i, c in enumerate(colours)]
    return out


def to_levels(fraction: np.ndarray) -> np.ndarray:
    """Fractions in [0, 1] (clipped) as uint8 colour levels 1..LEVELS; NaN as level 0 (no value)."""
    f = np.asarray(fraction, dtype=np.float64)
    out = np.zeros(f.shape, dtype=np.uint8)
    ok = np.isfinite(f)
    out[ok] = 1 + np.rint((LEVELS - 1) * np.clip(f[ok], 0.0, 1.0)).astype(np.uint8)
    return out


def level_of(fraction: float) -> float:
    """The colour level of one fraction (where a colour-bar tick goes)."""
    return 1 + (LEVELS - 1) * float(np.clip(fraction, 0.0, 1.0))


def nice_linear_ticks(hi: float, *, count: int = 5) -> list[float]:
    """About ``count`` round tick values from 0 to ``hi`` (steps of 1, 2 or 5 times a power of 10)."""
    if not np.isfinite(hi) or hi <= 0:
        return [0.0]
    raw = hi / count
    mag = 10 ** np.floor(np.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [float(v) for v in np.round(np.arange(0, hi + step * 1e-9, step), 10)]


def nice_log_ticks(lo: float, hi: float) -> list[float]:
    """Round tick values between ``lo`` and ``hi`` (> 0) for a log axis: 1-2-5 times powers of 10,
    only the powers of 10 when that gives more than 8, a finer 1-1.5-2-3-5-7 series when 1-2-5 gives
    fewer than 3."""
    if not (np.isfinite(lo) and np.isfinite(hi)) or lo <= 0 or hi <= lo:
        return [float(hi)] if np.isfinite(hi) and hi > 0 else []
    k0, k1 = int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi)))

    def series(ms: tuple[float, ...]) -> list[float]:
        vals = [float(f"{m * 10.0**k:.6g}") for k in range(k0, k1 + 1) for m in ms]
        return [v for v in vals if lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9)]

    ticks = series((1, 2, 5))
    if len(ticks) > 8:
        ticks = series((1,))
    if len(ticks) < 3:
        ticks = series((1, 1.5, 2, 3, 5, 7))
    return ticks


def square_matrix(
    fig: Any,
    names: Sequence[str],
    *,
    x_title: str,
    y_title: str,
    what: str,
    source: str,
    slider: bool,
) -> tuple[int, int]:
    """Lay out a names × names matrix heatmap (correlations, confusion) in place: square cells, the
    column labels and x-axis title on top (a matrix reads like a table), the layer slider alone
    below, margins sized to the labels. Returns the figure's (height, width) in px: give the width
    to the page as the figure's ``max_width`` so a wide window does not stretch the square.
    """
    n = max(len(names), 1)
    longest = max((len(str(v)) for v in names), default=1)
    label_px = 7 * longest + 10  # ~7 px per character at the axis font size
    side = int(min(max(56 * n, 300), 640))  # the square plot area
    rotate = label_px > side / n  # column labels wider than a cell: tilt them
    top_labels = int(label_px * 0.75) + 10 if rotate else 24
    left = label_px + 50  # row labels and axis title
    right = 110  # colour bar
    width = left + side + right
    lines = wrap_words(
        what, max_chars=max((side + right - 10) // 8, 20)
    )  # the title starts above the plot; ~8 px a character
    t = 44 + 20 * len(lines) + top_labels + 30  # figure title (+ its source line), column labels, axis title
    b = 90 if slider else 20  # the slider and its current-value label
    height = t + side + b
    finish(fig, what="<br>".join(lines), source=source, height=height)
    title_at_top(fig, height)
    fig.update_layout(
        margin={"l": left, "r": right, "t": t, "b": b},
        xaxis={
            "title": {"text": x_title, "standoff": 8},
            "type": "category",
            "side": "top",
            "tickangle": -45 if rotate else 0,
            "constrain": "domain",
            "automargin": True,
        },
        yaxis={
            "title": {"text": y_title},
            "type": "category",
            "autorange": "reversed",
            "scaleanchor": "x",
            "scaleratio": 1,
            "constrain": "domain",
            "automargin": True,
        },
    )
    if slider:
        for s in fig.layout.sliders:
            s.update(y=0.0, yanchor="top", pad={"t": 16, "b": 0})
    return height, width


def title_at_top(fig: Any, height: int, *, offset_px: int = 26) -> None:
    """Pin a figure's title near the top of the figure, whatever its top margin (for figures whose
    margin holds more than the title: column labels, buttons). plotly.js anchors a multi-line title
    about 15 px above its ``y``, hence ``offset_px`` 26 for a ~11 px gap."""
    fig.update_layout(title={"y": 1 - offset_px / height, "yref": "container", "yanchor": "top"})


def wrap_words(text: str, *, max_chars: int) -> list[str]:
    """``text`` cut at spaces into lines of at most ``max_chars`` characters (a longer word stays whole)."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= max_chars:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]
