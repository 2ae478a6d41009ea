"""Shared fixtures: small traces written with the real writer."""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.tracer.trace.schema import ModelInfo
from moetrace.tracer.trace.writer import TraceWriter

SMALL = ModelInfo(
    name="small",
    source="test",
    architecture="TestMoe",
    num_hidden_layers=4,
    moe_layers=(1, 2, 3),
    num_experts=16,
    top_k=2,
    num_shared_experts=0,
    hidden_size=32,
)


def write_small_trace(path, *, num_requests: int = 6, seed: int = 0, model: ModelInfo = SMALL, **writer_kw):
    """A valid trace of random routing: request r has 3+r prompt and 2+r%3 output tokens."""
    rng = np.random.default_rng(seed)
    with TraceWriter(path, model=model, backend={"name": "synthetic"}, collection={"seed": seed}, **writer_kw) as w:
        for r in range(num_requests):
            P, O = 3 + r, 2 + r % 3
            ex = np.stack(
                [np.stack([rng.choice(model.num_experts, model.top_k, replace=False) for _ in range(model.num_moe_layers)]) for _ in range(P + O)]
            )
            ex[-1] = -1
            w.add_request(request_id=r, dataset=["a", "b"][r % 2], prompt_tokens=P, topk_ids_TX=ex)
    return path


@pytest.fixture
def small_trace(tmp_path):
    return write_small_trace(tmp_path / "trace")
