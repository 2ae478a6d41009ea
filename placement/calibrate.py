"""Calibration of the step model against measured all-to-all kernels (docs/placement.md, "Calibration").

``predict`` prices measured shapes (``kernel_tables.KernelRow``) with the step model exactly as every
command does: the traffic of the benchmark's routing through the kernel's copy model
(``step_model.CopyModel.traffic``), then ``step_model.layer_seconds`` with the row's value types.
``fit`` finds a kernel's parameters per phase (dispatch, combine) from measured rows; ``calibrate``
fits every kernel of a set of tables into a links file (``hardware.Hardware``) with a report.

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

The fit, per kernel and phase, on the training rows (``hold_out`` rows are predicted, never fitted):
least squares on ``log(predicted / measured)`` (relative error; soft-L1 loss, so a few noisy rows do
not drag it), parameters positive (fitted as logarithms): the fixed cost, each link class's bandwidth
where the rows send over it (intra: any row with more than one GPU per node; inter: any row with more
than one node), else the class is taken from a fallback kernel (``calibrate``'s ``base``: the H100
preset's network link for single-node tables) and the kernel's ``source`` says so.
Per-message latencies are fitted only where the data supports them: the intra-node latency is
kept when adding it lowers the cross-validated median relative error (4 folds of the training rows)
by at least ``LATENCY_GAIN``; then the inter-node latency likewise, with one fold per multi-node EP
size (a per-peer cost must carry over to other EP sizes, whose peers differ). Else it stays 0.
Combine is its own phase (its own fixed cost and links) plus the reduction term at the GPU's HBM
bandwidth (``HBM_BYTES_PER_S``): it is proportional to the copies moved, so the tables cannot tell it
from combine's bandwidth; it is held, not fitted.

Hold-out syntax (``parse_hold_out``): ``TERM[,TERM...]`` holds out the rows matching every term;
``;`` separates alternatives (a row matching any group is held out). A term is ``FIELD OP VALUE``
with ``OP`` one of ``= != < <= > >=`` (``=``/``!=`` take ``a|b`` lists) over the fields ``kernel gpu
ep gpn nodes hidden topk experts tokens dispatch_type combine_type routing``, or ``every=N``
(every N-th row of the input, the N-th, 2N-th, ...). Examples: ``tokens>=256``, ``gpu=h200``,
``every=5``, ``kernel=deepep-ll,nodes>1``.

Shape legend (docs/architecture.md): B batches, W EP ranks (GPUs), N rows of a table.

Out of scope: reading the tables (``kernel_tables``); the congestion of a shared fabric; the
``notify``/``prepare`` exchanges before a dispatch (the tables time the transfer with a known layout).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.cost import Link, Links
from moetrace.placement.hardware import Hardware
from moetrace.placement.kernel_tables import KERNEL_COPIES, KernelRow, gpus_per_node_of
from moetrace.placement.step_model import (
    BF16,
    VALUE_TYPES,
    GpuTraffic,
    Kernel,
    Phase,
    ValueType,
    copy_model,
    layer_seconds,
    phase_seconds_BW,
)

__all__ = [
    "NVFP4",
    "ROW_VALUE_TYPES",
    "HBM_BYTES_PER_S",
    "TOKENS_SIMULATED",
    "LATENCY_GAIN",
    "KERNEL_NAMES",
    "row_traffic",
    "predict",
    "parse_hold_out",
    "PhaseFit",
    "KernelFit",
    "fit",
    "fit_kernel",
    "Calibration",
    "calibrate",
    "calibration_text",
    "ShapeCost",
    "cost_of_shape",
    "format_cost",
    "errors",
    "format_rows",
    "format_fit",
]

#: NVFP4: 4-bit values, one 8-bit scale per 16 (TensorRT-LLM's ``hidden/2 + hidden/16`` bytes)
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
LATENCY_GAIN = 0.005
#: the kernel name a fitted copy model gets when the rows do not say (``Kernel.name``)
KERNEL_NAMES = {"expert": "deepep-ll", "node": "deepep-normal", "rank": "nvlink-a2a"}
_FOLDS = 4


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


# ------------------------------------------------------------------------------ hold-out
_FIELDS: dict[str, Callable[[KernelRow], Any]] = {
    "kernel": lambda r: r.kernel,
    "gpu": lambda r: r.gpu,
    "ep": lambda r: r.ep_size,
    "gpn": lambda r: r.gpus_per_node,
    "nodes": lambda r: r.nodes,
    "hidden": lambda r: r.hidden,
    "topk": lambda r: r.top_k,
    "experts": lambda r: r.num_experts,
    "tokens": lambda r: r.tokens_per_rank,
    "dispatch_type": lambda r: r.dispatch_type,
    "combine_type": lambda r: r.combine_type,
    "routing": lambda r: r.routing,
}
_OPS = {
    "=": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}
HoldOut = Callable[[KernelRow, int], bool]


def _term(text: str, spec: str) -> HoldOut:
    m = re.fullmatch(r"\s*([a-z_]+)\s*(!=|<=|>=|=|<|>)\s*([^\s].*?)\s*", text)
    if not m:
        raise ConfigError(
            f"--hold-out {spec!r}: cannot read {text!r}; write FIELD OP VALUE (e.g. tokens>=256, gpu=h200) or every=N"
        )
    name, op, value = m.groups()
    if name == "every":
        if op != "=" or not (value.isascii() and value.isdigit() and len(value) <= 9) or int(value) < 2:
            raise ConfigError(f"--hold-out {spec!r}: every=N needs a whole N >= 2")
        n = int(value)
        return lambda row, i: (i + 1) % n == 0
    if name not in _FIELDS:
        raise ConfigError(f"--hold-out {spec!r}: unknown field {name!r}; use {', '.join(_FIELDS)} or every")
    get = _FIELDS[name]
    numeric = name in ("ep", "gpn", "nodes", "hidden", "topk", "experts", "tokens")
    values = value.split("|") if op in ("=", "!=") else [value]
    try:
        if numeric and not all(v.isascii() and len(v) <= 19 for v in values):  # int() takes '٣' and 4,300 digits
            raise ValueError(value)
        parsed = [int(v) if numeric else v.lower() for v in values]
    except ValueError:
        raise ConfigError(f"--hold-out {spec!r}: {name} takes whole numbers, got {value!r}") from None
    if not numeric and op not in ("=", "!="):
        raise ConfigError(f"--hold-out {spec!r}: {name} takes = or != only")
    if op == "=":
        return lambda row, i: get(row) in parsed
    if op == "!=":
        return lambda row, i: get(row) not in parsed
    cmp, bound = _OPS[op], parsed[0]
    return lambda row, i: cmp(get(row), bound)


def parse_hold_out(spec: str | None) -> HoldOut | None:
    """The rule of a hold-out spec (module docstring): ``rule(row, index) -> held out``; None: none."""
    if spec is None or not spec.strip():
        return None
    groups = []
    for alt in spec.split(";"):
        terms = [_term(t, spec) for t in alt.split(",") if t.strip()]
        if not terms:
            raise ConfigError(f"--hold-out {spec!r}: an empty alternative")
        groups.append(terms)
    return lambda row, i: any(all(t(row, i) for t in terms) for terms in groups)


# ------------------------------------------------------------------------------ fast evaluation
@dataclass
class _Group:
    idx: np.ndarray  # rows of this EP size, int [R]
    traffic: GpuTraffic  # the phase's traffic (combine: reversed), stacked [R * Bmax, W]
    returned: np.ndarray  # copies coming back to each GPU (combine's reduction), [R * Bmax, W]
    bytes: np.ndarray  # bytes per copy, [R * Bmax, 1]
    mask: np.ndarray  # which of the Bmax batches each row drew, [R, Bmax]


class _PhaseEval:
    """One phase's time of many rows at once, exactly as ``layer_seconds`` computes it (the rows'
    traffic stacked per EP size and priced by one ``phase_seconds_BW`` call each)."""

    def __init__(self, rows: Sequence[KernelRow], phase: str, *, seed: int = 0):
        self.phase = phase
        self.n = len(rows)
        by_w: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_w.setdefault(r.ep_size, []).append(i)
        self.groups: list[_Group] = []
        has_intra = np.zeros(self.n, bool)
        has_inter = np.zeros(self.n, bool)
        for idx in by_w.values():
            ts = [row_traffic(rows[i], seed=seed) for i in idx]
            Bmax = max(t.send_intra.shape[0] for t in ts)

            def pad(x: np.ndarray, Bmax: int = Bmax) -> np.ndarray:
                return np.concatenate([x, np.zeros((Bmax - x.shape[0], x.shape[1]))]) if x.shape[0] < Bmax else x

            fields = [np.concatenate([pad(getattr(t, f)) for t in ts]) for f in GpuTraffic._fields]
            traffic = GpuTraffic(*fields)
            returned = traffic.send_intra + traffic.send_inter
            if phase == "combine":
                traffic = traffic.reversed()
            vt = [ROW_VALUE_TYPES[rows[i].dispatch_type if phase == "dispatch" else rows[i].combine_type] for i in idx]
            nbytes = np.repeat([v.bytes_per_token(rows[i].hidden) for v, i in zip(vt, idx, strict=True)], Bmax)[:, None]
            mask = np.zeros((len(idx), Bmax))
            for j, t in enumerate(ts):
                mask[j, : t.send_intra.shape[0]] = 1.0
            self.groups.append(_Group(np.asarray(idx), traffic, returned, nbytes, mask))
            for j, t in zip(idx, ts, strict=True):
                has_intra[j] = t.send_intra.any()
                has_inter[j] = t.send_inter.any()
        self.has_intra, self.has_inter = has_intra, has_inter

    def seconds(self, links: Links, fixed_s: float, reduce_bytes_per_s: float) -> np.ndarray:
        """The phase's time per row, seconds, float64 [N] (``links.inter_nic`` must be ``gpu``)."""
        out = np.empty(self.n)
        for g in self.groups:
            t = phase_seconds_BW(g.traffic, links=links, bytes_per_copy=g.bytes, ranks_per_node=1)  # type: ignore[arg-type]
            if self.phase == "combine":
                t = t + g.returned * (g.bytes / reduce_bytes_per_s)
            m = t.max(axis=1).reshape(g.mask.shape)
            out[g.idx] = (m * g.mask).sum(axis=1) / g.mask.sum(axis=1) + fixed_s
        return out


