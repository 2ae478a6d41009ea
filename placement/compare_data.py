"""What ``compare``, ``place`` and ``advise`` read from a trace: ``TraceData`` (per-request counts per
stage, the held-out split, the held-out requests' tokens), ``load_trace_data`` (count, split, cap the
requests kept) and ``with_held_out_tokens`` (one more pass for the held-out tokens); the request caps
as compare.json records them and the check that data and config agree on them.

Shape legend (docs/architecture.md): R requests, L MoE layers, E logical experts, K top-k slots,
T tokens.

Out of scope: the config (``compare_config``); placing (``compare_placing``); a load profile's
drawn tokens (``profile_batches``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.compare_config import MAX_TEST_REQUESTS, MAX_TRAIN_REQUESTS, CompareConfig
from moetrace.placement.held_out import held_out_R

if TYPE_CHECKING:
    from moetrace.tracer.trace.reader import TokenArrays, Trace
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "MAX_PREFILL_TOKENS",
    "TraceData",
    "check_caps",
    "held_out_nbytes",
    "load_trace_data",
    "request_caps",
    "with_held_out_tokens",
]


#: the most held-out prompt tokens kept for the prefill steps (a uniform, seeded sample of them beyond)
MAX_PREFILL_TOKENS = 1 << 17
#: rows the prefill sample's array is sized for (the seeded sample keeps about MAX_PREFILL_TOKENS; it stops here)
_PREFILL_ROWS = MAX_PREFILL_TOKENS + (1 << 14)


@dataclass(frozen=True, kw_only=True)
class TraceData:
    """What placement and evaluation read from a trace."""

    model: ModelInfo  # the traced model
    trace_path: str  # where it came from
    prefill_RLE: np.ndarray  # [R, L, E] prefill token counts, unsigned (count_trace's smallest safe dtype)
    decode_RLE: np.ndarray  # [R, L, E] decode token counts, same dtype
    is_test_R: np.ndarray  # bool [R] held out from placement
    test_topk_ids_TLK: (
        np.ndarray | None
    )  # int16 [T, L, K] held-out decode tokens with a recorded id (None: not read yet)
    test_req_T: (
        np.ndarray | None
    )  # int64 [T] row (0..R-1) of each held-out token's request, ascending (None: not read yet)
    test_prefill_ids_TLK: np.ndarray | None = (
        None  # int16 [T', L, K] a seeded sample (MAX_PREFILL_TOKENS) of the held-out prompt tokens
    )
    test_prefill_req_T: np.ndarray | None = None  # int64 [T'] row of each one's request, ascending
    stages: frozenset[str] = frozenset({"prefill", "decode"})  # routing stages the trace recorded (schema.stages_of)
    allow_incomplete: bool = False  # read from a trace without its completion mark (for the held-out tokens' pass)
    # N > 0: ``prefill_RLE`` holds each request's first N generated tokens (what the routers see, a what-if),
    # and ``decode_RLE`` and the held-out tokens only the later ones
    route_first_decode: int = 0
    request_unit: str = "request"  # what a trace request is (manifest collection.request_unit; "forward pass": an import without request ids)
    # int64 [R] the row in the trace's requests table (``Trace.request_arrays``) of each row here, ascending;
    # None: every request of the trace, in that order (or no trace: a load profile)
    trace_rows_R: np.ndarray | None = None
    num_trace_requests: int | None = None  # requests in the trace (R when nothing was capped; None: a load profile)
    num_trace_train_requests: int | None = None  # training requests of the split before the cap (None: a load profile)
    num_trace_test_requests: int | None = None  # held-out requests of the split before the cap
    max_train_requests: int | None = None  # the cap applied to the training requests (None: a load profile)
    max_test_requests: int | None = None  # the cap applied to the held-out requests

    @property
    def routable(self) -> bool:
        """Whether a router has something to route on: prefill routing, or the first generated tokens."""
        return "prefill" in self.stages or self.route_first_decode > 0

    tokens_from: str | None = (
        None  # None: the trace's held-out requests; else how the tokens were drawn (profile_batches)
    )


def load_trace_data(
    trace: str | os.PathLike,
    *,
    test_fraction: float,
    seed: int,
    allow_incomplete: bool = False,
    progress: Callable[[int, int], None] | None = None,
    held_out_tokens: bool = True,
    held_out_max_bytes: int | None = None,
    route_first_decode: int = 0,
    max_train_requests: int = MAX_TRAIN_REQUESTS,
    max_test_requests: int = MAX_TEST_REQUESTS,
) -> TraceData:
    """Count the trace, split train/test and (``held_out_tokens``) keep the held-out requests' decode
    tokens, collected in the counting pass. ``held_out_max_bytes``: keep them only when they take at
    most this many bytes (the requests table's bound), else leave them to ``with_held_out_tokens``
    (``compare`` reads large ones after placing, so that placing and holding them never add up in
    memory); None: always.

    Bounded memory: after the split (every request of the trace, as without caps), at most
    ``max_train_requests`` training and ``max_test_requests`` held-out requests are kept (seeded
    uniform samples of each, ``CompareConfig``'s fields of the same names); only they are counted and
    only their tokens read, so the counts hold at most the sum of the caps' rows. The rows of the
    result are the kept requests in trace order (``TraceData.trace_rows_R``); below both caps they are
    every request, and nothing changes.

    ``progress(tokens_done, tokens_total)`` is passed to the counting pass (``count_trace``).
    ``route_first_decode`` N > 0: the what-if of ``CompareConfig.route_first_decode`` (one more pass
    counts each request's first N generated tokens).
    """
    from moetrace.analysis.counts import count_trace
    from moetrace.tracer.trace.reader import open_trace
    from moetrace.tracer.trace.schema import STAGE_DECODE, stages_of

    tr = open_trace(trace, require_complete=not allow_incomplete)
    stages = stages_of(tr)
    if STAGE_DECODE not in stages:
        raise TraceFormatError(
            f"{trace}: recorded prefill routing only (manifest collection.stages); placements are built "
            "from decode counts and the all-to-all model simulates decode steps: use a trace with "
            "decode routing"
        )
    if max_train_requests < 1 or max_test_requests < 1:
        raise ConfigError(f"request caps must be >= 1, got {max_train_requests}, {max_test_requests}")
    R = len(tr.request_arrays.request_id_R)
    if R < 4:
        raise TraceFormatError(f"{trace}: {R} requests; placement needs at least 4 (some to train, some to test)")
    is_test_all = held_out_R(R, test_fraction=test_fraction, seed=seed)
    n_test = int(is_test_all.sum())
    keep_rng = np.random.default_rng([seed, 27])  # its own stream: the split is the same with or without caps
    keep = np.sort(
        np.concatenate(
            [
                _sample_rows(np.flatnonzero(~is_test_all), max_train_requests, keep_rng),
                _sample_rows(np.flatnonzero(is_test_all), max_test_requests, keep_rng),
            ]
        )
    )
    capped = len(keep) < R
    is_test = is_test_all[keep]
    held_out = None
    if held_out_tokens:
        held_out = _HeldOut(
            tr,
            is_test_R=is_test,
            trace_rows_R=keep if capped else None,
            stages=stages,
            route_first_decode=route_first_decode,
        )
        if held_out_max_bytes is not None and held_out.nbytes > held_out_max_bytes:
            held_out = None
    counts = count_trace(
        tr,
        allow_incomplete=allow_incomplete,
        progress=progress,
        rows=keep if capped else None,
        on_batch=None if held_out is None else held_out.add,
    )
    _release_arrow_memory()
    route_RLE, decode_RLE = counts.stage("prefill"), counts.stage("decode")  # views of one counts array
    if route_first_decode > 0:  # one more pass: each request's first N generated tokens
        prompt_R = tr.request_arrays.prompt_tokens_R
        route_RLE = count_trace(
            tr,
            stages=[STAGE_DECODE],
            allow_incomplete=allow_incomplete,
            rows=keep,
            keep_T=lambda ta: ta.position_T - prompt_R[ta.row_T] < route_first_decode,
        ).stage(STAGE_DECODE)
        _release_arrow_memory()
        decode_RLE = decode_RLE - route_RLE  # the later tokens (the first ones are a subset: never below 0)
    data = TraceData(
        model=tr.model,
        trace_path=str(trace),
        prefill_RLE=route_RLE,
        decode_RLE=decode_RLE,
        is_test_R=is_test,
        test_topk_ids_TLK=None,
        test_req_T=None,
        stages=stages,
        allow_incomplete=allow_incomplete,
        route_first_decode=route_first_decode,
        request_unit=str((tr.manifest.get("collection") or {}).get("request_unit") or "request"),
        trace_rows_R=keep if capped else None,
        num_trace_requests=R,
        num_trace_train_requests=R - n_test,
        num_trace_test_requests=n_test,
        max_train_requests=max_train_requests,
        max_test_requests=max_test_requests,
    )
    return data if held_out is None else held_out.finish(data)


def _sample_rows(rows: np.ndarray, cap: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` itself when it has at most ``cap`` entries, else a uniform sample of ``cap`` of them
    (without replacement, ascending)."""
    if len(rows) <= cap:
        return rows
    return np.sort(rng.choice(rows, size=cap, replace=False))


def _release_arrow_memory() -> None:
    """Give back the pages Arrow's allocator keeps after a pass over the trace (RSS, not correctness)."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def held_out_nbytes(data: TraceData) -> int:
    """About the bytes ``with_held_out_tokens`` holds for ``data``: the held-out requests' decode ids and
    the prefill sample (int16 [T, L, K] each), estimated from the counts already in memory (a token
    adds K ids over each layer's experts); 0 when they are read already."""
    if data.test_topk_ids_TLK is not None:
        return 0
    test = np.flatnonzero(data.is_test_R)
    L, K = data.decode_RLE.shape[1], max(data.model.top_k, 1)

    def tokens(x_RLE: np.ndarray) -> int:  # summed a chunk of rows at a time: no copy of the selected rows
        ids = sum(int(x_RLE[test[lo : lo + 1024]].sum(dtype=np.int64)) for lo in range(0, len(test), 1024))
        return ids // (L * K)

    prefill = min(tokens(data.prefill_RLE), _PREFILL_ROWS) if "prefill" in data.stages else 0
    return (tokens(data.decode_RLE) + prefill) * L * K * np.dtype(np.int16).itemsize


def with_held_out_tokens(data: TraceData) -> TraceData:
    """``data`` with ``test_topk_ids_TLK`` / ``test_req_T`` read from its trace (itself if they are): one
    pass over the trace (``load_trace_data`` collects them in its counting pass instead)."""
    from moetrace.tracer.trace.reader import open_trace

    if data.test_topk_ids_TLK is not None:
        return data
    tr = open_trace(data.trace_path, require_complete=not data.allow_incomplete)
    held_out = _HeldOut(
        tr,
        is_test_R=data.is_test_R,
        trace_rows_R=data.trace_rows_R,
        stages=data.stages,
        route_first_decode=data.route_first_decode,
    )
    for ta in tr.iter_token_arrays(batch_tokens=1 << 14):
        held_out.add(ta)
    _release_arrow_memory()
    return held_out.finish(data)


class _HeldOut:
    """The held-out requests' tokens, collected from the batches of one pass over a trace (``add``, in the
    trace's order), then set on the data (``finish``): the decode rows with a recorded id (but a
    ``route_first_decode`` request's first N), and a seeded uniform sample of ``MAX_PREFILL_TOKENS`` of
    the prompt rows. They are written in place into arrays sized from the requests table (an upper
    bound: rows with no recorded id are skipped): no list of parts and no concatenated copy, and pages
    never written are never resident."""

    def __init__(
        self,
        tr: Trace,
        *,
        is_test_R: np.ndarray,
        trace_rows_R: np.ndarray | None,
        stages: frozenset[str],
        route_first_decode: int,
    ) -> None:
        L, K = tr.model.num_moe_layers, tr.model.top_k
        self.path, self.route_first_decode = str(tr.path), route_first_decode
        self.req_table = req_table = tr.request_arrays  # sorted by request id (the rows of the counts when uncapped)
        trace_rows = np.arange(len(is_test_R)) if trace_rows_R is None else trace_rows_R
        self.row_map = np.full(len(req_table.request_id_R), -1, dtype=np.int64)  # trace row -> row (-1: not kept)
        self.row_map[trace_rows] = np.arange(len(trace_rows))
        self.is_test_x = np.append(is_test_R, False)  # indexed by row_map: -1 (a request not kept) reads False
        self.bound = int(req_table.output_tokens_R[trace_rows[is_test_R]].sum(dtype=np.int64))
        self.with_prefill = "prefill" in stages
        p_bound = int(req_table.prompt_tokens_R[trace_rows[is_test_R]].sum(dtype=np.int64)) if self.with_prefill else 0
        self.keep_share = min(1.0, MAX_PREFILL_TOKENS / max(p_bound, 1))  # a uniform sample of the prompt tokens
        self.p_rng = np.random.default_rng([len(is_test_R), 11])
        self.ids: np.ndarray | None = None  # allocated on the first batch: not before the caller decides to read
        self.shape = (self.bound, L, K), (min(p_bound, _PREFILL_ROWS), L, K)
        #: the most bytes the two arrays can hold (what ``load_trace_data``'s ``held_out_max_bytes`` weighs)
        self.nbytes = sum(int(np.prod(shape)) for shape in self.shape) * np.dtype(np.int16).itemsize
        self.req_parts: list[np.ndarray] = []
        self.p_req_parts: list[np.ndarray] = []
        self.n = self.pn = 0

    def add(self, ta: TokenArrays) -> None:
        if self.ids is None:
            self.ids, self.p_ids = (np.empty(shape, dtype=np.int16) for shape in self.shape)
        trace_row = np.searchsorted(self.req_table.request_id_R, ta.request_id_T)
        row = self.row_map[trace_row]
        recorded = (ta.topk_ids_TLK >= 0).any(axis=(1, 2))
        keep = ta.is_decode_T & self.is_test_x[row] & recorded
        if self.route_first_decode:  # the router saw the first N generated tokens: simulate the later ones
            keep &= ta.position_T - self.req_table.prompt_tokens_R[trace_row] >= self.route_first_decode
        k = int(keep.sum())
        if self.n + k > self.bound:  # the reader checked every row against the requests table: cannot happen
            raise AssertionError(f"{self.path}: more held-out decode rows than the requests table claims")
        self.ids[self.n : self.n + k] = ta.topk_ids_TLK[keep]
        self.req_parts.append(row[keep])
        self.n += k
        if self.with_prefill:
            pkeep = ~ta.is_decode_T & self.is_test_x[row] & recorded & (self.p_rng.random(len(row)) < self.keep_share)
            pk = min(int(pkeep.sum()), len(self.p_ids) - self.pn)
            sel = np.flatnonzero(pkeep)[:pk]
            self.p_ids[self.pn : self.pn + pk] = ta.topk_ids_TLK[sel]
            self.p_req_parts.append(row[sel])
            self.pn += pk

    def finish(self, data: TraceData) -> TraceData:
        if self.n == 0 or self.ids is None:
            raise TraceFormatError(
                f"{data.trace_path}: the held-out requests have no decode tokens; the volume model needs decode steps"
            )
        req = np.concatenate(self.req_parts)
        ids = self.ids[: self.n]
        if (np.diff(req) < 0).any():  # rows not in request order (e.g. shards interleaved): one reordered copy
            order = np.argsort(req, kind="stable")
            ids, req = ids[order], req[order]
        p_req = np.concatenate(self.p_req_parts) if self.p_req_parts else np.zeros(0, dtype=np.int64)
        p_out = self.p_ids[: self.pn]
        if (np.diff(p_req) < 0).any():
            order = np.argsort(p_req, kind="stable")
            p_out, p_req = p_out[order], p_req[order]
        return replace(
            data,
            test_topk_ids_TLK=ids,
            test_req_T=req,
            test_prefill_ids_TLK=p_out if self.pn else None,
            test_prefill_req_T=p_req if self.pn else None,
        )


def check_caps(data: TraceData, cfg: CompareConfig) -> None:
    """``ConfigError`` when ``data`` was loaded with other request caps than ``cfg`` asks for."""
    if data.max_train_requests is None:  # a load profile: no requests to cap
        return
    if (data.max_train_requests, data.max_test_requests) != (cfg.max_train_requests, cfg.max_test_requests):
        raise ConfigError(
            f"the trace data was loaded with request caps {data.max_train_requests} train / {data.max_test_requests} "
            f"held out, the config asks for {cfg.max_train_requests} / {cfg.max_test_requests}: pass the config's "
            "max_train_requests and max_test_requests to load_trace_data"
        )


def request_caps(data: TraceData) -> dict[str, int | None]:
    """What compare.json and a placement file's ``source`` record of the request caps: the trace's
    requests and split before them, and the caps (None each for a load profile)."""
    return {
        "num_trace_requests": data.num_trace_requests,
        "num_trace_train_requests": data.num_trace_train_requests,
        "num_trace_test_requests": data.num_trace_test_requests,
        "max_train_requests": data.max_train_requests,
        "max_test_requests": data.max_test_requests,
    }
