"""vLLM routed experts → trace rows, on arrays in vLLM's layouts (no vLLM needed), and the collect
path's parent side up to the engine with a fake ``vllm`` module.

Layouts (from vLLM's source, see docs/collecting.md): the whole sequence in
``CompletionOutput.routed_experts`` ``[prompt+output-1, num_hidden_layers, top_k]`` indexed by
decoder layer (0.14–0.20 int32, ≥0.22 uint8/uint16; dense layers are zero rows); 0.21's split
``RequestOutput.prompt_routed_experts`` + ``routed_experts`` in int16 with a MoE-ordinal layer axis
(sized by vLLM's MoE-layer count, all layers for DeepSeek-style configs, trailing rows zero); the
HTTP server's base64 ``.npy`` text (≥0.22).
"""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import types
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ConfigError, MissingDependencyError, ModelError
from moetrace.tracer.backends import vllm as V
from moetrace.tracer.backends import vllm_convert as VC
from moetrace.tracer.backends.base import GenerationConfig
from moetrace.tracer.collect import CollectConfig, collect
from moetrace.tracer.presets import model_info_for, resolve
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.validate import find_problems
from moetrace.tracer.trace.writer import TraceWriter

DSV3 = model_info_for("deepseek-v3-tiny")  # 61 layers, MoE 3..60, 256 experts, top-8


def planted(T_moe: int, info=DSV3, *, seed: int = 0) -> np.ndarray:
    """True routing of T_moe forwarded tokens: [T_moe, L, K] distinct ids per (token, layer), within
    ``topk_group`` of the router's groups when it is group-limited (as the real router picks them)."""
    rng = np.random.default_rng(seed)
    E, K = info.num_experts, info.top_k

    def one() -> np.ndarray:
        if not info.n_group:
            return rng.choice(E, K, replace=False)
        size = E // info.n_group
        groups = rng.choice(info.n_group, info.topk_group, replace=False)
        return rng.choice(np.concatenate([np.arange(g * size, (g + 1) * size) for g in groups]), K, replace=False)

    return np.stack([np.stack([one() for _ in info.moe_layers]) for _ in range(T_moe)]).astype(np.int16)


def vllm_full_layout(truth_NLK: np.ndarray, info=DSV3, dtype=np.uint8) -> np.ndarray:
    """vLLM's array: the layer axis sized by all decoder layers, dense layers left at zero."""
    N = truth_NLK.shape[0]
    arr = np.zeros((N, info.num_hidden_layers, info.top_k), dtype=dtype)
    arr[:, list(info.moe_layers), :] = truth_NLK
    return arr


def vllm021_layout(truth_NLK: np.ndarray, info=DSV3) -> np.ndarray:
    """vLLM 0.21's array: int16, the layer axis by MoE ordinal and sized by vLLM's MoE-layer count,
    which for DeepSeek-style configs (no ``mlp_only_layers``) is all decoder layers: the first L rows
    hold the MoE layers, the rest stay 0."""
    N = truth_NLK.shape[0]
    arr = np.zeros((N, info.num_hidden_layers, info.top_k), dtype=np.int16)
    arr[:, : info.num_moe_layers, :] = truth_NLK
    return arr


