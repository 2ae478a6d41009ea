"""Agreement of two captures of the same tokens (e.g. HF transformers vs vLLM on identical weights),
explained by the router's score margins.

Two engines running the same checkpoint on the same token sequence compute the router's scores with
different kernels (fused vs unfused matmuls, bf16 accumulation order, chunked prefill vs one pass).
Where two experts' scores are closer than that numerical noise, the engines may pick different
top-k sets. :func:`agreement` counts, per stage, the token-layers whose top-k *sets* agree, and
:func:`router_margins` gives each token-layer's margin (how far the last chosen expert's selection
score is above the best one left out), so the disagreements can be checked against the margins.

Shape legend: T token positions of one sequence, L MoE layers, K top-k, E routed experts,
G router groups (DeepSeek-V3's group-limited routing).

Out of scope: running the engines (``benchmarks/gpu_agreement.py`` does that on a GPU), and any
claim about which engine is right: neither is; the margin says how close the call was.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetrace.tracer.trace.schema import NO_EXPERT

#: relative margin under which a call is within bf16's resolution of the score (8 significant bits)
BF16_RELATIVE_RESOLUTION = 2.0**-8


def topk_sets_equal(a_TLK: np.ndarray, b_TLK: np.ndarray) -> np.ndarray:
    """bool [T, L]: whether the top-k *sets* of two captures agree per token and layer (order ignored).

    ``a_TLK``, ``b_TLK``: integer expert ids of the same shape; rows holding ``NO_EXPERT`` (-1) in
    either capture count as not comparable and come back False (mask them with :func:`comparable`).
    """
    if a_TLK.shape != b_TLK.shape:
        raise ValueError(f"captures differ in shape: {a_TLK.shape} vs {b_TLK.shape}")
    eq = (np.sort(a_TLK, axis=-1) == np.sort(b_TLK, axis=-1)).all(axis=-1)
    return eq & comparable(a_TLK, b_TLK)


def comparable(a_TLK: np.ndarray, b_TLK: np.ndarray) -> np.ndarray:
    """bool [T, L]: token-layers that both captures recorded (no ``NO_EXPERT`` in either)."""
    return (a_TLK != NO_EXPERT).all(axis=-1) & (b_TLK != NO_EXPERT).all(axis=-1)


def selection_scores(logits_NE: np.ndarray, *, scoring: str, correction_bias_E: np.ndarray | None = None) -> np.ndarray:
    """float64 [N, E]: the scores a router ranks experts by, from its raw logits.

    ``scoring``: ``"softmax"`` (Qwen3-MoE, Mixtral, OLMoE: the softmax of the logits) or
    ``"sigmoid"`` (DeepSeek-V3: the sigmoid of the logits plus ``correction_bias_E``, the
    ``e_score_correction_bias`` it selects by but does not weight by).
    """
    x = logits_NE.astype(np.float64)
    if scoring == "softmax":
        x = np.exp(x - x.max(axis=-1, keepdims=True))
        return x / x.sum(axis=-1, keepdims=True)
    if scoring == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-x))
        return s + (0.0 if correction_bias_E is None else correction_bias_E.astype(np.float64))
    raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")


def router_margins(scores_NE: np.ndarray, *, top_k: int, num_groups: int = 1, topk_groups: int = 1) -> np.ndarray:
    """float64 [N]: each row's margin, the smallest change of one score that would change the top-k set.

    Without groups (``num_groups`` 1): the k-th highest score minus the (k+1)-th. With DeepSeek-V3's
    group-limited routing (experts in ``num_groups`` equal groups, a group scored by the sum of its
    two highest scores, only the ``topk_groups`` best groups eligible): the smaller of the expert
    margin within the eligible groups and the group margin (the last chosen group's score minus the
    best left-out group's).
    """
    N, E = scores_NE.shape
    if num_groups <= 1:
        part = -np.partition(-scores_NE, (top_k - 1, top_k), axis=-1)
        return part[:, top_k - 1] - part[:, top_k]
    grouped = scores_NE.reshape(N, num_groups, E // num_groups)
    group_NG = -np.sort(-grouped, axis=-1)[:, :, :2].sum(axis=-1)
    order_NG = np.argsort(-group_NG, axis=-1, kind="stable")
    g_sorted = np.take_along_axis(group_NG, order_NG, axis=-1)
    group_margin = g_sorted[:, topk_groups - 1] - g_sorted[:, topk_groups]
    eligible = np.zeros((N, num_groups), dtype=bool)
    np.put_along_axis(eligible, order_NG[:, :topk_groups], True, axis=-1)
    masked = np.where(np.repeat(eligible, E // num_groups, axis=-1), scores_NE, -np.inf)
    part = -np.partition(-masked, (top_k - 1, top_k), axis=-1)
    expert_margin = part[:, top_k - 1] - part[:, top_k]
    return np.minimum(expert_margin, group_margin)


@dataclass(frozen=True, kw_only=True)
class StageAgreement:
    """Agreement of two captures over one stage's token-layers."""

    stage: str  # "prefill" or "decode"
    num_token_layers: int  # token-layers both captures recorded
    num_agree: int  # of those, the ones whose top-k sets are equal
    margin_quantiles_agree: dict[str, float]  # relative margin (margin / k-th score) at p1, p10, p50
    margin_quantiles_disagree: dict[str, float]  # the same over the disagreeing token-layers
    disagree_within_bf16: float  # share of disagreements whose relative margin < 2**-8 (bf16 resolution)
    agree_above_bf16: float  # agreement among token-layers whose relative margin >= 2**-8

    @property
    def share(self) -> float:
        return self.num_agree / self.num_token_layers if self.num_token_layers else float("nan")

    def to_json(self) -> dict[str, object]:
        return {
            "stage": self.stage,
            "num_token_layers": self.num_token_layers,
            "num_agree": self.num_agree,
            "share": self.share,
            "margin_quantiles_agree": self.margin_quantiles_agree,
            "margin_quantiles_disagree": self.margin_quantiles_disagree,
            "disagree_within_bf16": self.disagree_within_bf16,
            "agree_above_bf16": self.agree_above_bf16,
        }


def _quantiles(x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {}
    return {f"p{q}": float(np.quantile(x, q / 100)) for q in (1, 10, 50, 90)}


def stage_agreement(stage: str, equal_N: np.ndarray, rel_margin_N: np.ndarray) -> StageAgreement:
    """Summarise one stage: ``equal_N`` (bool) whether the sets agreed, ``rel_margin_N`` (float) the
    relative margin of the reference capture, over the N comparable token-layers of the stage."""
    agree, disagree = rel_margin_N[equal_N], rel_margin_N[~equal_N]
    above = rel_margin_N >= BF16_RELATIVE_RESOLUTION
    return StageAgreement(
        stage=stage,
        num_token_layers=int(equal_N.size),
        num_agree=int(equal_N.sum()),
        margin_quantiles_agree=_quantiles(agree),
        margin_quantiles_disagree=_quantiles(disagree),
        disagree_within_bf16=float((disagree < BF16_RELATIVE_RESOLUTION).mean()) if disagree.size else float("nan"),
        agree_above_bf16=float(equal_N[above].mean()) if above.any() else float("nan"),
    )
