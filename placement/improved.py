"""moetrace's improved placer: the group-membership problem solved exactly, then load-aware GPUs.

The core paper's phase 1 is greedy. What the simulator measures (inter-node volume with requests
routed to their group) is, to first order, the usage mass a group finds on its own node: every
routed (token, expert) pair whose expert is not on the token's node crosses the network. Maximizing
``sum_g sum_e usage[g, e] * member[g, e]`` subject to exactly J slots per group and every expert in
at least one group is a bipartite b-matching with a coverage constraint; its constraint matrix is
totally unimodular, so the LP optimum (HiGHS) is integral and optimal. Ties are broken towards
experts with more overall load via a tiny perturbation, so the solution is deterministic. GPUs
inside a node are then filled as in the data placer (balanced packing of expected load).

Shape legend (docs/architecture.md): G node groups (= nodes), L MoE layers, E logical experts,
P physical slots, J slots of one node group (P / G).

Out of scope: clustering requests (``grouping``); second-order effects (two experts of one token on
the same remote GPU cost one copy, not two).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from moetrace._deps import require
from moetrace.placement.data_placement import check_usage, place_members, verify_members
from moetrace.placement.grouping import available_cores
from moetrace.placement.maps import Placement

__all__ = ["LPOutcome", "fixed_constraint_lp", "improved_placement", "optimal_members"]

#: the most threads ``optimal_members`` solves layers on (HiGHS runs one LP per thread, outside the GIL)
_MAX_LP_THREADS = 8


def optimal_members(usage_GLE: np.ndarray, *, num_slots: int) -> np.ndarray:
    """Membership ``member_LGE`` (bool [L, G, E]) maximizing group-local usage, J per group.

    One LP per layer, the layers side by side on the cores this process may run on (HiGHS releases
    the GIL while it solves; each layer's LP is solved whole by one thread, with a model of its own,
    so the answer does not depend on the number of threads).
    """
    G, L, E, J = check_usage(np.asarray(usage_GLE), num_slots, 1)
    sparse = require("scipy.sparse", purpose="the improved placer's exact assignment")
    u = np.transpose(np.asarray(usage_GLE, dtype=np.float64), (1, 0, 2))  # [L, G, E]
    # constraints over x[g, e] (flattened g-major): sum_e x = J per group; -sum_g x <= -1 per expert
    gi = np.repeat(np.arange(G), E)
    ei = np.tile(np.arange(E), G)
    A_eq = sparse.csr_matrix((np.ones(G * E), (gi, np.arange(G * E))), shape=(G, G * E))
    A_ub = sparse.csr_matrix((-np.ones(G * E), (ei, np.arange(G * E))), shape=(E, G * E))

    def solve_layers(layers: range) -> list[LPOutcome]:
        # one model per thread, the costs changed per layer (the constraints are the same for every layer)
        solve = fixed_constraint_lp(A_ub, -np.ones(E), A_eq, np.full(G, J), bounds=(0, 1), method="highs-ds")
        out = []
        for l in layers:
            scale = max(u[l].max(), 1.0)
            tie = 1e-6 * (u[l].sum(0) / scale)[None, :] * np.ones((G, 1))  # prefer heavy experts on ties
            out.append(solve(-(u[l] / scale + tie).reshape(-1)))
        return out

    workers = min(available_cores(), _MAX_LP_THREADS, L)
    if workers <= 1:
        solved = solve_layers(range(L))
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:  # layer l on thread l % workers
            parts = list(pool.map(solve_layers, [range(k, L, workers) for k in range(workers)]))
        solved = [parts[l % workers][l // workers] for l in range(L)]
    member = np.zeros((L, G, E), dtype=bool)
    for l, res in enumerate(solved):
        if res.status != 0 or res.x is None:
            raise AssertionError(f"layer {l}: assignment LP failed ({res.message})")
        x = res.x.reshape(G, E)
        if np.abs(x - np.round(x)).max() > 1e-6:
            raise AssertionError(f"layer {l}: assignment LP returned a fractional vertex")
        member[l] = x > 0.5
    verify_members(member, J)
    return member


def improved_placement(usage_GLE: np.ndarray, *, num_slots: int, ranks_per_group: int) -> Placement:
    """Exact group membership + balanced GPUs; group g owns slots [g*J, (g+1)*J).

    ``usage_GLE``: float [G, L, E] decode tokens per group, layer and expert (training requests).
    """
    return place_members(usage_GLE, optimal_members, num_slots=num_slots, ranks_per_group=ranks_per_group)


class LPOutcome(NamedTuple):
    """One solve of a ``fixed_constraint_lp``: what the callers read of ``scipy.optimize.linprog``'s result."""

    status: int  # linprog's status (0: optimal)
    message: str  # linprog's message
    x: np.ndarray | None  # float64 [n] the solution (None unless solved)
    ineqlin_marginals: np.ndarray | None  # float64 [m_ub] duals of the inequality rows (None unless solved)