def npy_base64(arr: np.ndarray, *, as_bytes: bool = False):
    """What vLLM's HTTP server (≥ 0.22) sends: base64 of the array's ``.npy`` file."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    text = base64.b64encode(buf.getvalue())
    return text if as_bytes else text.decode("ascii")


_SPLIT = object()


def fake_output(rid: int, prompt: int, output: int, *, routed=None, prompt_routed=_SPLIT, text=""):
    """A finished ``vllm.RequestOutput`` as far as the converter reads it (``prompt_routed`` given,
    even None: 0.21's split layout, whose ``RequestOutput`` has that attribute)."""
    completion = SimpleNamespace(token_ids=list(range(output)), routed_experts=routed, text=text)
    out = SimpleNamespace(
        request_id=str(rid), prompt_token_ids=list(range(prompt)), outputs=[completion], finished=True
    )
    if prompt_routed is not _SPLIT:
        out.prompt_routed_experts = prompt_routed
    return out


def convert(arr, prompt, output, info=DSV3, layer_axis="decoder"):
    return VC.routed_experts_to_rows(
        arr,
        moe_layers=info.moe_layers,
        num_hidden_layers=info.num_hidden_layers,
        num_experts=info.num_experts,
        prompt_tokens=prompt,
        output_tokens=output,
        layer_axis=layer_axis,
    )


def test_full_layer_axis_keeps_moe_layers_and_marks_final_token():
    prompt, output = 7, 4
    truth = planted(prompt + output - 1)
    rows = convert(vllm_full_layout(truth), prompt, output)
    assert rows.dtype == np.int16 and rows.shape == (prompt + output, DSV3.ids_per_token)
    np.testing.assert_array_equal(rows[:-1].reshape(-1, DSV3.num_moe_layers, DSV3.top_k), truth)
    assert (rows[-1] == -1).all()  # the last generated token was never forwarded


def test_row_for_final_token_is_dropped_and_compact_layer_axis_accepted():
    prompt, output = 3, 2
    truth = planted(prompt + output)  # a version that returns T rows: the last one means nothing
    rows = convert(truth, prompt, output)  # layer axis = MoE layers only
    np.testing.assert_array_equal(rows[:-1].reshape(-1, 58, 8), truth[:-1])
    assert (rows[-1] == -1).all()


def test_uint16_ids_for_more_than_256_experts():
    info = model_info_for("qwen3-30b-a3b-tiny")
    truth = planted(5, info)
    rows = convert(vllm_full_layout(truth, info, dtype=np.uint16), 4, 2, info)
    np.testing.assert_array_equal(rows[:-1].reshape(5, 48, 8), truth)


def test_v021_split_layout_moe_ordinal_layer_axis():
    """DeepSeek-V3 in 0.21: 61 rows on the layer axis, rows 0..57 = MoE layers 3..60 in order."""
    prompt, output = 6, 3
    truth = planted(prompt + output - 1)
    full = vllm021_layout(truth)
    out = fake_output(0, prompt, output, prompt_routed=full[:prompt], routed=full[prompt:])
    c = VC.convert_output(out, info=DSV3, layer_axis="moe")
    np.testing.assert_array_equal(c.topk_ids_TX[:-1].reshape(-1, 58, 8), truth)
    assert (c.topk_ids_TX[-1] == -1).all()
    # read by decoder index, the same array would be misread (every layer shifted by 3): the version decides
    assert not np.array_equal(VC.convert_output(out, info=DSV3).topk_ids_TX, c.topk_ids_TX)
    stray = full.copy()
    stray[0, 60, 0] = 5  # data past the MoE rows: not the 0.21 layout
    with pytest.raises(ValueError, match="beyond the first 58"):
        convert(stray, prompt, output, layer_axis="moe")


def test_v021_sentinel_single_token_and_preempted_request():
    info = model_info_for("qwen3-30b-a3b-tiny")  # every layer MoE: 0.21's axis is exactly the MoE layers
    truth = planted(5, info)
    full = truth.astype(np.int16)
    full[:2] = -1  # the sentinel 0.21's docs describe for prefix-cache hits stays "not recorded"
    one = fake_output(1, 5, 1, prompt_routed=full, routed=None)  # one generated token: no generated rows
    c = VC.convert_output(one, info=info, layer_axis="moe")
    assert (c.topk_ids_TX[:2] == -1).all() and (c.topk_ids_TX[-1] == -1).all()
    np.testing.assert_array_equal(c.topk_ids_TX[2:5].reshape(3, 48, 8), truth[2:])
    preempted = fake_output(2, 5, 3, prompt_routed=None, routed=None)  # 0.21 drops a preempted request's routing
    assert VC.request_routed_experts(preempted) is None
    failed = VC.convert_or_fail(preempted, info=info, layer_axis="moe")
    assert isinstance(failed, VC.FailedRequest) and "no routed experts" in failed.reason


@pytest.mark.parametrize("as_bytes", [False, True])
def test_base64_npy_payloads_as_str_and_bytes(as_bytes):
    """vLLM's HTTP server (≥ 0.22) sends routed_experts as base64 of an .npy file."""
    prompt, output = 4, 3
    truth = planted(prompt + output - 1)
    payload = npy_base64(vllm_full_layout(truth), as_bytes=as_bytes)
    rows = convert(payload, prompt, output)
    np.testing.assert_array_equal(rows[:-1].reshape(-1, 58, 8), truth)
    c = VC.convert_output(fake_output(3, prompt, output, routed=payload), info=DSV3)
    np.testing.assert_array_equal(c.topk_ids_TX, rows)
    split = vllm021_layout(truth)  # the same text form works for each part of the split layout
    out = fake_output(
        4,
        prompt,
        output,
        prompt_routed=npy_base64(split[:prompt], as_bytes=as_bytes),
        routed=npy_base64(split[prompt:], as_bytes=as_bytes),
    )
    np.testing.assert_array_equal(VC.convert_output(out, info=DSV3, layer_axis="moe").topk_ids_TX, rows)


@pytest.mark.parametrize(
    "payload, match",
    [
        ("not base64!", "not base64"),
        (b"\xff\xfe", "not base64"),
        (base64.b64encode(b"hello, not an npy file").decode(), "not of a .npy array file"),
        (base64.b64encode(b"").decode(), "not of a .npy array file"),
        (base64.b64encode(b"PK\x03\x04not a zip either"), "not of a .npy array file"),  # never opened as .npz
        (base64.b64encode(b"\x93NUMPY\x01\x00truncated header"), "not of a .npy array file"),
        (npy_base64(np.zeros((3, 61, 8), dtype=np.float32)), "integer expert ids"),
        ([[[0, 1]], [[2]]], "rectangular|integer"),
    ],
)
def test_garbage_payloads_are_clean_errors(payload, match):
    with pytest.raises(ValueError, match=match):
        VC.routed_experts_array(payload)
    failed = VC.convert_or_fail(fake_output(7, 2, 2, routed=payload), info=DSV3)
    assert isinstance(failed, VC.FailedRequest) and failed.request_id == 7


def test_pickled_npy_is_never_loaded():
    buf = io.BytesIO()
    np.save(buf, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="not of a .npy array file"):
        VC.routed_experts_array(base64.b64encode(buf.getvalue()).decode())


def test_single_generated_token_has_only_prompt_rows():
    truth = planted(5)
    out = fake_output(0, 5, 1, routed=vllm_full_layout(truth))
    c = VC.convert_output(out, info=DSV3)
    assert (c.prompt_tokens, c.output_tokens) == (5, 1)
    np.testing.assert_array_equal(c.topk_ids_TX[:5].reshape(5, 58, 8), truth)
    assert (c.topk_ids_TX[5] == -1).all()


@pytest.mark.parametrize(
    "shape_fix, match",
    [
        (lambda a: a[:, :50], "50 layers; expected 61 .* or 58"),
        (lambda a: a[:-2], "cover 7 tokens"),
        (lambda a: a[0], r"\[tokens, layers, top_k\]"),
    ],
)
def test_bad_shapes_are_named(shape_fix, match):
    arr = vllm_full_layout(planted(9))
    with pytest.raises(ValueError, match=match):
        convert(shape_fix(arr), 6, 4)


def test_ids_outside_expert_range_are_rejected():
    arr = vllm_full_layout(planted(3), dtype=np.int32)
    arr[1, 5, 0] = 256
    with pytest.raises(ValueError, match="outside 0..255"):
        convert(arr, 2, 2)


def test_several_requests_through_the_writer_thread_read_back_exactly(tmp_path):
    """Finished outputs → _Sink (conversion + Parquet on its own thread) → a valid trace."""
    shapes = {0: (5, 3), 1: (9, 1), 2: (2, 6), 3: (4, 4)}
    truths = {rid: planted(p + o - 1, seed=rid) for rid, (p, o) in shapes.items()}
    outputs = [fake_output(rid, p, o, routed=vllm_full_layout(truths[rid])) for rid, (p, o) in shapes.items()]
    outputs.append(fake_output(9, 4, 2, routed=vllm_full_layout(planted(2))))  # wrong length: not written
    progress = []
    with TraceWriter(tmp_path / "t", model=DSV3, backend={"name": "vllm"}, collection={}) as w:
        sink = V._Sink(
            w,
            info=DSV3,
            datasets={0: "a", 1: "b", 2: "a", 3: "b", 9: "a"},
            commit_every=2,
            on_progress=lambda r, t: progress.append(r),
            prompt_texts=None,
        )
        sink.put(outputs[:2])
        sink.put(outputs[2:])
        sink.close()
    assert [rid for rid, _ in sink.failed] == [9]
    assert progress[-1] == 4
    assert find_problems(tmp_path / "t") == []
    tr = open_trace(tmp_path / "t")
    ta = tr.token_arrays()
    for rid, (p, o) in shapes.items():
        sel = ta.request_id_T == rid
        assert ta.position_T[sel].tolist() == list(range(p + o))
        assert ta.is_decode_T[sel].tolist() == [False] * p + [True] * o
        np.testing.assert_array_equal(ta.topk_ids_TLK[sel][:-1], truths[rid])
        assert (ta.topk_ids_TLK[sel][-1] == -1).all()
    req = tr.requests().collect().sort("request_id")
    assert req["dataset"].to_list() == ["a", "b", "a", "b"]


class _FakeEngine:
    """Finishes each request a fixed number of steps after it was added (records the in-flight peak)."""

    def __init__(self, steps: int):
        self.steps, self.live, self.peak, self.added = steps, {}, 0, []

    def add_request(self, rid, prompt, params):
        self.live[rid] = self.steps
        self.added.append((rid, prompt["prompt_token_ids"], params.max_tokens))
        self.peak = max(self.peak, len(self.live))

    def step(self):
        done = []
        for rid in list(self.live):
            self.live[rid] -= 1
            if self.live[rid] == 0:
                del self.live[rid]
                done.append(SimpleNamespace(request_id=rid, finished=True))
        return done


def test_engine_loop_keeps_the_window_full_and_emits_every_request():
    engine = _FakeEngine(steps=3)
    llm = SimpleNamespace(llm_engine=engine)
    fake_vllm = SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw))
    work = iter([(i, [1, 2, i]) for i in range(25)])
    emitted = []
    V.run_engine_loop(
        llm, work, vllm=fake_vllm, num_inflight=8, generation=GenerationConfig(max_new_tokens=5), emit=emitted.extend
    )
    assert sorted(int(o.request_id) for o in emitted) == list(range(25))
    assert engine.peak == 8
    assert engine.added[3] == ("3", [1, 2, 3], 5)


