"""The fit of one kernel's parameters to measured rows (docs/placement.md, "Calibration").

``fit_kernel`` finds a kernel's parameters per phase (dispatch, combine) from measured rows of one copy
model; ``fit`` returns the kernel alone; ``unfitted`` predicts rows that are all held out with a given
kernel. The fit, per kernel and phase, on the training rows (``hold_out`` rows are predicted, never
fitted): least squares on ``log(predicted / measured)`` (relative error; soft-L1 loss, so a few noisy
rows do not drag it), parameters positive (fitted as logarithms): the fixed cost, each link class's
bandwidth where the rows send over it (intra: any row with more than one GPU per node; inter: any row
with more than one node), else the class is taken from a fallback kernel (``calibrate``'s ``base``:
the H100 preset's network link for single-node tables) and the kernel's ``source`` says so.
Per-message latencies are fitted only where the data supports them: the intra-node latency is
kept when adding it lowers the cross-validated median relative error (4 folds of the training rows)
by at least ``LATENCY_GAIN``; then the inter-node latency likewise, with one fold per multi-node EP
size (a per-peer cost must carry over to other EP sizes, whose peers differ). Else it stays 0.
Combine is its own phase (its own fixed cost and links) plus the reduction term at the GPU's HBM
bandwidth (``HBM_BYTES_PER_S``): it is proportional to the copies moved, so the tables cannot tell it
from combine's bandwidth; it is held, not fitted.

Many rows are priced at once (``_PhaseEval``), exactly as ``layer_seconds`` prices each.

Shape legend (docs/architecture.md): B batches, W EP ranks (GPUs), N rows of a table.

Out of scope: the rows' traffic (``calibrate_traffic``); the hold-out syntax (``calibrate_hold_out``);
assembling a links file from the fitted kernels (``calibrate``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.calibrate_hold_out import HoldOut, parse_hold_out
from moetrace.placement.calibrate_traffic import ROW_VALUE_TYPES, hbm_bytes_per_s, predict, row_traffic
from moetrace.placement.cost import Link, Links
from moetrace.placement.kernel_tables import KernelRow
from moetrace.placement.step_model import BF16, GpuTraffic, Kernel, Phase, ValueType, phase_seconds_BW

__all__ = [
    "LATENCY_GAIN",
    "KERNEL_NAMES",
    "PhaseFit",
    "KernelFit",
    "errors",
    "fit",
    "fit_kernel",
    "unfitted",
]

#: the cross-validated median relative error a latency must remove to be kept
LATENCY_GAIN = 0.005
#: the kernel name a fitted copy model gets when the rows do not say (``Kernel.name``)
KERNEL_NAMES = {"expert": "deepep-ll", "node": "deepep-normal", "rank": "nvlink-a2a"}
_FOLDS = 4


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


def unfitted(rows: Sequence[KernelRow], kernel: Kernel, *, seed: int) -> KernelFit:
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
