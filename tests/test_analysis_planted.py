"""Builders of small traces with planted structure for the analysis tests (and tests of the builders).

Other ``test_analysis*`` modules import these helpers (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import ModelInfo
from moetrace.tracer.trace.validate import find_problems
from moetrace.tracer.trace.writer import TraceWriter


def tiny_model(*, num_layers: int = 2, num_experts: int = 8, top_k: int = 2) -> ModelInfo:
    return ModelInfo(
        name="planted",
        source="tests",
        architecture="Planted",
        num_hidden_layers=num_layers,
        moe_layers=tuple(range(num_layers)),
        num_experts=num_experts,
        top_k=top_k,
        num_shared_experts=0,
        hidden_size=64,
    )


def write_trace(
    path: Path,
    *,
    model: ModelInfo,
    dataset_R: list[str],
    prompt_tokens_R: np.ndarray,
    output_tokens_R: np.ndarray,
    topk_ids_TLK: np.ndarray,
    collection: dict | None = None,
    request_id_R: np.ndarray | None = None,
) -> Path:
    R = len(dataset_R)
    rid = np.arange(R, dtype=np.int64) * 7 + 3 if request_id_R is None else request_id_R
    with TraceWriter(
        path,
        model=model,
        backend={"name": "synthetic"},
        collection=collection or {},
        part_tokens=2000,
        row_group_tokens=700,
    ) as w:
        w.add_requests(
            request_id_R=rid,
            dataset_R=dataset_R,
            prompt_tokens_R=np.asarray(prompt_tokens_R, np.int32),
            output_tokens_R=np.asarray(output_tokens_R, np.int32),
            topk_ids_TX=topk_ids_TLK.reshape(topk_ids_TLK.shape[0], -1),
        )
    return path


def sample_topk(rng: np.random.Generator, p_TLE: np.ndarray, top_k: int) -> np.ndarray:
    """Distinct top-k ids per (token, layer) drawn without replacement from ``p_TLE`` (Gumbel top-k)."""
    g = np.log(np.maximum(p_TLE, 1e-300)) + rng.gumbel(size=p_TLE.shape)
    return np.argsort(-g, axis=-1)[..., :top_k].astype(np.int16)


def stage_mask(prompt_tokens_R: np.ndarray, output_tokens_R: np.ndarray) -> np.ndarray:
    """is_decode_T of requests laid back to back."""
    lens = np.asarray(prompt_tokens_R) + np.asarray(output_tokens_R)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    return (np.arange(lens.sum()) - starts) >= np.repeat(prompt_tokens_R, lens)


def profile_trace(
    path: Path,
    *,
    profiles_DSLE: np.ndarray,
    requests_per_dataset: int,
    prompt_tokens: int = 30,
    output_tokens: int = 20,
    top_k: int = 2,
    seed: int = 0,
    per_request_noise: float = 0.0,
) -> Path:
    """Requests of D datasets; a token of dataset d, stage s at layer l draws its top-k from
    ``profiles_DSLE[d, s, l]`` (optionally times a per-request log-normal jitter)."""
    rng = np.random.default_rng(seed)
    D, S, L, E = profiles_DSLE.shape
    R = D * requests_per_dataset
    d_R = np.repeat(np.arange(D), requests_per_dataset)
    rng.shuffle(d_R)
    ptok = np.full(R, prompt_tokens)
    otok = np.full(R, output_tokens)
    lens = ptok + otok
    dec_T = stage_mask(ptok, otok)
    d_T = np.repeat(d_R, lens)
    p_TLE = profiles_DSLE[d_T, dec_T.astype(int)]
    if per_request_noise:
        jit = np.exp(rng.normal(0, per_request_noise, size=(R, L, E)))
        p_TLE = p_TLE * np.repeat(jit, lens, axis=0)
    ids = sample_topk(rng, p_TLE, top_k)
    return write_trace(
        path,
        model=tiny_model(num_layers=L, num_experts=E, top_k=top_k),
        dataset_R=[f"ds{d}" for d in d_R],
        prompt_tokens_R=ptok,
        output_tokens_R=otok,
        topk_ids_TLK=ids,
    )


# ---------------------------------------------------------------------------------- builder tests
def test_profile_trace_is_valid_and_follows_its_profile(tmp_path):
    E = 6
    prof = np.ones((2, 2, 1, E))
    prof[0, :, 0, 0] = 50.0  # dataset 0 strongly prefers expert 0
    path = profile_trace(tmp_path / "t", profiles_DSLE=prof, requests_per_dataset=20, top_k=1)
    assert find_problems(path) == []
    arr = open_trace(path).token_arrays()
    assert arr.topk_ids_TLK.shape[1:] == (1, 1)
    assert (arr.topk_ids_TLK[:, 0, 0] == 0).mean() > 0.4  # half the tokens are dataset 0, ~90% of those on expert 0


def test_sample_topk_draws_distinct_ids():
    rng = np.random.default_rng(1)
    ids = sample_topk(rng, np.ones((500, 3, 8)), 4)
    srt = np.sort(ids, axis=-1)
    assert np.all(srt[..., 1:] != srt[..., :-1])
