"""``analyze()``: count once, run the chosen analyses, write every result into a results directory.

Each result is a Parquet table (or JSON) named in ``docs/analysis.md``; the names, the format
name and the version come from ``moetrace.results`` (``ANALYSIS``), and every file carries them
(JSON keys, Parquet schema metadata). ``manifest.json`` records what was computed, from which trace
(path and the trace manifest's model/backend/collection and recorded stages), when, with which
moetrace version and parameters, and under ``skipped`` each analysis (or part) that did not run with
its one-line reason; ``summary.json`` holds the headline numbers (and the same ``skipped``).

Affinity reads the trace a second time and needs no counts: it starts on a background thread once the
counts are done and runs beside the other steps; its tables are written in its turn (last), so the results
are the same as run one after another. Before it, that thread imports the scikit-learn modules of the chosen
steps (``PRELOADED_MODULES``) while the trace is counted.

Partial captures (a public capture of one MoE layer of 24; only some layers recorded): a layer
where no request has a recorded id in a stage is *empty* (``RequestCounts.empty_layers``, listed
in ``summary.json`` ``layers.empty``); its per-layer numbers are NaN (null for ids), every mean over
layers leaves it out and the printed table says how many it left out; classification runs on the
layers with prefill routing; an analysis that cannot run at all (an embedding with fewer than 5
requests with routing, cross-layer affinity without two consecutive recorded layers) is recorded
under ``skipped`` with its reason.

Single-stage traces (an imported capture of generated tokens only, ``collection.stages``, read by
``schema.stages_of``): only the recorded stage is counted; what needs both stages (prefill↔decode
correlation and recall) or the missing one (classification from prefill counts) is skipped with the
reason, logged and recorded; everything else runs on the recorded stage.

Out of scope: the algorithms themselves (one module each), drawing (``dashboards``), the result
format's names (``moetrace.results``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import polars as pl

from moetrace import results as rf
from moetrace.analysis.embedding_step import embedding_line, run_embedding_one_thread
from moetrace.errors import ConfigError
from moetrace.stats import mean_skip_nan
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import STAGE_DECODE, STAGE_PREFILL, STAGES, stages_of

if TYPE_CHECKING:
    from moetrace.analysis.embedding import Method

Analysis = Literal["imbalance", "correlation", "embedding", "classify", "affinity", "counts"]
#: what runs when nothing is chosen (``counts``, the tidy table, is opt-in: it can be large)
DEFAULT_ANALYSES: tuple[str, ...] = ("imbalance", "correlation", "embedding", "classify", "affinity")
ANALYSES: tuple[str, ...] = (*DEFAULT_ANALYSES, "counts")
#: the scikit-learn modules a step imports, loaded on a background thread while the trace is counted
PRELOADED_MODULES: dict[str, tuple[str, ...]] = {
    "classify": ("sklearn.linear_model", "sklearn.metrics"),
    "embedding": ("sklearn.decomposition", "sklearn.manifold", "sklearn.cluster", "sklearn.neighbors"),
}


@dataclass(frozen=True, kw_only=True)
class AnalyzeConfig:
    """Parameters of one ``analyze`` run (recorded in the results manifest)."""

    only: tuple[str, ...] = DEFAULT_ANALYSES  # analyses to run, out of ANALYSES
    seed: int = 0  # seeds batches, splits, subsamples, t-SNE/UMAP, K-means, token sampling
    layers: tuple[int, ...] | None = None  # MoE-layer ordinals to analyse (default all); affinity always uses all
    batch_size: int = 64  # requests per serving batch for the batch IF distribution
    num_batches: int = 1000  # at most this many batches per scope
    embedding_max_requests: int | None = 4000  # requests embedded per stage (stratified by dataset); None = all
    embedding_fit_requests: int = 1000  # of those, the sample t-SNE/UMAP fit (the rest placed by neighbours)
    embedding_layer: int | None = None  # MoE-layer ordinal to embed; None = all analysed layers concatenated
    embedding_methods: tuple[Method, ...] = ("tsne",)  # projections to compute (umap: compiles numba first)
    classify_max_requests_per_dataset: int = 5000  # cap per dataset before the 80:20 split
    affinity_max_tokens: int = 500_000  # token sample for cross-layer affinity and co-activation
    recall_k: int | None = None  # k of prefill→decode recall@k (default the model's top-k)
    allow_incomplete: bool = False  # analyse the committed part of an unfinished trace
    # requests whose counts are held (memory ~ requests x stages x layers x experts): beyond it, a seeded
    # sample stratified by dataset (every dataset keeps at least min(its requests, 50)); 0 = all
    max_requests: int = 20_000

    def __post_init__(self) -> None:
        if self.max_requests < 0:
            raise ConfigError(f"--max-requests must be >= 0 (0: all), got {self.max_requests}")
        bad = [a for a in self.only if a not in ANALYSES]
        if bad or not self.only:
            raise ConfigError(f"unknown analyses {bad or '(none chosen)'}; choose from {', '.join(ANALYSES)}")
        if self.batch_size < 1 or self.num_batches < 1:
            raise ConfigError(
                f"batch size and number of batches must be >= 1, got {self.batch_size}, {self.num_batches}"
            )
        for m in self.embedding_methods:
            if m not in ("tsne", "umap"):
                raise ConfigError(f"unknown embedding method {m!r}; use tsne and/or umap")
        if self.embedding_fit_requests < 5 or (self.embedding_max_requests or 5) < 5:
            raise ConfigError(
                f"an embedding fits at least 5 requests; got fit {self.embedding_fit_requests}, "
                f"max {self.embedding_max_requests}"
            )


def request_sample(dataset_R: np.ndarray, *, max_requests: int, seed: int) -> np.ndarray | None:
    """Rows of the requests analysed when there are more than ``max_requests`` (0: no cap), int64
    ascending; None when every request is. Stratified by dataset: each keeps
    ``max(min(n_d, 50), floor(max_requests * n_d / R))`` of its ``n_d`` requests, drawn with ``seed``."""
    R = int(dataset_R.shape[0])
    if max_requests == 0 or R <= max_requests:
        return None
    rng = np.random.default_rng([seed, 31])
    labels, inv = np.unique(np.asarray(dataset_R).astype(str), return_inverse=True)
    keep = []
    for d in range(len(labels)):
        rows_d = np.flatnonzero(inv == d)
        k = max(min(len(rows_d), 50), (max_requests * len(rows_d)) // R)
        keep.append(rng.choice(rows_d, size=min(k, len(rows_d)), replace=False))
    return np.sort(np.concatenate(keep)).astype(np.int64)


def analyze(
    trace_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    config: AnalyzeConfig = AnalyzeConfig(),
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run the analyses of ``config`` on the trace at ``trace_path``; write results into ``out``.

    Returns the summary (also written as ``summary.json``). ``log`` receives one line per step,
    ``progress(tokens_done, tokens_total)`` follows the counting pass.
    """
    from moetrace import __version__
    from moetrace.analysis.counts import count_trace, write_counts_table
    from moetrace.tracer.trace.profile import is_profile

    if is_profile(trace_path):  # expert counts, no requests: the analyses of loads only
        from moetrace.analysis.profile_analysis import analyze_profile

        return analyze_profile(
            trace_path,
            out,
            only=config.only,
            layers=config.layers,
            parameters=dataclasses.asdict(config),
            overwrite=overwrite,
            log=log,
        )
    say = log or (lambda _msg: None)
    trace = open_trace(trace_path, require_complete=not config.allow_incomplete)
    out = Path(out)
    rf.check_output(out, rf.ANALYSIS, overwrite=overwrite)
    out.mkdir(parents=True, exist_ok=True)
    if config.embedding_layer is not None and config.layers is not None and config.embedding_layer not in config.layers:
        raise ConfigError(
            f"embedding layer {config.embedding_layer} is not among the analysed layers {list(config.layers)}"
        )

    t_start = time.perf_counter()
    files: dict[str, str] = {}
    summary: dict[str, Any] = {}
    timings: dict[str, float] = {}
    recorded = stages_of(trace)
    skipped: dict[str, str] = {}  # analysis (or part) -> why it did not run

    def write(name: str, df: pl.DataFrame, what: str) -> None:
        rf.write_result_table(out, rf.ANALYSIS, name, df)
        files[name] = what

    # one background thread: scikit-learn's imports while the trace is counted, then affinity (below)
    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetrace-analyze")
    try:
        preload = tuple(dict.fromkeys(m for a in config.only for m in PRELOADED_MODULES.get(a, ())))
        if preload:
            background.submit(_preload, preload)
        needs_counts = [a for a in config.only if a != "affinity"]
        counts = None
        if needs_counts:
            say("counting tokens per (request, stage, layer, expert)")
            t0 = time.perf_counter()
            sample = request_sample(trace.request_arrays.dataset_R, max_requests=config.max_requests, seed=config.seed)
            if sample is not None:
                summary["request_sample"] = {
                    "num_trace_requests": int(trace.request_arrays.dataset_R.shape[0]),
                    "num_analysed": int(sample.size),
                    "max_requests": config.max_requests,
                }
                say(
                    f"analysing a sample of {sample.size:,} of the trace's {trace.request_arrays.dataset_R.shape[0]:,} "
                    f"requests (stratified by dataset; --max-requests {config.max_requests:,}, 0 for all)"
                )
            counts = count_trace(
                trace,
                stages=[s for s in STAGES if s in recorded],
                layers=config.layers,
                allow_incomplete=config.allow_incomplete,
                progress=progress,
                rows=sample,
            )
            timings["counts"] = time.perf_counter() - t0
            summary["num_requests"] = counts.num_requests
            summary["datasets"] = counts.datasets()
            empty = counts.empty_layers()
            if all(len(ls) == len(counts.layers) for ls in empty.values()):
                raise ConfigError(
                    f"no recorded routing at the analysed MoE layers {list(counts.layers)} (every id there is -1); "
                    f"`moetrace info {trace_path}` lists the layers that hold routing; pass those to --layers"
                )
            summary["layers"] = {"num_layers": len(counts.layers), "empty": empty}
            for stage, ls in empty.items():
                if ls:
                    say(
                        f"{stage}: {len(ls)} of {len(counts.layers)} MoE layers have no recorded routing (left out of means)"
                    )

        if "counts" in config.only:
            t0 = time.perf_counter()
            assert counts is not None  # "counts" is one of needs_counts
            n = write_counts_table(counts, out / rf.COUNTS)
            files[rf.COUNTS] = "tidy non-zero token counts per request, stage, layer, expert"
            summary["counts_rows"] = n
            timings["counts_table"] = time.perf_counter() - t0

        # affinity reads the trace again and needs no counts: it starts now on a background thread (its numba
        # kernel and pyarrow's decoding release the GIL) and is written in its turn, last, as if it ran there
        early: dict[str, Future[tuple[dict[str, Any], list[tuple[str, pl.DataFrame, str]], float]]] = {}
        if "affinity" in config.only:
            early["affinity"] = background.submit(_deferred, lambda w: _run_affinity(trace, config, w))
        steps = (  # (analysis, what it does, step) in the order they run
            ("imbalance", "expert load and imbalance factor", lambda: _run_imbalance(counts, config, write)),
            (
                "correlation",
                "datasets, prefill↔decode (pooled, per request), recall@k",
                lambda: _run_correlation(counts, config, write),
            ),
            (
                "classify",
                "per-layer logistic regression from prefill counts to dataset",
                lambda: _run_classify(counts, config, write),
            ),
            (
                "embedding",
                embedding_line(config),
                lambda: run_embedding_one_thread(counts, config, write),
            ),
            (
                "affinity",
                "cross-layer affinity and co-activation on a token sample",
                lambda: _run_affinity(trace, config, write),
            ),
        )
        for name, what, step in steps:
            if name in config.only:
                say(f"{name}: {what}")
                t0 = time.perf_counter()
                if name in early:  # ran in the background: its tables are written now, in this step's turn
                    summary[name], tables, timings[name] = early[name].result()
                    for table in tables:
                        write(*table)
                else:
                    summary[name] = step()
                    timings[name] = time.perf_counter() - t0
                for part, why in _skips(name, summary[name]):
                    skipped[part] = why
                    say(f"{part}: skipped ({why})")
    finally:
        background.shutdown(wait=False, cancel_futures=True)

    summary["skipped"] = skipped
    summary["seconds"] = round(time.perf_counter() - t_start, 3)
    rf.write_result_json(out, rf.ANALYSIS, rf.ANALYSIS_SUMMARY, _jsonable(summary))
    files[rf.ANALYSIS_SUMMARY] = "headline numbers"
    manifest = {
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "moetrace_version": __version__,
        "trace": {
            "path": rf.recorded_path(trace_path, results_dir=out),  # relative to the results
            "complete": trace.complete,
            "model": trace.manifest.get("model"),
            "backend": trace.manifest.get("backend"),
            "collection": trace.manifest.get("collection"),
            "stages": [s for s in STAGES if s in recorded],
        },
        "parameters": _jsonable(dataclasses.asdict(config)),
        "analyses": list(config.only),
        "skipped": skipped,
        "files": files,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
    }
    rf.write_result_json(out, rf.ANALYSIS, rf.ANALYSIS_MANIFEST, manifest)
    return summary


