"""The dashboard's sections, one row each: the one table ``report.build_sections``, the
``moetrace dashboard`` command's help and docs/dashboards.md (a test keeps it in step) read.

A ``SectionRow`` names a section (its key and title), the input kind it is drawn from, its builder
(``"module:function"`` under ``moetrace.dashboards``, imported only when a report is built, so the
CLI reads this table without importing polars or plotly), the report's settings it takes and
whether a trace of random weights puts its banner on it. ``SECTIONS`` is in page order: the
decision first (advice, placement, measured all-to-all), then load, structure, and the trace last.
``INPUT_KINDS`` says, per input kind, the key prefix several inputs of the kind get (``a0-``,
``a1-``, ...), the command that writes it, and what the footer says when none was given.

Adding a section: its module (a builder ``f(source, *, key_prefix, **options) -> (Section | None,
notes)``: the section, or None and why), one row here, its paragraph and row in docs/dashboards.md,
a test. Nothing else learns its name.

Out of scope: the summary card's headlines (``summary``, ``summary_advice``: one per results
kind, with how compare's answer relates to advise's), how inputs are recognised (``inputs``),
the page (``page``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["INPUT_KINDS", "SECTIONS", "InputKindRow", "Option", "SectionRow", "kind_row", "section_row"]

#: a report setting a builder may take as a keyword: ``max_points`` and ``seed`` of
#: ``DashboardConfig``, ``analyses`` (every analysis results directory among the inputs)
Option = Literal["max_points", "seed", "analyses"]


@dataclass(frozen=True, kw_only=True)
class SectionRow:
    """One section of the report."""

    key: str  # its key: the anchor, nav target and figure-key prefix ("imbalance"); several inputs: "a0-imbalance"
    title: str  # its heading and nav label, as its builder sets it
    needs: str  # the input kind it is drawn from (an ``InputKindRow.kind``): one section per such input
    builder: str  # "module:function" under moetrace.dashboards
    options: tuple[Option, ...] = ()  # the report's settings passed to the builder as keywords
    banner: bool = False  # drawn from a trace of random weights: the banner goes on this section

    def build(self) -> Callable[..., Any]:
        """The builder, imported now."""
        module, _, function = self.builder.partition(":")
        return getattr(importlib.import_module(f"moetrace.dashboards.{module}"), function)


@dataclass(frozen=True, kw_only=True)
class InputKindRow:
    """One kind of dashboard input (``inputs.InputKind``)."""

    kind: str  # "trace", "analysis", "placement", "a2a", "advice"
    prefix: str  # key prefix letter when several inputs of the kind are given ("a" -> "a0-", "a1-")
    command: str  # what writes it, for the command's help ("moetrace analyze"; a trace: "moetrace collect")
    missing: str | None  # the footer's note when no input of the kind is given; None: say nothing
    retitle: bool = True  # several inputs: each section's title gets its trace's name (the overview names its own)


SECTIONS: tuple[SectionRow, ...] = (
    SectionRow(key="advice", title="Advice", needs="advice", builder="section_advice:advice_section"),
    SectionRow(
        key="placement",
        title="Placement and all-to-all volume",
        needs="placement",
        builder="section_placement:placement_section",
        options=("analyses",),
        banner=True,
    ),
    SectionRow(key="a2a", title="Measured all-to-all vs predictions", needs="a2a", builder="section_a2a:a2a_section"),
    SectionRow(
        key="imbalance",
        title="Load imbalance",
        needs="analysis",
        builder="section_imbalance:imbalance_section",
        banner=True,
    ),
    SectionRow(
        key="correlation",
        title="Correlations",
        needs="analysis",
        builder="section_correlation:correlation_section",
        banner=True,
    ),
    SectionRow(
        key="clusters",
        title="Request clusters",
        needs="analysis",
        builder="section_clusters:clusters_section",
        options=("max_points", "seed"),
        banner=True,
    ),
    SectionRow(
        key="classifiers",
        title="Request-type classifiers",
        needs="analysis",
        builder="section_clusters:classifiers_section",
        banner=True,
    ),
    SectionRow(key="overview", title="Overview", needs="trace", builder="section_overview:trace_overview_section"),
)

INPUT_KINDS: tuple[InputKindRow, ...] = (
    InputKindRow(kind="advice", prefix="v", command="moetrace advise", missing=None),
    InputKindRow(
        kind="placement",
        prefix="p",
        command="moetrace compare",
        missing="placement: no `moetrace compare` results among the inputs",
    ),
    InputKindRow(
        kind="a2a",
        prefix="m",
        command="moetrace a2a",
        missing="all-to-all measurements vs predictions: no measured all-to-all results among the inputs (run "
        "`moetrace a2a`)",
    ),
    InputKindRow(
        kind="analysis",
        prefix="a",
        command="moetrace analyze",
        missing="load imbalance, correlations, clusters, classifiers: no `moetrace analyze` results among the inputs",
    ),
    InputKindRow(kind="trace", prefix="t", command="moetrace collect, import or synth", missing=None, retitle=False),
)


def section_row(key: str) -> SectionRow:
    """The row of the section ``key`` (``KeyError`` naming the keys there are)."""
    for row in SECTIONS:
        if row.key == key:
            return row
    raise KeyError(f"no dashboard section {key!r}; sections: {', '.join(r.key for r in SECTIONS)}")


def kind_row(kind: str) -> InputKindRow:
    """The row of the input kind ``kind``."""
    for row in INPUT_KINDS:
        if row.kind == kind:
            return row
    raise KeyError(f"no dashboard input kind {kind!r}; kinds: {', '.join(r.kind for r in INPUT_KINDS)}")
