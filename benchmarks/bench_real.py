"""Placement on public real routing captures: linear, EPLB, ours (joint) and the bounds, at 2, 4 and 8 nodes.

Sources (downloaded, never vendored), one or both:

- ``--esft``: deepseek-ai/ESFT (MIT), ``results/expert_scores/<task>/expert_weights_<layer>.txt``:
  DeepSeek-V2-Lite's per-token routing of 213 teacher-forced sequences of four task domains of
  unequal size (intent 127, law 33, summary 13, translation 40). Takes the repository (a plain
  checkout, or a bare git directory such as a mirror of it, whose files are read with ``git
  cat-file``), its ``results/expert_scores`` folder, or one task folder. Imported with ``--format
  esft`` (``tracer/importers/esft.py``; each sequence a request, its first ``--prompt-fraction`` of
  tokens its prefill) into ``WORK/esft-trace`` (kept and reused while the commit and fraction are the same).
- ``--chaos``: the "Patterns behind Chaos" expert-selection request files (``<n>.json`` per request
  in subject folders; Llama-4-Maverick on MMLU in the public subset at andronius-yang/cse223b-proj,
  no licence stated: read in place). Takes a folder of them or a bare git directory holding them
  (every ``<folder>/<n>.json`` blob of HEAD is written into ``WORK/chaos-src``). Imported with
  ``--format chaos --model`` ``--chaos-model`` (default ``llama4-maverick``) into ``WORK/chaos-trace``.

Then, for each of ``--seeds`` train/held-out splits (``--test-fraction`` of the requests held out),
each held-out arrival order, node count and copy model, ``run_compare`` (what ``moetrace compare``
runs) places linear, EPLB and joint on the training requests and simulates ``--batches`` decode
steps of the held-out ones, with the two bounds (perfect routing, oracle), under the default cost
model (H100-class links, prefill copies per node). Deployments: nodes of 8 GPUs, one expert-parallel
GPU per attention replica (``DP{8n}TP1EP{8n}``: DeepSeek-V2-Lite fits one GPU).

Held-out arrival order. ``compare`` routes the held-out requests in row order (the trace's request
order; ``PriceRouter.route`` -> ``joint.route_requests``), and only the joint router's admission cap
(no node over ``--max-node-load`` times an even share of the requests so far) depends on it. The
ESFT import writes task after task, so the trace order is already single-domain bursts. This
benchmark re-orders the held-out rows among themselves (``arrange_held_out``: training rows stay
where they are, so every placement is fitted on identical input) as:

- ``shuffled``: a seeded random order (requests of all domains interleaved);
- ``bursts``: sorted by dataset (a seeded shuffle inside each domain): every domain arrives as one
  burst, the case where a router that fills a domain's best node first is pushed to other nodes by
  the cap.

Printed: one markdown table per copy model and order, rows node count x strategy, each figure the
mean over the seeds with its [min, max] (node load: the largest over the seeds, ``!`` when one is over
the limit). Written to ``--json``: every row of every run (``summary_rows`` of ``run_compare`` plus
the run's seed, order, nodes, copy model and wall time).

Run: .venv/bin/python benchmarks/bench_real.py --esft PATH/TO/ESFT --chaos PATH/TO/cse223b-proj \\
    [--work /tmp/bench_real] [--nodes 2,4,8] [--dedup expert,node] [--seeds 0,1,2] \\
    [--orders shuffled,bursts] [--batches 200] [--test-fraction 0.3] [--json /tmp/bench_real/rows.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from moetrace.placement.compare import CompareConfig, TraceData, load_trace_data, run_compare
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.strategies import LABELS
from moetrace.tracer.importers import ImportOptions, chaos, esft, import_trace
from moetrace.tracer.presets import resolve
from moetrace.tracer.trace.reader import open_trace

STRATEGIES = ("linear", "eplb", "eplb_global", "data", "joint", "joint_free", "ours")
GPUS_PER_NODE = 8
ORDERS = ("shuffled", "bursts", "trace")
#: the summary columns kept in the JSON rows (``CompareResult.summary_rows``; absent ones are skipped)
COLUMNS = (
    "strategy",
    "is_bound",
    "a2a_time_normalized_median",
    "a2a_time_normalized_p10",
    "a2a_time_normalized_p90",
    "moe_time_normalized_median",
    "a2a_seconds_per_step_median",
    "moe_seconds_per_step_median",
    "inter_node_normalized_median",
    "inter_node_bytes_per_batch_median",
    "busiest_node_load",
    "over_node_load_limit",
    "busiest_gpu_load",
    "router_match_rate",
    "oracle_captured",
    "groups_without_routed_requests",
    "prefill_a2a_time_normalized_median",
    "prefill_moe_time_normalized_median",
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- the source
def _git(git_dir: Path, *args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(
        ["git", "--git-dir", str(git_dir), *args], input=stdin, capture_output=True, check=True
    ).stdout


def _is_bare_git(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def _extract_head(git_dir: Path, dest: Path, *, keep: Callable[[str], bool], what: str) -> str:
    """Write the blobs of ``git_dir``'s HEAD whose path ``keep`` accepts under ``dest`` (``git ls-tree`` +
    one ``git cat-file --batch``), unless ``dest`` already holds this commit; the commit."""
    commit = _git(git_dir, "rev-parse", "HEAD").decode().strip()
    stamp = dest / ".commit"
    if stamp.is_file() and stamp.read_text() == commit:
        return commit
    shutil.rmtree(dest, ignore_errors=True)
    rows = _git(git_dir, "ls-tree", "-r", "HEAD").decode().splitlines()
    files = [(r.split()[2], r.split("\t", 1)[1]) for r in rows if r.split()[1] == "blob"]
    files = [(sha, p) for sha, p in files if keep(p)]
    if not files:
        raise SystemExit(f"{git_dir}: HEAD has no {what}")
    out = _git(git_dir, "cat-file", "--batch", stdin="".join(sha + "\n" for sha, _ in files).encode())
    at = 0
    for sha, p in files:
        header_end = out.index(b"\n", at)
        got_sha, _, size = out[at:header_end].decode().split()
        assert got_sha == sha, (got_sha, sha)
        body = out[header_end + 1 : header_end + 1 + int(size)]
        at = header_end + 1 + int(size) + 1
        (dest / p).parent.mkdir(parents=True, exist_ok=True)
        (dest / p).write_bytes(body)
    stamp.write_text(commit)
    log(f"{len(files)} {what} of {git_dir} at {commit[:12]} written to {dest}")
    return commit


def _imported(src: Path, out: Path, key: dict[str, Any], **how: Any) -> Path:
    """``out``, imported from ``src`` (``import_trace(src, out=out, **how)``) unless it already holds the
    import ``key`` describes (a stamp beside it)."""
    stamp = out.with_name(out.name + ".source")
    text = json.dumps(key)
    if out.exists() and stamp.is_file() and stamp.read_text() == text:
        return out
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    stats = import_trace(src, out=out, **how)
    stamp.write_text(text)
    log(
        f"{out.name}: {stats.num_requests} requests, {stats.num_tokens} tokens imported in {time.perf_counter() - t0:.1f} s"
    )
    return out


def esft_source(path: Path, work: Path) -> tuple[Path, str]:
    """The folder to import and what it is (``commit <sha>`` of a git directory, else the path).

    A bare git directory: ``results/expert_scores`` of its HEAD is written into ``work/esft-src``. A
    plain directory: the repository root (its ``results/expert_scores``), that folder itself, or one
    task folder."""
    if _is_bare_git(path):
        dest = work / "esft-src"
        commit = _extract_head(
            path,
            dest,
            keep=lambda p: p.startswith("results/expert_scores/") and bool(esft.LAYER_FILE.match(Path(p).name)),
            what="results/expert_scores/*/expert_weights_*.txt layer files",
        )
        return dest / "results" / "expert_scores", f"commit {commit}"
    for cand in (path / "results" / "expert_scores", path):
        if cand.is_dir() and esft.detect(b"", cand):
            return cand, str(cand)
    raise SystemExit(f"{path}: neither a git directory nor a folder of ESFT expert logs")


def esft_trace(src: Path, what: str, work: Path, *, prompt_fraction: float) -> Path:
    """``work/esft-trace``, imported from ``src`` unless it already holds this source at this fraction."""
    return _imported(
        src,
        work / "esft-trace",
        {"source": what, "prompt_fraction": prompt_fraction},
        model=esft.model_info(),
        source_format="esft",
        options=ImportOptions(prompt_fraction=prompt_fraction),
    )


def _below_single_folders(path: Path) -> Path:
    """``path``, or the folder below it while it holds nothing but one folder (``traffic-gen/``), so the
    datasets are named by the subject folders alone."""
    while True:
        entries = [e for e in path.iterdir() if not e.name.startswith(".")]
        if len(entries) != 1 or not entries[0].is_dir():
            return path
        path = entries[0]


def chaos_source(path: Path, work: Path) -> tuple[Path, str]:
    """The folder of "Patterns behind Chaos" request files to import and what it is.

    A bare git directory (a mirror of a repository holding the files, e.g. andronius-yang/cse223b-proj):
    every ``<folder>/<n>.json`` blob of its HEAD is written into ``work/chaos-src`` under its path. A
    plain directory is read where it is."""
    if _is_bare_git(path):
        dest = work / "chaos-src"
        commit = _extract_head(
            path,
            dest,
            keep=lambda p: "/" in p and bool(chaos.REQUEST_FILE.match(Path(p).name)),
            what="<folder>/<n>.json request files",
        )
        return _below_single_folders(dest), f"commit {commit}"
    if path.is_dir() and chaos.detect(b"", path):
        return path, str(path)
    raise SystemExit(f"{path}: neither a git directory nor a folder of expert-selection request files")


def chaos_trace(src: Path, what: str, work: Path, *, model: str) -> Path:
    """``work/chaos-trace``, imported from ``src`` unless it already holds this source for this model."""
    return _imported(
        src,
        work / "chaos-trace",
        {"source": what, "folder": src.name, "model": model},
        model=resolve(model).model_info(),
        source_format="chaos",
        options=ImportOptions(),
    )


# ------------------------------------------------------------------------------ the held-out arrival order
def datasets_of_rows(data: TraceData) -> np.ndarray:
    """The dataset label of every row of ``data`` (the trace's requests sorted by id, the rows' order)."""
    req = open_trace(data.trace_path).requests().collect().sort("request_id")
    labels = np.asarray(req["dataset"].to_list(), dtype=object)
    return labels if data.trace_rows_R is None else labels[data.trace_rows_R]


def arrange_held_out(data: TraceData, order: str, *, seed: int) -> TraceData:
    """``data`` with its held-out rows re-ordered among themselves (module docstring: ``shuffled``,
    ``bursts``, ``trace``); training rows keep their rows, so every placement sees the same input. The
    held-out tokens follow their requests (``test_req_T`` stays ascending, as ``held_out_batches`` needs)."""
    if order == "trace":
        return data
    assert data.test_req_T is not None and data.test_topk_ids_TLK is not None, "load the held-out tokens first"
    rng = np.random.default_rng([seed, 34])
    test = np.flatnonzero(data.is_test_R)
    shuffled = rng.permutation(test)
    if order == "shuffled":
        arrival = shuffled
    elif order == "bursts":
        labels = datasets_of_rows(data)[shuffled]
        arrival = shuffled[np.argsort(labels, kind="stable")]
    else:
        raise SystemExit(f"unknown order {order!r}; choose from {', '.join(ORDERS)}")
    perm = np.arange(len(data.is_test_R))  # new row i holds old row perm[i]
    perm[test] = arrival
    new_of_old = np.empty_like(perm)
    new_of_old[perm] = np.arange(len(perm))

    def move(req_T: np.ndarray | None, ids_TLK: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        if req_T is None or ids_TLK is None:
            return req_T, ids_TLK
        new_T = new_of_old[req_T]
        by = np.argsort(new_T, kind="stable")
        return new_T[by], ids_TLK[by]

    test_req, test_ids = move(data.test_req_T, data.test_topk_ids_TLK)
    pre_req, pre_ids = move(data.test_prefill_req_T, data.test_prefill_ids_TLK)
    return replace(
        data,
        prefill_RLE=data.prefill_RLE[perm],
        decode_RLE=data.decode_RLE[perm],
        test_req_T=test_req,
        test_topk_ids_TLK=test_ids,
        test_prefill_req_T=pre_req,
        test_prefill_ids_TLK=pre_ids,
        trace_rows_R=None if data.trace_rows_R is None else data.trace_rows_R[perm],
    )


# ------------------------------------------------------------------------------------------------- tables
def _num(x: Any) -> float:
    return float("nan") if x is None else float(x)


def _agg(values: list[float], fmt: str) -> str:
    v = [x for x in values if not math.isnan(x)]
    if not v:
        return "n/a"
    mean = sum(v) / len(v)
    if len(v) == 1 or max(v) - min(v) < 5e-4:
        return format(mean, fmt)
    return f"{format(mean, fmt)} [{format(min(v), fmt)}, {format(max(v), fmt)}]"


def print_tables(rows: list[dict[str, Any]], *, seeds: list[int], max_node_load: float, header: str) -> None:
    for dedup, order in dict.fromkeys((r["dedup"], r["order"]) for r in rows):
        part = [r for r in rows if r["dedup"] == dedup and r["order"] == order]
        print(f"\n#### {header}; decode copies per {dedup}; held-out requests {order}; {len(seeds)} splits")
        print(
            "| nodes | strategy | MoE-layer time / linear | a2a time / linear | prefill MoE-layer time / linear "
            "| inter-node bytes / linear | node load | busiest GPU / mean | router match |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for nodes in dict.fromkeys(r["nodes"] for r in part):
            for strategy in dict.fromkeys(r["strategy"] for r in part if r["nodes"] == nodes):
                g = [r for r in part if r["nodes"] == nodes and r["strategy"] == strategy]
                load = max(_num(r.get("busiest_node_load")) for r in g)
                over = any(r.get("over_node_load_limit") for r in g)  # the limit integer counts can meet
                name = LABELS.get(strategy, strategy) + (" (bound)" if g[0].get("is_bound") else "")
                if strategy == "ours":  # what it chose on its validation split, per split
                    chose = [r.get("ours_choice") for r in g]
                    name += " → " + ", ".join(f"{c} ×{chose.count(c)}" for c in dict.fromkeys(chose))
                match = [_num(r.get("router_match_rate")) for r in g]
                print(
                    f"| {nodes} | {name} | {_agg([_num(r.get('moe_time_normalized_median')) for r in g], '.3f')} | "
                    f"{_agg([_num(r.get('a2a_time_normalized_median')) for r in g], '.3f')} | "
                    f"{_agg([_num(r.get('prefill_moe_time_normalized_median')) for r in g], '.3f')} | "
                    f"{_agg([_num(r.get('inter_node_normalized_median')) for r in g], '.3f')} | "
                    f"{load:.2f}{' !' if over else ''} | "
                    f"{_agg([_num(r.get('busiest_gpu_load')) for r in g], '.2f')} | "
                    f"{_agg(match, '.2f') if not all(math.isnan(m) for m in match) else '-'} |"
                )


def goal_check(rows: list[dict[str, Any]]) -> list[str]:
    """Per run (seed, order, nodes, copy model): whether ours, within the node-load limit, is at most the
    better EPLB policy in MoE-layer time and in all-to-all time (the issue's goal), as lines saying where not."""
    out = []
    runs = dict.fromkeys((r["seed"], r["order"], r["nodes"], r["dedup"]) for r in rows)
    fails = 0
    for run in runs:
        by = {r["strategy"]: r for r in rows if (r["seed"], r["order"], r["nodes"], r["dedup"]) == run}
        ours = by["ours"]
        for col, what in (("moe_time_normalized_median", "MoE-layer"), ("a2a_time_normalized_median", "a2a")):
            eplb = min(_num(by[s][col]) for s in ("eplb", "eplb_global") if s in by)
            if ours.get("over_node_load_limit") or _num(ours[col]) > eplb + 1e-9:
                fails += 1
                out.append(
                    f"seed {run[0]}, {run[1]}, {run[2]} nodes, copies per {run[3]}: ours {what} {_num(ours[col]):.4f} "
                    f"> EPLB {eplb:.4f} (chose {ours.get('ours_choice')})"
                    + (" [over the node-load limit]" if ours.get("over_node_load_limit") else "")
                )
    out.append(f"ours <= EPLB in MoE-layer and all-to-all time: {2 * len(runs) - fails} of {2 * len(runs)} comparisons")
    return out


# -------------------------------------------------------------------------------------------------- runs
def run_source(
    source: str, trace: Path, header: str, args: argparse.Namespace, *, t_start: float
) -> tuple[list[dict[str, Any]], str]:
    """Every (seed, order, nodes, copy model) run of ``compare`` on one imported capture: its rows and
    the table header (``header`` plus the request count)."""
    nodes_list = [int(x) for x in args.nodes.split(",")]
    dedups, seeds, orders = args.dedup.split(","), [int(x) for x in args.seeds.split(",")], args.orders.split(",")
    model = open_trace(trace).model
    rows: list[dict[str, Any]] = []
    runs = len(seeds) * len(orders) * len(nodes_list) * len(dedups)
    done, num_requests = 0, 0
    for seed in seeds:
        t0 = time.perf_counter()
        data = load_trace_data(trace, test_fraction=args.test_fraction, seed=seed)
        num_requests = len(data.is_test_R)
        n_test = int(data.is_test_R.sum())
        log(
            f"{source}, seed {seed}: {num_requests - n_test} training, {n_test} held-out requests; "
            f"counted in {time.perf_counter() - t0:.1f} s"
        )
        for order, nodes, dedup in itertools.product(orders, nodes_list, dedups):
            arranged = arrange_held_out(data, order, seed=seed)
            n = nodes * GPUS_PER_NODE
            config = f"DP{n}TP1EP{n}"
            cfg = CompareConfig(
                deployment=parse_deployment(config, num_gpus_per_node=GPUS_PER_NODE),
                strategies=STRATEGIES,
                num_batches=args.batches,
                num_batch_requests=args.requests_per_node * nodes,
                dedup=dedup,
                seed=seed,
                test_fraction=args.test_fraction,
                max_node_load=args.max_node_load,
            )
            t1 = time.perf_counter()
            res = run_compare(arranged, cfg)
            wall = time.perf_counter() - t1
            done += 1
            ours_extra = res.placed["ours"].extra
            summary = [row.to_row() for row in res.summary_rows()]
            for r in summary:
                rows.append(
                    {
                        "source": source,
                        "model": model.name,
                        "seed": seed,
                        "order": order,
                        "nodes": nodes,
                        "deployment": config,
                        "dedup": dedup,
                        "num_train_requests": num_requests - n_test,
                        "num_test_requests": n_test,
                        "batches": args.batches,
                        "batch_requests": cfg.batch_requests,
                        "compare_seconds": round(wall, 2),
                        **{k: r[k] for k in COLUMNS if k in r},
                        **(
                            {
                                k: ours_extra.get(k)
                                for k in (
                                    "ours_choice",
                                    "ours_validation",
                                    "ours_validation_detail",
                                    "ours_router_gain",
                                )
                            }
                            if r["strategy"] == "ours"
                            else {}
                        ),
                    }
                )
            by = {r["strategy"]: r for r in summary}
            log(
                f"[{source} {done}/{runs}] seed {seed}, {order}, {config}, dedup {dedup}: {wall:.1f} s; ours -> "
                f"{ours_extra.get('ours_choice')}: MoE {by['ours']['moe_time_normalized_median']:.4f} "
                f"a2a {by['ours']['a2a_time_normalized_median']:.4f}; EPLB MoE {by['eplb']['moe_time_normalized_median']:.4f} "
                f"a2a {by['eplb']['a2a_time_normalized_median']:.4f}; joint MoE {by['joint']['moe_time_normalized_median']:.4f} "
                f"a2a {by['joint']['a2a_time_normalized_median']:.4f} ({time.perf_counter() - t_start:.0f} s so far)"
            )
    header = (
        f"{header}: {num_requests} requests ({args.test_fraction:.0%} held out), {args.batches} decode steps of {args.requests_per_node} requests per node, "
        f"DP(8n)TP1EP(8n) on nodes of {GPUS_PER_NODE} GPUs"
    )
    return rows, header


def gap_summary(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's averages: ours' lead over the better EPLB policy in all-to-all time (points of
    linear's), and the share of the gap from EPLB to the oracle bound it takes, per copy model."""
    out = []
    for dedup in dict.fromkeys(r["dedup"] for r in rows):
        runs = dict.fromkeys((r["seed"], r["order"], r["nodes"]) for r in rows if r["dedup"] == dedup)
        lead, share = [], []
        for run in runs:
            by = {r["strategy"]: r for r in rows if r["dedup"] == dedup and (r["seed"], r["order"], r["nodes"]) == run}
            col = "a2a_time_normalized_median"
            eplb = min(_num(by[s][col]) for s in ("eplb", "eplb_global") if s in by)
            lead.append(eplb - _num(by["ours"][col]))
            if "oracle" in by and eplb - _num(by["oracle"][col]) > 1e-6:
                share.append((eplb - _num(by["ours"][col])) / (eplb - _num(by["oracle"][col])))
        out.append(
            f"copies per {dedup}: ours leads the better EPLB policy by {100 * float(np.mean(lead)):.2f} points of linear's "
            f"all-to-all time on average over {len(runs)} runs"
            + (
                f"; takes {100 * float(np.median(share)):.0f} % (median) of the gap from EPLB to the oracle"
                if share
                else ""
            )
        )
    return out


# --------------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--esft", type=Path, default=None, help="deepseek-ai/ESFT: a checkout, a bare git dir, or its logs")
    ap.add_argument(
        "--chaos",
        type=Path,
        default=None,
        help='"Patterns behind Chaos" request files: a folder of them, or a bare git dir holding them',
    )
    ap.add_argument("--chaos-model", default="llama4-maverick", help="the model of the --chaos files (a preset)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_real"))
    ap.add_argument("--nodes", default="2,4,8")
    ap.add_argument("--dedup", default="expert,node", help="decode copy models (compare --dedup)")
    ap.add_argument("--seeds", default="0,1,2", help="train/held-out splits (compare --seed)")
    ap.add_argument("--orders", default="shuffled,bursts", help=f"held-out arrival orders: {', '.join(ORDERS)}")
    ap.add_argument("--batches", type=int, default=200, help="decode steps simulated per run")
    ap.add_argument(
        "--requests-per-node", type=int, default=32, help="decode batch of each node (compare's default 32)"
    )
    ap.add_argument("--test-fraction", type=float, default=0.3)
    ap.add_argument("--prompt-fraction", type=float, default=esft.DEFAULT_PROMPT_FRACTION, help="ESFT only")
    ap.add_argument("--max-node-load", type=float, default=1.10)
    ap.add_argument("--json", type=Path, default=None, help="all rows (default WORK/rows.json)")
    args = ap.parse_args()
    if args.esft is None and args.chaos is None:
        ap.error("give --esft, --chaos or both: the captures to run on")
    args.work.mkdir(parents=True, exist_ok=True)

    t_start = time.perf_counter()
    traces: list[tuple[str, Path, str]] = []
    sources: dict[str, Any] = {}
    if args.esft is not None:
        src, what = esft_source(args.esft, args.work)
        traces.append(
            (
                "esft",
                esft_trace(src, what, args.work, prompt_fraction=args.prompt_fraction),
                f"ESFT (DeepSeek-V2-Lite, {what[:19]}), prompt = first {args.prompt_fraction:g} of each",
            )
        )
        sources["esft"] = {"repository": "deepseek-ai/ESFT", "read": what, "licence": "MIT"}
    if args.chaos is not None:
        src, what = chaos_source(args.chaos, args.work)
        traces.append(
            (
                "chaos",
                chaos_trace(src, what, args.work, model=args.chaos_model),
                f"Patterns behind Chaos ({args.chaos_model}, {what[:19]}), SGLang prefill + 128 decode tokens",
            )
        )
        sources["chaos"] = {
            "dataset": "core12345/MoE_expert_selection_trace (subset)",
            "read": what,
            "model": args.chaos_model,
            "licence": "none stated: read in place, not vendored",
        }
    rows: list[dict[str, Any]] = []
    headers: dict[str, str] = {}
    for source, trace, header in traces:
        got, headers[source] = run_source(source, trace, header, args, t_start=t_start)
        rows += got
    out = args.json or args.work / "rows.json"
    out.write_text(
        json.dumps(
            {
                "format": "moetrace.bench_real",
                "sources": sources,
                "config": {
                    "strategies": STRATEGIES,
                    "gpus_per_node": GPUS_PER_NODE,
                    "test_fraction": args.test_fraction,
                    "prompt_fraction": args.prompt_fraction,
                    "batches": args.batches,
                    "max_node_load": args.max_node_load,
                    "seeds": args.seeds,
                    "orders": args.orders,
                },
                "wall_seconds": round(time.perf_counter() - t_start, 1),
                "rows": rows,
            },
            indent=1,
            default=lambda o: o.item() if isinstance(o, np.generic) else str(o),
        )
    )
    seeds = [int(x) for x in args.seeds.split(",")]
    for source, header in headers.items():
        part = [r for r in rows if r["source"] == source]
        print_tables(part, seeds=seeds, max_node_load=args.max_node_load, header=header)
        print()
        for line in goal_check(part) + gap_summary(part):
            print(f"- {source}: {line}")
    log(f"{len(rows)} rows written to {out}; {time.perf_counter() - t_start:.0f} s in all")


if __name__ == "__main__":
    main()
