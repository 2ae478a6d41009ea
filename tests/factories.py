"""Shared test factories: the models, traces, responses and helpers more than one test module builds.

A test module imports these from here (``from factories import ...``; pytest puts ``tests/`` on
``sys.path``), never from another test module; each builder is tested where it is used. Fixtures that
wrap them live in ``conftest.py``.

- models: ``SMALL`` (conftest's small trace), ``PLANTED`` (parity domains), ``ADVISE_MODEL``,
  ``TINY_MOE`` (the route proxy's), ``MAV`` (Llama 4 Maverick, tiny), ``tiny_model``, ``small_model``;
- traces: ``write_small_trace`` (random routing), ``write_trace`` (given ids), ``profile_trace``
  (datasets with routing profiles), ``planted_trace`` (parity domains, compare and the replay),
  ``zipf_trace`` (skewed load, advise), ``partial_trace`` (one MoE layer recorded);
- routing and inputs: ``sample_topk``, ``stage_mask``, ``planted_ids``, ``sglang_response``,
  ``write_jsonl``, ``save_expert_dump`` (SGLang's expert-distribution ``.pt``), ``SHORT`` (synth lengths);
- the fused simulation kernel's cases (``test_simulate_fused``, ``test_advise_fused``): ``FUSED_EXPERT``,
  ``FUSED_DEDUPS``, ``redundant_placement``, ``fused_ids``, ``FUSED_SHAPES`` / ``fused_slots`` (hypothesis);
- processes and backends: ``start_lock_holder`` / ``finish_lock_holder`` (a writer holding a trace's
  lock in another process), ``PlantedBackend`` / ``planted_rows`` / ``register_planted_backend``;
- ``tree_hashes``: SHA-256 of every file under a directory.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from hypothesis import strategies as st

from moetrace.placement.cost import ExpertCompute
from moetrace.placement.maps import Placement, placement_from_phy2log
from moetrace.tracer.presets import model_info_for
from moetrace.tracer.synth import PAPER_DATASETS
from moetrace.tracer.trace.schema import ModelInfo
from moetrace.tracer.trace.writer import TraceWriter

# ---------------------------------------------------------------- models
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

#: ``planted_trace``'s model: 2 MoE layers of 16 experts, top-2
PLANTED = ModelInfo(
    name="planted",
    source="test",
    architecture="Test",
    num_hidden_layers=3,
    moe_layers=(1, 2),
    num_experts=16,
    top_k=2,
    num_shared_experts=0,
    hidden_size=8,
)

#: ``zipf_trace``'s model: 2 MoE layers of 16 experts, top-2, hidden size 64
ADVISE_MODEL = ModelInfo(
    name="advise-test",
    source="test",
    architecture="TestMoe",
    num_hidden_layers=3,
    moe_layers=(1, 2),
    num_experts=16,
    top_k=2,
    num_shared_experts=0,
    hidden_size=64,
)

#: the route proxy's model: layer 0 dense, the engines return all 4 decoder layers, the router reads the 3 MoE ones
TINY_MOE = ModelInfo(
    name="tiny-moe",
    source="test/tiny-moe",
    architecture="Test",
    num_hidden_layers=4,
    moe_layers=(1, 2, 3),
    num_experts=16,
    top_k=2,
    num_shared_experts=0,
    hidden_size=64,
)

MAV = model_info_for("llama4-maverick-tiny")  # 48 layers, MoE every 2nd (1, 3, ..., 47), 128 experts, top-1


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


def small_model(*, L: int = 4, E: int = 32, K: int = 4) -> ModelInfo:
    return ModelInfo(
        name="test-moe",
        source="test",
        architecture="TestMoE",
        num_hidden_layers=L,
        moe_layers=tuple(range(L)),
        num_experts=E,
        top_k=K,
        num_shared_experts=0,
        hidden_size=64,
    )


# ---------------------------------------------------------------- traces
def write_small_trace(path, *, num_requests: int = 6, seed: int = 0, model: ModelInfo = SMALL, **writer_kw):
    """A valid trace of random routing: request r has 3+r prompt and 2+r%3 output tokens."""
    rng = np.random.default_rng(seed)
    with TraceWriter(path, model=model, backend={"name": "synthetic"}, collection={"seed": seed}, **writer_kw) as w:
        for r in range(num_requests):
            P, O = 3 + r, 2 + r % 3
            ex = np.stack(
                [
                    np.stack(
                        [rng.choice(model.num_experts, model.top_k, replace=False) for _ in range(model.num_moe_layers)]
                    )
                    for _ in range(P + O)
                ]
            )
            ex[-1] = -1
            w.add_request(request_id=r, dataset=["a", "b"][r % 2], prompt_tokens=P, topk_ids_TX=ex)
    return path


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


def planted_trace(path, *, structured: bool, num_requests: int = 80, seed: int = 0):
    """Two domains; domain d routes only to experts with e % 2 == d (prefill and decode alike)."""
    E, K, L = PLANTED.num_experts, PLANTED.top_k, PLANTED.num_moe_layers
    rng = np.random.default_rng(seed)
    rows, ptok, otok = [], [], []
    for r in range(num_requests):
        d = r % 2
        pool = np.arange(d, E, 2) if structured else np.arange(E)
        p, o = 6, 10
        ids = np.stack([np.stack([rng.choice(pool, K, replace=False) for _ in range(L)]) for _ in range(p + o)])
        ids[-1] = -1  # the final generated token is never forwarded
        rows.append(ids.reshape(p + o, L * K))
        ptok.append(p)
        otok.append(o)
    with TraceWriter(path, model=PLANTED, backend={"name": "synthetic"}, collection={"planted": "parity domains"}) as w:
        w.add_requests(
            request_id_R=np.arange(num_requests),
            dataset_R=[f"d{r % 2}" for r in range(num_requests)],
            prompt_tokens_R=np.array(ptok),
            output_tokens_R=np.array(otok),
            topk_ids_TX=np.concatenate(rows),
        )
    return path


def zipf_trace(path, *, n=48, skew=2.0, stages=("prefill", "decode"), seed=0):
    """Requests of ``ADVISE_MODEL`` whose tokens favour low expert ids (Zipf-like ``skew``; 0: uniform);
    ``stages``: the stages recorded (the other one's ids are -1)."""
    E, K, L = ADVISE_MODEL.num_experts, ADVISE_MODEL.top_k, ADVISE_MODEL.num_moe_layers
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1) ** skew
    p /= p.sum()
    collection = {"seed": seed} if len(stages) == 2 else {"seed": seed, "stages": list(stages)}
    with TraceWriter(path, model=ADVISE_MODEL, backend={"name": "synthetic"}, collection=collection) as w:
        for r in range(n):
            P, O = 12, 10
            ex = np.stack([rng.choice(E, K, replace=False, p=p) for _ in range((P + O) * L)]).reshape(P + O, L * K)
            ex[-1] = -1
            if "prefill" not in stages:
                ex[:P] = -1
            if "decode" not in stages:
                ex[P:] = -1
            w.add_request(request_id=r, dataset="d", prompt_tokens=P, topk_ids_TX=ex)
    return path


