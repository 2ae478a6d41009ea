"""Token-level statistics beyond the paper: cross-layer affinity and expert co-activation.

Both need a token's whole top-k set, so they come from a second streaming pass over the routing
rows (``pair_counts``), on a uniform random sample of at most ``max_tokens`` tokens (seeded; each
token is kept with probability min(1, max_tokens / T)). Ids == -1 are skipped.

Definitions, per MoE layer l (pairs counted over all top-k × top-k combinations of one token):
- cross-layer pair counts N_l[a, b] = sampled tokens with a in their set at layer l and b in their
  set at layer l+1 (consecutive MoE layers; the last layer has none). From P = N / sum(N):
  mutual_information_bits I(A;B) (plug-in estimate), uncertainty_coefficient = I(A;B) / H(B) in
  [0, 1] (the share of the layer-(l+1) expert's entropy explained by the layer-l expert; 1 = fully
  determined, 0 = independent); top1_predictability = sum_a max_b N[a, b] / sum(N) (guessing the
  most frequent follower of each expert) against top1_marginal = max_b P(b) (guessing the most
  popular expert of layer l+1 regardless).
- co-activation C_l[a, b] (a != b) = sampled tokens whose set at layer l holds both a and b;
  lift = C_l[a, b] / (n_a n_b / T_l), with n_a tokens routed to a and T_l routed tokens at l (1 =
  as often as independent choices would pair them).

Shape legend (docs/architecture.md): T tokens, L MoE layers, K top-k slots per token, E logical experts per layer,
X = L*K flat ids of one token.

Out of scope: per-request statistics (``counts``, ``correlation``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl

from moetrace._deps import require
from moetrace.tracer.trace.reader import Trace, open_trace

_KERNELS: dict[str, Callable] = {}


def _kernel() -> Callable:
    if "pairs" in _KERNELS:
        return _KERNELS["pairs"]
    numba = require("numba", purpose="the token-level pair-count kernel of `moetrace analyze`")

    @numba.njit(parallel=True, cache=True, nogil=True)
    def pair_kernel(topk_ids_TX, keep_T, top_k, cross_LEE, co_LEE, single_LE, tokens_L, num_chunks):
        # topk_ids_TX int16 [T, L*K]; keep_T bool [T]; cross_LEE int64 [L-1, E, E]; co_LEE int64 [L, E, E];
        # single_LE int64 [L, E]; tokens_L int64 [L]. Each thread owns a contiguous chunk of layers.
        T = topk_ids_TX.shape[0]
        L = co_LEE.shape[0]
        E = co_LEE.shape[1]
        for c in numba.prange(num_chunks):
            lo = c * L // num_chunks
            hi = (c + 1) * L // num_chunks
            # layer outer, token inner: one layer's [E, E] tables stay in cache while every token passes
            for l in range(lo, hi):
                base = l * top_k
                routed_tokens = 0
                for t in range(T):
                    if not keep_T[t]:
                        continue
                    routed = False
                    for i in range(top_k):
                        a = topk_ids_TX[t, base + i]
                        if a < 0 or a >= E:
                            continue
                        routed = True
                        single_LE[l, a] += 1
                        for j in range(i + 1, top_k):
                            b = topk_ids_TX[t, base + j]
                            if b >= 0 and b < E and b != a:
                                co_LEE[l, a, b] += 1
                                co_LEE[l, b, a] += 1
                        if l + 1 < L:
                            for j in range(top_k):
                                b = topk_ids_TX[t, base + top_k + j]
                                if b >= 0 and b < E:
                                    cross_LEE[l, a, b] += 1
                    if routed:
                        routed_tokens += 1
                tokens_L[l] += routed_tokens

    _KERNELS["pairs"] = pair_kernel
    return pair_kernel


@dataclass(frozen=True, kw_only=True)
class PairCounts:
    """Token-level pair counts over a token sample."""

    cross_LEE: np.ndarray  # int64 [L-1, E, E], layer l expert a with layer l+1 expert b
    co_LEE: np.ndarray  # int64 [L, E, E], symmetric, zero diagonal: a and b in one token's set at l
    single_LE: np.ndarray  # int64 [L, E], sampled tokens routed to e at l
    tokens_L: np.ndarray  # int64 [L], sampled tokens routed at l (at least one id != -1)
    num_sampled: int  # tokens kept by the sampler
    num_tokens: int  # tokens in the trace
    model_layers: tuple[int, ...]  # model layer index of each MoE layer


def pair_counts_arrays(
    topk_ids_TLK: np.ndarray, *, num_experts: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The pure array form: (cross_LEE, co_LEE, single_LE, tokens_L) of every token of ``topk_ids_TLK`` (int16 ``[T, L, K]``)."""
    T, L, K = topk_ids_TLK.shape
    E = int(num_experts)
    out = (
        np.zeros((max(L - 1, 0), E, E), np.int64),
        np.zeros((L, E, E), np.int64),
        np.zeros((L, E), np.int64),
        np.zeros(L, np.int64),
    )
    _run(np.ascontiguousarray(topk_ids_TLK.reshape(T, L * K), dtype=np.int16), np.ones(T, bool), K, *out)
    return out


