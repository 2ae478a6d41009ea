"""What ``moetrace advise`` is asked: ``AdviseConfig`` (the deployment, the EPLB sweep's slot limit,
the steps simulated, the strategies, how EPLB sums, the replica rule, the rearrangement, the split,
the step model's kernels and copy models) with its checks, and the step sizes' defaults.

Out of scope: the inputs and the evaluation (``run``); the strategies evaluated (``options``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moetrace.errors import ConfigError
from moetrace.placement.advise.metrics import redundancy_sweep
from moetrace.placement.advise.rearrange import Rearrangement
from moetrace.placement.deployment import Deployment
from moetrace.placement.eplb import ACCUMULATE, Accumulate
from moetrace.placement.eplb_replicas import ReplicaRule, check_rule
from moetrace.placement.hardware import Hardware, default_hardware
from moetrace.placement.step_model import DedupUnit

__all__ = ["DECODE_TOKENS_PER_GPU", "PREFILL_TOKENS_PER_GPU", "AdviseConfig"]


#: decode tokens per GPU in one step by default (32 requests per node of 8 GPUs, one token each)
DECODE_TOKENS_PER_GPU = 4


#: chunked-prefill tokens per GPU in one prefill step by default (1024 per node of 8 GPUs)
PREFILL_TOKENS_PER_GPU = 128


@dataclass(frozen=True, kw_only=True)
class AdviseConfig:
    """What to sweep and how to evaluate it."""

    deployment: Deployment  # DPaTPbEPc[TPd] on nodes of g GPUs
    max_slots_per_gpu: int = 0  # slot limit per GPU and layer for the EPLB sweep (0: E/W + 2)
    num_steps: int = 200  # decode steps simulated on a trace (each of step_requests tokens)
    decode_tokens_per_gpu: int = DECODE_TOKENS_PER_GPU  # decode tokens (one per request) per EP rank and step
    prefill_tokens_per_gpu: int = PREFILL_TOKENS_PER_GPU  # chunked-prefill tokens per EP rank and prefill step
    # registered strategies to evaluate (``options``; empty: DEFAULT_STRATEGIES where they apply)
    strategies: tuple[str, ...] = ()
    eplb_sum: Accumulate = "float64"  # how EPLB sums pack weights: float64 as SGLang/vLLM, float32 as DeepSeek's
    replica_policy: ReplicaRule = (
        "same_node"  # which replica serves a (token, expert): an engine's rule (eplb_replicas)
    )
    rearrangement: Rearrangement = field(default_factory=Rearrangement)  # stall and interval of a rearrangement
    test_fraction: float = 0.2  # share of a trace's requests held out for evaluation (as compare)
    seed: int = 0  # the split and the drawn steps (as compare: the same seed, the same split)
    hardware: Hardware = field(default_factory=default_hardware)  # the step model's kernels (--link)
    decode_dedup: DedupUnit = "expert"  # decode copy model (DeepEP's low-latency kernels)
    prefill_dedup: DedupUnit = "node"  # prefill copy model (DeepEP's normal kernels)
    num_windows: int = 16  # windows of a trace's requests in arrival (id) order for the drift check
    # the user's HF config.json, parsed (--model-config): the experts' size where the model records none
    model_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.max_slots_per_gpu < 0 or self.num_steps < 4 or self.num_windows < 4:
            raise ConfigError("--max-slots-per-gpu must be >= 0, steps >= 4 and windows >= 4")
        if self.decode_tokens_per_gpu < 1 or self.prefill_tokens_per_gpu < 1:
            raise ConfigError(
                f"--decode-tokens-per-gpu and --prefill-tokens-per-gpu must be >= 1, got {self.decode_tokens_per_gpu} "
                f"and {self.prefill_tokens_per_gpu}"
            )
        if self.eplb_sum not in ACCUMULATE:
            raise ConfigError(f"--eplb-sum {self.eplb_sum!r}: one of {', '.join(ACCUMULATE)}")
        check_rule(self.replica_policy)
        if not (0.0 < self.test_fraction < 1.0):
            raise ConfigError(f"test fraction must be in (0, 1), got {self.test_fraction}")

    def sweep(self, num_experts: int) -> list[int]:
        """Redundant slots the EPLB sweep tries (``redundancy_sweep``); ``ConfigError`` when none fits."""
        W = self.deployment.num_ep
        out = redundancy_sweep(num_experts=num_experts, num_ranks=W, max_slots_per_gpu=self.slot_limit(num_experts))
        if not out:
            raise ConfigError(
                f"{self.deployment.name}: {num_experts} experts need at least {-(-num_experts // W)} slots per GPU; "
                f"--max-slots-per-gpu {self.slot_limit(num_experts)} leaves no EPLB option to try"
            )
        return out

    def slot_limit(self, num_experts: int) -> int:
        """Slots per GPU and layer the sweep may use: ``max_slots_per_gpu``, or ceil(E/W) + 2."""
        W = self.deployment.num_ep
        return self.max_slots_per_gpu or -(-num_experts // W) + 2

    @property
    def step_requests(self) -> int:
        """Decode tokens (requests) in one step over all EP ranks."""
        return self.decode_tokens_per_gpu * self.deployment.num_ep

    @property
    def prefill_tokens_per_node(self) -> int:
        """Chunked-prefill tokens per node in one prefill step."""
        return self.prefill_tokens_per_gpu * self.deployment.ranks_per_node