def fixed_constraint_lp(
    A_ub: Any, b_ub: np.ndarray, A_eq: Any, b_eq: np.ndarray, *, bounds: tuple[float, float], method: str
) -> Callable[[np.ndarray], LPOutcome]:
    """``solve(c)``: ``scipy.optimize.linprog(c, A_ub, b_ub, A_eq, b_eq, bounds, method)`` for many
    cost vectors ``c`` (float [n]) over the same constraints, with the same answer bit for bit.

    ``linprog`` re-validates and re-stacks the constraints on every call, and reads the bound duals
    back one column at a time in Python: on the placers' LPs (2,048 columns, 10 ms in HiGHS) that
    doubled each solve. Here the HiGHS model (the matrix ``linprog`` stacks, its row and column bounds)
    and options (set as ``linprog`` sets them) are built once; each solve hands HiGHS a fresh solver
    with the same options and the model with its new costs (no warm start, so each solve is the
    solve ``linprog`` runs), and checks the result as ``linprog`` does. Where scipy's HiGHS module has
    another layout (scipy before 1.15) or a solve does not end optimal (the error path, with
    ``linprog``'s own message), ``linprog`` itself answers. Not thread-safe: one caller at a time.
    """
    optimize = require("scipy.optimize", purpose="the placers' exact LPs")

    def by_linprog(c: np.ndarray) -> LPOutcome:
        res = optimize.linprog(c, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=b_eq, bounds=bounds, method=method)
        marg = None if res.x is None else np.asarray(res.ineqlin.marginals, dtype=np.float64)
        return LPOutcome(int(res.status), str(res.message), res.x, marg)

    try:
        fast = _highs_model(A_ub, b_ub, A_eq, b_eq, bounds=bounds, method=method)
    except (ImportError, AttributeError, TypeError):  # another scipy: its private HiGHS module differs
        return by_linprog
    core, util, model, rhs, options, to_scipy, tol, clean = fast
    m_ub = len(clean.b_ub)

    def solve(c: np.ndarray) -> LPOutcome:
        try:
            return fast_solve(c)
        except (AttributeError, TypeError):  # a scipy whose private HiGHS calls changed shape: its public linprog
            return by_linprog(c)

    def fast_solve(c: np.ndarray) -> LPOutcome:
        cost = np.array(c, dtype=np.float64, copy=True).squeeze()
        if cost.shape != (model.num_col_,) or not np.isfinite(cost).all():
            return by_linprog(c)  # linprog's own error
        highs = core._Highs()
        if highs.passOptions(options) == core.HighsStatus.kError:
            return by_linprog(c)
        model.col_cost_ = cost
        if highs.passModel(model) == core.HighsStatus.kError or highs.run() == core.HighsStatus.kError:
            return by_linprog(c)
        model_status = highs.getModelStatus()
        if model_status != core.HighsModelStatus.kOptimal:
            return by_linprog(c)
        solution = highs.getSolution()
        info = highs.getInfo()
        status, message = to_scipy(model_status, highs.modelStatusToString(model_status))
        x = np.array(solution.col_value)
        slack_all = rhs - np.asarray(solution.row_value)
        status, message = util._check_result(
            x,
            info.objective_function_value,
            status,
            np.array(slack_all[:m_ub]),
            np.array(slack_all[m_ub:]),
            clean.bounds,
            tol,
            message,
            None,
        )
        return LPOutcome(int(status), str(message), x, np.array(np.asarray(solution.row_dual)[:m_ub]))

    return solve


