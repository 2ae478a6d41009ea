"""Figure builders shared by the sections: pure functions from arrays to plotly figures.

Each builder takes arrays with shape suffixes and the labels to print, and returns a
``go.Figure`` already finished with the report's look (``theme.finish``). None reads files.

Shape legend (docs/architecture.md): L MoE layers, Y rows of a heatmap, Z columns of a heatmap, N rows of anything else
(points of a scatter, values of a distribution).

Out of scope: reading results (``section_*``), the page (``page``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from moetrace.dashboards.theme import (
    REFERENCE_LINE,
    SEQUENTIAL,
    category_colours,
    downsample,
    finish,
    layer_slider,
    note_annotation,
    plotly_go,
    square_matrix,
)


def _reference_lines(fig: Any, reference: dict[str, float] | None, *, label_above: bool = False) -> None:
    """A dotted horizontal line, labelled with its value, per named reference level. ``label_above``:
    the labels sit in one row above the plot area, never on the data (line charts, whose lines
    cross the reference); else at the line's left end."""
    for name, value in (reference or {}).items():
        label: dict[str, Any] = {
            "annotation": {"text": f"{name} ({value:.3g})", "font": {"size": 11, "color": REFERENCE_LINE}},
            "annotation_position": "top left",
        }
        fig.add_hline(
            y=value, line={"color": REFERENCE_LINE, "dash": "dot", "width": 1.5}, **({} if label_above else label)
        )
    if label_above and reference:
        fig.add_annotation(
            text="dotted: " + ", ".join(f"{name} ({value:.3g})" for name, value in reference.items()),
            xref="paper", yref="paper", x=0, y=1.0, xanchor="left", yanchor="bottom", yshift=4, showarrow=False,
            font={"size": 11, "color": REFERENCE_LINE},
        )  # fmt: skip


def same_series(series: dict[str, np.ndarray], order: Sequence[str]) -> dict[str, str]:
    """Series equal, value for value (NaN where the other is NaN), to one drawn before them in ``order``:
    {series: the first one it equals}. Drawn one on the other, the later would hide the first."""
    out: dict[str, str] = {}
    for i, name in enumerate(order):
        a = np.asarray(series[name], dtype=np.float64)
        for other in order[:i]:
            b = np.asarray(series[other], dtype=np.float64)
            if other not in out and a.shape == b.shape and np.allclose(a, b, rtol=1e-9, atol=0.0, equal_nan=True):
                out[name] = other
                break
    return out


def _colorbar(title: str, value_format: str = "") -> dict[str, Any]:
    """The colour bar, in the cells' unit (percentages when the cells are)."""
    bar: dict[str, Any] = {"title": {"text": title, "side": "right"}, "thickness": 14}
    if value_format.endswith("%"):
        bar["tickformat"] = ".0%"
    return bar


def heatmap(z_YZ: np.ndarray, *, height: int = 460, **style: Any) -> Any:
    """One heatmap ``z_YZ`` (rows Y labelled ``y``, columns Z labelled ``x``); ``style`` takes the
    keyword arguments of :func:`heatmaps_by_layer` (titles, colours, range, value format)."""
    return heatmaps_by_layer(np.asarray(z_YZ)[None], layer_labels=None, height=height, **style)


