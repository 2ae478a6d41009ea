"""Writes the sample inputs of the README's ``moetrace import`` lines into ``data/samples/``.

The two files are tiny stand-ins, generated here from a seeded random draw (no engine, no
download), for what the two text import formats read (docs/collecting.md, "Importing routing
recorded elsewhere"):

- ``sglang-responses.jsonl``: three SGLang ``/generate`` responses of DeepSeek-V3 with
  ``meta_info.routed_experts`` (base64 of little-endian int32 ids ``[rows, 61 decoder layers, 8]``,
  dense layers holding 0, rows covering positions ``[0, prompt + completion - 1)``), each with the
  optional ``request_id`` and ``dataset`` keys. Ids follow DeepSeek-V3's group-limited routing
  (8 groups of 32 experts, 4 groups chosen, 8 experts among them).
- ``tokens-decode-only.jsonl``: the ``tokens`` format's records of three Mixtral-8x7B requests,
  generated tokens only (``stage`` always ``decode``, positions counting the prompt), one record per
  token and MoE layer.

The ids are random, so the files exercise the import, not an analysis. The package ships them
(``moetrace.data``, folder ``samples/``); ``tests/test_readme_samples.py`` checks that they equal
what this script writes and that every README import line runs on them.

    .venv/bin/python benchmarks/make_samples.py            # rewrite data/samples/
    .venv/bin/python benchmarks/make_samples.py --check    # exit 1 if the files differ

Shape legend: T tokens (rows of one response), H all decoder layers, L MoE layers, K top-k
(legend: docs/architecture.md).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

import numpy as np

#: where the samples live (the repository's data/ folder is the package moetrace.data)
SAMPLES_DIR = Path(__file__).resolve().parents[1] / "data" / "samples"
SEED = 0

# DeepSeek-V3 (data/models/deepseek-v3.json): 61 decoder layers, the first 3 dense, 256 experts in
# 8 router groups, 4 groups per token, top-8
DSV3_LAYERS, DSV3_DENSE, DSV3_EXPERTS, DSV3_GROUPS, DSV3_TOPK_GROUPS, DSV3_TOPK = 61, 3, 256, 8, 4, 8
# Mixtral-8x7B (data/models/mixtral-8x7b.json): 32 decoder layers, all MoE, 8 experts, top-2
MIXTRAL_LAYERS, MIXTRAL_EXPERTS, MIXTRAL_TOPK = 32, 8, 2

#: (request_id, dataset, prompt tokens, completion tokens) of each sample request
SGLANG_REQUESTS = ((0, "gsm8k", 9, 4), (1, "mbpp", 7, 5), (2, "lmsys-chat", 6, 3))
TOKENS_REQUESTS = ((10, "chat", 5, 4), (11, "chat", 8, 3), (12, "code", 6, 4))


def _dsv3_ids_TH(rng: np.random.Generator, num_rows: int) -> np.ndarray:
    """``int32 [num_rows, 61, 8]`` group-limited ids; the dense layers hold 0, as SGLang returns them."""
    per_group = DSV3_EXPERTS // DSV3_GROUPS
    ids = np.zeros((num_rows, DSV3_LAYERS, DSV3_TOPK), dtype="<i4")
    for t in range(num_rows):
        for h in range(DSV3_DENSE, DSV3_LAYERS):
            groups = rng.choice(DSV3_GROUPS, size=DSV3_TOPK_GROUPS, replace=False)
            pool = (groups[:, None] * per_group + np.arange(per_group)[None, :]).ravel()
            ids[t, h] = rng.choice(pool, size=DSV3_TOPK, replace=False)
    return ids


def sglang_lines() -> list[str]:
    """One JSON line per SGLang ``/generate`` response."""
    rng = np.random.default_rng(SEED)
    lines = []
    for request_id, dataset, prompt, completion in SGLANG_REQUESTS:
        ids = _dsv3_ids_TH(rng, prompt + completion - 1)  # the last generated token is never forwarded
        meta = {
            "id": f"sample-{request_id}",
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": completion},
            "routed_experts": base64.b64encode(ids.tobytes()).decode("ascii"),
        }
        response = {
            "request_id": request_id,
            "dataset": dataset,
            "text": "",
            "output_ids": [int(x) for x in rng.integers(0, 129280, size=completion)],
            "meta_info": meta,
        }
        lines.append(json.dumps(response, separators=(",", ":")))
    return lines


def tokens_lines() -> list[str]:
    """One JSON line per (generated token, MoE layer) of the decode-only sample."""
    rng = np.random.default_rng(SEED + 1)
    lines = []
    for request_id, dataset, prompt, generated in TOKENS_REQUESTS:
        for position in range(prompt, prompt + generated):  # positions count the prompt
            for layer in range(MIXTRAL_LAYERS):
                experts = [int(e) for e in rng.choice(MIXTRAL_EXPERTS, size=MIXTRAL_TOPK, replace=False)]
                record = {
                    "request": request_id,
                    "layer": layer,
                    "position": position,
                    "stage": "decode",
                    "experts": experts,
                    "dataset": dataset,
                }
                lines.append(json.dumps(record, separators=(",", ":")))
    return lines


def samples() -> dict[str, str]:
    """File name -> contents of every sample."""
    return {
        "sglang-responses.jsonl": "\n".join(sglang_lines()) + "\n",
        "tokens-decode-only.jsonl": "\n".join(tokens_lines()) + "\n",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if a file differs")
    args = ap.parse_args(argv)
    stale = []
    for name, text in samples().items():
        path = SAMPLES_DIR / name
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(name)
        if not args.check:
            SAMPLES_DIR.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path} ({len(text):,} bytes)")
    if args.check and stale:
        print(f"out of date: {', '.join(stale)} (run benchmarks/make_samples.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