# ------------------------------------------------------------------------------ the fit
_PARAMS = ("fixed_s", "intra_bytes_per_s", "intra_latency_s", "inter_bytes_per_s", "inter_latency_s")
_BOUNDS = {
    "fixed_s": (1e-8, 1e-2),
    "intra_bytes_per_s": (1e8, 1e14),
    "inter_bytes_per_s": (1e8, 1e14),
    "intra_latency_s": (1e-11, 1e-4),
    "inter_latency_s": (1e-11, 1e-4),
}


def _links_of(p: Mapping[str, float]) -> Links:
    return Links(
        intra=Link(bytes_per_s=p["intra_bytes_per_s"], latency_s=p["intra_latency_s"]),
        inter=Link(bytes_per_s=p["inter_bytes_per_s"], latency_s=p["inter_latency_s"]),
    )


def errors(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float | int]:
    """Median and worst relative error ``|predicted / measured - 1|`` over the measured rows (NaN skipped)."""
    ok = np.isfinite(measured) & np.isfinite(predicted)
    if not ok.any():
        return {"n": 0, "median": math.nan, "worst": math.nan}
    e = np.abs(predicted[ok] / measured[ok] - 1.0)
    return {"n": int(ok.sum()), "median": float(np.median(e)), "worst": float(e.max())}


