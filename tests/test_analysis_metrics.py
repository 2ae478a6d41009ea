"""Ground truth: each analysis on a trace whose structure was planted, against the planted numbers."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from factories import profile_trace, stage_mask, tiny_model, write_trace
from hypothesis import given
from hypothesis import strategies as st

from moetrace.analysis.affinity import affinity_table, coactivation_lift_LEE, pair_counts
from moetrace.analysis.classify import classify_layers
from moetrace.analysis.correlation import (
    dataset_correlation,
    prefill_decode_per_request,
    prefill_decode_pooled,
    prefill_decode_recall,
    topk_sets,
)
from moetrace.analysis.counts import count_trace
from moetrace.analysis.embedding import cluster_scores, request_features
from moetrace.analysis.imbalance import batch_imbalance_table, expert_load_table, imbalance_table


# ---------------------------------------------------------------------------------- imbalance
@pytest.fixture(scope="module")
def skew_counts(tmp_path_factory):
    """E=4, K=1, 2 layers; 10 requests of `a` then 10 of `b`, 4 prompt + 4 output tokens each.
    a, layer 0: every token on expert 0. b, layer 0: position p -> expert p % 2.
    Layer 1 (both): position p -> expert p % 4. The final generated token is unrouted (-1)."""
    R, P, O, E = 20, 4, 4, 4
    pos = np.tile(np.arange(P + O), R)
    is_a = np.repeat(np.arange(R) < 10, P + O)
    ids = np.empty((R * (P + O), 2, 1), np.int16)
    ids[:, 0, 0] = np.where(is_a, 0, pos % 2)
    ids[:, 1, 0] = pos % 4
    ids[pos == P + O - 1] = -1
    path = write_trace(
        tmp_path_factory.mktemp("skew") / "t",
        model=tiny_model(num_layers=2, num_experts=E, top_k=1),
        dataset_R=["a"] * 10 + ["b"] * 10,
        prompt_tokens_R=np.full(R, P),
        output_tokens_R=np.full(R, O),
        topk_ids_TLK=ids,
    )
    return count_trace(path)


def _if(df, dataset, stage, layer):
    return df.filter((pl.col("dataset") == dataset) & (pl.col("stage") == stage) & (pl.col("layer") == layer))[
        "imbalance_factor"
    ].item()


def test_imbalance_factor_matches_hand_computation(skew_counts):
    df = imbalance_table(skew_counts)
    assert _if(df, "a", "prefill", 0) == pytest.approx(4.0)  # all 40 tokens on one of 4 experts
    assert _if(df, "b", "prefill", 0) == pytest.approx(2.0)  # [20, 20, 0, 0] -> 20 / (40/4)
    assert _if(df, "all", "prefill", 0) == pytest.approx(3.0)  # [60, 20, 0, 0] -> 60 / 20
    assert _if(df, "a", "prefill", 1) == pytest.approx(1.0)  # exactly balanced
    # decode: positions 4, 5, 6 routed (7 is the unrouted final token) -> [10, 10, 10, 0] at layer 1
    assert _if(df, "a", "decode", 1) == pytest.approx(4 / 3)
    row = df.filter((pl.col("dataset") == "a") & (pl.col("stage") == "decode") & (pl.col("layer") == 1))
    assert row["tokens"].item() == 30


def test_expert_load_averages_to_one(skew_counts):
    load = expert_load_table(skew_counts)
    per_scope = load.group_by("dataset", "stage", "layer").agg(pl.col("load").mean())
    np.testing.assert_allclose(per_scope["load"].to_numpy(), 1.0)
    a0 = load.filter((pl.col("dataset") == "a") & (pl.col("stage") == "prefill") & (pl.col("layer") == 0)).sort(
        "expert"
    )
    assert a0["load"].to_list() == pytest.approx([4.0, 0, 0, 0])


def test_batch_imbalance_of_single_request_batches(skew_counts):
    bt = batch_imbalance_table(skew_counts, batch_size=1, seed=0)
    mixed = bt.filter((pl.col("dataset") == "all") & (pl.col("stage") == "prefill") & (pl.col("layer") == 0))
    assert mixed.height == 20
    assert sorted(mixed["imbalance_factor"].to_list()) == pytest.approx([2.0] * 10 + [4.0] * 10)
    # batches of 10 drawn only from dataset a: the same IF as the whole dataset
    bt10 = batch_imbalance_table(skew_counts, batch_size=10, seed=1)
    a = bt10.filter((pl.col("dataset") == "a") & (pl.col("stage") == "prefill") & (pl.col("layer") == 0))
    assert a["imbalance_factor"].to_list() == pytest.approx([4.0])
    # seeded: same seed, same batches
    assert bt.equals(batch_imbalance_table(skew_counts, batch_size=1, seed=0))


# ---------------------------------------------------------------------------------- correlation
def _mixing_trace(path, alpha, *, seed=0, E=16, L=2):
    rng = np.random.default_rng(42)  # the same profiles for every alpha
    p = np.exp(rng.normal(0, 1.2, size=(L, E)))
    q = np.exp(rng.normal(0, 1.2, size=(L, E)))
    p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
    prof = np.stack([p, alpha * p + (1 - alpha) * q])[None]  # [D=1, S, L, E]
    return profile_trace(
        path, profiles_DSLE=prof, requests_per_dataset=60, prompt_tokens=40, output_tokens=40, seed=seed
    )


def test_prefill_decode_correlation_tracks_the_planted_mixing(tmp_path):
    pooled, per_req = [], []
    for i, alpha in enumerate((0.0, 0.5, 1.0)):
        c = count_trace(_mixing_trace(tmp_path / f"m{i}", alpha))
        pooled.append(prefill_decode_pooled(c).filter(pl.col("dataset") == "ds0")["pearson"].mean())
        per_req.append(prefill_decode_per_request(c)[0].filter(pl.col("dataset") == "all")["pearson_mean"].mean())
    assert pooled[0] < pooled[1] < pooled[2]
    assert pooled[2] > 0.97  # identical distributions: only sampling noise left
    assert per_req[0] < per_req[1] < per_req[2]
    assert all(pr < po for pr, po in zip(per_req, pooled))  # a request's few tokens are noisier than the pool


def test_dataset_correlation_separates_disjoint_from_identical(tmp_path):
    E = 12
    prof = np.ones((3, 2, 1, E))
    prof[0, :, 0, :4] = 40  # ds0 and ds1 share hot experts 0-3, ds2 uses 8-11
    prof[1, :, 0, :4] = 40
    prof[2, :, 0, 8:] = 40
    c = count_trace(profile_trace(tmp_path / "t", profiles_DSLE=prof, requests_per_dataset=30))
    per_layer, mean = dataset_correlation(c)

    def get(a: str, b: str) -> float:
        return mean.filter((pl.col("stage") == "decode") & (pl.col("dataset_a") == a) & (pl.col("dataset_b") == b))[
            "pearson"
        ].item()

    assert get("ds0", "ds1") > 0.95
    assert get("ds0", "ds2") < 0
    assert get("ds2", "ds2") == pytest.approx(1.0)
    assert per_layer.height == 2 * 1 * 3 * 3


def test_recall_at_k_exact_on_planted_hot_sets(tmp_path):
    """Each request routes every token to its own k experts; decode keeps them (recall 1) or moves
    to the complementary set (recall 0)."""
    E, K, R, P, O = 8, 2, 12, 5, 5
    rng = np.random.default_rng(3)
    for keep, expected in ((True, 1.0), (False, 0.0)):
        hot = np.stack([rng.choice(E // 2, size=K, replace=False) for _ in range(R)])  # experts 0..3
        dec = np.stack([rng.choice(np.arange(E // 2, E), size=K, replace=False) for _ in range(R)])  # 4..7
        is_dec = stage_mask(np.full(R, P), np.full(R, O))
        req_T = np.repeat(np.arange(R), P + O)
        ids = np.where(is_dec[:, None] & (not keep), dec[req_T], hot[req_T])[:, None, :].astype(np.int16)
        path = write_trace(
            tmp_path / f"r{keep}",
            model=tiny_model(num_layers=1, num_experts=E, top_k=K),
            dataset_R=["x"] * R,
            prompt_tokens_R=np.full(R, P),
            output_tokens_R=np.full(R, O),
            topk_ids_TLK=ids,
        )
        rec = prefill_decode_recall(count_trace(path)).filter(pl.col("dataset") == "all")
        assert rec["recall"].item() == pytest.approx(expected)
        assert rec["num_requests"].item() == R
        if keep:
            assert rec["recall_popularity"].item() < 1.0  # one popular set cannot fit every request


def _topk_by_stable_sort(c, k):
    """The definition: the first k of a stable descending sort, counts > 0."""
    order = np.argsort(-c.astype(np.int64), axis=-1, kind="stable")[..., :k]
    sel = np.zeros(c.shape, dtype=bool)
    np.put_along_axis(sel, order, True, axis=-1)
    return sel & (c > 0)


@given(
    shape=st.tuples(st.integers(0, 4), st.integers(1, 3), st.integers(1, 40)),
    high=st.integers(1, 6),
    dtype=st.sampled_from([np.uint8, np.int16, np.uint16, np.int32, np.int64]),
    data=st.data(),
)
def test_topk_sets_equal_the_stable_sort(shape, high, dtype, data):
    """Ties (small counts) go to the lower expert id, zeros are never hot, as the sort's first k."""
    k = data.draw(st.integers(1, shape[-1]))
    seed = data.draw(st.integers(0, 2**32 - 1))
    c = np.random.default_rng(seed).integers(0, high, size=shape).astype(dtype)
    assert np.array_equal(topk_sets(c, k), _topk_by_stable_sort(c, k))


