"""The steps ``compare`` simulates and how it prices them: each held-out request's node by its
router's share (``node_shares``, ``node_counts``), the decode and prefill steps drawn from the held-out
tokens (``held_out_batches``, ``prefill_batches``), and one stage's traffic and step time of a placement
under the run's cost model (``Stepper`` over ``simulate_volume``), summed per step (``seconds_B``).

A global batch is one decode step: each of the G groups (nodes) takes its share of ``batch_requests``
requests drawn with replacement from the test requests routed to it, each at a uniformly drawn
decode position (one token per request). Within a node, requests go round robin over its DP
replicas and then over each replica's TP GPUs (the GPU the token is dispatched from).

Shape legend (docs/architecture.md): R requests, L MoE layers, K top-k slots, T tokens, B batches
(steps), G node groups.

Out of scope: the volume model itself (``simulate``, ``step_model``); placing (``compare_placing``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.compare_config import CompareConfig
from moetrace.placement.compare_data import TraceData
from moetrace.placement.cost import expert_compute_for
from moetrace.placement.deployment import Deployment
from moetrace.placement.grouping import available_cores
from moetrace.placement.hardware import CostModel
from moetrace.placement.maps import Placement
from moetrace.placement.simulate import simulate_volume
from moetrace.placement.step_model import DedupUnit

if TYPE_CHECKING:
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "Measure",
    "Stepper",
    "a2a_seconds_B",
    "a2a_seconds_median",
    "held_out_batches",
    "inter_bytes_BL",
    "node_counts",
    "node_shares",
    "one_blas_thread",
    "prefill_batches",
    "seconds_B",
    "seconds_median",
    "simulation_workers",
    "time_hidden_size",
]

#: most simulations run side by side (each holds its counts and step times: ~30 MB for 500 DeepSeek-V3 decode steps)
MAX_SIMULATION_THREADS = 4


def simulation_workers(tasks: int | None = None) -> int:
    """Threads to simulate ``tasks`` placements side by side: the cores this process may run on, at most
    ``MAX_SIMULATION_THREADS`` (and ``tasks``). The simulation kernel releases the GIL; each simulation
    is computed whole on one thread, so results do not depend on the number."""
    n = min(available_cores(), MAX_SIMULATION_THREADS)
    return max(1, min(n, tasks) if tasks is not None else n)


def one_blas_thread() -> contextlib.AbstractContextManager[Any]:
    """BLAS on one thread inside the block (threadpoolctl, scikit-learn's dependency; without it BLAS
    keeps its threads). compare's products are small (requests x nodes), and between them BLAS's
    threads busy-wait on the cores the simulations need: 2 of compare's 45 CPU-seconds measured.
    BLAS splits a product's outputs over its threads, never its sums: the same bits either way."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # no scikit-learn: nothing to limit with, and the results do not depend on it
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


