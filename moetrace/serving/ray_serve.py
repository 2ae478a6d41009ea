"""Ray Serve plug-in: ``ExpertRequestRouter``, a Serve ``RequestRouter`` that routes by routed experts.

Name it by class path in a deployment's request router config (docs/serving.md has a complete
example)::

    RequestRouterConfig(
        request_router_class="moetrace.serving.ray_serve:ExpertRequestRouter",
        request_router_kwargs={"placement": "/path/placement.json", "fallback": "least_loaded"},
    )

Read from Ray 2.60.0's source (the wheel installed here, commit b7f4259e944bf6959f721b106adc366ddfa0c356):
``ray/serve/_private/request_router/request_router.py`` (``RequestRouter``: ``initialize_state(**kwargs)``
gets ``request_router_kwargs``; ``choose_replicas(candidate_replicas, pending_request)`` returns ranks
of replicas, most preferred first; ``on_request_routed``, ``on_request_completed(replica_id,
internal_request_id)``, ``on_replica_actor_died``), ``ray/serve/_private/request_router/common.py``
(``PendingRequest``: ``args``, ``kwargs``, ``metadata.internal_request_id``),
``replica_wrapper.py`` (``RunningReplica.replica_metadata``: what a replica's
``record_replica_metadata`` returned; ``routing_stats``), ``ray/serve/config.py``
(``RequestRouterConfig``: ``request_router_kwargs`` must be JSON-serializable), and
``ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_aware_router.py``
(``PrefixCacheAffinityRouter``, the template this follows).

Each replica is one DP rank of the placement's deployment. Its rank is read from the replica's
``replica_metadata[rank_key]`` (a replica method ``record_replica_metadata`` returning
``{"dp_rank": rank}``; Ray Serve LLM's ``DPServer`` knows it as ``self.dp_rank``), else from
``routing_stats[rank_key]`` or ``routing_stats["kv_event_metadata"]["dp_rank"]`` (what Ray's KV-aware
router reads); replicas that say nothing are ranked by their replica id, which keeps the load
balanced but not the placement's locality (a warning says so once).

The request's prefill routed experts (int ``[T, L, K]``, nested lists or an array) are read from
``pending_request.kwargs[experts_field]`` or from the first argument that carries the field (a dict
key or an attribute; default field ``routed_experts``): a caller that ran the prefill (a
prefill–decode proxy) attaches them. Without them the request takes the fallback.

The decision is returned as the only first choice, the other live replicas as the second rank (Serve
uses them only when the chosen one is full; ``on_request_routed`` then moves the in-flight count).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve._private.request_router.request_router import RequestRouter

from moetrace.serving.router import ExpertRouter

__all__ = ["ExpertRequestRouter"]

logger = logging.getLogger("ray.serve")


class ExpertRequestRouter(RequestRouter):
    """``ExpertRouter`` behind Ray Serve's request-router interface (module docstring)."""

    def initialize_state(
        self,
        placement: str = "",
        fallback: str = "least_loaded",
        experts_field: str = "routed_experts",
        rank_key: str = "dp_rank",
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ValueError(f"ExpertRequestRouter: unknown request_router_kwargs {sorted(unknown)}")
        if not placement:
            raise ValueError("ExpertRequestRouter needs request_router_kwargs={'placement': PATH}")
        self._router = ExpertRouter.from_placement(placement, fallback=fallback)  # type: ignore[arg-type]
        self._experts_field = experts_field
        self._rank_key = rank_key
        self._decided: dict[str, int] = {}  # internal request id -> the rank its count is on
        self._warned = False

    # ---- replicas <-> ranks -----------------------------------------------------------------------
    def _rank_of(self, replica: Any, fallback_order: dict[Any, int]) -> int:
        meta = getattr(replica, "replica_metadata", None) or {}
        stats = getattr(replica, "routing_stats", None) or {}
        for value in (
            meta.get(self._rank_key),
            stats.get(self._rank_key),
            (stats.get("kv_event_metadata") or {}).get("dp_rank"),
        ):
            if isinstance(value, int) and 0 <= value < self._router.num_ranks:
                return value
        if not self._warned:
            logger.warning(
                "ExpertRequestRouter: replica %s reports no `%s`; ranking replicas by id (load balanced, "
                "placement locality not kept)",
                replica.replica_id,
                self._rank_key,
            )
            self._warned = True
        return fallback_order[replica.replica_id] % self._router.num_ranks

    def _ranks(self, replicas: list[Any]) -> dict[int, Any]:
        order = {rid: i for i, rid in enumerate(sorted((r.replica_id for r in replicas), key=str))}
        out: dict[int, Any] = {}
        for r in replicas:
            out.setdefault(self._rank_of(r, order), r)
        return out

    def _experts(self, pending_request: Any) -> Any:
        if pending_request is None:
            return None
        field = self._experts_field
        kwargs = getattr(pending_request, "kwargs", None) or {}
        if field in kwargs:
            return kwargs[field]
        for arg in getattr(pending_request, "args", None) or ():
            value = arg.get(field) if isinstance(arg, dict) else getattr(arg, field, None)
            if value is not None:
                return value
        return None

    # ---- the RequestRouter interface ------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        by_rank = self._ranks(candidate_replicas)
        if not by_rank:
            return []
        rid = getattr(getattr(pending_request, "metadata", None), "internal_request_id", None)
        if rid is not None and rid in self._decided:  # a retry of a request already counted
            rank = self._decided[rid]
        else:
            for r in range(self._router.num_ranks):
                self._router.set_live(r, r in by_rank)
            decision = self._router.route(self._experts(pending_request))
            rank = decision.rank
            if rid is not None:
                self._decided[rid] = rank
        first = by_rank[rank]
        return [[first], [r for r in candidate_replicas if r is not first]]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        rid = getattr(getattr(pending_request, "metadata", None), "internal_request_id", None)
        if rid is None or rid not in self._decided:
            return
        actual = next(
            (k for k, r in self._ranks(list(self.curr_replicas.values())).items() if r.replica_id == replica_id), None
        )
        if actual is not None and actual != self._decided[rid]:
            self._router.move(self._decided[rid], actual)
            self._decided[rid] = actual

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        rank = self._decided.pop(internal_request_id, None)
        if rank is not None:
            self._router.release(rank)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        # the next choose_replicas marks the ranks it is offered live; requests counted on the dead
        # replica are released as Serve completes them with an error

    @property
    def expert_router(self) -> ExpertRouter:
        """The library router inside (decisions, fallbacks and load: ``stats()``)."""
        return self._router