def _solve(
    ev: _PhaseEval,
    meas: np.ndarray,
    train: np.ndarray,
    start: dict[str, float],
    free: Sequence[str],
    reduce: float,
    *,
    starts: Sequence[float] = (1.0,),
) -> dict[str, float]:
    """Least squares on log(pred / meas) over ``train`` for the ``free`` parameters (as logarithms),
    from ``start`` with its fixed cost times each of ``starts``; the best of those."""
    from moetrace._deps import require

    opt = require("scipy.optimize", purpose="fitting the step model (moetrace calibrate)")
    p = dict(start)
    if not free or not train.any():
        return p
    lo = np.log([_BOUNDS[k][0] for k in free])
    hi = np.log([_BOUNDS[k][1] for k in free])
    logm = np.log(meas[train])

    def resid(x: np.ndarray) -> np.ndarray:
        q = dict(p, **{k: float(math.exp(v)) for k, v in zip(free, x, strict=True)})
        s = ev.seconds(_links_of(q), q["fixed_s"], reduce)[train]
        return np.log(np.maximum(s, 1e-12)) - logm

    best = None
    for scale in starts:
        x0 = np.clip(np.log([start[k] * (scale if k == "fixed_s" else 1.0) for k in free]), lo + 1e-9, hi - 1e-9)
        r = opt.least_squares(
            resid, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.05, diff_step=1e-3, ftol=1e-7, xtol=1e-7, gtol=1e-7
        )
        if best is None or r.cost < best.cost:
            best = r
    assert best is not None
    return dict(p, **{k: float(math.exp(v)) for k, v in zip(free, best.x, strict=True)})


@dataclass
class PhaseFit:
    """One phase's fitted parameters and how well they do."""

    phase: str
    params: dict[str, float]  # _PARAMS
    fitted: list[str]  # the parameters the fit moved (the rest: from a fallback, or 0 for latencies)
    taken: dict[str, str]  # parameter -> where it came from when not fitted
    variants: list[dict[str, Any]]  # latencies tried: {"latency", "folds", "cv_median_without", "cv_median_with"}
    predicted_us: np.ndarray  # every row's prediction (train and held out), float64 [N]

    def to_json(self) -> dict[str, Any]:
        p = self.params
        return {
            "fixed_us": p["fixed_s"] * 1e6,
            "intra_GBps": p["intra_bytes_per_s"] / 1e9,
            "intra_latency_us": p["intra_latency_s"] * 1e6,
            "inter_GBps": p["inter_bytes_per_s"] / 1e9,
            "inter_latency_us": p["inter_latency_s"] * 1e6,
            "fitted": self.fitted,
            "taken": self.taken,
            "latency_variants": self.variants,
        }


