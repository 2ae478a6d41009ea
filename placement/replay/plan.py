"""The replay's plan: held-out batches, placements and every (strategy, batch, layer)'s send matrix.

``build_plan`` draws the same held-out global batches as ``compare`` (``compare.held_out_batches``,
same seed), places each strategy (or takes placement files, ``placed_from_file``), and computes the
per-(batch, layer) send matrices (``sends.send_matrices``), checked exactly against
``simulate_volume``. The ``A2APlan`` is pickled to every rank; it is pure numpy.

Shape legend (docs/architecture.md): B batches, L MoE layers, W EP ranks (GPUs), V strategies.

Out of scope: running the collectives (``rank``, ``launch``), the result files (``results``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import numpy as np

from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.a2a_manifest import A2AConfig
from moetrace.placement.compare import CompareConfig, PlacedStrategy, TraceData, held_out_batches, place_strategies
from moetrace.placement.exports import PlacementFile, load_placement
from moetrace.placement.maps import Placement
from moetrace.placement.replay.sends import check_against_simulator, send_matrices
from moetrace.placement.replica_routing import ReplicaPolicy
from moetrace.placement.routers import NoRouter
from moetrace.placement.simulate import simulate_volume
from moetrace.placement.step_model import DedupUnit

__all__ = ["DTYPE_BYTES", "A2APlan", "build_plan", "placed_from_file", "placed_from_files", "plan_bytes_per_rank"]

#: bytes per value on the wire of each supported dtype
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True, kw_only=True)
class A2APlan:
    """Everything every rank needs to replay the collectives (pickled to each process)."""

    strategies: tuple[str, ...]  # V names, in run order
    sends_VBLWW: np.ndarray  # int64 [V, B, L, W, W] token copies src -> dst in dispatch (combine: transpose)
    sim_intra_VBL: np.ndarray  # float64 [V, B, L] simulator's dispatch intra-node bytes (combine equal)
    sim_inter_VBL: np.ndarray  # float64 [V, B, L] simulator's dispatch inter-node bytes (combine equal)
    ranks_per_node: int  # EP ranks per node; link (src, dst) is inter-node when their nodes differ
    hidden_size: int  # values per token row
    dtype: str  # a key of DTYPE_BYTES
    backend: str  # "gloo" or "nccl" (resolved, never "auto")
    config: A2AConfig  # provenance written to a2a.json (deployment, batches, trace, model)
    warmup: int = 1  # untimed collectives before the first timed one
    model_layers: tuple[int, ...] = ()  # the model's index of each MoE layer, [L]

    @property
    def world_size(self) -> int:
        return int(self.sends_VBLWW.shape[-1])

    @property
    def bytes_per_token(self) -> int:
        return self.hidden_size * DTYPE_BYTES[self.dtype]


def plan_bytes_per_rank(plan: A2APlan) -> int:
    """Memory each rank needs on top of ``RANK_RSS_BYTES``: its unpickled plan and its send, receive and
    combine buffers (the most rows any rank sends or receives in one collective)."""
    s = plan.sends_VBLWW
    rows = 2 * int(s.sum(-1).max(initial=0)) + int(s.sum(-2).max(initial=0))
    return int(s.nbytes + plan.sim_intra_VBL.nbytes + plan.sim_inter_VBL.nbytes) + rows * plan.bytes_per_token


def placed_from_file(data: TraceData, cfg: CompareConfig, pf: PlacementFile, *, where: str) -> PlacedStrategy:
    """A ``PlacedStrategy`` from a loaded placement file ``pf``, checked against the trace and
    deployment; a file with a router routes the held-out requests by it from their prefill (as
    ``compare`` does)."""
    m, dep = data.model, cfg.deployment
    L, P = pf.placement.phy2log.shape
    if L != m.num_moe_layers or pf.model.num_experts != m.num_experts:
        raise TraceFormatError(
            f"{where}: placement of {L} MoE layers x {pf.model.num_experts} experts; the trace has "
            f"{m.num_moe_layers} x {m.num_experts} (place it from this trace's model)"
        )
    if P % dep.num_ep or pf.deployment.num_ep != dep.num_ep:
        raise ConfigError(
            f"{where}: placement for EP{pf.deployment.num_ep} ({P} slots); --config {dep.name} has "
            f"EP{dep.num_ep} (re-run `moetrace place` with this --config)"
        )
    if isinstance(pf.router, NoRouter):
        return PlacedStrategy(strategy=pf.strategy, placement=pf.placement)
    if pf.router.num_groups != dep.num_groups:
        raise ConfigError(
            f"{where}: its {pf.router.kind} router sends requests to {pf.router.num_groups} nodes; --config "
            f"{dep.name} on nodes of {dep.num_gpus_per_node} GPUs has {dep.num_groups} (re-run `moetrace place` "
            "with this --config and --gpus-per-node)"
        )
    if "prefill" not in data.stages:
        raise ConfigError(f"{where}: its router reads prefill routing, which this trace did not record")
    routes = pf.router.route(data.prefill_RLE, placement=pf.placement, is_test_R=data.is_test_R)
    return PlacedStrategy(
        strategy=pf.strategy, placement=pf.placement, router=pf.router, group_of_test_R=routes.group_R
    )


class _Routing(TypedDict):
    """The keyword arguments ``send_matrices`` and ``simulate_volume`` share (see ``simulate.layer_copies``)."""

    placement: Placement
    batch_T: np.ndarray
    src_rank_T: np.ndarray
    num_batches: int
    num_ranks: int
    ranks_per_node: int
    dedup: DedupUnit
    policy: ReplicaPolicy


def build_plan(
    data: TraceData,
    *,
    cfg: CompareConfig,
    placed: dict[str, PlacedStrategy] | None = None,
    hidden_size: int = 0,
    dtype: str = "bfloat16",
    backend: str = "gloo",
) -> A2APlan:
    """The send matrices of every strategy over ``cfg.num_batches`` held-out global batches.

    ``placed``: name -> placement (e.g. from files); None: build ``cfg.strategies`` from the trace's
    training requests (``compare.place_strategies``). ``hidden_size`` 0: the model's. Raises
    ``A2AMismatchError`` if a matrix disagrees with ``simulate_volume`` (a bug, never expected).
    """
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    dep, m = cfg.deployment, data.model
    H = hidden_size or int(m.hidden_size)
    if H < 1:
        raise ConfigError(f"--hidden-size must be >= 1, got {H}")
    if placed is None:
        placed = place_strategies(data, cfg, cfg.strategies)
    bpt = H * DTYPE_BYTES[dtype]
    sends, intra, inter = [], [], []
    for name, ps in placed.items():
        rows, batch, src, _ = held_out_batches(data, cfg, ps.group_of_test_R)
        kw = _Routing(
            placement=ps.placement,
            batch_T=batch,
            src_rank_T=src,
            num_batches=cfg.num_batches,
            num_ranks=dep.num_ep,
            ranks_per_node=dep.ranks_per_node,
            dedup=cfg.dedup,
            policy=cfg.replica_policy,
        )
        assert data.test_topk_ids_TLK is not None  # read with test_req_T, which held_out_batches needed
        ids = data.test_topk_ids_TLK[rows]
        s_BLWW = send_matrices(ids, **kw)
        sim = simulate_volume(ids, bytes_per_token=bpt, **kw)
        check_against_simulator(s_BLWW, sim, ranks_per_node=dep.ranks_per_node, bytes_per_token=bpt, label=name)
        sends.append(s_BLWW)
        intra.append(sim["dispatch_intra_bytes"])
        inter.append(sim["dispatch_inter_bytes"])
    conf = A2AConfig(
        deployment=dep.name,
        gpus_per_node=dep.num_gpus_per_node,
        num_ep=dep.num_ep,
        num_nodes=dep.num_nodes,
        ranks_per_node=dep.ranks_per_node,
        num_batches=cfg.num_batches,
        batch_requests=cfg.batch_requests,
        dedup=cfg.dedup,
        replica_policy=cfg.replica_policy,
        seed=cfg.seed,
        test_fraction=cfg.test_fraction,
        trace=data.trace_path,
        model=m,
    )
    return A2APlan(
        strategies=tuple(placed),
        sends_VBLWW=np.stack(sends),
        sim_intra_VBL=np.stack(intra),
        sim_inter_VBL=np.stack(inter),
        ranks_per_node=dep.ranks_per_node,
        hidden_size=H,
        dtype=dtype,
        backend=backend,
        model_layers=tuple(int(x) for x in m.moe_layers),
        config=conf,
    )


def placed_from_files(
    data: TraceData, cfg: CompareConfig, paths: Sequence[str | os.PathLike[str]]
) -> dict[str, PlacedStrategy]:
    """Name -> placement of each placement file (``placed_from_file``), in the order given; a name
    already taken gets the file's stem after it (``eplb:other``)."""
    placed: dict[str, PlacedStrategy] = {}
    for f in map(Path, paths):
        ps = placed_from_file(data, cfg, load_placement(f), where=str(f))
        placed[ps.strategy if ps.strategy not in placed else f"{ps.strategy}:{f.stem}"] = ps
    return placed
