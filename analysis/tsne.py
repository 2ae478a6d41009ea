"""t-SNE of a few thousand points with the exact gradient: the 2-D map ``analyze`` draws (core paper §3.4).

The method is van der Maaten & Hinton's t-SNE with scikit-learn's defaults, so a map reads as
``sklearn.manifold.TSNE(init="pca")`` does: input affinities from each point's
``min(N - 1, 3 * perplexity + 1)`` nearest neighbours (Euclidean; a Gaussian per point whose width
gives the perplexity, found by bisection; symmetrized and normalized to sum 1), a Student-t kernel
with one degree of freedom in 2-D, the first two principal components scaled to standard deviation
1e-4 as the start, 250 iterations with early exaggeration 12 and momentum 0.5, then momentum 0.8 up
to ``max_iter`` (1000), per-coordinate gains (+0.2 / x0.8, at least 0.01) and scikit-learn's
``learning_rate="auto"`` (max(N / 48, 50)). What differs is the repulsion: scikit-learn approximates
it with a Barnes-Hut quadtree (angle 0.5); here every pair is summed (O(N^2) per iteration, in
float64, one thread, in a fixed order, so a seeded run gives the same map on any thread count). At
``analyze``'s fit sample (1,000 requests) that costs about half of scikit-learn's Barnes-Hut on one thread,
and its final KL divergence is no worse (docs/benchmarks.md, issue 41;
``tests/test_analysis_tsne.py`` compares the two on planted clusters). Above ``EXACT_MAX_POINTS`` points
the quadratic cost loses to Barnes-Hut, and ``project`` calls scikit-learn instead.

Nothing here is random (the start is the PCA, the neighbour search exact), so ``tsne_2d`` takes no
seed. Ties in neighbour distances are broken as scikit-learn's ``NearestNeighbors`` breaks them.

Shape legend (docs/architecture.md): N points, F input features, K neighbours per point, Q
non-zero input affinities (the symmetrized neighbour graph).

Out of scope: UMAP, Barnes-Hut and FFT-accelerated t-SNE for large N (scikit-learn's and other
libraries'), an early stop on the KL divergence (scikit-learn's never triggers at these sizes;
``max_iter`` iterations always run unless the gradient vanishes).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moetrace._deps import require

#: above this many points ``project`` uses scikit-learn's Barnes-Hut t-SNE: the exact sums cost N^2, Barnes-Hut
#: about N log N, and on one thread they cost the same near 2000 (about 3.5 s per 1000 iterations at N = 1000 here)
EXACT_MAX_POINTS = 2000
EARLY_EXAGGERATION = 12.0
EXPLORATION_ITER = 250  # iterations with early exaggeration and momentum 0.5
MIN_GRAD_NORM = 1e-7  # stop when the gradient's norm falls below this (checked every 50 iterations)

_KERNELS: dict[str, Callable] = {}


def _kernel() -> Callable:
    """The numba gradient kernel, compiled on first use (cached on disk by numba)."""
    if "grad" in _KERNELS:
        return _KERNELS["grad"]
    numba = require("numba", purpose="the t-SNE gradient kernel of `moetrace analyze`")

    @numba.njit(cache=True, nogil=True)
    def tsne_gradient(y_N2, indptr_N1, indices_Q, p_Q, exaggeration, grad_N2):
        # y_N2 float64 [N, 2]; CSR of the symmetric affinities P (indptr_N1 [N+1], indices_Q, p_Q);
        # writes the KL gradient into grad_N2 and returns the normalizer Z = sum_{i != j} w_ij
        N = y_N2.shape[0]
        rep_N2 = np.zeros((N, 2))
        z = 0.0
        for i in range(N):  # repulsion: every pair once, w_ij^2 (y_i - y_j) to i and its opposite to j
            yi0 = y_N2[i, 0]
            yi1 = y_N2[i, 1]
            rx = 0.0
            ry = 0.0
            zi = 0.0
            for j in range(i + 1, N):
                dx = yi0 - y_N2[j, 0]
                dy = yi1 - y_N2[j, 1]
                w = 1.0 / (1.0 + dx * dx + dy * dy)
                zi += w
                w2 = w * w
                rx += w2 * dx
                ry += w2 * dy
                rep_N2[j, 0] -= w2 * dx
                rep_N2[j, 1] -= w2 * dy
            rep_N2[i, 0] += rx
            rep_N2[i, 1] += ry
            z += 2.0 * zi
        for i in range(N):  # attraction over the neighbour graph, then 4 (attraction - repulsion / Z)
            ax = 0.0
            ay = 0.0
            for q in range(indptr_N1[i], indptr_N1[i + 1]):
                j = indices_Q[q]
                dx = y_N2[i, 0] - y_N2[j, 0]
                dy = y_N2[i, 1] - y_N2[j, 1]
                pw = exaggeration * p_Q[q] / (1.0 + dx * dx + dy * dy)
                ax += pw * dx
                ay += pw * dy
            grad_N2[i, 0] = 4.0 * (ax - rep_N2[i, 0] / z)
            grad_N2[i, 1] = 4.0 * (ay - rep_N2[i, 1] / z)
        return z

    _KERNELS["grad"] = tsne_gradient
    return tsne_gradient


def tsne_gradient_numpy(
    y_N2: np.ndarray,
    indptr_N1: np.ndarray,
    indices_Q: np.ndarray,
    p_Q: np.ndarray,
    exaggeration: float,
    grad_N2: np.ndarray,
) -> float:
    """The kernel's NumPy twin (same signature and effect; used where numba cannot compile it)."""
    N = y_N2.shape[0]
    d_NN2 = y_N2[:, None, :] - y_N2[None, :, :]
    w_NN = 1.0 / (1.0 + (d_NN2**2).sum(axis=2))
    np.fill_diagonal(w_NN, 0.0)
    z = float(w_NN.sum())
    rep_N2 = np.einsum("ij,ijk->ik", w_NN * w_NN, d_NN2)
    rows_Q = np.repeat(np.arange(N), np.diff(indptr_N1))
    pw_Q = exaggeration * p_Q * w_NN[rows_Q, indices_Q]
    att_N2 = np.zeros((N, 2))
    np.add.at(att_N2, rows_Q, pw_Q[:, None] * d_NN2[rows_Q, indices_Q])
    grad_N2[:] = 4.0 * (att_N2 - rep_N2 / z)
    return z