def _fit_phase(
    rows: Sequence[KernelRow],
    phase: str,
    train: np.ndarray,
    *,
    start: dict[str, float],
    taken_from: dict[str, str],
    reduce: float,
    seed: int,
    latencies: Collection[str] = ("intra", "inter"),
) -> PhaseFit:
    meas = np.array([r.dispatch_us if phase == "dispatch" else r.combine_us for r in rows]) * 1e-6
    ev = _PhaseEval(rows, phase, seed=seed)
    train = train & np.isfinite(meas)
    classes = []
    taken: dict[str, str] = {}
    for c, has in (("intra", ev.has_intra), ("inter", ev.has_inter)):
        if (has & train).any():
            classes.append(c)
        else:
            taken[f"{c}_bytes_per_s"] = taken[f"{c}_latency_s"] = taken_from.get(c, "the starting value")
    p0 = dict(start)
    p0["fixed_s"] = float(np.quantile(meas[train], 0.02)) * 0.9 if train.any() else start["fixed_s"]
    for c in classes:
        p0[f"{c}_latency_s"] = 0.0
    base_free = ["fixed_s"] + [f"{c}_bytes_per_s" for c in classes]
    idx_train = np.flatnonzero(train)
    row_folds = [idx_train[f::_FOLDS] for f in range(_FOLDS)]
    multi = [r.ep_size for r, m in zip(rows, train & ev.has_inter, strict=True) if m]
    ep_folds = [
        idx_train[[rows[int(i)].ep_size == e and ev.has_inter[i] for i in idx_train]] for e in sorted(set(multi))
    ]
    fitted: dict[tuple[str, ...], dict[str, float]] = {}

    def fit_combo(combo: tuple[str, ...]) -> dict[str, float]:
        if combo not in fitted:
            q0 = dict(p0, **{k: 2e-7 for k in combo})
            fitted[combo] = _solve(ev, meas, train, q0, base_free + list(combo), reduce, starts=(1.0, 0.3))
        return fitted[combo]

    def cv(combo: tuple[str, ...], folds: list[np.ndarray]) -> float:
        """Median relative error of each fold predicted by a fit (from the full fit) to the other rows."""
        q = fit_combo(combo)
        pred = np.full(len(rows), np.nan)
        for idx in folds:
            test = np.zeros(len(rows), bool)
            test[idx] = True
            qf = _solve(ev, meas, train & ~test, q, base_free + list(combo), reduce)
            pred[test] = ev.seconds(_links_of(qf), qf["fixed_s"], reduce)[test]
        tested = np.concatenate(folds)
        return errors(pred[tested], meas[tested])["median"]

    variants: list[dict[str, Any]] = []
    best: tuple[str, ...] = ()
    # the intra-node latency on folds of rows; then the inter-node one on folds of EP sizes (a per-peer
    # cost must carry over to other EP sizes: the peers grow with them)
    for c, folds, how in (
        ("intra", row_folds, "rows"),
        ("inter", ep_folds if len(ep_folds) >= 2 else row_folds, "EP sizes"),
    ):
        if c not in classes or c not in latencies:
            continue
        how = how if c == "intra" or len(ep_folds) >= 2 else "rows"
        without, with_ = cv(best, folds), cv((*best, f"{c}_latency_s"), folds)
        variants.append({"latency": c, "folds": how, "cv_median_without": without, "cv_median_with": with_})
        if with_ <= without - LATENCY_GAIN:
            best = (*best, f"{c}_latency_s")
    q = fit_combo(best)
    pred_us = ev.seconds(_links_of(q), q["fixed_s"], reduce) * 1e6
    return PhaseFit(
        phase=phase, params=q, fitted=base_free + list(best), taken=taken, variants=variants, predicted_us=pred_us
    )


@dataclass
class KernelFit:
    """A fitted kernel, its phases' fits and which rows were held out."""

    kernel: Kernel
    rows: list[KernelRow]
    held_out: np.ndarray  # bool [N]
    dispatch: PhaseFit
    combine: PhaseFit

    def report(self) -> dict[str, Any]:
        """Parameters and errors (median/worst) per phase, split (train, held_out) and GPU kind."""
        out: dict[str, Any] = {"kernel": self.kernel.name, "copies": self.kernel.copies, "source": self.kernel.source}
        out["rows"] = {"train": int((~self.held_out).sum()), "held_out": int(self.held_out.sum())}
        gpus = sorted({r.gpu for r in self.rows})
        for pf in (self.dispatch, self.combine):
            meas = np.array([r.dispatch_us if pf.phase == "dispatch" else r.combine_us for r in self.rows])
            errs: dict[str, Any] = {}
            for split, m in (("train", ~self.held_out), ("held_out", self.held_out)):
                if not m.any():
                    continue
                errs[split] = {"all": errors(pf.predicted_us[m], meas[m])}
                if len(gpus) > 1:
                    for g in gpus:
                        gm = m & np.array([r.gpu == g for r in self.rows])
                        if gm.any():
                            errs[split][g] = errors(pf.predicted_us[gm], meas[gm])
            out[pf.phase] = {**pf.to_json(), "errors": errs}
        return out


