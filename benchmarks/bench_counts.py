"""Benchmark: expert-count aggregation from Parquet on disk (``moetrace.analysis.counts``).

Measures, in one run on the same trace: ``count_trace`` (numba kernel over the streamed int16 ids)
against a straightforward polars baseline (scan_parquet -> explode the expert list -> group_by
request, stage, layer, expert -> count). Both produce counts per (request, stage, layer, expert);
the script checks they agree. Throughput is in expert ids per second (tokens * L * K, -1 included).

    .venv/bin/python benchmarks/bench_counts.py --requests 2000 --model deepseek-v3

The trace is generated once into --workdir (a DeepSeek-V3-shape numpy generator below, also used
by bench_analyze.py) and reused by later runs.
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
from pathlib import Path

import numpy as np


def make_trace(
    path: Path,
    *,
    num_requests: int,
    model: str = "deepseek-v3",
    datasets: tuple[str, ...] = ("gsm8k", "mbpp", "lmsys", "xsum"),
    prompt_mean: int = 160,
    output_mean: int = 80,
    seed: int = 0,
) -> Path:
    """Write a synthetic trace with dataset-specific expert popularity (log-normal per dataset and
    layer, decode mixed 60:40 with a stage-specific profile). Top-k sets are an expert drawn from
    the popularity plus k-1 experts at a fixed stride (distinct by construction)."""
    from moetrace.tracer.presets import model_info_for
    from moetrace.tracer.trace.writer import TraceWriter

    info = model_info_for(model)
    L, K, E = info.num_moe_layers, info.top_k, info.num_experts
    rng = np.random.default_rng(seed)
    stride = next(s for s in (37, 41, 43, 47) if math.gcd(s, E) == 1)
    D = len(datasets)
    p_DSLE = np.exp(rng.normal(0, 1.0, size=(D, 2, L, E)))
    p_DSLE[:, 1] = 0.6 * p_DSLE[:, 0] + 0.4 * p_DSLE[:, 1]
    cdf_DSLE = np.cumsum(p_DSLE / p_DSLE.sum(-1, keepdims=True), axis=-1)
    offs_K = (np.arange(K) * stride) % E
    chunk = 256
    if path.exists():
        shutil.rmtree(path)
    with TraceWriter(
        path,
        model=info,
        backend={"name": "synthetic", "generator": "bench_counts.make_trace"},
        collection={"datasets": list(datasets), "seed": seed, "num_requests": num_requests},
    ) as w:
        for lo in range(0, num_requests, chunk):
            R = min(chunk, num_requests - lo)
            d_R = rng.integers(0, D, size=R)
            ptok = np.maximum(1, rng.poisson(prompt_mean, size=R)).astype(np.int32)
            otok = np.maximum(1, rng.poisson(output_mean, size=R)).astype(np.int32)
            lens = ptok + otok
            T = int(lens.sum())
            d_T = np.repeat(d_R, lens)
            starts = np.repeat(np.cumsum(lens) - lens, lens)
            s_T = ((np.arange(T) - starts) >= np.repeat(ptok, lens)).astype(np.int64)
            u_TL = rng.random((T, L))
            first_TL = np.empty((T, L), dtype=np.int64)
            for d in range(D):
                for s in range(2):
                    m = (d_T == d) & (s_T == s)
                    if not m.any():
                        continue
                    for l in range(L):
                        first_TL[m, l] = np.searchsorted(cdf_DSLE[d, s, l], u_TL[m, l])
            topk_ids_TLK = (np.minimum(first_TL, E - 1)[:, :, None] + offs_K) % E
            topk_ids_TLK[np.cumsum(lens) - 1] = -1  # the final generated token is never routed
            w.add_requests(
                request_id_R=np.arange(lo, lo + R, dtype=np.int64),
                dataset_R=[datasets[i] for i in d_R],
                prompt_tokens_R=ptok,
                output_tokens_R=otok,
                topk_ids_TX=topk_ids_TLK.reshape(T, L * K).astype(np.int16),
            )
    return path


def polars_baseline(trace_path: Path):
    """The straightforward way: explode the expert lists and group_by."""
    import polars as pl

    from moetrace.tracer.trace.reader import open_trace

    t = open_trace(trace_path)
    X, K = t.model.ids_per_token, t.model.top_k
    return (
        t.routing()
        .select("request_id", "stage", pl.col("experts").arr.to_list())
        .with_columns(slot=pl.int_ranges(0, X, dtype=pl.Int16))
        .explode("experts", "slot")
        .filter(pl.col("experts") >= 0)
        .with_columns(layer=pl.col("slot") // K)
        .group_by("request_id", "stage", "layer", pl.col("experts").alias("expert"))
        .len()
        .collect()
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moetrace-bench"))
    ap.add_argument("--repeat", type=int, default=3, help="best of N for count_trace")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--trace", type=Path, default=None, help="use this existing trace instead of generating one")
    args = ap.parse_args()

    from moetrace.analysis.counts import count_trace
    from moetrace.tracer.trace.reader import open_trace

    path = args.trace or args.workdir / f"counts-{args.model}-{args.requests}"
    if not (path / "manifest.json").exists():
        t0 = time.perf_counter()
        make_trace(path, num_requests=args.requests, model=args.model)
        print(f"generated {path} in {time.perf_counter() - t0:.1f} s")
    trace = open_trace(path)
    import pyarrow.parquet as pq

    T = sum(pq.read_metadata(f).num_rows for f in trace.routing_files())
    ids = T * trace.model.ids_per_token
    size = sum(f.stat().st_size for f in trace.routing_files())
    print(f"trace: {len(trace.part_names())} parts, {T:,} tokens, {ids:,} ids, routing {size / 2**20:.0f} MiB on disk")

    count_trace(trace, layers=[0])  # compile the kernel (cached by numba afterwards)
    best = math.inf
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        res = count_trace(trace)
        best = min(best, time.perf_counter() - t0)
    print(
        f"count_trace      {best:8.3f} s  {ids / best / 1e6:8.1f} M ids/s   counts {res.counts_RSLE.dtype} "
        f"{res.counts_RSLE.nbytes / 2**20:.0f} MiB"
    )
    if args.skip_baseline:
        return
    t0 = time.perf_counter()
    base = polars_baseline(path)
    tb = time.perf_counter() - t0
    print(f"polars baseline  {tb:8.3f} s  {ids / tb / 1e6:8.1f} M ids/s")
    print(f"speed-up         {tb / best:8.1f} x")
    # the two must agree
    total_base = int(base["len"].sum())
    total_ours = int(res.counts_RSLE.sum(dtype=np.int64))
    assert total_base == total_ours, (total_base, total_ours)
    row = base.row(0, named=True)
    r = int(np.searchsorted(res.request_id_R, row["request_id"]))
    s = res.stages.index(row["stage"])
    assert int(res.counts_RSLE[r, s, row["layer"], row["expert"]]) == row["len"]
    print("check: baseline and count_trace agree (totals and a sampled cell)")


if __name__ == "__main__":
    main()
