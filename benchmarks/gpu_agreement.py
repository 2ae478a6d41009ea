"""HF transformers vs vLLM on identical weights: do they route the same tokens to the same experts?

Needs a CUDA GPU and vLLM (>= 0.22). For one checkpoint directory (``moetrace make-checkpoint``):

1. vLLM generates greedily from the bundled prompts (no chat template) with routed-experts capture
   on, through moetrace's own engine settings, submission loop and conversion
   (``VllmEngineConfig.llm_kwargs``, ``run_engine_loop``, ``convert_output``).
2. HF transformers runs the *same token sequences* (prompt + vLLM's generated tokens, teacher
   forced in one forward pass, bf16 like vLLM) on the same GPU, with forward hooks on every router
   keeping its logits and its top-k choice.
3. Per stage (prompt positions = prefill, generated positions = decode) it counts the token-layers
   whose top-k sets agree, and sets each against the router's margin in HF's scores
   (``analysis/agreement.py``): how far the last chosen expert's selection score is above the best
   one left out, relative to that score.

Teacher forcing keeps the two sides on identical sequences even where their greedy tokens would part;
the share of vLLM's greedy tokens that are also HF's argmax is reported beside it.

Usage (the project's root on PYTHONPATH, vLLM importable)::

    python benchmarks/gpu_agreement.py CKPT_DIR --out agreement.json [--per-dataset 6] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np


def run_vllm(source: str, info, prompts, *, max_new_tokens: int, gpu_memory_utilization: float):
    """vLLM's greedy generation with capture: ``{request_id: (token_ids, topk_ids_TLK)}`` and the version."""
    import vllm

    from moetrace.tracer.backends.base import GenerationConfig
    from moetrace.tracer.backends.vllm import (
        VllmEngineConfig,
        _encode_all,
        _max_prompt,
        check_environment,
        run_engine_loop,
    )
    from moetrace.tracer.backends.vllm_convert import convert_output

    engine = VllmEngineConfig(enforce_eager=True, gpu_memory_utilization=gpu_memory_utilization, max_model_len=2048)
    generation = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, chat_template=False)
    version, capture = check_environment(engine)
    import os

    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    llm = vllm.LLM(source, seed=0, **engine.llm_kwargs(capture=capture), kv_cache_memory_bytes=4 << 30)
    outputs: list = []
    work = _encode_all(
        prompts, llm.get_tokenizer(), chat_template=False, max_prompt=_max_prompt(llm, max_new_tokens), truncated=[]
    )
    run_engine_loop(llm, work, vllm=vllm, num_inflight=256, generation=generation, emit=outputs.extend)
    K, L = info.top_k, info.num_moe_layers
    result = {}
    for out in outputs:
        conv = convert_output(out, info=info, layer_axis=capture.layer_axis)
        tokens = [int(t) for t in out.prompt_token_ids] + [int(t) for t in out.outputs[0].token_ids]
        result[conv.request_id] = (tokens, conv.prompt_tokens, conv.topk_ids_TX.reshape(-1, L, K))
    del llm
    gc.collect()
    return result, version


