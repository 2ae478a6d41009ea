"""What ``moetrace calibrate`` computes and how it is written and printed (docs/placement.md, "Calibration").

``Calibration``: the hardware (a links file) and every kernel's fit; ``calibration_text`` its links
file's text (one line per measured row); ``format_rows`` (measured vs predicted per row) and
``format_fit`` (the fitted parameters and errors) the printed report.

Out of scope: computing it (``calibrate``, ``calibrate_fit``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from moetrace.placement.calibrate_fit import KernelFit
from moetrace.placement.hardware import Hardware

__all__ = ["Calibration", "calibration_text", "format_rows", "format_fit"]


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
