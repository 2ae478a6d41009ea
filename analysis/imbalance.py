"""Expert load and imbalance factor (core paper §3.2, docs/analysis.md).

Definitions, for one layer in a scope (a dataset × stage, or a batch of requests × stage):
    T       tokens routed at that layer in the scope (tokens whose ids are -1 there do not count),
            computed as sum_e counts_e / k (each routed token picks k distinct experts)
    load_e  = counts_e / (T * k / E) = counts_e * E / sum_e counts_e     (1 = exactly balanced)
    IF      = max_e load_e                                              (1 = perfectly balanced)
A scope with no routed token (e.g. a MoE layer a partial capture did not record) has load and IF
NaN and no hottest expert (null, never expert 0). Both are computed by ``moetrace.stats``
(``expert_load``, ``imbalance_factor``), the one definition the synth calibration uses too.

Shape legend (docs/architecture.md): R requests, S stages (prefill, decode), L MoE layers, E logical experts per layer,
D datasets, B batches.

Out of scope: counting (``counts``), placing experts to fix the imbalance (``placement``).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from moetrace.analysis.counts import RequestCounts, sum_by_label
from moetrace.errors import ConfigError
from moetrace.stats import expert_load, imbalance_factor

ALL = "all"  # dataset label of the scope "every request of the trace"


def scope_counts(counts: RequestCounts) -> tuple[list[str], np.ndarray]:
    """Counts summed per dataset plus the whole trace: labels ``[*datasets, "all"]``, int64 ``[D+1, S, L, E]``."""
    labels, sums_DSLE = sum_by_label(counts.counts_RSLE, counts.dataset_R)
    return [*labels, ALL], np.concatenate([sums_DSLE, sums_DSLE.sum(axis=0, keepdims=True)])


def imbalance_table(counts: RequestCounts) -> pl.DataFrame:
    """IF per dataset × stage × layer (dataset ``"all"`` = the whole trace).

    Columns: dataset str, stage str, layer int (MoE-layer ordinal), model_layer int, tokens int
    (routed tokens T), imbalance_factor float (NaN: no routed token), hottest_expert int (argmax
    load; null where no token was routed).
    """
    labels, c_DSLE = scope_counts(counts)
    if_DSL = imbalance_factor(c_DSLE)
    tokens_DSL = c_DSLE.sum(-1) // counts.top_k
    hot_DSL = c_DSLE.argmax(-1)
    routed_DSL = c_DSLE.any(-1)
    D, S, L = if_DSL.shape
    d, s, l = (a.ravel() for a in np.meshgrid(np.arange(D), np.arange(S), np.arange(L), indexing="ij"))
    return pl.DataFrame(
        {
            "dataset": [labels[i] for i in d],
            "stage": [counts.stages[i] for i in s],
            "layer": np.asarray(counts.layers)[l],
            "model_layer": np.asarray(counts.model_layers)[l],
            "tokens": tokens_DSL.ravel(),
            "imbalance_factor": if_DSL.ravel(),
            "hottest_expert": pl.Series(hot_DSL.ravel(), dtype=pl.Int64).scatter(np.flatnonzero(~routed_DSL), None),
        }
    )


def expert_load_table(counts: RequestCounts) -> pl.DataFrame:
    """The expert-load matrix layer × expert per dataset (and ``"all"``) and stage, for heatmaps.

    Columns: dataset, stage, layer, model_layer, expert, tokens (tokens routed to the expert), load.
    """
    labels, c_DSLE = scope_counts(counts)
    load = expert_load(c_DSLE)
    D, S, L, E = c_DSLE.shape
    d, s, l, e = (a.ravel() for a in np.meshgrid(np.arange(D), np.arange(S), np.arange(L), np.arange(E), indexing="ij"))
    return pl.DataFrame(
        {
            "dataset": pl.Series([labels[i] for i in range(D)]).gather(d),
            "stage": pl.Series(list(counts.stages)).gather(s),
            "layer": np.asarray(counts.layers)[l],
            "model_layer": np.asarray(counts.model_layers)[l],
            "expert": e.astype(np.int32),
            "tokens": c_DSLE.ravel(),
            "load": load.ravel(),
        }
    )


def batch_imbalance(
    counts_RSLE: np.ndarray, *, batch_size: int, seed: int, num_batches: int | None = None
) -> np.ndarray:
    """IF of random serving-sized batches: float64 ``[B, S, L]``.

    The requests are shuffled (``seed``) and cut into consecutive batches of ``batch_size``
    requests (the remainder, under one batch, is dropped; at most ``num_batches`` batches); each
    batch's counts are summed over its requests and the IF taken per stage and layer.
    """
    R = counts_RSLE.shape[0]
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    n = R // batch_size if num_batches is None else min(R // batch_size, num_batches)
    perm = np.random.default_rng(seed).permutation(R)
    out = np.empty((n, *counts_RSLE.shape[1:3]), dtype=np.float64)
    for b in range(n):
        idx = np.sort(perm[b * batch_size : (b + 1) * batch_size])
        out[b] = imbalance_factor(counts_RSLE[idx].sum(axis=0, dtype=np.int64))
    return out


def batch_imbalance_table(
    counts: RequestCounts, *, batch_size: int, seed: int, num_batches: int | None = 1000
) -> pl.DataFrame:
    """IF distribution over random batches: mixed batches (dataset ``"all"``, drawn from every
    request) and single-dataset batches (drawn from one dataset's requests, if it has at least
    ``batch_size``). Columns: dataset, batch (index), stage, layer, model_layer, imbalance_factor.
    """
    frames = []
    groups = [(ALL, np.arange(counts.num_requests))]
    groups += [(d, np.flatnonzero(counts.dataset_R == d)) for d in counts.datasets()]
    for label, idx in groups:
        if idx.size < batch_size:
            continue
        sub = counts.counts_RSLE if idx.size == counts.num_requests else counts.counts_RSLE[idx]
        if_BSL = batch_imbalance(sub, batch_size=batch_size, seed=seed, num_batches=num_batches)
        B, S, L = if_BSL.shape
        b, s, l = (a.ravel() for a in np.meshgrid(np.arange(B), np.arange(S), np.arange(L), indexing="ij"))
        frames.append(
            pl.DataFrame(
                {
                    "dataset": [label] * b.size,
                    "batch": b.astype(np.int32),
                    "stage": pl.Series(list(counts.stages)).gather(s),
                    "layer": np.asarray(counts.layers)[l],
                    "model_layer": np.asarray(counts.model_layers)[l],
                    "imbalance_factor": if_BSL.ravel(),
                }
            )
        )
    if not frames:
        raise ConfigError(
            f"batch size {batch_size} exceeds the {counts.num_requests} requests of the trace; pass a smaller --batch-size"
        )
    return pl.concat(frames)
