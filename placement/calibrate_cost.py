"""The step model's dispatch and combine time of one shape (``moetrace cost``; docs/placement.md, "Calibration").

``cost_of_shape`` prices one shape as a measured row would be predicted (``calibrate_traffic.predict``:
uniform routing, or routing in proportion to given per-expert loads); ``format_cost`` prints it.

Out of scope: fitting the hardware it prices with (``calibrate``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from moetrace.errors import ConfigError
from moetrace.placement.calibrate_traffic import ROW_VALUE_TYPES, predict
from moetrace.placement.hardware import Hardware
from moetrace.placement.kernel_tables import KERNEL_COPIES, KernelRow, gpus_per_node_of
from moetrace.placement.step_model import Kernel

__all__ = ["ShapeCost", "cost_of_shape", "format_cost"]

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
