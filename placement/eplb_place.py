"""``moetrace place --eplb-sum``: EPLB's placements summed as the engine that will load them sums.

The registry's EPLB rows (``strategies``: ``eplb``, ``eplb_global``) sum pack weights in float64, as
SGLang and vLLM do (``eplb`` module docstring). ``place_with_sum`` builds the placement through
``compare.make_placement`` and, for ``--eplb-sum float32`` (DeepSeek's reference), recomputes the
EPLB strategies' placement from the same training load with float32 sums; the placement file's
``source`` names the summation either way.

Out of scope: the EPLB algorithm (``eplb``); strategies that choose among EPLB candidates
(``ours``) keep the engines' float64 and refuse float32 (naming the strategies that take it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.advise.options import EPLB_STRATEGIES, eplb_option_placement
from moetrace.placement.eplb import ACCUMULATE, Accumulate

if TYPE_CHECKING:
    from moetrace.placement.compare import CompareConfig, PlacedStrategy, TraceData

__all__ = ["place_with_sum", "training_load"]


def training_load(data: TraceData) -> np.ndarray:
    """The training requests' decode tokens per (layer, expert), float64 [L, E] (what the registry's
    builders receive as ``load_LE``; whole counts, so exact in any summation order)."""
    rows = np.flatnonzero(~data.is_test_R)
    out = np.zeros(data.decode_RLE.shape[1:])
    for lo in range(0, len(rows), 1024):
        out += data.decode_RLE[rows[lo : lo + 1024]].sum(axis=0, dtype=np.float64)
    return out


def place_with_sum(data: TraceData, cfg: CompareConfig, strategy: str, *, eplb_sum: Accumulate) -> PlacedStrategy:
    """``compare.make_placement`` with the EPLB strategies' pack weights summed in ``eplb_sum``;
    ``ConfigError`` for float32 with a strategy that is not EPLB's."""
    from moetrace.placement.compare import make_placement

    if eplb_sum not in ACCUMULATE:
        raise ConfigError(f"--eplb-sum {eplb_sum!r}: one of {', '.join(ACCUMULATE)}")
    if eplb_sum != "float64" and strategy not in EPLB_STRATEGIES:
        raise ConfigError(
            f"--eplb-sum {eplb_sum} applies to --strategy {' or '.join(EPLB_STRATEGIES)}; {strategy!r} computes "
            "EPLB (if at all) as the engines do, in float64: drop --eplb-sum or choose an EPLB strategy"
        )
    ps = make_placement(data, cfg, strategy)
    if strategy not in EPLB_STRATEGIES or ps.extra.get("eplb_sum") == eplb_sum:
        return ps
    placement = eplb_option_placement(
        training_load(data),
        strategy=strategy,
        model=data.model,
        deployment=cfg.deployment,
        num_redundant=cfg.num_redundant,
        eplb_sum=eplb_sum,
    )
    return replace(ps, placement=placement, extra={**ps.extra, "eplb_sum": eplb_sum})
