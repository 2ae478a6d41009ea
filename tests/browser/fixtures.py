"""Small traces with planted structure for the dashboard tests.

``make_trace``: two or three datasets, each routing mostly to its own block of experts (so imbalance,
dataset correlations and classifiers have a known answer), written with the real ``TraceWriter``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moetrace.tracer.presets import model_info_for
from moetrace.tracer.store import TraceWriter


def make_trace(
    path: Path,
    *,
    model: str = "mixtral-8x7b-tiny",
    datasets: tuple[str, ...] = ("code", "math"),
    num_requests: int = 48,
    seed: int = 0,
    preference: float = 0.85,
) -> Path:
    """A complete trace: request r belongs to ``datasets[r % D]``; with probability ``preference``
    a token picks its experts from its dataset's block ``[d*E/D, (d+1)*E/D)``, else uniformly."""
    m = model_info_for(model)
    E, K, L = m.num_experts, m.top_k, m.num_moe_layers
    D = len(datasets)
    rng = np.random.default_rng(seed)
    block = E // D
    R = num_requests
    prompt = rng.integers(6, 24, size=R).astype(np.int32)
    output = rng.integers(2, 12, size=R).astype(np.int32)
    T = int((prompt + output).sum())
    d_T = np.repeat(np.arange(R) % D, prompt + output)
    # random scores; planted block gets a bonus so its experts win top-k most of the time
    scores = rng.random((T, L, E))
    bonus = (rng.random((T, L)) < preference)[..., None] & (np.arange(E)[None, None, :] // block == d_T[:, None, None])
    ids = np.argsort(-(scores + 2.0 * bonus), axis=-1)[..., :K].astype(np.int16)
    # the final generated token of each request is never forwarded: -1 as in real traces
    last = np.cumsum(prompt + output) - 1
    ids[last] = -1
    with TraceWriter(
        path,
        model=m,
        backend={"name": "synthetic"},
        collection={"datasets": list(datasets), "seed": seed, "preference": preference},
        on_existing="overwrite",
    ) as w:
        w.add_requests(
            request_id_R=np.arange(R, dtype=np.int64) + 1000,
            dataset_R=[datasets[r % D] for r in range(R)],
            prompt_tokens_R=prompt,
            output_tokens_R=output,
            experts_TX=ids.reshape(T, L * K),
        )
    return path