# ---------------------------------------------------------------------------------- classification and clusters
def _datasets_trace(path, *, separated, seed=0):
    E, L, D = 16, 2, 3
    prof = np.ones((D, 2, L, E))
    if separated:
        for d in range(D):
            prof[d, :, :, 5 * d : 5 * d + 5] = 8.0  # each dataset has its own 5 hot experts
    return profile_trace(
        path,
        profiles_DSLE=prof,
        requests_per_dataset=60,
        prompt_tokens=30,
        output_tokens=15,
        seed=seed,
        per_request_noise=0.3,
    )


@pytest.fixture(scope="module")
def separated(tmp_path_factory):
    return count_trace(_datasets_trace(tmp_path_factory.mktemp("sep") / "t", separated=True))


@pytest.fixture(scope="module")
def identical(tmp_path_factory):
    return count_trace(_datasets_trace(tmp_path_factory.mktemp("same") / "t", separated=False, seed=1))


def test_classifier_near_perfect_when_datasets_separate(separated):
    res = classify_layers(separated.stage("prefill"), separated.dataset_R, seed=0)
    assert res.chance == pytest.approx(1 / 3)
    assert res.num_test == 36 and res.num_train == 144  # 60 per dataset, 12 of each held out
    assert res.mean_accuracy >= 0.95
    assert res.mean_shuffled_accuracy < 0.6
    assert res.confusion_LDD.sum() == 2 * 36
    assert np.all(res.confusion_LDD.sum(axis=2) == 12)  # balanced test split: 12 true rows per dataset


