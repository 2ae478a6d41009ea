"""Correlations of expert-count vectors (core paper §3.3, docs/analysis.md) and prefill→decode predictability.

Definitions (Pearson r over the E experts of one layer, ``moetrace.stats``: the one definition the
synth calibration uses too; NaN when either vector is constant, e.g. a scope without tokens, and
NaNs are left out of every mean):

- dataset correlation, per stage and layer: r(c_a, c_b) where c_d[e] = tokens of dataset d's
  requests in that stage routed to e. Layer-averaged matrix = mean over layers of the per-layer r.
- prefill↔decode, **pooled** (the headline): per dataset d and layer l, r(P_d, D_d) with P_d[e] =
  all prefill tokens of d's requests routed to e and D_d[e] the same for decode. Headline = mean
  over layers and datasets (each dataset weighted equally). Dataset ``"all"`` pools every request.
- prefill↔decode, **per request**: r(p_r, d_r) of one request's own prefill and decode vectors at
  layer l, then the mean over requests (requests with a constant vector, e.g. no decode token, are
  left out), per layer; headline = mean over layers.
- recall@k (what an expert prefetcher gets): for request r and layer l, the predicted set is the k
  experts with the most prefill tokens of r, the hot set the k experts with the most decode tokens
  of r (only experts with a count > 0; ties broken by lower expert id); recall = |pred ∩ hot| /
  |hot|. Baseline: predict the k experts with the most prefill tokens over the whole trace
  (popularity) instead. Requests without decode tokens at the layer are left out.

Shape legend (docs/architecture.md): R requests, S stages (prefill, decode), L MoE layers, E logical experts per layer,
D datasets, N rows of anything else (the generic helpers' rows: datasets, or requests × layers).

Out of scope: the counting itself (``counts``), token-level statistics (``affinity``).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from moetrace.analysis.counts import RequestCounts, sum_by_label
from moetrace.analysis.imbalance import ALL
from moetrace.errors import ConfigError
from moetrace.stats import dataset_correlation_LDD, pearson_paired


def _require_both_stages(counts: RequestCounts) -> tuple[int, int]:
    if "prefill" not in counts.stages or "decode" not in counts.stages:
        raise ConfigError(f"prefill↔decode analyses need both stages counted, have {list(counts.stages)}")
    return counts.stages.index("prefill"), counts.stages.index("decode")


def dataset_correlation(counts: RequestCounts) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Dataset × dataset Pearson matrices: (per layer, layer-averaged).

    Per layer columns: stage, layer, model_layer, dataset_a, dataset_b, pearson.
    Layer-averaged columns: stage, dataset_a, dataset_b, pearson (nan-mean over layers).
    """
    labels, c_DSLE = sum_by_label(counts.counts_RSLE, counts.dataset_R)
    D, S, L, _ = c_DSLE.shape
    r_SLDD = np.stack([dataset_correlation_LDD(c_DSLE[:, s]) for s in range(S)])
    s, l, a, b = (x.ravel() for x in np.meshgrid(np.arange(S), np.arange(L), np.arange(D), np.arange(D), indexing="ij"))
    per_layer = pl.DataFrame(
        {
            "stage": [counts.stages[i] for i in s],
            "layer": np.asarray(counts.layers)[l],
            "model_layer": np.asarray(counts.model_layers)[l],
            "dataset_a": [labels[i] for i in a],
            "dataset_b": [labels[i] for i in b],
            "pearson": r_SLDD.ravel(),
        }
    )
    with np.errstate(invalid="ignore"), _quiet_nanmean():
        mean_SDD = np.nanmean(r_SLDD, axis=1)
    s, a, b = (x.ravel() for x in np.meshgrid(np.arange(S), np.arange(D), np.arange(D), indexing="ij"))
    mean = pl.DataFrame(
        {
            "stage": [counts.stages[i] for i in s],
            "dataset_a": [labels[i] for i in a],
            "dataset_b": [labels[i] for i in b],
            "pearson": mean_SDD.ravel(),
        }
    )
    return per_layer, mean


def prefill_decode_pooled(counts: RequestCounts) -> pl.DataFrame:
    """Pooled prefill↔decode r per dataset (and ``"all"``) and layer.

    Columns: dataset, layer, model_layer, pearson. The headline is the mean of ``pearson`` over the
    rows whose dataset is not ``"all"`` (layers and datasets weighted equally).
    """
    ip, idec = _require_both_stages(counts)
    labels, c_DSLE = sum_by_label(counts.counts_RSLE, counts.dataset_R)
    labels = [*labels, ALL]
    c_DSLE = np.concatenate([c_DSLE, c_DSLE.sum(0, keepdims=True)])
    r_DL = pearson_paired(c_DSLE[:, ip], c_DSLE[:, idec])
    D, L = r_DL.shape
    d, l = (x.ravel() for x in np.meshgrid(np.arange(D), np.arange(L), indexing="ij"))
    return pl.DataFrame(
        {
            "dataset": [labels[i] for i in d],
            "layer": np.asarray(counts.layers)[l],
            "model_layer": np.asarray(counts.model_layers)[l],
            "pearson": r_DL.ravel(),
        }
    )


