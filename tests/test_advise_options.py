"""``moetrace advise`` on one statistics file, with EPLB's two policies, the step sizes, the engines'
replica rules, the rearrangement's stall and the EPLB summation (issue 36, item 3 and item 2's rest)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ConfigError
from moetrace.placement.advise import AdviseConfig, advise_profile_counts
from moetrace.placement.advise.options import eplb_option_placement
from moetrace.placement.advise.rearrange import Rearrangement
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.eplb_replicas import KNUTH, sglang_dispatch_map, slot_shares, vllm_slots
from moetrace.placement.maps import placement_from_phy2log
from moetrace.tracer.presets import model_info_for

DSV3 = model_info_for("deepseek-v3")
SMALL = dataclasses.replace(DSV3, moe_layers=tuple(DSV3.moe_layers[:4]))  # 4 MoE layers: seconds, not minutes
EP64 = parse_deployment("DP64TP1EP64", num_gpus_per_node=8)  # 8 nodes: 8 router groups, one per node
EP32 = parse_deployment("DP32TP1EP32", num_gpus_per_node=8)


def _stats(seed: int = 0) -> np.ndarray:
    """One window of decode counts [1, L, E], the hot experts inside router group 0 (experts 0-31)."""
    rng = np.random.default_rng(seed)
    w = rng.gamma(0.5, 1.0, size=(SMALL.num_moe_layers, SMALL.num_experts))
    w[:, :32] *= 8
    return np.round(w / w.sum(1, keepdims=True) * 2e6).astype(np.int64)[None]


def test_one_statistics_file_gets_an_answer_and_says_there_is_no_drift_estimate():
    adv = advise_profile_counts(SMALL, {"decode": _stats()}, AdviseConfig(deployment=EP64), source="stats")
    assert adv.manifest.verdicts[0].verdict == "enable"
    assert adv.manifest.drift_estimated is False and not adv.manifest.drift["decode"].estimated
    assert any(v.startswith("No drift estimate: the input has 1 window(s)") and "in-sample" in v for v in adv.verdicts)


def test_the_global_policy_is_offered_at_ep64_and_chosen_when_better():
    """Hot experts inside one router group: the hierarchical policy packs that group onto one node, the
    global one spreads its replicas; the verdict picks the global one and names the other's figure."""
    adv = advise_profile_counts(SMALL, {"decode": _stats()}, AdviseConfig(deployment=EP64), source="stats")
    rows = {r.option: r for r in adv.rows}
    assert {"eplb-64", "eplb_global-64"} <= set(rows)
    assert rows["eplb-64"].eplb_policy == "hierarchical" and rows["eplb_global-64"].eplb_policy == "global"
    assert rows["eplb_global-64"].balancedness_vllm > rows["eplb-64"].balancedness_vllm + 0.3
    first = adv.manifest.verdicts[0]
    assert first.option is not None and first.option.startswith("eplb_global-")
    assert "enable EPLB's global policy" in first.text and "Hierarchical policy at its best" in first.text


def test_one_node_evaluates_eplb_once_and_says_why():
    dep = parse_deployment("DP8TP1EP8", num_gpus_per_node=8)
    adv = advise_profile_counts(SMALL, {"decode": _stats()}, AdviseConfig(deployment=dep), source="stats")
    assert not any(r.strategy == "eplb_global" for r in adv.rows)
    assert {r.eplb_policy for r in adv.rows if r.strategy == "eplb"} == {"global"}
    assert any("hierarchical policy does not apply" in v for v in adv.verdicts)


def test_the_decode_step_size_changes_the_verdict():
    """At 4 tokens per GPU a synchronous rearrangement every 3000 steps does not pay back; at 128 it does."""
    small = advise_profile_counts(SMALL, {"decode": _stats()}, AdviseConfig(deployment=EP32), source="s")
    large = advise_profile_counts(
        SMALL, {"decode": _stats()}, AdviseConfig(deployment=EP32, decode_tokens_per_gpu=128), source="s"
    )
    a, b = small.manifest.verdicts[0], large.manifest.verdicts[0]
    assert a.info["rearrangement"]["worth_it"] is False and b.info["rearrangement"]["worth_it"] is True
    assert small.manifest.step_tokens_per_gpu == {"decode": 4, "prefill": 128}
    assert large.manifest.step_tokens_per_gpu == {"decode": 128, "prefill": 128}
    gain = {
        s: 1 - next(r for r in adv.rows if r.option == v.option).vs_ref("moe")
        for s, adv, v in (("a", small, a), ("b", large, b))
    }
    assert gain["b"] > gain["a"] + 0.2