def _start_links(base: Kernel | None, phase: str) -> dict[str, float]:
    links = (
        getattr(base, phase).links
        if base is not None
        else Links(intra=Link(bytes_per_s=150e9, latency_s=0.0), inter=Link(bytes_per_s=40e9, latency_s=0.0))
    )
    return {
        "fixed_s": getattr(base, phase).fixed_s if base is not None else 10e-6,
        "intra_bytes_per_s": links.intra.bytes_per_s,
        "intra_latency_s": links.intra.latency_s,
        "inter_bytes_per_s": links.inter.bytes_per_s,
        "inter_latency_s": links.inter.latency_s,
    }


def fit_kernel(
    rows: Sequence[KernelRow],
    *,
    copies: str | None = None,
    hold_out: str | HoldOut | None = None,
    fallback: Kernel | None = None,
    fallback_name: str = "",
    name: str | None = None,
    dispatch_value: ValueType | None = None,
    combine_value: ValueType = BF16,
    reduce_bytes_per_s: float | None = None,
    seed: int = 0,
    latencies: Collection[str] = ("intra", "inter"),
) -> KernelFit:
    """Fit one kernel (module docstring) to ``rows`` of one copy model. ``fallback``: the kernel whose
    link classes are taken where the rows do not send over them (``fallback_name`` says whose);
    ``dispatch_value``: the fitted kernel's dispatch value type (default: the rows' most common);
    ``latencies``: the link classes whose per-message latency may be tried (the others stay 0)."""
    rows = list(rows)
    if not rows:
        raise ConfigError("calibrate: no measured rows to fit")
    kinds = {r.copies for r in rows}
    copies = copies or (kinds.pop() if len(kinds) == 1 else "")
    if not copies or any(r.copies != copies for r in rows):
        raise ConfigError(
            f"calibrate: rows of several copy models ({', '.join(sorted({r.copies for r in rows}))}); fit one at a time"
        )
    rule = parse_hold_out(hold_out) if isinstance(hold_out, str) or hold_out is None else hold_out
    held = np.array([bool(rule(r, i)) if rule else False for i, r in enumerate(rows)])
    if held.all():
        raise ConfigError(f"--hold-out holds out all {len(rows)} rows of {rows[0].kernel}; nothing is left to fit")
    gpus = sorted({r.gpu for r in rows})
    reduce = reduce_bytes_per_s or hbm_bytes_per_s(gpus[0])
    taken_from = {"intra": fallback_name or "the starting value", "inter": fallback_name or "the starting value"}
    fits = {
        ph: _fit_phase(
            rows,
            ph,
            ~held,
            start=_start_links(fallback, ph),
            taken_from=taken_from,
            reduce=reduce,
            seed=seed,
            latencies=latencies,
        )
        for ph in ("dispatch", "combine")
    }
    if dispatch_value is None:  # the rows' most common dispatch type (ties: the wider one)
        names = [r.dispatch_type for r in rows]
        dispatch_value = ROW_VALUE_TYPES[max(("bf16", "fp8", "nvfp4"), key=names.count)]
    kname = name or (rows[0].kernel if len({r.kernel for r in rows}) == 1 else KERNEL_NAMES[copies])
    srcs = sorted({r.source.split(":")[0] for r in rows})
    notes = sorted(
        {
            f"{c} link from {pf.taken[f'{c}_bytes_per_s']}"
            for pf in fits.values()
            for c in ("intra", "inter")
            if f"{c}_bytes_per_s" in pf.taken
        }
    )
    source = f"fitted to {', '.join(srcs)} ({len(rows) - int(held.sum())} rows)" + "".join(f"; {n}" for n in notes)
    kernel = Kernel(
        name=kname,
        copies=copies,  # type: ignore[arg-type]
        dispatch=Phase(
            value=dispatch_value, links=_links_of(fits["dispatch"].params), fixed_s=fits["dispatch"].params["fixed_s"]
        ),
        combine=Phase(
            value=combine_value, links=_links_of(fits["combine"].params), fixed_s=fits["combine"].params["fixed_s"]
        ),
        reduce_bytes_per_s=reduce,
        source=source,
    )
    return KernelFit(kernel=kernel, rows=rows, held_out=held, dispatch=fits["dispatch"], combine=fits["combine"])


def fit(rows: Sequence[KernelRow], *, copies: str | None = None, hold_out: str | None = None, **kw: Any) -> Kernel:
    """The fitted kernel of ``rows`` (``fit_kernel`` with its report dropped)."""
    return fit_kernel(rows, copies=copies, hold_out=hold_out, **kw).kernel


