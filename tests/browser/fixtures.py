"""Small traces with planted structure for the dashboard tests.

``make_trace``: two or three datasets, each routing mostly to its own block of experts (so imbalance,
dataset correlations and classifiers have a known answer), written with the real ``TraceWriter``.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetrace.tracer.presets import model_info_for
from moetrace.tracer.trace.writer import TraceWriter


def make_trace(
    path: Path,
    *,
    model: str | None = None,
    datasets: tuple[str, ...] = ("code", "math"),
    num_requests: int = 48,
    seed: int = 0,
    preference: float = 0.85,
) -> Path:
    """A complete trace: request r belongs to ``datasets[r % D]``; with probability ``preference``
    a token picks its experts from its dataset's block ``[d*E/D, (d+1)*E/D)``, else uniformly.
    ``model``: a preset name, default :func:`small_model`."""
    m = small_model() if model is None else model_info_for(model)
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
            topk_ids_TX=ids.reshape(T, L * K),
        )
    return path


def small_model(*, num_layers: int = 4, num_experts: int = 8, top_k: int = 2):
    """A 4-layer, 8-expert, top-2 model: big enough for every figure, small enough for fast tests."""
    from moetrace.tracer.trace.schema import ModelInfo

    return ModelInfo(
        name="dash-tiny",
        source="tests",
        architecture="DashTiny",
        num_hidden_layers=num_layers + 1,
        moe_layers=tuple(range(1, num_layers + 1)),  # layer 0 dense: model indices differ from MoE ordinals
        num_experts=num_experts,
        top_k=top_k,
        num_shared_experts=0,
        hidden_size=64,
    )


@dataclass(frozen=True)
class Produced:
    """A trace and the real results of ``analyze`` and ``compare`` on it."""

    trace: Path
    analysis: Path  # the analyze results folder
    compare: Path  # the compare results folder


@functools.cache
def produced() -> Produced:
    """Run the real producers once per test process (UMAP's JIT alone takes ~15 s) and share the outputs.

    The trace: 60 requests of 3 datasets on :func:`small_model`. Analysis: every default analysis
    with 8-request batches. Compare: DP4TP1EP4 on 2-GPU nodes (2 nodes), 30 global batches.
    """
    root = Path(tempfile.mkdtemp(prefix="moetrace-dash-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    trace = make_trace(root / "trace", datasets=("chat", "code", "math"), num_requests=60)
    from typer.testing import CliRunner

    from moetrace.analysis.run import AnalyzeConfig, analyze
    from moetrace.cli import app

    analysis = root / "analysis"
    analyze(trace, analysis, config=AnalyzeConfig(batch_size=8, num_batches=20))
    compare = root / "compare"
    res = CliRunner().invoke(
        app,
        ["compare", str(trace), "--config", "DP4TP1EP4", "--gpus-per-node", "2", "--batches", "30", "-o", str(compare)],
    )
    if res.exit_code != 0:
        raise RuntimeError(f"moetrace compare failed: {res.output}")
    return Produced(trace=trace, analysis=analysis, compare=compare)
