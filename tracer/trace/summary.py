"""A short text summary of a trace (``moetrace info``)."""

from __future__ import annotations

import os

import polars as pl

from moetrace.sizes import dir_bytes, human_bytes
from moetrace.tracer.trace.reader import open_trace


def trace_summary(path: str | os.PathLike, *, allow_incomplete: bool = False) -> str:
    """Model, backend, per-dataset request and token counts, and size on disk, as text."""
    from moetrace.errors import TraceFormatError

    t = open_trace(path, require_complete=not allow_incomplete)
    m = t.model
    try:
        per = (
            t.requests()
            .group_by("dataset")
            .agg(
                pl.len().alias("requests"),
                pl.col("prompt_tokens").sum().alias("prefill_tokens"),
                pl.col("output_tokens").sum().alias("decode_tokens"),
            )
            .sort("dataset")
            .collect()
        )
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise TraceFormatError(
            f"{t.path}: cannot read the requests parts ({str(exc).splitlines()[0]}); run `moetrace validate {t.path}`"
        ) from exc
    lines = [
        f"trace      {t.path}  ({'complete' if t.complete else 'INCOMPLETE'})",
        f"model      {m.name}  [{m.architecture}]  source {m.source}",
        f"routing    {m.num_moe_layers} MoE layers of {m.num_hidden_layers}, {m.num_experts} experts, top-{m.top_k}"
        + (f", {m.n_group} groups (top-{m.topk_group})" if m.n_group else ""),
        f"backend    {t.manifest.get('backend', {})}",
        f"size       {human_bytes(dir_bytes(t.path))} in {len(t.part_names())} part(s)",
        "",
        f"{'dataset':<16} {'requests':>9} {'prefill tok':>12} {'decode tok':>11}",
    ]
    for row in per.iter_rows(named=True):
        lines.append(f"{row['dataset']:<16} {row['requests']:>9} {row['prefill_tokens']:>12} {row['decode_tokens']:>11}")
    if per.height:
        lines.append(
            f"{'total':<16} {per['requests'].sum():>9} {per['prefill_tokens'].sum():>12} {per['decode_tokens'].sum():>11}"
        )
    return "\n".join(lines)
