"""``write_dashboard``: turn any mix of traces and result directories into one HTML report.

Each input directory is recognised by its manifest (``inputs``); every section whose results are
present is rendered (``sections.SECTIONS``: one row per section, in page order), the decision first: the summary card, placement (``compare``) and measured
all-to-all (``a2a``), then load (imbalance), then structure (correlations, clusters, classifiers),
then the trace overview. Every section whose results are absent is listed in
``DashboardReport.omitted`` with the reason (and in the page's footer), never an error. A summary
card of headline numbers (``summary``) opens the page when any of their results are present.
Progress is reported as ``progress(done, total)`` over the report's steps: one per section built
(overview per trace; imbalance, correlations, clusters, classifiers per analysis; one per compare
and a2a results directory) and one for writing the page.

Out of scope: computing results (``moetrace analyze`` / ``compare`` / ``a2a`` do that; the
dashboard only reads their files), serving the page.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from moetrace.atomic import write_text_atomic
from moetrace.dashboards.inputs import Input, detect
from moetrace.dashboards.page import Headline, Section, render_page
from moetrace.dashboards.sections import INPUT_KINDS, SECTIONS, kind_row
from moetrace.errors import ConfigError, OutputExistsError, TraceFormatError


@dataclass(frozen=True, kw_only=True)
class DashboardConfig:
    """Knobs of a report."""

    max_points: int = 20_000  # scatter points drawn per figure; more are sampled down (cap shown on the figure)
    seed: int = 0  # seed of that sampling
    title: str | None = None  # page title; default names the model(s)


@dataclass(frozen=True, kw_only=True)
class DashboardReport:
    """What ``write_dashboard`` wrote."""

    path: Path  # the HTML file
    size_bytes: int  # its size (plotly.js alone is ~4.8 MB)
    sections: tuple[str, ...]  # keys of the sections rendered, in page order
    num_figures: int  # plotly figures on the page
    omitted: tuple[str, ...]  # sections not rendered and why (results absent)
    headlines: tuple[str, ...]  # keys of the summary card's numbers, in card order (empty: no card)


#: ``progress(done, total)``: steps of the report done so far, of a total fixed before the first call
Progress = Callable[[int, int], None]


@dataclass(frozen=True, kw_only=True)
class Built:
    """What ``build_sections`` made of the inputs."""

    sections: list[Section]  # in page order
    headlines: list[Headline]  # the summary card, in card order
    omitted: list[str]  # sections left out and why
    steps: int  # steps done (sections built); ``write_dashboard`` adds one for the page


def _no_progress(done: int, total: int) -> None:
    del done, total


def build_sections(
    inputs: Sequence[Input], *, config: DashboardConfig, progress: Progress = _no_progress, extra_steps: int = 0
) -> Built:
    """The sections and summary headlines for these inputs, and notes on the sections left out.

    One section per row of ``sections.SECTIONS`` (in page order) and input of the kind it needs.
    ``progress`` is called with ``(done, total)`` before the first section and after each one built;
    ``total`` counts ``extra_steps`` more that the caller does afterwards (writing the page).
    """
    from moetrace.dashboards.results import Results
    from moetrace.dashboards.summary import a2a_headline, analysis_skipped_notes, imbalance_headline, placement_headline
    from moetrace.dashboards.summary_advice import advice_headline, compare_relation_line

    traces = [i for i in inputs if i.kind == "trace"]
    results = [Results.from_input(i) for i in inputs if i.kind != "trace"]
    # a results directory names its trace: show that trace's overview too when it is at hand
    given = {t.path.resolve() for t in traces}
    omitted: list[str] = []
    for r in results:
        tp = r.trace_path
        if tp is not None and tp.resolve() not in given and (tp / "manifest.json").is_file():
            try:
                traces.append(detect(tp))
                given.add(tp.resolve())
            except TraceFormatError as exc:  # rewritten since the results were computed: say so, show the rest
                omitted.append(f"overview of {tp} (named by {r.path}): {exc}")
    by_kind: dict[str, list] = {k.kind: [r for r in results if r.kind == k.kind] for k in INPUT_KINDS}
    by_kind["trace"] = traces
    analyses = by_kind["analysis"]
    options = {"max_points": config.max_points, "seed": config.seed, "analyses": analyses}
    total = sum(len(by_kind[row.needs]) for row in SECTIONS) + extra_steps
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        progress(done, total)

    progress(0, total)
    sections: list[Section] = []  # in page order: the table's
    for row in SECTIONS:
        build = row.build()
        kw = {o: options[o] for o in row.options}

        def built(src, kp, build=build, kw=kw):
            return build(src, key_prefix=kp, **kw)

        kind = kind_row(row.needs)
        _add_sections(
            sections,
            omitted,
            by_kind[row.needs],
            _with_random_weights_banner(built) if row.banner else built,
            kind.prefix,
            step,
            retitle=kind.retitle,
        )
    omitted.extend(note for r in analyses for note in analysis_skipped_notes(r))  # what analyze skipped, and why
    profiles = sorted({p.name for r in [*analyses, *by_kind["placement"]] if (p := r.profile_path) is not None})
    if not traces and profiles:
        omitted.append(f"overview: the results are of a load profile ({', '.join(profiles)}): it holds no requests")
    elif not traces:
        omitted.append("overview: no trace directory among the inputs (and the results name none that exists)")
    omitted.extend(k.missing for k in INPUT_KINDS if k.missing is not None and not by_kind[k.kind])
    # the card: the decision first (advise's, then compare's with how the two relate), measured all-to-all,
    # then the load; a trace with seeded random weights last, said in its title (its numbers mean nothing)
    advices, placements = by_kind["advice"], by_kind["placement"]
    headlines: list[Headline] = []
    real = [r for r in analyses if not _random_weights(r)]
    for results_, prefix, headline in ((advices, "v", advice_headline), (placements, "p", placement_headline),
                                       (by_kind["a2a"], "m", a2a_headline), (analyses, "a", imbalance_headline)):  # fmt: skip
        many = len(results_) > 1
        for n, r in sorted(enumerate(results_), key=lambda nr: results_ is analyses and nr[1] not in real):
            h = headline(r, key_prefix=f"{prefix}{n}-" if many else "", suffix=f": {r.trace_label}" if many else "")
            if h is not None and results_ is analyses and r not in real:
                h = replace(h, title=f"{h.title} (random weights)")
            if h is not None and results_ is placements and advices:  # the decision is advise's card
                title = h.title.replace("Best deployable placement", "Best of the compared strategies")
                h = replace(h, title=title, lines=(*h.lines, compare_relation_line(advices[0], r)))
            if h is not None:
                headlines.append(h)
    return Built(sections=sections, headlines=headlines, omitted=list(dict.fromkeys(omitted)), steps=done)


def _random_weights(r) -> bool:
    """Whether the results' trace had seeded random weights (a ``-tiny`` preset's collection)."""
    from moetrace.dashboards.section_overview import random_weights

    tp = r.trace_path
    if tp is None or not (tp / "manifest.json").is_file():
        return False
    try:
        return bool(random_weights(json.loads((tp / "manifest.json").read_text())))
    except (OSError, ValueError):
        return False


def _with_random_weights_banner(build):
    """``build``, with the random-weights banner on its section when the results' trace had random weights."""

    from moetrace.dashboards.section_overview import RANDOM_WEIGHTS_BANNER, random_weights

    def wrapped(r, kp):
        sec, notes = build(r, kp)
        tp = r.trace_path
        if sec is not None and tp is not None and (tp / "manifest.json").is_file():
            try:
                manifest = json.loads((tp / "manifest.json").read_text())
            except (OSError, ValueError):
                manifest = {}
            if random_weights(manifest):
                sec = replace(sec, banner=RANDOM_WEIGHTS_BANNER)
        return sec, notes

    return wrapped