def test_sampling_params_come_from_the_one_generation_config():
    fake_vllm = SimpleNamespace(SamplingParams=lambda **kw: kw)
    greedy = V._sampling_params(fake_vllm, request_id=7, generation=GenerationConfig(max_new_tokens=9))
    assert greedy == {"n": 1, "max_tokens": 9, "temperature": 0.0, "seed": None, "detokenize": False}
    sampled = V._sampling_params(
        fake_vllm, request_id=7, generation=GenerationConfig(temperature=0.7, seed=3, store_text=True)
    )
    assert sampled["seed"] == 3 * 1_000_003 + 7 and sampled["detokenize"] is True and sampled["temperature"] == 0.7


def test_engine_config_checks_and_pass_through():
    kw = V.VllmEngineConfig(tp=8, ep=8, max_model_len=4096, enforce_eager=True).llm_kwargs(
        capture=V.capture_facts((0, 22, 1))
    )
    assert kw["tensor_parallel_size"] == 8 and kw["enable_expert_parallel"] is True
    assert kw["enable_return_routed_experts"] is True and kw["max_model_len"] == 4096 and kw["enforce_eager"]
    assert "enable_prefix_caching" not in kw  # 0.22: capture works with vLLM's default, either way
    assert V.VllmEngineConfig(tp=1, dp=8, ep=8).num_gpus == 8
    with pytest.raises(ConfigError, match="1 .off. or tp\\*dp = 16"):
        V.VllmEngineConfig(tp=8, dp=2, ep=4)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        V.VllmEngineConfig(gpu_memory_utilization=1.5)


