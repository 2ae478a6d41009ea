"""Any model's experts: the expert size recorded in the trace's ModelInfo (from the HF config), a
user's --model-config over it, the missing key named; the shared-expert term; old manifests still read."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from factories import SMALL, write_small_trace
from typer.testing import CliRunner

from moetrace.cli.common import read_model_config
from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.cost import (
    ExpertCompute,
    expert_compute_for,
    expert_seconds_BW,
    expert_unknown_reason,
    missing_expert_keys,
)
from moetrace.tracer.presets import expert_sizes_from_hf_config, model_info_for, model_info_from_hf_config
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import ModelInfo

#: a model that is no preset, its expert sizes recorded (as a trace collected from its config.json has them)
OWN = dataclasses.replace(
    SMALL,
    name="/ckpt/my-moe",
    source="/ckpt/my-moe",
    hidden_size=1024,
    num_shared_experts=2,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    weight_bytes_per_value=1.0,
)
#: the same model in a trace written before the expert sizes were recorded
OLD = dataclasses.replace(
    OWN, moe_intermediate_size=None, shared_expert_intermediate_size=None, weight_bytes_per_value=None
)


# ------------------------------------------------------------------------------ where the size comes from
def test_a_model_that_is_no_preset_gets_its_recorded_expert_size():
    e = expert_compute_for(OWN)
    assert e == ExpertCompute(
        hidden_size=1024, ffn_size=256, weight_bytes_per_value=1.0, num_shared_experts=2, shared_ffn_size=256
    )
    assert missing_expert_keys(OWN) == [] and expert_unknown_reason(OWN) == ""


def test_the_users_config_overrides_the_trace():
    cfg = {"hidden_size": 2048, "moe_intermediate_size": 512, "n_shared_experts": 1, "torch_dtype": "bfloat16"}
    e = expert_compute_for(OWN, config=cfg)
    assert e is not None
    assert (e.hidden_size, e.ffn_size, e.weight_bytes_per_value) == (2048, 512, 2.0)
    assert (e.num_shared_experts, e.shared_ffn_size) == (1, 512)  # a DeepSeek-style shared expert: routed width
    # a config with only the routed width: the rest from the trace (its two shared experts stay, at their width)
    e = expert_compute_for(OWN, config={"moe_intermediate_size": 128})
    assert e is not None and (e.hidden_size, e.ffn_size, e.num_shared_experts, e.shared_ffn_size) == (1024, 128, 2, 256)
    # an old trace: the config alone gives the size
    e = expert_compute_for(OLD, config={"intermediate_size": 4096, "model_type": "mixtral"})
    assert e is not None and (e.ffn_size, e.weight_bytes_per_value) == (4096, 2.0)


def test_missing_keys_are_named():
    assert expert_compute_for(OLD) is None
    assert missing_expert_keys(OLD) == ["moe_intermediate_size"]
    reason = expert_unknown_reason(OLD)
    assert "`moe_intermediate_size`" in reason and "--model-config" in reason and "n/a" in reason
    # a config that does not give it either: an error, not a quiet n/a
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        expert_compute_for(OLD, config={"hidden_size": 1024})
    with pytest.raises(ConfigError, match="`moe_intermediate_size` must be a whole number"):
        expert_compute_for(OWN, config={"moe_intermediate_size": [256, 512]})  # a per-layer list
    with pytest.raises(ConfigError, match="JSON object"):
        expert_compute_for(OWN, config=[1, 2])  # type: ignore[arg-type]


def test_tiny_presets_are_priced_as_the_model_they_mirror():
    tiny = model_info_for("deepseek-v3-tiny")
    assert tiny.moe_intermediate_size == 32  # the tiny model's own (toy) width is what the trace records
    e = expert_compute_for(tiny)
    assert e is not None and (e.hidden_size, e.ffn_size, e.weight_bytes_per_value) == (7168, 2048, 1.0)
    # an old full-size DeepSeek-V3 trace (no sizes): the preset, found by its name
    old = dataclasses.replace(model_info_for("deepseek-v3"), moe_intermediate_size=None)
    assert expert_compute_for(old) == e


# ------------------------------------------------------------------------------ the formulas
def test_routed_seconds_is_the_old_formula():
    e = ExpertCompute(hidden_size=1000, ffn_size=500, weight_bytes_per_value=2, hbm_bytes_per_s=1e9, peak_flops=1e12)
    rng = np.random.default_rng(0)
    pairs, active = rng.integers(0, 5000, (3, 4)).astype(np.float64), rng.integers(0, 9, (3, 4)).astype(np.float64)
    old = np.maximum(active * (e.weight_bytes / e.hbm_bytes_per_s), pairs * (e.flops_per_token / e.peak_flops))
    np.testing.assert_array_equal(e.routed_seconds(pairs, active), old)
    np.testing.assert_array_equal(expert_seconds_BW(pairs, active, expert=e), old)


def test_shared_seconds_by_hand_on_two_steps_of_two_gpus():
    # hidden 1000, shared ffn 500, bf16: one shared expert is 3e6 bytes, 3e6 FLOPs per token
    e = ExpertCompute(
        hidden_size=1000,
        ffn_size=100,
        weight_bytes_per_value=2,
        hbm_bytes_per_s=1e9,
        peak_flops=1e12,
        num_shared_experts=2,
        shared_ffn_size=500,
    )
    tokens = np.array([[0.0, 1.0], [1000.0, 5000.0]])
    s = e.shared_seconds(tokens)
    # no token: nothing read; 1 token: 2 experts' weights read (6 ms) beat 2 x 3e6 FLOPs (6 us);
    # 1000 tokens: 6e9 FLOPs = 6 ms = the weights' 6 ms; 5000 tokens: 3e10 FLOPs = 30 ms
    np.testing.assert_allclose(s, [[0.0, 6e-3], [6e-3, 30e-3]])
    assert ExpertCompute(hidden_size=1000, ffn_size=100).shared_seconds(tokens).tolist() == [[0, 0], [0, 0]]
    assert e.to_json()["num_shared_experts"] == 2 and e.to_json()["shared_ffn_size"] == 500


# ------------------------------------------------------------------------------ the trace's model section
def test_an_old_manifest_without_the_new_fields_still_loads():
    old = {k: v for k, v in SMALL.to_dict().items()}
    assert not {"moe_intermediate_size", "shared_expert_intermediate_size", "weight_bytes_per_value"} & set(old)
    m = ModelInfo.from_dict(old)
    assert m == SMALL and m.moe_intermediate_size is None and m.weight_bytes_per_value is None


def test_the_new_fields_round_trip_through_a_written_trace(tmp_path):
    d = OWN.to_dict()
    assert (d["moe_intermediate_size"], d["shared_expert_intermediate_size"], d["weight_bytes_per_value"]) == (
        256,
        256,
        1.0,
    )
    assert ModelInfo.from_dict(json.loads(json.dumps(d))) == OWN
    path = write_small_trace(tmp_path / "t", model=OWN)
    assert open_trace(path).model == OWN


@pytest.mark.parametrize(
    "field, value",
    [
        ("moe_intermediate_size", 0),
        ("moe_intermediate_size", "256"),
        ("shared_expert_intermediate_size", 2.5),
        ("weight_bytes_per_value", 0),
        ("weight_bytes_per_value", True),
        ("weight_bytes_per_value", float("nan")),
        ("weight_bytes_per_value", "fp8"),
    ],
)
def test_bad_expert_sizes_in_a_manifest_are_refused(field, value):
    with pytest.raises(TraceFormatError, match=field):
        ModelInfo.from_dict({**OWN.to_dict(), field: value})


# ------------------------------------------------------------------------------ from HF configs
def _dsv3_like(**kw):
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "n_routed_experts": 16,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "moe_intermediate_size": 64,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
        "torch_dtype": "bfloat16",
        **kw,
    }


def test_model_info_from_a_config_records_the_expert_sizes():
    m = model_info_from_hf_config(_dsv3_like(), name="x", source="x")
    assert (m.moe_intermediate_size, m.shared_expert_intermediate_size, m.weight_bytes_per_value) == (64, 64, 1.0)
    assert m.num_shared_experts == 1
    qwen2 = model_info_from_hf_config(
        {
            "model_type": "qwen2_moe",
            "num_hidden_layers": 2,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "hidden_size": 128,
            "intermediate_size": 512,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96,  # one shared expert of that width
            "torch_dtype": "bfloat16",
        },
        name="q",
        source="q",
    )
    assert (qwen2.num_shared_experts, qwen2.moe_intermediate_size, qwen2.shared_expert_intermediate_size) == (1, 32, 96)
    assert qwen2.weight_bytes_per_value == 2.0
    mixtral_cfg = dict(model_type="mixtral", num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)
    mixtral = model_info_from_hf_config(
        {**mixtral_cfg, "hidden_size": 128, "intermediate_size": 448}, name="m", source="m"
    )
    assert (mixtral.moe_intermediate_size, mixtral.shared_expert_intermediate_size) == (448, None)
    assert mixtral.weight_bytes_per_value is None  # the config does not say


def _bytes(**cfg) -> float | None:
    return expert_sizes_from_hf_config({"intermediate_size": 32, **cfg})["weight_bytes_per_value"]


def test_config_quirks():
    assert _bytes(quantization_config={"quant_method": "mxfp4"}) == 4.25 / 8  # gpt-oss
    assert _bytes(quantization_config={"quant_method": "gptq", "bits": 4}) == 0.5
    weights = {"weights": {"num_bits": 8, "type": "float"}}
    assert _bytes(quantization_config={"quant_method": "compressed-tensors", "config_groups": {"g": weights}}) == 1.0
    assert _bytes(quantization_config={"quant_method": "magic"}, torch_dtype="bfloat16") is None  # not the dtype's
    assert _bytes(torch_dtype="float32") == 4.0 and _bytes(dtype="bfloat16") == 2.0 and _bytes() is None
    text = dict(model_type="llama4_text", hidden_size=64, intermediate_size=32, intermediate_size_mlp=128)
    llama4 = expert_sizes_from_hf_config({"model_type": "llama4", "text_config": text, "torch_dtype": "bfloat16"})
    shared = (llama4["num_shared_experts"], llama4["shared_expert_intermediate_size"])
    assert llama4["moe_intermediate_size"] == 32 and shared == (1, 32) and llama4["weight_bytes_per_value"] == 2.0
    # a per-layer list is not a width; intermediate_size (the dense layers') is then not read either
    listed = expert_sizes_from_hf_config({"moe_intermediate_size": [1, 2], "intermediate_size": 9})
    assert listed["moe_intermediate_size"] is None


def test_presets_record_their_expert_sizes():
    assert model_info_for("deepseek-v3").moe_intermediate_size == 2048
    assert model_info_for("mixtral-8x7b").moe_intermediate_size == 14336
    mav = model_info_for("llama4-maverick")
    assert (mav.moe_intermediate_size, mav.num_shared_experts, mav.shared_expert_intermediate_size) == (8192, 1, 8192)


# ------------------------------------------------------------------------------ --model-config
def test_read_model_config(tmp_path):
    assert read_model_config(None) is None
    good = tmp_path / "config.json"
    good.write_text(json.dumps({"moe_intermediate_size": 256}))
    assert read_model_config(good) == {"moe_intermediate_size": 256}
    assert read_model_config(tmp_path) == {"moe_intermediate_size": 256}  # a checkpoint directory
    bad = tmp_path / "bad.json"
    for text, why in (("{not json", "not valid JSON"), ("[1, 2]", "JSON object")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=f"--model-config {bad}: .*{why}"):
            read_model_config(bad)
    with pytest.raises(ConfigError, match="no such file"):
        read_model_config(tmp_path / "nothing.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="without config.json"):
        read_model_config(tmp_path / "empty")


@pytest.mark.parametrize("command", ["compare", "advise", "place"])
def test_the_commands_refuse_an_unreadable_model_config_at_once(tmp_path, command):
    from moetrace.cli import app

    bad = tmp_path / "config.json"
    bad.write_text("{oops")
    out = tmp_path / ("p.json" if command == "place" else "out")
    res = CliRunner().invoke(
        app, [command, str(tmp_path / "no-trace"), "--config", "DP2TP1EP2", "--model-config", str(bad), "-o", str(out)]
    )
    assert res.exit_code == 2, res.output
    assert f"--model-config {bad}: not valid JSON" in res.output.replace("\n", "")


def test_compare_prices_a_non_preset_model_from_its_config_and_says_why_when_it_cannot(tmp_path):
    from moetrace.placement.compare import CompareConfig, load_trace_data, run_compare
    from moetrace.placement.deployment import parse_deployment
    from moetrace.placement.report import copy_model_line

    path = write_small_trace(tmp_path / "t", num_requests=24)  # SMALL: no expert size recorded
    data = load_trace_data(path, test_fraction=0.3, seed=0)
    dep = parse_deployment("DP4TP1EP4", num_gpus_per_node=2)
    kw = dict(deployment=dep, strategies=("linear",), num_batches=4, num_batch_requests=4, oracle=False)
    unknown = run_compare(data, CompareConfig(**kw))
    assert unknown.manifest.expert is None
    assert "records no `moe_intermediate_size`; pass --model-config" in copy_model_line(unknown.manifest)
    known = run_compare(data, CompareConfig(**kw, model_config={"moe_intermediate_size": 48}))
    assert known.manifest.expert is not None and known.manifest.expert["ffn_size"] == 48
