"""compare's placements, made faster without changing an answer (docs/benchmarks.md, 2c): each shortcut's
answer equals the full computation's, bit for bit, on random and adversarial inputs.

- ``improved.fixed_constraint_lp`` (one HiGHS model, only the costs change) against ``scipy.optimize.linprog``
  on the placers' own LPs: the same status, message, solution and inequality duals;
- ``improved.optimal_members`` (its layers on several threads) against the one-layer-at-a-time linprog loop
  it replaced, on one thread and on several;
- ``joint.balanced_assign`` against its linprog form (assignment and prices);
- ``grouping._kmeans`` (BLAS on one thread) against scikit-learn's K-means with every thread: the same labels.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetrace.placement import improved
from moetrace.placement.improved import fixed_constraint_lp, optimal_members
from moetrace.placement.joint import balanced_assign, balanced_constraints

optimize = pytest.importorskip("scipy.optimize")
sparse = pytest.importorskip("scipy.sparse")


def _membership_lp(G: int, E: int, J: int) -> tuple:
    """``optimal_members``' constraints: sum_e x = J per group, every expert in at least one group."""
    gi = np.repeat(np.arange(G), E)
    ei = np.tile(np.arange(E), G)
    A_eq = sparse.csr_matrix((np.ones(G * E), (gi, np.arange(G * E))), shape=(G, G * E))
    A_ub = sparse.csr_matrix((-np.ones(G * E), (ei, np.arange(G * E))), shape=(E, G * E))
    return A_ub, -np.ones(E), A_eq, np.full(G, float(J))


