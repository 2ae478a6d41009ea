"""The dashboards' one look: colours, fonts, titles, layer sliders and downsampling.

Every figure in a report goes through :func:`finish` so that titles, fonts, margins and colour
scales agree. Colour choices survive the common forms of colour blindness: Okabe-Ito for
categories (datasets, strategies), viridis/cividis for magnitudes, ColorBrewer RdBu (a diverging
scale safe for red-green deficiency) centred on 0 for correlations.

Shape legend (docs/architecture.md): none; no shape-suffixed names here.

Out of scope: what a figure shows (the ``section_*`` modules), the page around it (``page``).
"""

from __future__ import annotations

from typing import Any, Sequence

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
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True, "showLink": False, "modeBarButtonsToRemove": ["sendDataToCloud"]}


#: category order: Okabe-Ito without black, yellow last (it is faint on white)
_CATEGORY_ORDER = (0, 1, 2, 4, 5, 6, 3)


def category_colour(i: int) -> str:
    """Colour of the i-th category (datasets, strategies), cycling through Okabe-Ito without black."""
    return OKABE_ITO[_CATEGORY_ORDER[i % len(_CATEGORY_ORDER)]]


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
    num_layers: int, *, traces_per_layer: int, layer_labels: Sequence[str], extra_visible: int = 0, prefix: str = "layer "
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


def dropdown(labels: Sequence[str], visible: Sequence[Sequence[bool]], *, prefix: str) -> list[dict[str, Any]]:
    """Plotly ``updatemenus``: a dropdown whose i-th entry shows the traces flagged in ``visible[i]``."""
    return [
        {
            "type": "dropdown",
            "direction": "down",
            "active": 0,
            "x": 1.0,
            "xanchor": "right",
            "y": 1.12,
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
