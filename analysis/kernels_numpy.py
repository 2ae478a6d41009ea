"""NumPy versions of the numba kernels of ``counts`` and ``affinity``: same signatures, same effect.

Used only where numba cannot compile a kernel (``analysis/jit.py``); tests check each against its
numba kernel on random inputs. They are vectorised per call (one batch of tokens), not per token, so
they are slower than the kernels but not Python-loop slow.

Shape legend (docs/architecture.md): T tokens, L MoE layers (L_sel selected), K top-k slots,
E experts, R requests, S stages, X = L*K flat ids of one token.
"""

from __future__ import annotations

import numpy as np


def count_numpy(
    counts_RSLE: np.ndarray,
    row_T: np.ndarray,
    stage_T: np.ndarray,
    topk_ids_TX: np.ndarray,
    layers_L: np.ndarray,
    top_k: int,
    num_chunks: int,
) -> int:
    """``counts.count_kernel``: add each kept token's ids at the selected layers to
    ``counts_RSLE[row, stage, j, id]`` in place; return the number of ids ``>= E`` plus the cells that
    overflowed their dtype (0 when the batch is clean). ``num_chunks`` is unused (no threads)."""
    R, S, Lsel, E = counts_RSLE.shape
    keep = (row_T >= 0) & (stage_T >= 0)
    if not keep.any() or Lsel == 0:
        return 0
    ids = topk_ids_TX[keep].reshape(int(keep.sum()), -1, top_k)[:, layers_L, :].astype(np.int64)  # [n, Lsel, K]
    r = row_T[keep].astype(np.int64)[:, None, None]
    s = stage_T[keep].astype(np.int64)[:, None, None]
    j = np.arange(Lsel, dtype=np.int64)[None, :, None]
    bad = int((ids >= E).sum())
    ok = (ids >= 0) & (ids < E)
    cell = (((r * S + s) * Lsel + j) * E + ids)[ok]
    where, add = np.unique(cell, return_counts=True)
    flat = counts_RSLE.reshape(-1)
    room = np.iinfo(counts_RSLE.dtype).max - flat[where].astype(np.int64)
    overflow = int((add > room).sum())
    flat[where] = (flat[where].astype(np.int64) + add).astype(counts_RSLE.dtype)  # wraps as the kernel does
    return bad + overflow


def pair_numpy(
    topk_ids_TX: np.ndarray,
    keep_T: np.ndarray,
    top_k: int,
    cross_LEE: np.ndarray,
    co_LEE: np.ndarray,
    single_LE: np.ndarray,
    tokens_L: np.ndarray,
    num_chunks: int,
) -> None:
    """``affinity.pair_kernel``: add the kept tokens' cross-layer pairs, co-activations, single counts
    and routed-token counts in place. ``num_chunks`` is unused (no threads)."""
    L, E = co_LEE.shape[0], co_LEE.shape[1]
    ids_TLK = topk_ids_TX[keep_T].reshape(int(keep_T.sum()), L, top_k).astype(np.int64)
    valid_TLK = (ids_TLK >= 0) & (ids_TLK < E)
    for l in range(L):
        a_TK, va_TK = ids_TLK[:, l], valid_TLK[:, l]
        single_LE[l] += np.bincount(a_TK[va_TK], minlength=E)
        tokens_L[l] += int(va_TK.any(axis=1).sum())
        i, j = np.triu_indices(top_k, k=1)
        a, b = a_TK[:, i], a_TK[:, j]
        ok = va_TK[:, i] & va_TK[:, j] & (a != b)
        np.add.at(co_LEE[l], (a[ok], b[ok]), 1)
        np.add.at(co_LEE[l], (b[ok], a[ok]), 1)
        if l + 1 < L:
            b_TK, vb_TK = ids_TLK[:, l + 1], valid_TLK[:, l + 1]
            pa = np.repeat(a_TK, top_k, axis=1)
            pb = np.tile(b_TK, (1, top_k))
            ok2 = np.repeat(va_TK, top_k, axis=1) & np.tile(vb_TK, (1, top_k))
            np.add.at(cross_LEE[l], (pa[ok2], pb[ok2]), 1)