def test_classifier_at_chance_when_datasets_are_identical(identical):
    res = classify_layers(identical.stage("prefill"), identical.dataset_R, seed=0)
    assert res.mean_accuracy < 0.6
    assert res.mean_shuffled_accuracy < 0.6


def test_cluster_scores_follow_separation(separated, identical):
    sep = cluster_scores(request_features(separated.stage("prefill")), separated.dataset_R, seed=0)
    same = cluster_scores(request_features(identical.stage("prefill")), identical.dataset_R, seed=0)
    assert sep.adjusted_rand > 0.9 and sep.silhouette > 0.2
    assert same.adjusted_rand < 0.1 and same.silhouette < 0.05


def test_request_features_are_unit_vectors(separated):
    x = request_features(separated.stage("decode"))
    assert x.shape == (180, 2 * 16)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-5)


# ---------------------------------------------------------------------------------- affinity
def _affinity_trace(path, p, *, seed=0, E=8, T=6000):
    """K=1, 2 layers: layer 0 uniform; layer 1 = perm(layer 0) with probability p, else uniform."""
    rng = np.random.default_rng(seed)
    perm = np.roll(np.arange(E), 3)
    a = rng.integers(0, E, size=T)
    b = np.where(rng.random(T) < p, perm[a], rng.integers(0, E, size=T))
    R = T // 20
    return write_trace(
        path,
        model=tiny_model(num_layers=2, num_experts=E, top_k=1),
        dataset_R=["x"] * R,
        prompt_tokens_R=np.full(R, 10),
        output_tokens_R=np.full(R, 10),
        topk_ids_TLK=np.stack([a, b], axis=1)[:, :, None].astype(np.int16),
    )


