"""2-D embeddings of per-request activation vectors and how well they cluster by dataset (core paper §3.4).

Features of request r for one stage: its counts per expert at one layer (``[E]``), or at every
selected layer concatenated (``[L*E]``), divided by their L2 norm (the whole concatenated vector
is normalized once). Requests with an all-zero vector (e.g. no decode token) are left out.

Bounded fit: t-SNE and UMAP cost grows faster than linearly and UMAP compiles numba kernels on its
first call in a process (~10 s, more on a busy machine). ``analyze`` draws at most ``max_requests``
requests to embed and, among those, a fit sample of at most ``fit_requests`` (both per dataset in
proportion to its size, at least one each, seeded: ``stratified_subsample``). It reduces the unit
vectors to their first 50 principal components with a PCA fitted on the fit sample (``fit_pca``,
seeded; the other requests are transformed in chunks), runs t-SNE / UMAP on the fit sample only,
and places every other request at the mean 2-D position of its ``PLACE_NEIGHBOURS`` nearest fitted
requests in the 50-D space (``place_by_neighbours``), so the cost past the fit sample is linear.
K-means and the silhouette run on the 50-D projection of every embedded request. ``project``
applies the same reduction before t-SNE when called on wider features.

Cluster quality against the dataset labels: silhouette (Euclidean on the unit vectors, i.e. a
monotone function of cosine distance, or on their PCA projection; -1..1, higher = datasets
separate) and the adjusted Rand index between the labels and K-means clusters with C = number of
datasets (0 = chance, 1 = identical). Silhouette of each 2-D embedding is reported too.

Shape legend (docs/architecture.md): R requests, L MoE layers, E logical experts per layer, F features (L*E, or E for one
layer), N rows of anything else (here the embedded requests, or the fit sample), M the embedded requests placed
by their neighbours, C clusters (K-means).

Out of scope: choosing clusters for placement (``placement``), drawing (``dashboards``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from moetrace._deps import require
from moetrace.errors import ConfigError

Method = Literal["tsne", "umap"]


def request_features(counts_RLE: np.ndarray, *, layer: int | None = None) -> np.ndarray:
    """L2-normalized activation vectors: float32 ``[R, E]`` (one layer) or ``[R, L*E]`` (``layer=None``).

    All-zero rows stay zero (callers drop them)."""
    x = counts_RLE[:, layer] if layer is not None else counts_RLE.reshape(counts_RLE.shape[0], -1)
    x = x.astype(np.float32)
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    np.divide(x, norm, out=x, where=norm > 0)
    return x


def stratified_subsample(label_R: np.ndarray, *, max_requests: int, seed: int) -> np.ndarray:
    """Sorted row indices: all rows if there are at most ``max_requests``, else per label in
    proportion to its size (at least one each)."""
    R = label_R.shape[0]
    if R <= max_requests:
        return np.arange(R)
    rng = np.random.default_rng(seed)
    labels, inv = np.unique(label_R, return_inverse=True)
    sizes = np.bincount(inv)
    take = np.maximum(1, np.floor(sizes * max_requests / R).astype(int))
    picks = [
        rng.choice(np.flatnonzero(inv == d), size=min(take[d], sizes[d]), replace=False) for d in range(len(labels))
    ]
    return np.sort(np.concatenate(picks))


#: how many fitted requests place one that was not fitted (mean of their 2-D positions)
PLACE_NEIGHBOURS = 5
#: how ``place_by_neighbours`` places a request, as the results record it
PLACEMENT = f"mean 2-D position of its {PLACE_NEIGHBOURS} nearest fitted requests (Euclidean, 50 principal components)"


def fit_pca(features_NF: np.ndarray, *, num_components: int = 50, seed: int = 0) -> Callable[[np.ndarray], np.ndarray]:
    """A projection onto the first ``num_components`` principal components of ``features_NF``:
    a function of float32 ``[M, F]`` to float32 ``[M, min(num_components, N, F)]`` (the identity if F
    is already that small)."""
    N, F = features_NF.shape
    if F <= num_components:
        return lambda x_MF: np.asarray(x_MF, np.float32)
    decomposition = require("sklearn.decomposition", purpose="embeddings")
    pca = decomposition.PCA(n_components=min(num_components, N), random_state=seed).fit(features_NF)
    return lambda x_MF: pca.transform(x_MF).astype(np.float32)


def place_by_neighbours(
    fitted_NF: np.ndarray, xy_N2: np.ndarray, rest_MF: np.ndarray, *, chunk: int = 4096
) -> np.ndarray:
    """2-D positions float32 ``[M, 2]`` of requests that were not fitted: the mean of the positions
    ``xy_N2`` of their ``PLACE_NEIGHBOURS`` nearest fitted requests ``fitted_NF`` (fewer if N is
    smaller), queried in chunks of ``chunk`` requests."""
    out = np.empty((rest_MF.shape[0], 2), np.float32)
    if rest_MF.shape[0] == 0:
        return out
    neighbors = require("sklearn.neighbors", purpose="embeddings")
    nn = neighbors.NearestNeighbors(n_neighbors=min(PLACE_NEIGHBOURS, fitted_NF.shape[0])).fit(fitted_NF)
    for lo in range(0, rest_MF.shape[0], chunk):
        nearest_MN = nn.kneighbors(rest_MF[lo : lo + chunk], return_distance=False)
        out[lo : lo + chunk] = xy_N2[nearest_MN].mean(axis=1)
    return out


def reduce_pca(features_NF: np.ndarray, *, num_components: int = 50, seed: int = 0) -> np.ndarray:
    """The first ``num_components`` principal components (float32 ``[N, min(num_components, N, F)]``); as is if F is already small."""
    N, F = features_NF.shape
    if F <= num_components:
        return features_NF
    decomposition = require("sklearn.decomposition", purpose="embeddings")
    return (
        decomposition.PCA(n_components=min(num_components, N), random_state=seed)
        .fit_transform(features_NF)
        .astype(np.float32)
    )


def project(features_NF: np.ndarray, *, method: Method, seed: int) -> np.ndarray:
    """2-D projection float32 ``[N, 2]`` with t-SNE or UMAP (umap-learn), seeded.

    t-SNE: ``analysis.tsne`` (scikit-learn's method and defaults, exact gradient) up to
    ``EXACT_MAX_POINTS`` points, scikit-learn's Barnes-Hut ``TSNE`` above."""
    N = features_NF.shape[0]
    if N < 5:
        raise ConfigError(f"an embedding needs at least 5 requests with tokens, have {N}")
    if method == "tsne":
        from moetrace.analysis.tsne import EXACT_MAX_POINTS, tsne_2d

        x = reduce_pca(features_NF, num_components=50, seed=seed)
        perplexity = float(min(30.0, (N - 1) / 3))
        if N <= EXACT_MAX_POINTS:  # the exact gradient: faster than Barnes-Hut at this size, and as good
            return tsne_2d(x, perplexity=perplexity)
        manifold = require("sklearn.manifold", purpose="t-SNE embeddings")
        return (
            manifold.TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed)
            .fit_transform(x)
            .astype(np.float32)
        )
    if method == "umap":
        umap = require("umap", purpose="UMAP embeddings")
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*n_jobs.*")  # seeded UMAP runs single-threaded, by design
            reducer = umap.UMAP(n_components=2, n_neighbors=min(15, N - 1), random_state=seed)
            return reducer.fit_transform(features_NF).astype(np.float32)
    raise ConfigError(f"unknown embedding method {method!r}; use 'tsne' or 'umap'")