def _sources(dep: Deployment, per_group: int) -> np.ndarray:
    """EP rank each request position of each group's micro-batch dispatches from, int64 [G, per_group]."""
    rep_node_A = dep.replica_node_A()
    out = np.empty((dep.num_groups, per_group), dtype=np.int64)
    j = np.arange(per_group)
    for g in range(dep.num_groups):
        reps = np.flatnonzero(rep_node_A == g)
        if len(reps) == 0:
            raise ConfigError(f"{dep.name}: node {g} hosts no DP replica (TP wider than a node is not modelled)")
        src = np.stack([dep.replica_source_ranks(int(r)) for r in reps])  # [replicas, tp]
        out[g] = src[j % len(reps), (j // len(reps)) % dep.num_tp]
    return out


def node_shares(group_of_R: np.ndarray | None, rows: np.ndarray, num_groups: int) -> np.ndarray:
    """Share of the requests ``rows`` that a router sends each node, float64 [G] summing to 1 (even
    without a router: ``group_of_R`` None)."""
    if group_of_R is None or len(rows) == 0:
        return np.full(num_groups, 1.0 / num_groups)
    n_G = np.bincount(group_of_R[rows], minlength=num_groups).astype(np.float64)
    return n_G / n_G.sum()


def node_counts(share_G: np.ndarray, total: int) -> np.ndarray:
    """``total`` split over nodes in proportion to ``share_G`` (largest remainders), int64 [G]."""
    raw = share_G * total
    out = np.floor(raw).astype(np.int64)
    rest = total - int(out.sum())
    if rest > 0:
        out[np.argsort(-(raw - out), kind="stable")[:rest]] += 1
    return out


def held_out_batches(
    data: TraceData, cfg: CompareConfig, group_of_R: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Token rows, batch index and source rank of every simulated decode token (int64 [T] each), and the
    groups no held-out request was routed to.

    At a fixed global request rate each node's micro-batch is proportional to the share of requests
    its router sends it: node g takes ``node_counts(share, batch_requests)[g]`` requests per step
    (``batch_requests / G`` each without a router), drawn with replacement from the held-out requests
    routed to it, each at a uniformly drawn decode position.
    """
    dep, B, G = cfg.deployment, cfg.num_batches, cfg.deployment.num_groups
    rng = np.random.default_rng([cfg.seed, 7])
    R = len(data.is_test_R)
    assert data.test_req_T is not None, "read the held-out tokens first (with_held_out_tokens)"
    ntok_R = np.bincount(data.test_req_T, minlength=R)
    start_R = np.zeros(R, dtype=np.int64)
    np.cumsum(ntok_R[:-1], out=start_R[1:])
    usable = np.flatnonzero(data.is_test_R & (ntok_R > 0))
    if group_of_R is None:
        n_G = np.full(G, max(1, cfg.batch_requests // G), dtype=np.int64)
    else:
        n_G = node_counts(node_shares(group_of_R, usable, G), max(G, cfg.batch_requests))
    width = int(n_G.max())
    src_GR = _sources(dep, width)
    rows, batch, src, empty = [], [], [], []
    u_pick = rng.random((B, G, width))
    u_pos = rng.random((B, G, width))
    for g in range(G):
        n = int(n_G[g])
        pool = usable if group_of_R is None else usable[group_of_R[usable] == g]
        if len(pool) == 0:
            empty.append(g)
            continue  # the router sends this node nothing: it idles
        req = pool[(u_pick[:, g, :n] * len(pool)).astype(np.int64)]
        tok = start_R[req] + (u_pos[:, g, :n] * ntok_R[req]).astype(np.int64)
        rows.append(tok.reshape(-1))
        batch.append(np.repeat(np.arange(B), n))
        src.append(np.broadcast_to(src_GR[g, :n], (B, n)).reshape(-1))
    return np.concatenate(rows), np.concatenate(batch), np.concatenate(src), empty


def prefill_batches(
    data: TraceData, cfg: CompareConfig, group_of_R: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Rows of ``data.test_prefill_ids_TLK``, prefill step and source rank of every simulated prompt
    token (int64 [T] each), or None when the trace kept no prompt tokens.

    A prefill step gives the nodes ``prefill_tokens_per_node * G`` prompt tokens in all, split in
    proportion to the share of requests each node's router sends it (chunked prefill at a fixed
    global request rate); node g's tokens are drawn uniformly from the prompt tokens of the held-out
    requests routed to it, and go round robin over its DP replicas and their TP GPUs.
    """
    if data.test_prefill_req_T is None or cfg.num_prefill_batches == 0:
        return None
    dep, B, G = cfg.deployment, cfg.num_prefill_batches, cfg.deployment.num_groups
    rng = np.random.default_rng([cfg.seed, 13])
    req_T = data.test_prefill_req_T
    usable = np.unique(req_T)
    n_G = node_counts(node_shares(group_of_R, usable, G), cfg.prefill_tokens_per_node * G)
    width = int(n_G.max())
    src_GR = _sources(dep, max(width, 1))
    u = rng.random((B, G, width))
    rows, batch, src = [], [], []
    for g in range(G):
        n = int(n_G[g])
        tokens = np.arange(len(req_T)) if group_of_R is None else np.flatnonzero(group_of_R[req_T] == g)
        if len(tokens) == 0 or n == 0:
            continue
        rows.append(tokens[(u[:, g, :n] * len(tokens)).astype(np.int64)].reshape(-1))
        batch.append(np.repeat(np.arange(B), n))
        src.append(np.broadcast_to(src_GR[g, :n], (B, n)).reshape(-1))
    if not rows:
        return None
    return np.concatenate(rows), np.concatenate(batch), np.concatenate(src)


#: what the verdict ranks by: MoE-layer time per step (dispatch + the slowest GPU's experts + combine), or
#: all-to-all time (dispatch + combine) when the model's expert size is unknown
Measure = Literal["moe", "a2a"]


@dataclass(frozen=True, kw_only=True)
class Stepper:
    """One stage's simulated traffic and step time of a placement: ``simulate_volume`` under the run's cost
    model (compare's held-out steps and ours' validation steps alike)."""

    model: ModelInfo
    cfg: CompareConfig
    cost: CostModel
    time_hidden: int  # values per copy: the full-size model's (a -tiny preset mirrors its routing, not its width)

    @classmethod
    def of(cls, m: ModelInfo, cfg: CompareConfig) -> Stepper:
        expert = expert_compute_for(m, config=cfg.model_config)
        hidden = expert.hidden_size if expert is not None else time_hidden_size(m, config=cfg.model_config)
        return cls(model=m, cfg=cfg, cost=CostModel(hardware=cfg.hardware, expert=expert), time_hidden=hidden)

    @property
    def expert(self) -> Any:
        return self.cost.expert

    @property
    def measure(self) -> Measure:
        """MoE-layer time where the expert size is known, else all-to-all time."""
        return "a2a" if self.cost.expert is None else "moe"

    def volume(
        self,
        ids_TLK: np.ndarray,
        placement: Placement,
        drawn: tuple[np.ndarray, np.ndarray, np.ndarray],
        *,
        steps: int,
        dedup: DedupUnit,
    ) -> dict[str, np.ndarray]:
        """``drawn`` = (token rows of ``ids_TLK``, step, source rank)."""
        dep = self.cfg.deployment
        rows, batch, src = drawn
        return simulate_volume(
            ids_TLK,
            rows_T=rows,
            placement=placement,
            batch_T=batch,
            src_rank_T=src,
            num_batches=steps,
            num_ranks=dep.num_ep,
            ranks_per_node=dep.ranks_per_node,
            bytes_per_token=self.model.hidden_size * self.cfg.bytes_per_value,
            dedup=dedup,
            policy=self.cfg.replica_policy,
            cost=self.cost,
            time_hidden_size=self.time_hidden,
        )


def time_hidden_size(m: ModelInfo, *, config: dict[str, Any] | None = None) -> int:
    """Values per all-to-all copy: the full-size model's hidden size (a ``-tiny`` preset mirrors a
    model's routing at a small width; its copies are priced at the full model's; ``config``: the
    user's --model-config)."""
    expert = expert_compute_for(m, config=config)
    return expert.hidden_size if expert is not None else m.hidden_size


def seconds_B(metrics: dict[str, np.ndarray], measure: Measure) -> np.ndarray:
    """Predicted seconds of every step (all layers) in ``measure``, float64 [B]."""
    return a2a_seconds_B(metrics) if measure == "a2a" else metrics["moe_seconds"].sum(1)


def seconds_median(metrics: dict[str, np.ndarray], measure: Measure) -> float:
    """Median over steps of ``seconds_B`` (what the verdict ranks by)."""
    return float(np.median(seconds_B(metrics, measure)))


def a2a_seconds_B(metrics: dict[str, np.ndarray]) -> np.ndarray:
    """Predicted all-to-all seconds of every step (dispatch + combine, all layers), float64 [B]."""
    return (metrics["dispatch_seconds"] + metrics["combine_seconds"]).sum(1)


def a2a_seconds_median(metrics: dict[str, np.ndarray]) -> float:
    """Median over steps of ``a2a_seconds_B`` (the figure compare ranks placements by)."""
    return float(np.median(a2a_seconds_B(metrics)))


def inter_bytes_BL(metrics: dict[str, np.ndarray]) -> np.ndarray:
    """Inter-node bytes (dispatch + combine) of every batch and layer, float64 [B, L]."""
    return metrics["dispatch_inter_bytes"] + metrics["combine_inter_bytes"]
