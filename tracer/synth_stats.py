"""The statistics the synth knobs move, measured from routing (for calibration, tests and docs).

Definitions (docs/analysis.md). Expert load, the imbalance factor, Pearson correlation and the dataset
correlation are ``moetrace.stats``, the functions the analysis stage calls too:
- expert load of e in a scope = tokens routed to e / (T*K/E), where T*K counts the recorded ids of
  the scope (ids == -1 are ignored);
- imbalance factor (IF) of a layer in a scope = max over experts of the expert load;
- prefill↔decode correlation of a layer = Pearson correlation over experts between the per-expert
  count vectors of prefill and of decode, pooled over all tokens of one dataset (the analysis
  stage's pooled prefill↔decode r); the headline number is its mean over layers and datasets;
- next-layer predictability of a layer pair (l, l+1) = the fraction of (token, expert e at l) whose
  most frequent layer-(l+1) companion of e (estimated on the same tokens) is among the token's
  layer-(l+1) experts;
- cluster separation of request vectors = between-dataset scatter / within-dataset scatter of
  L2-normalized per-request count vectors (a Fisher ratio: higher = more separable);
- top-share of a scope = the share of its recorded ids that go to its ``ceil(fraction * E)`` most
  loaded experts (default fraction 1/8: "the top 32 of DeepSeek-V3's 256 experts take ~40% of the
  activations of a coding workload");
- within-domain / cross-domain correlation = the mean, over layers and over pairs of distinct datasets
  of the same / of different domains, of the dataset correlation (Pearson over experts of two
  datasets' per-expert counts of one stage, the core paper's §3.3.2 measure); dataset
  specialisation = 1 - the mean over all pairs of distinct datasets (0 when every dataset routes
  alike, up to sampling noise).

The command line ``python -m moetrace.tracer.synth_stats TRACE`` prints all headline figures of any
trace (synthetic or collected), so a preset is compared with a real trace by the same code.

Shape legend: T tokens, R requests, L MoE layers, K top-k, E experts, D datasets, S stages (0 prefill,
1 decode), F features (a request's per-expert counts of its layers, concatenated) (legend:
docs/architecture.md).

Out of scope: plots, per-batch IF distributions, embeddings and classifiers (``moetrace.analysis``).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable, Mapping

import numpy as np

from moetrace.stats import dataset_correlation_LDD, imbalance_factor, pearson_paired
from moetrace.tracer.synth import Chunk


def _bincount_DSLE(ds_T: np.ndarray, decode_T: np.ndarray, topk_ids_TLK: np.ndarray, D: int, E: int) -> np.ndarray:
    T, L, K = topk_ids_TLK.shape
    valid = topk_ids_TLK >= 0
    key = ((ds_T.astype(np.int64) * 2 + decode_T)[:, None, None] * L + np.arange(L)[None, :, None]) * E + topk_ids_TLK
    return np.bincount(key[valid], minlength=D * 2 * L * E).reshape(D, 2, L, E)


def counts_from_chunks(chunks: Iterable[Chunk], *, num_datasets: int, L: int, K: int, E: int) -> np.ndarray:
    """``counts_DSLE`` int64: routed tokens per (dataset, stage, layer, expert) of generated chunks."""
    counts = np.zeros((num_datasets, 2, L, E), np.int64)
    for ch in chunks:
        len_R = ch.prompt_tokens_R.astype(np.int64) + ch.output_tokens_R
        starts = np.concatenate([[0], np.cumsum(len_R)[:-1]])
        T = int(len_R.sum())
        decode_T = (np.arange(T) - np.repeat(starts, len_R)) >= np.repeat(ch.prompt_tokens_R, len_R)
        counts += _bincount_DSLE(
            np.repeat(ch.dataset_R, len_R), decode_T, ch.topk_ids_TX.reshape(T, L, K), num_datasets, E
        )
    return counts


def counts_from_trace(path: str | os.PathLike) -> tuple[np.ndarray, tuple[str, ...]]:
    """``(counts_DSLE, datasets)`` of any trace directory (streamed part by part)."""
    from moetrace.tracer.trace.reader import open_trace

    tr = open_trace(path)
    req = tr.requests().select("request_id", "dataset").collect()
    datasets = tuple(sorted(set(req["dataset"].to_list())))
    rid = req["request_id"].to_numpy()
    order = np.argsort(rid)
    rid_sorted = rid[order]
    ds_sorted = np.array([datasets.index(d) for d in req["dataset"].to_list()], np.int64)[order]
    m = tr.model
    counts = np.zeros((len(datasets), 2, m.num_moe_layers, m.num_experts), np.int64)
    for ta in tr.iter_token_arrays():
        ds_T = ds_sorted[np.searchsorted(rid_sorted, ta.request_id_T)]
        counts += _bincount_DSLE(ds_T, ta.is_decode_T, ta.topk_ids_TLK, len(datasets), m.num_experts)
    return counts, datasets


def prefill_decode_correlation(counts_DSLE: np.ndarray) -> np.ndarray:
    """``[D, L]`` Pearson correlation of prefill vs decode per-expert counts, pooled per dataset."""
    return pearson_paired(counts_DSLE[:, 0], counts_DSLE[:, 1])


def dataset_correlation(counts_DSLE: np.ndarray, *, stage: int | None = None) -> np.ndarray:
    """``[L, D, D]`` Pearson correlation between datasets' per-expert counts (one stage, or both pooled)."""
    return dataset_correlation_LDD(counts_DSLE.sum(axis=1) if stage is None else counts_DSLE[:, stage])