def heatmaps_by_layer(
    z_LYZ: np.ndarray,
    *,
    layer_labels: Sequence[Any] | np.ndarray | None,
    x: Sequence[Any],
    y: Sequence[Any],
    x_title: str,
    y_title: str,
    value_title: str,
    what: str,
    source: str,
    colorscale: str = SEQUENTIAL,
    zmin: float | None = None,
    zmax: float | None = None,
    zmid: float | None = None,
    reverse: bool = False,
    value_format: str = ".3f",
    show_values: bool = False,
    height: int = 520,
    square: bool = False,
) -> Any:
    """One heatmap per layer behind a layer slider; the colour range is shared by all layers.
    ``layer_labels=None``: a single heatmap ``z_LYZ[0]``, no slider (what :func:`heatmap` draws).
    ``square``: a names × names matrix (``x`` = ``y``) laid out by :func:`theme.square_matrix`; its
    width (px, for the page's ``max_width``) is then in ``fig.layout.meta["width"]``."""
    go = plotly_go()
    z = np.asarray(z_LYZ, dtype=np.float64)
    finite = z[np.isfinite(z)]
    lo = zmin if zmin is not None else (float(finite.min()) if finite.size else 0.0)
    hi = zmax if zmax is not None else (float(finite.max()) if finite.size else 1.0)
    fig = go.Figure()
    for i in range(z.shape[0]):
        fig.add_trace(
            go.Heatmap(
                z=z[i],
                x=[str(v) for v in x],
                y=[str(v) for v in y],
                colorscale=colorscale,
                reversescale=reverse,
                zmin=lo,
                zmax=hi,
                zmid=zmid,
                colorbar=_colorbar(value_title, value_format),
                visible=i == 0,
                name=None if layer_labels is None else f"layer {layer_labels[i]}",
                hovertemplate=("" if layer_labels is None else f"layer {layer_labels[i]}<br>")
                + f"{y_title} %{{y}}<br>{x_title} %{{x}}<br>{value_title} %{{z:{value_format}}}<extra></extra>",
                texttemplate=f"%{{z:{value_format}}}" if show_values else None,
            )
        )
    if layer_labels is not None:
        fig.update_layout(
            sliders=layer_slider(z.shape[0], traces_per_layer=1, layer_labels=[str(v) for v in layer_labels])
        )
    if square:
        _, width = square_matrix(fig, [str(v) for v in x], x_title=x_title, y_title=y_title, what=what, source=source,
                                 slider=layer_labels is not None)  # fmt: skip
        fig.update_layout(meta={"width": width})
        return fig
    fig.update_layout(
        xaxis={"title": {"text": x_title}, "type": "category"},
        yaxis={"title": {"text": y_title}, "type": "category", "autorange": "reversed"},
    )
    return finish(fig, what=what, source=source, height=height)


def lines_by_layer(
    series: dict[str, np.ndarray],
    *,
    layers: Sequence[Any],
    y_title: str,
    what: str,
    source: str,
    reference: dict[str, float] | None = None,
    y_range: tuple[float, float] | None = None,
    colours: dict[str, str] | None = None,
    dash: dict[str, str] | None = None,
    height: int = 420,
    emphasis: str | None = None,
    groups: dict[str, str] | None = None,
) -> Any:
    """One line per named series over layers (x axis: the model's layer index), plus horizontal
    reference lines (``{"chance": 0.5}``) drawn in grey and labelled.

    ``emphasis``: the series drawn last (on top of the others), thicker, and listed first in the
    legend. ``groups``: series -> a legend group title (series without one stay ungrouped, listed
    before the groups), e.g. ``{"oracle": "bounds, not deployable"}``; grouped lines are thinner."""
    go = plotly_go()
    colours = colours or category_colours(list(series))
    groups = groups or {}
    fig = go.Figure()
    xs = [int(v) if isinstance(v, (int, np.integer)) else v for v in layers]
    names = list(series)
    rank = {n: (0 if n == emphasis else 1 + (1000 if n in groups else 0) + i) for i, n in enumerate(names)}
    order = [n for n in names if n != emphasis] + [n for n in names if n == emphasis]
    # a series equal to one drawn before it would vanish under it: drawn dashed, with rings for markers
    # and a wider line, and the figure says which equal which
    same = same_series(series, [n for n in names if n == emphasis] + [n for n in names if n != emphasis])
    titled: set[str] = set()
    for name in order:
        group = groups.get(name)
        extra: dict[str, Any] = {}
        if group is not None:
            extra["legendgroup"] = group
            if group not in titled:  # the group's title is drawn once, over its first entry
                extra["legendgrouptitle"] = {"text": group}
                titled.add(group)
        width = 4.5 if name == emphasis else 1.5 if group is not None else 2
        twin = same.get(name)
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=np.asarray(series[name], dtype=np.float64),
                mode="lines+markers",
                name=name,
                legendrank=rank[name],
                line={
                    "color": colours.get(name),
                    "dash": "dash" if twin is not None else (dash or {}).get(name, "solid"),
                    "width": width,
                },
                marker={"size": 8 if name == emphasis else 5}
                if twin is None
                else {"size": 11, "symbol": "circle-open", "line": {"width": 1.5}},
                hovertemplate=f"{name}<br>layer %{{x}}<br>{y_title} %{{y:.3f}}"
                + (f"<br>(the same as {twin} at every layer)" if twin is not None else "")
                + "<extra></extra>",
                **extra,
            )
        )
    _reference_lines(fig, reference, label_above=True)
    if same:
        fig.add_annotation(
            text="the same at every layer: " + "; ".join(f"{n} = {t}" for n, t in same.items()) + " (dashed, rings)",
            xref="paper", yref="paper", x=0, y=0, xanchor="left", yanchor="top", yshift=-62, showarrow=False,
            font={"size": 11, "color": REFERENCE_LINE},
        )  # fmt: skip
    fig.update_layout(
        xaxis={"title": {"text": "layer (model index)"}},
        yaxis={"title": {"text": wrap_title(y_title)}},
    )
    if y_range is not None:
        fig.update_yaxes(range=list(y_range))
    top, bottom = (96 if reference else 80), (100 if same else 60)
    rows = len(names) + len(set(groups.values()))  # legend entries and group titles, ~30 px each
    finish(fig, what=what, source=source, height=max(height, top + bottom + 30 * (rows + 1)))
    fig.update_layout(margin={"t": top, "b": bottom})  # the legend never runs past the plot's bottom
    return fig


