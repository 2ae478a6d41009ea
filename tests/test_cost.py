"""The per-step cost model (placement/cost.py) against hand-computed small cases."""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.errors import ConfigError
from moetrace.placement.cost import (
    DEFAULT_LINKS,
    ExpertCompute,
    Link,
    Links,
    expert_compute_for,
    expert_seconds_BW,
    parse_links,
)


def test_expert_time_is_memory_bound_for_few_tokens_and_compute_bound_for_many():
    e = ExpertCompute(hidden_size=1000, ffn_size=500, weight_bytes_per_value=2, hbm_bytes_per_s=1e9, peak_flops=1e12)
    assert e.weight_bytes == 3e6 and e.flops_per_token == 3e6
    s = expert_seconds_BW(np.array([[1.0, 10_000.0]]), np.array([[2.0, 2.0]]), expert=e)
    assert s[0, 0] == pytest.approx(2 * 3e6 / 1e9)  # two experts' weights read
    assert s[0, 1] == pytest.approx(10_000 * 3e6 / 1e12)  # 10k (token, expert) pairs computed


def test_parse_links():
    links = parse_links("intra=300GB/s,2us,inter=400Gbit")
    assert links.intra == Link(bytes_per_s=300e9, latency_s=2e-6)
    assert links.inter == Link(bytes_per_s=50e9, latency_s=DEFAULT_LINKS.inter.latency_s)
    assert parse_links("inter=25") == Links(intra=DEFAULT_LINKS.intra, inter=Link(bytes_per_s=25e9, latency_s=0.4e-6))
    for bad in ("intra=fast", "nvlink=100", "inter=10,2us,3us", "intra=1,intra=2", "inter=10,soon"):
        with pytest.raises(ConfigError, match="--link"):
            parse_links(bad)


def test_expert_size_from_presets():
    import dataclasses

    from moetrace.tracer.presets import model_info_for

    dsv3 = expert_compute_for(model_info_for("deepseek-v3-tiny"))  # the full model the tiny preset mirrors
    assert dsv3 is not None and (dsv3.hidden_size, dsv3.ffn_size, dsv3.weight_bytes_per_value) == (7168, 2048, 1.0)
    assert (dsv3.num_shared_experts, dsv3.shared_ffn_size) == (1, 2048)
    # an old trace of OLMoE (no expert sizes in its manifest), found by its hub id
    olmoe_info = dataclasses.replace(model_info_for("olmoe-1b-7b"), name="my-olmoe", moe_intermediate_size=None)
    olmoe = expert_compute_for(olmoe_info)
    assert olmoe is not None and (olmoe.hidden_size, olmoe.ffn_size, olmoe.num_shared_experts) == (2048, 1024, 0)
    mine = dataclasses.replace(olmoe_info, source="me/my-own-model")
    assert expert_compute_for(mine) is None