# ------------------------------------------------------------------------------ a links file
@dataclass
class Calibration:
    """What ``moetrace calibrate`` computes: the hardware (a links file) and every kernel's fit."""

    hardware: Hardware
    fits: dict[str, KernelFit]  # copy model -> its fit (kernels taken whole from the base are absent)
    hold_out: str | None = None
    derived: dict[str, str] = field(default_factory=dict)  # copy model -> how its kernel was made without rows
    no_latency: list[str] = field(default_factory=list)  # latencies left out on request (``calibrate``)
    notes: list[str] = field(default_factory=list)  # anything else the fit's reader should know

    def rows_json(self) -> list[dict[str, Any]]:
        """One object per measured row: its settings, measured and predicted times, held out or not."""
        out = []
        for kf in self.fits.values():
            for i, r in enumerate(kf.rows):
                out.append(
                    {
                        **r.settings(),
                        "measured_dispatch_us": _num(r.dispatch_us),
                        "predicted_dispatch_us": _num(kf.dispatch.predicted_us[i]),
                        "measured_combine_us": _num(r.combine_us),
                        "predicted_combine_us": _num(kf.combine.predicted_us[i]),
                        "held_out": bool(kf.held_out[i]),
                    }
                )
        return out

    def to_json(self) -> dict[str, Any]:
        """A links file (``hardware.load_hardware`` reads it) with the fit's report and rows."""
        return {
            **self.hardware.to_json(),
            "fit": {
                "hold_out": self.hold_out,
                "no_latency": self.no_latency,
                "kernels": {c: kf.report() for c, kf in self.fits.items()},
                "derived": self.derived,
                "notes": self.notes,
            },
            "rows": self.rows_json(),
        }


def calibration_text(cal: Calibration) -> str:
    """``cal.to_json()`` as the text of a links file: indented, one line per measured row."""
    doc = cal.to_json()
    rows = doc.pop("rows")
    head = json.dumps(doc, indent=1)
    assert head.endswith("\n}")
    body = ",\n".join("  " + json.dumps(r) for r in rows)
    return head[:-2] + (',\n "rows": [\n' + body + "\n ]\n}\n" if rows else ',\n "rows": []\n}\n')


def _num(x: float) -> float | None:
    return None if not math.isfinite(x) else round(float(x), 4)


def calibrate(
    rows: Sequence[KernelRow],
    *,
    hold_out: str | None = None,
    base: Hardware | None = None,
    name: str = "calibrated",
    gpu: str | None = None,
    seed: int = 0,
    no_latency: Collection[str] = (),
) -> Calibration:
    """Fit every kernel found in ``rows`` and assemble a ``Hardware``: kernels without rows come from
    ``base`` (its ``rank`` kernel is derived from the fitted ``node`` kernel when the rows have DeepEP
    normal rows but no NVLink all-to-all: inside a node both send one copy per destination GPU), and a
    link class no row sends over comes from ``base``'s kernel of the same copy model.
    ``no_latency``: per-message latencies not to fit, as ``CLASS`` (every kernel) or ``COPIES.CLASS``
    (``expert.inter``: the low-latency kernel's inter-node latency)."""
    for item in no_latency:
        head, _, cls = item.rpartition(".")
        if cls not in ("intra", "inter") or (head and head not in KERNEL_COPIES.values()):
            raise ConfigError(f"--no-latency {item!r}: write intra, inter, or COPIES.CLASS (e.g. expert.inter)")
    rows = list(rows)
    if not rows:
        raise ConfigError("calibrate: no measured rows (give tables, or --gpu for the bundled ones)")
    gpus = sorted({r.gpu for r in rows})
    gpu = gpu or "+".join(gpus)
    by_copies: dict[str, list[KernelRow]] = {}
    for r in rows:
        by_copies.setdefault(r.copies, []).append(r)
    rule = parse_hold_out(hold_out)
    index = {id(r): i for i, r in enumerate(rows)}  # hold-out's every=N counts over the input order

    def held(row: KernelRow, _i: int) -> bool:
        return bool(rule(row, index[id(row)])) if rule else False

    fits: dict[str, KernelFit] = {}
    notes: list[str] = []
    for copies in sorted(by_copies, key=list(KERNEL_COPIES.values()).index):
        fb = base.kernels.get(copies) if base is not None else None
        krows = by_copies[copies]
        if all(held(r, 0) for r in krows) and fb is not None and base is not None:
            fits[copies] = _unfitted(krows, fb, seed=seed)  # nothing to fit: the base's kernel predicts them
            notes.append(f"{krows[0].kernel}: every row held out; predicted with {base.name}'s {fb.name} kernel")
            continue
        fits[copies] = fit_kernel(
            by_copies[copies],
            copies=copies,
            hold_out=held,
            fallback=fb,
            fallback_name=f"{base.name}'s {fb.name} kernel" if base is not None and fb is not None else "",
            reduce_bytes_per_s=hbm_bytes_per_s(gpus[0]),
            seed=seed,
            latencies=[c for c in ("intra", "inter") if c not in no_latency and f"{copies}.{c}" not in no_latency],
        )
    kernels = {c: kf.kernel for c, kf in fits.items() if kf.held_out.sum() < len(kf.rows)}
    derived: dict[str, str] = {}
    if "rank" not in kernels and "node" in kernels:
        node = kernels["node"]

        def per_gpu(p: Phase) -> Links:  # the normal kernel's network latency is per remote node, not per GPU
            return replace(p.links, inter=Link(bytes_per_s=p.links.inter.bytes_per_s, latency_s=0.0))

        kernels["rank"] = replace(
            node,
            name="nvlink-a2a",
            copies="rank",
            dispatch=replace(node.dispatch, value=BF16, links=per_gpu(node.dispatch)),
            combine=replace(node.combine, links=per_gpu(node.combine)),
            source="derived from the deepep-normal fit (inside a node it sends one copy per destination GPU; "
            f"no inter-node per-message latency): {node.source}",
        )
        derived["rank"] = (
            "the deepep-normal kernel's parameters, copies per rank, BF16 dispatch, without its inter-node "
            "per-message latency (the normal kernel's is per remote node)"
        )
    if base is not None:
        for c, k in base.kernels.items():
            if c not in kernels:
                kernels[c] = k
                derived[c] = f"taken whole from {base.name}: {k.source}"
    order = [c for c in ("expert", "node", "rank") if c in kernels]
    srcs = sorted({r.source.split(":")[0] for r in rows})
    hw = Hardware(
        name=name,
        gpu=gpu,
        source=f"moetrace calibrate: {', '.join(srcs)}" + (f" (held out: {hold_out})" if hold_out else ""),
        kernels={c: kernels[c] for c in order},
    )
    return Calibration(
        hardware=hw, fits=fits, hold_out=hold_out, derived=derived, no_latency=list(no_latency), notes=notes
    )


