"""Deployment notation ``DPaTPbEPcTPd`` and the topology it implies (docs/placement.md, core paper §2.3).

Non-expert parts run as ``a`` data-parallel replicas of ``b``-way tensor parallelism; routed experts
are spread over ``c`` expert-parallel ranks, each split ``d`` ways (``TPd`` optional, default 1).
GPUs are numbered replica-major: DP replica ``i`` uses GPUs ``i*b .. i*b+b-1``; EP rank ``r`` uses
GPUs ``r*d .. r*d+d-1``; GPU ``u`` sits on node ``u // gpus_per_node``. Each node is one *expert
group* (the core paper's evaluation: a request lives on one node).

Shape legend (docs/architecture.md): W EP ranks, A DP replicas, G node groups (= nodes),
E logical experts, P physical slots.

Out of scope: which expert goes where (the placers), the traffic model (``simulate``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from moetrace.errors import ConfigError

__all__ = ["Deployment", "parse_deployment"]

#: ASCII digits only (``\d`` alone also matches ``٣`` and ``３``, which ``int`` reads)
_RE = re.compile(r"^DP(\d+)TP(\d+)EP(\d+)(?:TP(\d+))?$", re.IGNORECASE | re.ASCII)
#: the most digits of one count (a billion GPUs)
_MAX_DIGITS = 9


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """A validated ``DPaTPbEPcTPd`` deployment on nodes of ``num_gpus_per_node`` GPUs."""

    num_dp: int  # a: data-parallel replicas of the non-expert parts
    num_tp: int  # b: tensor-parallel ways of each DP replica
    num_ep: int  # c: expert-parallel ranks
    num_ep_tp: int = 1  # d: tensor-parallel ways of each EP rank's experts
    num_gpus_per_node: int = 8  # GPUs per node (NVLink domain); inter-node traffic leaves it

    def __post_init__(self) -> None:
        for name, what in (
            ("num_dp", "DP"),
            ("num_tp", "TP"),
            ("num_ep", "EP"),
            ("num_ep_tp", "the TP after EP"),
            ("num_gpus_per_node", "--gpus-per-node"),
        ):
            if getattr(self, name) < 1:
                hint = "" if what.startswith("--") else " (e.g. DP8TP8EP64)"
                raise ConfigError(f"{self.name}: {what} must be >= 1, got {getattr(self, name)}{hint}")
        a, b, c, d, g = self.num_dp, self.num_tp, self.num_ep, self.num_ep_tp, self.num_gpus_per_node
        if a * b != c * d:
            raise ConfigError(
                f"{self.name}: the non-expert parts use DP×TP = {a}×{b} = {a * b} GPUs but the experts use "
                f"EP×TP = {c}×{d} = {c * d}; both must cover the same GPUs (e.g. DP{a}TP{b}EP{a * b // d}"
                f"{'TP' + str(d) if d > 1 else ''})"
            )
        n = a * b
        if n > g and n % g:
            raise ConfigError(
                f"{self.name}: {n} GPUs do not fill whole nodes of {g} GPUs; use a multiple of {g} GPUs "
                "or set --gpus-per-node"
            )
        if n > g and g % d:
            raise ConfigError(
                f"{self.name}: an EP rank's {d} tensor-parallel shards must sit on one node, but {g} GPUs per "
                f"node is not a multiple of {d}"
            )
        if self.num_ep % self.num_nodes:
            raise ConfigError(
                f"{self.name}: EP{c} is not a multiple of the {self.num_nodes} nodes; every node must hold the "
                "same number of EP ranks"
            )

    # ---- derived sizes ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        tail = f"TP{self.num_ep_tp}" if self.num_ep_tp > 1 else ""
        return f"DP{self.num_dp}TP{self.num_tp}EP{self.num_ep}{tail}"

    @property
    def num_gpus(self) -> int:
        return self.num_dp * self.num_tp

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.num_gpus_per_node)

    @property
    def num_groups(self) -> int:
        """Expert groups of the core paper: one per node."""
        return self.num_nodes

    @property
    def ranks_per_node(self) -> int:
        return self.num_ep // self.num_nodes

    def rank_node_W(self) -> np.ndarray:
        """Node of each EP rank, int64 [W]."""
        return np.arange(self.num_ep, dtype=np.int64) // self.ranks_per_node

    def replica_node_A(self) -> np.ndarray:
        """Node of each DP replica's first GPU, int64 [A]."""
        return (np.arange(self.num_dp, dtype=np.int64) * self.num_tp) // self.num_gpus_per_node

    def replica_source_ranks(self, replica: int) -> np.ndarray:
        """EP ranks on the GPUs of DP replica ``replica``: its tokens leave from these, int64 [b]."""
        gpus = replica * self.num_tp + np.arange(self.num_tp, dtype=np.int64)
        return gpus // self.num_ep_tp

    def check_slots(self, *, num_experts: int, num_redundant: int) -> int:
        """Return P = E + R physical slots per layer, or raise ``ConfigError`` if R is negative, R >= E
        (every expert copied again: nothing left to place, and linear's volume may be 0), or E + R slots
        cannot divide over the ranks. Needs no trace data: commands call it before reading one."""
        if num_redundant < 0:
            raise ConfigError(f"redundancy must be >= 0, got {num_redundant}")
        if num_redundant >= num_experts:
            raise ConfigError(
                f"--redundancy {num_redundant}: a redundant slot holds one more copy of one of the {num_experts} "
                f"experts; {num_redundant} >= E copies every expert at least once more, and compare normalizes by "
                f"linear's inter-node volume, which can then be 0; use fewer than {num_experts}"
            )
        P = num_experts + num_redundant
        if P % self.num_ep:
            hint = (-num_experts) % self.num_ep
            raise ConfigError(
                f"{self.name}: {num_experts} experts + {num_redundant} redundant = {P} slots do not divide over "
                f"EP{self.num_ep} ranks; choose a redundancy that makes E+R a multiple of {self.num_ep} "
                f"(e.g. --redundancy {hint or self.num_ep})"
            )
        return P


def parse_deployment(spec: str, *, num_gpus_per_node: int = 8) -> Deployment:
    """Parse ``DPaTPbEPc`` or ``DPaTPbEPcTPd`` (case-insensitive), e.g. ``DP8TP8EP64``."""
    m = _RE.match(spec.strip())
    if not m:
        raise ConfigError(
            f"deployment {spec!r} is not of the form DPaTPbEPc or DPaTPbEPcTPd (e.g. DP8TP8EP64, DP8TP8EP32TP2)"
        )
    if any(x is not None and len(x.lstrip("0")) > _MAX_DIGITS for x in m.groups()):
        raise ConfigError(f"deployment {spec[:40]!r}: a count of more than {_MAX_DIGITS} digits (e.g. DP8TP8EP64)")
    a, b, c, d = (int(x) if x else 1 for x in m.groups())
    return Deployment(num_dp=a, num_tp=b, num_ep=c, num_ep_tp=d, num_gpus_per_node=num_gpus_per_node)