def next_layer_predictability(topk_ids_TLK: np.ndarray, *, E: int) -> np.ndarray:
    """``[L-1]`` next-layer predictability of each layer pair (tokens with -1 ids are skipped)."""
    ids = topk_ids_TLK[(topk_ids_TLK >= 0).all(axis=(1, 2))].astype(np.int64)
    T, L, K = ids.shape
    out = np.full(L - 1, np.nan)
    for l in range(L - 1):
        pair = (ids[:, l, :, None] * E + ids[:, l + 1, None, :]).reshape(-1)
        cooc_EE = np.bincount(pair, minlength=E * E).reshape(E, E)
        pred_E = cooc_EE.argmax(axis=1)
        hit = cooc_EE[np.arange(E), pred_E].sum()
        out[l] = hit / max(T * K, 1)
    return out


def request_vectors(
    chunks: Iterable[Chunk], *, L: int, K: int, E: int, stage: int, layers: slice | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(vectors_RF, dataset_R)``: per-request per-expert counts of one stage (layers concatenated), L2-normalized."""
    vecs: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    sel = np.arange(L)[layers] if layers is not None else np.arange(L)
    for ch in chunks:
        len_R = ch.prompt_tokens_R.astype(np.int64) + ch.output_tokens_R
        starts = np.concatenate([[0], np.cumsum(len_R)[:-1]])
        T = int(len_R.sum())
        ids = ch.topk_ids_TX.reshape(T, L, K)[:, sel, :]
        req_T = np.repeat(np.arange(len_R.size), len_R)
        decode_T = (np.arange(T) - np.repeat(starts, len_R)) >= np.repeat(ch.prompt_tokens_R, len_R)
        keep = (decode_T == bool(stage))[:, None, None] & (ids >= 0)
        key = (req_T[:, None, None] * sel.size + np.arange(sel.size)[None, :, None]) * E + ids
        v = np.bincount(key[keep], minlength=len_R.size * sel.size * E).reshape(len_R.size, sel.size * E)
        vecs.append(v)
        labels.append(ch.dataset_R)
    vectors_RF = np.concatenate(vecs).astype(np.float64)
    vectors_RF /= np.maximum(np.linalg.norm(vectors_RF, axis=1, keepdims=True), 1e-12)
    return vectors_RF, np.concatenate(labels)


def cluster_separation(vectors_RF: np.ndarray, labels_R: np.ndarray) -> float:
    """Between-class / within-class scatter of the vectors (Fisher ratio; higher = more separable)."""
    mu = vectors_RF.mean(axis=0)
    between = within = 0.0
    for d in np.unique(labels_R):
        v = vectors_RF[labels_R == d]
        c = v.mean(axis=0)
        between += v.shape[0] * float(((c - mu) ** 2).sum())
        within += float(((v - c) ** 2).sum())
    return between / within


def top_share(counts_xE: np.ndarray, *, fraction: float = 0.125) -> np.ndarray:
    """Share of each scope's ids routed to its ``ceil(fraction * E)`` most loaded experts (last axis; NaN if empty)."""
    E = counts_xE.shape[-1]
    n = min(E, max(1, int(np.ceil(fraction * E - 1e-9))))
    c = counts_xE.astype(np.float64)
    top = -np.partition(-c, n - 1, axis=-1)[..., :n]
    with np.errstate(invalid="ignore", divide="ignore"):
        return top.sum(axis=-1) / c.sum(axis=-1)


def domain_correlation(
    counts_DSLE: np.ndarray, datasets: tuple[str, ...], domains: Mapping[str, str], *, stage: int | None
) -> dict[str, float]:
    """Mean dataset correlation of same-domain and of cross-domain pairs, and the dataset specialisation.

    Per pair of distinct datasets, the Pearson correlation of their per-expert counts of ``stage``
    (None: both stages pooled) is averaged over layers; ``within`` / ``cross`` average it over the
    pairs of one domain / of different domains (NaN when there is no such pair); ``specialisation``
    is 1 - its mean over all pairs. ``domains`` maps a dataset to its domain (absent: its own).
    """
    corr_DD = np.nanmean(dataset_correlation(counts_DSLE, stage=stage), axis=0)
    dom = [domains.get(d, d) for d in datasets]
    same: list[float] = []
    cross: list[float] = []
    for i, j in zip(*np.triu_indices(len(datasets), k=1)):
        (same if dom[i] == dom[j] else cross).append(corr_DD[i, j])
    return {"within": _mean(same), "cross": _mean(cross), "specialisation": 1.0 - _mean(same + cross)}


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else float("nan")


def _if_stats(if_x: np.ndarray) -> dict[str, float]:
    """Mean, 90th percentile and max of imbalance factors over their scopes (NaN ignored)."""
    return {"mean": float(np.nanmean(if_x)), "p90": float(np.nanpercentile(if_x, 90)), "max": float(np.nanmax(if_x))}


def summarize_counts(
    counts_DSLE: np.ndarray, datasets: tuple[str, ...], *, domains: Mapping[str, str] | None = None
) -> dict:
    """Headline figures of ``counts_DSLE`` (int64 [D, 2, L, E]), each defined in the module docstring.

    - ``pd_correlation``: the prefill↔decode correlation, mean over layers and datasets;
    - ``imbalance``: per dataset the IF of each (stage, layer) scope: its mean, 90th percentile and max;
    - ``imbalance_all_datasets``: the same over the (stage, layer) scopes of all datasets pooled (a mixed workload);
    - ``top_share``: per dataset the top-1/8 share of each layer (stages pooled), mean over layers;
    - ``dataset_correlation``: per stage (``prefill``, ``decode``, ``pooled``) the within-domain and
      cross-domain means and the dataset specialisation (``domains``: dataset -> domain; default
      :data:`~moetrace.tracer.synth.DEFAULT_DOMAINS`).
    """
    from moetrace.tracer.synth import DEFAULT_DOMAINS

    domains = DEFAULT_DOMAINS if domains is None else domains
    pd = prefill_decode_correlation(counts_DSLE)
    if_DSL = imbalance_factor(counts_DSLE)
    share_DL = top_share(counts_DSLE.sum(axis=1))
    if_SL = imbalance_factor(counts_DSLE.sum(axis=0))
    return {
        "pd_correlation": float(np.nanmean(pd)),
        "imbalance": {d: _if_stats(if_DSL[i]) for i, d in enumerate(datasets)},
        "imbalance_all_datasets": _if_stats(if_SL),
        "top_share": {d: float(np.nanmean(share_DL[i])) for i, d in enumerate(datasets)},
        "dataset_correlation": {
            name: domain_correlation(counts_DSLE, datasets, domains, stage=st)
            for name, st in (("prefill", 0), ("decode", 1), ("pooled", None))
        },
    }


def measure_plan(model, plan, *, workers: int = 1) -> dict:
    """Generate ``plan`` in memory (nothing written) and return :func:`summarize_counts` of it."""
    from moetrace.tracer.synth import generate_in_memory

    counts = counts_from_chunks(
        generate_in_memory(model, plan, workers=workers),
        num_datasets=len(plan.datasets),
        L=model.num_moe_layers,
        K=model.top_k,
        E=model.num_experts,
    )
    return summarize_counts(counts, plan.datasets, domains=plan.knobs.domains)


def measure_trace(path: str | os.PathLike) -> dict:
    """:func:`summarize_counts` of a trace directory; domains from a synthetic trace's manifest, else the defaults."""
    from moetrace.tracer.trace.reader import open_trace

    counts, datasets = counts_from_trace(path)
    domains = (open_trace(path).manifest.get("collection") or {}).get("domains")
    return {"trace": str(path), "datasets": list(datasets), **summarize_counts(counts, datasets, domains=domains)}


def main(argv: list[str] | None = None) -> None:
    """``python -m moetrace.tracer.synth_stats TRACE...``: print each trace's headline figures as JSON."""
    ap = argparse.ArgumentParser(prog="python -m moetrace.tracer.synth_stats", description=main.__doc__)
    ap.add_argument("traces", nargs="+", help="trace directories (synthetic or collected)")
    args = ap.parse_args(argv)
    for t in args.traces:
        print(json.dumps(measure_trace(t), indent=1))


if __name__ == "__main__":
    main()
