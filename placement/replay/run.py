"""The library call: ``replay(plan)`` runs a plan's collectives and returns a ``ReplayRun`` to check and write.

``moetrace a2a`` is this over ``plan.build_plan``: ``replay`` refuses a local run this machine cannot
hold (``capacity``), starts the ranks (``launch.run_a2a``) and, on rank 0, wraps the gathered
records with the plan and the network they ran on.

Out of scope: the plan (``plan``), the one-GPU check (``smoke``), messages and progress bars (the CLI).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moetrace.placement import netemu
from moetrace.placement.replay.capacity import check_local_capacity
from moetrace.placement.replay.launch import run_a2a
from moetrace.placement.replay.network import Network
from moetrace.placement.replay.plan import A2APlan, plan_bytes_per_rank
from moetrace.placement.replay.rank import RankRecord
from moetrace.placement.replay.results import first_mismatch, format_summary, raise_on_mismatch, write_a2a_results

__all__ = ["ReplayRun", "replay"]


@dataclass(frozen=True, kw_only=True)
class ReplayRun:
    """A finished replay as rank 0 holds it: the plan, every rank's record (``rank.RankRecord``, gathered
    by ``rank.run_rank``) and how the links were realized."""

    plan: A2APlan
    records: tuple[RankRecord, ...]  # one per rank, in rank order
    network: Network

    @property
    def mismatch(self) -> str | None:
        """The first collective whose measured bytes differ from the plan's, as one line; None when all match."""
        return first_mismatch(self.plan, self.records)

    def summary(self) -> str:
        """The summary table (``results.format_summary``)."""
        return format_summary(self.plan, self.records, self.network)

    def write(self, out: str | os.PathLike[str]) -> list[Path]:
        """Write ``collectives.parquet`` and ``a2a.json`` into ``out``; the paths written."""
        return write_a2a_results(out, self.plan, self.records, self.network)

    def check(self) -> None:
        """Raise ``A2AMismatchError`` naming the first mismatch (``mismatch``); nothing when the bytes match."""
        raise_on_mismatch(self.plan, self.records)


def replay(
    plan: A2APlan,
    *,
    torchrun: bool = False,
    emulate: bool | None = None,
    link: str = netemu.DEFAULT_LINK,
    force: bool = False,
    log: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayRun | None:
    """Run ``plan``'s collectives; the run on rank 0, None on a torchrun rank other than 0.

    ``torchrun``: this process is one rank of a torchrun job; else ``plan.world_size`` local
    processes, refused (``ConfigError``) when this machine's cores and memory cannot hold them with
    their plans and buffers, unless ``force``. ``emulate``, ``link``, ``log`` and ``progress``: as
    ``launch.run_a2a``.
    """
    if not torchrun and not force:
        check_local_capacity(plan.world_size, extra_bytes_per_rank=plan_bytes_per_rank(plan))
    records, network = run_a2a(plan, torchrun=torchrun, emulate=emulate, link=link, log=log, progress=progress)
    if records is None:
        return None
    return ReplayRun(plan=plan, records=tuple(records), network=network)
