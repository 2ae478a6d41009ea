"""Overview section: what was traced (model, datasets, requests, tokens) and how (provenance).

Read from a trace directory: ``manifest.json`` (model, backend, collection) and the requests table.
Token counts are the requests table's ``prompt_tokens`` (prefill) and ``output_tokens`` (decode)
sums, i.e. positions of the trace, including positions whose routing was not recorded (``-1``).
The provenance table of a synthetic trace runs to dozens of settings; like every long table it is
folded (``page.COLLAPSE_ROWS``) behind a one-line summary.

Shape legend (docs/architecture.md): none; no shape-suffixed names here.

Out of scope: routing statistics (those come from ``moetrace analyze`` results).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import polars as pl

from moetrace.dashboards.inputs import Input
from moetrace.dashboards.page import Figure, Section, Table
from moetrace.dashboards.theme import category_colours, finish, plotly_go
from moetrace.errors import TraceFormatError
from moetrace.tracer.trace.reader import Trace, open_trace


def trace_label(trace: Trace) -> str:
    """How figures name a trace: ``<dir name> (<model>)``."""
    return f"trace {trace.path.name} ({trace.model.name})"


def _flat(d: object, prefix: str = "") -> list[tuple[str, str]]:
    """Nested manifest dicts as (dotted key, compact value) rows."""
    rows: list[tuple[str, str]] = []
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v and len(json.dumps(v)) > 80:
                rows.extend(_flat(v, key))
            else:
                rows.append((key, v if isinstance(v, str) else json.dumps(v)))
    return rows


RANDOM_WEIGHTS_BANNER = "routing of random weights: structure here says nothing about a real model"


def random_weights(manifest: dict[str, Any]) -> bool:
    """Whether a trace's manifest says its model had seeded random weights: a ``-tiny`` preset
    (model source ``moetrace:<preset>-tiny``) or a backend that says so."""
    source = str((manifest.get("model") or {}).get("source", ""))
    backend = str(manifest.get("backend") or {}).lower()
    return source.startswith("moetrace:") or "random weights" in backend or "random_weights" in backend


def _stages_line(trace: Trace) -> str:
    """Which stages' routing the trace holds (manifest ``collection.stages``; absent: both)."""
    from moetrace.tracer.trace.schema import stages_of

    stages = stages_of(trace)
    if len(stages) == 2:
        return "prefill and decode"
    only = next(iter(stages))
    unknown = (trace.manifest.get("collection") or {}).get("prompt_lengths_known") is False
    note = "; prompt lengths unknown (one placeholder prompt row per request)" if unknown else ""
    return f"{only} only (the other stage's rows hold -1){note}"


def trace_overview_section(inp: Input, *, key_prefix: str = "") -> tuple[Section | None, list[str]]:
    """The overview of one trace directory, opened and checked here: a finished trace against its
    manifest (parts, totals; damaged since it was written: no section, and why), a collection still
    running as far as it committed (the overview says so). The requests table and every routing
    part's footer are read, as ``analyze`` reads them."""
    if inp.manifest.get("complete"):
        try:
            trace = open_trace(inp.path)
        except TraceFormatError as exc:  # damaged since it was written: say so, never show the rest as whole
            return None, [f"overview of {inp.path}: {exc}"]
    else:
        trace = open_trace(inp.path, require_complete=False)
    if trace.part_names():
        _ = trace.request_arrays  # checks the requests table and every routing part's footer, like analyze does
    return overview_section(trace, key_prefix=key_prefix), []