# ------------------------------------------------------------------------------------- steps
def missing_stage_reason(stages: tuple[str, ...], *, needs: tuple[str, ...]) -> str | None:
    """None when every stage of ``needs`` was counted; else the one-line reason an analysis is skipped."""
    missing = [s for s in needs if s not in stages]
    if not missing:
        return None
    return (
        f"needs {' and '.join(needs)} routing; this trace recorded {' and '.join(stages)} only (its manifest's "
        f"collection.stages); run it on a trace that has {' and '.join(missing)} routing"
    )


def _skips(name: str, result: Any) -> list[tuple[str, str]]:
    """``(part, reason)`` of what the step ``name`` skipped, from its summary entry: ``skipped`` (the
    whole step), ``prefill_decode_skipped`` (correlation) and ``skipped_parts`` (``{part: reason}``)."""
    if not isinstance(result, dict):
        return []
    out = [(name, result["skipped"])] if "skipped" in result else []
    if "prefill_decode_skipped" in result:
        out.append(("prefill_decode", result["prefill_decode_skipped"]))
    out.extend(result.get("skipped_parts", {}).items())
    return out


def _run_imbalance(counts, config: AnalyzeConfig, write) -> dict[str, Any]:
    from moetrace.analysis.imbalance import batch_imbalance_table, expert_load_table, imbalance_table

    imb = imbalance_table(counts)
    write(rf.IMBALANCE, imb, "imbalance factor per dataset, stage, layer")
    write(rf.EXPERT_LOAD, expert_load_table(counts), "expert load per dataset, stage, layer, expert")
    out: dict[str, Any] = {  # NaN (layers without routing in the scope) left out of the mean
        "mean_if": _nested(
            imb.group_by("dataset", "stage").agg(pl.col("imbalance_factor").fill_nan(None).mean()), "imbalance_factor"
        )
    }
    batch_size = min(config.batch_size, counts.num_requests)
    if batch_size != config.batch_size:
        out["batch_size_note"] = f"batch size lowered to the {counts.num_requests} requests of the trace"
    bt = batch_imbalance_table(counts, batch_size=batch_size, seed=config.seed, num_batches=config.num_batches)
    write(rf.BATCH_IMBALANCE, bt, f"imbalance factor of random batches of {batch_size} requests")
    out["batch_size"] = batch_size
    out["batch_if"] = _nested(
        bt.filter(pl.col("dataset") == "all")
        .group_by("dataset", "stage")
        .agg(pl.col("imbalance_factor").fill_nan(None).median().alias("median")),
        "median",
    )
    small = [d for d in counts.datasets() if int((counts.dataset_R == d).sum()) < batch_size]
    if small:
        out["skipped_parts"] = {
            "batch_imbalance_per_dataset": f"datasets {small} have fewer than {batch_size} requests, so no "
            f"single-dataset batch of {batch_size}; their requests are in the mixed batches (dataset 'all')"
        }
    return out