def _run(topk_ids_TX, keep_T, K, cross, co, single, tokens) -> None:
    numba = require("numba", purpose="the token-level pair-count kernel")
    L = co.shape[0]
    from moetrace.analysis.jit import run_kernel
    from moetrace.analysis.kernels_numpy import pair_numpy

    chunks = max(1, min(L, numba.get_num_threads()))
    run_kernel("pair-count", _kernel, pair_numpy, topk_ids_TX, keep_T, K, cross, co, single, tokens, chunks)


def pair_counts(
    trace: Trace | str | os.PathLike,
    *,
    max_tokens: int = 500_000,
    seed: int = 0,
    allow_incomplete: bool = False,
    batch_tokens: int = 1 << 16,
) -> PairCounts:
    """Stream the trace once and count pairs on a token sample (see the module docstring)."""
    if not isinstance(trace, Trace):
        trace = open_trace(trace, require_complete=not allow_incomplete)
    m = trace.model
    L, K, E = m.num_moe_layers, m.top_k, m.num_experts
    total = trace.num_tokens()
    p = 1.0 if total <= max_tokens else max_tokens / total
    rng = np.random.default_rng(seed)
    cross = np.zeros((max(L - 1, 0), E, E), np.int64)
    co = np.zeros((L, E, E), np.int64)
    single = np.zeros((L, E), np.int64)
    tokens = np.zeros(L, np.int64)
    kept = 0
    for ta in trace.iter_token_arrays(batch_tokens=batch_tokens):  # checked against the manifest, row by row
        T = int(ta.row_T.shape[0])
        keep = np.ones(T, bool) if p >= 1 else rng.random(T) < p
        kept += int(keep.sum())
        _run(ta.topk_ids_TLK.reshape(T, L * K), keep, K, cross, co, single, tokens)
    return PairCounts(
        cross_LEE=cross,
        co_LEE=co,
        single_LE=single,
        tokens_L=tokens,
        num_sampled=kept,
        num_tokens=total,
        model_layers=tuple(m.moe_layers),
    )


def cross_layer_affinity(cross_EE: np.ndarray) -> dict[str, float]:
    """Affinity of one layer pair from its pair counts ``[E, E]`` (rows layer l, columns l+1)."""
    n = np.asarray(cross_EE, dtype=np.float64)
    total = n.sum()
    if total == 0:
        return {
            "mutual_information_bits": np.nan,
            "uncertainty_coefficient": np.nan,
            "top1_predictability": np.nan,
            "top1_marginal": np.nan,
        }
    p = n / total
    pa, pb = p.sum(1), p.sum(0)
    nz = p > 0
    mi = float((p[nz] * np.log2(p[nz] / np.outer(pa, pb)[nz])).sum())
    hb = float(-(pb[pb > 0] * np.log2(pb[pb > 0])).sum())
    return {
        "mutual_information_bits": max(mi, 0.0),
        "uncertainty_coefficient": min(max(mi, 0.0) / hb, 1.0) if hb > 0 else np.nan,
        "top1_predictability": float(n.max(axis=1).sum() / total),
        "top1_marginal": float(pb.max()),
    }


def affinity_table(pc: PairCounts) -> pl.DataFrame:
    """Per layer pair (l, l+1). Columns: layer, model_layer, next_model_layer, mutual_information_bits,
    uncertainty_coefficient, top1_predictability, top1_marginal, pairs (pair count sum)."""
    rows = []
    for l in range(pc.cross_LEE.shape[0]):
        a = cross_layer_affinity(pc.cross_LEE[l])
        rows.append(
            {
                "layer": l,
                "model_layer": pc.model_layers[l],
                "next_model_layer": pc.model_layers[l + 1],
                **a,
                "pairs": int(pc.cross_LEE[l].sum()),
            }
        )
    schema = {
        "layer": pl.Int64,
        "model_layer": pl.Int64,
        "next_model_layer": pl.Int64,
        "mutual_information_bits": pl.Float64,
        "uncertainty_coefficient": pl.Float64,
        "top1_predictability": pl.Float64,
        "top1_marginal": pl.Float64,
        "pairs": pl.Int64,
    }
    return pl.DataFrame(rows, schema=schema)


def coactivation_lift_LEE(pc: PairCounts) -> np.ndarray:
    """float64 ``[L, E, E]``: co-activation count over its independence expectation n_a n_b / T_l (NaN where expected 0)."""
    T = pc.tokens_L.astype(np.float64)[:, None, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        exp = pc.single_LE[:, :, None].astype(np.float64) * pc.single_LE[:, None, :] / T
        return np.where(exp > 0, pc.co_LEE / exp, np.nan)


def coactivation_table(pc: PairCounts) -> pl.DataFrame:
    """Non-zero co-activation pairs, a < b. Columns: layer, model_layer, expert_a, expert_b, count, lift."""
    lift = coactivation_lift_LEE(pc)
    l, a, b = np.nonzero(np.triu(pc.co_LEE, k=1))
    return pl.DataFrame(
        {
            "layer": l.astype(np.int32),
            "model_layer": np.asarray(pc.model_layers, dtype=np.int32)[l],
            "expert_a": a.astype(np.int32),
            "expert_b": b.astype(np.int32),
            "count": pc.co_LEE[l, a, b],
            "lift": lift[l, a, b],
        }
    )
