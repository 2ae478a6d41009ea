"""The step model against the replay: the links an emulated run realised, and its predicted seconds.

On emulated nodes the summary predicts each strategy's time with the step model
(``placement/step_model.py``) on the replay's send matrices, its links as the run realised them
(``replay_cost``: the shaped node link, loopback's probed rate, the probed fixed cost per
collective), next to the measured time (docs/a2a.md, "The cost model against the replay").

Shape legend (docs/architecture.md): B batches, L MoE layers, W EP ranks (GPUs), V strategies,
N collectives (or probe repeats).

Out of scope: the measured side (``results``), the step model's formulas (``step_model``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moetrace.placement import netemu
from moetrace.placement.cost import Link, Links
from moetrace.placement.replay.network import Network
from moetrace.placement.replay.plan import A2APlan
from moetrace.placement.replay.rank import RankRecord
from moetrace.placement.step_model import GpuTraffic, Kernel, ValueType, layer_seconds
from moetrace.placement.step_model import Phase as KernelPhase

__all__ = ["ReplayCost", "predicted_seconds_VBL", "replay_cost", "replay_kernel", "replay_traffic"]


@dataclass(frozen=True, kw_only=True)
class ReplayCost:
    """The cost model's links as an emulated run realised them, and gloo's fixed cost per collective."""

    links: Links  # inter: the shaped node link's payload rate (inter_nic "node"); intra: loopback's probed rate
    fixed_seconds: float  # median empty all_to_all_single (slowest rank): software, barrier skew, peer messages
    wire_overhead: float  # link bytes per inter-node payload byte (netemu.WIRE_BYTES_PER_PAYLOAD_BYTE)
    intra_probe_seconds: float | None  # median node-local probe (slowest rank), fixed cost included; None: not run
    intra_probe_bytes: int  # bytes each rank sent (and received) in that probe
    note: str = ""  # what the calibration could not measure (empty when all was)

    def to_json(self) -> dict[str, Any]:
        return {
            "links": self.links.to_json(),
            "fixed_seconds": self.fixed_seconds,
            "wire_overhead": self.wire_overhead,
            "intra_probe_seconds": self.intra_probe_seconds,
            "intra_probe_bytes": self.intra_probe_bytes,
            "note": self.note,
        }


def replay_cost(plan: A2APlan, records: Sequence[RankRecord], network: Network | None) -> ReplayCost | None:
    """The cost model of an emulated run (``network.mode == "emulated"``), else None (loopback or
    torchrun: every link is what the machine has, and the model's link classes mean nothing there).

    inter: the emulated link, one per node (``inter_nic="node"``: a node's ranks share its veth), its
    payload rate ``rate_bit / 8 / netemu.WIRE_BYTES_PER_PAYLOAD_BYTE`` (TCP/IP and Ethernet headers,
    the reverse direction's ACKs); intra: loopback's rate from the node-local probe, ``bytes /
    (probe seconds - fixed seconds)``; both message latencies 0: gloo sends every peer a message in
    every collective (an empty split too), so per-message costs and the link's one-way delay are in
    ``fixed_seconds``, the empty probe's median, which ``predicted_seconds_VBL`` adds to every collective.
    """
    if network is None or network.mode != "emulated":
        return None
    notes: list[str] = []
    overhead = netemu.WIRE_BYTES_PER_PAYLOAD_BYTE
    inter = Link(bytes_per_s=netemu.parse_link(network.link).rate_bit / 8 / overhead, latency_s=0.0)
    empty = np.stack([r.probe_empty_seconds_BN for r in records]).max(0)  # [B, N] slowest rank
    fixed = float(np.median(empty))
    nbytes = int(max(r.probe_intra_bytes for r in records))
    intra_s: float | None = None
    if plan.ranks_per_node == 1:
        intra = inter
        notes.append("one rank per node: no node-local traffic, the intra link is unused")
    else:
        intra_s = float(np.median(np.stack([r.probe_intra_seconds_BN for r in records]).max(0)))
        if intra_s > fixed:
            intra = Link(bytes_per_s=nbytes / (intra_s - fixed), latency_s=0.0)
        else:
            intra = Link(bytes_per_s=nbytes / intra_s, latency_s=0.0)
            notes.append(
                "the node-local probe was not slower than an empty collective: loopback's rate is its bytes over "
                "its whole time (the fixed cost not subtracted)"
            )
    return ReplayCost(
        links=Links(intra=intra, inter=inter, inter_nic="node"),
        fixed_seconds=fixed,
        wire_overhead=overhead,
        intra_probe_seconds=intra_s,
        intra_probe_bytes=nbytes,
        note="; ".join(notes),
    )


def replay_traffic(sends_NWW: np.ndarray, *, ranks_per_node: int) -> GpuTraffic:
    """The cost model's per-GPU traffic of the collectives the replay ran: copies sent and received
    and distinct peers per link class, float64 [N, W] each, from send matrices int [N, W, W]
    (``[n, src, dst]``, dispatch; combine is the reverse and costs the same): the copy model's
    traffic, as ``send_matrices`` builds the matrices from its copies."""
    s = np.asarray(sends_NWW, dtype=np.float64)
    node_W = np.arange(s.shape[-1]) // ranks_per_node
    inter_WW = node_W[:, None] != node_W[None, :]
    si, se = s * ~inter_WW, s * inter_WW
    return GpuTraffic(
        send_intra=si.sum(-1),
        recv_intra=si.sum(-2),
        send_inter=se.sum(-1),
        recv_inter=se.sum(-2),
        peers_send_intra=(si > 0).sum(-1).astype(np.float64),
        peers_recv_intra=(si > 0).sum(-2).astype(np.float64),
        peers_send_inter=(se > 0).sum(-1).astype(np.float64),
        peers_recv_inter=(se > 0).sum(-2).astype(np.float64),
    )


def replay_kernel(cost: ReplayCost) -> Kernel:
    """The step model's kernel of a replay: raw bytes both ways (a copy is ``bytes_per_token`` bytes:
    ``hidden_size`` = that count of one-byte values), the run's links and fixed cost per collective,
    no reduction (the replay sends the same copies back and sums nothing)."""
    raw = KernelPhase(value=ValueType(name="raw", bytes_per_value=1.0), links=cost.links, fixed_s=cost.fixed_seconds)
    return Kernel(
        name="replay", copies="rank", dispatch=raw, combine=raw, reduce_bytes_per_s=math.inf, source=cost.note
    )


def predicted_seconds_VBL(plan: A2APlan, cost: ReplayCost) -> np.ndarray:
    """The step model's seconds of each dispatch (= its combine here), float64 [V, B, L]:
    ``step_model.layer_seconds`` on the replay's send matrices with ``replay_kernel(cost)``."""
    V, B, L, W, _ = plan.sends_VBLWW.shape
    traffic = replay_traffic(plan.sends_VBLWW.reshape(V * B * L, W, W), ranks_per_node=plan.ranks_per_node)
    secs = layer_seconds(
        traffic, kernel=replay_kernel(cost), hidden_size=plan.bytes_per_token, ranks_per_node=plan.ranks_per_node
    )
    return secs.dispatch.reshape(V, B, L)