def _run_correlation(counts, config: AnalyzeConfig, write) -> dict[str, Any]:
    from moetrace.analysis.correlation import (
        dataset_correlation,
        prefill_decode_per_request,
        prefill_decode_pooled,
        prefill_decode_recall,
    )

    per_layer, mean = dataset_correlation(counts)
    write(rf.DATASET_CORRELATION, per_layer, "dataset × dataset Pearson r per stage and layer")
    write(rf.DATASET_CORRELATION_MEAN, mean, "dataset × dataset Pearson r per stage, mean over layers")
    out: dict[str, Any] = {}
    why = missing_stage_reason(counts.stages, needs=(STAGE_PREFILL, STAGE_DECODE))
    if why is not None:
        out["prefill_decode_skipped"] = why
    else:
        pooled = prefill_decode_pooled(counts)
        write(rf.PREFILL_DECODE_POOLED, pooled, "pooled prefill↔decode r per dataset and layer")
        pr_layers, pr_req = prefill_decode_per_request(counts)
        write(rf.PREFILL_DECODE_PER_REQUEST_LAYERS, pr_layers, "per-request prefill↔decode r, mean per layer")
        write(rf.PREFILL_DECODE_PER_REQUEST, pr_req, "per-request prefill↔decode r, mean over layers")
        rec = prefill_decode_recall(counts, k=config.recall_k)
        write(rf.PREFILL_DECODE_RECALL, rec, "recall@k of decode hot experts from prefill counts")
        ds = pooled.filter(pl.col("dataset") != "all")
        out["prefill_decode_pooled"] = _mean(ds["pearson"])
        out["prefill_decode_pooled_by_dataset"] = {
            r["dataset"]: r["pearson"]
            for r in ds.group_by("dataset").agg(pl.col("pearson").fill_nan(None).mean()).iter_rows(named=True)
        }
        out["prefill_decode_per_request"] = _mean(pr_layers.filter(pl.col("dataset") == "all")["pearson_mean"])
        allrec = rec.filter(pl.col("dataset") == "all")
        out["recall_k"] = int(allrec["k"][0])
        out["recall"] = _mean(allrec["recall"])
        out["recall_popularity"] = _mean(allrec["recall_popularity"])
    return out


