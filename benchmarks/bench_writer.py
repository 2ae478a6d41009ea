"""Trace writer throughput for the DeepSeek-V3 shape (58 MoE layers x top-8 = 464 ids per token).

Measures, in one run on the same data, each repetition in a fresh child process (so each has its own
peak memory), alternating the variants:

- ``after``: this checkout's ``TraceWriter`` (default settings: the fast Parquet encoder, dictionary-encoded
  ids, lz4);
- ``pyarrow encoder``: this checkout's ``TraceWriter(encoder="pyarrow")``, the escape hatch
  (``MOETRACE_PARQUET_ENCODER=pyarrow``): the same files written by plain pyarrow;
- ``before`` (with ``--baseline PATH``): another version of the writer. PATH a directory: a whole checkout
  (``git archive HEAD | tar -x -C /tmp/head``), put first on the child's ``PYTHONPATH``, so its writer,
  encoder and checksum modules are all its own; PATH a file: another ``tracer/trace/writer.py``, loaded under
  another module name (its imports resolve to this checkout's ``moetrace``, so only that module differs);
- ``pyarrow ceiling``: one ``pyarrow.parquet.write_table`` of the bare ``experts`` column, plain encoding,
  no compression (what the Parquet library alone does with the column);
- ``disk floor``: T x X bytes (one byte an id, what the encoded part holds) written in 1 MiB chunks, then one
  ``fsync``: the durable-write floor of this machine's disk for a part of this size (the writer fsyncs each part).

Each child first writes one request (outside the measurement: lazy imports of the first write). Reported
per variant: best and median tokens/s (wall clock), CPU seconds (the least of the repetitions), peak RSS
growth of the child while writing (MiB; the ids are loaded before the baseline is taken), bytes per token
on disk.

    python benchmarks/bench_writer.py [--tokens 400000] [--reps 3] [--baseline /tmp/head]
                                      [--last-token-unrecorded] [--skip pyarrow,ceiling]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

R_STEP = 64  # requests per add_requests call
PROMPT, OUTPUT = 350, 150  # tokens of every request


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _load_writer(path: str | None):
    if path is None or Path(path).is_dir():  # a directory: already first on this child's PYTHONPATH
        from moetrace.tracer.trace.writer import TraceWriter

        return TraceWriter
    spec = importlib.util.spec_from_file_location("moetrace_bench_baseline_writer", path)
    if spec is None or spec.loader is None:
        sys.exit(f"{path}: not a Python module this script can load")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod.TraceWriter


def _child(variant: str, ids_path: str, out: str, writer_path: str | None) -> dict:
    """One measurement in this (fresh) process: write the ids once, return timings and memory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moetrace.tracer.presets import model_info_for

    topk_ids_TX = np.load(ids_path)  # int16 [T, 464]
    T, X = topk_ids_TX.shape
    model = model_info_for("deepseek-v3")
    if variant == "disk":
        chunk = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes()
        left = T * X
        cpu0, t0 = time.process_time(), time.perf_counter()
        with open(Path(out) / "bytes.bin", "wb") as f:
            while left > 0:
                left -= f.write(chunk[: min(left, len(chunk))])
            f.flush()
            os.fsync(f.fileno())
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        return {"wall": wall, "cpu": cpu, "peak_mib": 0.0, "bytes_per_token": X, "tokens": T}
    TraceWriter = None if variant == "ceiling" else _load_writer(writer_path)
    kw = {"encoder": "pyarrow"} if variant == "pyarrow" else {}
    # warm-up outside the measurement: lazy imports (pyarrow's pandas shim, compute kernels) of the first write
    if TraceWriter is not None:
        with TraceWriter(Path(out) / "warmup", model=model, backend={"name": "synthetic"}, collection={}, **kw) as w:
            w.add_request(request_id=0, dataset="gsm8k", prompt_tokens=1, topk_ids_TX=topk_ids_TX[:2])
        shutil.rmtree(Path(out) / "warmup")
    else:
        pq.write_table(
            pa.table({"experts": pa.FixedSizeListArray.from_arrays(pa.array(topk_ids_TX[:2].reshape(-1)), X)}),
            Path(out) / "warmup.parquet",
        )
        (Path(out) / "warmup.parquet").unlink()
    rss0 = _rss_mib()
    cpu0, t0 = time.process_time(), time.perf_counter()
    if variant == "ceiling":
        flat = pa.FixedSizeListArray.from_arrays(pa.array(topk_ids_TX.reshape(-1)), X)
        pq.write_table(
            pa.table({"experts": flat}),
            Path(out) / "bare.parquet",
            compression=None,
            use_dictionary=False,
            write_statistics=False,
        )
    else:
        assert TraceWriter is not None  # every variant but the ceiling has one
        R = T // (PROMPT + OUTPUT)
        P, O = np.full(R, PROMPT, np.int32), np.full(R, OUTPUT, np.int32)
        offsets = np.concatenate([[0], np.cumsum(P + O)])
        with TraceWriter(Path(out) / "w", model=model, backend={"name": "synthetic"}, collection={}, **kw) as w:
            for s in range(0, R, R_STEP):
                e = min(s + R_STEP, R)
                w.add_requests(
                    request_id_R=np.arange(s, e),
                    dataset_R=["gsm8k"] * (e - s),
                    prompt_tokens_R=P[s:e],
                    output_tokens_R=O[s:e],
                    topk_ids_TX=topk_ids_TX[offsets[s] : offsets[e]],
                )
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB (Linux)
    size = sum(f.stat().st_size for f in Path(out).rglob("*.parquet"))
    return {"wall": wall, "cpu": cpu, "peak_mib": peak - rss0, "bytes_per_token": size / T, "tokens": T}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=400_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--baseline", help="path of another tracer/trace/writer.py to measure as `before`")
    ap.add_argument(
        "--last-token-unrecorded",
        action="store_true",
        help="-1 in every slot of each request's last row, as HF and vLLM traces have",
    )
    ap.add_argument("--skip", default="", help="variants left out, comma-separated: pyarrow, ceiling, disk")
    ap.add_argument("--child", nargs=4, metavar=("VARIANT", "IDS", "OUT", "WRITER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        variant, ids, out, writer = args.child
        print(json.dumps(_child(variant, ids, out, None if writer == "-" else writer)))
        return

    from moetrace.tracer.presets import model_info_for

    model = model_info_for("deepseek-v3")
    rng = np.random.default_rng(0)
    R = max(1, args.tokens // (PROMPT + OUTPUT))
    T = R * (PROMPT + OUTPUT)
    # skewed ids like a real trace (Zipf-like popularity per layer)
    pop = rng.dirichlet(np.full(model.num_experts, 0.3), size=model.num_moe_layers)
    experts = np.empty((T, model.num_moe_layers, model.top_k), np.int16)
    for layer in range(model.num_moe_layers):
        experts[:, layer, :] = rng.choice(model.num_experts, size=(T, model.top_k), p=pop[layer])
    if args.last_token_unrecorded:
        experts[PROMPT + OUTPUT - 1 :: PROMPT + OUTPUT] = -1
    root = Path(tempfile.mkdtemp(prefix="bench_writer_"))
    ids_path = root / "ids.npy"
    np.save(ids_path, experts.reshape(T, -1))
    del experts

    variants = (
        [("after", "-")]
        + ([("before", str(Path(args.baseline).resolve()))] if args.baseline else [])
        + [(v, "-") for v in ("pyarrow", "ceiling", "disk") if v not in args.skip.split(",")]
    )
    res: dict[str, list[dict]] = {v: [] for v, _ in variants}
    for rep in range(args.reps):
        order = variants if rep % 2 == 0 else [variants[1], variants[0], *variants[2:]]
        for variant, writer in order:
            out = root / "out"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, str(ids_path), str(out), writer]
            env = dict(os.environ)
            if writer != "-" and Path(writer).is_dir():
                env["PYTHONPATH"] = os.pathsep.join(x for x in (writer, env.get("PYTHONPATH")) if x)
            r = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            res[variant].append(json.loads(r.stdout.strip().splitlines()[-1]))
    shutil.rmtree(root)

    X = model.ids_per_token
    names = {
        "after": "moetrace TraceWriter, this checkout (dict+lz4)",
        "before": f"moetrace TraceWriter, {args.baseline}",
        "pyarrow": "moetrace TraceWriter, encoder='pyarrow'",
        "ceiling": "pyarrow ceiling (plain, bare column)",
        "disk": "disk floor (T x X bytes written + fsync)",
    }
    unrec = ", last token of each request -1" if args.last_token_unrecorded else ""
    print(
        f"{T:,} tokens x {X} ids (DeepSeek-V3 shape{unrec}), {args.reps} reps per variant, one child process each, "
        f"{os.cpu_count()} CPUs, load average before/after: see `uptime`"
    )
    print(f"  {'variant':<60} {'best':>7} {'median':>7} M tok/s  {'CPU s':>6}  {'peak MiB':>8}  {'B/token':>7}")
    for variant, _ in variants:
        runs = res[variant]
        rates = sorted(T / r["wall"] / 1e6 for r in runs)
        print(
            f"  {names[variant]:<60} {rates[-1]:7.3f} {float(np.median(rates)):7.3f}          "
            f"{min(r['cpu'] for r in runs):6.2f}  {max(r['peak_mib'] for r in runs):8.0f}  {runs[0]['bytes_per_token']:7.0f}"
        )
    for other in [v for v, _ in variants if v != "after"]:
        best = {v: min(r["wall"] for r in res[v]) for v in ("after", other)}
        cpu = {v: min(r["cpu"] for r in res[v]) for v in ("after", other)}
        print(
            f"  after / {other}: {best[other] / best['after']:.2f}x tokens/s (best wall), "
            f"{cpu[other] / cpu['after']:.2f}x (CPU time)"
        )


if __name__ == "__main__":
    main()