def test_cross_layer_affinity_tracks_its_knob(tmp_path):
    u, top1 = [], []
    for i, p in enumerate((0.0, 0.3, 0.6, 1.0)):
        aff = affinity_table(pair_counts(_affinity_trace(tmp_path / f"a{i}", p)))
        u.append(aff["uncertainty_coefficient"].item())
        top1.append(aff["top1_predictability"].item())
    assert u[0] < 0.01  # independent layers: only the plug-in estimator's small bias
    assert u[0] < u[1] < u[2] < u[3]
    assert u[3] == pytest.approx(1.0)  # layer 1 is a function of layer 0
    assert top1[3] == pytest.approx(1.0)


def test_affinity_token_sample_is_seeded_and_capped(tmp_path):
    path = _affinity_trace(tmp_path / "a", 0.5)
    pc = pair_counts(path, max_tokens=1000, seed=7)
    assert 800 < pc.num_sampled < 1200 and pc.num_tokens == 6000
    assert pc.cross_LEE.sum() == pc.num_sampled
    assert np.array_equal(pc.cross_LEE, pair_counts(path, max_tokens=1000, seed=7).cross_LEE)


def test_coactivation_finds_the_planted_pair(tmp_path):
    rng = np.random.default_rng(0)
    E, T = 8, 4000
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :2]
    glued = rng.random(T) < 0.4
    ids[glued] = [2, 5]  # experts 2 and 5 fire together far more often than chance
    R = T // 20
    path = write_trace(
        tmp_path / "c",
        model=tiny_model(num_layers=1, num_experts=E, top_k=2),
        dataset_R=["x"] * R,
        prompt_tokens_R=np.full(R, 10),
        output_tokens_R=np.full(R, 10),
        topk_ids_TLK=ids[:, None, :].astype(np.int16),
    )
    pc = pair_counts(path)
    lift = coactivation_lift_LEE(pc)[0]
    assert np.nanargmax(lift) in (2 * E + 5, 5 * E + 2)
    assert pc.co_LEE[0, 2, 5] == pc.co_LEE[0, 5, 2] == int(((ids == 2).any(1) & (ids == 5).any(1)).sum())
    assert np.all(np.diag(pc.co_LEE[0]) == 0)


def _pair_counts_reference(ids_TLK: np.ndarray, keep_T: np.ndarray, E: int):
    """The definitions of the affinity module, written out token by token (no kernel)."""
    T, L, K = ids_TLK.shape
    cross = np.zeros((max(L - 1, 0), E, E), np.int64)
    co = np.zeros((L, E, E), np.int64)
    single = np.zeros((L, E), np.int64)
    tokens = np.zeros(L, np.int64)
    for t in np.flatnonzero(keep_T):
        for l in range(L):
            ids = [int(a) for a in ids_TLK[t, l] if 0 <= a < E]
            tokens[l] += bool(ids)
            for i, a in enumerate(ids):
                single[l, a] += 1
                for b in ids[i + 1 :]:
                    if b != a:
                        co[l, a, b] += 1
                        co[l, b, a] += 1
                if l + 1 < L:
                    for b in ids_TLK[t, l + 1]:
                        if 0 <= b < E:
                            cross[l, a, b] += 1
    return cross, co, single, tokens


@pytest.mark.parametrize("L", [1, 2, 5])
def test_pair_kernel_equals_the_reference(L):
    """The numba kernel (layer outer, token inner) counts exactly what the definitions say, with -1 ids,
    unrouted tokens and a token sample."""
    from moetrace.analysis.affinity import _run, pair_counts_arrays

    rng = np.random.default_rng(L)
    T, K, E = 300, 3, 7
    ids = rng.integers(-1, E, size=(T, L, K)).astype(np.int16)
    ids[::17] = -1  # whole tokens unrouted
    keep = rng.random(T) < 0.6
    want = _pair_counts_reference(ids, keep, E)
    got = tuple(np.zeros_like(w) for w in want)
    _run(np.ascontiguousarray(ids.reshape(T, L * K)), keep, K, *got)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and np.array_equal(g, w)
    everything = pair_counts_arrays(ids, num_experts=E)
    for g, w in zip(everything, _pair_counts_reference(ids, np.ones(T, bool), E), strict=True):
        assert np.array_equal(g, w)