def _run_classify(counts, config: AnalyzeConfig, write) -> dict[str, Any]:
    from moetrace.analysis.classify import classify_layers, classify_tables

    why = missing_stage_reason(counts.stages, needs=(STAGE_PREFILL,))
    if why is not None:
        return {"skipped": why}
    if len(counts.datasets()) < 2:
        return {
            "skipped": f"needs at least 2 datasets, the trace has {counts.datasets()}; trace requests of a second dataset"
        }
    smallest = min(int((counts.dataset_R == d).sum()) for d in counts.datasets())
    if round(smallest * 0.2) < 1:  # the 80:20 split needs one test request per dataset
        return {
            "skipped": f"the smallest dataset has {smallest} requests; an 80:20 split needs at least 3 each; trace more requests of it"
        }
    empty = set(counts.empty_layers()[STAGE_PREFILL])
    keep = [i for i, layer in enumerate(counts.layers) if layer not in empty]  # an empty layer has nothing to learn
    if not keep:
        return {"skipped": "no analysed MoE layer has recorded prefill routing"}
    prefill_RLE = counts.stage("prefill")
    res = classify_layers(
        prefill_RLE if len(keep) == len(counts.layers) else prefill_RLE[:, keep],
        counts.dataset_R,
        layers=tuple(counts.layers[i] for i in keep),
        seed=config.seed,
        max_requests_per_dataset=config.classify_max_requests_per_dataset,
    )
    acc, conf = classify_tables(res, model_layers=tuple(counts.model_layers[i] for i in keep))
    write(rf.CLASSIFY_ACCURACY, acc, "test accuracy per layer, shuffled-label control, chance")
    write(rf.CLASSIFY_CONFUSION, conf, "confusion matrix per layer (test split)")
    return {
        "mean_accuracy": res.mean_accuracy,
        "best_layer_accuracy": float(res.accuracy_L.max()),
        "chance": res.chance,
        "mean_shuffled_accuracy": res.mean_shuffled_accuracy,
        "num_train": res.num_train,
        "num_test": res.num_test,
        "num_layers": len(keep),  # layers classified (those with recorded prefill routing)
        "num_empty_layers": len(empty),  # analysed layers left out: no recorded prefill routing
    }