def _unfitted(rows: Sequence[KernelRow], kernel: Kernel, *, seed: int) -> KernelFit:
    """A ``KernelFit`` of rows all held out: ``kernel``'s predictions, nothing fitted."""
    d, c = predict(rows, kernel, seed=seed)

    def phase_fit(ph: str, pred: np.ndarray) -> PhaseFit:
        p = getattr(kernel, ph)
        params = {"fixed_s": p.fixed_s, **{k: v for k, v in _start_links(kernel, ph).items() if k != "fixed_s"}}
        return PhaseFit(
            phase=ph,
            params=params,
            fitted=[],
            taken={k: "all rows held out" for k in _PARAMS},
            variants=[],
            predicted_us=pred,
        )

    return KernelFit(
        kernel=kernel,
        rows=list(rows),
        held_out=np.ones(len(rows), bool),
        dispatch=phase_fit("dispatch", d),
        combine=phase_fit("combine", c),
    )


# ------------------------------------------------------------------------------ printing
def _pct(x: float) -> str:
    return "   n/a" if not math.isfinite(x) else f"{x * 100:+6.1f}%"


def format_rows(cal: Calibration) -> str:
    """The per-row table: measured vs predicted dispatch and combine with the relative error."""
    lines = [
        f"{'kernel':<13} {'gpu':<6} {'ep':>4} {'gpn':>3} {'hidden':>6} {'k':>3} {'E':>4} {'tokens':>6} {'d/c':>9}"
        f" {'disp us':>9} {'pred':>9} {'err':>7}  {'comb us':>9} {'pred':>9} {'err':>7}  held"
    ]
    for kf in cal.fits.values():
        for i, r in enumerate(kf.rows):
            pd_, pc = kf.dispatch.predicted_us[i], kf.combine.predicted_us[i]
            lines.append(
                f"{r.kernel:<13} {r.gpu:<6} {r.ep_size:>4} {r.gpus_per_node:>3} {r.hidden:>6} {r.top_k:>3} {r.num_experts:>4}"
                f" {r.tokens_per_rank:>6} {r.dispatch_type + '/' + r.combine_type:>9}"
                f" {r.dispatch_us:>9.1f} {pd_:>9.1f} {_pct(pd_ / r.dispatch_us - 1):>7}"
                f"  {r.combine_us:>9.1f} {pc:>9.1f} {_pct(pc / r.combine_us - 1):>7}  {'yes' if kf.held_out[i] else ''}"
            )
    return "\n".join(lines)


