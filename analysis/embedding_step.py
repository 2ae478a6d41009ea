"""``analyze``'s embedding step: per stage, requests' unit activation vectors, their cluster scores against the
datasets, and their 2-D maps (t-SNE, UMAP) with the requests outside the fit sample placed by neighbours.

The algorithms are ``embedding`` and ``tsne``; this module only runs them over the stages of a trace's counts,
with one thread in every native pool (BLAS, OpenMP), and the stages' t-SNE fits side by side on the cores the
process may use (their kernel releases the GIL; each fit is one thread in a fixed order, so the maps do not
depend on how many ran at once).

Out of scope: the algorithms (``embedding``, ``tsne``), the other steps and the results directory (``run``).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import polars as pl

from moetrace import results as rf

#: ``run.AnalyzeConfig`` (not imported: ``run`` imports this module)
AnalyzeConfig = Any


def _cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def embedding_line(config: AnalyzeConfig) -> str:
    """The progress line of the embedding step: what it fits, what it places, what it compiles."""
    names = {"tsne": "t-SNE", "umap": "UMAP"}
    methods = " and ".join(names[m] for m in config.embedding_methods)
    cap = "every request" if config.embedding_max_requests is None else f"up to {config.embedding_max_requests}"
    line = (
        f"{methods} of normalized per-request vectors ({cap} per stage; fitted on up to "
        f"{config.embedding_fit_requests}, the rest placed by their nearest fitted requests)"
    )
    if "umap" in config.embedding_methods:
        line += "; UMAP compiles its numba kernels first (about 10 s once per process, longer on a busy machine)"
    return line


def run_embedding_one_thread(counts, config: AnalyzeConfig, write) -> dict[str, Any]:
    """Embeddings with one thread in every native pool (BLAS and OpenMP: PCA, t-SNE, K-means,
    silhouette). Spinning worker threads on a busy box made t-SNE of 1000 requests 9x slower
    (107 s against 12 s measured under load 11); see classify for BLAS."""
    from moetrace._deps import require

    # threadpoolctl limits only the libraries already loaded: load scikit-learn's (its OpenMP) first
    for module in ("sklearn.decomposition", "sklearn.manifold", "sklearn.cluster", "sklearn.neighbors"):
        require(module, purpose="embeddings")
    with require("threadpoolctl", purpose="embeddings").threadpool_limits(limits=1):
        return _run_embedding(counts, config, write)


def _run_embedding(counts, config: AnalyzeConfig, write) -> dict[str, Any]:
    from moetrace.analysis.embedding import (
        PLACEMENT,
        cluster_scores,
        fit_pca,
        place_by_neighbours,
        project,
        request_features,
        silhouette_2d,
        stratified_subsample,
    )

    layer_pos = None if config.embedding_layer is None else counts.layers.index(config.embedding_layer)
    layer_name = -1 if layer_pos is None else config.embedding_layer
    chunk = 4096  # requests whose float32 features are built at once (DeepSeek-V3: 4096 x 14848 x 4 B = 243 MB)
    frames, scores = [], []
    why: dict[str, str] = {}  # stage -> reason its embedding was skipped
    prepared = []  # (stage, pick, lab, fitted, x, score row) of each stage embedded
    for stage in counts.stages:
        counts_RLE = counts.stage(stage)
        sel_RLE = counts_RLE[:, layer_pos : layer_pos + 1] if layer_pos is not None else counts_RLE
        has = np.flatnonzero(
            np.concatenate([sel_RLE[lo : lo + chunk].any(axis=(1, 2)) for lo in range(0, counts.num_requests, chunk)])
            if counts.num_requests
            else np.zeros(0, bool)
        )
        cap = has.size if config.embedding_max_requests is None else config.embedding_max_requests
        pick = has[stratified_subsample(counts.dataset_R[has], max_requests=cap, seed=config.seed)]
        if pick.size < 5:
            where = "" if layer_pos is None else f" at MoE layer {layer_name}"
            why[stage] = (
                f"needs at least 5 requests with recorded {stage} routing{where}, the trace has {has.size}; "
                "trace more requests" + (" or embed another layer (--embedding-layer)" if where else "")
            )
            continue
        lab = counts.dataset_R[pick]
        fit_pos = stratified_subsample(lab, max_requests=config.embedding_fit_requests, seed=config.seed)
        fitted = np.zeros(pick.size, bool)
        fitted[fit_pos] = True
        reduce = fit_pca(
            request_features(counts_RLE[pick[fit_pos]], layer=layer_pos), num_components=50, seed=config.seed
        )
        x = np.concatenate(
            [
                reduce(request_features(counts_RLE[pick[lo : lo + chunk]], layer=layer_pos))
                for lo in range(0, pick.size, chunk)
            ]
        )
        cs = cluster_scores(x, lab, seed=config.seed)
        row: dict[str, Any] = {
            "stage": stage,
            "layer": layer_name,
            "num_requests": int(pick.size),
            "num_datasets": cs.num_datasets,
            "silhouette": cs.silhouette,
            "adjusted_rand": cs.adjusted_rand,
            "num_fitted": int(fit_pos.size),
        }
        prepared.append((stage, pick, lab, fitted, x, row))
    # the stages' t-SNE fits run side by side: their kernel releases the GIL and each is one thread in a
    # fixed order, so the maps are the same on any number of cores; UMAP (numba, GIL-bound) runs in turn
    workers = max(1, min(len(prepared), _cores()))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        fits = {
            (i, m): pool.submit(project, p[4][p[3]], method=m, seed=config.seed) if m == "tsne" else None
            for i, p in enumerate(prepared)
            for m in config.embedding_methods
        }
        for i, (stage, pick, lab, fitted, x, row) in enumerate(prepared):
            for method in config.embedding_methods:
                job = fits[(i, method)]
                xy = np.empty((pick.size, 2), np.float32)
                xy[fitted] = job.result() if job is not None else project(x[fitted], method=method, seed=config.seed)
                xy[~fitted] = place_by_neighbours(x[fitted], xy[fitted], x[~fitted])
                row[f"silhouette_{method}"] = silhouette_2d(xy, lab, seed=config.seed)
                frames.append(
                    pl.DataFrame(
                        {
                            "request_id": counts.request_id_R[pick],
                            "dataset": lab,
                            "stage": [stage] * pick.size,
                            "method": [method] * pick.size,
                            "layer": np.full(pick.size, layer_name, np.int32),
                            "x": xy[:, 0],
                            "y": xy[:, 1],
                            "fitted": fitted,
                        }
                    )
                )
            scores.append(row)
    if frames:
        write(rf.EMBEDDING, pl.concat(frames), "2-D request embeddings (t-SNE/UMAP) per stage")
    if scores:
        write(rf.EMBEDDING_SCORES, pl.DataFrame(scores), "cluster quality vs dataset labels per stage")
    out: dict[str, Any] = {  # placement: how the requests outside the fit sample got their position
        r["stage"]: {**{k: v for k, v in r.items() if k != "stage"}, "placement": PLACEMENT} for r in scores
    }
    if why and not scores:
        out["skipped"] = "; ".join(f"{s}: {w}" for s, w in why.items())
    elif why:
        out["skipped_parts"] = {f"embedding.{s}": w for s, w in why.items()}
    return out
