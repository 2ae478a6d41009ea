"""The real vLLM engine on a tiny MoE config with dummy weights (needs vLLM ≥ 0.14 and a CUDA GPU).

Result on a GPU is recorded in docs/collecting.md ("Real-engine test"). The test process itself
never initialises CUDA (GPUs are counted through NVML), so vLLM's engine processes would start even
with the ``fork`` method; moetrace still asks for ``spawn`` unless the user chose otherwise.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install 'moetrace[vllm]' on a CUDA machine)"
    from moetrace.tracer.backends.vllm import visible_gpu_count

    if visible_gpu_count() == 0:  # NVML count: initialises no CUDA in this process (is_available would)
        return "no CUDA GPU: vLLM's engine does not run on a CPU"
    return None


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    """A Qwen3-MoE checkpoint directory without weights: 4 layers (layer 0 dense), 16 experts, top-4."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from moetrace.tracer.backends.hf import tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny-qwen3-moe")
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": 4,
        "mlp_only_layers": [0],
        "decoder_sparse_step": 1,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 384,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 257,
        "eos_token_id": 258,
        "tie_word_embeddings": False,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    tiny_tokenizer().save_pretrained(d)
    return d


def test_vllm_engine_collects_a_valid_resumable_trace(tiny_moe_dir, tmp_path):
    import torch

    from moetrace.tracer.backends.vllm import VllmEngineConfig
    from moetrace.tracer.collect import CollectConfig, collect
    from moetrace.tracer.trace.reader import open_trace
    from moetrace.tracer.trace.validate import find_problems

    engine = VllmEngineConfig(
        load_format="dummy", enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=1024, commit_every=4
    )
    config = CollectConfig(
        model=str(tiny_moe_dir), datasets=("math-word", "code"), per_dataset=6, max_new_tokens=12, device="cuda"
    )
    out = tmp_path / "trace"
    assert not torch.cuda.is_initialized(), "counting the GPUs must not initialise CUDA in this process"
    result = collect(config, out=out, backend="vllm", engine=engine)
    assert result.backend == "vllm" and result.num_new_requests == 12
    assert find_problems(out) == []

    tr = open_trace(out)
    assert tr.model.moe_layers == (1, 2, 3)
    assert tr.manifest["backend"]["name"] == "vllm" and tr.manifest["backend"]["versions"]["vllm"]
    assert tr.manifest["backend"]["capture"]["releases"]  # which capture facts the run used
    assert tr.manifest["vllm_run"]["num_failed_requests"] == 0
    req = tr.requests().collect()
    ta = tr.token_arrays()
    for rid, p, o in zip(req["request_id"], req["prompt_tokens"], req["output_tokens"]):
        sel = ta.request_id_T == rid
        ids = ta.topk_ids_TLK[sel]
        assert ta.position_T[sel].tolist() == list(range(p + o))
        assert (ids[-1] == -1).all()  # the final generated token was never forwarded
        body = ids[:-1]
        assert ((body >= 0) & (body < 16)).all(), "every forwarded token has routing in every MoE layer"
        # top-k picks distinct experts: a dense layer's zero rows in a MoE column would repeat 0
        assert (np.sort(body, axis=-1)[..., 1:] != np.sort(body, axis=-1)[..., :-1]).all()

    again = collect(config, out=out, backend="vllm", engine=engine, on_existing="resume")
    assert again.num_new_requests == 0