def input_affinities(x_NF: np.ndarray, *, perplexity: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The symmetric input affinities P as CSR (indptr ``[N+1]``, indices ``[Q]``, float64 values ``[Q]``, summing to 1)."""
    neighbors = require("sklearn.neighbors", purpose="t-SNE embeddings")
    sparse = require("scipy.sparse", purpose="t-SNE embeddings")
    N = x_NF.shape[0]
    K = min(N - 1, int(3.0 * perplexity + 1))
    dist_NK, idx_NK = neighbors.NearestNeighbors(n_neighbors=K).fit(x_NF).kneighbors(return_distance=True)
    cond_NK = conditional_affinities(dist_NK.astype(np.float64) ** 2, perplexity=perplexity)
    c = sparse.csr_matrix((cond_NK.ravel(), idx_NK.ravel(), np.arange(0, N * K + 1, K)), shape=(N, N))
    p = (c + c.T).tocsr()
    p.sort_indices()
    p.data /= max(p.data.sum(), np.finfo(np.float64).eps)
    return p.indptr.astype(np.int64), p.indices.astype(np.int64), p.data.astype(np.float64)


def conditional_affinities(
    sqdist_NK: np.ndarray, *, perplexity: float, steps: int = 100, tol: float = 1e-5
) -> np.ndarray:
    """p_{j|i} ``[N, K]`` over each point's neighbours: a Gaussian on the squared distances whose
    precision is bisected (all rows at once) until the entropy (nats) is log(perplexity) within ``tol``."""
    N = sqdist_NK.shape[0]
    target = np.log(perplexity)
    beta_N = np.ones(N)
    lo_N = np.full(N, -np.inf)
    hi_N = np.full(N, np.inf)
    p_NK = np.empty_like(sqdist_NK)
    todo_N = np.ones(N, bool)
    for _ in range(steps):
        p_NK = np.exp(-sqdist_NK * beta_N[:, None])
        s_N = np.maximum(p_NK.sum(axis=1), 1e-8)
        h_N = np.log(s_N) + beta_N * (sqdist_NK * p_NK).sum(axis=1) / s_N
        p_NK /= s_N[:, None]
        diff_N = h_N - target
        todo_N = np.abs(diff_N) > tol
        if not todo_N.any():
            break
        up_N = todo_N & (diff_N > 0)  # entropy too high: narrower Gaussian
        down_N = todo_N & (diff_N <= 0)
        lo_N[up_N] = beta_N[up_N]
        beta_N[up_N] = np.where(np.isinf(hi_N[up_N]), beta_N[up_N] * 2.0, (beta_N[up_N] + hi_N[up_N]) / 2.0)
        hi_N[down_N] = beta_N[down_N]
        beta_N[down_N] = np.where(np.isinf(lo_N[down_N]), beta_N[down_N] / 2.0, (beta_N[down_N] + lo_N[down_N]) / 2.0)
    return p_NK


def pca_start(x_NF: np.ndarray) -> np.ndarray:
    """float64 ``[N, 2]``: the first two principal components (signs fixed: each column's largest
    absolute loading positive), scaled so the first has standard deviation 1e-4."""
    xc_NF = np.asarray(x_NF, np.float64) - np.asarray(x_NF, np.float64).mean(axis=0)
    _, _, vt_CF = np.linalg.svd(xc_NF, full_matrices=False)
    vt_2F = vt_CF[:2] * np.sign(vt_CF[:2][np.arange(2), np.abs(vt_CF[:2]).argmax(axis=1)])[:, None]
    y_N2 = xc_NF @ vt_2F.T
    if y_N2.shape[1] < 2:  # one feature: a second coordinate of zeros
        y_N2 = np.concatenate([y_N2, np.zeros((y_N2.shape[0], 2 - y_N2.shape[1]))], axis=1)
    sd = float(np.std(y_N2[:, 0]))
    return y_N2 / (sd if sd > 0 else 1.0) * 1e-4


def tsne_2d(x_NF: np.ndarray, *, perplexity: float = 30.0, max_iter: int = 1000) -> np.ndarray:
    """The t-SNE map float32 ``[N, 2]`` of ``x_NF`` (see the module docstring for the method)."""
    from moetrace.analysis.jit import run_kernel

    N = x_NF.shape[0]
    indptr, indices, p = input_affinities(np.asarray(x_NF, np.float32), perplexity=perplexity)
    y_N2 = pca_start(x_NF)
    learning_rate = max(N / EARLY_EXAGGERATION / 4.0, 50.0)
    grad_N2 = np.zeros_like(y_N2)
    update_N2 = np.zeros_like(y_N2)
    gains_N2 = np.ones_like(y_N2)
    for it in range(max_iter):
        early = it < EXPLORATION_ITER
        if it == EXPLORATION_ITER:
            update_N2[:] = 0.0  # scikit-learn restarts its update and gains after the exploration
            gains_N2[:] = 1.0
        exaggeration = EARLY_EXAGGERATION if early else 1.0
        run_kernel("t-SNE gradient", _kernel, tsne_gradient_numpy, y_N2, indptr, indices, p, exaggeration, grad_N2)
        inc = update_N2 * grad_N2 < 0.0
        gains_N2[inc] += 0.2
        gains_N2[~inc] *= 0.8
        np.maximum(gains_N2, 0.01, out=gains_N2)
        grad_N2 *= gains_N2
        update_N2 *= 0.5 if early else 0.8
        update_N2 -= learning_rate * grad_N2
        y_N2 += update_N2
        if not early and (it + 1) % 50 == 0 and float(np.linalg.norm(grad_N2)) <= MIN_GRAD_NORM:
            break
    return y_N2.astype(np.float32)


def kl_divergence(x_NF: np.ndarray, y_N2: np.ndarray, *, perplexity: float = 30.0) -> float:
    """KL(P || Q) of a map ``y_N2`` of ``x_NF``: P as ``tsne_2d`` builds it, Q exact (for benchmarks and tests)."""
    indptr, indices, p = input_affinities(np.asarray(x_NF, np.float32), perplexity=perplexity)
    y = np.asarray(y_N2, np.float64)
    w_NN = 1.0 / (1.0 + ((y[:, None, :] - y[None, :, :]) ** 2).sum(axis=2))
    np.fill_diagonal(w_NN, 0.0)
    rows = np.repeat(np.arange(y.shape[0]), np.diff(indptr))
    q = np.maximum(w_NN[rows, indices] / w_NN.sum(), np.finfo(np.float64).eps)
    return float((p * np.log(np.maximum(p, np.finfo(np.float64).eps) / q)).sum())
