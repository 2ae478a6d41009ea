"""Serving-time request routers: how a request finds its node from its prompt, one class per kind.

A grouped placement puts each node's experts for the requests that node will serve, so serving it
takes a *router* that sends every new request to a node having seen only its prefill. The kinds:

- ``NoRouter`` (kind ``"none"``): an ungrouped placement; any node serves any request (``compare``
  draws each node's requests uniformly from all held-out ones).
- ``CentroidRouter`` (``"centroid"``; strategies ``data``, ``improved``; core paper §4.1): the
  cosine-nearest prefill centroid names the request's cluster (``grouping.predict_clusters``); the
  cluster's groups (= nodes) take its requests in turn.
- ``PriceRouter`` (``"price"``; strategies ``joint``, ``joint_aligned``): each node scores the share
  of the request's prefill expert activations (all MoE layers) it holds; the node with the highest
  score minus its price wins (``joint.route_requests``; the prices keep nodes evenly loaded).

``Router`` is their union. Each class knows its ``kind``; how it is made from what a strategy built
(``fitted``); its section of the placement file (``to_json`` / ``from_json``: the file's
``grouping`` object, headed by ``"router_kind"``; ``NoRouter``'s is ``null``); and how it routes
requests (``route``). ``read_router`` is the one reader of that section, files written before the
kind was recorded included. The strategy registry (``strategies.Strategy.router``) names the kind
each strategy produces; ``fit_router`` builds it.

Adding a router kind: one class here with those four members, its entry in ``ROUTERS``, the
``router`` of its strategies' rows in ``strategies.py``, tests (a file round trip, routing).

Shape legend (docs/architecture.md): R requests, L MoE layers, E logical experts, G node groups
(= nodes), C clusters, F features (L * E).

Out of scope: fitting the clusters (``grouping``) and the prices (``joint``); placing experts;
simulating traffic (``simulate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.grouping import Grouping, groups_of_clusters, predict_clusters

if TYPE_CHECKING:
    from moetrace.placement.maps import Placement

__all__ = [
    "ROUTERS",
    "CentroidRouter",
    "NoRouter",
    "PriceRouter",
    "Router",
    "RouterKind",
    "Routes",
    "fit_router",
    "read_router",
]

RouterKind = Literal["none", "centroid", "price"]

#: the placement file's hint to anyone who meets a broken router section
_REDO = "re-create the file with `moetrace place`"


@dataclass(frozen=True, kw_only=True)
class Routes:
    """Where a router sends requests, and how well their prompt predicts that."""

    group_R: (
        np.ndarray | None
    )  # int64 [R] node of each request, routed from its prefill (held-out rows); None: no router
    match_rate: float | None = (
        None  # share of held-out requests routed from prefill as their decode would be (needs decode)
    )
    decode_group_R: np.ndarray | None = (
        None  # int64 [R] price router: the balanced assignment by decode (perfect routing)
    )


@dataclass(frozen=True)
class NoRouter:
    """No router: the placement is not grouped; its file section is ``null``."""

    kind: ClassVar[Literal["none"]] = "none"

    @classmethod
    def fitted(cls, *, grouping: Grouping | None, provenance: dict[str, Any], num_groups: int) -> NoRouter:
        del grouping, provenance, num_groups
        return cls()

    def to_json(self) -> None:
        return None

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, where: str, num_groups: int, num_features: int) -> NoRouter:
        del obj, where, num_groups, num_features
        return cls()

    def route(
        self,
        prefill_RLE: np.ndarray,
        *,
        placement: Placement,
        is_test_R: np.ndarray,
        decode_RLE: np.ndarray | None = None,
    ) -> Routes:
        """No routes: every node serves any request."""
        del prefill_RLE, placement, is_test_R, decode_RLE
        return Routes(group_R=None)


@dataclass(frozen=True, kw_only=True, eq=False)
class CentroidRouter:
    """Cosine-nearest prefill centroid → cluster → its groups in turn (strategies ``data``, ``improved``)."""

    kind: ClassVar[Literal["centroid"]] = "centroid"
    #: what the file says about the features, the normalization and the rule (for a reader of the JSON)
    FEATURES: ClassVar[str] = "tokens per (moe layer, expert), layer-major"
    NORMALIZATION: ClassVar[str] = "l2 over the concatenated [moe_layers x experts] token-count vector"
    RULE: ClassVar[str] = "cosine-nearest prefill centroid"

    num_groups: int  # G nodes
    cluster_to_groups: tuple[tuple[int, ...], ...]  # [C] the groups serving each cluster
    prefill_centroids_CF: np.ndarray  # float64 [C, F] mean normalized prefill vector of each cluster (what routes)
    decode_centroids_CF: np.ndarray  # float64 [C, F] K-means centroids in normalized decode space (the match rate)
    match_rate: float | None = None  # share of held-out requests whose prefill picks their decode's cluster

    @property
    def num_clusters(self) -> int:
        return len(self.cluster_to_groups)

    @classmethod
    def fitted(cls, *, grouping: Grouping | None, provenance: dict[str, Any], num_groups: int) -> CentroidRouter:
        """The router of a fitted clustering of the training requests."""
        del provenance
        if grouping is None:
            raise ConfigError("a centroid-routed strategy needs the clustering of the training requests")
        return cls(
            num_groups=num_groups,
            cluster_to_groups=tuple(tuple(int(g) for g in gs) for gs in grouping.cluster_to_groups),
            prefill_centroids_CF=grouping.prefill_centroids_CF,
            decode_centroids_CF=grouping.decode_centroids_CF,
        )

    def to_json(self) -> dict[str, Any]:
        """The file section; centroids rounded to 6 decimals, so a file read and written again is the same file."""
        return {
            "router_kind": self.kind,
            "num_clusters": self.num_clusters,
            "num_groups": self.num_groups,
            "cluster_to_groups": [list(gs) for gs in self.cluster_to_groups],
            "normalization": self.NORMALIZATION,
            "features": self.FEATURES,
            # float64 first: K-means' float32 centroids would print every digit of their rounded value
            "decode_centroids": np.round(np.asarray(self.decode_centroids_CF, dtype=np.float64), 6).tolist(),
            "prefill_centroids": np.round(np.asarray(self.prefill_centroids_CF, dtype=np.float64), 6).tolist(),
            "router": self.RULE,
            "router_match_rate": self.match_rate,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, where: str, num_groups: int, num_features: int) -> CentroidRouter:
        c2g = obj.get("cluster_to_groups", [])
        if not isinstance(c2g, list) or not all(
            isinstance(gs, list) and gs and all(_is_int(g) and 0 <= g < num_groups for g in gs) for gs in c2g
        ):
            raise TraceFormatError(
                f"{where}: grouping `cluster_to_groups` must be a list of group lists (groups "
                f"0..{num_groups - 1}); {_REDO}"
            )
        C = len(c2g)
        centroids = {}
        for key in ("decode_centroids", "prefill_centroids"):
            try:
                arr = np.asarray(obj.get(key, []), dtype=np.float64)
            except (ValueError, TypeError) as exc:
                raise TraceFormatError(
                    f"{where}: grouping `{key}` must be a rectangular array of numbers ({exc})"
                ) from None
            if arr.shape != (C, num_features):
                raise TraceFormatError(
                    f"{where}: grouping `{key}` has shape {arr.shape}, expected ({C}, {num_features})"
                )
            centroids[key] = arr
        return cls(
            num_groups=num_groups,
            cluster_to_groups=tuple(tuple(int(g) for g in gs) for gs in c2g),
            prefill_centroids_CF=centroids["prefill_centroids"],
            decode_centroids_CF=centroids["decode_centroids"],
            match_rate=_match_rate(obj, where),
        )

    def route(
        self,
        prefill_RLE: np.ndarray,
        *,
        placement: Placement,
        is_test_R: np.ndarray,
        decode_RLE: np.ndarray | None = None,
    ) -> Routes:
        """Every request's node from its prefill counts ``prefill_RLE`` [R, L, E] (any numeric dtype);
        with ``decode_RLE`` also the match rate: the same cluster from prefill as from decode, over the
        held-out rows (``is_test_R``, bool [R]). All R rows are routed (a cluster's groups take its
        requests in row order, so a held-out request's node depends on the rows before it)."""
        del placement
        R = len(is_test_R)
        pred_R = predict_clusters(prefill_RLE.reshape(R, -1), self.prefill_centroids_CF)
        group_R = groups_of_clusters(pred_R, [list(gs) for gs in self.cluster_to_groups])
        if decode_RLE is None:
            return Routes(group_R=group_R)
        truth_R = predict_clusters(decode_RLE.reshape(R, -1), self.decode_centroids_CF)
        return Routes(group_R=group_R, match_rate=float((pred_R[is_test_R] == truth_R[is_test_R]).mean()))


@dataclass(frozen=True, kw_only=True, eq=False)
class PriceRouter:
    """Node score minus node price, highest wins, among the nodes under the admission cap (strategies
    ``joint``, ``joint_aligned``): held-out requests arrive in row order (``joint.route_requests``)."""

    kind: ClassVar[Literal["price"]] = "price"
    #: what the file says about the rule and the score (for a reader of the JSON)
    RULE: ClassVar[str] = "node score minus node price, highest wins"
    SCORE: ClassVar[str] = "share of the request's prefill expert activations (all MoE layers) held by the node"

    num_groups: int  # G nodes; node g holds slots [g * P / G, (g + 1) * P / G) of the placement
    node_prices_G: tuple[float, ...]  # [G] each node's price (the balancing LP's duals, rounded to 9 decimals)
    match_rate: float | None = (
        None  # share of held-out requests routed to the node the balanced decode assignment picks
    )
    max_node_load: float | None = None  # admission cap: no node takes more than this over an even share (None: no cap)

    @classmethod
    def fitted(cls, *, grouping: Grouping | None, provenance: dict[str, Any], num_groups: int) -> PriceRouter:
        """The router whose prices the joint placer recorded (``provenance["router_price"]``)."""
        del grouping
        if "router_price" not in provenance:
            raise ConfigError("a price-routed strategy's builder must record its node prices (`router_price`)")
        return cls(num_groups=num_groups, node_prices_G=tuple(float(p) for p in provenance["router_price"]))

    def to_json(self) -> dict[str, Any]:
        cap = {} if self.max_node_load is None else {"max_node_load": self.max_node_load}  # older files: no cap
        return {
            "router_kind": self.kind,
            "num_groups": self.num_groups,
            "router": self.RULE,
            "score": self.SCORE,
            "node_prices": list(self.node_prices_G),
            **cap,
            "router_match_rate": self.match_rate,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, where: str, num_groups: int, num_features: int) -> PriceRouter:
        del num_features
        prices = obj.get("node_prices")
        if (
            not isinstance(prices, list)
            or len(prices) != num_groups
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x) for x in prices)
        ):
            raise TraceFormatError(
                f"{where}: grouping `node_prices` must be {num_groups} finite numbers (one per node); {_REDO}"
            )
        cap = obj.get("max_node_load")  # files written before the admission cap have none
        if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool) or not 1.0 <= cap < 100.0):
            raise TraceFormatError(f"{where}: grouping `max_node_load` must be a number in [1, 100) or null; {_REDO}")
        return cls(
            num_groups=num_groups,
            node_prices_G=tuple(float(x) for x in prices),
            match_rate=_match_rate(obj, where),
            max_node_load=None if cap is None else float(cap),
        )

    def route(
        self,
        prefill_RLE: np.ndarray,
        *,
        placement: Placement,
        is_test_R: np.ndarray,
        decode_RLE: np.ndarray | None = None,
    ) -> Routes:
        """The node of every held-out request (``is_test_R``, bool [R]; other rows 0) from its prefill
        counts ``prefill_RLE`` [R, L, E] (any numeric dtype); with ``decode_RLE`` also the balanced
        assignment by decode (``decode_group_R``) and the share of held-out requests routed alike."""
        from moetrace.placement.joint import (
            balanced_assign,
            members_of_placement,
            node_scores,
            route_requests,
        )

        member = members_of_placement(placement, num_groups=self.num_groups, num_experts=prefill_RLE.shape[2])
        test = np.flatnonzero(is_test_R)
        routed_R = np.zeros(len(is_test_R), dtype=np.int64)
        routed_R[test] = route_requests(
            node_scores(prefill_RLE, member, rows=test),
            np.asarray(self.node_prices_G),
            max_node_load=self.max_node_load,
        )
        if decode_RLE is None:
            return Routes(group_R=routed_R)
        # the assignment by decode under the router's own limit: what a router seeing the decode would do
        truth_R = np.zeros(len(is_test_R), dtype=np.int64)
        d_RG = node_scores(decode_RLE, member, rows=test)
        if self.max_node_load is None:
            truth_R[test] = balanced_assign(d_RG)[0]
        else:
            truth_R[test] = route_requests(d_RG, np.zeros(self.num_groups), max_node_load=self.max_node_load)
        return Routes(
            group_R=routed_R, match_rate=float((routed_R[test] == truth_R[test]).mean()), decode_group_R=truth_R
        )


