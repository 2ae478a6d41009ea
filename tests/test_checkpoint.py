"""``make-checkpoint``: a tiny checkpoint directory that both backends run.

The vLLM-sized configs keep every preset's routing topology and real attention head dims and stay
CPU-buildable; a written checkpoint (Mixtral: the fastest to build) has the hub layout, loads with
``AutoTokenizer`` and collects through ``moetrace collect --backend hf``; refusals are one line and
leave nothing behind. vLLM itself is not run here (no GPU): docs/hf-backend.md has the GPU command.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil

import pytest
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ModelError, OutputExistsError
from moetrace.tracer.presets import TINY_VOCAB_SIZE, list_presets, moe_topology_from_hf_config, resolve

runner = CliRunner()
PRESET = "mixtral-8x7b"  # 12.9M parameters: the fastest vLLM-sized checkpoint to build
#: MLA fields DeepSeek-V3's vLLM attention kernels need at the released model's values
MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
#: architectures whose vLLM attention derives head_dim as hidden_size // num_attention_heads
HEAD_DIM_FROM_HIDDEN = ("MixtralForCausalLM", "OlmoeForCausalLM")


def _one_line_error(res) -> str:
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), res.output
    return lines[0]


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # HF's own default


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------- the vLLM-sized configs
@pytest.mark.parametrize("name", [p.name for p in list_presets()])
def test_vllm_sized_config_keeps_topology_and_real_head_dims(name):
    from moetrace.tracer.backends.hf import count_parameters

    p = resolve(name).preset
    full, small = p.hf_config(tiny=False), p.hf_config(tiny=True, engine="vllm")
    topo, want = moe_topology_from_hf_config(small), moe_topology_from_hf_config(full)
    assert {k: v for k, v in topo.items() if k != "hidden_size"} == {
        k: v for k, v in want.items() if k != "hidden_size"
    }
    heads, kv = small.num_attention_heads, small.num_key_value_heads
    assert heads == 2 and heads % kv == 0 and small.vocab_size == TINY_VOCAB_SIZE
    if p.architecture == "DeepseekV3ForCausalLM":
        assert [getattr(small, f) for f in MLA_DIMS] == [getattr(full, f) for f in MLA_DIMS] == [512, 128, 64, 128]
        assert kv == heads  # MLA: no grouped-query heads
    else:
        assert small.head_dim == _head_dim(full) in (64, 128)
    if p.architecture in HEAD_DIM_FROM_HIDDEN:
        assert small.hidden_size == heads * small.head_dim
    assert small.hidden_size <= 256
    assert count_parameters(small) < 215e6  # CPU-buildable; DeepSeek-V3 is the largest, 212M
    assert p.model_info(tiny=True, engine="vllm").hidden_size == small.hidden_size


def test_deepseek_v3_names_its_router_as_vllm_reads_it():
    # vLLM 0.26 model_executor/models/deepseek_v2.py creates the gate's e_score_correction_bias only
    # when config.topk_method == "noaux_tc" and scores with config.scoring_func (default softmax);
    # without them loading a DeepSeek-V3 checkpoint fails (KeyError '...mlp.gate.e_score_correction_bias',
    # seen on an H200 with vLLM 0.26.0). The released config.json has both.
    p = resolve("deepseek-v3").preset
    cfg = p.hf_config_dict(tiny=True, engine="vllm")
    assert (cfg["topk_method"], cfg["scoring_func"]) == ("noaux_tc", "sigmoid")


def test_the_cpu_tiny_dims_are_unchanged():
    cfg = resolve("deepseek-v3-tiny").hf_config()
    assert (cfg.hidden_size, cfg.qk_rope_head_dim, cfg.kv_lora_rank) == (64, 8, 32)


def test_a_preset_without_a_vllm_sized_config_is_refused():
    p = dataclasses.replace(resolve(PRESET).preset, tiny_vllm=None)
    with pytest.raises(ModelError, match="has no vLLM-sized tiny config; presets with one: deepseek-v3"):
        p.tiny_overrides(engine="vllm")


# --------------------------------------------------------------------------------- a checkpoint
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from moetrace.tracer.checkpoint import make_checkpoint

    return make_checkpoint(PRESET, out=tmp_path_factory.mktemp("ckpt") / "mixtral", seed=0)


def test_the_checkpoint_has_the_real_topology_and_vllm_dims(checkpoint):
    d = checkpoint.path
    assert sorted(f.name for f in d.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "moetrace-checkpoint.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert _leftovers(d.parent) == []
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["model_type"] == "mixtral"
    assert (cfg["num_hidden_layers"], cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (32, 8, 2)
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        256,
        2,
        1,
        128,
    )
    assert (cfg["intermediate_size"], cfg["vocab_size"], cfg["max_position_embeddings"]) == (32, TINY_VOCAB_SIZE, 4096)
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 1e6  # the name transformers 4 (vLLM) reads
    info = resolve(str(d)).model_info()  # a local model name, read as JSON
    assert (info.architecture, info.moe_layers, info.num_experts, info.top_k) == (
        "MixtralForCausalLM",
        tuple(range(32)),
        8,
        2,
    )
    assert (checkpoint.preset, checkpoint.architecture) == (PRESET, "MixtralForCausalLM")
    assert checkpoint.bytes_on_disk == sum(f.stat().st_size for f in d.iterdir())


def test_the_weights_are_bf16_safetensors_in_the_hub_layout(checkpoint):
    from safetensors import safe_open

    from moetrace.tracer.backends.hf import count_parameters

    with safe_open(checkpoint.path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"BF16"}
        n = sum(math.prod(f.get_slice(k).get_shape()) for k in keys)
    # per-expert tensors, as in mistralai/Mixtral-8x7B: what vLLM's and transformers 4's loaders map
    assert {f"model.layers.31.block_sparse_moe.experts.7.{w}.weight" for w in ("w1", "w2", "w3")} <= keys
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys and "lm_head.weight" in keys
    assert n == checkpoint.num_parameters == count_parameters(resolve(str(checkpoint.path)).hf_config())


def test_the_tokenizer_loads_with_autotokenizer(checkpoint):
    from transformers import AutoTokenizer

    from moetrace.tracer.backends.hf import tiny_tokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint.path)
    text = "Natalia sold clips to 48 of her friends."
    assert tok(text).input_ids == tiny_tokenizer()(text).input_ids
    assert (tok.pad_token_id, tok.eos_token_id, tok.padding_side) == (256, 258, "left")
    tcfg = json.loads((checkpoint.path / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"  # a class transformers 4 (vLLM) knows


def test_the_provenance_file(checkpoint):
    prov = json.loads((checkpoint.path / "moetrace-checkpoint.json").read_text())
    assert (prov["format"], prov["version"], prov["preset"], prov["seed"], prov["dtype"]) == (
        "moetrace-checkpoint",
        1,
        PRESET,
        0,
        "bfloat16",
    )
    assert prov["num_parameters"] == checkpoint.num_parameters and prov["moetrace_version"]
    assert prov["dims"]["hidden_size"] == 256 and prov["topology"]["num_experts"] == 8


def test_collect_runs_on_the_checkpoint_through_the_cli(checkpoint, tmp_path):
    from moetrace.tracer.trace.reader import open_trace
    from moetrace.tracer.trace.validate import validate

    out = tmp_path / "trace"
    res = runner.invoke(
        app,
        [
            "collect",
            "--model",
            str(checkpoint.path),
            "--backend",
            "hf",
            "--dataset",
            "bundled",
            "--per-dataset",
            "1",
            "--max-new-tokens",
            "2",
            "--no-chat-template",
            "-o",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    validate(out)
    t = open_trace(out)
    assert (t.model.architecture, t.model.num_moe_layers, t.model.top_k) == ("MixtralForCausalLM", 32, 2)
    assert len(t.request_arrays.request_id_R) == 5


def test_overwrite_replaces_the_directory_with_the_same_seeded_weights(checkpoint, tmp_path):
    from moetrace.tracer.checkpoint import make_checkpoint

    out = tmp_path / "ckpt"
    shutil.copytree(checkpoint.path, out)
    (out / "stale.bin").write_bytes(b"x")
    info = make_checkpoint(PRESET, out=out, seed=0, overwrite=True)
    assert not (out / "stale.bin").exists() and _leftovers(tmp_path) == []
    assert (out / "model.safetensors").read_bytes() == (checkpoint.path / "model.safetensors").read_bytes()
    assert info.num_parameters == checkpoint.num_parameters
    # through the CLI with -q: the one result line on stdout, nothing on stderr (no transformers progress bar)
    res = runner.invoke(app, ["make-checkpoint", PRESET, "-o", str(out), "--overwrite", "-q"])
    assert res.exit_code == 0, res.output
    assert res.stderr == "" and res.stdout.count("\n") == 1 and "parameters" in res.stdout
    assert (out / "model.safetensors").read_bytes() == (checkpoint.path / "model.safetensors").read_bytes()


# ------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("no-such-model", "unknown model preset|neither a preset"),
        ("mixtral-8x7b-tiny", r"pass the preset name \(mixtral-8x7b\)"),
        ("org/model", "is not a model preset; make-checkpoint takes one of: deepseek-v3"),
    ],
)
def test_a_name_that_is_not_a_preset_is_one_line(name, match, tmp_path):
    line = _one_line_error(runner.invoke(app, ["make-checkpoint", name, "-o", str(tmp_path / "c")]))
    assert re.search(match, line), line
    assert not (tmp_path / "c").exists()


def test_an_architecture_vllm_does_not_serve_is_refused(monkeypatch, tmp_path):
    from moetrace.tracer import checkpoint as ck

    monkeypatch.setattr(ck, "VLLM_ARCHITECTURES", ("DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM"))
    with pytest.raises(
        ModelError,
        match="vLLM does not serve MixtralForCausalLM; make-checkpoint supports "
        "DeepseekV3ForCausalLM, Qwen3MoeForCausalLM",
    ):
        ck.make_checkpoint(PRESET, out=tmp_path / "c")


def test_an_existing_output_is_one_line_and_kept(tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = _one_line_error(runner.invoke(app, ["make-checkpoint", PRESET, "-o", str(out)]))
    assert "is not empty; pass --overwrite" in line
    (tmp_path / "f").write_text("")
    assert "is not a directory" in _one_line_error(
        runner.invoke(app, ["make-checkpoint", PRESET, "-o", str(tmp_path / "f")])
    )
    assert (out / "keep.txt").read_text() == "mine" and _leftovers(tmp_path) == []


def test_a_failed_build_leaves_nothing_and_keeps_the_old_directory(monkeypatch, tmp_path):
    from moetrace.tracer import checkpoint as ck
    from moetrace.tracer.backends import hf

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf, "build_tiny_model", boom)
    with pytest.raises(OSError):
        ck.make_checkpoint(PRESET, out=tmp_path / "new")
    out = tmp_path / "old"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OSError):
        ck.make_checkpoint(PRESET, out=out, overwrite=True)
    assert not (tmp_path / "new").exists() and (out / "keep.txt").read_text() == "mine"
    assert _leftovers(tmp_path) == []


def test_an_unknown_dtype_is_refused(tmp_path):
    from moetrace.tracer.checkpoint import make_checkpoint

    with pytest.raises(ModelError, match="unknown weight dtype 'int8'; choose one of: bfloat16, float16, float32"):
        make_checkpoint(PRESET, out=tmp_path / "c", dtype="int8")
    with pytest.raises(OutputExistsError):
        (tmp_path / "f").write_text("")
        make_checkpoint(PRESET, out=tmp_path / "f")
