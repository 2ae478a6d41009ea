"""Is batched collection faithful? Batch size B vs batch size 1 on every -tiny architecture.

For each model: collect the same prompts at batch size B and at batch size 1 (greedy), then count
(a) rows whose (request, position) attribution differs, (b) generated tokens that differ, and
(c) (token, layer) routings whose expert set differs — numerical near-ties of the router, since
padding changes the shapes of the matrix products. The core paper logged at batch size 1 for
exactness; this measures what batching costs.

    python benchmarks/batch_faithfulness.py [--prompts 16] [--batch 8] [--new 16] [--models a-tiny,b-tiny]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from moetrace.tracer.backends.hf import build_tiny_model, generate_batch, tiny_tokenizer
from moetrace.tracer.datasets import load_prompts, render_prompt_ids

MODELS = [
    "deepseek-v3-tiny",
    "qwen3-30b-a3b-tiny",
    "mixtral-8x7b-tiny",
    "olmoe-1b-7b-tiny",
    "llama4-maverick-tiny",
    "gpt-oss-120b-tiny",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=160)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated -tiny presets")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = tiny_tokenizer()
    prompts = load_prompts(["bundled"], num_requests=args.prompts, seed=0)
    ids = [render_prompt_ids(p, tok, chat_template=False)[: args.max_prompt] for p in prompts]
    print(
        f"{args.prompts} bundled prompts (<= {args.max_prompt} tokens), {args.new} greedy new tokens, batch {args.batch} vs 1"
    )
    print(f"{'model':<22} {'rows':>7} {'row diffs':>9} {'token diffs':>11} {'(token,layer)':>13} {'near-ties':>9}")
    for name in args.models.split(","):
        model, info = build_tiny_model(name, seed=0)
        batched = []
        for s in range(0, len(ids), args.batch):
            batched += generate_batch(model, tok, ids[s : s + args.batch], info=info, max_new_tokens=args.new)
        singles = [generate_batch(model, tok, [p], info=info, max_new_tokens=args.new)[0] for p in ids]
        rows = row_diff = tok_diff = ties = pairs = 0
        for in_batch, alone in zip(batched, singles):
            rows += alone.topk_ids_TX.shape[0]
            row_diff += abs(in_batch.topk_ids_TX.shape[0] - alone.topk_ids_TX.shape[0])
            tok_diff += sum(x != y for x, y in zip(in_batch.output_ids, alone.output_ids)) + abs(
                len(in_batch.output_ids) - len(alone.output_ids)
            )
            n = min(in_batch.topk_ids_TX.shape[0], alone.topk_ids_TX.shape[0])
            bb = np.sort(in_batch.topk_ids_TX[:n].reshape(n, info.num_moe_layers, info.top_k), -1)
            ss = np.sort(alone.topk_ids_TX[:n].reshape(n, info.num_moe_layers, info.top_k), -1)
            ties += int((bb != ss).any(-1).sum())
            pairs += n * info.num_moe_layers
        print(f"{name:<22} {rows:>7} {row_diff:>9} {tok_diff:>11} {pairs:>13} {ties:>9}", flush=True)


if __name__ == "__main__":
    main()