#: ``partial_trace``'s model: 4 MoE layers of 8 experts, top-2; layer 2 recorded by default
PARTIAL_L, PARTIAL_RECORDED, PARTIAL_E, PARTIAL_K = 4, 2, 8, 2


def partial_trace(
    path: Path,
    *,
    recorded_layers: tuple[int, ...] = (PARTIAL_RECORDED,),
    requests_per_dataset: int = 20,
    prompt_tokens: int = 12,
    output_tokens: int = 8,
    decode_only: bool = False,
    seed: int = 0,
) -> Path:
    """Two datasets with distinct hot experts; ids -1 at every layer not in ``recorded_layers``
    (and, ``decode_only``, at every prompt position: the manifest then says ``stages: [decode]``)."""
    rng = np.random.default_rng(seed)
    R = 2 * requests_per_dataset
    lens = np.full(R, prompt_tokens + output_tokens)
    d_T = np.repeat(np.arange(R) % 2, lens)
    L, E, K = PARTIAL_L, PARTIAL_E, PARTIAL_K
    p_TLE = np.ones((int(lens.sum()), L, E))
    p_TLE[d_T == 0, :, :3] = 10.0
    p_TLE[d_T == 1, :, 5:] = 10.0
    ids = sample_topk(rng, p_TLE, K)
    ids[:, [l for l in range(L) if l not in recorded_layers]] = -1
    if decode_only:
        pos_T = np.arange(ids.shape[0]) % lens[0]
        ids[pos_T < prompt_tokens] = -1
    return write_trace(
        path,
        model=tiny_model(num_layers=L, num_experts=E, top_k=K),
        dataset_R=[f"ds{r % 2}" for r in range(R)],
        prompt_tokens_R=np.full(R, prompt_tokens),
        output_tokens_R=np.full(R, output_tokens),
        topk_ids_TLK=ids,
        collection={"stages": ["decode"]} if decode_only else None,
    )


