"""One decision (issue 39): the rule ``placement.decision.choose`` by hand, and ``compare``, ``advise``
and ``place`` run on one small trace naming the same best option per stage, or saying why not."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from factories import zipf_trace
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.placement.decision import MIN_GAIN, Candidate, StageChoice, choose
from moetrace.placement.exports import load_placement


def _c(option: str, time: float, *, red: int = 0, ok: bool = True) -> Candidate:
    return Candidate(option=option, strategy=option.split("-")[0], num_redundant=red, time=time, deployable=ok)


def test_the_rule_by_hand():
    ref = _c("linear", 1.0)
    # the fastest deployable option; one over the node-load limit is never chosen
    ch = choose("decode", [ref, _c("joint", 0.80, ok=False), _c("eplb-0", 0.90)], reference="linear", measure="m")
    assert (ch.decision, ch.best) == ("eplb-0", "eplb-0") and ch.time == pytest.approx(0.90)
    # within 1 % of the best: the fewest redundant slots win
    ch = choose("prefill", [ref, _c("eplb-4", 0.700, red=4), _c("eplb-0", 0.705)], reference="linear", measure="m")
    assert ch.decision == "eplb-0"
    # under MIN_GAIN saved: keep the reference, the closest named
    ch = choose("decode", [ref, _c("joint", 1 - MIN_GAIN / 2)], reference="linear", measure="m")
    assert (
        ch.decision == "linear" and ch.best == "joint" and "keep linear" in ch.text() and "closest: joint" in ch.text()
    )
    # nothing faster than the reference
    ch = choose("decode", [ref, _c("joint", 1.2)], reference="linear", measure="m")
    assert ch.decision == "linear" and ch.text() == "decode: keep linear (no option is faster than linear)"
    # read back from JSON (NaN figures as null)
    assert StageChoice.from_json(json.loads(json.dumps(ch.to_json()))).to_json() == ch.to_json()


def _run(args: list[str]) -> str:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return res.output


def test_compare_advise_and_place_name_the_same_best_option_per_stage(tmp_path):
    """compare, advise and place on one trace, asked the same question (the same strategies, step sizes
    and copy models; EPLB without redundant slots, which compare's --redundancy 0 evaluates): the same
    decision per stage, or the output says why the answers differ (compare fits every placement on
    decode load, advise each stage's on its own). place writes the decode decision advise evaluated."""
    t = zipf_trace(tmp_path / "t", n=64, skew=2.0)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 7168, "moe_intermediate_size": 2048}))
    model = ["--model-config", str(tmp_path / "config.json")]  # the expert size: MoE-layer time, as for a preset
    dep = ["--config", "DP2TP2EP4", "--gpus-per-node", "2", *model]
    strategies = "linear,eplb,joint"
    out_c = _run(
        ["compare", str(t), *dep, "--strategies", strategies, "--batches", "40", "--batch-requests", "8",
         "--prefill-tokens", "32", "-q", "-o", str(tmp_path / "c")]
    )  # fmt: skip
    out_a = _run(
        ["advise", str(t), *dep, "--strategies", strategies, "--max-slots-per-gpu", "4", "--steps", "40",
         "--decode-tokens-per-gpu", "2", "--prefill-tokens-per-gpu", "16", "-q", "-o", str(tmp_path / "a")]
    )  # fmt: skip
    compared = json.loads((tmp_path / "c" / "compare.json").read_text())["verdict"]["stages"]
    advised = json.loads((tmp_path / "a" / "advice.json").read_text())["best"]
    assert set(compared) == set(advised) == {"decode", "prefill"}
    assert "best per stage (the rule advise applies too" in out_c and "Decision per stage (the rule compare" in out_a
    for stage in ("decode", "prefill"):
        c, a = compared[stage], advised[stage]
        assert c["measure"] == a["measure"] == "MoE-layer time"  # one objective
        if c["decision"] != a["decision"]:  # asked a different question: the outputs say so
            assert stage == "prefill", (c, a)
            assert "fitted on decode load" in out_c and "fitted on the stage it serves" in out_a
    decision = advised["decode"]["decision"]
    strategy = decision.rsplit("-", 1)[0] if decision.startswith("eplb") else decision
    out_p = _run(["place", str(t), *dep, "--strategy", strategy, "-q", "-o", str(tmp_path / "p.json")])
    assert "moetrace advise" in out_p  # place says how its one placement relates to the per-stage advice
    written = load_placement(tmp_path / "p.json").placement.phy2log
    if decision != "linear":  # advise wrote the placement it recommends; place writes the same
        advised_file = load_placement(tmp_path / "a" / "placements" / f"decode-{decision}.json")
        assert np.array_equal(written, advised_file.placement.phy2log)
    # not a trivial agreement: decode's decision gains (EPLB balances the skewed load), in both
    assert advised["decode"]["decision"] != "linear" and advised["decode"]["time"] < 0.9
    assert compared["decode"]["time"] == pytest.approx(advised["decode"]["time"], abs=0.02)
    assert math.isfinite(advised["prefill"]["time"])
    # one answer in words too: each stage's verdict names the decision (EPLB's point, or "deploy" another)
    for v in json.loads((tmp_path / "a" / "advice.json").read_text())["verdicts"]:
        if v["stage"] in advised and advised[v["stage"]]["decision"] != "linear":
            assert v["option"] == advised[v["stage"]]["decision"], v
            assert v["verdict"] in ("enable", "deploy") and (v["verdict"] == "deploy") == (
                not v["option"].startswith("eplb")
            )


