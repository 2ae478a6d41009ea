"""What vLLM's routed-experts capture costs: tokens/s with capture on vs off, same engine and prompts.

Needs a CUDA GPU and vLLM (>= 0.22). Two engines of one checkpoint live in this process, identical
but for ``enable_return_routed_experts`` (moetrace's own engine settings,
``VllmEngineConfig.llm_kwargs``); rounds alternate between them (on, off, off, on, ...) so that
drift in the machine's speed falls on both sides alike. Each round generates the same requests
(bundled prompts, repeated; greedy; a fixed number of new tokens, end-of-sequence ignored).

``--mode eager`` runs without CUDA graphs; ``--mode graphs`` with full CUDA graphs and no
torch.compile (vLLM's ``CompilationConfig(mode=NONE, cudagraph_mode=FULL)``), the fast path closest
to a deployment that fits a short GPU lease. Beside the engine's throughput it times moetrace's
conversion of the returned arrays into trace rows (``convert_output``), which the collection runs on
its writer thread, off the engine's path.

Usage::

    python benchmarks/gpu_capture_overhead.py CKPT_DIR --out overhead.json [--mode eager|graphs]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("eager", "graphs"), default="eager")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    a = ap.parse_args()

    import torch
    import vllm

    from moetrace.tracer.backends.vllm import VllmEngineConfig, check_environment, model_for_vllm
    from moetrace.tracer.backends.vllm_convert import convert_output
    from moetrace.tracer.datasets import load_prompts, render_prompt_ids
    from moetrace.tracer.presets import resolve

    resolved = resolve(a.checkpoint)
    source, info = model_for_vllm(resolved)
    engine = VllmEngineConfig(
        enforce_eager=a.mode == "eager", gpu_memory_utilization=a.gpu_memory_utilization, max_model_len=1024
    )
    version, capture = check_environment(engine)
    kw = engine.llm_kwargs(capture=capture)
    kw["kv_cache_memory_bytes"] = 4 << 30  # fixed KV size: no memory profiling, so other GPU jobs cannot upset it
    if a.mode == "graphs":
        kw["compilation_config"] = {
            "mode": 0,
            "cudagraph_mode": "FULL",
            "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256],
        }
    t0 = time.perf_counter()
    llm_on = vllm.LLM(source, seed=0, **kw)
    llm_off = vllm.LLM(source, seed=0, **{**kw, "enable_return_routed_experts": False})
    start_s = time.perf_counter() - t0

    tok = llm_on.get_tokenizer()
    base = load_prompts(["bundled"])
    ids = [render_prompt_ids(p, tok, chat_template=False)[:512] for p in base]
    batch = [{"prompt_token_ids": ids[i % len(ids)]} for i in range(a.requests)]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    prompt_tokens = sum(len(b["prompt_token_ids"]) for b in batch)
    gen_tokens = a.requests * a.new_tokens

    def timed(llm):
        t = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t, outs

    timed(llm_on)  # warm-up, both sides
    timed(llm_off)
    rounds = []
    outs_on = None
    for r in range(a.rounds):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        row = {}
        for side in order:
            s, outs = timed(llm_on if side == "on" else llm_off)
            row[side] = s
            if side == "on":
                outs_on = outs
        rounds.append(row)
    assert outs_on is not None  # a.rounds >= 1 ran the "on" side
    t = time.perf_counter()
    converted = [convert_output(o, info=info, layer_axis=capture.layer_axis) for o in outs_on]
    convert_s = time.perf_counter() - t
    ratio = [r["on"] / r["off"] for r in rounds]
    report = {
        "checkpoint": Path(a.checkpoint).name,
        "mode": a.mode,
        "versions": {"vllm": version, "torch": torch.__version__},
        "device": torch.cuda.get_device_name(0),
        "requests_per_round": a.requests,
        "prompt_tokens_per_round": prompt_tokens,
        "generated_tokens_per_round": gen_tokens,
        "engine_start_seconds_both": start_s,
        "rounds": rounds,
        "tokens_per_second_on_median": (prompt_tokens + gen_tokens) / statistics.median(r["on"] for r in rounds),
        "tokens_per_second_off_median": (prompt_tokens + gen_tokens) / statistics.median(r["off"] for r in rounds),
        "time_ratio_on_over_off_per_round": ratio,
        "overhead_median": statistics.median(ratio) - 1.0,
        "convert_rows_per_second": sum(c.topk_ids_TX.shape[0] for c in converted) / max(convert_s, 1e-9),
    }
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(
        f"capture overhead ({a.mode}): {100 * report['overhead_median']:+.1f} % time "
        f"(on {report['tokens_per_second_on_median']:.0f} tok/s, off {report['tokens_per_second_off_median']:.0f} tok/s; "
        f"per-round ratios {', '.join(f'{x:.3f}' for x in ratio)}); conversion {report['convert_rows_per_second']:.0f} rows/s"
    )


if __name__ == "__main__":
    main()