def test_split_evenly():
    assert [len(p) for p in V.split_evenly(list(range(10)), 4)] == [3, 3, 2, 2]
    assert sum(V.split_evenly(list(range(10)), 4), []) == list(range(10))
    assert V.split_evenly([1], 3) == [[1], [], []]


def test_model_resolution(tmp_path):
    source, info = V.model_for_vllm(resolve("deepseek-v3"))
    assert source == "deepseek-ai/DeepSeek-V3" and info.moe_layers[0] == 3 and len(info.moe_layers) == 58
    with pytest.raises(ModelError, match="--backend hf"):
        V.model_for_vllm(resolve("deepseek-v3-tiny"))
    cfg = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 384,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    source, info = V.model_for_vllm(resolve(str(tmp_path)))
    assert source == str(tmp_path) and info.moe_layers == (1, 2, 3) and info.num_experts == 16 and info.top_k == 4
    dense = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "vocab_size": 384,
    }
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(dense))
    with pytest.raises(ModelError, match="not a Mixture-of-Experts"):
        V.model_for_vllm(resolve(str(tmp_path / "d")))


def test_missing_vllm_fails_early_with_install_hint():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; this checks the error without it")
    with pytest.raises(MissingDependencyError, match=r"moetrace\[vllm\]"):
        V.check_environment(V.VllmEngineConfig())