def _highs_model(A_ub: Any, b_ub: np.ndarray, A_eq: Any, b_eq: np.ndarray, *, bounds: Any, method: str) -> tuple:
    """What ``linprog`` (scipy 1.15+) hands HiGHS for these constraints, built as it builds them:
    ``(core, util, model, rhs, options, to_scipy, tol, cleaned problem)``; ``AttributeError`` / ``ImportError``
    on another scipy."""
    import warnings

    from scipy.optimize import _linprog_highs as lh
    from scipy.optimize import _linprog_util as util
    from scipy.optimize._highspy import _core as core
    from scipy.optimize._highspy import _highs_options as hopt
    from scipy.optimize._highspy._highs_wrapper import check_option
    from scipy.sparse import csc_array, issparse, vstack

    solver = {"highs-ipm": "ipm", "highs-ds": "simplex", "highs": None}[method]
    n = A_ub.shape[1] if A_ub is not None else A_eq.shape[1]
    lp = util._LPProblem(np.zeros(n), A_ub, b_ub, A_eq, b_eq, bounds, None, None)
    clean, solver_options = util._parse_linprog(lp, None, method)
    if solver_options:
        raise AttributeError("options this path does not replicate")
    tol = 1e-9  # linprog's default
    _, A_ub_c, b_ub_c, A_eq_c, b_eq_c, bounds_c, _, _ = clean
    lb, ub = bounds_c.T.copy()
    with np.errstate(invalid="ignore"):
        lhs_ub = -np.ones_like(b_ub_c) * np.inf
    lhs = np.concatenate((lhs_ub, b_eq_c))
    rhs = np.concatenate((b_ub_c, b_eq_c))
    A = csc_array(vstack((A_ub_c, A_eq_c)) if issparse(A_ub_c) or issparse(A_eq_c) else np.vstack((A_ub_c, A_eq_c)))
    rhs, lhs, lb, ub = (lh._replace_inf(v) for v in (rhs, lhs, lb, ub))
    model = core.HighsLp()
    model.num_col_ = n
    model.num_row_ = rhs.size
    model.a_matrix_.num_col_ = n
    model.a_matrix_.num_row_ = rhs.size
    model.a_matrix_.format_ = core.MatrixFormat.kColwise
    model.col_lower_ = lb
    model.col_upper_ = ub
    model.row_lower_ = lhs
    model.row_upper_ = rhs
    model.a_matrix_.start_ = A.indptr
    model.a_matrix_.index_ = A.indices
    model.a_matrix_.value_ = A.data
    # the options as linprog passes them (_linprog_highs), set as its wrapper sets them (_highs_wrapper)
    wanted = {
        "presolve": True,
        "solver": solver,
        "highs_debug_level": lh.HighsDebugLevel.kHighsDebugLevelNone,
        "log_to_console": False,
        "output_flag": False,
        "simplex_strategy": lh.s_c.SimplexStrategy.kSimplexStrategyDual,
    }
    options = core.HighsOptions()
    probe = core._Highs()
    manager = hopt.HighsOptionsManager()
    for key, val in wanted.items():
        if val is None:
            continue
        opt_type = manager.get_option_type(key)
        if opt_type == -1:
            raise AttributeError(f"HiGHS has no option {key}")
        if key == "presolve":
            val = "on" if val else "off"
        status, _ = check_option(probe, key, val)
        if core.HighsOptionType(opt_type) == core.HighsOptionType.kBool and not isinstance(val, bool):
            raise AttributeError(f"option {key} is not set as linprog sets it")
        if status != 0:
            warnings.warn(f"HiGHS refused option {key}={val!r}", stacklevel=3)
            continue
        setattr(options, key, val)
    return core, util, model, rhs, options, lh._highs_to_scipy_status_message, tol, clean
