"""Agreement of two captures and the router's margins (analysis/agreement.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from moetrace.analysis.agreement import (
    BF16_RELATIVE_RESOLUTION,
    router_margins,
    selection_scores,
    stage_agreement,
    topk_sets_equal,
)


def _topk_set(scores_E: np.ndarray, k: int, *, groups: int = 1, topk_groups: int = 1) -> frozenset[int]:
    """Top-k set by brute force: group-limited as DeepSeek-V3 (groups scored by their two best)."""
    E = scores_E.size
    allowed = np.ones(E, dtype=bool)
    if groups > 1:
        g = scores_E.reshape(groups, E // groups)
        gs = np.sort(g, axis=1)[:, -2:].sum(axis=1)
        keep = np.argsort(-gs, kind="stable")[:topk_groups]
        allowed = np.repeat(np.isin(np.arange(groups), keep), E // groups)
    masked = np.where(allowed, scores_E, -np.inf)
    return frozenset(np.argsort(-masked, kind="stable")[:k].tolist())


def test_sets_compare_without_order_and_unrecorded_rows_never_agree():
    a = np.array([[[1, 2, 3], [4, 5, 6]], [[0, 1, 2], [-1, -1, -1]]])
    b = np.array([[[3, 1, 2], [4, 5, 7]], [[2, 0, 1], [-1, -1, -1]]])
    assert topk_sets_equal(a, b).tolist() == [[True, False], [True, False]]


def test_margin_is_the_gap_between_the_kth_and_the_next_score():
    s = np.array([[0.5, 0.1, 0.3, 0.1]])
    assert router_margins(s, top_k=1)[0] == 0.5 - 0.3
    assert np.isclose(router_margins(s, top_k=2)[0], 0.3 - 0.1)
    assert router_margins(s, top_k=3)[0] == 0.0  # a tie at the edge: no margin at all


def test_group_margin_limits_a_wide_expert_margin():
    # 4 groups of 2; groups scored 1.0, 0.95, 0.2, 0.1: the second group wins by 0.75, the expert
    # margin inside the two eligible groups is small (0.5 vs 0.48)
    s = np.array([[0.5, 0.5, 0.48, 0.47, 0.1, 0.1, 0.05, 0.05]])
    m = router_margins(s, top_k=3, num_groups=4, topk_groups=2)[0]
    assert np.isclose(m, 0.48 - 0.47)
    # now the groups are close (0.96 vs 0.95) but the experts far apart
    s2 = np.array([[0.9, 0.06, 0.5, 0.45, 0.48, 0.47, 0.0, 0.0]])
    m2 = router_margins(s2, top_k=1, num_groups=4, topk_groups=2)[0]
    assert np.isclose(m2, (0.5 + 0.45) - (0.48 + 0.47))


@given(
    st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=8, max_size=8),
    st.integers(1, 3),
    st.sampled_from([(1, 1), (4, 2)]),
    st.integers(0, 7),
)
def test_a_change_smaller_than_the_margin_never_changes_the_set(values, k, grouping, which):
    groups, topk_groups = grouping
    s = np.array(values, dtype=np.float64)
    if len(set(values)) < 8:
        return  # ties make the brute-force order arbitrary
    m = router_margins(s[None], top_k=k, num_groups=groups, topk_groups=topk_groups)[0]
    base = _topk_set(s, k, groups=groups, topk_groups=topk_groups)
    for sign in (-1.0, 1.0):  # any one score moved by less than half the margin
        t = s.copy()
        t[which] += sign * 0.49 * m
        assert _topk_set(t, k, groups=groups, topk_groups=topk_groups) == base


def test_selection_scores_follow_each_router():
    logits = np.array([[0.0, np.log(3.0)]])
    assert np.allclose(selection_scores(logits, scoring="softmax"), [[0.25, 0.75]])
    sig = selection_scores(np.zeros((1, 2)), scoring="sigmoid", correction_bias_E=np.array([0.1, -0.1]))
    assert np.allclose(sig, [[0.6, 0.4]])


def test_stage_summary_explains_disagreements_by_margin():
    equal = np.array([True, True, True, False, False])
    rel = np.array([0.5, 0.1, 1e-4, 1e-4, 0.2])
    s = stage_agreement("prefill", equal, rel)
    assert (s.num_token_layers, s.num_agree, s.share) == (5, 3, 0.6)
    assert s.disagree_within_bf16 == 0.5  # one of the two disagreements is within bf16's resolution
    assert s.agree_above_bf16 == 2 / 3  # above it: 0.5 and 0.1 agree, 0.2 does not
    assert BF16_RELATIVE_RESOLUTION == 2.0**-8
    assert s.to_json()["share"] == 0.6