def _run_affinity(trace, config: AnalyzeConfig, write) -> dict[str, Any]:
    from moetrace.analysis.affinity import affinity_table, coactivation_table, pair_counts

    pc = pair_counts(
        trace, max_tokens=config.affinity_max_tokens, seed=config.seed, allow_incomplete=config.allow_incomplete
    )
    aff = affinity_table(pc)
    write(rf.AFFINITY, aff, "cross-layer affinity per consecutive MoE-layer pair")
    write(rf.COACTIVATION, coactivation_table(pc), "expert pairs co-activated within a token, per layer, with lift")
    out: dict[str, Any] = {
        "sampled_tokens": pc.num_sampled,
        "uncertainty_coefficient": _mean(aff["uncertainty_coefficient"]),
        "top1_predictability": _mean(aff["top1_predictability"]),
        "top1_marginal": _mean(aff["top1_marginal"]),
        "num_pairs": aff.height,  # consecutive MoE-layer pairs
        "num_empty_pairs": int((aff["pairs"] == 0).sum()),  # pairs without a token routed at both layers
    }
    if out["num_empty_pairs"] == aff.height:
        has = "the model has one MoE layer" if aff.height == 0 else f"none of the {aff.height} layer pairs has one"
        out["skipped_parts"] = {
            "cross_layer_affinity": f"needs tokens routed at two consecutive MoE layers; {has}; "
            "co-activation within a layer still ran"
        }
    return out