def test_option_rows_read_both_times_by_measure():
    """``OptionRow``'s accessors read the MoE-layer or the all-to-all columns by ``Measure``; a row ranks
    by MoE-layer time when the experts' size is known; ``with_vs_ref`` changes that ratio only."""
    adv = advise_profile_counts(SMALL, {"decode": _stats()}, AdviseConfig(deployment=EP32), source="s")
    r = next(r for r in adv.rows if r.strategy == "eplb_global")
    assert r.measure == "moe" and r.vs_ref("moe") == r.moe_vs_ref and r.vs_ref("a2a") == r.a2a_vs_ref
    assert (r.vs_ref_p10("moe"), r.vs_ref_p90("moe")) == (r.moe_vs_ref_p10, r.moe_vs_ref_p90)
    assert (r.vs_ref_p10("a2a"), r.vs_ref_p90("a2a")) == (r.a2a_vs_ref_p10, r.a2a_vs_ref_p90)
    assert r.seconds_per_step("moe") == r.moe_seconds_per_step > r.seconds_per_step("a2a") == r.a2a_seconds_per_step
    w = r.with_vs_ref("a2a", 0.5)
    assert w.a2a_vs_ref == 0.5 and r.with_vs_ref("moe", 0.25).vs_ref("moe") == 0.25
    np.testing.assert_equal(dataclasses.replace(w, a2a_vs_ref=r.a2a_vs_ref).to_row(), r.to_row())  # NaN equal
    assert list(r.to_row()) == [f.name for f in dataclasses.fields(r)]


def test_the_stall_and_its_payback_are_in_the_verdict():
    r = Rearrangement(stall_seconds=2.0, interval_steps=100)
    adv = advise_profile_counts(SMALL, {"decode": _stats()}, AdviseConfig(deployment=EP32, rearrangement=r), source="s")
    v = adv.manifest.verdicts[0]
    cost = v.info["rearrangement"]
    assert "stalls serving ~2 s" in v.text and "not worth it" in v.text
    assert cost["payback_steps"] == pytest.approx(2.0 / cost["saving_seconds"])
    assert cost["stall_steps"] == pytest.approx(2.0 / cost["step_seconds"])
    # the payback also in seconds of serving: payback steps at the placement's own step time
    served = cost["payback_steps"] * (cost["step_seconds"] - cost["saving_seconds"])
    assert served > 0 and "of serving, one step after another" in v.text
    assert adv.manifest.rearrangement == r
    assert adv.manifest.to_json()["rearrangement"] == {"stall_seconds": 2.0, "interval_steps": 100}
    with pytest.raises(ConfigError, match="--stall-seconds"):
        Rearrangement(stall_seconds=-1.0)


# ---------------------------------------------------------------- the engines' replica rules
def test_vllm_hashes_the_token_row_into_the_replicas_in_slot_order():
    p2l = np.array([0, 1, 0, 2, 0, 3])  # expert 0 in slots 0, 2, 4
    rows = np.arange(6)
    got = vllm_slots(np.zeros((6, 1), dtype=np.int64), phy2log_P=p2l, row_T=rows, num_experts=4)
    want = [[(0, 2, 4)[((t * KNUTH) & 0xFFFFFFFF) % 3]] for t in range(6)]
    assert got.tolist() == want


def test_sglang_sends_each_rank_to_its_nearest_replica():
    """2 nodes of 2 GPUs, 2 slots per GPU. Expert 0 on GPUs 0 and 2: each node uses its own copy.
    Expert 1 twice on GPU 1: GPU 1 uses its first, GPU 0 (same node, narrowing nothing) draws fairly."""
    p2l = np.array([[0, 2, 1, 1, 0, 3, 4, 5]])  # GPU0: 0,2  GPU1: 1,1  GPU2: 0,3  GPU3: 4,5
    m = sglang_dispatch_map(p2l, num_experts=6, num_ranks=4, ranks_per_node=2)[0]  # [W, E]
    assert m[:, 0].tolist() == [0, 0, 4, 4]
    assert m[1, 1] == 2 and set(m[:, 1].tolist()) <= {2, 3}


