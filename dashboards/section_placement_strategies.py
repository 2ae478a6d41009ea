"""The placement section's strategies: their labels, colours, page order, which rows are bounds.

Every figure and table of compare results (this section, ``section_a2a``, ``section_advice``, the
summary card) names and colours strategies through these, so they agree: the recommended strategy
black and emphasised, bounds (rows no deployment reaches) in greys, dotted, in their own group.

Out of scope: the strategies themselves (``placement.strategies``, the registry).
"""

from __future__ import annotations

from typing import Any

import polars as pl

from moetrace.dashboards.results import Results
from moetrace.dashboards.theme import category_colour
from moetrace.placement.strategies import LABELS, RECOMMENDED
from moetrace.placement.strategies import STRATEGY_NAMES as REGISTERED

__all__ = [
    "STRATEGY_NAMES",
    "BOUNDS_GROUP",
    "RECOMMENDED_COLOUR",
    "is_bound",
    "recommended_of",
    "strategy_colours",
    "strategies_in_order",
    "line_style",
]


#: strategy -> its label in figures, in registry order (which also fixes each strategy's colour)
STRATEGY_NAMES = LABELS  # strategies and the bounds compare reports


#: the legend group and table caption of the rows that are bounds, not strategies
BOUNDS_GROUP = "bounds, not deployable"
#: the recommended strategy's colour: black, which no other strategy has (categories skip it)
RECOMMENDED_COLOUR = "#000000"
#: bounds are drawn in greys (dotted lines), apart from the strategies' colours
_BOUND_COLOURS = ("#7a7a7a", "#a9a9a9", "#5a5a5a")


def is_bound(name: str) -> bool:
    """A row of compare's results that no deployment reaches (any name outside the strategy registry)."""
    return name not in REGISTERED


def recommended_of(strategies: list[str]) -> str | None:
    """The strategy the page emphasises: the recommended one (ours), else, in results without it, joint."""
    return next((s for s in (RECOMMENDED, "joint") if s in strategies), None)


def strategy_colours(strategies: list[str]) -> dict[str, str]:
    """Fixed colours per known strategy so every figure and report agrees; unknown ones after;
    the recommended strategy black; bounds in greys."""
    known = list(REGISTERED)
    bounds = [s for s in strategies if is_bound(s)]
    return {
        s: _BOUND_COLOURS[bounds.index(s) % len(_BOUND_COLOURS)]
        if is_bound(s)
        else RECOMMENDED_COLOUR
        if s == recommended_of(strategies)
        else category_colour(known.index(s) if s in known else len(known) + i)
        for i, s in enumerate(strategies)
    }


def strategies_in_order(res: Results, df: pl.DataFrame) -> list[str]:
    """The rows of ``df`` in page order: the reference, the recommended strategy, the other strategies
    as compare.json lists them, then the bounds."""
    order, ref = res.compare.strategies, res.compare.reference
    have = df["strategy"].unique().to_list()
    rec = recommended_of(have)
    out = ([ref] if ref in have else []) + ([rec] if rec is not None and rec != ref else [])
    out += [s for s in order if s in have and s not in out and not is_bound(s)]
    out += sorted(s for s in have if s not in out and not is_bound(s))
    return out + [s for s in dict.fromkeys([*res.compare.bounds, *sorted(have)]) if s in have and is_bound(s)]


def line_style(res: Results, strategies: list[str]) -> dict[str, Any]:
    """``lines_by_layer``'s keyword arguments for these strategies: colours, the recommended strategy
    emphasised (on top, thicker, first in the legend), bounds dotted in their own legend group."""
    label = {s: STRATEGY_NAMES.get(s, s) for s in strategies}
    return {
        "colours": {label[s]: c for s, c in strategy_colours(strategies).items()},
        "emphasis": label[rec] if (rec := recommended_of(strategies)) is not None else None,
        "groups": {label[s]: BOUNDS_GROUP for s in strategies if is_bound(s)},
        "dash": {label[s]: "dot" for s in strategies if is_bound(s)},
    }
