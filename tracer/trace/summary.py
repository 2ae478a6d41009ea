"""A short text summary of a trace (``moetrace info``).

Token counts come in two kinds. The requests table's ``prompt_tokens`` / ``output_tokens`` are the
positions of the trace (one routing row each); a row is *recorded* when it holds a routed id at
some MoE layer and *unrecorded* when its ids are all ``-1``: the final generated token (never
forwarded), prefix-cache hits, and a single-stage import's other stage (a decode-only capture's
prompt rows). ``info`` shows both, per dataset and stage, and how many MoE layers hold any
recorded id (a partial capture records a few of them).

Shape legend (docs/architecture.md): T tokens (rows), L MoE layers, K top-k slots, D datasets,
S stages (prefill, decode).

Out of scope: routing statistics (``moetrace analyze``), checking the trace (``validate``; the
reader checks every row it reads here too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from moetrace.sizes import dir_bytes, human_bytes
from moetrace.tracer.trace.reader import Trace, open_trace


@dataclass(frozen=True, kw_only=True)
class RecordedTokens:
    """Rows of a trace per dataset and stage, split by whether any routing was recorded in them."""

    datasets: tuple[str, ...]  # labels of axis D, sorted
    requests_D: np.ndarray  # int64 [D], requests per dataset
    tokens_DS: np.ndarray  # int64 [D, 2], rows per dataset and stage (prefill, decode)
    recorded_DS: np.ndarray  # int64 [D, 2], rows with at least one id != -1
    recorded_layers_L: np.ndarray  # bool [L], MoE layers where some row has a recorded id

    @property
    def unrecorded_DS(self) -> np.ndarray:
        """int64 [D, 2]: rows whose ids are all -1."""
        return self.tokens_DS - self.recorded_DS


def recorded_tokens(trace: Trace) -> RecordedTokens:
    """One checked pass over the routing rows: recorded and unrecorded rows per dataset and stage."""
    req = trace.request_arrays  # checked: ids, lengths, nulls, and lengths against the routing rows
    names, inv_R = np.unique(req.dataset_R, return_inverse=True)
    D = len(names)
    tokens_DS = np.stack(
        [
            np.bincount(inv_R, weights=req.prompt_tokens_R, minlength=D),
            np.bincount(inv_R, weights=req.output_tokens_R, minlength=D),
        ],
        axis=1,
    ).astype(np.int64)
    recorded_DS = np.zeros((D, 2), np.int64)
    layers_L = np.zeros(trace.model.num_moe_layers, bool)
    for b in trace.iter_token_arrays():
        routed_TL = (b.topk_ids_TLK != -1).any(axis=2)
        layers_L |= routed_TL.any(axis=0)
        rec_T = routed_TL.any(axis=1)
        cell_T = inv_R[b.row_T[rec_T]] * 2 + b.is_decode_T[rec_T]
        recorded_DS += np.bincount(cell_T, minlength=2 * D).reshape(D, 2)
    return RecordedTokens(
        datasets=tuple(str(n) for n in names),
        requests_D=np.bincount(inv_R, minlength=D).astype(np.int64),
        tokens_DS=tokens_DS,
        recorded_DS=recorded_DS,
        recorded_layers_L=layers_L,
    )


def trace_summary(path: str | os.PathLike, *, allow_incomplete: bool = False) -> str:
    """Model, backend, per-dataset requests and recorded/unrecorded tokens per stage, and size on disk, as text."""
    t = open_trace(path, require_complete=not allow_incomplete)
    m = t.model
    rec = recorded_tokens(t) if t.part_names() else None
    layers = ""
    if rec is not None and not rec.recorded_layers_L.all():
        on = np.flatnonzero(rec.recorded_layers_L).tolist()
        layers = f"; routing recorded at {len(on)} of them (MoE-layer ordinals {on})" if on else "; no routing recorded"
    lines = [
        f"trace      {t.path}  ({'complete' if t.complete else 'INCOMPLETE'})",
        f"model      {m.name}  [{m.architecture}]  source {m.source}",
        f"routing    {m.num_moe_layers} MoE layers of {m.num_hidden_layers}, {m.num_experts} experts, top-{m.top_k}"
        + (f", {m.n_group} groups (top-{m.topk_group})" if m.n_group else "")
        + layers,
        f"backend    {t.manifest.get('backend', {})}",
        f"size       {human_bytes(dir_bytes(t.path))} in {len(t.part_names())} part(s)",
        "",
        f"{'':<16} {'':>9} {'prefill tokens':>25} {'decode tokens':>25}",
        f"{'dataset':<16} {'requests':>9} {'recorded':>12} {'unrecorded':>12} {'recorded':>12} {'unrecorded':>12}",
    ]
    if rec is None:
        return "\n".join(lines)
    cells_DN = np.stack(
        [rec.recorded_DS[:, 0], rec.unrecorded_DS[:, 0], rec.recorded_DS[:, 1], rec.unrecorded_DS[:, 1]], 1
    )
    rows = [(name, int(rec.requests_D[d]), cells_DN[d]) for d, name in enumerate(rec.datasets)]
    rows.append(("total", int(rec.requests_D.sum()), cells_DN.sum(0)))
    for name, n, cells_N in rows:
        lines.append(f"{name:<16} {n:>9} " + " ".join(f"{int(c):>12}" for c in cells_N))
    lines.append(
        "unrecorded = positions whose ids are all -1 (the final generated token, prefix-cache hits, "
        "a single-stage capture's other stage)"
    )
    return "\n".join(lines)