def prefill_decode_per_request_RL(counts: RequestCounts, *, chunk_requests: int = 512) -> np.ndarray:
    """Per-request prefill↔decode r: float64 ``[R, L]`` (NaN where a vector is constant)."""
    ip, idec = _require_both_stages(counts)
    R, _, L, _ = counts.counts_RSLE.shape
    out = np.empty((R, L))
    for lo in range(0, R, chunk_requests):
        block = counts.counts_RSLE[lo : lo + chunk_requests]
        out[lo : lo + chunk_requests] = pearson_paired(block[:, ip], block[:, idec])
    return out


def prefill_decode_per_request(counts: RequestCounts) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(per layer, per request) tables of the per-request prefill↔decode r.

    Per layer columns: dataset (and ``"all"``), layer, model_layer, pearson_mean (mean over the
    requests with a defined r), num_requests (how many had one). Per request columns: request_id,
    dataset, pearson_mean (nan-mean over layers), num_layers (layers with a defined r).
    """
    r_RL = prefill_decode_per_request_RL(counts)
    rows = []
    groups = [(ALL, np.ones(counts.num_requests, bool))] + [(d, counts.dataset_R == d) for d in counts.datasets()]
    for label, m in groups:
        sub = r_RL[m]
        n_L = np.isfinite(sub).sum(0)
        with _quiet_nanmean():
            mean_L = np.nanmean(sub, axis=0) if sub.shape[0] else np.full(r_RL.shape[1], np.nan)
        for l in range(r_RL.shape[1]):
            rows.append((label, counts.layers[l], counts.model_layers[l], float(mean_L[l]), int(n_L[l])))
    per_layer = pl.DataFrame(
        rows, schema=["dataset", "layer", "model_layer", "pearson_mean", "num_requests"], orient="row"
    )
    with _quiet_nanmean():
        per_req = pl.DataFrame(
            {
                "request_id": counts.request_id_R,
                "dataset": counts.dataset_R,
                "pearson_mean": np.nanmean(r_RL, axis=1),
                "num_layers": np.isfinite(r_RL).sum(1),
            }
        )
    return per_layer, per_req


def topk_sets(counts_NE: np.ndarray, k: int) -> np.ndarray:
    """Boolean ``[N, E]``: the k largest counts per row, only counts > 0, ties to the lower expert id.

    The set a stable descending sort's first k would give, found by one partition instead of a sort:
    each count is keyed ``count * E + (E - 1 - id)`` (counts are never negative, so the keys are
    distinct per row and order by count, then by lower id), and the k largest keys are kept.
    """
    c = np.asarray(counts_NE)
    E = c.shape[-1]
    if not 1 <= k <= E:
        raise ValueError(f"k must be in 1..{E}, got {k}")
    key = c.astype(np.int64) * E + np.arange(E - 1, -1, -1, dtype=np.int64)
    kth = np.partition(key, E - k, axis=-1)[..., E - k, None]  # the k-th largest key of each row
    return (key >= kth) & (c > 0)


def prefill_decode_recall(counts: RequestCounts, *, k: int | None = None, chunk_requests: int = 512) -> pl.DataFrame:
    """recall@k of a request's decode hot experts from its prefill counts, per dataset and layer.

    ``k`` defaults to the model's top-k. Columns: dataset (and ``"all"``), layer, model_layer, k,
    recall (mean over requests), recall_popularity (same, predicting the trace-wide prefill top-k),
    num_requests.
    """
    ip, idec = _require_both_stages(counts)
    k = counts.top_k if k is None else int(k)
    if not 1 <= k <= counts.num_experts:
        raise ConfigError(f"recall@k needs 1 <= k <= {counts.num_experts}, got {k}")
    R, _, L, E = counts.counts_RSLE.shape
    pop_LE = topk_sets(counts.counts_RSLE[:, ip].sum(0, dtype=np.int64), k)
    rec_RL = np.full((R, L), np.nan)
    pop_RL = np.full((R, L), np.nan)
    for lo in range(0, R, chunk_requests):
        block = counts.counts_RSLE[lo : lo + chunk_requests]
        pred = topk_sets(block[:, ip], k)
        hot = topk_sets(block[:, idec], k)
        n_hot = hot.sum(-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            rec_RL[lo : lo + chunk_requests] = np.where(n_hot > 0, (pred & hot).sum(-1) / n_hot, np.nan)
            pop_RL[lo : lo + chunk_requests] = np.where(n_hot > 0, (pop_LE[None] & hot).sum(-1) / n_hot, np.nan)
    rows = []
    groups = [(ALL, np.ones(R, bool))] + [(d, counts.dataset_R == d) for d in counts.datasets()]
    for label, m in groups:
        with _quiet_nanmean():
            rec = np.nanmean(rec_RL[m], axis=0) if m.any() else np.full(L, np.nan)
            pop = np.nanmean(pop_RL[m], axis=0) if m.any() else np.full(L, np.nan)
        n = np.isfinite(rec_RL[m]).sum(0)
        for l in range(L):
            rows.append((label, counts.layers[l], counts.model_layers[l], k, float(rec[l]), float(pop[l]), int(n[l])))
    return pl.DataFrame(
        rows,
        schema=["dataset", "layer", "model_layer", "k", "recall", "recall_popularity", "num_requests"],
        orient="row",
    )


class _quiet_nanmean:
    """Silence numpy's "Mean of empty slice" for all-NaN columns (the result is NaN, as documented)."""

    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.filterwarnings("ignore", message="Mean of empty slice", category=RuntimeWarning)

    def __exit__(self, *exc):
        return self._w.__exit__(*exc)
