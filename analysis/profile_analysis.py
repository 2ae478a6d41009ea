"""``analyze`` on a load profile: the analyses that need only loads, the others skipped with the reason.

A load profile (``moetrace.tracer.trace.profile``) holds tokens per (stage, MoE layer, expert),
optionally per dataset and per window, and no requests. What runs on it:

- ``imbalance``: the imbalance factor and expert load per dataset (and ``all``), stage and layer
  (``imbalance.parquet``, ``expert_load.parquet``: the columns a trace's analysis writes), and the
  imbalance factor of every window (``window_imbalance.parquet``: stage, window, layer,
  model_layer, tokens, imbalance_factor) when the profile has more than one window;
- ``correlation``: dataset × dataset Pearson r per stage and layer (when the profile knows two
  datasets or more), and the pooled prefill↔decode r of loads per dataset and layer (when it
  counted both stages).

Skipped with a recorded reason: the random-batch imbalance, per-request prefill↔decode r and
recall, classification, embeddings, cross-layer affinity and the per-request counts table (each
needs requests or tokens). The summary and manifest have the keys a trace's analysis writes;
``manifest.json`` names the profile under ``profile`` instead of ``trace``.

Shape legend (docs/architecture.md): D datasets (and ``all``), S stages, L MoE layers, E experts,
N windows.

Out of scope: the trace path (``run``), the statistics themselves (``moetrace.stats``).
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moetrace import results as rf
from moetrace.errors import ConfigError
from moetrace.stats import dataset_correlation_LDD, expert_load, imbalance_factor, mean_skip_nan, pearson_paired
from moetrace.tracer.trace.profile import LoadProfile, open_profile

ALL = "all"  # the scope "every token of the profile" (as analysis.imbalance names it)

#: analysis (or part) -> why it cannot run on a profile
NEEDS_REQUESTS: dict[str, str] = {
    "batch_imbalance": "needs requests to form random batches; a load profile holds expert counts only",
    "prefill_decode_per_request": "needs each request's prefill and decode counts; a load profile holds totals only",
    "classify": "needs each request's prefill counts and dataset; a load profile holds totals only",
    "embedding": "needs per-request count vectors; a load profile holds totals only",
    "affinity": "needs each token's experts at consecutive layers; a load profile holds counts only",
    "counts": "the per-request counts table needs requests; a load profile is the counts already",
}


def analyze_profile(
    profile_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    only: tuple[str, ...],
    layers: tuple[int, ...] | None,
    parameters: dict[str, Any],
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the analyses ``only`` names (``run.ANALYSES``) on the load profile at ``profile_path``, at
    the MoE-layer ordinals ``layers`` (None: all); write the results into ``out``. ``parameters``:
    the run's configuration, recorded in the manifest. Returns the summary (also ``summary.json``).
    """
    from moetrace import __version__

    say = log or (lambda _msg: None)
    prof = open_profile(profile_path)
    out = Path(out)
    rf.check_output(out, rf.ANALYSIS, overwrite=overwrite)
    L = prof.model.num_moe_layers
    layers = tuple(range(L)) if layers is None else layers
    if not layers or any(not 0 <= x < L for x in layers):
        raise ConfigError(f"--layers must be MoE-layer ordinals in 0..{L - 1}, got {list(layers)}")
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    files: dict[str, str] = {}
    skipped: dict[str, str] = {}

    def write(name: str, df: pl.DataFrame, what: str) -> None:
        rf.write_result_table(out, rf.ANALYSIS, name, df)
        files[name] = what

    summary: dict[str, Any] = {"num_requests": None, "datasets": list(prof.dataset_labels), "input": "profile"}
    summary["layers"] = {"num_layers": len(layers), "empty": _empty_layers(prof, layers)}
    for name in only:
        say(f"{name}: on the profile's loads" if name in ("imbalance", "correlation") else f"{name}: skipped")
        if name == "imbalance":
            summary[name] = _imbalance(prof, layers, write)
            skipped["batch_imbalance"] = NEEDS_REQUESTS["batch_imbalance"]
        elif name == "correlation":
            summary[name] = _correlation(prof, layers, write)
            skipped["prefill_decode_per_request"] = NEEDS_REQUESTS["prefill_decode_per_request"]
            for part in ("dataset_correlation", "prefill_decode"):
                if f"{part}_skipped" in summary[name]:
                    skipped[part] = summary[name][f"{part}_skipped"]
        else:
            if name == "classify":  # the printed summary says its skip in place; the others under `skipped`
                summary[name] = {"skipped": NEEDS_REQUESTS[name]}
            skipped[name] = NEEDS_REQUESTS[name]
    summary["skipped"] = skipped
    summary["seconds"] = round(time.perf_counter() - t_start, 3)
    rf.write_result_json(out, rf.ANALYSIS, rf.ANALYSIS_SUMMARY, _jsonable(summary))
    files[rf.ANALYSIS_SUMMARY] = "headline numbers"
    manifest = {
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "moetrace_version": __version__,
        "profile": {
            "path": rf.recorded_path(profile_path, results_dir=out),  # relative to the results
            "model": prof.model.to_dict(),
            "source": prof.source,
            "stages": list(prof.stages),
            "num_windows": prof.num_windows,
            "datasets": list(prof.dataset_labels),
        },
        "parameters": _jsonable(parameters),
        "analyses": list(only),
        "skipped": skipped,
        "files": files,
    }
    rf.write_result_json(out, rf.ANALYSIS, rf.ANALYSIS_MANIFEST, manifest)
    return summary


