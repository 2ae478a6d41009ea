"""``place`` and ``compare`` on a load profile: placements from its loads, tokens drawn from them.

A load profile (``moetrace.tracer.trace.profile``) has no requests, so only the ungrouped
strategies run on it (those that read the decode load ``load_LE`` alone: linear, round robin,
random, EPLB); the grouped ones cluster requests and route each by its prefill, and are refused
with one line, as are the upper bounds and the expert-copy floor (both look at held-out requests).

``load_profile_data`` builds compare's ``TraceData`` from a profile: one training row holding the
profile's decode counts (``mixed`` when the recorder did not tell prefill from decode; a
prefill-only profile is refused), and one held-out row whose tokens are **drawn from the same
counts**: each token picks ``top_k`` distinct experts at every MoE layer, expert ``e`` of layer
``l`` with probability ``K * counts[l, e] / sum_e counts[l, e]`` (its share of the layer's routed
ids), by systematic sampling over a random order of the experts; layers are drawn independently
(a profile holds no co-activation). Placement and evaluation therefore see the same loads (an
in-sample figure), and ``compare.json`` says so (``tokens_from``).

Shape legend (docs/architecture.md): T tokens, L MoE layers, K top-k, E experts, R requests (here
2 rows: train, held out), N random expert orders.

Out of scope: the simulation itself (``compare``, ``simulate``), reading the file (``profile``).
"""

from __future__ import annotations

import os

import numpy as np

from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.compare import TraceData
from moetrace.placement.strategies import STRATEGIES, get_strategy
from moetrace.tracer.trace.profile import STAGE_MIXED, LoadProfile, open_profile

__all__ = ["PROFILE_TOKENS", "TOKENS_FROM", "draw_tokens", "load_profile_data", "profile_strategies"]

#: tokens drawn per stage (compare samples its steps from them, with replacement)
PROFILE_TOKENS = 1 << 16
#: what compare.json's ``tokens_from`` and the printed note say
TOKENS_FROM = (
    "load profile: tokens drawn from its expert loads, layers independent (placed and evaluated on the same loads)"
)
#: random expert orders a batch of drawn tokens shares (each token takes one at random)
_ORDERS = 64


def ungrouped() -> list[str]:
    """The registry's strategies that need no requests."""
    return [s.name for s in STRATEGIES if not s.grouped]


def profile_strategies(strategies: tuple[str, ...], *, asked: bool) -> tuple[str, ...]:
    """The strategies to run on a profile: ``strategies`` when none is grouped; without the grouped
    ones when the user did not ``asked`` for them (the command's default); else ``ConfigError``
    naming why and the choices."""
    grouped = [s for s in strategies if get_strategy(s).grouped]
    if not grouped:
        return strategies
    if asked:
        raise ConfigError(
            f"strategy {', '.join(repr(s) for s in grouped)} groups requests and routes each by its prefill; a load "
            f"profile has expert counts, no requests: choose from {', '.join(ungrouped())}"
        )
    return tuple(s for s in strategies if s not in grouped) or ("linear",)


def placement_stage(profile: LoadProfile) -> str:
    """The stage placements are built from: decode, else mixed; ``TraceFormatError`` for prefill only."""
    for s in ("decode", STAGE_MIXED):
        if s in profile.stages:
            return s
    raise TraceFormatError(
        "the profile counted prefill only; placements are built from decode counts and the all-to-all model "
        "simulates decode steps: use a profile with decode counts"
    )


def draw_tokens(counts_LE: np.ndarray, *, num_tokens: int, top_k: int, seed: int) -> np.ndarray:
    """``num_tokens`` tokens whose experts follow the loads ``counts_LE``: int16 ``[T, L, K]``.

    At each layer a token holds ``top_k`` distinct experts; expert e is among them with probability
    ``min(1, K * c_e / sum c)`` (capped shares spread over the rest), by systematic sampling (one
    uniform offset, K equally spaced points over the cumulative shares) in one of ``_ORDERS`` random
    expert orders. A layer without counts gets ``-1`` (nothing recorded). Deterministic in ``seed``.
    """
    L, E = counts_LE.shape
    K = top_k
    rng = np.random.default_rng([seed, 17])
    out = np.full((num_tokens, L, K), -1, dtype=np.int16)
    for layer in range(L):
        c = counts_LE[layer].astype(np.float64)
        if c.sum() <= 0:
            continue
        pi = _inclusion(c, K)
        orders = np.stack([rng.permutation(E) for _ in range(_ORDERS)])  # [N, E]
        cum = np.cumsum(pi[orders], axis=1)  # [N, E], last = K
        pick = rng.integers(0, _ORDERS, num_tokens)
        u = rng.random(num_tokens)
        for o in range(_ORDERS):
            rows = np.flatnonzero(pick == o)
            points = u[rows, None] + np.arange(K)[None, :]  # [n, K] in [0, K)
            pos = np.minimum(np.searchsorted(cum[o], points, side="right"), E - 1)
            out[rows, layer] = orders[o][pos]
    return out


def _inclusion(c_E: np.ndarray, k: int) -> np.ndarray:
    """Inclusion probabilities summing to ``min(k, experts with counts)``, each at most 1."""
    k = min(k, int((c_E > 0).sum()))
    pi = np.zeros_like(c_E)
    free = c_E > 0
    left = float(k)
    for _ in range(len(c_E)):  # cap at 1 and spread the rest; ends within E rounds
        share = c_E * free / c_E[free].sum() * left
        over = free & (share >= 1.0)
        if not over.any():
            pi[free] = share[free]
            break
        pi[over] = 1.0
        free &= ~over
        left = k - float(pi.sum())
        if left <= 0 or not free.any():
            break
    return pi * (k / pi.sum())


def load_profile_data(path: str | os.PathLike, *, seed: int, num_tokens: int = PROFILE_TOKENS) -> TraceData:
    """Compare's input from the load profile at ``path`` (module docstring): 2 rows (train, held out),
    ``num_tokens`` drawn decode tokens (and prefill ones when the profile counted prefill)."""
    prof = open_profile(path)
    m = prof.model
    stage = placement_stage(prof)
    decode_LE = prof.total(stage)
    if not decode_LE.any():
        raise TraceFormatError(f"{path}: the profile's {stage} counts are all zero; nothing to place")
    prefill_LE = prof.total("prefill") if "prefill" in prof.stages else np.zeros_like(decode_LE)
    decode_RLE = np.stack([decode_LE, decode_LE])
    prefill_RLE = np.stack([prefill_LE, prefill_LE])
    tokens = draw_tokens(decode_LE, num_tokens=num_tokens, top_k=m.top_k, seed=seed)
    with_prefill = "prefill" in prof.stages and prefill_LE.any()
    p_tokens = draw_tokens(prefill_LE, num_tokens=num_tokens, top_k=m.top_k, seed=seed + 1) if with_prefill else None
    stages = frozenset({"decode", *(("prefill",) if with_prefill else ())})
    return TraceData(
        model=m,
        trace_path=str(path),
        prefill_RLE=prefill_RLE,
        decode_RLE=decode_RLE,
        is_test_R=np.array([False, True]),
        test_topk_ids_TLK=tokens,
        test_req_T=np.ones(num_tokens, dtype=np.int64),
        test_prefill_ids_TLK=p_tokens,
        test_prefill_req_T=None if p_tokens is None else np.ones(num_tokens, dtype=np.int64),
        stages=stages,
        tokens_from=TOKENS_FROM + ("" if stage == "decode" else "; decode loads are the recorder's mixed counts"),
    )