def overview_section(trace: Trace, *, key_prefix: str = "") -> Section:
    """The overview of one trace: model and provenance tables, per-dataset counts, length figures."""
    from moetrace.sizes import dir_bytes, human_bytes

    go = plotly_go()
    m = trace.model
    label = trace_label(trace)
    req = trace.requests().select("request_id", "dataset", "prompt_tokens", "output_tokens").collect()
    per = (
        req.group_by("dataset")
        .agg(
            pl.len().alias("requests"),
            pl.col("prompt_tokens").sum().alias("prefill"),
            pl.col("output_tokens").sum().alias("decode"),
            pl.col("prompt_tokens").median().alias("prompt_median"),
            pl.col("output_tokens").median().alias("output_median"),
        )
        .sort("dataset")
    )
    model_rows = (
        ("model", m.name),
        ("source", m.source),
        ("architecture", m.architecture),
        ("layers (MoE / all)", f"{m.num_moe_layers} / {m.num_hidden_layers}"),
        ("routed experts per layer", m.num_experts),
        ("top-k", m.top_k),
        ("shared experts", m.num_shared_experts),
        ("hidden size", m.hidden_size),
        ("router groups (n_group / topk_group)", f"{m.n_group} / {m.topk_group}" if m.n_group else "none"),
    )
    trace_rows = (
        ("directory", str(trace.path)),
        ("complete", trace.complete),
        ("parts", len(trace.part_names())),
        ("size on disk", human_bytes(dir_bytes(trace.path))),
        ("requests", req.height),
        ("tokens (prefill + decode)", int(req["prompt_tokens"].sum() or 0) + int(req["output_tokens"].sum() or 0)),
        ("routing recorded", _stages_line(trace)),
        ("moetrace version", trace.manifest.get("moetrace_version", "unknown")),
    )
    prov = _flat({"backend": trace.manifest.get("backend", {}), "collection": trace.manifest.get("collection", {})})
    counts_rows = tuple(
        (
            r["dataset"],
            r["requests"],
            int(r["prefill"]),
            int(r["decode"]),
            float(r["prompt_median"]),
            float(r["output_median"]),
        )
        for r in per.iter_rows(named=True)
    )
    if per.height > 1:
        counts_rows += (
            ("total", req.height, int(req["prompt_tokens"].sum()), int(req["output_tokens"].sum()),
             float(req["prompt_tokens"].median()), float(req["output_tokens"].median())),  # type: ignore[arg-type]  # polars types Series.median() as any Python literal
        )  # fmt: skip
    tables = (
        Table(key=f"{key_prefix}overview-model", header=("model", ""), rows=model_rows, caption=f"Model of {label}."),
        Table(key=f"{key_prefix}overview-trace", header=("trace", ""), rows=trace_rows),
        Table(
            key=f"{key_prefix}overview-datasets",
            header=("dataset", "requests", "prefill tokens", "decode tokens", "median prompt", "median output"),
            rows=counts_rows,
            caption="Requests and tokens per dataset (prefill = prompt positions, decode = generated positions).",
        ),
        Table(
            key=f"{key_prefix}overview-provenance",
            header=("provenance", ""),
            rows=tuple(prov),
            caption="How the trace was collected (manifest backend and collection sections).",
            summary=f"Provenance: {len(prov)} settings from the manifest's backend and collection sections "
            "(click to show)",
        ),
    )

    # prompt and output length distributions per dataset (box plots over requests)
    colours = category_colours(per["dataset"].to_list())
    fig = go.Figure()
    for ds in per["dataset"].to_list():
        sub = req.filter(pl.col("dataset") == ds)
        for col, name, side in (("prompt_tokens", "prompt", "x"), ("output_tokens", "output", "x2")):
            fig.add_trace(
                go.Box(
                    y=sub[col].to_numpy().astype(np.int32),
                    name=ds,
                    legendgroup=ds,
                    showlegend=name == "prompt",
                    marker_color=colours[ds],
                    boxpoints=False,
                    xaxis=side,
                    yaxis="y" if name == "prompt" else "y2",
                    hovertemplate=f"{ds}<br>{name} length %{{y}} tokens<extra></extra>",
                )
            )
    fig.update_layout(
        grid={"rows": 1, "columns": 2, "pattern": "independent"},
        xaxis={"title": {"text": "dataset (prompt)"}},
        xaxis2={"title": {"text": "dataset (output)"}},
        yaxis={"title": {"text": "prompt length (tokens)"}},
        yaxis2={"title": {"text": "output length (tokens)"}},
    )
    finish(fig, what="Prompt and output lengths per dataset", source=label, height=400)
    figures = (
        Figure(
            key=f"{key_prefix}overview-lengths",
            figure=fig,
            source=str(trace.path / "requests"),
            caption="Box plots over requests: prompt tokens (prefill) left, generated tokens (decode) right.",
        ),
    )
    return Section(
        key=f"{key_prefix}overview",
        title="Overview" if not key_prefix else f"Overview: {trace.path.name}",
        intro=f"{label}: {req.height:,} requests from {per.height} dataset(s).",
        tables=tables,
        figures=figures,
        banner=RANDOM_WEIGHTS_BANNER if random_weights(trace.manifest) else "",
    )
