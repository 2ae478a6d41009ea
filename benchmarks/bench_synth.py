"""Benchmark of ``moetrace synth``: expert ids generated and written per second, and peak memory.

Shape: DeepSeek-V3 (58 MoE layers x 256 experts x top-8 = 464 ids per token), the paper's seven
datasets, the deepseek-v3 calibration. For each N in --requests, a fresh subprocess runs
``synthesize`` end to end (plant truth, generate in --workers processes, write Parquet through
TraceWriter) and reports ids/s and the peak RSS of the writer process and of the largest worker.
Reported: wall ids/s, and ids per CPU-second of all processes (robust to other load on the
machine). In the same run, two references on one core (CPU time): generation alone (no writing) of
the same sampler, and a naive Gumbel-top-k over all E experts per (token, layer) on one profile.

    .venv/bin/python benchmarks/bench_synth.py --requests 1000,4000 --workers 2
    .venv/bin/python benchmarks/bench_synth.py --calibration   # the statistics of each preset (docs/synth.md's
                                                                # calibration table uses python -m moetrace.tracer.synth_stats)
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _one(n: int, workers: int, out: Path) -> dict:
    from moetrace.tracer.presets import model_info_for
    from moetrace.tracer.synth import PAPER_DATASETS, SynthPlan, load_calibration, synthesize

    model = model_info_for("deepseek-v3")
    plan = SynthPlan(datasets=PAPER_DATASETS, num_requests=n, seed=0, knobs=load_calibration("deepseek-v3"))
    s = synthesize(out, model=model, plan=plan, workers=workers, on_existing="overwrite")
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    self_kib, child_kib = me.ru_maxrss, kids.ru_maxrss
    cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    return {
        "requests": n,
        "tokens": s.num_tokens,
        "ids": s.num_ids,
        "seconds": round(s.seconds, 2),
        "Mids_per_s": round(s.num_ids / s.seconds / 1e6, 1),
        "cpu_seconds": round(cpu, 1),
        "Mids_per_cpu_s": round(s.num_ids / cpu / 1e6, 1),
        "peak_rss_writer_MiB": round(self_kib / 1024),
        "peak_rss_worker_MiB": round(child_kib / 1024),
        "bytes_on_disk": s.bytes_on_disk,
    }


def _references(seconds: float = 4.0) -> dict:
    """Generation alone vs naive Gumbel-top-k, one core, on the same model and calibration."""
    from moetrace.tracer.presets import model_info_for
    from moetrace.tracer.synth import (
        PAPER_DATASETS,
        SynthPlan,
        _make_sampler,
        generate_chunk,
        load_calibration,
        plant_truth,
    )

    model = model_info_for("deepseek-v3")
    plan = SynthPlan(datasets=PAPER_DATASETS, num_requests=10**6, seed=0, knobs=load_calibration("deepseek-v3"))
    truth = plant_truth(model, plan)
    sampler = _make_sampler(model, plan, truth)
    t0, ids, c = time.process_time(), 0, 0
    while time.process_time() - t0 < seconds:
        ids += generate_chunk(sampler, c).topk_ids_TX.size
        c += 1
    ours = ids / (time.process_time() - t0)

    rng = np.random.default_rng(0)
    logp_LE = np.log(truth.prefill_DLE[0])  # one dataset's profile, [L, E]
    T, K = 2048, model.top_k
    t0, ids = time.process_time(), 0
    while time.process_time() - t0 < seconds:
        key_TLE = logp_LE[None] - np.log(-np.log(rng.random((T, *logp_LE.shape))))
        np.argpartition(-key_TLE, K - 1, axis=2)[:, :, :K].astype(np.int16)
        ids += T * logp_LE.shape[0] * K
    naive = ids / (time.process_time() - t0)
    return {
        "generate_only_Mids_per_cpu_s": round(ours / 1e6, 1),
        "naive_gumbel_topk_Mids_per_cpu_s": round(naive / 1e6, 1),
        "speedup_vs_naive": round(ours / naive, 1),
    }


def _calibration_rows() -> None:
    """The calibration figures of docs/synth.md: each preset measured in memory, seeds 0 and 1."""
    from moetrace.tracer.presets import model_info_for
    from moetrace.tracer.synth import PAPER_DATASETS, SynthPlan, load_calibration
    from moetrace.tracer.synth_stats import measure_plan

    for model, n in (("llama4-maverick", 2100), ("deepseek-v3", 1400), ("qwen3-235b-a22b", 700)):
        for seed in (0, 1):
            plan = SynthPlan(datasets=PAPER_DATASETS, num_requests=n, seed=seed, knobs=load_calibration(model))
            r = measure_plan(model_info_for(model), plan, workers=2)
            print(json.dumps({"model": model, "requests": n, "seed": seed, **r}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", default="1000,4000", help="comma-separated request counts (one subprocess each)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--calibration", action="store_true", help="print the calibration figures of docs/synth.md instead")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.calibration:
        _calibration_rows()
        return
    if args.one is not None:
        print(json.dumps(_one(args.one, args.workers, args.out)))
        return
    rows = []
    for n in (int(x) for x in args.requests.split(",")):
        tmp = Path(tempfile.mkdtemp(prefix="bench-synth-"))
        try:
            res = subprocess.run(
                [sys.executable, __file__, "--one", str(n), "--workers", str(args.workers), "--out", str(tmp / "t")],
                check=True,
                capture_output=True,
                text=True,
            )
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(_references()), flush=True)


if __name__ == "__main__":
    main()