def test_the_replica_rule_changes_the_balance_as_the_engines_say():
    """2 nodes of 2 GPUs, 3 slots each; all the load on expert 0, with copies on GPU 0 (slot 0) and twice on
    GPU 2 (slots 6, 7). vLLM hashes tokens evenly over the 3 copies: GPU 2 gets 2/3. SGLang sends every
    rank to its nearest copy, the first one on a GPU or node: node 0's ranks to slot 0, node 1's to
    slot 6: each GPU holding a used copy gets 1/2, slot 7 nothing."""
    from moetrace.tracer.trace.schema import ModelInfo

    E = 8
    p2l = np.array([[0, 1, 2, 3, 4, 5, 0, 0, 6, 7, 1, 2]])
    pl = placement_from_phy2log(p2l, num_experts=E)
    sh_s = slot_shares(pl, rule="sglang", num_ranks=4, ranks_per_node=2)[0]
    sh_v = slot_shares(pl, rule="vllm", num_ranks=4, ranks_per_node=2)[0]
    assert sh_v[[0, 6, 7]] == pytest.approx([1 / 3] * 3)
    assert sh_s[[0, 6, 7]] == pytest.approx([1 / 2, 1 / 2, 0.0])
    model = ModelInfo(
        name="rule-test",
        source="test",
        architecture="TestMoe",
        num_hidden_layers=2,
        moe_layers=(1,),
        num_experts=E,
        top_k=1,
        num_shared_experts=0,
        hidden_size=64,
    )
    c = np.zeros((1, 1, E), dtype=np.int64)
    c[0, 0, 0] = 12000
    cfg = AdviseConfig(deployment=parse_deployment("DP4TP1EP4", num_gpus_per_node=2), strategies=("linear",))
    b = {}
    for rule in ("vllm", "sglang", "same_node"):
        adv = advise_profile_counts(
            model, {"decode": c}, dataclasses.replace(cfg, replica_policy=rule), source="s", current=pl
        )
        b[rule] = next(r for r in adv.rows if r.option == "current").balancedness_vllm
        assert adv.manifest.replica_policy == rule
    assert b["vllm"] == pytest.approx((1 / 4) / (2 / 3)) and b["same_node"] == b["vllm"]
    assert b["sglang"] == pytest.approx((1 / 4) / (1 / 2))


# ---------------------------------------------------------------- the summation
ENGINES = json.loads((Path(__file__).parent / "golden" / "eplb_engines.json").read_text())


@pytest.mark.parametrize("case", ENGINES["cases"][:2], ids=[c["name"] for c in ENGINES["cases"][:2]])
def test_advise_eplb_sum_float32_is_deepseeks_reference_and_float64_the_engines(case):
    load = np.asarray(case["load"], dtype=np.float32)
    model = dataclasses.replace(DSV3, moe_layers=tuple(DSV3.moe_layers[: load.shape[0]]))
    dep = parse_deployment(
        f"DP{case['num_gpus']}TP1EP{case['num_gpus']}", num_gpus_per_node=case["num_gpus"] // case["num_nodes"]
    )
    R = case["num_replicas"] - load.shape[1]
    for eplb_sum, want in (("float32", "deepseek_phy2log"), ("float64", "sglang_phy2log")):
        cfg = AdviseConfig(deployment=dep, eplb_sum=eplb_sum, strategies=("eplb",))
        adv = advise_profile_counts(model, {"decode": load.astype(np.float64)[None]}, cfg, source="golden")
        np.testing.assert_array_equal(adv.options[f"decode-eplb-{R}"].placement.phy2log, np.asarray(case[want]))
        assert adv.manifest.eplb_sum == eplb_sum
        direct = eplb_option_placement(
            load, strategy="eplb", model=model, deployment=dep, num_redundant=R, eplb_sum=eplb_sum
        )
        np.testing.assert_array_equal(direct.phy2log, np.asarray(case[want]))


