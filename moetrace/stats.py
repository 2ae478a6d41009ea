"""Statistics of expert-count vectors, defined once for the whole package (core paper §3, docs/analysis.md).

Pure numpy functions of count arrays. The analysis stage (``moetrace.analysis``: ``imbalance``,
``correlation``) and the synthetic generator's calibration (``moetrace.tracer.synth_stats``) both
call them, so an imbalance factor or a correlation means the same number wherever it is computed.
A core module because the tracer may not import the analysis stage and the analysis stage reads
nothing of the tracer but the trace format (pyproject.toml, import-linter contracts).

Definitions, along the last axis (the E experts of one layer in one scope: a dataset × stage, a
batch of requests, ...; counts are tokens routed to each expert, ids == -1 never counted):

- expert load: ``load_e = counts_e / (T * K / E) = counts_e * E / sum_e counts_e`` (1 = exactly
  balanced), where T * K is the number of recorded ids of the scope;
- imbalance factor (IF): ``max_e load_e`` (1 = perfectly balanced);
- Pearson r of two count vectors over the experts, clipped to [-1, 1] (rounding can step past it);
- dataset correlation of one layer: Pearson r between every pair of datasets' count vectors.

A scope with no recorded id has load and IF NaN; a constant vector (e.g. no tokens) has r NaN.
Means over layers (``mean_skip_nan``) leave NaN out and say how many they left out: a partial
capture (one MoE layer of 24 recorded) has numbers for its recorded layers, not NaN.

Shape legend (docs/architecture.md): E experts of one layer, D datasets, L MoE layers, N rows of
anything else.

Out of scope: counting tokens (``analysis.counts``, ``synth_stats.counts_from_*``), the tables and
summaries built from these numbers, token-level statistics (``analysis.affinity``).
"""

from __future__ import annotations

import numpy as np


def expert_load(counts_E: np.ndarray) -> np.ndarray:
    """Expert load along the last axis: ``counts * E / counts.sum(-1)``; float64, NaN where the sum is 0.

    counts_E: ``[..., E]`` token counts of one layer (any leading axes, e.g. ``[S, L, E]``), any
    integer or float dtype.
    """
    c = np.asarray(counts_E, dtype=np.float64)
    total = c.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, c * c.shape[-1] / total, np.nan)


def imbalance_factor(counts_E: np.ndarray) -> np.ndarray:
    """IF = max expert load over the last axis: ``[...]`` float64, NaN where nothing was routed.

    counts_E: ``[..., E]`` token counts, as for :func:`expert_load`.
    """
    c = np.asarray(counts_E, dtype=np.float64)
    total = c.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, c.max(axis=-1) * c.shape[-1] / total, np.nan)


def pearson_paired(a_NE: np.ndarray, b_NE: np.ndarray) -> np.ndarray:
    """Pearson r of ``a[..., :]`` with ``b[..., :]`` over the last axis (the arrays broadcast).

    Returns float64 ``[N...]`` in [-1, 1]; NaN where either vector is constant.
    """
    a = np.asarray(a_NE, dtype=np.float64)
    b = np.asarray(b_NE, dtype=np.float64)
    a = a - a.mean(axis=-1, keepdims=True)
    b = b - b.mean(axis=-1, keepdims=True)
    den = np.sqrt((a * a).sum(-1) * (b * b).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, np.clip((a * b).sum(-1) / den, -1, 1), np.nan)


def pearson_rows(x_NE: np.ndarray) -> np.ndarray:
    """Pearson r between every pair of rows of ``x_NE`` ``[N, E]``: float64 ``[N, N]``; NaN for constant rows."""
    x = np.asarray(x_NE, dtype=np.float64)
    x = x - x.mean(axis=-1, keepdims=True)
    norm = np.sqrt((x * x).sum(axis=-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        z = x / norm[:, None]
        z[norm == 0] = np.nan
    return np.clip(z @ z.T, -1.0, 1.0)


def dataset_correlation_LDD(counts_DLE: np.ndarray) -> np.ndarray:
    """Per layer, Pearson r between every pair of datasets' count vectors: float64 ``[L, D, D]``.

    counts_DLE: ``[D, L, E]`` tokens of each dataset (one stage, or stages pooled) routed to each
    expert of each layer. NaN for a dataset whose vector is constant at that layer.
    """
    c = np.asarray(counts_DLE)
    D, L = c.shape[:2]
    out = np.empty((L, D, D))
    for layer in range(L):
        out[layer] = pearson_rows(c[:, layer])
    return out


def mean_skip_nan(values_N: np.ndarray) -> tuple[float, int]:
    """Mean of the defined values of ``values_N`` and how many were NaN (left out).

    values_N: any float array (e.g. one number per MoE layer). Returns ``(mean, num_nan)``: the
    float64 mean over the non-NaN entries (NaN when there is none, without a warning) and the int
    count of NaN entries.
    """
    v = np.asarray(values_N, dtype=np.float64).ravel()
    ok = ~np.isnan(v)
    num_nan = int(v.size - ok.sum())
    return (float(v[ok].mean()) if ok.any() else float("nan")), num_nan