# ---------------------------------------------------------------- routing and inputs
def sample_topk(rng: np.random.Generator, p_TLE: np.ndarray, top_k: int) -> np.ndarray:
    """Distinct top-k ids per (token, layer) drawn without replacement from ``p_TLE`` (Gumbel top-k)."""
    g = np.log(np.maximum(p_TLE, 1e-300)) + rng.gumbel(size=p_TLE.shape)
    return np.argsort(-g, axis=-1)[..., :top_k].astype(np.int16)


def stage_mask(prompt_tokens_R: np.ndarray, output_tokens_R: np.ndarray) -> np.ndarray:
    """is_decode_T of requests laid back to back."""
    lens = np.asarray(prompt_tokens_R) + np.asarray(output_tokens_R)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    return (np.arange(lens.sum()) - starts) >= np.repeat(prompt_tokens_R, lens)


def planted_ids(n: int, info, seed: int) -> np.ndarray:
    """int32 [n, L, K]: distinct random experts per (token, MoE layer) of ``info``."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [np.stack([rng.choice(info.num_experts, info.top_k, replace=False) for _ in info.moe_layers]) for _ in range(n)]
    ).astype(np.int32)


def sglang_response(
    prompt: int,
    output: int,
    truth_NLK: np.ndarray,
    info,
    *,
    start: int = 0,
    all_layers=True,
    dtype: str | None = None,
    **top,
):
    """A /generate response as SGLang returns it: base64 of little-endian ids [rows, layers, top_k], rows
    covering [start, prompt+output-1); the layer axis over all decoder layers (dense = 0). The ids are
    int32, or with ``dtype`` the compact encoding named in ``meta_info.routed_experts_dtype``
    (uint8/uint16/int32, SGLang PR #31219)."""
    rows = truth_NLK[start:]
    if all_layers:
        full = np.zeros((len(rows), info.num_hidden_layers, info.top_k), dtype="<i4")
        full[:, list(info.moe_layers)] = rows
        rows = full
    wire = {None: "<i4", "int32": "<i4", "uint16": "<u2", "uint8": "u1"}[dtype]
    meta = {
        "id": "a1b2",
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "cached_tokens": 0,
        "finish_reason": {"type": "length", "length": output},
        "routed_experts": base64.b64encode(np.ascontiguousarray(rows, dtype=wire).tobytes()).decode(),
    }
    if dtype is not None:
        meta["routed_experts_dtype"] = dtype
    if start:
        meta["routed_experts_start_len"] = start
    return {"text": "...", "output_ids": list(range(output)), "meta_info": meta, **top}


def write_jsonl(path: Path, recs) -> Path:
    """``recs`` as JSON lines at ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def save_expert_dump(path: Path, records: list[dict], map_HP: np.ndarray | None) -> Path:
    """SGLang's expert-distribution dump: ``torch.save({"records": ..., "last_physical_to_logical_map": ...})``."""
    import torch

    obj: dict = {"records": records}
    if map_HP is not None:
        obj["last_physical_to_logical_map"] = torch.from_numpy(map_HP)
    torch.save(obj, path)
    return path


#: short requests so a few hundred give enough tokens quickly
SHORT = {
    d: {"prompt_median": 40, "prompt_sigma": 0.2, "output_median": 40, "output_sigma": 0.2} for d in PAPER_DATASETS
}


# ---------------------------------------------------------------- fused simulation kernel's cases
#: the fused-kernel tests' expert: hidden size 64, FFN 32, one shared expert of FFN 48
FUSED_EXPERT = ExpertCompute(hidden_size=64, ffn_size=32, num_shared_experts=1, shared_ffn_size=48)
#: the copy models (``dedup``) the fused-kernel tests run
FUSED_DEDUPS = ("rank", "expert", "node")


def redundant_placement(rng: np.random.Generator, L: int, E: int, P: int) -> Placement:
    """Every expert once plus ``P - E`` random redundant replicas, shuffled over the slots, per layer."""
    phy2log = np.empty((L, P), dtype=np.int64)
    for l in range(L):
        phy2log[l] = rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, P - E)]))
    return placement_from_phy2log(phy2log, num_experts=E)