@dataclass(frozen=True, kw_only=True)
class ClusterScores:
    """How well requests group by dataset."""

    silhouette: float  # of the normalized features vs dataset labels (NaN with one dataset)
    adjusted_rand: float  # ARI of K-means (C = number of datasets) vs dataset labels
    num_requests: int  # requests scored
    num_datasets: int  # C


def cluster_scores(features_NF: np.ndarray, label_N: np.ndarray, *, seed: int) -> ClusterScores:
    """Silhouette and K-means ARI of ``features_NF`` against ``label_N`` (see the module docstring)."""
    cluster = require("sklearn.cluster", purpose="cluster-quality scores")
    metrics = require("sklearn.metrics", purpose="cluster-quality scores")
    labels, inv = np.unique(label_N, return_inverse=True)
    C = len(labels)
    N = features_NF.shape[0]
    if C < 2 or N <= C:
        return ClusterScores(silhouette=float("nan"), adjusted_rand=float("nan"), num_requests=N, num_datasets=C)
    km = cluster.KMeans(n_clusters=C, n_init=4, random_state=seed).fit(features_NF)
    return ClusterScores(
        silhouette=float(metrics.silhouette_score(features_NF, inv, random_state=seed, sample_size=min(N, 5000))),
        adjusted_rand=float(metrics.adjusted_rand_score(inv, km.labels_)),
        num_requests=N,
        num_datasets=C,
    )


def silhouette_2d(xy_N2: np.ndarray, label_N: np.ndarray, *, seed: int) -> float:
    """Silhouette of a 2-D embedding against the labels (NaN with fewer than 2 labels)."""
    metrics = require("sklearn.metrics", purpose="cluster-quality scores")
    _, inv = np.unique(label_N, return_inverse=True)
    if inv.max(initial=0) < 1 or xy_N2.shape[0] <= inv.max() + 1:
        return float("nan")
    return float(metrics.silhouette_score(xy_N2, inv, random_state=seed, sample_size=min(xy_N2.shape[0], 5000)))
