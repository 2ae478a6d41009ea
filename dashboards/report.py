"""``write_dashboard``: turn any mix of traces and result directories into one HTML report.

Each input directory is recognised by its manifest (``inputs``); every section whose results are
present is rendered, the decision first: the summary card, placement (``compare``) and measured
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

    ``progress`` is called with ``(done, total)`` before the first section and after each one built;
    ``total`` counts ``extra_steps`` more that the caller does afterwards (writing the page).
    """
    from moetrace.dashboards.results import Results
    from moetrace.dashboards.section_a2a import a2a_section
    from moetrace.dashboards.section_advice import advice_section
    from moetrace.dashboards.section_clusters import classifiers_section, clusters_section
    from moetrace.dashboards.section_correlation import correlation_section
    from moetrace.dashboards.section_imbalance import imbalance_section
    from moetrace.dashboards.section_overview import overview_section
    from moetrace.dashboards.section_placement import placement_section
    from moetrace.dashboards.summary import a2a_headline, analysis_skipped_notes, imbalance_headline, placement_headline
    from moetrace.dashboards.summary_advice import advice_headline, compare_relation_line
    from moetrace.tracer.trace.reader import open_trace

    traces = [i for i in inputs if i.kind == "trace"]
    analyses = [Results.from_input(i) for i in inputs if i.kind == "analysis"]
    placements = [Results.from_input(i) for i in inputs if i.kind == "placement"]
    a2as = [Results.from_input(i) for i in inputs if i.kind == "a2a"]
    advices = [Results.from_input(i) for i in inputs if i.kind == "advice"]
    # a results directory names its trace: show that trace's overview too when it is at hand
    given = {t.path.resolve() for t in traces}
    omitted: list[str] = []
    for r in [*analyses, *placements, *a2as, *advices]:
        tp = r.trace_path
        if tp is not None and tp.resolve() not in given and (tp / "manifest.json").is_file():
            try:
                traces.append(detect(tp))
                given.add(tp.resolve())
            except TraceFormatError as exc:  # rewritten since the results were computed: say so, show the rest
                omitted.append(f"overview of {tp} (named by {r.path}): {exc}")
    builders = (
        lambda r, kp: imbalance_section(r, key_prefix=kp),
        lambda r, kp: correlation_section(r, key_prefix=kp),
        lambda r, kp: clusters_section(r, max_points=config.max_points, seed=config.seed, key_prefix=kp),
        lambda r, kp: classifiers_section(r, key_prefix=kp),
    )
    total = len(traces) + len(builders) * len(analyses) + len(placements) + len(a2as) + len(advices) + extra_steps
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        progress(done, total)

    progress(0, total)
    overview: list[Section] = []
    advice: list[Section] = []  # `moetrace advise` results: first when present
    _add_sections(advice, omitted, advices, lambda r, kp: advice_section(r, key_prefix=kp), "v", step)
    for n, t in enumerate(traces):
        if t.manifest.get("complete"):  # a finished trace is checked against its manifest (parts, totals)
            try:
                trace = open_trace(t.path)
            except TraceFormatError as exc:  # damaged since it was written: say so, never show the rest as whole
                omitted.append(f"overview of {t.path}: {exc}")
                step()
                continue
        else:  # a collection still running: what it committed so far (the overview says so)
            trace = open_trace(t.path, require_complete=False)
        if trace.part_names():
            _ = trace.request_arrays  # checks the requests table and every routing part's footer, like analyze does
        overview.append(overview_section(trace, key_prefix=f"t{n}-" if len(traces) > 1 else ""))
        step()
    profiles = sorted({p.name for r in [*analyses, *placements] if (p := r.profile_path) is not None})
    if not traces and profiles:
        omitted.append(f"overview: the results are of a load profile ({', '.join(profiles)}): it holds no requests")
    elif not traces:
        omitted.append("overview: no trace directory among the inputs (and the results name none that exists)")

    load: list[Section] = []  # imbalance
    structure: list[Section] = []  # correlations, clusters, classifiers
    for i, build in enumerate(builders):
        _add_sections(load if i == 0 else structure, omitted, analyses, _with_random_weights_banner(build), "a", step)
    omitted.extend(note for r in analyses for note in analysis_skipped_notes(r))  # what analyze skipped, and why
    if not analyses:
        omitted.append(
            "load imbalance, correlations, clusters, classifiers: no `moetrace analyze` results among the inputs"
        )
    decision: list[Section] = []  # placement, then measured all-to-all
    _add_sections(
        decision,
        omitted,
        placements,
        _with_random_weights_banner(lambda r, kp: placement_section(r, key_prefix=kp, analyses=analyses)),
        "p",
        step,
    )
    if not placements:
        omitted.append("placement: no `moetrace compare` results among the inputs")
    _add_sections(decision, omitted, a2as, lambda r, kp: a2a_section(r, key_prefix=kp), "m", step)
    if not a2as:
        omitted.append(
            "all-to-all measurements vs predictions: no measured all-to-all results among the inputs (run `moetrace a2a`)"
        )
    # the decision first: (summary card), advice, placement and measured all-to-all, load, structure, the trace.
    sections = [*advice, *decision, *load, *structure, *overview]
    # the card: the decision first (advise's, then compare's with how the two relate), measured all-to-all,
    # then the load; a trace with seeded random weights last, said in its title (its numbers mean nothing)
    headlines: list[Headline] = []
    real = [r for r in analyses if not _random_weights(r)]
    for results, prefix, headline in ((advices, "v", advice_headline), (placements, "p", placement_headline),
                                      (a2as, "m", a2a_headline), (analyses, "a", imbalance_headline)):  # fmt: skip
        many = len(results) > 1
        for n, r in sorted(enumerate(results), key=lambda nr: results is analyses and nr[1] not in real):
            h = headline(r, key_prefix=f"{prefix}{n}-" if many else "", suffix=f": {r.trace_label}" if many else "")
            if h is not None and results is analyses and r not in real:
                h = replace(h, title=f"{h.title} (random weights)")
            if h is not None and results is placements and advices:  # the decision is advise's card
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
    sections: list[Section], omitted: list[str], results: Sequence, build, prefix: str, step: Callable[[], None]
) -> None:
    """One section per results directory from ``build(results, key_prefix)``; several directories of one
    kind get distinct keys and their trace's name in the title. ``step()`` after each."""
    many = len(results) > 1
    for n, r in enumerate(results):
        sec, notes = build(r, f"{prefix}{n}-" if many else "")
        if sec is not None:
            sections.append(replace(sec, title=f"{sec.title}: {r.trace_label}") if many else sec)
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