def fused_ids(rng: np.random.Generator, *, T: int, L: int, K: int, E: int, minus_one: float) -> np.ndarray:
    """int64 [T, L, K]: random experts below ``E``, a ``minus_one`` share of them -1, and (``K > 1``) the
    first tenth of the rows naming one expert twice (the expert copy model counts its slot once)."""
    ids = rng.integers(0, E, (T, L, K))
    ids[rng.random(ids.shape) < minus_one] = -1
    if K > 1:
        ids[: T // 10, :, 1] = ids[: T // 10, :, 0]
    return ids


#: hypothesis strategies of a random fused-kernel case: ``T`` tokens, ``L`` layers, top-``K`` of ``E``
#: experts, a ``minus_one`` share of -1 ids, ``B`` batches, ``nodes`` nodes of ``g`` ranks, ``per_rank``
#: slots a rank (``fused_slots``)
FUSED_SHAPES: dict[str, st.SearchStrategy] = dict(
    seed=st.integers(0, 2**32 - 1),
    T=st.integers(0, 120),
    L=st.integers(1, 3),
    K=st.integers(1, 8),
    E=st.integers(1, 10),
    nodes=st.integers(1, 4),
    g=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 3),
    B=st.integers(1, 4),
    minus_one=st.sampled_from([0.0, 0.2, 0.9]),
)


