"""Model names: resolve() for every kind of name; preset facts match the released models; -tiny keeps
the routing topology."""

from __future__ import annotations

import json

import pytest

from moetrace.errors import ModelError
from moetrace.tracer.presets import list_presets, model_info_for, moe_topology_from_hf_config, resolve

# total parameters of the released checkpoints (model cards), in billions
PUBLISHED_B = {
    "deepseek-v3": 671,
    "qwen3-235b-a22b": 235,
    "qwen3-30b-a3b": 30.5,
    "llama4-maverick": 400,
    "mixtral-8x7b": 46.7,
    "olmoe-1b-7b": 6.9,
    "gpt-oss-120b": 117,
}


def test_every_spec_preset_exists():
    assert {p.name for p in list_presets()} == set(PUBLISHED_B)


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_full_config_has_the_published_size_and_topology(name):
    from moetrace.tracer.backends.hf import count_parameters

    resolved = resolve(name)
    p, cfg = resolved.preset, resolved.hf_config()
    assert count_parameters(cfg) / 1e9 == pytest.approx(PUBLISHED_B[name], rel=0.02)
    topo = moe_topology_from_hf_config(cfg)
    assert topo["moe_layers"] == p.moe_layers
    assert (topo["num_experts"], topo["top_k"], topo["hidden_size"]) == (p.num_experts, p.top_k, p.hidden_size)


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_tiny_keeps_routing_topology(name):
    full, tiny = model_info_for(name), model_info_for(name + "-tiny")
    for f in ("num_hidden_layers", "moe_layers", "num_experts", "top_k", "n_group", "topk_group", "architecture"):
        assert getattr(full, f) == getattr(tiny, f)
    assert tiny.hidden_size < 256


def test_spec_table_facts():
    dsv3 = model_info_for("deepseek-v3")
    assert dsv3.moe_layers == tuple(range(3, 61)) and (dsv3.n_group, dsv3.topk_group) == (8, 4)
    mav = model_info_for("llama4-maverick")
    assert mav.num_moe_layers == 24 and mav.moe_layers[:3] == (1, 3, 5) and mav.top_k == 1


def test_resolve_a_preset_and_its_tiny_variant():
    full = resolve("deepseek-v3")
    assert (full.kind, full.preset.name, full.source, full.config_path) == (
        "preset",
        "deepseek-v3",
        "deepseek-ai/DeepSeek-V3",
        None,
    )
    assert full.model_info() == model_info_for("deepseek-v3") and full.model_info().source == "deepseek-ai/DeepSeek-V3"
    tiny = resolve("deepseek-v3-tiny")
    assert (tiny.kind, tiny.preset.name, tiny.source) == ("tiny-preset", "deepseek-v3", "moetrace:deepseek-v3-tiny")
    info = tiny.model_info()
    assert info.name == "deepseek-v3-tiny" and info.source == "moetrace:deepseek-v3-tiny"
    assert info.moe_layers == full.model_info().moe_layers and info.hidden_size < full.model_info().hidden_size


def test_resolve_a_local_checkpoint_directory_and_config_file(tmp_path):
    cfg = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = resolve(str(tmp_path))
    assert (r.kind, r.preset, r.source, r.config_path) == ("local", None, str(tmp_path), tmp_path / "config.json")
    info = r.model_info()  # read as JSON: no transformers, nothing downloaded
    assert (info.name, info.source, info.architecture) == (str(tmp_path), str(tmp_path), "Qwen3MoeForCausalLM")
    assert info.moe_layers == (1, 2, 3) and (info.num_experts, info.top_k) == (16, 4)
    assert resolve(str(tmp_path / "config.json")).kind == "local"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="without config.json"):
        resolve(str(tmp_path / "empty"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{nope")
    with pytest.raises(ModelError, match="not valid JSON"):
        resolve(str(tmp_path / "bad")).model_info()
    dense = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64}
    (tmp_path / "bad" / "config.json").write_text(json.dumps(dense))
    with pytest.raises(ModelError, match="not a Mixture-of-Experts"):
        resolve(str(tmp_path / "bad")).model_info()


def test_resolve_a_hub_id_reads_nothing():
    r = resolve("Qwen/Qwen3-30B-A3B")
    assert (r.kind, r.preset, r.source, r.config_path) == ("hub", None, "Qwen/Qwen3-30B-A3B", None)
    with pytest.raises(ModelError, match="not downloaded here"):
        r.model_info()  # without a config loaded by an engine


@pytest.mark.parametrize(
    "name, match",
    [
        ("deepseek-v4", "neither a preset.*deepseek-v3-tiny"),  # a bare unknown name, with the presets listed
        (
            "deepseek-v4-tiny",
            "unknown model preset 'deepseek-v4-tiny'; did you mean 'deepseek-v3-tiny'.*presets: .*deepseek-v3-tiny",
        ),
        ("/no/such/checkpoint", "neither a preset, nor an existing checkpoint directory"),
        ("./ckpt", "neither a preset"),
    ],
)
def test_resolve_refuses_an_unknown_name_in_one_line(name, match):
    with pytest.raises(ModelError, match=match) as exc:
        resolve(name)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "typo, suggestion",
    [("deepseekv3-tiny", "deepseek-v3-tiny"), ("Qwen3-30B", "qwen3-30b-a3b"), ("mixtral-8x7", "mixtral-8x7b")],
)
def test_a_mistyped_model_name_is_refused_at_once_with_a_suggestion(typo, suggestion):
    from moetrace.errors import ModelError
    from moetrace.tracer.presets import resolve

    with pytest.raises(ModelError, match=f"did you mean '{suggestion}'"):
        resolve(typo)


def test_an_unreachable_hub_is_refused_at_once_with_did_you_mean(monkeypatch):
    """Offline (by HF_HUB_OFFLINE, or a hub that does not answer) a hub id not in the cache is one
    line straight away, with the near presets, instead of the hub client's retries."""
    import time

    from moetrace.errors import ModelError
    from moetrace.tracer.presets import hub_unreachable, resolve

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_unreachable() == "HF_HUB_OFFLINE is set"
    t0 = time.monotonic()
    with pytest.raises(ModelError) as e:
        resolve("someorg/qwen3-30b-a3bx").hf_config()
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert "not in the local Hugging Face cache and the hub is not reachable from here (HF_HUB_OFFLINE is set)" in msg
    assert "did you mean 'qwen3-30b-a3b'" in msg and "\n" not in msg
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    assert hub_unreachable(timeout_s=1).startswith("127.0.0.1:9: ")