def run_hf_teacher_forced(resolved, sequences: dict[int, list[int]], *, device: str = "cuda"):
    """HF forward of each sequence (all but its last token) with router hooks:
    ``{request_id: (topk_ids_TLK, rel_margin_TL, argmax_T)}``."""
    import torch

    from moetrace.analysis.agreement import router_margins, selection_scores
    from moetrace.tracer.backends.hf import _iter_routers, load_model

    model, _tok, info = load_model(resolved, seed=0, device=device, dtype="auto")
    routers = [r for _, r in _iter_routers(model)]
    got: list[tuple] = [() for _ in routers]

    def hook(slot):
        def fn(module, args, output):
            got[slot] = (output[0].detach().float().cpu().numpy(), output[2].detach().cpu().numpy())

        return fn

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    K = info.top_k
    out = {}
    try:
        for rid, tokens in sequences.items():
            ids = torch.tensor([tokens[:-1]], device=device)
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0]
            argmax_T = logits.argmax(-1).cpu().numpy()
            topk, margin = [], []
            for slot, r in enumerate(routers):
                logits_NE, ids_NK = got[slot]
                bias = getattr(r, "e_score_correction_bias", None)
                if bias is not None:  # DeepSeek-V3: sigmoid + correction bias, group-limited
                    s = selection_scores(logits_NE, scoring="sigmoid", correction_bias_E=bias.float().cpu().numpy())
                    m = router_margins(s, top_k=K, num_groups=int(r.num_group), topk_groups=int(r.topk_group))
                else:
                    s = selection_scores(logits_NE, scoring="softmax")
                    m = router_margins(s, top_k=K)
                kth = np.take_along_axis(s, ids_NK, axis=-1).min(axis=-1)
                topk.append(ids_NK)
                margin.append(m / np.abs(kth))
            out[rid] = (np.stack(topk, axis=1), np.stack(margin, axis=1), argmax_T)
    finally:
        for h in handles:
            h.remove()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--out", required=True)
    ap.add_argument("--per-dataset", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    a = ap.parse_args()

    from moetrace.analysis.agreement import comparable, stage_agreement, topk_sets_equal
    from moetrace.tracer.backends.vllm import model_for_vllm
    from moetrace.tracer.datasets import load_prompts
    from moetrace.tracer.presets import resolve

    t0 = time.perf_counter()
    resolved = resolve(a.checkpoint)
    source, info = model_for_vllm(resolved)
    prompts = load_prompts(["bundled"], per_dataset=a.per_dataset)
    v, version = run_vllm(
        source, info, prompts, max_new_tokens=a.max_new_tokens, gpu_memory_utilization=a.gpu_memory_utilization
    )
    t_vllm = time.perf_counter() - t0
    h = run_hf_teacher_forced(resolved, {rid: toks for rid, (toks, _, _) in v.items()})
    eq: dict[str, list[np.ndarray]] = {"prefill": [], "decode": []}
    mg: dict[str, list[np.ndarray]] = {"prefill": [], "decode": []}
    same_tokens = total_tokens = 0
    for rid, (tokens, P, v_TLK) in v.items():
        h_TLK, rel_TL, argmax_T = h[rid]
        T = len(tokens) - 1  # positions that went through the model
        a_TLK = v_TLK[:T]
        ok_TL = comparable(a_TLK, h_TLK)
        e_TL = topk_sets_equal(a_TLK, h_TLK)
        for stage, sl in (("prefill", slice(0, P)), ("decode", slice(P, T))):
            eq[stage].append(e_TL[sl][ok_TL[sl]])
            mg[stage].append(rel_TL[sl][ok_TL[sl]])
        gen = np.asarray(tokens[P:])  # vLLM's greedy tokens; HF's argmax at the position before each
        same_tokens += int((argmax_T[P - 1 : P - 1 + len(gen)] == gen).sum())
        total_tokens += len(gen)
    stages = [stage_agreement(s, np.concatenate(eq[s]), np.concatenate(mg[s])).to_json() for s in ("prefill", "decode")]
    import torch
    import transformers

    report = {
        "checkpoint": Path(a.checkpoint).name,
        "model": {
            "architecture": info.architecture,
            "moe_layers": info.num_moe_layers,
            "experts": info.num_experts,
            "top_k": info.top_k,
        },
        "versions": {"vllm": version, "transformers": transformers.__version__, "torch": torch.__version__},
        "device": torch.cuda.get_device_name(0),
        "requests": len(v),
        "stages": stages,
        "greedy_tokens_equal": same_tokens / max(total_tokens, 1),
        "seconds": {"vllm": t_vllm, "total": time.perf_counter() - t0},
    }
    Path(a.out).write_text(json.dumps(report, indent=1))
    for s in stages:
        print(
            f"{report['checkpoint']} {s['stage']}: {s['share']:.4f} of {s['num_token_layers']} token-layers agree; "
            f"disagreements within bf16 resolution: {s['disagree_within_bf16']:.3f}; "
            f"agreement above it: {s['agree_above_bf16']:.4f}"
        )
    print(f"greedy tokens equal: {report['greedy_tokens_equal']:.4f}")


if __name__ == "__main__":
    main()
