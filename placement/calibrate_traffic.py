"""The measured rows' traffic and the step model's prediction of them (docs/placement.md, "Calibration").

``predict`` prices measured shapes (``kernel_tables.KernelRow``) with the step model exactly as every
command does: the traffic of the benchmark's routing through the kernel's copy model
(``step_model.CopyModel.traffic``), then ``step_model.layer_seconds`` with the row's value types.

The benchmark's routing, re-drawn here:

- ``uniform`` (DeepEP's tests, aiconfigurator's DeepEP collectors): every token's top-k a uniform
  draw of k distinct experts, expert ``e`` on GPU ``e // (E / W)``; a few draws per shape (8 up to
  32 tokens per GPU, 4 up to 128, 2 below ``TOKENS_SIMULATED``, else 1), seeded by the shape, so the
  busiest GPU's excess over the mean is the one a single benchmark draw shows on average. Above
  ``TOKENS_SIMULATED`` tokens per GPU the copies of a ``TOKENS_SIMULATED``-token draw are scaled: the mean by
  ``s = tokens / TOKENS_SIMULATED``, each GPU's deviation from it by ``sqrt(s)`` (a count's variance
  grows linearly with the tokens); distinct peers are the draw's.
- ``balanced`` (TensorRT-LLM's collector, ``generate_balanced_expert_ids``): token ``i`` of every GPU
  goes to the ``k`` consecutive GPUs of group ``i % (W / k)`` (every GPU when ``W < k``);
- ``grouped:N`` (DeepEP's ``test_internode.py``): random expert scores, the N nodes with the highest
  maximum score, the top-k experts on them.

Also the value types a row may name (``ROW_VALUE_TYPES``) and each GPU kind's HBM bandwidth
(``HBM_BYTES_PER_S``, combine's reduction term).

Shape legend (docs/architecture.md): B batches, W EP ranks (GPUs), N rows of a table.

Out of scope: reading the tables (``kernel_tables``); fitting (``calibrate_fit``); the congestion of a
shared fabric; the ``notify``/``prepare`` exchanges before a dispatch (the tables time the transfer
with a known layout).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.kernel_tables import KernelRow
from moetrace.placement.step_model import VALUE_TYPES, GpuTraffic, Kernel, Phase, ValueType, copy_model, layer_seconds

__all__ = [
    "NVFP4",
    "ROW_VALUE_TYPES",
    "HBM_BYTES_PER_S",
    "TOKENS_SIMULATED",
    "hbm_bytes_per_s",
    "row_traffic",
    "predict",
]

NVFP4 = ValueType(name="nvfp4", bytes_per_value=0.5, scale_bytes=1.0, block=16)
#: the value types a measured row may name
ROW_VALUE_TYPES: dict[str, ValueType] = {**VALUE_TYPES, "nvfp4": NVFP4}
#: HBM bandwidth per GPU kind (datasheets): combine's reduction term; 3.35 TB/s for any other kind
HBM_BYTES_PER_S = {
    "h100": 3.35e12,
    "h800": 3.35e12,
    "h200": 4.8e12,
    "b200": 8e12,
    "gb200": 8e12,
    "b300": 8e12,
    "gb300": 8e12,
}
#: tokens per GPU drawn at most; larger token counts scale a draw of this many (module docstring)
TOKENS_SIMULATED = 512


#: the cross-validated median relative error a latency must remove to be kept
def hbm_bytes_per_s(gpu: str) -> float:
    return HBM_BYTES_PER_S.get(gpu.lower(), 3.35e12)


# ------------------------------------------------------------------------------ traffic of a row
def _batches(tokens: int) -> int:
    return 8 if tokens <= 32 else 4 if tokens <= 128 else 2 if tokens < TOKENS_SIMULATED else 1


def _uniform_ids(rng: np.random.Generator, n: int, E: int, K: int) -> np.ndarray:
    """``n`` draws of ``K`` distinct experts out of ``E``, uniform, int64 [n, K]."""
    if K * 4 >= E:  # few experts: the top-k of random keys
        return np.argpartition(rng.random((n, E)), K - 1, axis=1)[:, :K] if K < E else np.tile(np.arange(E), (n, 1))
    out = rng.integers(0, E, size=(n, K))
    bad = np.arange(n)
    for _ in range(1000):  # redraw the rows holding a repeated expert (a minority: 4K < E)
        s = np.sort(out[bad], axis=1)
        bad = bad[(s[:, 1:] == s[:, :-1]).any(axis=1)]
        if not bad.size:
            return out
        out[bad] = rng.integers(0, E, size=(bad.size, K))
    raise RuntimeError("could not draw distinct experts")


def _weighted_ids(rng: np.random.Generator, n: int, loads_E: np.ndarray, K: int) -> np.ndarray:
    """``n`` draws of ``K`` distinct experts with probability proportional to ``loads_E`` (Gumbel top-k)."""
    with np.errstate(divide="ignore"):
        logp = np.log(loads_E / loads_E.sum())
    keys = logp[None, :] + rng.gumbel(size=(n, loads_E.size))
    return np.argpartition(-keys, K - 1, axis=1)[:, :K]


def _grouped_ids(rng: np.random.Generator, n: int, E: int, K: int, groups: int, top: int) -> np.ndarray:
    """Group-limited routing, int64 [n, K]: per token, uniform expert scores; the ``top`` groups (of
    ``groups`` equal blocks of experts) with the highest maximum score, then the top-``K`` experts
    inside them. Drawn without the [n, E] scores: a group's maximum of ``m`` uniforms is ``U**(1/m)``,
    and given it, the group's other scores are uniform below it."""
    m = E // groups
    gmax = rng.random((n, groups)) ** (1.0 / m)
    keep = np.sort(np.argpartition(-gmax, top - 1, axis=1)[:, :top], axis=1)  # [n, top] chosen groups
    top_max = np.take_along_axis(gmax, keep, axis=1)
    sc = rng.random((n, top, m)) * top_max[:, :, None]
    sc[:, :, 0] = top_max  # the maximum sits at a random slot of its group
    slot = rng.integers(0, m, size=(n, top))
    order = (np.arange(m)[None, None, :] + slot[:, :, None]) % m  # rotate: slot 0 -> a random expert
    ids_local = np.argpartition(-sc.reshape(n, top * m), K - 1, axis=1)[:, :K]
    g_idx, j = np.divmod(ids_local, m)
    expert_in_group = np.take_along_axis(order.reshape(n, top * m), ids_local, axis=1)
    del j
    return np.take_along_axis(keep, g_idx, axis=1) * m + expert_in_group


