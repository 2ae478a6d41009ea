"""The random draws of ``moetrace synth``: the planted truth (``plant_truth``, from
``SeedSequence(seed, spawn_key=(0,))``; ``truth.npz`` written by ``save_truth``, read by ``load_truth``)
and the chunks of requests (``generate_chunk``: chunk ``c`` from ``SeedSequence(seed, spawn_key=(1, c))``):
prompt and output lengths, each request's favourite experts, and every layer's top-k sampled without
replacement from the token's mixture (packed Walker alias tables, ``alias_tables``; sequential rejection,
then an exact Gumbel-top-k; within the router's group limit when it has one). A chunk is a pure function
of (sampler, chunk index), whatever process draws it. The model itself (steps 1-4, the control):
:mod:`moetrace.tracer.synth`'s docstring.

Shape legend: R requests, T tokens, L MoE layers, K top-k, E experts, D datasets, S stages (prefill,
decode), N alias tables (= D*S*L), X = L*K (legend: docs/architecture.md).

Out of scope: the knobs, the plan and the dataset of each request id (``synth_plan``); worker processes
and writing the trace (``synth``); routing weights, token text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from moetrace.atomic import atomic_path
from moetrace.errors import ConfigError
from moetrace.tracer.synth_plan import TRUTH_FILE, SynthPlan, _num_fav, dataset_assignment
from moetrace.tracer.trace.schema import NO_EXPERT, ModelInfo

__all__ = [
    "PlantedTruth",
    "plant_truth",
    "save_truth",
    "load_truth",
    "alias_tables",
    "Chunk",
    "generate_chunk",
]


# ====================================================================== the planted truth


class PlantedTruth(NamedTuple):
    """The planted structure (``truth.npz`` in the trace directory).

    prefill_DLE, decode_DLE: float64 per-expert routing probability of a draw from the dataset
    profile (rows sum to 1); decode_specific_DLE: the stage-specific part of decode_DLE; skew_DL:
    the Zipf exponent of each (dataset, layer); affinity_map_LE: int16, expert at layer l+1 that an
    expert e at layer l leads to (row L-1 unused).
    """

    prefill_DLE: np.ndarray
    decode_DLE: np.ndarray
    decode_specific_DLE: np.ndarray
    skew_DL: np.ndarray
    affinity_map_LE: np.ndarray


def plant_truth(model: ModelInfo, plan: SynthPlan) -> PlantedTruth:
    """Draw the planted profiles and affinity maps from ``SeedSequence(seed, spawn_key=(0,))``.

    With ``plan.structure == "none"`` every dataset gets one and the same profile per stage: the
    profile a single dataset with skew multiplier 1 would get (shared, domain and dataset components
    drawn once), so the load imbalance of a dataset is kept but nothing distinguishes datasets; the
    decode profile keeps its ``pd_mix`` relation to the prefill one, and ``skew_DL`` rows are equal.
    """
    k = plan.knobs
    D, L, E = len(plan.datasets), model.num_moe_layers, model.num_experts
    rng = np.random.default_rng(np.random.SeedSequence(plan.seed, spawn_key=(0,)))
    zipf_E = -np.log(np.arange(1, E + 1, dtype=np.float64) + k.zipf_offset)

    def scores(n: int) -> np.ndarray:  # [n, L, E] Zipf scores over independent random permutations
        return zipf_E[rng.permuted(np.broadcast_to(np.arange(E), (n * L, E)), axis=1)].reshape(n, L, E)

    w_sh, w_dom = k.shared_weight, k.domain_weight
    w_ds = 1.0 - w_sh - w_dom
    if plan.structure == "none":  # one "dataset" and one "domain", broadcast to every dataset
        dom_names, dom_idx, ds_idx = ["all"], np.zeros(D, np.int64), np.zeros(D, np.int64)
        mult_D = np.ones(1)
    else:
        domains = [k.domains.get(d, d) for d in plan.datasets]
        dom_names = sorted(set(domains))
        dom_idx = np.array([dom_names.index(x) for x in domains])
        ds_idx = np.arange(D)
        mult_D = np.array([k.dataset_skew.get(d, 1.0) for d in plan.datasets])
    skew_DL = k.zipf_exponent * mult_D[:, None] * np.exp(k.layer_skew_spread * rng.standard_normal((mult_D.size, L)))
    skew_DL = skew_DL[ds_idx]
    profiles = []
    for _stage in range(2):  # 0: prefill, 1: decode-specific (independent draws)
        logit_DLE = w_sh * scores(1) + w_dom * scores(len(dom_names))[dom_idx] + w_ds * scores(ds_idx.max() + 1)[ds_idx]
        logit_DLE = skew_DL[:, :, None] * logit_DLE
        logit_DLE -= logit_DLE.max(axis=2, keepdims=True)
        p = np.exp(logit_DLE)
        profiles.append(p / p.sum(axis=2, keepdims=True))
    prefill_DLE, specific_DLE = profiles
    decode_DLE = k.pd_mix * prefill_DLE + (1.0 - k.pd_mix) * specific_DLE
    affinity_map_LE = rng.permuted(np.broadcast_to(np.arange(E), (L, E)), axis=1).astype(np.int16)
    return PlantedTruth(prefill_DLE, decode_DLE, specific_DLE, skew_DL, affinity_map_LE)


def save_truth(path: str | os.PathLike, truth: PlantedTruth, datasets: tuple[str, ...]) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:  # a file object: savez adds no ".npz" suffix
        np.savez_compressed(f, datasets=np.array(datasets), **truth._asdict())


def load_truth(trace_dir: str | os.PathLike) -> tuple[PlantedTruth, tuple[str, ...]]:
    """The planted truth of a synthetic trace and its dataset order."""
    with np.load(Path(trace_dir) / TRUTH_FILE) as z:
        return PlantedTruth(*(z[f] for f in PlantedTruth._fields)), tuple(str(x) for x in z["datasets"])


def alias_tables(p_NE: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker alias tables (Vose's construction) of N distributions over E outcomes.

    Returns ``threshold_NE`` float64 in [0, 1] (keep column c when a uniform draw is below it) and
    ``alias_NE`` int16 (the outcome taken otherwise; a column with threshold 1 is its own alias).
    Drawing a column uniformly and applying the test samples ``p`` exactly.
    """
    N, E = p_NE.shape
    scaled_NE = p_NE / p_NE.sum(axis=1, keepdims=True) * E
    thr_NE = np.ones((N, E))
    alias_NE = np.tile(np.arange(E, dtype=np.int16), (N, 1))
    for n in range(N):
        sc = scaled_NE[n].tolist()
        thr, alias = thr_NE[n], alias_NE[n]
        small = [e for e in range(E) if sc[e] < 1.0]
        large = [e for e in range(E) if sc[e] >= 1.0]
        while small and large:
            s_, l_ = small.pop(), large[-1]
            thr[s_] = sc[s_]
            alias[s_] = l_
            sc[l_] -= 1.0 - sc[s_]
            if sc[l_] < 1.0:
                small.append(large.pop())
        # leftovers are 1 up to rounding: keep them (threshold 1, own alias)
    return thr_NE, alias_NE


