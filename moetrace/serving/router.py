"""The library router: a placement file's router deciding, per request, the node and DP rank that serve it.

``ExpertRouter.from_placement("placement.json")`` reads the file ``moetrace place`` wrote
(``placement.exports.load_placement``, the one reader) and routes requests from their **prefill
routed experts**: int ``[T, L, K]`` expert ids of the prompt's tokens, the format vLLM
(``enable_return_routed_experts``) and SGLang (``return_routed_experts``) return and the trace
stores (``topk_ids_TLK``; ``-1`` = not recorded). Two ways to route (docs/serving.md):

- **a window** (``route_window``): the requests routed together, decided at once by the placement's
  own router (``Router.route``, for the price router ``joint.route_requests``: the assignment
  maximising score − price with no node over ``node_capacity(R, G, max_node_load)``). Given
  ``compare``'s held-out set it gives exactly ``compare``'s routing (the same function on the same
  counts; order-independent beyond ties).
- **a stream** (``route``): one arrival at a time against the live load. Price router: the request
  goes to ``argmax_g score_g − price_g`` among the live nodes whose in-flight requests are fewer than
  ``node_capacity(N + 1, G_live, max_node_load)``, N = requests in flight (this one not counted);
  without a cap (files before it) the plain argmax, which is also what a window gives. Centroid
  router: the nearest prefill centroid's cluster, its nodes in turn (a window's rule, kept across
  calls). No router (an ungrouped placement): the least-loaded rank.

Inside the chosen node the request goes to its least-loaded live DP rank (ties: the lowest rank);
``release(rank)`` ends a request. A request without routing (``None``, no token, no recorded id)
goes to the least-loaded live rank (the fallback) and so does a request whose node has no live rank;
malformed routing (wrong shape, ids out of range) falls back too, or raises ``RoutingError`` with
``fallback="error"``. Every call is thread-safe (one lock around the load; scores are computed
outside it).

Shape legend (docs/architecture.md): T tokens, L MoE layers, K top-k slots, E logical experts,
G nodes, A DP ranks, F features (L * E), R requests.

Out of scope: transport (the Ray Serve plug-in ``ray_serve``; a prefill–decode proxy, docs/serving.md),
fitting the router (``placement.routers``).
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from moetrace.analysis.jit import cached_kernel, run_kernel
from moetrace.errors import ConfigError, MoetraceError
from moetrace.placement.exports import PlacementFile, load_placement
from moetrace.placement.grouping import predict_clusters
from moetrace.placement.joint import members_of_placement, node_capacity
from moetrace.placement.routers import CentroidRouter, NoRouter, PriceRouter

__all__ = ["Decision", "ExpertRouter", "Fallback", "RoutingError", "expert_counts"]

Fallback = Literal["least_loaded", "error"]
FALLBACKS: tuple[str, ...] = ("least_loaded", "error")
_F32_EXACT = 1 << 24  # integers below this are exact in float32, and so is any float32 sum of them


class RoutingError(MoetraceError, ValueError):
    """A request's routed experts cannot be read (wrong shape, ids outside the model's experts)."""


@dataclass(frozen=True)
class Decision:
    """Where one request goes."""

    rank: int  # the DP rank (attention data-parallel replica) that serves it
    node: int  # the node of that rank
    routed: bool  # True: the placement's router chose the node; False: the fallback did
    reason: str  # "routed", or why the fallback took it ("no routing", "malformed: ...", "node down", ...)


def expert_counts(topk_ids_TLK: Any, *, num_layers: int, num_experts: int) -> np.ndarray:
    """Tokens per (MoE layer, expert) of one request, int64 [L, E], from its routed expert ids.

    ``topk_ids_TLK``: int ``[T, L, K]`` (any K; ``-1`` = not recorded) over the MoE layers in model
    order. Raises ``RoutingError`` on another shape or ids outside ``-1 .. E-1``. Counted in one
    numba pass where numba is installed (about 1 ns per id; ``_count_kernel``), else by numpy's
    ``bincount`` (about 4 ns per id, ``_count_numpy``): the same counts."""
    ids = np.asarray(topk_ids_TLK)
    if ids.ndim != 3 or ids.shape[1] != num_layers:
        raise RoutingError(f"routed experts must be [tokens, {num_layers} MoE layers, top-k], got shape {ids.shape}")
    if ids.size and ids.dtype.kind not in "iu":
        raise RoutingError(f"routed experts must be integer ids, got {ids.dtype}")
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)
    if ids.size == 0:
        return counts
    if _count_kernel() is None:
        bad = _count_numpy(ids, counts)
    else:
        bad = run_kernel("router counting", _count_kernel, _count_numpy, ids, counts)
    if bad:
        raise RoutingError(
            f"routed expert ids must be in -1..{num_experts - 1}, got {int(ids.min())}..{int(ids.max())}"
        )
    return counts


def _count_numpy(ids_TLK: np.ndarray, counts_LE: np.ndarray) -> int:
    """The counting kernel's NumPy twin: add every id of ``ids_TLK`` to ``counts_LE`` (int64 [L, E]) unless
    one is outside ``-1 .. E-1``; returns how many are (then nothing is added)."""
    L, E = counts_LE.shape
    lo, hi = int(ids_TLK.min()), int(ids_TLK.max())
    if lo < -1 or hi >= E:
        return int(((ids_TLK < -1) | (ids_TLK >= E)).sum())
    # one bin per (layer, expert) plus one per layer for -1, without a boolean mask
    # (one pass into the platform integer bincount reads; ~3-4 ns per id, numpy's floor here)
    off = (1 + np.arange(L, dtype=np.intp) * (E + 1))[None, :, None]
    c = np.bincount(np.add(ids_TLK, off, dtype=np.intp, casting="unsafe").reshape(-1), minlength=L * (E + 1))
    counts_LE += c.reshape(L, E + 1)[:, 1:]
    return 0


_KERNELS: dict[str, Any] = {}


def _count_kernel() -> Any:
    """The numba counting kernel, compiled per id dtype and memory layout on first use (cached on disk by
    numba), or None where numba is not installed (looked up once per process: the fallback is decided once,
    not per request). ``kernel(ids_TLK, counts_LE)`` adds every id in ``0 .. E-1`` to ``counts_LE`` (int64,
    E its columns), skips -1 and returns how many ids were outside ``-1 .. E-1`` (the caller then raises)."""
    return cached_kernel(_KERNELS, "count", _build_count_kernel)


def _build_count_kernel() -> Any:
    import numba

    @numba.njit(cache=True, nogil=True)
    def count_ids(ids_TLK, counts_LE):
        T, L, K = ids_TLK.shape
        E = counts_LE.shape[1]
        bad = 0
        for t in range(T):
            for l in range(L):
                for k in range(K):
                    e = np.int64(ids_TLK[t, l, k])
                    if e >= 0 and e < E:
                        counts_LE[l, e] += 1
                    elif e != -1:
                        bad += 1
        return bad

    return count_ids


def warm_up_counting(num_layers: int, num_experts: int) -> None:
    """Compile (or load from numba's cache) the counting kernel for the id arrays routers receive (int64,
    int32 and int16 arrays, and a uint8 view of consecutive MoE layers: the prefill–decode proxy's), so
    that no request pays it. Without numba: nothing to do."""
    if _count_kernel() is None:
        return
    for dtype in (np.int64, np.int32, np.int16, np.uint8):
        expert_counts(np.zeros((2, num_layers, 2), dtype), num_layers=num_layers, num_experts=num_experts)
    view = np.zeros((2, num_layers + 1, 2), np.uint8)[:, 1:]  # not contiguous: numba's "A" layout
    expert_counts(view, num_layers=num_layers, num_experts=num_experts)


class ExpertRouter:
    """A placement file's router with live per-rank load (module docstring). Thread-safe."""

    def __init__(self, pf: PlacementFile, *, fallback: Fallback = "least_loaded", where: str = "placement") -> None:
        if fallback not in FALLBACKS:
            raise ConfigError(f"fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
        self.placement_file = pf
        self.fallback: Fallback = fallback
        dep = pf.deployment
        self.num_nodes = int(dep.num_groups)
        self.num_layers = pf.model.num_moe_layers
        self.num_experts = pf.model.num_experts
        self.rank_node_A = np.asarray(dep.replica_node_A(), dtype=np.int64)  # node of each DP rank
        self.num_ranks = len(self.rank_node_A)
        router = pf.router
        if not isinstance(router, NoRouter) and router.num_groups != self.num_nodes:
            raise ConfigError(
                f"{where}: its router sends requests to {router.num_groups} nodes but its deployment "
                f"{dep.name} has {self.num_nodes}; re-create it with `moetrace place`"
            )
        self.router = router
        if isinstance(router, PriceRouter):
            member_LGE = members_of_placement(pf.placement, num_groups=self.num_nodes, num_experts=self.num_experts)
            # the matrix joint.node_scores builds, once (the per-request path reuses it)
            L, G, E = member_LGE.shape
            self._m_FG = np.ascontiguousarray(np.transpose(member_LGE, (0, 2, 1)).reshape(L * E, G), dtype=np.float32)
            self._price_G = np.asarray(router.node_prices_G, dtype=np.float64)
        self._lock = threading.Lock()
        # the live state, in plain lists: a decision reads a few of 8-64 entries, which numpy makes slower;
        # a node's load and liveness are summed from its ranks' when needed, never kept twice
        self._node_of = [int(g) for g in self.rank_node_A]
        self._ranks_of_G = [[a for a in range(self.num_ranks) if self._node_of[a] == g] for g in range(self.num_nodes)]
        self._inflight_A = [0] * self.num_ranks
        self._live_A = [True] * self.num_ranks
        self._decisions_A = [0] * self.num_ranks
        self._turn_C: Counter[int] = Counter()  # centroid router: the next of each cluster's nodes
        self._fallbacks: Counter[str] = Counter()
        warm_up_counting(self.num_layers, self.num_experts)  # no request pays the kernel's compilation

    @classmethod
    def from_placement(cls, path: str | os.PathLike[str], *, fallback: Fallback = "least_loaded") -> ExpertRouter:
        """The router of the placement file at ``path`` (``TraceFormatError`` naming a problem of the file)."""
        return cls(load_placement(path), fallback=fallback, where=str(path))

    # ---- state ---------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return self.router.kind

    def inflight(self) -> np.ndarray:
        """Requests in flight per DP rank, int64 [A] (a copy)."""
        with self._lock:
            return np.array(self._inflight_A, dtype=np.int64)

    def release(self, rank: int) -> None:
        """A request served by ``rank`` finished (or failed): it no longer counts as in flight."""
        with self._lock:
            self._check_rank(rank)
            if self._inflight_A[rank] <= 0:
                raise ValueError(f"rank {rank} has no request in flight to release")
            self._inflight_A[rank] -= 1

    def move(self, from_rank: int, to_rank: int) -> None:
        """A request counted on ``from_rank`` went to ``to_rank`` instead (a transport that overrode the
        decision, e.g. a full replica): its in-flight count moves with it."""
        with self._lock:
            self._check_rank(from_rank)
            self._check_rank(to_rank)
            if self._inflight_A[from_rank] <= 0:
                raise ValueError(f"rank {from_rank} has no request in flight to move")
            self._inflight_A[from_rank] -= 1
            self._inflight_A[to_rank] += 1

    def reroute(self, rank: int, why: str) -> Decision:
        """A request counted on ``rank`` cannot be served there (the rank failed before answering): its
        count leaves ``rank`` and it goes to the least-loaded live rank, counted as a fallback for
        ``why``. ``RoutingError`` when no rank is live (the count has left ``rank`` all the same)."""
        with self._lock:
            self._check_rank(rank)
            if self._inflight_A[rank] <= 0:
                raise ValueError(f"rank {rank} has no request in flight to reroute")
            self._inflight_A[rank] -= 1
            return self._fallback_locked(why)

    def live(self) -> np.ndarray:
        """Whether each DP rank takes new requests, bool [A] (a copy)."""
        with self._lock:
            return np.array(self._live_A, dtype=bool)

    def set_live(self, rank: int, live: bool) -> None:
        """Mark a DP rank up or down; a down rank takes no new request (its in-flight ones still count
        until released)."""
        with self._lock:
            self._check_rank(rank)
            self._live_A[rank] = bool(live)

    def stats(self) -> dict[str, Any]:
        """Decisions per rank, fallbacks by reason and the current in-flight load."""
        with self._lock:
            return {
                "decisions_per_rank": list(self._decisions_A),
                "fallbacks": dict(self._fallbacks),
                "inflight_per_rank": list(self._inflight_A),
                "live_ranks": [a for a, up in enumerate(self._live_A) if up],
            }

    # ---- routing -------------------------------------------------------------------------------
    def counts(self, topk_ids_TLK: Any) -> np.ndarray:
        """``expert_counts`` for this placement's model, int64 [L, E]."""
        return expert_counts(topk_ids_TLK, num_layers=self.num_layers, num_experts=self.num_experts)

    def scores(self, counts_LE: np.ndarray, *, total: int | None = None) -> np.ndarray:
        """Price router: each node's share of the request's activations, float64 [G], computed as
        ``joint.node_scores`` computes it (float32 shares times the membership matrix). ``total``:
        ``counts_LE.sum()`` when the caller has it (a positive int)."""
        c = np.asarray(counts_LE).reshape(1, -1).astype(np.float32)
        if total is not None and 0 < total < _F32_EXACT:
            # the float32 sum of integer counts below 2**24 is exact: the same divisor, the same shares
            np.divide(c, np.float32(total), out=c)
        else:
            tot = c.sum(1, keepdims=True)
            np.divide(c, tot, out=c, where=tot > 0)
        out = np.empty((1, self.num_nodes))
        out[:] = c @ self._m_FG
        return out[0]

    def route(self, topk_ids_TLK: Any) -> Decision:
        """One arrival: its node and DP rank, counted in flight until ``release(decision.rank)``."""
        counts, total, why = self._read(topk_ids_TLK)
        if counts is None:
            return self._take_fallback(why)
        return self._route_counted(counts, total)

    def route_fallback(self, why: str) -> Decision:
        """A request whose routing the caller could not read (``why``: "no routing", "malformed: ...",
        "prefill failed"): the least-loaded live rank, counted as a fallback for ``why``."""
        return self._take_fallback(why)

    def route_counts(self, counts_LE: np.ndarray) -> Decision:
        """``route`` from the request's prefill counts per (MoE layer, expert), int [L, E] (for a
        caller that counts itself; all zeros: the fallback)."""
        counts = np.asarray(counts_LE)
        if counts.shape != (self.num_layers, self.num_experts):
            raise RoutingError(f"counts must be [{self.num_layers}, {self.num_experts}], got {counts.shape}")
        if not counts.any():
            return self._take_fallback("no routing")
        return self._route_counted(counts, None)

    def _route_counted(self, counts: np.ndarray, total: int | None) -> Decision:
        """``route_counts`` of counts already checked: [L, E], not all zero (``total``: their sum, if known)."""
        if isinstance(self.router, PriceRouter):
            net_G = (self.scores(counts, total=total) - self._price_G).tolist()
            with self._lock:
                live, inflight = self._live_A, self._inflight_A
                eligible = [g for g, ranks in enumerate(self._ranks_of_G) if any(live[a] for a in ranks)]
                if not eligible:
                    return self._fallback_locked("no live rank")
                if self.router.max_node_load is not None:
                    cap = node_capacity(sum(inflight) + 1, len(eligible), self.router.max_node_load)
                    eligible = [g for g in eligible if sum(inflight[a] for a in self._ranks_of_G[g]) < cap]
                node = max(eligible, key=net_G.__getitem__)  # ties: the lowest node (max keeps the first)
                return self._admit_locked(node)
        if isinstance(self.router, CentroidRouter):
            cluster = int(predict_clusters(counts.reshape(1, -1), self.router.prefill_centroids_CF)[0])
            nodes = self.router.cluster_to_groups[cluster]
            with self._lock:
                node = nodes[self._turn_C[cluster] % len(nodes)]
                self._turn_C[cluster] += 1
                return self._admit_locked(node)
        return self._take_fallback("no router")  # an ungrouped placement: any rank serves any request

    def route_window(self, requests: Sequence[Any]) -> list[Decision]:
        """The requests routed together (an admission window), decided at once by the placement's own
        router (``Router.route``): for the same requests, the nodes ``compare`` routes them to. Each
        counts in flight until released. Requests without readable routing take the fallback and are
        left out of the window."""
        out: list[Decision | None] = [None] * len(requests)
        rows, counts = [], []
        for i, ids in enumerate(requests):
            c, _, why = self._read(ids)
            if c is None:
                out[i] = self._take_fallback(why)
            else:
                rows.append(i)
                counts.append(c)
        if rows and not isinstance(self.router, NoRouter):
            counts_RLE = np.stack(counts)
            routes = self.router.route(
                counts_RLE, placement=self.placement_file.placement, is_test_R=np.ones(len(rows), dtype=bool)
            )
            assert routes.group_R is not None
            with self._lock:
                for i, node in zip(rows, routes.group_R.tolist(), strict=True):
                    out[i] = self._admit_locked(int(node))
        else:
            for i in rows:
                out[i] = self._take_fallback("no router")
        return [d for d in out if d is not None]

    def nodes_of_window(self, counts_RLE: np.ndarray) -> np.ndarray:
        """The nodes a window of requests given as counts [R, L, E] goes to, int64 [R], without
        admitting them (what ``route_window`` decides, for checks and replays)."""
        routes = self.router.route(
            counts_RLE, placement=self.placement_file.placement, is_test_R=np.ones(len(counts_RLE), dtype=bool)
        )
        return np.zeros(len(counts_RLE), np.int64) if routes.group_R is None else routes.group_R

    # ---- internals (the ``_locked`` ones run under ``self._lock``) -------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"DP rank {rank} is not one of this placement's ranks 0..{self.num_ranks - 1}")

    def _read(self, ids: Any) -> tuple[np.ndarray | None, int, str]:
        """The counts of ``ids`` and their sum, or None, 0 and why not."""
        if ids is None:
            return None, 0, "no routing"
        try:
            counts = self.counts(ids)
        except RoutingError as exc:
            if self.fallback == "error":
                raise
            return None, 0, f"malformed: {exc}"
        total = int(counts.sum())  # counts are >= 0: a zero sum is no routing
        if total == 0:
            return None, 0, "no routing"
        return counts, total, "routed"

    def _take_fallback(self, why: str) -> Decision:
        with self._lock:
            return self._fallback_locked(why)

    def _fallback_locked(self, why: str) -> Decision:
        live = [a for a, up in enumerate(self._live_A) if up]
        if not live:
            raise RoutingError("no live DP rank to route to")
        rank = min(live, key=self._inflight_A.__getitem__)  # ties: the lowest rank
        self._fallbacks[why.split(":", 1)[0]] += 1
        return self._count_locked(rank, routed=False, reason=why)

    def _admit_locked(self, node: int) -> Decision:
        ranks = [a for a in self._ranks_of_G[node] if self._live_A[a]]
        if not ranks:
            return self._fallback_locked("node down")
        rank = min(ranks, key=self._inflight_A.__getitem__)  # ties: the lowest rank
        return self._count_locked(rank, routed=True, reason="routed")

    def _count_locked(self, rank: int, *, routed: bool, reason: str) -> Decision:
        self._inflight_A[rank] += 1
        self._decisions_A[rank] += 1
        return Decision(rank=rank, node=self._node_of[rank], routed=routed, reason=reason)