def _balanced_ranks(T: int, W: int, K: int) -> np.ndarray:
    """TensorRT-LLM's balanced routing as destination GPUs, int64 [T, K] (the same for every source)."""
    i = np.arange(T)[:, None]
    k = np.arange(K)[None, :]
    if W >= K:
        return (i % (W // K)) * K + k
    return np.broadcast_to(k % W, (T, K)).copy()


@functools.lru_cache(maxsize=4096)
def _traffic(W: int, g: int, T: int, E: int, K: int, copies: str, routing: str, seed: int, loads: tuple | None):
    B = 1 if routing == "balanced" else _batches(T)
    Ts = min(T, TOKENS_SIMULATED)
    n = B * W * Ts
    if routing == "balanced":
        rank_TK = np.tile(_balanced_ranks(Ts, W, K), (W, 1))
    else:
        rng = np.random.default_rng([seed, W, g, T, E, K])
        if loads:
            ids = _weighted_ids(rng, n, np.asarray(loads, dtype=np.float64), K)
        elif routing.startswith("grouped:"):
            ids = _grouped_ids(rng, n, E, K, W // g, int(routing.split(":")[1]))
        else:
            ids = _uniform_ids(rng, n, E, K)
        rank_TK = ids // (E // W)
    src_T = np.tile(np.repeat(np.arange(W), Ts), B)
    batch_T = np.repeat(np.arange(B), W * Ts)
    t = copy_model(copies).traffic(
        rank_TK=rank_TK,
        valid_TK=np.ones(rank_TK.shape, dtype=bool),
        batch_T=batch_T,
        src_rank_T=src_T,
        num_batches=B,
        num_ranks=W,
        ranks_per_node=g,
    )
    if T > Ts:  # scale the copies (module docstring); per-GPU means where the GPUs differ (loads)
        s = T / Ts
        axis = 0 if loads else (0, 1)

        def scale(x: np.ndarray) -> np.ndarray:
            m = x.mean(axis=axis, keepdims=True)
            return np.maximum(s * m + math.sqrt(s) * (x - m), 0.0)

        t = t._replace(**{f: scale(getattr(t, f)) for f in ("send_intra", "recv_intra", "send_inter", "recv_inter")})
    for x in t:
        x.flags.writeable = False
    return t


def row_traffic(row: KernelRow, *, seed: int = 0, loads_E: Sequence[float] | None = None) -> GpuTraffic:
    """The dispatch traffic of ``row``'s benchmark (its routing, its kernel's copy model), float64 [B, W]
    per field; cached per shape. ``loads_E``: route in proportion to these per-expert loads instead
    (top-k distinct experts, weighted)."""
    loads = None
    if loads_E is not None:
        arr = np.asarray(loads_E, dtype=np.float64)
        if arr.shape != (row.num_experts,) or not (arr >= 0).all() or np.count_nonzero(arr) < row.top_k:
            raise ConfigError(
                f"loads: need {row.num_experts} non-negative per-expert loads with at least top-k={row.top_k} above 0"
            )
        loads = tuple(arr.tolist())
    return _traffic(
        row.ep_size,
        row.gpus_per_node,
        row.tokens_per_rank,
        row.num_experts,
        row.top_k,
        row.copies,
        row.routing,
        seed,
        loads,
    )


def _row_kernel(row: KernelRow, kernel: Kernel) -> Kernel:
    """``kernel`` with ``row``'s value types on the wire (the kernel's own where the names agree)."""

    def value(phase: Phase, name: str) -> ValueType:
        return phase.value if phase.value.name == name else ROW_VALUE_TYPES[name]

    return replace(
        kernel,
        dispatch=replace(kernel.dispatch, value=value(kernel.dispatch, row.dispatch_type)),
        combine=replace(kernel.combine, value=value(kernel.combine, row.combine_type)),
    )


def predict(
    rows: Iterable[KernelRow], kernel: Kernel, *, seed: int = 0, loads_E: Sequence[float] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The step model's dispatch and combine time of each row in microseconds, float64 [N] each:
    ``layer_seconds`` of the row's traffic (``row_traffic``) with ``kernel``'s parameters and the row's
    value types, averaged over the drawn batches."""
    d, c = [], []
    for row in rows:
        t = row_traffic(row, seed=seed, loads_E=loads_E)
        s = layer_seconds(t, kernel=_row_kernel(row, kernel), hidden_size=row.hidden, ranks_per_node=row.gpus_per_node)
        d.append(float(s.dispatch.mean()) * 1e6)
        c.append(float(s.combine.mean()) * 1e6)
    return np.asarray(d), np.asarray(c)
