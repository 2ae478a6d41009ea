"""moetrace synth: exact top-k sampling, each knob moving its statistic, determinism, valid output."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable

import numpy as np
import pyarrow.parquet as pq
import pytest
from factories import SHORT, small_model
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ConfigError
from moetrace.tracer.presets import model_info_for
from moetrace.tracer.synth import (
    DEFAULT_DOMAINS,
    PAPER_DATASETS,
    SynthKnobs,
    SynthPlan,
    _make_sampler,
    alias_tables,
    generate_chunk,
    generate_in_memory,
    load_calibration,
    load_truth,
    plant_truth,
    synthesize,
)
from moetrace.tracer.synth_stats import (
    cluster_separation,
    counts_from_chunks,
    counts_from_trace,
    dataset_correlation,
    domain_correlation,
    imbalance_factor,
    measure_plan,
    next_layer_predictability,
    prefill_decode_correlation,
    request_vectors,
    top_share,
)
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import ModelInfo
from moetrace.tracer.trace.validate import find_problems


def plan_for(num_requests: int = 280, seed: int = 0, **knobs) -> SynthPlan:
    return SynthPlan(
        datasets=PAPER_DATASETS,
        num_requests=num_requests,
        seed=seed,
        knobs=SynthKnobs.from_dict({"lengths": SHORT, **knobs}),
    )


def chunks_of(model: ModelInfo, plan: SynthPlan) -> list:
    return list(generate_in_memory(model, plan))


def counts(model: ModelInfo, plan: SynthPlan) -> np.ndarray:
    return counts_from_chunks(
        chunks_of(model, plan),
        num_datasets=len(plan.datasets),
        L=model.num_moe_layers,
        K=model.top_k,
        E=model.num_experts,
    )


# ---------------------------------------------------------------- exact sampling without replacement


def plackett_luce_inclusion(p: np.ndarray, K: int) -> np.ndarray:
    """P(expert e among the K chosen) under sequential sampling without replacement, by enumeration."""
    incl = np.zeros(p.size)
    for seq in itertools.permutations(range(p.size), K):
        prob, left = 1.0, 1.0
        for e in seq:
            prob *= p[e] / left
            left -= p[e]
        incl[list(seq)] += prob
    return incl


@pytest.mark.parametrize(("E", "K", "zipf"), [(6, 3, 1.0), (8, 6, 5.0)])
def test_topk_matches_plackett_luce(E, K, zipf):
    # (8, 6, zipf 5) leaves little mass for the last slots: most rows go through the exact finish
    model = small_model(L=1, E=E, K=K)
    plan = SynthPlan(
        datasets=("a",),
        num_requests=64,
        seed=1,
        knobs=SynthKnobs(
            zipf_exponent=zipf,
            layer_skew_spread=0.0,
            request_spread=0.0,
            layer_affinity=0.0,
            lengths={"a": {"prompt_median": 1200, "prompt_sigma": 0.0, "output_median": 2, "output_sigma": 0.0}},
        ),
    )
    truth = plant_truth(model, plan)
    ch = generate_chunk(_make_sampler(model, plan, truth), 0)
    prefill = ch.topk_ids_TX[np.concatenate([np.arange(s, s + 1200) for s in range(0, ch.topk_ids_TX.shape[0], 1202)])]
    assert all(len(set(row)) == K for row in prefill[:2000].tolist())
    freq = np.bincount(prefill.reshape(-1), minlength=E) / prefill.shape[0]
    expected = plackett_luce_inclusion(truth.prefill_DLE[0, 0], K)
    n = prefill.shape[0]
    assert np.all(np.abs(freq - expected) < 5 * np.sqrt(expected * (1 - expected) / n) + 1e-3)


def test_alias_tables_reproduce_distribution():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(40, 0.3), size=5)
    p[0, :10] = 0.0
    p[0] /= p[0].sum()
    thr, alias = alias_tables(p)
    back = thr.copy()
    for n in range(p.shape[0]):
        np.add.at(back[n], alias[n].astype(int), 1.0 - thr[n])
    np.testing.assert_allclose(back / p.shape[1], p, atol=1e-12)


@settings(max_examples=12, deadline=None)
@given(
    E=st.sampled_from([3, 8, 20, 64]),
    K=st.integers(1, 4),
    zipf=st.floats(0.0, 3.0),
    spread=st.floats(0.0, 1.0),
    affinity=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_every_row_has_k_distinct_valid_experts(E, K, zipf, spread, affinity, seed):
    K = min(K, E)
    model = small_model(L=3, E=E, K=K)
    plan = SynthPlan(
        datasets=("gsm8k", "xsum"),
        num_requests=6,
        seed=seed,
        num_chunk_requests=4,
        knobs=SynthKnobs(zipf_exponent=zipf, request_spread=spread, layer_affinity=affinity, lengths=SHORT),
    )
    for ch in generate_in_memory(model, plan):
        ids = ch.topk_ids_TX.reshape(-1, 3, K)
        ends = np.cumsum(ch.prompt_tokens_R.astype(np.int64) + ch.output_tokens_R) - 1
        assert (ids[ends] == -1).all()  # the final generated token is never forwarded
        rest = np.delete(ids, ends, axis=0)
        assert rest.min() >= 0 and rest.max() < E
        s = np.sort(rest, axis=2)
        assert (np.diff(s, axis=2) > 0).all()  # K distinct per (token, layer)


# ---------------------------------------------------------------- each knob moves its statistic


def test_skew_raises_imbalance_factor():
    m = small_model()
    low = imbalance_factor(counts(m, plan_for(zipf_exponent=0.4)).sum(axis=1)).mean()
    high = imbalance_factor(counts(m, plan_for(zipf_exponent=1.6)).sum(axis=1)).mean()
    assert low < 1.6 < high, (low, high)
    # a Zipf-Mandelbrot offset flattens the head of the profiles: a lower IF at the same exponent
    offset = imbalance_factor(counts(m, plan_for(zipf_exponent=1.6, zipf_offset=4.0)).sum(axis=1)).mean()
    assert offset < 0.8 * high, (offset, high)


def test_dataset_skew_multiplier_is_per_dataset():
    m = small_model()
    c = counts(m, plan_for(zipf_exponent=0.8, dataset_skew={"gsm8k": 2.5, "lmsys-chat": 0.3}))
    if_D = imbalance_factor(c.sum(axis=1)).mean(axis=1)
    d = {name: if_D[i] for i, name in enumerate(PAPER_DATASETS)}
    assert d["gsm8k"] > d["math"] > d["lmsys-chat"]


@pytest.mark.parametrize(("pd_mix", "lo", "hi"), [(0.0, -0.25, 0.25), (1.0, 0.95, 1.0)])
def test_pd_mix_sets_prefill_decode_correlation(pd_mix, lo, hi):
    m = small_model()
    r = np.nanmean(prefill_decode_correlation(counts(m, plan_for(pd_mix=pd_mix))))
    assert lo < r <= hi, r


def test_pd_mix_is_monotone():
    m = small_model()
    rs = [np.nanmean(prefill_decode_correlation(counts(m, plan_for(pd_mix=x)))) for x in (0.2, 0.5, 0.8)]
    assert rs[0] < rs[1] < rs[2], rs


def test_layer_affinity_raises_next_layer_predictability():
    m = small_model(L=4, E=32, K=2)

    def predictability(a: float) -> float:
        ids = np.concatenate([c.topk_ids_TX for c in chunks_of(m, plan_for(layer_affinity=a))]).reshape(-1, 4, 2)
        return float(next_layer_predictability(ids, E=32).mean())

    p0, p5, p9 = predictability(0.0), predictability(0.5), predictability(0.9)
    assert p0 < p5 < p9, (p0, p5, p9)
    assert p9 > 0.8


def test_request_spread_makes_clusters_less_separable():
    m = small_model()

    def separation(v: float) -> float:
        vec, lab = request_vectors(chunks_of(m, plan_for(request_spread=v)), L=4, K=4, E=32, stage=1)
        return cluster_separation(vec, lab)

    tight, loose = separation(0.05), separation(0.8)
    assert tight > 2 * loose, (tight, loose)


def test_domains_share_experts():
    m = small_model()
    corr = np.nanmean(dataset_correlation(counts(m, plan_for(domain_weight=0.6, shared_weight=0.0))), axis=0)
    i = {d: n for n, d in enumerate(PAPER_DATASETS)}
    assert corr[i["gsm8k"], i["math"]] > 0.3 + corr[i["gsm8k"], i["mbpp"]]
    assert corr[i["mbpp"], i["humaneval"]] > 0.3 + corr[i["mbpp"], i["xsum"]]
    assert corr[i["xsum"], i["tldr"]] > 0.3 + corr[i["xsum"], i["lmsys-chat"]]
    # experts shared by every dataset raise cross-domain correlation
    shared = np.nanmean(dataset_correlation(counts(m, plan_for(domain_weight=0.2, shared_weight=0.7))), axis=0)
    assert shared[i["gsm8k"], i["mbpp"]] > corr[i["gsm8k"], i["mbpp"]] + 0.3


def test_lengths_follow_their_dataset():
    m = small_model(L=1, E=8, K=2)
    plan = SynthPlan(datasets=("xsum", "math"), num_requests=400, seed=0, knobs=SynthKnobs())
    ch = chunks_of(m, plan)
    ds = np.concatenate([c.dataset_R for c in ch])
    prompt = np.concatenate([c.prompt_tokens_R for c in ch])
    output = np.concatenate([c.output_tokens_R for c in ch])
    assert np.median(prompt[ds == 0]) == pytest.approx(520, rel=0.15)
    assert np.median(output[ds == 1]) == pytest.approx(450, rel=0.2)
    assert prompt.min() >= 1 and output.min() >= 2


# ---------------------------------------------------------------- the written trace


def test_trace_is_valid_deterministic_across_workers_and_carries_its_truth(tmp_path):
    model = model_info_for("deepseek-v3-tiny")
    plan = SynthPlan(
        datasets=("gsm8k", "mbpp", "xsum"),
        num_requests=40,
        seed=7,
        num_chunk_requests=8,
        knobs=SynthKnobs.from_dict({"lengths": SHORT}, base=load_calibration("deepseek-v3")),
        calibration="deepseek-v3",
    )
    s1 = synthesize(tmp_path / "w1", model=model, plan=plan, workers=1)
    s2 = synthesize(tmp_path / "w2", model=model, plan=plan, workers=2)
    assert find_problems(tmp_path / "w1") == [] and find_problems(tmp_path / "w2") == []
    assert s1.num_requests == 40 and s1.num_tokens == s2.num_tokens
    for sub in ("routing", "requests"):
        f1, f2 = sorted((tmp_path / "w1" / sub).glob("*.parquet")), sorted((tmp_path / "w2" / sub).glob("*.parquet"))
        assert [f.name for f in f1] == [f.name for f in f2]
        for a, b in zip(f1, f2):
            assert pq.read_table(a).equals(pq.read_table(b))
            assert a.read_bytes() == b.read_bytes()

    tr = open_trace(tmp_path / "w1")
    assert tr.manifest["backend"]["name"] == "synthetic"
    coll = tr.manifest["collection"]
    assert coll["seed"] == 7 and coll["datasets"] == ["gsm8k", "mbpp", "xsum"] and coll["calibration"] == "deepseek-v3"
    assert SynthKnobs.from_dict(coll["knobs"]) == plan.knobs  # the planted recipe round-trips
    truth, ds = load_truth(tmp_path / "w1")
    assert ds == plan.datasets
    np.testing.assert_array_equal(truth.decode_DLE, plant_truth(model, plan).decode_DLE)
    # the trace's counts agree with the in-memory generator
    c_trace, names = counts_from_trace(tmp_path / "w1")
    c_mem = counts_from_chunks(generate_in_memory(model, plan), num_datasets=3, L=58, K=8, E=256)
    np.testing.assert_array_equal(c_trace, c_mem[[plan.datasets.index(n) for n in names]])


def test_different_seeds_differ_same_seed_repeats():
    m = small_model()
    a = np.concatenate([c.topk_ids_TX for c in chunks_of(m, plan_for(num_requests=20, seed=1))])
    b = np.concatenate([c.topk_ids_TX for c in chunks_of(m, plan_for(num_requests=20, seed=1))])
    c = np.concatenate([c.topk_ids_TX for c in chunks_of(m, plan_for(num_requests=20, seed=2))])
    assert np.array_equal(a, b)
    assert a.shape != c.shape or not np.array_equal(a, c)


# ---------------------------------------------------------------- configuration errors and the CLI


def test_bad_knobs_are_named():
    with pytest.raises(ConfigError, match="pd_mx"):
        SynthKnobs.from_dict({"pd_mx": 0.3})
    with pytest.raises(ConfigError, match="pd_mix"):
        SynthKnobs(pd_mix=1.5)
    with pytest.raises(ConfigError, match="shared_weight"):
        SynthKnobs(shared_weight=0.7, domain_weight=0.6)
    with pytest.raises(ConfigError, match="repeat"):
        SynthPlan(datasets=("a", "a"), num_requests=1, seed=0, knobs=SynthKnobs())


def test_cli_synth_writes_a_valid_trace_and_reports_errors(tmp_path):
    runner = CliRunner()
    out = tmp_path / "t"
    args = ["synth", "-o", str(out), "--model", "mixtral-8x7b-tiny", "-n", "30", "--seed", "3", "--workers", "1"]
    r = runner.invoke(app, [*args, "--datasets", "gsm8k,mydata", "--knobs", '{"pd_mix": 0.9}'])
    assert r.exit_code == 0, r.output
    assert "30 requests" in r.output and "calibration generic" in r.output
    assert find_problems(out) == []
    man = json.loads((out / "manifest.json").read_text())
    assert man["collection"]["knobs"]["pd_mix"] == 0.9 and man["collection"]["domains"]["mydata"] == "mydata"

    r = runner.invoke(app, args)  # exists, no --overwrite
    assert r.exit_code == 2 and "--overwrite" in r.output
    r = runner.invoke(app, [*args, "--overwrite", "--knobs", '{"pd_mx": 1}'])
    assert r.exit_code == 2 and "unknown synth knob" in r.output
    r = runner.invoke(app, [*args, "--overwrite", "--calibration", "nope"])
    assert r.exit_code == 2 and "unknown synth calibration" in r.output
    knob_file = tmp_path / "k.json"
    knob_file.write_text(json.dumps({"zipf_exponent": 1.3}))
    r = runner.invoke(app, [*args, "--overwrite", "--knobs", str(knob_file)])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["collection"]["knobs"]["zipf_exponent"] == 1.3


# ---------------------------------------------------------------- calibration presets


def group_limited_inclusion(p: np.ndarray, K: int, *, size: int, limit: int) -> np.ndarray:
    """P(expert e chosen) when a full Plackett-Luce order of all experts is scanned and an expert is
    kept if its group (``e // size``) is among the first ``limit`` groups met, until K are kept."""
    incl = np.zeros(p.size)
    for seq in itertools.permutations(range(p.size)):
        prob, left = 1.0, 1.0
        for e in seq:
            prob *= p[e] / left
            left -= p[e]
        groups: list[int] = []
        kept = []
        for e in seq:
            g = e // size
            if g not in groups and len(groups) < limit:
                groups.append(g)
            if g in groups:
                kept.append(e)
            if len(kept) == K:
                break
        incl[kept] += prob
    return incl


@pytest.mark.parametrize("zipf", [1.0, 4.0])
def test_group_limited_topk_law(zipf):
    # DeepSeek-V3-style router: 6 experts in 3 groups of 2, a token may use 2 groups, top-3;
    # zipf 4 leaves little mass outside the head, so many rows go through the exact finish
    model = dataclasses.replace(small_model(L=1, E=6, K=3), n_group=3, topk_group=2)
    plan = SynthPlan(
        datasets=("a",),
        num_requests=64,
        seed=2,
        knobs=SynthKnobs(
            zipf_exponent=zipf,
            layer_skew_spread=0.0,
            request_spread=0.0,
            layer_affinity=0.0,
            lengths={"a": {"prompt_median": 1200, "prompt_sigma": 0.0, "output_median": 2, "output_sigma": 0.0}},
        ),
    )
    truth = plant_truth(model, plan)
    ch = generate_chunk(_make_sampler(model, plan, truth), 0)
    prefill = ch.topk_ids_TX[np.concatenate([np.arange(s, s + 1200) for s in range(0, ch.topk_ids_TX.shape[0], 1202)])]
    assert all(len(set(row)) == 3 and len({e // 2 for e in row}) <= 2 for row in prefill.tolist())
    freq = np.bincount(prefill.reshape(-1), minlength=6) / prefill.shape[0]
    expected = group_limited_inclusion(truth.prefill_DLE[0, 0], 3, size=2, limit=2)
    n = prefill.shape[0]
    assert np.all(np.abs(freq - expected) < 5 * np.sqrt(expected * (1 - expected) / n) + 1e-3)


def test_deepseek_v3_tokens_stay_within_topk_group_groups():
    full = model_info_for("deepseek-v3")
    model = dataclasses.replace(full, moe_layers=full.moe_layers[:3])
    ids = np.concatenate([c.topk_ids_TX for c in chunks_of(model, plan_for(num_requests=40))]).reshape(-1, 3, 8)
    ids = ids[ids[:, 0, 0] >= 0]
    groups_used = np.array([[len({e // 32 for e in t}) for t in tok] for tok in ids.tolist()])
    assert groups_used.max() == 4 and (np.sort(ids, axis=2)[:, :, 1:] != np.sort(ids, axis=2)[:, :, :-1]).all()
    # without the limit 8 experts of 256 fall in 5 or more of 8 groups most of the time
    free = dataclasses.replace(model, n_group=None, topk_group=None)
    ids_free = np.concatenate([c.topk_ids_TX for c in chunks_of(free, plan_for(num_requests=40))]).reshape(-1, 3, 8)
    ids_free = ids_free[ids_free[:, 0, 0] >= 0]
    assert max(len({e // 32 for e in t}) for tok in ids_free.tolist() for t in tok) > 4


def _imb(dataset: str, key: str) -> Callable[[dict], float]:
    return lambda r: r["imbalance"][dataset][key]


def _corr(key: str) -> Callable[[dict], float]:
    return lambda r: r["dataset_correlation"]["decode"][key]


def _checks(name: str) -> list[tuple[str, Callable[[dict], float], float, float]]:
    """(statistic, how to read it from ``measure_plan``'s dict, low, high): docs/synth.md's Calibration table."""
    pd = {"deepseek-v3": 0.55, "qwen3-235b-a22b": 0.68, "llama4-maverick": 0.82}[name]
    common = [
        ("prefill-decode correlation", lambda r: r["pd_correlation"], pd - 0.07, pd + 0.07),
        ("within - cross domain correlation", lambda r: _corr("within")(r) - _corr("cross")(r), 0.15, 1.0),
    ]
    return (
        common
        + {
            "deepseek-v3": [
                (
                    "code top-1/8 share",
                    lambda r: (r["top_share"]["mbpp"] + r["top_share"]["humaneval"]) / 2,
                    0.34,
                    0.46,
                ),
                ("lmsys-chat IF p90", _imb("lmsys-chat", "p90"), 1.0, 10.0),
                ("within-domain correlation", _corr("within"), 0.5, 1.0),
                ("cross-domain correlation", _corr("cross"), -1.0, 0.2),
            ],
            "qwen3-235b-a22b": [
                ("IF p90, every dataset", lambda r: max(v["p90"] for v in r["imbalance"].values()), 1.0, 6.0),
                ("IF max, every dataset", lambda r: max(v["max"] for v in r["imbalance"].values()), 1.0, 10.0),
                ("cross-domain correlation", _corr("cross"), 0.4, 1.0),
            ],
            "llama4-maverick": [
                ("gsm8k IF max", _imb("gsm8k", "max"), 70.0, 128.0),
                ("lmsys-chat IF mean", _imb("lmsys-chat", "mean"), 8.0, 22.0),
                (
                    "gsm8k IF mean / lmsys-chat IF mean",
                    lambda r: _imb("gsm8k", "mean")(r) / _imb("lmsys-chat", "mean")(r),
                    2.0,
                    100.0,
                ),
                ("cross-domain correlation", _corr("cross"), 0.4, 1.0),
            ],
        }[name]
    )


@pytest.mark.parametrize(
    ("model_name", "num_layers", "num_requests"),
    [("deepseek-v3", 6, 350), ("qwen3-235b-a22b", 8, 210), ("llama4-maverick", 24, 350)],
)
def test_calibration_reproduces_published_figures(model_name, num_layers, num_requests):
    # every statistic is a mean or a quantile over layers: a few layers of the full width estimate it cheaply
    full = model_info_for(model_name)
    model = dataclasses.replace(full, moe_layers=full.moe_layers[:num_layers])
    plan = SynthPlan(datasets=PAPER_DATASETS, num_requests=num_requests, seed=0, knobs=load_calibration(model_name))
    r = measure_plan(model, plan)
    bad = [(what, round(get(r), 3), (lo, hi)) for what, get, lo, hi in _checks(model_name) if not lo <= get(r) <= hi]
    assert not bad, bad


def test_top_share_and_domain_correlation_definitions():
    c_E = np.array([40, 30, 10, 10, 5, 5, 0, 0])  # top 1/8 of 8 experts = the single most loaded one
    assert top_share(c_E) == pytest.approx(0.4)
    assert top_share(c_E, fraction=0.25) == pytest.approx(0.7)
    # datasets a, b share a domain and route alike; c routes the other way
    c_DSLE = np.zeros((3, 2, 1, 4), np.int64)
    c_DSLE[0, :, 0] = c_DSLE[1, :, 0] = [9, 5, 1, 1]
    c_DSLE[2, :, 0] = [1, 1, 5, 9]
    r = domain_correlation(c_DSLE, ("a", "b", "c"), {"a": "x", "b": "x"}, stage=1)
    assert r["within"] == pytest.approx(1.0) and r["cross"] < -0.5
    assert r["specialisation"] == pytest.approx(1.0 - (1.0 + 2 * r["cross"]) / 3)


# ---------------------------------------------------------------- the --structure none control


def test_structure_none_is_indistinguishable_across_datasets_and_keeps_imbalance():
    m = small_model()
    planted, none = plan_for(), dataclasses.replace(plan_for(), structure="none")
    truth = plant_truth(m, none)
    for arr in (truth.prefill_DLE, truth.decode_DLE, truth.skew_DL):
        assert (arr == arr[:1]).all()  # one profile (and skew) for every dataset
    c_none, c_planted = counts(m, none), counts(m, planted)
    for stage in (0, 1):
        s = domain_correlation(c_none, PAPER_DATASETS, DEFAULT_DOMAINS, stage=stage)
        assert s["specialisation"] < 0.06 and abs(s["within"] - s["cross"]) < 0.03, s
    assert domain_correlation(c_planted, PAPER_DATASETS, DEFAULT_DOMAINS, stage=1)["specialisation"] > 0.4
    # no request clusters: the Fisher ratio is at its no-structure level, (D - 1) / (R - D)
    vec, lab = request_vectors(chunks_of(m, none), L=4, K=4, E=32, stage=1)
    assert cluster_separation(vec, lab) < 2 * 6 / (280 - 7)
    # load imbalance is kept (about the planted level), not flattened away
    ratio = imbalance_factor(c_none).mean() / imbalance_factor(c_planted).mean()
    assert 0.7 < ratio < 1.6 and imbalance_factor(c_none).mean() > 1.5, ratio
    # the structure knobs do nothing in the control
    ignored = dataclasses.replace(
        none,
        knobs=SynthKnobs.from_dict(
            {"request_spread": 0.9, "layer_affinity": 0.9, "dataset_skew": {"gsm8k": 3.0}, "domains": {}},
            base=none.knobs,
        ),
    )
    a = np.concatenate([c.topk_ids_TX for c in chunks_of(m, none)])
    b = np.concatenate([c.topk_ids_TX for c in chunks_of(m, ignored)])
    np.testing.assert_array_equal(a, b)


def test_cli_structure_none_is_recorded_in_the_manifest(tmp_path):
    runner = CliRunner()
    out = tmp_path / "t"
    args = ["synth", "-o", str(out), "--model", "olmoe-1b-7b-tiny", "-n", "14", "--workers", "1", "--quiet"]
    r = runner.invoke(app, [*args, "--structure", "none"])
    assert r.exit_code == 0, r.output
    assert "structure none" in r.output and find_problems(out) == []
    coll = json.loads((out / "manifest.json").read_text())["collection"]
    assert coll["structure"] == "none"
    r = runner.invoke(app, [*args, "--overwrite", "--structure", "flat"])
    assert r.exit_code == 2
    with pytest.raises(ConfigError, match="structure"):
        SynthPlan(datasets=("a",), num_requests=1, seed=0, knobs=SynthKnobs(), structure="flat")
