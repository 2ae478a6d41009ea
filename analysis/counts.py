"""Token counts per (request, stage, layer, expert): the aggregation every analysis builds on.

``count_trace(trace)`` streams the routing part files once (row group by row group, so memory is
bounded by one batch plus the result) and returns :class:`RequestCounts`, dense arrays for the
algorithms. ``write_counts_table`` writes the same numbers as a tidy Parquet table (non-zero rows
only) for polars/DuckDB.

Definition: ``counts_RSLE[r, s, l, e]`` = number of tokens of request r in stage s whose routed
top-k set at MoE layer l contains expert e. Stage is decided by position: positions below the
request's ``prompt_tokens`` are prefill (s = 0), the rest decode (s = 1), which is exactly the
``stage`` column of a valid trace (docs/trace-format.md), so the string column is never read. Ids == -1
(nothing recorded: the final generated token, prefix-cache hits) are skipped.

Shape legend (docs/architecture.md): T tokens, R requests, S stages (0 prefill, 1 decode), L MoE layers, K top-k slots
per token, E logical experts per layer, X = L*K flat ids of one token (row-major [layer][slot]),
D datasets, N rows of anything else (the kernel's layer chunks).

Counts dtype: the smallest unsigned integer that holds the largest per-request stage length among
the selected stages (uint8 up to 255 tokens, uint16 up to 65535, else uint32). A valid router picks
distinct experts per token and layer, so no count can exceed that length; the kernel still checks
for wrap-around and raises ``TraceFormatError`` if a malformed trace repeats an id within a token.

Memory: R * S * L * E * itemsize bytes, e.g. DeepSeek-V3 (L=58, E=256) with 100k requests and
both stages in uint16 is 5.9 GB; select one stage, a few layers or a sample of requests (``rows``:
the other requests' tokens are skipped) to shrink it.

Out of scope: metrics over the counts (``imbalance``, ``correlation``, ...), token-level statistics
that need the full top-k set of one token (``affinity``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace._deps import require
from moetrace.atomic import atomic_path
from moetrace.errors import ConfigError, TraceFormatError
from moetrace.results import ANALYSIS, COUNTS, table_metadata
from moetrace.tracer.trace.reader import TokenArrays, Trace, open_trace
from moetrace.tracer.trace.schema import STAGE_DECODE, STAGE_PREFILL, STAGES, Stage

__all__ = ["RequestCounts", "count_trace", "count_arrays", "write_counts_table", "STAGES"]


@dataclass(frozen=True, kw_only=True)
class RequestCounts:
    """Per-request token counts, dense.

    Rows are the trace's requests sorted by ``request_id``. Axis S holds ``stages`` in the order
    given (default ``("prefill", "decode")``), axis L the selected MoE layers ``layers``.
    """

    request_id_R: np.ndarray  # int64, ascending, unique
    dataset_R: np.ndarray  # str (numpy unicode), the request's dataset label
    prompt_tokens_R: np.ndarray  # int32, prompt length (prefill positions)
    output_tokens_R: np.ndarray  # int32, generated length (decode positions, incl. the final unrouted token)
    counts_RSLE: np.ndarray  # uint8/16/32 [R, S, L, E], tokens of request r in stage s routed to expert e at layer l
    stages: tuple[str, ...]  # names of axis S ("prefill", "decode")
    layers: tuple[int, ...]  # MoE-layer ordinals (0..num_moe_layers-1) of axis L
    model_layers: tuple[int, ...]  # the model's layer index of each entry of ``layers``
    num_experts: int  # E
    top_k: int  # K

    @property
    def num_requests(self) -> int:
        return int(self.request_id_R.shape[0])

    def stage(self, name: Stage) -> np.ndarray:
        """``counts_RLE`` of one stage (a view, no copy)."""
        if name not in self.stages:
            raise ConfigError(
                f"stage {name!r} was not counted (have {list(self.stages)}); count it with stages=[..., {name!r}]"
            )
        return self.counts_RSLE[:, self.stages.index(name)]

    def datasets(self) -> list[str]:
        """Dataset labels present, sorted."""
        return sorted(set(self.dataset_R.tolist()))

    def empty_layers(self) -> dict[str, list[int]]:
        """Per counted stage, the MoE-layer ordinals (of ``layers``) where no request has a recorded id.

        A partial capture (one layer of 24 recorded) leaves the others empty; their statistics are
        NaN (null for ids) and every mean over layers leaves them out.
        """
        routed_SL = np.asarray(self.counts_RSLE.any(axis=(0, 3)), dtype=bool)
        return {s: [self.layers[l] for l in np.flatnonzero(~routed_SL[i])] for i, s in enumerate(self.stages)}


# ---------------------------------------------------------------------------------- the kernel
_KERNELS: dict[str, Callable] = {}


def _kernel() -> Callable:
    """The numba counting kernel, compiled on first use (cached on disk by numba)."""
    if "count" in _KERNELS:
        return _KERNELS["count"]
    numba = require("numba", purpose="the fast expert-count kernel of `moetrace analyze`")

    @numba.njit(parallel=True, cache=True, nogil=True)
    def count_kernel(counts_RSLE, row_T, stage_T, topk_ids_TX, layers_L, top_k, num_chunks):
        # counts_RSLE: unsigned [R, S, L_sel, E]; row_T: int64 row of each token (-1: skip token);
        # stage_T: int8 index into axis S (-1: stage not selected); topk_ids_TX: int16 [T, L_all*K];
        # layers_L: int64 MoE-layer ordinal of each selected layer. Each thread owns a contiguous
        # chunk of the selected layers (no two threads write one cell) and streams the tokens in
        # order, reading its part of each row. Returns the number of bad ids (>= E) and overflows.
        T = topk_ids_TX.shape[0]
        E = counts_RSLE.shape[3]
        n_sel = layers_L.shape[0]
        bad_N = np.zeros(num_chunks, dtype=np.int64)
        for c in numba.prange(num_chunks):
            lo = c * n_sel // num_chunks
            hi = (c + 1) * n_sel // num_chunks
            bad = 0
            for t in range(T):
                r = row_T[t]
                s = stage_T[t]
                if r < 0 or s < 0:
                    continue
                for j in range(lo, hi):
                    base = layers_L[j] * top_k
                    for k in range(top_k):
                        e = topk_ids_TX[t, base + k]
                        if e >= 0:
                            if e < E:
                                counts_RSLE[r, s, j, e] += 1
                                if counts_RSLE[r, s, j, e] == 0:
                                    bad += 1
                            else:
                                bad += 1
            bad_N[c] = bad
        return bad_N.sum()

    _KERNELS["count"] = count_kernel
    return count_kernel


def count_arrays(
    counts_RSLE: np.ndarray,
    *,
    row_T: np.ndarray,
    stage_T: np.ndarray,
    topk_ids_TX: np.ndarray,
    layers_L: np.ndarray,
    top_k: int,
) -> None:
    """Add one batch of tokens to ``counts_RSLE`` in place (the pure array form of the aggregation).

    counts_RSLE: uint8/16/32 ``[R, S, L_sel, E]``; row_T: int64 ``[T]`` row of each token in R (-1
    skips the token); stage_T: int8 ``[T]`` index into axis S (-1 skips); topk_ids_TX: int16 ``[T, L*K]``
    row-major ``[layer][slot]`` (-1 ids skipped); layers_L: int64 ``[L_sel]`` MoE-layer ordinals to
    count, in the order of axis L. Raises ``TraceFormatError`` on an id >= E or a count overflow
    (an expert repeated within one token's top-k).
    """
    from moetrace.analysis.jit import run_kernel
    from moetrace.analysis.kernels_numpy import count_numpy

    bad = run_kernel(
        "expert-count",
        _kernel,
        count_numpy,
        counts_RSLE,
        np.ascontiguousarray(row_T, dtype=np.int64),
        np.ascontiguousarray(stage_T, dtype=np.int8),
        np.ascontiguousarray(topk_ids_TX, dtype=np.int16),
        np.ascontiguousarray(layers_L, dtype=np.int64),
        int(top_k),
        max(1, min(len(layers_L), _num_threads())),
    )
    if bad:
        raise TraceFormatError(
            f"{bad} expert ids are >= num_experts={counts_RSLE.shape[3]} or repeat within one token's top-k "
            "(a count overflowed); the trace is malformed: run `moetrace validate` on it"
        )


def _num_threads() -> int:
    return int(require("numba", purpose="the fast expert-count kernel").get_num_threads())


# ---------------------------------------------------------------------------------- streaming
def _counts_dtype(max_count: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32):
        if max_count <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)


def count_trace(
    trace: Trace | str | os.PathLike,
    *,
    stages: Sequence[Stage] = STAGES,
    layers: Sequence[int] | None = None,
    allow_incomplete: bool = False,
    batch_tokens: int = 1 << 16,
    progress: Callable[[int, int], None] | None = None,
    rows: np.ndarray | None = None,
    keep_T: Callable[[TokenArrays], np.ndarray] | None = None,
    on_batch: Callable[[TokenArrays], None] | None = None,
) -> RequestCounts:
    """Count tokens per (request, stage, layer, expert) over a whole trace, streaming.

    Parameters
    ----------
    trace
        An opened :class:`~moetrace.tracer.trace.writer.Trace` or a trace directory.
    stages
        Stages to count, in the order of axis S (``("prefill", "decode")`` by default; pass
        ``["decode"]`` to halve the memory).
    layers
        MoE-layer ordinals (0 .. num_moe_layers-1, i.e. positions in ``model.moe_layers``, not the
        model's layer numbers) in the order of axis L; default all.
    allow_incomplete
        Count the committed part of an unfinished trace.
    batch_tokens
        Routing rows decoded per batch (bounds the streaming memory: ~ batch_tokens * L * K * 2 bytes).
    progress
        Called as ``progress(tokens_done, tokens_total)`` after each batch.
    rows
        Only these requests, int64 ``[R']`` strictly ascending rows of the requests table
        (``Trace.request_arrays``, sorted by request id); the other requests' tokens are read and
        skipped, so memory is ``R'`` requests' counts whatever the trace's size. Default all.
    keep_T
        Only the tokens of each batch for which it is True (bool ``[T]`` of a ``TokenArrays``, e.g. a
        request's first generated tokens by position); default all.
    on_batch
        Called with every batch read, after it is counted, for a caller that collects more from the
        same pass (``compare``'s held-out tokens); default none.

    Returns
    -------
    RequestCounts with ``counts_RSLE`` ``[R, len(stages), len(layers), E]`` (R: the selected
    requests, in ``rows`` order) in the smallest safe unsigned dtype (see the module docstring). Routing rows of requests missing from the requests
    table are an error (``TraceFormatError``); ids == -1 are ignored.
    """
    if not isinstance(trace, Trace):
        trace = open_trace(trace, require_complete=not allow_incomplete)
    model = trace.model
    L, K, E = model.num_moe_layers, model.top_k, model.num_experts
    stages = tuple(stages)
    if not stages or any(s not in STAGES for s in stages) or len(set(stages)) != len(stages):
        raise ConfigError(f"stages must be distinct names out of {list(STAGES)}, got {list(stages)}")
    layer_sel = tuple(range(L)) if layers is None else tuple(int(x) for x in layers)
    if not layer_sel or any(not 0 <= x < L for x in layer_sel) or len(set(layer_sel)) != len(layer_sel):
        raise ConfigError(
            f"layers must be distinct MoE-layer ordinals in 0..{L - 1} (positions in moe_layers), got {list(layer_sel)}"
        )

    rid_R, dataset_R, ptok_R, otok_R = trace.request_arrays  # checked by the reader
    row_map = None  # trace row -> row of the counts (-1: not counted); None: the identity
    if rows is not None:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim != 1 or (rows.size and (rows[0] < 0 or rows[-1] >= rid_R.shape[0])) or (np.diff(rows) <= 0).any():
            raise ConfigError(f"rows must be strictly ascending rows of the {rid_R.shape[0]} requests")
        row_map = np.full(rid_R.shape[0], -1, dtype=np.int64)
        row_map[rows] = np.arange(rows.size)
        rid_R, dataset_R, ptok_R, otok_R = rid_R[rows], dataset_R[rows], ptok_R[rows], otok_R[rows]
    R = rid_R.shape[0]
    max_len = 0
    if STAGE_PREFILL in stages and R:
        max_len = max(max_len, int(ptok_R.max()))
    if STAGE_DECODE in stages and R:
        max_len = max(max_len, int(otok_R.max()))
    counts = np.zeros((R, len(stages), len(layer_sel), E), dtype=_counts_dtype(max_len))
    # stage index of (is_decode): -1 when the stage is not selected
    stage_of = np.array([stages.index(s) if s in stages else -1 for s in STAGES], dtype=np.int8)
    layers_arr = np.asarray(layer_sel, dtype=np.int64)

    total = trace.num_tokens()
    done = 0
    for ta in trace.iter_token_arrays(batch_tokens=batch_tokens):  # checked against the manifest, row by row
        T = ta.row_T.shape[0]
        count_arrays(
            counts,
            row_T=ta.row_T if row_map is None else row_map[ta.row_T],
            stage_T=stage_of[ta.is_decode_T.view(np.int8)]
            if keep_T is None
            else np.where(keep_T(ta), stage_of[ta.is_decode_T.view(np.int8)], np.int8(-1)),
            topk_ids_TX=ta.topk_ids_TLK.reshape(T, L * K),
            layers_L=layers_arr,
            top_k=K,
        )
        if on_batch is not None:
            on_batch(ta)
        done += T
        if progress is not None:
            progress(done, total)

    return RequestCounts(
        request_id_R=rid_R,
        dataset_R=dataset_R,
        prompt_tokens_R=ptok_R,
        output_tokens_R=otok_R,
        counts_RSLE=counts,
        stages=stages,
        layers=layer_sel,
        model_layers=tuple(model.moe_layers[i] for i in layer_sel),
        num_experts=E,
        top_k=K,
    )


# ---------------------------------------------------------------------------------- tidy table
COUNTS_TABLE_SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.int64(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("model_layer", pa.int16(), nullable=False),
        pa.field("expert", pa.int16(), nullable=False),
        pa.field("count", pa.int32(), nullable=False),
    ]
)


def write_counts_table(counts: RequestCounts, path: str | os.PathLike, *, chunk_requests: int = 4096) -> int:
    """Write the non-zero cells of ``counts`` as a tidy Parquet table; returns the number of rows.

    Columns: ``request_id`` int64, ``dataset`` string, ``stage`` string (prefill/decode), ``layer``
    int16 (MoE-layer ordinal), ``model_layer`` int16 (the model's layer index), ``expert`` int16,
    ``count`` int32 (tokens). Rows ordered by request, stage, layer, expert. Written in request
    chunks (bounded memory), to a temporary name and renamed.
    """
    stage_names = pa.array(list(counts.stages))
    model_layer = np.asarray(counts.model_layers, dtype=np.int16)
    layer = np.asarray(counts.layers, dtype=np.int16)
    n = 0
    schema = COUNTS_TABLE_SCHEMA.with_metadata(table_metadata(ANALYSIS, COUNTS))  # its format and version
    with atomic_path(path) as tmp, pq.ParquetWriter(tmp, schema, compression="zstd") as w:
        for lo in range(0, counts.num_requests, chunk_requests):
            block = counts.counts_RSLE[lo : lo + chunk_requests]
            r, s, l, e = np.nonzero(block)
            if r.size == 0:
                continue
            r = r + lo
            cols = [
                pa.array(counts.request_id_R[r]),
                pa.array(counts.dataset_R[r].tolist(), type=pa.string()),
                stage_names.take(pa.array(s)),
                pa.array(layer[l]),
                pa.array(model_layer[l]),
                pa.array(e.astype(np.int16)),
                pa.array(block[r - lo, s, l, e].astype(np.int32)),
            ]
            w.write_batch(pa.RecordBatch.from_arrays(cols, schema=schema))
            n += r.size
    return n


# ---------------------------------------------------------------------------------- group sums
def sum_by_label(
    counts_R_: np.ndarray, label_R: np.ndarray, *, chunk_requests: int = 2048
) -> tuple[list[str], np.ndarray]:
    """Sum per-request counts over the requests of each label.

    counts_R_: ``[R, ...]`` any integer dtype; label_R: ``[R]`` labels (e.g. datasets). Returns the
    sorted labels and int64 sums ``[D, ...]``, summed in request chunks (no full-size temporary).
    """
    labels, inv = np.unique(np.asarray(label_R), return_inverse=True)
    out = np.zeros((len(labels), *counts_R_.shape[1:]), dtype=np.int64)
    for d in range(len(labels)):
        idx = np.flatnonzero(inv == d)
        for lo in range(0, idx.size, chunk_requests):
            out[d] += counts_R_[idx[lo : lo + chunk_requests]].sum(axis=0, dtype=np.int64)
    return [str(x) for x in labels], out
