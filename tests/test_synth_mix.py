"""moetrace synth --mix: unequal dataset shares, exact quotas spread over the ids, recorded in the manifest."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from factories import SHORT, small_model
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ConfigError
from moetrace.tracer.synth import (
    SynthKnobs,
    SynthPlan,
    dataset_assignment,
    generate_in_memory,
    parse_mix,
    synthesize,
)
from moetrace.tracer.synth_stats import counts_from_chunks, counts_from_trace
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.validate import find_problems

MIX = {"gsm8k": 0.6, "mbpp": 0.2, "humaneval": 0.1, "xsum": 0.1}


def mix_plan(num_requests: int, *, mix: dict[str, float] | None = MIX, **kw) -> SynthPlan:
    names = tuple(mix) if mix is not None else tuple(MIX)
    return SynthPlan(
        datasets=names,
        num_requests=num_requests,
        seed=kw.pop("seed", 0),
        knobs=SynthKnobs.from_dict({"lengths": SHORT}),
        mix=tuple(mix.values()) if mix is not None else None,
        **kw,
    )


def prefix_deviation(ds_R: np.ndarray, shares: np.ndarray) -> float:
    """Largest |requests of d among the first n ids - n * share[d]| over every n and d."""
    seen_RD = np.cumsum(np.eye(shares.size, dtype=np.int64)[ds_R], axis=0)
    return float(np.abs(seen_RD - np.arange(1, ds_R.size + 1)[:, None] * shares).max())


def test_mix_is_realised_within_one_request_in_every_prefix_of_the_ids():
    w = np.array(list(MIX.values()))
    assert mix_plan(103).requests_per_dataset() == (62, 21, 10, 10)  # of 61.8, 20.6, 10.3, 10.3
    assert mix_plan(10000).requests_per_dataset() == (6000, 2000, 1000, 1000)
    for R in (1, 3, 7, 103, 1000):
        plan = mix_plan(R)
        ds_R = dataset_assignment(plan)
        assert tuple(np.bincount(ds_R, minlength=4)) == plan.requests_per_dataset()
        # not in blocks: the first n ids hold n * share of each dataset, within 1 - 1/(2D - 2)
        assert prefix_deviation(ds_R, w) <= 5 / 6 + 1e-9
    # request i's dataset does not depend on how many requests follow
    np.testing.assert_array_equal(dataset_assignment(mix_plan(1000))[:103], dataset_assignment(mix_plan(103)))
    # the generated requests carry that assignment, chunk by chunk
    chunks = list(generate_in_memory(small_model(L=1, E=8, K=2), mix_plan(150, num_chunk_requests=16)))
    np.testing.assert_array_equal(np.concatenate([c.dataset_R for c in chunks]), dataset_assignment(mix_plan(150)))


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.floats(0.001, 1.0), min_size=2, max_size=9),
    num_requests=st.integers(1, 400),
)
def test_any_mix_stays_within_the_chairman_bound(weights, num_requests):
    shares = np.array(weights) / sum(weights)
    D = shares.size
    plan = SynthPlan(
        datasets=tuple(f"d{i}" for i in range(D)),
        num_requests=num_requests,
        seed=0,
        knobs=SynthKnobs(),
        mix=tuple(shares),
    )
    assert prefix_deviation(dataset_assignment(plan), np.array(plan.shares())) <= 1 - 1 / (2 * D - 2) + 1e-9


def test_equal_shares_are_round_robin_and_no_mix_is_unchanged():
    for D in (1, 2, 3, 7):
        names = tuple(f"d{i}" for i in range(D))
        for R in (1, 5, 64, 101):
            even = SynthPlan(datasets=names, num_requests=R, seed=0, knobs=SynthKnobs(), mix=(1 / D,) * D)
            rr = np.arange(R) % D
            np.testing.assert_array_equal(dataset_assignment(even), rr)
            np.testing.assert_array_equal(
                dataset_assignment(SynthPlan(datasets=names, num_requests=R, seed=0, knobs=SynthKnobs())), rr
            )
    # an even mix generates the very trace of no mix
    m = small_model(L=2, E=16, K=2)
    a = list(generate_in_memory(m, mix_plan(23, mix=None, num_chunk_requests=8)))
    b = list(generate_in_memory(m, mix_plan(23, mix=dict.fromkeys(MIX, 0.25), num_chunk_requests=8)))
    for x, y in zip(a, b, strict=True):
        for f in x._fields:
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f))


def test_mix_trace_is_identical_across_workers_and_records_the_mix(tmp_path):
    model = small_model(L=2, E=16, K=2)
    plan = mix_plan(45, seed=3, num_chunk_requests=8)
    synthesize(tmp_path / "w1", model=model, plan=plan, workers=1)
    synthesize(tmp_path / "w2", model=model, plan=plan, workers=2)
    assert find_problems(tmp_path / "w1") == []
    for sub in ("routing", "requests"):
        f1, f2 = sorted((tmp_path / "w1" / sub).glob("*.parquet")), sorted((tmp_path / "w2" / sub).glob("*.parquet"))
        assert [f.name for f in f1] == [f.name for f in f2]
        assert all(a.read_bytes() == b.read_bytes() for a, b in zip(f1, f2))

    tr = open_trace(tmp_path / "w1")
    coll = tr.manifest["collection"]
    assert coll["dataset_assignment"] == "mix" and coll["datasets"] == list(MIX)
    assert coll["mix"] == pytest.approx(MIX)
    assert coll["requests_per_dataset"] == {"gsm8k": 27, "mbpp": 9, "humaneval": 5, "xsum": 4}
    req = tr.requests().select("request_id", "dataset").collect()
    assert Counter(req["dataset"].to_list()) == coll["requests_per_dataset"]
    by_id = dict(zip(req["request_id"].to_list(), req["dataset"].to_list()))
    assert [by_id[i] for i in range(45)] == [list(MIX)[d] for d in dataset_assignment(plan)]
    # synth_stats reads each request's dataset from the trace, not from its id
    c_trace, names = counts_from_trace(tmp_path / "w1")
    c_mem = counts_from_chunks(generate_in_memory(model, plan), num_datasets=4, L=2, K=2, E=16)
    np.testing.assert_array_equal(c_trace, c_mem[[list(MIX).index(n) for n in names]])

    even = mix_plan(10, mix=None)  # no mix: round robin, 1/D each, recorded the same way
    even_coll = even.collection(model)
    assert even_coll["dataset_assignment"] == "round_robin"
    assert even_coll["mix"] == dict.fromkeys(MIX, 0.25)
    assert even_coll["requests_per_dataset"] == {"gsm8k": 3, "mbpp": 3, "humaneval": 2, "xsum": 2}


def test_bad_mixes_are_refused_with_the_fix():
    def plan(*shares: float) -> SynthPlan:
        return SynthPlan(datasets=("a", "b"), num_requests=4, seed=0, knobs=SynthKnobs(), mix=shares)

    with pytest.raises(ConfigError, match="one per dataset"):
        plan(1.0)
    for bad in (0.0, -0.2, float("nan")):
        with pytest.raises(ConfigError, match=r"> 0.*drop it from the datasets"):
            plan(1.0, bad)
    with pytest.raises(ConfigError, match="sum to 1.1"):
        plan(0.6, 0.5)
    assert sum(plan(0.7, 0.3 + 4e-7).shares()) == pytest.approx(1.0, abs=1e-15)  # close to 1: divided by the sum

    assert parse_mix("gsm8k=0.6, mbpp=0.4") == (("gsm8k", "mbpp"), (0.6, 0.4))
    assert parse_mix("gsm8k=0.6,mbpp=0.4", datasets=("mbpp", "gsm8k")) == (("mbpp", "gsm8k"), (0.4, 0.6))
    for text, message in [
        ("", "empty"),
        ("gsm8k", "not NAME=SHARE"),
        ("=0.5,a=0.5", "not NAME=SHARE"),
        ("gsm8k=abc,mbpp=0.4", "gsm8k=abc: the share is not a number"),
        ("gsm8k=0.5,gsm8k=0.5", "names gsm8k twice"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_mix(text)
    with pytest.raises(
        ConfigError, match="--datasets names math, --mix does not; --mix names xsum, --datasets does not"
    ):
        parse_mix("gsm8k=0.5,xsum=0.5", datasets=("gsm8k", "math"))


def test_cli_mix(tmp_path):
    runner = CliRunner()
    out = tmp_path / "t"
    args = ["synth", "-o", str(out), "--model", "olmoe-1b-7b-tiny", "-n", "20", "--workers", "1", "--quiet"]
    mix = "gsm8k=0.6,mbpp=0.2,humaneval=0.1,xsum=0.1"
    r = runner.invoke(app, [*args, "--mix", mix])
    assert r.exit_code == 0, r.output
    assert "mix gsm8k 12 (60%), mbpp 4 (20%), humaneval 2 (10%), xsum 2 (10%)" in r.output
    coll = json.loads((out / "manifest.json").read_text())["collection"]
    assert coll["datasets"] == list(MIX) and coll["requests_per_dataset"] == {
        "gsm8k": 12,
        "mbpp": 4,
        "humaneval": 2,
        "xsum": 2,
    }
    # --datasets may come too when it names the same datasets; its order is kept
    r = runner.invoke(app, [*args, "--overwrite", "--mix", mix, "--datasets", "xsum,gsm8k,mbpp,humaneval"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["collection"]["datasets"] == [
        "xsum",
        "gsm8k",
        "mbpp",
        "humaneval",
    ]
    for bad, message in [
        ("gsm8k=0.6,mbpp=x", "not a number"),
        ("gsm8k=0.6,gsm8k=0.4", "twice"),
        ("gsm8k=1,mbpp=0", "drop it from the datasets"),
        ("gsm8k=0.6,mbpp=0.6", "sum to 1.2"),
    ]:
        r = runner.invoke(app, [*args, "--overwrite", "--mix", bad])
        assert r.exit_code == 2 and message in r.output, r.output
    r = runner.invoke(app, [*args, "--overwrite", "--mix", "gsm8k=0.5,mbpp=0.5", "--datasets", "gsm8k,math"])
    assert r.exit_code == 2 and "drop --datasets" in r.output, r.output