# ---------------------------------------------------------------------------- engine facts by version


@pytest.mark.parametrize(
    "version, releases, layer_axis, prefix, v2",
    [
        ((0, 14, 0), "0.14-0.20", "decoder", None, False),
        ((0, 20, 2), "0.14-0.20", "decoder", None, False),
        ((0, 21, 0), "0.21", "moe", False, False),
        ((0, 22, 1), "0.22-0.27", "decoder", None, False),
        ((0, 27, 1), "0.22-0.27", "decoder", None, False),
        ((0, 28, 0), "0.28-0.30", "decoder", None, None),
        ((0, 31, 0), ">=0.31", "decoder", True, True),
        ((0, 33, 0), ">=0.31", "decoder", True, True),
    ],
)
def test_capture_facts_by_release(version, releases, layer_axis, prefix, v2):
    facts = V.capture_facts(version)
    assert (facts.releases, facts.layer_axis, facts.enable_prefix_caching, facts.model_runner_v2) == (
        releases,
        layer_axis,
        prefix,
        v2,
    )
    kw = V.VllmEngineConfig().llm_kwargs(capture=facts)
    assert kw.get("enable_prefix_caching", "vLLM default") == ("vLLM default" if prefix is None else prefix)


def test_capture_facts_refuse_releases_without_capture_and_versions_parse():
    with pytest.raises(ModelError, match=r"0\.13\.0 cannot return routed experts .*>= 0\.14"):
        V.capture_facts((0, 13, 0))
    assert V.MIN_VLLM == (0, 14)
    assert V.parse_vllm_version("0.22.1+cu130") == (0, 22, 1)
    assert V.parse_vllm_version("0.11.1rc2.dev12") == (0, 11, 1)
    assert V.parse_vllm_version("1.0") == (1, 0)
    with pytest.raises(ModelError, match="cannot read the vLLM version"):
        V.parse_vllm_version("dev")