def _packed_alias(p_NE: np.ndarray) -> tuple[np.ndarray, int]:
    """Alias tables packed one uint32 per column: threshold in the top 32-b bits, alias in the low b bits.

    E is padded to 2**b columns of probability 0, so a column is the top b bits of a 32-bit draw and
    the threshold test uses the other 32-b bits (exact up to 2**-(32-b) per column).
    """
    N, E = p_NE.shape
    b = max(1, (E - 1).bit_length())
    if b > 15:
        raise ConfigError(f"synth supports up to 32768 experts, got {E}")
    padded = np.zeros((N, 1 << b))
    padded[:, :E] = p_NE
    thr, alias = alias_tables(padded)
    q = np.minimum(np.floor(thr * 2.0 ** (32 - b)), 2.0 ** (32 - b) - 1).astype(np.uint32)
    q[thr >= 1.0] = np.uint32(2 ** (32 - b) - 1)  # alias is itself: the test outcome does not matter
    return ((q << np.uint32(b)) | alias.astype(np.uint32)).reshape(-1), b


class Chunk(NamedTuple):
    """One generated chunk: R requests and their T tokens (``topk_ids_TX`` int16 ``[T, L*K]``)."""

    request_id_R: np.ndarray
    dataset_R: np.ndarray  # int index into plan.datasets
    prompt_tokens_R: np.ndarray
    output_tokens_R: np.ndarray
    topk_ids_TX: np.ndarray


