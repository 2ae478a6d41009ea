"""Trace writer throughput for the DeepSeek-V3 shape (58 MoE layers x top-8 = 464 ids per token).

Measures, in one run on the same data: moetrace's TraceWriter (default: dictionary-encoded ids, lz4),
the writer without compression, and the ceiling of the Parquet library itself — one
``pyarrow.parquet.write_table`` of the bare ``experts`` column, plain encoding, no compression.

    python benchmarks/bench_writer.py [--tokens 400000] [--reps 3]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.tracer.presets import model_info_for
from moetrace.tracer.trace.writer import TraceWriter


def _writer_run(root: Path, model, topk_ids_TX, P, O, **kw) -> float:
    out = root / "w"
    shutil.rmtree(out, ignore_errors=True)
    R = len(P)
    t0 = time.perf_counter()
    with TraceWriter(out, model=model, backend={"name": "synthetic"}, collection={}, **kw) as w:
        step = 64
        offsets = np.concatenate([[0], np.cumsum(P + O)])
        for s in range(0, R, step):
            e = min(s + step, R)
            w.add_requests(
                request_id_R=np.arange(s, e), dataset_R=["gsm8k"] * (e - s), prompt_tokens_R=P[s:e],
                output_tokens_R=O[s:e], topk_ids_TX=topk_ids_TX[offsets[s]:offsets[e]],
            )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=400_000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    model = model_info_for("deepseek-v3")
    rng = np.random.default_rng(0)
    R = max(1, args.tokens // 500)
    P, O = np.full(R, 350, np.int32), np.full(R, 150, np.int32)
    T = int((P + O).sum())
    # skewed ids like a real trace (Zipf-like popularity per layer)
    pop = rng.dirichlet(np.full(model.num_experts, 0.3), size=model.num_moe_layers)
    experts = np.empty((T, model.num_moe_layers, model.top_k), np.int16)
    for l in range(model.num_moe_layers):
        experts[:, l, :] = rng.choice(model.num_experts, size=(T, model.top_k), p=pop[l])
    topk_ids_TX = experts.reshape(T, -1)
    root = Path(tempfile.mkdtemp(prefix="bench_writer_"))
    res: dict[str, list[float]] = {"moetrace (dict+lz4, default)": [], "moetrace (dict, no compression)": [], "pyarrow ceiling (plain, bare column)": []}
    flat = pa.FixedSizeListArray.from_arrays(pa.array(topk_ids_TX.reshape(-1)), topk_ids_TX.shape[1])
    for _ in range(args.reps):
        res["moetrace (dict+lz4, default)"].append(_writer_run(root, model, topk_ids_TX, P, O))
        res["moetrace (dict, no compression)"].append(_writer_run(root, model, topk_ids_TX, P, O, compression="none"))
        t0 = time.perf_counter()
        pq.write_table(pa.table({"experts": flat}), root / "bare.parquet", compression=None, use_dictionary=False, write_statistics=False)
        res["pyarrow ceiling (plain, bare column)"].append(time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in (root / "w").rglob("*.parquet"))
    print(f"{T:,} tokens x {topk_ids_TX.shape[1]} ids (DeepSeek-V3 shape), best of {args.reps}")
    for name, times in res.items():
        best = min(times)
        print(f"  {name:<40} {T / best / 1e6:6.3f} M tokens/s   {T * topk_ids_TX.shape[1] / best / 1e6:7.1f} M ids/s")
    print(f"  bytes per token on disk (no-compression run): {size / T:.0f}")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
