"""A short text summary of a trace (``moetrace info``)."""

from __future__ import annotations

import os

import numpy as np

from moetrace.sizes import dir_bytes, human_bytes
from moetrace.tracer.trace.reader import open_trace


def trace_summary(path: str | os.PathLike, *, allow_incomplete: bool = False) -> str:
    """Model, backend, per-dataset request and token counts, and size on disk, as text."""
    t = open_trace(path, require_complete=not allow_incomplete)
    m = t.model
    per: list[tuple[str, int, int, int]] = []
    if t.part_names():
        req = t.request_arrays  # checked: ids, lengths, nulls, and lengths against the routing rows
        names, inv = np.unique(req.dataset_R, return_inverse=True)
        count = np.bincount(inv, minlength=len(names))
        pre = np.bincount(inv, weights=req.prompt_tokens_R, minlength=len(names)).astype(np.int64)
        dec = np.bincount(inv, weights=req.output_tokens_R, minlength=len(names)).astype(np.int64)
        per = [(str(n), int(c), int(p_), int(d)) for n, c, p_, d in zip(names, count, pre, dec)]
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
    for name, n, pre_tok, dec_tok in per:
        lines.append(f"{name:<16} {n:>9} {pre_tok:>12} {dec_tok:>11}")
    if per:
        totals = [sum(col) for col in list(zip(*per))[1:]]
        lines.append(f"{'total':<16} {totals[0]:>9} {totals[1]:>12} {totals[2]:>11}")
    return "\n".join(lines)