# ---------------------------------------------------------------- the command, on an SGLang statistics file
def test_cli_advises_an_imported_sglang_stats_file_with_every_new_option(tmp_path):
    info = model_info_for("deepseek-v3-tiny")
    c = np.zeros((info.num_hidden_layers, info.num_experts))
    c[list(info.moe_layers)] = _stats()[0, :1].astype(np.float64)  # whole floats, as SGLang's published files
    src = tmp_path / "logical_count.json"
    src.write_text(json.dumps({"logical_count": c.tolist()}))
    run = CliRunner().invoke
    res = run(
        app,
        [
            "import",
            str(src),
            "-m",
            "deepseek-v3-tiny",
            "--stages",
            "decode-only",
            "-q",
            "-o",
            str(tmp_path / "p.parquet"),
        ],
    )
    assert res.exit_code == 0, res.output
    args = ["advise", str(tmp_path / "p.parquet"), "--config", "DP16TP1EP16", "-q", "--eplb-sum", "float32"]
    args += [
        "--replica-policy",
        "sglang",
        "--decode-tokens-per-gpu",
        "8",
        "--stall-seconds",
        "1.5",
        "-o",
        str(tmp_path / "a"),
    ]
    res = run(app, args)
    assert res.exit_code == 0, res.output
    assert "EPLB summed in float32 (as DeepSeek's reference); replica policy sglang" in res.output
    assert "no drift estimate" in res.output and "No drift estimate" in res.output
    man = json.loads((tmp_path / "a" / "advice.json").read_text())
    assert (
        man["eplb_sum"] == "float32" and man["step_tokens_per_gpu"]["decode"] == 8 and man["drift_estimated"] is False
    )
    bad = run(
        app,
        [
            "advise",
            str(tmp_path / "p.parquet"),
            "--config",
            "DP16TP1EP16",
            "--strategies",
            "joint",
            "-o",
            str(tmp_path / "b"),
        ],
    )
    assert bad.exit_code != 0 and "need a trace that recorded prefill and decode" in bad.output


def test_a_newly_registered_strategy_is_advised_by_name(monkeypatch):
    """The change path "a placement strategy" (docs/architecture.md) reaches advise with no other change:
    a registered ungrouped strategy that reads load is fitted on each stage's load and evaluated by
    name (advise once evaluated only the names it knew, and dropped any other without a word)."""
    import moetrace.placement.advise.options as advise_options
    from moetrace.placement import strategies
    from moetrace.placement.maps import placement_from_phy2log

    seen: list[float] = []

    def hottest_last(x):  # a toy placer: each layer's experts in rising load, the load it reads recorded
        seen.append(float(np.asarray(x.load_LE).sum()))
        phy2log = np.argsort(np.asarray(x.load_LE), axis=1, kind="stable")
        return placement_from_phy2log(phy2log, num_experts=x.num_experts), {}

    row = strategies.Strategy("toy_sorted", "toy sorted", False, hottest_last, "toy: experts in rising load")
    monkeypatch.setattr(strategies, "STRATEGIES", (*strategies.STRATEGIES, row))
    monkeypatch.setattr(strategies, "STRATEGY_NAMES", (*strategies.STRATEGY_NAMES, row.name))
    monkeypatch.setattr(advise_options, "STRATEGY_NAMES", (*advise_options.STRATEGY_NAMES, row.name))
    stats = _stats()
    adv = advise_profile_counts(
        SMALL,
        {"decode": stats},
        AdviseConfig(deployment=EP32, strategies=("toy_sorted", "eplb")),
        source="stats",
    )
    rows = {r.option: r for r in adv.rows}
    assert "toy_sorted" in rows and np.isfinite(rows["toy_sorted"].moe_vs_ref)
    assert rows["toy_sorted"].fitted_on == "decode"
    assert seen and seen[0] > 0  # fitted on the stage's load, not a zero load


def test_decode_says_why_it_keeps_fewer_redundant_experts():
    """At EP64 and 4 decode tokens per GPU (memory-bound) the best sweep point (64 redundant) has fewer
    redundant experts than the best-balanced one (128): the verdict says why (each redundant slot is
    one more expert a GPU may read)."""
    cfg = AdviseConfig(deployment=EP64, decode_tokens_per_gpu=4)
    adv = advise_profile_counts(SMALL, {"decode": _stats(3)}, cfg, source="stats")
    v = next(v for v in adv.manifest.verdicts if v.stage == "decode")
    rows = [r for r in adv.rows if r.strategy.startswith("eplb")]
    balanced = max(rows, key=lambda r: (r.balancedness_vllm, -r.num_redundant))
    chosen = next(r for r in rows if r.option == v.option)
    assert v.verdict == "enable" and chosen.num_redundant < balanced.num_redundant
    assert "Why not more redundant experts" in v.text and "one more expert a GPU may read" in v.text