def format_fit(cal: Calibration) -> str:
    """The fitted parameters and the median/worst error per kernel, phase and split."""
    out = []
    for copies, kf in cal.fits.items():
        rep = kf.report()
        out.append(
            f"{rep['kernel']} (copies per {copies}): {rep['rows']['train']} rows fitted, {rep['rows']['held_out']} held out"
        )
        for ph in ("dispatch", "combine"):
            p = rep[ph]
            out.append(
                f"  {ph:<8} fixed {p['fixed_us']:.2f} us, intra {p['intra_GBps']:.1f} GB/s + {p['intra_latency_us']:.3f} us/msg,"
                f" inter {p['inter_GBps']:.1f} GB/s + {p['inter_latency_us']:.3f} us/msg"
                + (f"  [taken: {', '.join(sorted({v for v in p['taken'].values()}))}]" if p["taken"] else "")
            )
            for v in p["latency_variants"]:
                kept = "kept" if f"{v['latency']}_latency_s" in p["fitted"] else "not kept"
                out.append(
                    f"           {v['latency']} latency {kept}: cross-validated median error (folds of {v['folds']})"
                    f" {v['cv_median_without'] * 100:.1f}% without, {v['cv_median_with'] * 100:.1f}% with"
                )
            for split, e in p["errors"].items():
                parts = [f"{g} {x['median'] * 100:.1f}%/{x['worst'] * 100:.1f}% (n={x['n']})" for g, x in e.items()]
                out.append(f"           {split:<8} median/worst: {'; '.join(parts)}")
    for c, how in cal.derived.items():
        out.append(f"{c}: {how}")
    out += cal.notes
    return "\n".join(out)


# ------------------------------------------------------------------------------ one shape (moetrace cost)
#: the measured-table kernel whose rows price a copy model (its copy model and routing)
_ROW_KERNEL = {v: k for k, v in KERNEL_COPIES.items()}


@dataclass(frozen=True)
class ShapeCost:
    """The step model's answer for one shape (``moetrace cost``)."""

    hardware: Hardware
    kernel: Kernel
    row: KernelRow  # the shape, as a table row (no measurement)
    dispatch_us: float
    combine_us: float
    routing: str  # "uniform" or "loads"


def cost_of_shape(
    hardware: Hardware,
    *,
    copies: str,
    ep_size: int,
    hidden: int,
    top_k: int,
    num_experts: int,
    tokens_per_rank: int,
    gpus_per_node: int | None = None,
    dispatch_type: str | None = None,
    combine_type: str | None = None,
    loads_E: Sequence[float] | None = None,
    seed: int = 0,
) -> ShapeCost:
    """Dispatch and combine time of one layer at one shape: ``predict`` of one row (uniform routing,
    or routing in proportion to ``loads_E``) with ``hardware``'s kernel for ``copies``.
    ``gpus_per_node``: default 4 on GB200/GB300, else 8; at most ``ep_size`` (one partial node)."""
    kernel = hardware.kernel(copies)
    g = min(gpus_per_node or gpus_per_node_of(hardware.gpu or hardware.name), ep_size)
    d_type = dispatch_type or kernel.dispatch.value.name
    c_type = combine_type or kernel.combine.value.name
    for what, t in (("dispatch", d_type), ("combine", c_type)):
        if t not in ROW_VALUE_TYPES:
            raise ConfigError(
                f"{what} value type {t!r} of {hardware.name}'s kernel is not one of {', '.join(ROW_VALUE_TYPES)}"
            )
    row = KernelRow(
        kernel=_ROW_KERNEL[copies],
        gpu=hardware.gpu,
        source="moetrace cost",
        ep_size=ep_size,
        gpus_per_node=g,
        hidden=hidden,
        top_k=top_k,
        num_experts=num_experts,
        tokens_per_rank=tokens_per_rank,
        dispatch_type=d_type,
        combine_type=c_type,
        dispatch_us=math.nan,
        combine_us=math.nan,
    ).check("moetrace cost")
    d, c = predict([row], kernel, seed=seed, loads_E=loads_E)
    return ShapeCost(hardware, kernel, row, float(d[0]), float(c[0]), "loads" if loads_E is not None else "uniform")


def format_cost(r: ShapeCost) -> str:
    row, k = r.row, r.kernel
    nodes = f"{row.nodes} node(s) x {row.gpus_per_node} GPUs"
    how = "uniform routing" if r.routing == "uniform" else "routing by the given per-expert loads"
    lines = [
        f"links {r.hardware.name} ({r.hardware.source}); kernel {k.name}, copies per {k.copies}",
        f"EP {row.ep_size} = {nodes}, hidden {row.hidden}, top-{row.top_k} of {row.num_experts} experts, "
        f"{row.tokens_per_rank} tokens per GPU, {how}, the busiest GPU:",
        f"  {'dispatch (' + row.dispatch_type + ')':<20}{r.dispatch_us:10.1f} us",
        f"  {'combine (' + row.combine_type + ')':<20}{r.combine_us:10.1f} us",
        f"  {'dispatch + combine':<20}{r.dispatch_us + r.combine_us:10.1f} us",
    ]
    return "\n".join(lines)