@pytest.mark.parametrize(
    "version, env, match",
    [
        ((0, 22, 1), {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "only with the V1 model runner"),
        ((0, 21, 0), {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "only with the V1 model runner"),
        ((0, 32, 0), {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "only with Model Runner V2"),
        ((0, 32, 0), {"VLLM_USE_V2_MODEL_RUNNER": "yes"}, "0 or 1"),
        ((0, 22, 1), {"VLLM_USE_V2_MODEL_RUNNER": "0"}, None),
        ((0, 28, 0), {"VLLM_USE_V2_MODEL_RUNNER": "1"}, None),
        ((0, 32, 0), {}, None),
    ],
)
def test_model_runner_switch_is_checked_against_the_capture(version, env, match):
    problem = V.capture_env_problem(V.capture_facts(version), env)
    if match is None:
        assert problem is None
    else:
        assert problem is not None and match in problem


def test_visible_gpu_count_initialises_no_cuda():
    import torch

    n = V.visible_gpu_count()
    assert n >= 0 and not torch.cuda.is_initialized()


# ---------------------------------------------------------------------------- the collect path, fake vLLM


class _FakeTokenizer:
    chat_template = None

    def encode(self, text):
        return list(text.encode()[:40]) or [1]


class _FakeVllm:
    """A ``vllm`` module as far as moetrace uses it: ``__version__``, ``SamplingParams`` and ``LLM``.

    Its engine finishes every request at the next step and returns routing in the layout of
    ``version`` for the planted truth of each request; ``drop`` request ids come back without routing
    (0.21's preempted requests). ``fail`` is raised by ``LLM(...)`` instead of starting.
    """

    def __init__(self, version, *, drop=(), fail=None):
        self.module = types.ModuleType("vllm")
        self.module.__version__ = version
        self.module.SamplingParams = lambda **kw: SimpleNamespace(**kw)
        self.module.LLM = self._llm
        self.nums = V.parse_vllm_version(version)
        self.drop, self.fail = set(drop), fail
        self.starts, self.added, self.truth = [], [], {}

    def _llm(self, model, **kw):
        import torch

        self.starts.append(
            {
                "model": model,
                "kw": kw,
                "cuda_initialized": torch.cuda.is_initialized(),
                "method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
            }
        )
        if self.fail is not None:
            raise self.fail
        fake = self
        live = []

        class Engine:
            model_config = SimpleNamespace(max_model_len=4096)

            def add_request(self, rid, prompt, params):
                fake.added.append(int(rid))
                live.append((rid, prompt["prompt_token_ids"], params.max_tokens))

            def step(self):
                done = [fake._output(*item) for item in live]
                live.clear()
                return done

        return SimpleNamespace(llm_engine=Engine(), get_tokenizer=lambda: _FakeTokenizer())

    def _output(self, rid, prompt_ids, max_tokens):
        P, O = len(prompt_ids), max_tokens
        truth = planted(P + O - 1, seed=int(rid))
        self.truth[int(rid)] = (P, O, truth)
        if self.nums[:2] == (0, 21):
            full = vllm021_layout(truth)
            if int(rid) in self.drop:
                return fake_output(int(rid), P, O, prompt_routed=None, routed=None)
            return fake_output(int(rid), P, O, prompt_routed=full[:P], routed=full[P:] if O > 1 else None)
        dtype = np.int32 if self.nums[:2] <= (0, 20) else np.uint8
        return fake_output(
            int(rid), P, O, routed=None if int(rid) in self.drop else vllm_full_layout(truth, dtype=dtype)
        )


@pytest.fixture
def fake_vllm_env(monkeypatch):
    """No multiprocessing method chosen, 8 GPUs counted, and any CUDA initialisation in this process
    an error; returns a function installing a fake ``vllm`` module."""
    import torch

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "unset")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")  # restored (removed) after the test
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(V, "visible_gpu_count", lambda: 8)

    def no_cuda(*a, **k):
        raise AssertionError("the collect path must not initialise CUDA in the parent")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)  # by default it initialises the driver
    monkeypatch.setattr(torch.cuda, "init", no_cuda)

    def install(fake):
        monkeypatch.setitem(sys.modules, "vllm", fake.module)
        return fake

    return install


CFG = CollectConfig(model="deepseek-v3", datasets=("math-word",), per_dataset=4, max_new_tokens=3, device="cuda")


def _check_trace(out, fake, rids):
    assert find_problems(out) == []
    ta = open_trace(out).token_arrays()
    for rid in rids:
        P, O, truth = fake.truth[rid]
        sel = ta.request_id_T == rid
        assert ta.position_T[sel].tolist() == list(range(P + O))
        np.testing.assert_array_equal(ta.topk_ids_TLK[sel][:-1], truth)
        assert (ta.topk_ids_TLK[sel][-1] == -1).all()


@pytest.mark.parametrize("version", ["0.14.0", "0.20.2", "0.22.1", "0.32.0"])
def test_parent_side_before_the_engine_spawn_no_cuda_and_rows_exact(fake_vllm_env, tmp_path, monkeypatch, version):
    import torch

    fake = fake_vllm_env(_FakeVllm(version))
    checks = []  # every look at vLLM's version and at the GPUs: once per run

    def counted(name):
        real = getattr(V, name)

        def call():
            checks.append(name)
            return real()

        return call

    for name in ("vllm_version", "visible_gpu_count"):
        monkeypatch.setattr(V, name, counted(name))
    result = collect(CFG, out=tmp_path / "t", backend="vllm", engine=V.VllmEngineConfig())
    assert checks == ["vllm_version", "visible_gpu_count"]
    (start,) = fake.starts
    assert start["cuda_initialized"] is False and start["method"] == "spawn"
    assert start["model"] == "deepseek-ai/DeepSeek-V3" and start["kw"]["enable_return_routed_experts"] is True
    facts = V.capture_facts(fake.nums)
    assert start["kw"].get("enable_prefix_caching") == facts.enable_prefix_caching
    assert result.num_new_requests == 4
    _check_trace(tmp_path / "t", fake, range(4))
    backend = open_trace(tmp_path / "t").manifest["backend"]
    assert backend["name"] == "vllm" and backend["versions"] == {"vllm": version, "torch": torch.__version__}
    assert backend["capture"]["releases"] == facts.releases and backend["model_source"] == "deepseek-ai/DeepSeek-V3"
    assert set(backend) == {"name", "versions", "model_source", "engine", "capture", "routed_experts"}


def test_user_chosen_multiproc_method_is_kept(fake_vllm_env, tmp_path, monkeypatch):
    fake = fake_vllm_env(_FakeVllm("0.22.1"))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    collect(CFG, out=tmp_path / "t", backend="vllm", engine=V.VllmEngineConfig())
    assert fake.starts[0]["method"] == "fork"


def test_v021_prefix_caching_off_and_preempted_request_retried_by_resume(fake_vllm_env, tmp_path):
    fake = fake_vllm_env(_FakeVllm("0.21.0", drop={2}))
    with pytest.warns(UserWarning, match="1 request.*--resume"):
        result = collect(CFG, out=tmp_path / "t", backend="vllm", engine=V.VllmEngineConfig())
    assert fake.starts[0]["kw"]["enable_prefix_caching"] is False
    assert result.num_new_requests == 3
    run = open_trace(tmp_path / "t").manifest["vllm_run"]
    assert run["num_failed_requests"] == 1 and run["failed_examples"][0].startswith("2: ")
    _check_trace(tmp_path / "t", fake, [0, 1, 3])

    again = fake_vllm_env(_FakeVllm("0.21.0"))  # the next run returns routing for it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = collect(CFG, out=tmp_path / "t", backend="vllm", engine=V.VllmEngineConfig(), on_existing="resume")
    assert again.added == [2] and result.num_new_requests == 1
    _check_trace(tmp_path / "t", again, [2])
    assert open_trace(tmp_path / "t").manifest["vllm_run"]["num_failed_requests"] == 0


def test_model_runner_env_refused_before_anything_is_written(fake_vllm_env, tmp_path, monkeypatch):
    fake = fake_vllm_env(_FakeVllm("0.22.1"))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ConfigError, match="V1 model runner"):
        collect(CFG, out=tmp_path / "t", backend="vllm", engine=V.VllmEngineConfig())
    assert not fake.starts and not (tmp_path / "t").exists()