def _add_sections(
    sections: list[Section],
    omitted: list[str],
    results: Sequence,
    build,
    prefix: str,
    step: Callable[[], None],
    *,
    retitle: bool = True,
) -> None:
    """One section per input from ``build(input, key_prefix)``; several inputs of one kind get distinct
    keys and (``retitle``) their trace's name in the title. ``step()`` after each."""
    many = len(results) > 1
    for n, r in enumerate(results):
        sec, notes = build(r, f"{prefix}{n}-" if many else "")
        if sec is not None:
            sections.append(replace(sec, title=f"{sec.title}: {r.trace_label}") if many and retitle else sec)
        omitted.extend(notes)
        step()


def write_dashboard(
    inputs: Sequence[str | os.PathLike],
    *,
    out: str | os.PathLike,
    config: DashboardConfig = DashboardConfig(),
    overwrite: bool = True,
    progress: Progress = _no_progress,
) -> DashboardReport:
    """Write one self-contained HTML report for ``inputs`` to ``out`` and say what is in it.

    ``inputs``: trace directories and result directories of ``moetrace analyze``,
    ``moetrace compare`` and ``moetrace a2a``, in any order and mix. ``out``: the ``.html`` file to write (its parent
    is created). The file is written to a temporary name and renamed, so a failure never leaves a
    half-written report. ``progress(done, total)`` is called as sections are built and once more
    when the file is written (``done == total``).
    """
    if not inputs:
        raise ConfigError("no inputs: pass at least one trace or results directory")
    if config.max_points < 1:
        raise ConfigError(f"`max_points` must be >= 1, got {config.max_points}")
    out = Path(out)
    if out.exists() and out.is_dir():
        raise OutputExistsError(f"{out} is a directory; -o takes the report's file name, e.g. {out / 'report.html'}")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} exists; choose another -o or allow overwriting")
    found = [detect(p) for p in inputs]
    built = build_sections(found, config=config, progress=progress, extra_steps=1)
    sections, omitted = built.sections, built.omitted
    if not sections:
        raise ConfigError("nothing to show: " + "; ".join(omitted))
    models = sorted({i.manifest.get("model", {}).get("name", "") for i in found if i.manifest.get("model")} - {""})
    title = config.title or f"moetrace report: {', '.join(models) or 'expert activations'}"
    subtitle = "Inputs: " + ", ".join(f"{i.path} ({i.kind})" for i in found)
    text = render_page(
        sections,
        title=title,
        subtitle=subtitle,
        footer_notes=[f"Not shown: {o}" for o in omitted],
        headlines=built.headlines,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, text)  # an unpredictable temporary name, never through a link
    progress(built.steps + 1, built.steps + 1)
    return DashboardReport(
        path=out,
        size_bytes=out.stat().st_size,
        sections=tuple(s.key for s in sections),
        num_figures=sum(len(s.figures) for s in sections),
        omitted=tuple(omitted),
        headlines=tuple(h.key for h in built.headlines),
    )