def _scopes(prof: LoadProfile, layers: tuple[int, ...]) -> tuple[list[str], np.ndarray]:
    """Labels ``[*datasets, "all"]`` and int64 ``[D+1, S, L', E]`` counts at the analysed layers."""
    labels = [*prof.dataset_labels, ALL]
    sel = list(layers)
    per = []
    for d in prof.dataset_labels:
        assert prof.datasets is not None  # labels come from it
        per.append(np.stack([prof.datasets[s][d][sel] for s in prof.stages]))
    per.append(np.stack([prof.total(s)[sel] for s in prof.stages]))
    return labels, np.stack(per)


def _empty_layers(prof: LoadProfile, layers: tuple[int, ...]) -> dict[str, list[int]]:
    return {s: [x for x in layers if not prof.total(s)[x].any()] for s in prof.stages}


def _imbalance(prof: LoadProfile, layers: tuple[int, ...], write: Callable[..., None]) -> dict[str, Any]:
    labels, c_DSLE = _scopes(prof, layers)
    K, stages, model_layers = prof.model.top_k, prof.stages, np.asarray(prof.model.moe_layers)
    lay = np.asarray(layers)
    if_DSL = imbalance_factor(c_DSLE)
    D, S, L, E = c_DSLE.shape
    d, s, l = (a.ravel() for a in np.meshgrid(np.arange(D), np.arange(S), np.arange(L), indexing="ij"))
    routed = c_DSLE.any(-1).ravel()
    write(
        rf.IMBALANCE,
        pl.DataFrame(
            {
                "dataset": [labels[i] for i in d],
                "stage": [stages[i] for i in s],
                "layer": lay[l],
                "model_layer": model_layers[lay[l]],
                "tokens": (c_DSLE.sum(-1) // K).ravel(),
                "imbalance_factor": if_DSL.ravel(),
                "hottest_expert": pl.Series(c_DSLE.argmax(-1).ravel(), dtype=pl.Int64).scatter(
                    np.flatnonzero(~routed), None
                ),
            }
        ),
        "imbalance factor per dataset, stage, layer (from the profile's loads)",
    )
    d, s, l, e = (a.ravel() for a in np.meshgrid(np.arange(D), np.arange(S), np.arange(L), np.arange(E), indexing="ij"))
    write(
        rf.EXPERT_LOAD,
        pl.DataFrame(
            {
                "dataset": [labels[i] for i in d],
                "stage": [stages[i] for i in s],
                "layer": lay[l],
                "model_layer": model_layers[lay[l]],
                "expert": e.astype(np.int32),
                "tokens": c_DSLE.ravel(),
                "load": expert_load(c_DSLE).ravel(),
            }
        ),
        "expert load per dataset, stage, layer, expert (from the profile's loads)",
    )
    out: dict[str, Any] = {
        "mean_if": {labels[i]: {stages[j]: _mean(if_DSL[i, j]) for j in range(S)} for i in range(D)},
        "batch_size": None,
        "batch_if": {},
    }
    if prof.num_windows > 1:
        frames = []
        for st in stages:
            c_NLE = prof.counts[st][:, list(layers)]
            if_NL = imbalance_factor(c_NLE)
            N = c_NLE.shape[0]
            n, l = (a.ravel() for a in np.meshgrid(np.arange(N), np.arange(L), indexing="ij"))
            frames.append(
                pl.DataFrame(
                    {
                        "stage": [st] * (N * L),
                        "window": n.astype(np.int64),
                        "layer": lay[l],
                        "model_layer": model_layers[lay[l]],
                        "tokens": (c_NLE.sum(-1) // K).ravel(),
                        "imbalance_factor": if_NL.ravel(),
                    }
                )
            )
            ok = ~np.isnan(if_NL).all(axis=1)
            out.setdefault("window_if", {})[st] = {
                "median": _median(np.nanmean(if_NL[ok], axis=1)) if ok.any() else None,
                "max": float(np.nanmax(if_NL)) if ok.any() else None,
            }
        write(rf.WINDOW_IMBALANCE, pl.concat(frames), "imbalance factor per stage, window and layer")
    return out


def _correlation(prof: LoadProfile, layers: tuple[int, ...], write: Callable[..., None]) -> dict[str, Any]:
    labels, c_DSLE = _scopes(prof, layers)
    stages, model_layers, lay = prof.stages, np.asarray(prof.model.moe_layers), np.asarray(layers)
    out: dict[str, Any] = {}
    D = len(labels) - 1  # without "all"
    if D >= 2:
        c = c_DSLE[:D]
        r_SLDD = np.stack([dataset_correlation_LDD(c[:, j]) for j in range(len(stages))])
        S, L = r_SLDD.shape[:2]
        s, l, a, b = (
            x.ravel() for x in np.meshgrid(np.arange(S), np.arange(L), np.arange(D), np.arange(D), indexing="ij")
        )
        per_layer = pl.DataFrame(
            {
                "stage": [stages[i] for i in s],
                "layer": lay[l],
                "model_layer": model_layers[lay[l]],
                "dataset_a": [labels[i] for i in a],
                "dataset_b": [labels[i] for i in b],
                "pearson": r_SLDD.ravel(),
            }
        )
        write(rf.DATASET_CORRELATION, per_layer, "dataset × dataset Pearson r per stage and layer")
        mean = per_layer.group_by("stage", "dataset_a", "dataset_b", maintain_order=True).agg(
            pl.col("pearson").fill_nan(None).mean()
        )
        write(rf.DATASET_CORRELATION_MEAN, mean, "dataset × dataset Pearson r per stage, mean over layers")
    else:
        out["dataset_correlation_skipped"] = (
            f"needs at least 2 datasets; the profile knows {list(prof.dataset_labels) or 'none'}"
        )
    if "prefill" in stages and "decode" in stages:
        ip, idec = stages.index("prefill"), stages.index("decode")
        r_DL = pearson_paired(c_DSLE[:, ip], c_DSLE[:, idec])
        Dp, L = r_DL.shape
        d, l = (x.ravel() for x in np.meshgrid(np.arange(Dp), np.arange(L), indexing="ij"))
        pooled = pl.DataFrame(
            {
                "dataset": [labels[i] for i in d],
                "layer": lay[l],
                "model_layer": model_layers[lay[l]],
                "pearson": r_DL.ravel(),
            }
        )
        write(rf.PREFILL_DECODE_POOLED, pooled, "pooled prefill↔decode r of loads per dataset and layer")
        own = r_DL[:-1] if D >= 1 else r_DL  # the datasets' rows; the whole profile's without datasets
        out["prefill_decode_pooled"] = _mean(own)
        out["prefill_decode_pooled_by_dataset"] = {labels[i]: _mean(r_DL[i]) for i in range(max(D, 1) if D else Dp)}
    else:
        out["prefill_decode_skipped"] = (
            f"needs prefill and decode counts; the profile counted {' and '.join(stages)} only"
            + (" (prefill and decode not told apart)" if "mixed" in stages else "")
        )
    return out


def _mean(x: np.ndarray) -> float | None:
    v, _ = mean_skip_nan(x)
    return None if np.isnan(v) else v


def _median(x: np.ndarray) -> float | None:
    x = x[~np.isnan(x)]
    return float(np.median(x)) if x.size else None


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if np.isnan(x) else float(x)
    return x
