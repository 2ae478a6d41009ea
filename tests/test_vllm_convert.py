"""vLLM routed experts → trace rows, on arrays in vLLM's layouts (no vLLM needed).

Layouts (from vLLM's source): the whole sequence in ``CompletionOutput.routed_experts``
``[prompt+output-1, num_hidden_layers, top_k]`` (0.14–0.20 int32, ≥0.22 uint8/uint16; dense layers
are zero rows), or 0.21's split ``RequestOutput.prompt_routed_experts`` + ``routed_experts`` in
int16 with -1 at prefix-cache hits.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from moetrace.errors import ConfigError, MissingDependencyError, ModelError
from moetrace.tracer.presets import model_info_for, resolve
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.writer import TraceWriter
from moetrace.tracer.trace.validate import find_problems
from moetrace.tracer.backends import vllm as V
from moetrace.tracer.backends import vllm_convert as VC

DSV3 = model_info_for("deepseek-v3-tiny")  # 61 layers, MoE 3..60, 256 experts, top-8


def planted(T_moe: int, info=DSV3, *, seed: int = 0) -> np.ndarray:
    """True routing of T_moe forwarded tokens: [T_moe, L, K] distinct ids per (token, layer)."""
    rng = np.random.default_rng(seed)
    return np.stack([
        np.stack([rng.choice(info.num_experts, info.top_k, replace=False) for _ in info.moe_layers])
        for _ in range(T_moe)
    ]).astype(np.int16)


def vllm_full_layout(truth_NLK: np.ndarray, info=DSV3, dtype=np.uint8) -> np.ndarray:
    """vLLM's array: the layer axis sized by all decoder layers, dense layers left at zero."""
    N = truth_NLK.shape[0]
    arr = np.zeros((N, info.num_hidden_layers, info.top_k), dtype=dtype)
    arr[:, list(info.moe_layers), :] = truth_NLK
    return arr


def fake_output(rid: int, prompt: int, output: int, *, routed=None, prompt_routed=None, text=""):
    """A finished ``vllm.RequestOutput`` as far as the converter reads it."""
    completion = SimpleNamespace(token_ids=list(range(output)), routed_experts=routed, text=text)
    out = SimpleNamespace(request_id=str(rid), prompt_token_ids=list(range(prompt)), outputs=[completion],
                          finished=True)
    if prompt_routed is not None:
        out.prompt_routed_experts = prompt_routed
    return out


def convert(arr, prompt, output, info=DSV3):
    return VC.routed_experts_to_rows(arr, moe_layers=info.moe_layers, num_hidden_layers=info.num_hidden_layers,
                                    num_experts=info.num_experts, prompt_tokens=prompt, output_tokens=output)


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


def test_v021_split_layout_with_prefix_cache_sentinel():
    prompt, output = 6, 3
    truth = planted(prompt + output - 1)
    full = vllm_full_layout(truth, dtype=np.int16)
    full[:4] = -1  # prefix-cache hits: nothing recorded for the first 4 prompt tokens
    out = fake_output(0, prompt, output, prompt_routed=full[:prompt], routed=full[prompt:])
    arr = VC.request_routed_experts(out)
    rows = convert(arr, prompt, output)
    assert (rows[:4] == -1).all() and (rows[-1] == -1).all()
    np.testing.assert_array_equal(rows[4:-1].reshape(-1, 58, 8), truth[4:])


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
        sink = V._Sink(w, info=DSV3, datasets={0: "a", 1: "b", 2: "a", 3: "b", 9: "a"}, commit_every=2,
                       on_progress=lambda r, t: progress.append(r), prompt_texts=None)
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
    V.run_engine_loop(llm, work, vllm=fake_vllm, num_inflight=8, max_new_tokens=5, temperature=0.0, seed=0,
                      detokenize=False, emit=emitted.extend)
    assert sorted(int(o.request_id) for o in emitted) == list(range(25))
    assert engine.peak == 8
    assert engine.added[3] == ("3", [1, 2, 3], 5)


def test_engine_config_checks_and_pass_through():
    kw = V.VllmEngineConfig(tp=8, ep=8, max_model_len=4096, enforce_eager=True).llm_kwargs()
    assert kw["tensor_parallel_size"] == 8 and kw["enable_expert_parallel"] is True
    assert kw["enable_return_routed_experts"] is True and kw["max_model_len"] == 4096 and kw["enforce_eager"]
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
    pytest.importorskip("transformers")
    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4,
           "hidden_size": 64, "num_experts": 16, "num_experts_per_tok": 4, "decoder_sparse_step": 1,
           "mlp_only_layers": [0], "intermediate_size": 64, "moe_intermediate_size": 32,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    source, info = V.model_for_vllm(resolve(str(tmp_path)))
    assert source == str(tmp_path) and info.moe_layers == (1, 2, 3) and info.num_experts == 16 and info.top_k == 4
    dense = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "intermediate_size": 64, "vocab_size": 384}
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
