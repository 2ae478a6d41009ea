"""The records ``moetrace advise`` passes between its modules: an evaluated ``Option`` and the
``Advice`` (summary rows, per-layer rows, verdicts, placements).

Out of scope: computing them (``advise``), writing them (``advise_files``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from moetrace.placement.advise_options import EPLB_STRATEGIES, EplbPolicy, option_label
from moetrace.placement.maps import Placement

if TYPE_CHECKING:
    from moetrace.placement.routers import Router

__all__ = ["Advice", "Option"]


@dataclass(frozen=True, kw_only=True)
class Option:
    """One placement advise evaluates."""

    name: str  # "current" or a registered strategy ("linear", "eplb", "eplb_global", "joint", ...)
    num_redundant: int  # R: redundant slots per layer
    placement: Placement  # over the MoE layers
    fitted_on: str = ""  # the stage whose load it was fitted on ("" for data-free placements)
    router: Router | None = None  # the serving router of a grouped placement (joint); None: requests spread evenly
    policy: EplbPolicy | None = None  # the EPLB policy it ran (EPLB strategies only)

    @property
    def key(self) -> str:
        """``eplb-64``, ``eplb_global-64``, ``linear``: unique within a stage."""
        return f"{self.name}-{self.num_redundant}" if self.name in EPLB_STRATEGIES else self.name

    @property
    def label(self) -> str:
        return option_label(self.name, self.num_redundant, policy=self.policy)

    @property
    def has_router(self) -> bool:
        """Its requests must be sent to nodes by a router (a grouped placement with one)."""
        from moetrace.placement.routers import NoRouter

        return self.router is not None and not isinstance(self.router, NoRouter)


@dataclass(frozen=True, kw_only=True)
class Advice:
    """What ``advise_arrays`` found: summary rows, per-layer rows, verdicts, commands, placements."""

    manifest: dict[str, Any]  # the advice.json body (config, verdicts, commands, correlations, drift)
    rows: list[dict[str, Any]]  # one per (stage, steps, option): the summary (options.parquet)
    layer_rows: dict[str, np.ndarray]  # columns of layers.parquet (stage, steps, option, layer, measures)
    placements: dict[str, Option] = field(default_factory=dict)  # file stem -> a recommended option to write
    options: dict[str, Option] = field(default_factory=dict)  # "<stage>-<option key>" -> every option evaluated

    @property
    def verdicts(self) -> list[str]:
        return [v["text"] for v in self.manifest["verdicts"]]