#: every router kind; a union, so code that must tell them apart matches on the class
Router = NoRouter | CentroidRouter | PriceRouter
#: kind tag -> class, the file's ``router_kind`` and the registry's ``Strategy.router``
ROUTERS: dict[str, type[Router]] = {c.kind: c for c in (NoRouter, CentroidRouter, PriceRouter)}


def fit_router(kind: RouterKind, *, grouping: Grouping | None, provenance: dict[str, Any], num_groups: int) -> Router:
    """The router of kind ``kind`` (a strategy's ``router``) from the clustering of the training requests
    (``grouping``) and what the strategy's builder recorded (``provenance``), for ``num_groups`` nodes;
    without a match rate (``route`` with decode counts measures it)."""
    return ROUTERS[kind].fitted(grouping=grouping, provenance=provenance, num_groups=num_groups)


def read_router(obj: object, *, where: str, num_groups: int, num_features: int) -> Router:
    """The router in a placement file's ``grouping`` section ``obj`` (``None``: ``NoRouter``), checked
    against the file's ``num_groups`` nodes and ``num_features`` = L * E; ``TraceFormatError`` naming
    the problem, an unknown ``router_kind`` included."""
    if obj is None:
        return NoRouter()
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: `grouping` must be a JSON object; {_REDO}")
    kind = obj.get("router_kind")
    if kind is None:
        # Placement files written by older moetrace (before `router_kind`) name their router only by
        # their keys: node prices mean the price router, anything else the centroid router. New files
        # always carry the kind; this is the one place that looks at keys.
        kind = PriceRouter.kind if "node_prices" in obj else CentroidRouter.kind
    cls = ROUTERS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise TraceFormatError(
            f"{where}: grouping `router_kind` {kind!r} is not a router this moetrace knows "
            f"({', '.join(ROUTERS)}); it may be from a newer moetrace, or {_REDO}"
        )
    return cls.from_json(obj, where=where, num_groups=num_groups, num_features=num_features)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _match_rate(obj: dict[str, Any], where: str) -> float | None:
    rate = obj.get("router_match_rate")
    if rate is None:
        return None
    if not isinstance(rate, (int, float)) or isinstance(rate, bool):
        raise TraceFormatError(f"{where}: grouping `router_match_rate` must be a number or null, got {rate!r}")
    return float(rate)
