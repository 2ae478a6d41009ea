"""Workload-aware micro-batch grouping (core paper §4.1) and the serving-time request router.

Requests are clustered on their decode activation vectors (tokens per (MoE layer, expert), all
layers concatenated, L2-normalized) with K-means; the C clusters are mapped to the G expert groups
(one group = one node) in one of three ways: C = G one to one; G > C every cluster one group, then
the remaining groups to the largest clusters round robin; C > G the C centroids are clustered again
into G meta-clusters. At serving time only the prompt has been seen, so the router predicts the
cluster from the request's prefill vector: nearest prefill centroid (cosine), where the prefill
centroid of a cluster is the mean normalized prefill vector of its training requests.

Shape legend (docs/architecture.md): R requests, F features (L*E), C clusters, G node groups.

Out of scope: which expert goes to which group (``data_placement``, ``improved``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from moetrace._deps import require
from moetrace.errors import ConfigError

__all__ = [
    "Grouping",
    "available_cores",
    "l2_normalize",
    "normalized_rows",
    "map_clusters_to_groups",
    "fit_grouping",
    "predict_clusters",
    "groups_of_clusters",
]


#: rows normalized at a time where only a reduction of the normalized rows is needed (bounds memory)
_CHUNK_ROWS = 1024
#: the most training requests K-means is fitted on (the rest are labelled by nearest centroid)
MAX_FIT_REQUESTS = 4096


def l2_normalize(x_RF: np.ndarray) -> np.ndarray:
    """Each row divided by its L2 norm (all-zero rows stay zero), float32 [R, F] (one new array).

    float32 halves the memory of the widest array in placement (R x L*E: 10,000 DeepSeek-V3
    requests are 0.6 GB) and is what K-means computes in; counts are exact in it up to 2^24.
    """
    x = np.array(x_RF, dtype=np.float32)
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return np.divide(x, norm, out=x, where=norm > 0)


def normalized_rows(x_RF: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``l2_normalize(x_RF[rows])`` filled a chunk at a time, float32 [len(rows), F]: no copy of the
    selected rows in ``x_RF``'s dtype is made on the way."""
    out = np.empty((len(rows), x_RF.shape[1]), dtype=np.float32)
    for lo in range(0, len(rows), _CHUNK_ROWS):
        out[lo : lo + _CHUNK_ROWS] = l2_normalize(x_RF[rows[lo : lo + _CHUNK_ROWS]])
    return out