# ------------------------------------------------------------------------------------- helpers
def _preload(modules: tuple[str, ...]) -> None:
    """Import ``modules`` (a background thread's head start). An import that fails here fails again,
    with the same clear error, in the step that needs the module (``require``)."""
    from moetrace._deps import require

    for module in modules:
        require(module, purpose="moetrace analyze")


def _deferred(step: Callable[[Callable[[str, pl.DataFrame, str], None]], dict[str, Any]]):
    """Run ``step(write)`` keeping what it writes: (its summary entry, its tables in order, its seconds)."""
    tables: list[tuple[str, pl.DataFrame, str]] = []
    t0 = time.perf_counter()
    result = step(lambda name, df, what: tables.append((name, df, what)))
    return result, tables, time.perf_counter() - t0


def _mean(s: pl.Series) -> float | None:
    """Mean of the defined values (NaN and null left out); None when there is none."""
    v, _ = mean_skip_nan(s.cast(pl.Float64).to_numpy())
    return None if np.isnan(v) else v


def _nested(df: pl.DataFrame, col: str) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for r in df.sort("dataset", "stage").iter_rows(named=True):
        out.setdefault(r["dataset"], {})[r["stage"]] = None if r[col] is None or np.isnan(r[col]) else float(r[col])
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if np.isnan(x) else float(x)
    return x


