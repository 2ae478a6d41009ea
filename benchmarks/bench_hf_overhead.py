"""Tracing overhead of the HF backend on the tiny DeepSeek-V3 (CPU).

Same prompts, same greedy generation, interleaved repetitions: ``model.generate`` alone vs
moetrace's ``generate_batch`` (router hooks + per-request attribution into int16 rows).

    python benchmarks/bench_hf_overhead.py [--model deepseek-v3-tiny] [--batch 8] [--new 32] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moetrace.tracer.backends.hf import build_tiny_model, generate_batch, tiny_tokenizer
from moetrace.tracer.datasets import load_prompts, render_prompt_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-v3-tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, info = build_tiny_model(args.model, seed=0)
    tok = tiny_tokenizer()
    prompts = load_prompts(["math-word"], num_requests=args.batch, seed=0)
    ids = [render_prompt_ids(p, tok, chat_template=False)[:64] for p in prompts]
    T = max(map(len, ids))  # padded positions (shape letters: docs/architecture.md)
    inp_RT = torch.full((len(ids), T), tok.pad_token_id)
    att_RT = torch.zeros_like(inp_RT)
    for r, p in enumerate(ids):
        inp_RT[r, T - len(p) :] = torch.tensor(p)
        att_RT[r, T - len(p) :] = 1
    tokens = sum(map(len, ids)) + args.new * len(ids)

    def plain():
        with torch.inference_mode():
            model.generate(
                input_ids=inp_RT,
                attention_mask=att_RT,
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )

    def traced():
        generate_batch(model, tok, ids, info=info, max_new_tokens=args.new)

    plain()
    traced()  # warm-up
    tp: list[float] = []
    tt: list[float] = []
    for _ in range(args.reps):
        for fn, acc in ((plain, tp), (traced, tt)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    mp, mt = statistics.median(tp), statistics.median(tt)
    print(f"{args.model}, batch {args.batch}, {args.new} new tokens, {tokens} tokens per run, median of {args.reps}")
    print(f"  generate alone      {tokens / mp:8.1f} tokens/s")
    print(f"  moetrace traced     {tokens / mt:8.1f} tokens/s")
    print(f"  overhead            {100 * (mt / mp - 1):+.1f}% time  ({100 * (1 - mp / mt):.1f}% fewer tokens/s)")


if __name__ == "__main__":
    main()