def _kmeans(x_RF: np.ndarray, num_clusters: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    sklearn_cluster = require("sklearn.cluster", purpose="K-means micro-batch grouping")
    threadpoolctl = require("threadpoolctl", purpose="K-means micro-batch grouping")  # scikit-learn's own dependency
    # copy_x=False: sklearn centres x in place and restores it, instead of holding a second [R, F] copy
    km = sklearn_cluster.KMeans(n_clusters=num_clusters, n_init=4, random_state=seed, copy_x=False)
    # OpenMP threads (the Lloyd iterations) no more than the cores this process is given (a cpuset or taskset
    # smaller than the machine: more threads than cores only wait on each other); BLAS on one thread: its
    # only calls are k-means++'s distances of a few candidates to every row, matrices too small to share,
    # where threads cost 5-10x the time (measured: DeepSeek-V3, 800 requests, 2 cores: 2 s instead of 10-20 s).
    # Threads split a product's outputs, never its sums: the distances, hence the labels, are the same
    with threadpoolctl.threadpool_limits(limits=available_cores()), threadpoolctl.threadpool_limits(1, user_api="blas"):
        km.fit(x_RF)
    return km.labels_.astype(np.int64), km.cluster_centers_


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


def map_clusters_to_groups(
    cluster_size_C: np.ndarray, *, num_groups: int, centroids_CF: np.ndarray | None = None, seed: int = 0
) -> list[list[int]]:
    """Groups of each cluster (core paper §4.1.2); every group serves exactly one cluster.

    C == G: cluster c -> group c. G > C: one group each, then the remaining groups to clusters in
    descending size, round robin. C > G: K-means on the centroids into G meta-clusters; meta-cluster
    g -> group g (needs ``centroids_CF``).
    """
    sizes = np.asarray(cluster_size_C)
    C = len(sizes)
    if C == num_groups:
        return [[c] for c in range(C)]
    if num_groups > C:
        out = [[c] for c in range(C)]
        by_size = np.argsort(-sizes, kind="stable")
        for j, g in enumerate(range(C, num_groups)):
            out[int(by_size[j % C])].append(g)
        return out
    if centroids_CF is None:
        raise ConfigError("more clusters than groups needs the cluster centroids to merge them")
    meta, _ = _kmeans(l2_normalize(centroids_CF), num_groups, seed)
    if len(np.unique(meta)) < num_groups:
        raise ConfigError(
            f"the {C} cluster centroids do not form {num_groups} distinct meta-clusters; use fewer clusters"
        )
    return [[int(m)] for m in meta]


@dataclass(frozen=True, kw_only=True)
class Grouping:
    """A fitted grouping: clusters, their groups and what the router needs."""

    num_groups: int  # G expert groups (nodes)
    cluster_to_groups: list[list[int]]  # groups serving each cluster
    decode_centroids_CF: np.ndarray  # K-means centroids in normalized decode space
    prefill_centroids_CF: np.ndarray  # mean normalized prefill vector per cluster (router)
    labels_R: np.ndarray  # cluster of each training request (from its decode vector)

    @property
    def num_clusters(self) -> int:
        return len(self.cluster_to_groups)


def fit_grouping(
    decode_RF: np.ndarray,
    prefill_RF: np.ndarray,
    *,
    num_clusters: int,
    num_groups: int,
    seed: int,
    rows: np.ndarray | None = None,
    max_fit_requests: int = MAX_FIT_REQUESTS,
) -> Grouping:
    """Cluster training requests on decode vectors and map clusters to groups.

    ``rows``: the training requests' row indices into ``decode_RF`` / ``prefill_RF`` (default all);
    ``labels_R`` then follows ``rows``' order. With more than ``max_fit_requests`` training requests,
    K-means is fitted on a seeded sample of that many and every request is labelled by its nearest
    centroid (what K-means' own assignment step does), which bounds memory at one float32
    [max_fit_requests, F] array (DeepSeek-V3: 243 MB) however many requests there are.
    """
    rows = np.arange(decode_RF.shape[0]) if rows is None else np.asarray(rows)
    R = len(rows)
    if num_clusters < 1 or num_clusters > R:
        raise ConfigError(f"--clusters must be in 1..{R} (the training requests), got {num_clusters}")
    if R <= max_fit_requests:
        x = normalized_rows(decode_RF, rows)
        labels, centroids = _kmeans(x, num_clusters, seed)
    else:  # fit on a seeded sample, then label every training request by its nearest centroid
        sample = np.sort(np.random.default_rng([seed, 11]).choice(R, max_fit_requests, replace=False))
        x = normalized_rows(decode_RF, rows[sample])
        _, centroids = _kmeans(x, num_clusters, seed)
        labels = _nearest_centroid(decode_RF, rows, centroids)
    del x
    sizes = np.bincount(labels, minlength=num_clusters)
    c2g = map_clusters_to_groups(sizes, num_groups=num_groups, centroids_CF=centroids, seed=seed)
    pre = np.zeros((num_clusters, prefill_RF.shape[1]))
    for lo in range(0, R, _CHUNK_ROWS):  # the mean normalized prefill vector per cluster, chunk by chunk
        chunk = l2_normalize(prefill_RF[rows[lo : lo + _CHUNK_ROWS]])
        for i, c in enumerate(labels[lo : lo + _CHUNK_ROWS]):  # row by row, in order: np.add.at's sums, 40x faster
            pre[c] += chunk[i]
    pre /= np.maximum(sizes, 1)[:, None]
    return Grouping(
        num_groups=num_groups,
        cluster_to_groups=c2g,
        decode_centroids_CF=centroids,
        prefill_centroids_CF=pre,
        labels_R=labels,
    )


def _nearest_centroid(x_RF: np.ndarray, rows: np.ndarray, centroids_CF: np.ndarray) -> np.ndarray:
    """K-means' assignment step: the Euclidean-nearest centroid of each normalized row, int64 [len(rows)]."""
    c = np.asarray(centroids_CF, dtype=np.float32)
    half_sq = 0.5 * (c * c).sum(1)
    out = np.empty(len(rows), dtype=np.int64)
    for lo in range(0, len(rows), _CHUNK_ROWS):
        out[lo : lo + _CHUNK_ROWS] = np.argmax(l2_normalize(x_RF[rows[lo : lo + _CHUNK_ROWS]]) @ c.T - half_sq, axis=1)
    return out


def predict_clusters(x_RF: np.ndarray, centroids_CF: np.ndarray) -> np.ndarray:
    """Nearest centroid by cosine similarity, int64 [R] (rows normalized a chunk at a time)."""
    c_FC = l2_normalize(centroids_CF).T
    R = x_RF.shape[0]
    out = np.empty(R, dtype=np.int64)
    for lo in range(0, R, _CHUNK_ROWS):
        out[lo : lo + _CHUNK_ROWS] = np.argmax(l2_normalize(x_RF[lo : lo + _CHUNK_ROWS]) @ c_FC, axis=1)
    return out


def groups_of_clusters(cluster_R: np.ndarray, cluster_to_groups: list[list[int]]) -> np.ndarray:
    """Group of each request: a cluster's requests take its groups in turn (round robin), int64 [R]."""
    out = np.empty(len(cluster_R), dtype=np.int64)
    for c, groups in enumerate(cluster_to_groups):
        idx = np.flatnonzero(cluster_R == c)
        out[idx] = np.asarray(groups)[np.arange(len(idx)) % len(groups)]
    return out