@dataclass(frozen=True)
class _Sampler:
    """Everything a worker needs (picklable; built once per run)."""

    model: ModelInfo
    plan: SynthPlan
    p_NE: np.ndarray  # float64 profiles, N = (dataset*2 + stage)*L + layer (for the exact finish)
    packed: np.ndarray  # uint32 packed alias tables, flat: column c of table n at n * 2**bits + c
    bits: int  # log2 of the padded column count
    affinity_map_LE: np.ndarray  # int16
    dataset_R: np.ndarray  # int64 [num_requests]: dataset index of every request id (dataset_assignment)


def _make_sampler(model: ModelInfo, plan: SynthPlan, truth: PlantedTruth) -> _Sampler:
    p_NE = np.stack([truth.prefill_DLE, truth.decode_DLE], axis=1).reshape(-1, model.num_experts)
    packed, bits = _packed_alias(p_NE)
    return _Sampler(model, plan, p_NE, packed, bits, truth.affinity_map_LE, dataset_assignment(plan))


def _chunk_ids(plan: SynthPlan, c: int) -> np.ndarray:
    lo = c * plan.num_chunk_requests
    return np.arange(lo, min(lo + plan.num_chunk_requests, plan.num_requests), dtype=np.int64)


def _lengths(rng: np.random.Generator, plan: SynthPlan, dataset_R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    R = dataset_R.shape[0]
    prompt = np.empty(R, np.int32)
    output = np.empty(R, np.int32)
    z_R2 = rng.standard_normal((R, 2))
    for d, name in enumerate(plan.datasets):
        sel = dataset_R == d
        ld = plan.knobs.length_of(name)
        prompt[sel] = np.clip(np.rint(ld.prompt_median * np.exp(ld.prompt_sigma * z_R2[sel, 0])), 1, ld.max_prompt)
        output[sel] = np.clip(np.rint(ld.output_median * np.exp(ld.output_sigma * z_R2[sel, 1])), 2, ld.max_output)
    return prompt, output


def generate_chunk(s: _Sampler, c: int) -> Chunk:
    """Generate chunk ``c`` (request ids ``c*num_chunk_requests ...``); a pure function of (sampler, c)."""
    model, plan, k = s.model, s.plan, s.plan.knobs
    L, K, E = model.num_moe_layers, model.top_k, model.num_experts
    num_fav = _num_fav(k, model)
    rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence(plan.seed, spawn_key=(1, c))))
    rid_R = _chunk_ids(plan, c)
    R = rid_R.shape[0]
    ds_R = s.dataset_R[rid_R]
    prompt_R, output_R = _lengths(rng, plan, ds_R)
    len_R = prompt_R.astype(np.int64) + output_R
    T = int(len_R.sum())
    starts_R = np.concatenate([[0], np.cumsum(len_R)[:-1]])
    req_T = np.repeat(np.arange(R), len_R)
    decode_T = (np.arange(T) - np.repeat(starts_R, len_R)) >= np.repeat(prompt_R, len_R)
    cols = 1 << s.bits  # columns of one alias table
    tab_T = ((ds_R[req_T] * 2 + decode_T) * L) * cols  # + l*cols: offset of the token's alias table at layer l
    # each request's favourite experts per layer: int16 [R, L, num_fav], flattened
    planted = plan.structure == "planted"
    favs: np.ndarray
    if planted:
        favs = np.argpartition(rng.random((R, L, E), dtype=np.float32), num_fav - 1, axis=2)[:, :, :num_fav]
        favs = favs.astype(np.int16).reshape(-1)
    else:  # the control: no per-request favourites, no layer affinity
        favs = np.zeros(R * L * num_fav, np.int16)
    fav_T = req_T * (L * num_fav)  # + l*num_fav: offset of the token's favourites at layer l
    topk_ids_LKT = np.empty((L, K, T), np.int16)
    for l in range(L):
        a = k.layer_affinity if l > 0 and planted else 0.0
        fv = (1.0 - a) * k.request_spread if planted else 0.0
        mix = _Mix(
            tab_T=tab_T + l * cols,
            fav_T=fav_T + l * num_fav,
            fav=favs,
            num_fav=num_fav,
            follow_KT=s.affinity_map_LE[l - 1][topk_ids_LKT[l - 1]] if l > 0 else None,
            cut_aff=np.uint16(min(round(a * 2**16), 2**16 - 1)) if a < 1 else np.uint32(2**16),
            cut_fav=np.uint16(min(round((a + fv) * 2**16), 2**16 - 1)) if a + fv < 1 else np.uint32(2**16),
            w=(a, fv, 1.0 - a - fv),
        )
        _sample_topk(rng, s, mix, topk_ids_LKT[l], K=K, E=E)
    topk_ids_TLK = np.ascontiguousarray(topk_ids_LKT.transpose(2, 0, 1))
    topk_ids_TLK[starts_R + len_R - 1] = NO_EXPERT  # final generated token: never forwarded through the model
    return Chunk(rid_R, ds_R, prompt_R, output_R, topk_ids_TLK.reshape(T, L * K))


