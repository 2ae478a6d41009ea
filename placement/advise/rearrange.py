"""What a rearrangement costs in serving time, and whether the engine's schedule pays for it: the
sentence ``moetrace advise`` adds to every "enable EPLB" verdict.

A synchronous rearrangement (vLLM's default before async EPLB, and any engine that moves weights
while serving waits) stalls serving for ``stall_seconds``. The documented default is vLLM's
measurement: ~0.9 s (0.65–1.70 s) per rearrangement of DeepSeek-R1 on 32 GB200s
(vllm-project/vllm#43219). Rearranging every ``interval_steps`` steps (vLLM's ``--eplb-config
step_interval``, default 3000 in vLLM 0.33.0's ``vllm/config/parallel.py`` ``EPLBConfig``) costs
``stall_seconds / interval_steps`` per step; the placement saves ``saving`` seconds per step
(the reference's predicted time less the option's). So:

- the stall is ``stall_seconds / step_seconds`` steps of the stage (``step_seconds``: the reference's
  predicted MoE-layer time per step, summed over the MoE layers; the whole step also runs attention
  and dense layers, so it is longer and the stall is at most that many whole steps);
- it pays back after ``stall_seconds / saving`` steps: worth it when the load stays put (the engine
  rearranges no more often) for longer than that.

Out of scope: async EPLB (no stall, but vLLM#57883: it can stop rebalancing silently), the time the
weights take to move beyond the measured stall (the verdicts give the bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moetrace.errors import ConfigError

__all__ = [
    "DEFAULT_INTERVAL_STEPS",
    "DEFAULT_STALL_SECONDS",
    "Rearrangement",
    "rearrangement_cost",
    "rearrangement_text",
]

#: seconds one synchronous rearrangement stalls serving: vLLM, DeepSeek-R1 on 32 GB200s (0.65-1.70 s), vllm#43219
DEFAULT_STALL_SECONDS = 0.9
#: steps between rearrangements: vLLM 0.33.0's EPLBConfig.step_interval default
DEFAULT_INTERVAL_STEPS = 3000


@dataclass(frozen=True, kw_only=True)
class Rearrangement:
    """How long one rearrangement stalls serving and how often the engine runs one."""

    stall_seconds: float = DEFAULT_STALL_SECONDS  # seconds serving waits per synchronous rearrangement
    interval_steps: int = DEFAULT_INTERVAL_STEPS  # steps between two rearrangements (vLLM's step_interval)

    def __post_init__(self) -> None:
        if not (self.stall_seconds >= 0.0 and math.isfinite(self.stall_seconds)) or self.interval_steps < 1:
            raise ConfigError(
                f"--stall-seconds must be a finite number >= 0 and --rearrange-every >= 1 step, got "
                f"{self.stall_seconds} and {self.interval_steps}"
            )


def rearrangement_cost(ref_seconds: float, option_seconds: float, *, r: Rearrangement) -> dict[str, Any]:
    """The rearrangement's cost against what it saves, from predicted seconds per step (the reference's
    and the option's): ``stall_steps`` (the stall in steps of the reference's predicted time),
    ``saving_seconds`` per step, ``payback_steps`` (the stall over the saving; inf without a saving),
    ``stall_seconds_per_step`` at the interval and ``worth_it`` (the interval outlasts the payback)."""
    saving = ref_seconds - option_seconds
    ok = math.isfinite(ref_seconds) and math.isfinite(option_seconds) and ref_seconds > 0
    payback = r.stall_seconds / saving if ok and saving > 0 else math.inf
    return {
        "stall_seconds": r.stall_seconds,
        "interval_steps": r.interval_steps,
        "step_seconds": ref_seconds if ok else None,
        "stall_steps": r.stall_seconds / ref_seconds if ok else None,
        "saving_seconds": saving if ok else None,
        "payback_steps": payback if math.isfinite(payback) else None,
        "stall_seconds_per_step": r.stall_seconds / r.interval_steps,
        "worth_it": bool(ok and payback <= r.interval_steps),
    }


def _ms(x: float) -> str:
    return f"{x * 1e3:.3g} ms"


def _secs(x: float) -> str:
    return f"{x:,.0f} s" if x >= 10 else f"{x:.2g} s" if x >= 0.01 else _ms(x)


def _steps(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.1f}"


def rearrangement_text(cost: dict[str, Any], *, steps: str, what: str) -> str:
    """The verdict's sentence on ``cost`` (``rearrangement_cost``); ``steps``: ``decode`` or ``prefill``;
    ``what``: the time it is in (``predicted MoE-layer time``)."""
    stall, every = cost["stall_seconds"], cost["interval_steps"]
    if cost["step_seconds"] is None:
        return f" A synchronous rearrangement stalls serving ~{stall:g} s; its cost in steps is n/a ({what} unknown)."
    head = (
        f" A synchronous rearrangement stalls serving ~{stall:g} s (vLLM's measurement, DeepSeek-R1 on 32 GB200s, "
        f"vllm#43219; --stall-seconds): up to ~{_steps(cost['stall_steps'])} {steps} steps at the reference's "
        f"{what} of {_ms(cost['step_seconds'])} per step"
    )
    if cost["payback_steps"] is None:
        return head + "; this placement saves nothing per step to pay it back: rearrange once, before serving."
    pay = cost["payback_steps"]
    at = (
        f"rearranging every {every:,} steps (vLLM's step_interval; --rearrange-every) costs "
        f"{_ms(cost['stall_seconds_per_step'])} per step against {_ms(cost['saving_seconds'])} saved"
    )
    verdict = (
        "worth it"
        if cost["worth_it"]
        else f"not worth it: rearrange at most every ~{_steps(pay)} steps, asynchronously, or once before serving"
    )
    serving = pay * (cost["step_seconds"] - cost["saving_seconds"])  # at the placement's own step time
    return head + (
        f". It pays back after ~{_steps(pay)} steps (~{_secs(serving)} of serving, one step after another) of the "
        f"{_ms(cost['saving_seconds'])} it saves per step, so it is worth it if the load stays put that long; "
        f"{at}: {verdict}."
    )
