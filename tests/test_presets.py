"""Model presets: facts match the released models; -tiny keeps the routing topology."""

from __future__ import annotations

import pytest

from moetrace.tracer.presets import get_preset, list_presets, model_info_for, moe_topology_from_hf_config

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
    transformers = pytest.importorskip("transformers")
    from moetrace.tracer.backends.hf import count_parameters

    p, _ = get_preset(name)
    cfg = transformers.AutoConfig.for_model(p.model_type, **p.hf_config_dict(tiny=False))
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


def test_unknown_preset_lists_the_valid_ones():
    from moetrace.errors import ModelError

    with pytest.raises(ModelError, match="deepseek-v3-tiny"):
        get_preset("deepseek-v4")