@dataclass
class _Mix:
    """The per-token candidate mixture at one layer."""

    tab_T: np.ndarray  # alias-table offset per token
    fav_T: np.ndarray  # favourites offset per token
    fav: np.ndarray  # int16 favourite experts, flat [R*L*num_fav]
    num_fav: int  # favourite experts per (request, layer)
    follow_KT: np.ndarray | None  # [K, T] int16: the planted followers of the token's layer l-1 experts
    cut_aff: np.integer  # 16-bit selector below -> follow
    cut_fav: np.integer  # 16-bit selector below (and >= cut_aff) -> favourite
    w: tuple[float, float, float]  # (follow, favourite, profile) weights


def _draw(
    rng: np.random.Generator, s: _Sampler, mix: _Mix, rows: np.ndarray | None, num_draws: int, K: int
) -> np.ndarray:
    """``[num_draws, n]`` int16 i.i.d. candidates from each token's mixture (rows: the n token indices, None = all).

    Per candidate, 32 random bits ``h`` pick the outcome inside a component: the alias column (top
    ``bits``) and its keep/alias test (the other bits), or a favourite/followed slot (top 16 bits,
    exact when num_fav and K divide 2**16); 16 more bits pick the component (weights in steps of 2**-16).
    """
    tab = mix.tab_T if rows is None else mix.tab_T[rows]
    n = tab.shape[0]
    mixed = mix.w[0] > 0 or mix.w[1] > 0
    m = num_draws * n
    size = m + (m + 1) // 2 if mixed else m
    u = rng.bit_generator.random_raw((size + 1) // 2).view(np.uint32)
    h = u[:m].reshape(num_draws, n)
    b = s.bits
    col = h >> np.uint32(32 - b)
    entry = s.packed[tab + col]
    keep = (h & np.uint32((1 << (32 - b)) - 1)) < (entry >> np.uint32(b))
    out = np.where(keep, col, entry & np.uint32((1 << b) - 1)).astype(np.int16)
    if not mixed:
        return out
    sel = u[m:].view(np.uint16)[:m].reshape(num_draws, n)
    h16 = h >> np.uint32(16)
    if mix.w[1] > 0:
        fi = (h16 * np.uint32(mix.num_fav)) >> np.uint32(16)
        fi = (mix.fav_T if rows is None else mix.fav_T[rows]) + fi
        np.copyto(out, mix.fav[fi], where=sel < mix.cut_fav)
    if mix.w[0] > 0:
        assert mix.follow_KT is not None  # the follow weight is 0 at layer 0, the one layer without followers
        follow = mix.follow_KT if rows is None else mix.follow_KT[:, rows]
        slot = (h16 * np.uint32(K)) >> np.uint32(16)
        fi = slot.astype(np.intp) * n + np.arange(n)
        np.copyto(out, follow.reshape(-1)[fi], where=sel < mix.cut_aff)
    return out


@dataclass
class _GroupLimit:
    """A group-limited router's state for the tokens being sampled (DeepSeek-V3's ``n_group``/``topk_group``)."""

    size: int  # experts per router group (num_experts / n_group); expert e is in group e // size
    limit: int  # groups one token may use (topk_group)
    mask_T: np.ndarray  # uint8/16/64 (by n_group), bit g set: the token already chose an expert of group g
    num_T: np.ndarray  # int8 groups the token uses so far

    def take(self, rows: np.ndarray) -> _GroupLimit:
        return _GroupLimit(self.size, self.limit, self.mask_T[rows], self.num_T[rows])

    def put(self, rows: np.ndarray, sub: _GroupLimit) -> None:
        self.mask_T[rows], self.num_T[rows] = sub.mask_T, sub.num_T

    def bits(self, c: np.ndarray) -> np.ndarray:
        """The group bit of every candidate in ``c`` (any shape), in ``mask_T``'s dtype."""
        one = self.mask_T.dtype.type(1)
        return np.left_shift(one, (c // self.size).astype(self.mask_T.dtype))

    def admit(self, c: np.ndarray, new: np.ndarray, bit: np.ndarray | None = None) -> None:
        """Clear ``new`` where candidate ``c`` would open a group past the limit; record the groups of
        the candidates that stay new (``bit``: ``bits(c)`` when already computed)."""
        bit = self.bits(c) if bit is None else bit
        seen = (self.mask_T & bit) != 0
        new &= seen | (self.num_T < self.limit)
        self.num_T += new & ~seen
        self.mask_T |= np.where(new, bit, self.mask_T.dtype.type(0))


def _accept(
    ch_KT: np.ndarray,
    nn_T: np.ndarray,
    candidates: np.ndarray,
    K: int,
    *,
    filled: int,
    groups: _GroupLimit | None = None,
) -> None:
    """Append each token's candidates (``[draws, T]``), in order, that are not yet chosen (and, under a
    group limit, whose group is among the token's first ``limit`` groups), until it holds K.

    ``ch_KT`` the chosen experts (-1 = empty slot), ``nn_T`` how many each token holds; ``filled``:
    an upper bound of ``nn_T`` on entry (slots at or above it are known to be empty).
    """
    bits = groups.bits(candidates) if groups is not None else None
    for i, c in enumerate(candidates):
        new = nn_T < K
        upto = min(filled, K)
        for slot in range(upto):
            new &= ch_KT[slot] != c
        if groups is not None:
            assert bits is not None  # computed whenever groups is set
            groups.admit(c, new, bits[i])
        for slot in range(min(upto + 1, K)):
            np.copyto(ch_KT[slot], c, where=new & (nn_T == slot))
        nn_T += new
        filled += 1


def _group_limit(model: ModelInfo, T: int) -> _GroupLimit | None:
    """The group limit of ``model``'s router for T tokens, or None when it routes without one."""
    if not model.group_limited:
        return None
    n_group, topk_group = model.n_group, model.topk_group
    assert n_group is not None and topk_group is not None  # group_limited implies both are set
    size = model.num_experts // n_group
    if n_group > 64 or topk_group * size < model.top_k:
        raise ConfigError(
            f"model {model.name!r}: n_group={n_group}, topk_group={topk_group} cannot hold "
            f"top_k={model.top_k} experts (or more than 64 groups); fix the model's router fields"
        )
    mask_dtype = np.uint8 if n_group <= 8 else np.uint16 if n_group <= 16 else np.uint64
    return _GroupLimit(size, topk_group, np.zeros(T, mask_dtype), np.zeros(T, np.int8))


def _sample_topk(rng: np.random.Generator, s: _Sampler, mix: _Mix, ch: np.ndarray, *, K: int, E: int) -> None:
    """Fill ``ch`` ``[K, T]`` int16 with K distinct experts per token, sampled without replacement
    (within the token's first ``topk_group`` groups when the model's router is group-limited)."""
    T = ch.shape[1]
    ch.fill(-1)
    nn = np.ones(T, np.int8)
    groups = _group_limit(s.model, T)
    cand = _draw(rng, s, mix, None, K + 2 if K > 1 else 1, K)
    ch[0] = cand[0]
    if groups is not None:
        groups.admit(cand[0], np.ones(T, dtype=bool))
    _accept(ch, nn, cand[1:], K, filled=1, groups=groups)
    rows = np.flatnonzero(nn < K)
    for _round in range(3):
        if rows.size == 0:
            return
        sub_ch, sub_nn = ch[:, rows], nn[rows]
        sub_g = groups.take(rows) if groups is not None else None
        # under a group limit most rows lack one or two experts: smaller rounds waste fewer draws
        _accept(sub_ch, sub_nn, _draw(rng, s, mix, rows, 2 * K if groups is None else K, K), K, filled=K, groups=sub_g)
        ch[:, rows], nn[rows] = sub_ch, sub_nn
        if groups is not None and sub_g is not None:  # sub_g is set exactly when groups is
            groups.put(rows, sub_g)
        rows = rows[sub_nn < K]
    if rows.size:
        _finish_exact(rng, s, mix, rows, ch, nn, K, E, groups=groups.take(rows) if groups is not None else None)


def _finish_exact(
    rng: np.random.Generator,
    s: _Sampler,
    mix: _Mix,
    rows: np.ndarray,
    ch: np.ndarray,
    nn: np.ndarray,
    K: int,
    E: int,
    *,
    groups: _GroupLimit | None = None,
) -> None:
    """Complete the remaining slots of ``rows`` by Gumbel-top-k over the dense mixture minus chosen
    experts (``groups``: the rows' group-limit state; experts of groups past the limit are skipped)."""
    n = rows.size
    w_aff, w_fav, w_tab = mix.w
    q = w_tab * s.p_NE[mix.tab_T[rows] >> s.bits]
    ar = np.arange(n)
    if w_fav > 0:
        fav = mix.fav[mix.fav_T[rows][:, None] + np.arange(mix.num_fav)]
        np.add.at(q, (np.repeat(ar, mix.num_fav), fav.reshape(-1)), w_fav / mix.num_fav)
    if w_aff > 0:
        assert mix.follow_KT is not None  # the follow weight is 0 at layer 0, the one layer without followers
        fol = mix.follow_KT[:, rows].T
        np.add.at(q, (np.repeat(ar, K), fol.reshape(-1)), w_aff / K)
    sub = ch[:, rows]
    for slot in range(K):
        have = sub[slot] >= 0
        q[ar[have], sub[slot][have]] = 0.0
    with np.errstate(divide="ignore"):
        key = np.log(q) - np.log(-np.log(rng.random((n, E))))
    order = np.argsort(-key, axis=1, kind="stable")
    sub_nn = nn[rows].astype(np.int64)
    for j in range(K if groups is None else E):  # chosen experts (key -inf) sort last
        need = sub_nn < K
        if not need.any():
            break
        if groups is not None:  # skip experts of groups past the limit (and chosen ones)
            need &= np.isfinite(key[ar, order[:, j]])
            groups.admit(order[:, j], need)
        sub[sub_nn[need], ar[need]] = order[need, j]
        sub_nn += need
    ch[:, rows] = sub
    nn[rows] = sub_nn
