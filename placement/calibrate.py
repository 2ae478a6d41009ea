"""Calibration of the step model against measured all-to-all kernels (docs/placement.md, "Calibration").

``calibrate`` fits every kernel of a set of measured tables (``kernel_tables.KernelRow``) into a links
file (``hardware.Hardware``) with a report: kernels without rows come from a base, a link class no row
sends over from the base's kernel of the same copy model.

Its parts live beside it, and the names other modules import are re-exported here: the rows' traffic
and the step model's prediction of them (``calibrate_traffic``: ``predict``, ``row_traffic``, the
benchmarks' routing), the hold-out rules (``calibrate_hold_out``: ``parse_hold_out`` and its syntax),
one kernel's fit (``calibrate_fit``: ``fit_kernel``, ``fit``, ``errors``), the result and its printing
(``calibrate_report``: ``Calibration``, ``calibration_text``, ``format_rows``, ``format_fit``), one
shape's cost (``calibrate_cost``: ``cost_of_shape``, ``format_cost``; ``moetrace cost``).

Out of scope: reading the tables (``kernel_tables``); the congestion of a shared fabric; the
``notify``/``prepare`` exchanges before a dispatch (the tables time the transfer with a known layout).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from moetrace.errors import ConfigError
from moetrace.placement.calibrate_cost import ShapeCost, cost_of_shape, format_cost
from moetrace.placement.calibrate_fit import (
    KERNEL_NAMES,
    LATENCY_GAIN,
    KernelFit,
    PhaseFit,
    errors,
    fit,
    fit_kernel,
    unfitted,
)
from moetrace.placement.calibrate_hold_out import HoldOut, parse_hold_out
from moetrace.placement.calibrate_report import Calibration, calibration_text, format_fit, format_rows
from moetrace.placement.calibrate_traffic import (
    HBM_BYTES_PER_S,
    NVFP4,
    ROW_VALUE_TYPES,
    TOKENS_SIMULATED,
    hbm_bytes_per_s,
    predict,
    row_traffic,
)
from moetrace.placement.cost import Link, Links
from moetrace.placement.hardware import Hardware
from moetrace.placement.kernel_tables import KERNEL_COPIES, KernelRow
from moetrace.placement.step_model import BF16, Phase

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
    "HoldOut",
    "hbm_bytes_per_s",
]


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
            fits[copies] = unfitted(krows, fb, seed=seed)  # nothing to fit: the base's kernel predicts them
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