def format_summary(summary: dict[str, Any]) -> str:
    """The compact table ``moetrace analyze`` prints."""
    lines = []
    if (smp := summary.get("request_sample")) is not None:
        lines.append(
            f"a sample of {smp['num_analysed']:,} of the trace's {smp['num_trace_requests']:,} requests "
            f"(stratified by dataset; --max-requests {smp['max_requests']:,}, 0 for all)"
        )
    layers = summary.get("layers") or {}
    num_layers = layers.get("num_layers", 0)
    for stage, empty in (layers.get("empty") or {}).items():
        if empty:
            lines.append(
                f"{stage}: {len(empty)} of {num_layers} MoE layers have no recorded routing "
                f"(left out of every mean over layers): {_layer_list(empty)}"
            )
    imb = summary.get("imbalance")
    if imb:
        stages = sorted({s for v in imb["mean_if"].values() for s in v})
        lines.append("mean imbalance factor (over layers)")
        lines.append(f"  {'dataset':<16}" + "".join(f"{s:>10}" for s in stages))
        for ds, v in imb["mean_if"].items():
            lines.append(f"  {ds:<16}" + "".join(f"{_f(v.get(s)):>10}" for s in stages))
        if imb.get("batch_size") is not None:  # None: a load profile (no requests to batch)
            lines.append(
                f"  median IF of random {imb['batch_size']}-request batches: "
                + ", ".join(f"{s} {_f(v)}" for s, v in imb["batch_if"].get("all", {}).items())
            )
        for s, v in (imb.get("window_if") or {}).items():
            lines.append(f"  {s}: median over windows of the mean IF {_f(v['median'])}, worst window {_f(v['max'])}")
    cor = summary.get("correlation")
    if cor and "prefill_decode_skipped" in cor:
        lines.append(f"prefill↔decode correlation: skipped ({cor['prefill_decode_skipped']})")
    if cor and "prefill_decode_pooled" in cor:
        lines.append("prefill↔decode correlation (mean over layers)")
        lines.append(
            f"  pooled per dataset   {_f(cor['prefill_decode_pooled'])}   "
            + "  ".join(f"{d} {_f(v)}" for d, v in sorted(cor["prefill_decode_pooled_by_dataset"].items()))
        )
        if "recall_k" in cor:  # absent on a load profile (no requests)
            lines.append(f"  per request          {_f(cor['prefill_decode_per_request'])}")
            lines.append(
                f"  recall@{cor['recall_k']} of decode hot experts from prefill {_f(cor['recall'])} "
                f"(popularity baseline {_f(cor['recall_popularity'])})"
            )
    cl = summary.get("classify")
    if cl and "mean_accuracy" in cl:
        lines.append(
            f"dataset classification from prefill counts: mean accuracy {_f(cl['mean_accuracy'])} "
            f"(best layer {_f(cl['best_layer_accuracy'])}, chance {_f(cl['chance'])}, "
            f"shuffled control {_f(cl['mean_shuffled_accuracy'])}; {cl['num_train']} train / {cl['num_test']} test"
            + (
                f"; over the {cl['num_layers']} of {cl['num_layers'] + cl['num_empty_layers']} layers with prefill routing"
                if cl.get("num_empty_layers")
                else ""
            )
            + ")"
        )
    elif cl:
        lines.append(f"dataset classification: skipped ({cl['skipped']})")
    emb = {s: v for s, v in (summary.get("embedding") or {}).items() if s in STAGES}
    if emb:
        lines.append(
            "clustering by dataset: "
            + "; ".join(
                f"{s} silhouette {_f(v['silhouette'])}, K-means ARI {_f(v['adjusted_rand'])}" for s, v in emb.items()
            )
        )
    aff = summary.get("affinity")
    if aff and aff.get("num_empty_pairs", 0) < aff.get("num_pairs", 1):  # all pairs empty: skipped, said below
        lines.append(
            f"cross-layer affinity: uncertainty coefficient {_f(aff['uncertainty_coefficient'])}, top-1 "
            f"predictability {_f(aff['top1_predictability'])} vs marginal {_f(aff['top1_marginal'])} "
            f"({aff['sampled_tokens']} tokens"
            + (
                f"; {aff['num_empty_pairs']} of {aff['num_pairs']} layer pairs without routing left out"
                if aff.get("num_empty_pairs")
                else ""
            )
            + ")"
        )
    shown = {"prefill_decode", "classify"}  # printed in place above
    for part, why in (summary.get("skipped") or {}).items():
        if part not in shown:
            lines.append(f"{part}: skipped ({why})")
    return "\n".join(lines)


def _layer_list(layers: list[int], *, most: int = 8) -> str:
    """MoE-layer ordinals as ``layers 0, 1, 3`` (the first ``most``, then how many more)."""
    head = ", ".join(map(str, layers[:most]))
    return f"layers {head}" + (f" and {len(layers) - most} more" if len(layers) > most else "")


def _f(v: float | None) -> str:
    return "n/a" if v is None or np.isnan(v) else f"{v:.3f}"