def _linprog_members(usage_GLE: np.ndarray, *, num_slots: int) -> np.ndarray:
    """``optimal_members`` as it was: one ``linprog`` per layer, in order."""
    u = np.transpose(np.asarray(usage_GLE, dtype=np.float64), (1, 0, 2))
    L, G, E = u.shape
    A_ub, b_ub, A_eq, b_eq = _membership_lp(G, E, num_slots // G)
    member = np.zeros((L, G, E), dtype=bool)
    for l in range(L):
        scale = max(u[l].max(), 1.0)
        tie = 1e-6 * (u[l].sum(0) / scale)[None, :] * np.ones((G, 1))
        c = -(u[l] / scale + tie).reshape(-1)
        res = optimize.linprog(c, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=b_eq, bounds=(0, 1), method="highs-ds")
        assert res.status == 0
        member[l] = res.x.reshape(G, E) > 0.5
    return member


def _same(out: improved.LPOutcome, res: object) -> None:
    assert out.status == res.status  # type: ignore[attr-defined]
    assert out.message == res.message  # type: ignore[attr-defined]
    if res.x is None:  # type: ignore[attr-defined]
        assert out.x is None
        return
    assert out.x is not None and out.ineqlin_marginals is not None
    assert np.array_equal(out.x, res.x)  # type: ignore[attr-defined]
    assert np.array_equal(out.ineqlin_marginals, res.ineqlin.marginals)  # type: ignore[attr-defined]


#: cost vectors: continuous, few distinct values (ties everywhere), all equal, mostly zero with spikes
_COSTS = st.sampled_from(["uniform", "ties", "flat", "spiky"])


def _costs(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "uniform":
        return -rng.random(n)
    if kind == "ties":
        return -rng.integers(0, 3, n).astype(np.float64)
    if kind == "flat":
        return np.full(n, -1.0)
    c = np.zeros(n)
    c[rng.integers(0, n, max(1, n // 20))] = -rng.random(max(1, n // 20)) * 1e6
    return c


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(
    G=st.integers(1, 6),
    per=st.integers(1, 6),
    extra=st.integers(0, 3),
    method=st.sampled_from(["highs-ds", "highs-ipm", "highs"]),
    kind=_COSTS,
    seed=st.integers(0, 2**31),
)
def test_fixed_constraint_lp_is_linprog(G, per, extra, method, kind, seed):
    """The placers' membership LP (J = E/G + extra slots per group), several cost vectors on one model:
    every solve is linprog's, bit for bit, duals included."""
    rng = np.random.default_rng(seed)
    E = G * per
    A_ub, b_ub, A_eq, b_eq = _membership_lp(G, E, per + min(extra, E - per))
    solve = fixed_constraint_lp(A_ub, b_ub, A_eq, b_eq, bounds=(0, 1), method=method)
    for _ in range(3):
        c = _costs(kind, G * E, rng)
        ref = optimize.linprog(c, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=b_eq, bounds=(0, 1), method=method)
        _same(solve(c), ref)


def test_fixed_constraint_lp_infeasible_is_linprog():
    """An infeasible model (more slots asked than the columns hold): linprog's status and message."""
    A_ub, b_ub, A_eq, _ = _membership_lp(3, 4, 1)
    b_eq = np.full(3, 5.0)  # 5 experts per group of 4
    solve = fixed_constraint_lp(A_ub, b_ub, A_eq, b_eq, bounds=(0, 1), method="highs-ds")
    c = -np.arange(12.0)
    _same(solve(c), optimize.linprog(c, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=b_eq, bounds=(0, 1), method="highs-ds"))


def test_fixed_constraint_lp_falls_back_to_linprog(monkeypatch):
    """Where scipy's HiGHS module is laid out otherwise (scipy < 1.15), linprog answers."""

    def missing(*a, **k):
        raise ImportError("no _highspy._core")

    monkeypatch.setattr(improved, "_highs_model", missing)
    A_ub, b_ub, A_eq, b_eq = _membership_lp(2, 4, 2)
    c = -np.arange(8.0)
    solve = fixed_constraint_lp(A_ub, b_ub, A_eq, b_eq, bounds=(0, 1), method="highs-ds")
    _same(solve(c), optimize.linprog(c, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=b_eq, bounds=(0, 1), method="highs-ds"))


_USAGE = st.sampled_from(["counts", "zeros", "ties", "one_hot", "heavy_tail"])


def _usage(kind: str, G: int, L: int, E: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "counts":
        return rng.poisson(5.0, (G, L, E)).astype(np.float64)
    if kind == "zeros":  # experts no group used: every assignment of them ties
        u = rng.poisson(3.0, (G, L, E)).astype(np.float64)
        u[:, :, rng.random(E) < 0.5] = 0.0
        return u
    if kind == "ties":  # every group alike
        return np.repeat(rng.integers(0, 3, (1, L, E)).astype(np.float64), G, axis=0)
    if kind == "one_hot":  # each group wants the same few experts
        u = np.zeros((G, L, E))
        u[:, :, : max(1, E // 4)] = 7.0
        return u
    return rng.pareto(1.2, (G, L, E)) * 1e4


@settings(max_examples=20, suppress_health_check=[HealthCheck.too_slow])
@given(
    G=st.integers(1, 5),
    per=st.integers(1, 5),
    extra=st.integers(0, 2),
    L=st.integers(1, 7),
    kind=_USAGE,
    threads=st.sampled_from([1, 2, 3, 8]),
    seed=st.integers(0, 2**31),
)
def test_optimal_members_is_the_linprog_loop(G, per, extra, L, kind, threads, seed):
    """The layers on ``threads`` threads (as many cores as the process may use): the membership the
    one-layer-at-a-time linprog loop finds, ties and unused experts included."""
    rng = np.random.default_rng(seed)
    E = G * per
    num_slots = G * (per + min(extra, E - per))
    usage = _usage(kind, G, L, E, rng)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(improved, "available_cores", lambda: threads)
        member = optimal_members(usage, num_slots=num_slots)
    assert np.array_equal(member, _linprog_members(usage, num_slots=num_slots))


def _linprog_balanced(score_RG: np.ndarray, balance_slack: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """``balanced_assign`` as it was: one ``linprog`` (interior point) on the same constraints."""
    s = np.asarray(score_RG, dtype=np.float64)
    R, G = s.shape
    A_ub, b_ub, A_eq, b_eq = balanced_constraints(R, G, balance_slack=balance_slack)
    res = optimize.linprog(
        -s.reshape(-1), A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=b_eq, bounds=(0, 1), method="highs-ipm"
    )
    marg = -np.asarray(res.ineqlin.marginals, dtype=np.float64)
    return np.argmax(res.x.reshape(R, G), axis=1).astype(np.int64), marg[:G] - marg[G:]


@settings(max_examples=20, suppress_health_check=[HealthCheck.too_slow])
@given(
    R=st.integers(1, 60),
    G=st.integers(1, 6),
    kind=st.sampled_from(["uniform", "ties", "flat", "one_node"]),
    slack=st.sampled_from([0.0, 0.05, 0.5]),
    seed=st.integers(0, 2**31),
)
def test_balanced_assign_is_linprog(R, G, kind, slack, seed):
    """The balanced routing and its node prices: linprog's, bit for bit (ties, every request wanting one node)."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        s = rng.random((R, G))
    elif kind == "ties":
        s = rng.integers(0, 2, (R, G)).astype(np.float64)
    elif kind == "flat":
        s = np.full((R, G), 0.5)
    else:
        s = np.zeros((R, G))
        s[:, 0] = 1.0
    group, price = balanced_assign(s, balance_slack=slack)
    ref_group, ref_price = _linprog_balanced(s, slack)
    assert np.array_equal(group, ref_group)
    assert np.array_equal(price, ref_price)


@pytest.mark.filterwarnings("ignore:Number of distinct clusters")  # duplicate rows: fewer clusters than asked
@settings(max_examples=10, suppress_health_check=[HealthCheck.too_slow])
@given(
    R=st.integers(8, 120),
    F=st.integers(2, 300),
    C=st.integers(1, 6),
    kind=st.sampled_from(["counts", "duplicates", "sparse"]),
    seed=st.integers(0, 2**31),
)
def test_kmeans_labels_do_not_depend_on_blas_threads(R, F, C, kind, seed):
    """``_kmeans`` runs BLAS on one thread: the labels scikit-learn finds with every thread BLAS has."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    cluster = pytest.importorskip("sklearn.cluster")
    from moetrace.placement.grouping import _kmeans, available_cores, l2_normalize

    rng = np.random.default_rng(seed)
    if kind == "counts":
        x = rng.poisson(2.0, (R, F))
    elif kind == "duplicates":  # many identical rows: distance ties
        x = rng.poisson(2.0, (4, F))[rng.integers(0, 4, R)]
    else:
        x = rng.poisson(2.0, (R, F)) * (rng.random((R, F)) < 0.05)
    xn = l2_normalize(x)
    C = min(C, R)
    labels, _ = _kmeans(xn.copy(), C, seed % 1000)
    km = cluster.KMeans(n_clusters=C, n_init=4, random_state=seed % 1000, copy_x=False)
    with threadpoolctl.threadpool_limits(limits=max(available_cores(), 2)):
        km.fit(xn.copy())
    assert np.array_equal(labels, km.labels_.astype(np.int64))