def test_advise_commands_write_beside_the_advice_with_distinct_names(tmp_path):
    """Every printed command writes under the advice directory's exports/, no two to one file."""
    import shlex

    t = zipf_trace(tmp_path / "t", n=48, skew=2.0)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 7168, "moe_intermediate_size": 2048}))
    out = tmp_path / "a"
    _run(
        ["advise", str(t), "--config", "DP2TP2EP4", "--gpus-per-node", "2", "--steps", "20",
         "--model-config", str(tmp_path / "config.json"), "-q", "-o", str(out)]
    )  # fmt: skip
    cmds = json.loads((out / "advice.json").read_text())["commands"]
    targets = []
    for c in cmds:
        for line in [c["place"], *c["export"].values()]:
            if line:
                args = shlex.split(line)
                targets.append(args[args.index("-o") + 1])
    assert targets and len(set(targets)) == len(targets)
    assert all(p.startswith(f"{out}/exports/") for p in targets), targets


def test_dashboard_without_out_writes_beside_its_inputs_and_says_where(tmp_path):
    t = zipf_trace(tmp_path / "traces" / "t", n=24)
    output = _run(["dashboard", str(t), "-q"])
    assert f"no -o: writing {(tmp_path / 'traces' / 'report.html').resolve()}" in output
    assert (tmp_path / "traces" / "report.html").is_file()


def test_advise_words_lead_with_the_decision_when_it_is_not_eplb(tmp_path):
    """Parity domains (each request uses only its domain's experts): ours (joint) with its router is
    advise's decode decision, and the verdict says so first ("deploy ours (joint)"), EPLB's point
    following as the alternative, its placement file the first written: the table, the card and
    the words give one answer."""
    from factories import planted_trace

    t = planted_trace(tmp_path / "t", structured=True, num_requests=80)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 7168, "moe_intermediate_size": 2048}))
    dep = ["--config", "DP2TP1EP2", "--gpus-per-node", "1", "--model-config", str(tmp_path / "config.json")]
    out = _run(
        ["advise", str(t), *dep, "--strategies", "linear,eplb,joint", "--steps", "40",
         "--decode-tokens-per-gpu", "256", "-q", "-o", str(tmp_path / "a")]
    )  # fmt: skip
    advice = json.loads((tmp_path / "a" / "advice.json").read_text())
    assert advice["best"]["decode"]["decision"] == "joint", advice["best"]["decode"]
    v = next(v for v in advice["verdicts"] if v["stage"] == "decode")
    assert v["verdict"] == "deploy" and v["option"] == "joint"
    assert v["text"].startswith("Decode: deploy ours (joint), the decision (") and "EPLB alone: " in v["text"]
    assert "Decode: deploy ours (joint)" in out
    decode_commands = [c for c in advice["commands"] if c["stage"] == "decode"]
    assert decode_commands and decode_commands[0]["option"] == "joint"  # the decision's files first
