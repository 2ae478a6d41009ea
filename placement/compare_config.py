"""What ``compare`` and ``place`` are asked: ``CompareConfig`` (the deployment, strategies, split,
steps simulated, copy and step models, request caps) with its checks, the request caps' defaults,
and ``--route-on`` read into ``CompareConfig.route_first_decode``.

Out of scope: reading the trace (``compare_data``); placing and simulating (``compare``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moetrace.errors import ConfigError, option_hint
from moetrace.placement.deployment import Deployment
from moetrace.placement.hardware import Hardware, default_hardware
from moetrace.placement.replica_routing import ReplicaPolicy
from moetrace.placement.step_model import DedupUnit
from moetrace.placement.strategies import check_strategies

__all__ = [
    "MAX_ROUTE_FIRST_DECODE",
    "MAX_SIMULATED_TOKENS",
    "MAX_TEST_REQUESTS",
    "MAX_TRAIN_REQUESTS",
    "CompareConfig",
    "parse_route_on",
]


#: the most tokens one comparison simulates (batches x requests per batch), so a typo cannot ask for terabytes
MAX_SIMULATED_TOKENS = 20_000_000


#: the most prompt tokens one simulated prefill step holds, over all nodes
MAX_PREFILL_STEP_TOKENS = 1 << 22

#: the fixes naming options only some commands building a CompareConfig have (compare has them, a2a only the
#: first two, place none): dropped from the message of a command without the option (``errors.option_hint``)
_LOWER_BATCHES = option_hint("--batches", ": lower --batches or --batch-requests")
_OR_LOWER_BATCHES = option_hint("--batches", ", or lower --batches or --batch-requests")
_OR_LOWER_PREFILL_TOKENS = option_hint("--prefill-tokens", ", or lower --prefill-tokens")


#: the most generated tokens ``--route-on first-decode:N`` lets a router see
MAX_ROUTE_FIRST_DECODE = 1 << 16


#: training requests the placements are fitted on by default (a seeded uniform sample beyond): with the
#: held-out cap, what bounds compare's and place's memory whatever the trace's size (issue 27)
MAX_TRAIN_REQUESTS = 20_000


#: held-out requests the batches draw from by default (a seeded uniform sample beyond)
MAX_TEST_REQUESTS = 5_000


@dataclass(frozen=True, kw_only=True)
class CompareConfig:
    """What to place and how to evaluate it."""

    deployment: Deployment  # DPaTPbEPcTPd on nodes of g GPUs
    strategies: tuple[str, ...] = ("linear", "eplb", "data", "joint", "joint_free", "ours")  # placements to compare
    num_clusters: int = 0  # K-means clusters for grouped strategies (0: one per group)
    num_redundant: int = 0  # redundant slots per layer (P = E + R)
    test_fraction: float = 0.2  # share of requests held out for evaluation
    num_batches: int = 500  # global batches simulated
    num_batch_requests: int = 0  # requests per global batch (0: 32 per group)
    dedup: DedupUnit = "expert"  # decode copy model: a token is sent once per distinct destination of this unit
    replica_policy: ReplicaPolicy = "same_node"  # which replica serves a token when there are several
    bytes_per_value: int = 2  # bytes per hidden value on the wire (bf16 = 2)
    seed: int = 0  # split, K-means, random placement and batch sampling
    oracle: bool = True  # also report the upper bounds (strategies.BOUNDS: perfect routing, test-set oracle)
    prefill_dedup: DedupUnit = "node"  # prefill copy model (DeepEP's normal kernels: one copy per node)
    hardware: Hardware = field(default_factory=default_hardware)  # the step model's kernels (--link: preset, file)
    max_node_load: float = 1.10  # routers sending the busiest node more than this over an even share are flagged
    prefill_tokens_per_node: int = 1024  # chunked-prefill tokens per node and step at an even share (0: none)
    # what-if for decode-only captures: routers see each request's first N generated tokens instead of its
    # prefill, and only the later ones are placed and simulated (0: routers see the prefill, as deployed)
    route_first_decode: int = 0
    # placements are fitted on at most this many training requests (a seeded uniform sample of them beyond;
    # only the sample is counted): bounds memory on large traces (load_trace_data takes the same value)
    max_train_requests: int = MAX_TRAIN_REQUESTS
    # the batches draw from at most this many held-out requests (a seeded uniform sample beyond; only they
    # are counted and only their tokens read)
    max_test_requests: int = MAX_TEST_REQUESTS
    # the user's HF config.json, parsed (--model-config): the experts' size where the trace's model records
    # none (cost.expert_compute_for); None: the trace's ModelInfo, then the preset
    model_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_strategies(self.strategies)
        if self.max_train_requests < 1 or self.max_test_requests < 1:
            raise ConfigError(
                f"the training and held-out request caps must be >= 1, got {self.max_train_requests}, "
                f"{self.max_test_requests}"
            )
        if not (0 <= self.route_first_decode <= MAX_ROUTE_FIRST_DECODE):
            raise ConfigError(
                f"--route-on first-decode:N needs N in 1..{MAX_ROUTE_FIRST_DECODE:,}, got {self.route_first_decode}"
            )
        if not (0.0 < self.test_fraction < 1.0):
            raise ConfigError(f"test fraction must be in (0, 1), got {self.test_fraction}")
        simulated = self.num_batches * self.batch_requests
        if simulated > MAX_SIMULATED_TOKENS:  # bounded work: checked before anything is allocated
            G = self.deployment.num_groups
            per, fix = (f" (32 for each of {G:,} nodes)", ": deploy on fewer nodes" + _OR_LOWER_BATCHES)
            if self.num_batch_requests:
                per, fix = "", _LOWER_BATCHES
            raise ConfigError(
                f"{self.num_batches:,} batches x {self.batch_requests:,} requests per batch{per} = {simulated:,} "
                f"simulated tokens; at most {MAX_SIMULATED_TOKENS:,} per run (about 100 bytes of memory each){fix}"
            )
        wrong = [  # each its own line: place has --clusters, not --batches
            f"{option} must be >= {low}, got {value}"
            for option, low, value in (
                ("--batches", 1, self.num_batches),
                ("--batch-requests", 0, self.num_batch_requests),
                ("--clusters", 0, self.num_clusters),
            )
            if value < low
        ]
        if wrong:
            raise ConfigError("; ".join(wrong))
        if not (1.0 <= self.max_node_load < 100.0):
            raise ConfigError(
                f"--max-node-load must be in [1, 100) (1.10: 10% over an even share), got {self.max_node_load}"
            )
        G, per_node = self.deployment.num_groups, self.prefill_tokens_per_node
        if per_node < 0:
            raise ConfigError(f"--prefill-tokens must be >= 0, got {per_node}")
        if per_node * G > MAX_PREFILL_STEP_TOKENS:  # a2a and place take the default: their fix is fewer nodes
            raise ConfigError(
                f"{per_node:,} prefill tokens per node x {G:,} nodes = {per_node * G:,} prompt tokens per simulated "
                f"prefill step; at most {MAX_PREFILL_STEP_TOKENS:,} ({MAX_PREFILL_STEP_TOKENS // G:,} per node): deploy "
                "on fewer nodes" + _OR_LOWER_PREFILL_TOKENS
            )

    @property
    def batch_requests(self) -> int:
        return self.num_batch_requests or 32 * self.deployment.num_groups

    @property
    def num_prefill_batches(self) -> int:
        """Prefill steps simulated: one per 100 decode steps, at least 4 (and at most ``num_batches``);
        0 without prefill tokens."""
        if self.prefill_tokens_per_node == 0:
            return 0
        return min(self.num_batches, max(4, self.num_batches // 100))


def parse_route_on(text: str) -> int:
    """``--route-on``: ``prefill`` -> 0, ``first-decode:N`` -> N (``CompareConfig.route_first_decode``)."""
    t = text.strip()
    if t == "prefill":
        return 0
    head, _, n = t.partition(":")
    if head == "first-decode" and n.isascii() and n.isdigit() and len(n) <= 9 and 0 < int(n) <= MAX_ROUTE_FIRST_DECODE:
        return int(n)
    raise ConfigError(
        f"--route-on {text[:40]!r}: use `prefill` (as deployed) or `first-decode:N` with N in 1..{MAX_ROUTE_FIRST_DECODE:,} "
        "(a what-if for decode-only captures: routers see each request's first N generated tokens)"
    )