class OutOfMemoryError(RuntimeError):
    """Stands in for ``torch.OutOfMemoryError`` (a RuntimeError)."""


@pytest.mark.parametrize(
    "exc, hint",
    [
        (
            RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}"),
            "engine process's own error is in the log above. Usual causes: no attention backend",
        ),
        (
            ValueError("No valid attention backend found for cuda with head_size: 8, dtype: torch.bfloat16"),
            "head_size: 8",
        ),
        (
            OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 0 has a total capacity of 79 GiB"),
            "Not enough GPU memory: raise --gpu-memory-utilization",
        ),
        (
            TypeError("LLM.__init__() got an unexpected keyword argument 'enable_return_routed_experts'"),
            "unexpected keyword argument",
        ),
    ],
)
def test_engine_start_failure_is_one_model_error_line(fake_vllm_env, tmp_path, exc, hint):
    fake_vllm_env(_FakeVllm("0.22.1", fail=exc))
    with pytest.raises(ModelError) as info:
        collect(CFG, out=tmp_path / "t", backend="vllm", engine=V.VllmEngineConfig())
    msg = str(info.value)
    assert "\n" not in msg and hint in msg and type(exc).__name__ in msg
    assert msg.startswith("vLLM could not start an engine for 'deepseek-ai/DeepSeek-V3'")
    assert info.value.__cause__ is exc


def test_engine_start_failure_from_the_cli_is_one_clean_line(fake_vllm_env, tmp_path):
    fake_vllm_env(
        _FakeVllm(
            "0.26.0",
            fail=RuntimeError(
                "Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': 1}"
            ),
        )
    )
    res = CliRunner().invoke(
        app,
        [
            "collect",
            "--backend",
            "vllm",
            "--model",
            "deepseek-v3",
            "--dataset",
            "math-word",
            "--per-dataset",
            "2",
            "--max-new-tokens",
            "2",
            "-o",
            str(tmp_path / "t"),
        ],
    )
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "Engine core initialization failed" in res.output
    assert "no attention backend for the model's head dimensions" in res.output
    assert not (tmp_path / "t").exists(), "a run that never started left a trace that would need --overwrite"