def fused_slots(E: int, W: int, per_rank: int) -> int:
    """Slots over ``W`` ranks: ``per_rank`` a rank, or as many a rank as hold every expert once."""
    P = W * per_rank
    return P if P >= E else W * -(-E // W)


# ---------------------------------------------------------------- processes and backends
HOLDER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from moetrace.tracer.trace import TraceWriter
    from moetrace.tracer.trace.layout import shard_manifest_name, shard_prefix
    sys.path.insert(0, {tests!r})
    from factories import SMALL
    shard = {shard!r}
    kw = {{}} if shard is None else dict(part_prefix=shard_prefix(shard), manifest_name=shard_manifest_name(shard))
    w = TraceWriter({path!r}, model=SMALL, backend={{"name": "synthetic"}}, collection={{}}, on_existing="resume", **kw)
    ids = np.zeros((4, SMALL.ids_per_token), np.int16)
    w.add_request(request_id=100 + (shard or 0), dataset="held", prompt_tokens=2, topk_ids_TX=ids)
    w.commit()
    print("holding", flush=True)
    sys.stdin.readline()
    w.close()
    print("closed", flush=True)
    """
)


def start_lock_holder(path, *, shard=None) -> subprocess.Popen:
    """A process that opens a trace writer at ``path`` (a shard of it with ``shard``), commits one
    request and holds the writer's lock until ``finish_lock_holder``."""
    code = HOLDER.format(path=str(path), shard=shard, tests=str(Path(__file__).parent))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def finish_lock_holder(proc: subprocess.Popen) -> None:
    """Let the holder close its writer; it must exit cleanly."""
    out, _ = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0 and "closed" in out


def planted_rows(request_id: int, num_tokens: int, *, num_layers: int, num_experts: int, top_k: int) -> np.ndarray:
    """int16 [T, L*K]: distinct experts per (token, layer), seeded by the request id; last row -1."""
    rng = np.random.default_rng(request_id)
    ids_TLK = np.argsort(rng.random((num_tokens, num_layers, num_experts)), axis=-1)[..., :top_k].astype(np.int16)
    ids_TLK[-1] = -1  # the last generated token is never fed back
    return ids_TLK.reshape(num_tokens, num_layers * top_k)


class PlantedBackend:
    """A backend with no engine: it writes planted routing through the same protocol HF and vLLM use."""

    def __init__(self, *, fail_in_run: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_in_run = fail_in_run

    def check_environment(self, generation):
        self.calls.append("check_environment")

    def load(self, resolved, generation):
        self.calls.append("load")
        return resolved.model_info()

    def describe(self):
        from moetrace.tracer.backends.base import BackendDescription

        self.calls.append("describe")
        return BackendDescription(versions={"planted": "1.0"}, settings={"rows": "seeded by request id"})

    def run(self, prompts, *, writer, generation, on_progress=None):
        self.calls.append("run")
        if self.fail_in_run:
            raise RuntimeError("the engine died")
        m = writer.model
        for p in prompts:
            if p.request_id in writer.completed_request_ids:
                continue
            num_prompt = 2 + p.request_id % 3
            rows = planted_rows(
                p.request_id,
                num_prompt + generation.max_new_tokens,
                num_layers=m.num_moe_layers,
                num_experts=m.num_experts,
                top_k=m.top_k,
            )
            writer.add_request(request_id=p.request_id, dataset=p.dataset, prompt_tokens=num_prompt, topk_ids_TX=rows)
            writer.commit()
            if on_progress is not None:
                on_progress(writer.num_requests_written, writer.num_tokens_written)


def register_planted_backend(monkeypatch) -> SimpleNamespace:
    """Registers backend ``planted`` first in the registry (so ``auto`` picks it); returns where its
    built objects go (``built``) and whether the next one fails (``fail_in_run``)."""
    from moetrace.tracer.backends import registry

    state = SimpleNamespace(built=[], fail_in_run=False)

    def build(settings: Any) -> PlantedBackend:
        state.built.append(PlantedBackend(fail_in_run=state.fail_in_run))
        return state.built[-1]

    entry = registry.BackendEntry(
        name="planted",
        description="planted rows (test)",
        build=build,
        auto_here=lambda s: True,
        auto_when="always",
        auto_on_ray=False,
        num_gpus=lambda s: 0.0,
    )
    monkeypatch.setattr(registry, "BACKENDS", {"planted": entry, **registry.BACKENDS})
    return state


# ---------------------------------------------------------------- files
def tree_hashes(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root`` (or of ``root`` itself), by relative path; a pipe by its kind."""
    if root.is_file() or root.is_fifo():
        return {"": "fifo" if root.is_fifo() else hashlib.sha256(root.read_bytes()).hexdigest()}
    out = {}
    for p in sorted(root.rglob("*")):
        if p.name == ".writer.lock" or p.is_dir():
            continue
        out[str(p.relative_to(root))] = "fifo" if p.is_fifo() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out