def wrap_title(text: str, *, width: int = 34) -> str:
    """An axis title on at most two lines (``<br>`` at the space nearest the middle) when it is longer
    than ``width`` characters: a y title longer than the plot is tall is cut off at the figure's edges."""
    if len(text) <= width or " " not in text:
        return text
    mid = len(text) // 2
    cut = min((i for i, c in enumerate(text) if c == " "), key=lambda i: abs(i - mid))
    return text[:cut] + "<br>" + text[cut + 1 :]


def distributions(
    values: dict[str, np.ndarray],
    *,
    value_title: str,
    what: str,
    source: str,
    category_title: str,
    kind: str = "box",
    reference: dict[str, float] | None = None,
    colours: dict[str, str] | None = None,
    height: int = 420,
) -> Any:
    """A box (or violin) per category of the values ``values[name]`` [N]."""
    go = plotly_go()
    colours = colours or category_colours(list(values))
    fig = go.Figure()
    for name, v_N in values.items():
        v = np.asarray(v_N, dtype=np.float64)
        common = dict(
            y=v,
            name=str(name),
            marker_color=colours.get(name),
            hovertemplate=f"{name}<br>{value_title} %{{y:.3f}}<extra></extra>",
        )
        if kind == "violin":
            fig.add_trace(go.Violin(**common, box_visible=True, meanline_visible=False, points=False))
        else:
            fig.add_trace(go.Box(**common, boxpoints="outliers"))
    _reference_lines(fig, reference)
    fig.update_layout(
        xaxis={"title": {"text": category_title}}, yaxis={"title": {"text": value_title}}, showlegend=False
    )
    return finish(fig, what=what, source=source, height=height)


def scatter_by_category(
    x_N: np.ndarray,
    y_N: np.ndarray,
    *,
    category_N: Sequence[str],
    hover_N: dict[str, np.ndarray],
    x_title: str,
    y_title: str,
    what: str,
    source: str,
    max_points: int,
    seed: int,
    height: int = 560,
) -> Any:
    """A WebGL scatter coloured by category, sampled down to ``max_points`` with the cap printed on it.

    ``hover_N``: extra per-point columns shown on hover (e.g. request id, prompt tokens).
    """
    go = plotly_go()
    x_N, y_N = np.asarray(x_N), np.asarray(y_N)
    cat_N = np.asarray(category_N).astype(str)
    idx, note = downsample(x_N.shape[0], cap=max_points, seed=seed)
    names = list(hover_N)
    # [N, len(names)]: one column per hover field (``customdata``)
    custom_N_ = np.stack([np.asarray(hover_N[n])[idx] for n in names], axis=1) if names else None
    hover = "<br>".join(f"{n} %{{customdata[{j}]}}" for j, n in enumerate(names))
    colours = category_colours(cat_N.tolist())
    fig = go.Figure()
    cat_idx = cat_N[idx]
    for name in sorted(colours):
        sel = cat_idx == name
        fig.add_trace(
            go.Scattergl(
                x=x_N[idx][sel],
                y=y_N[idx][sel],
                mode="markers",
                name=name,
                marker={"color": colours[name], "size": 6, "opacity": 0.8},
                customdata=custom_N_[sel] if custom_N_ is not None else None,
                hovertemplate=f"<b>{name}</b><br>{hover}<extra></extra>",
            )
        )
    fig.update_layout(
        xaxis={"title": {"text": x_title}, "zeroline": False},
        yaxis={"title": {"text": y_title}, "zeroline": False},
        legend={"title": {"text": "dataset"}, "itemsizing": "constant"},
    )
    if note:
        fig.add_annotation(**note_annotation(note))
    return finish(fig, what=what, source=source, height=height)
