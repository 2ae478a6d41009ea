"""What ``run_compare`` found (``CompareResult``: per strategy its placement and simulated traffic),
its summary rows (normalized times and bytes per strategy and bound) and the result files the
dashboards read (``write_results``; names, format and version from ``moetrace.results.COMPARE``).

Shape legend (docs/architecture.md): B batches (steps), L MoE layers, P physical slots.

Out of scope: computing the result (``compare``); the printed table (``report``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from moetrace import results as rf
from moetrace.placement.compare_config import CompareConfig
from moetrace.placement.compare_manifest import CompareManifest
from moetrace.placement.compare_placing import PlacedStrategy
from moetrace.placement.compare_row import CompareRow
from moetrace.placement.compare_steps import Measure, a2a_seconds_B, a2a_seconds_median, inter_bytes_BL
from moetrace.placement.simulate import METRICS

if TYPE_CHECKING:
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = ["MIN_ORACLE_GAIN", "CompareResult", "Stage", "write_results"]


#: the least saving over linear (a share of linear's median) the oracle must show before compare says
#: what share of it each strategy reaches
MIN_ORACLE_GAIN = 0.02


Stage = Literal["decode", "prefill"]


@dataclass(frozen=True, kw_only=True)
class CompareResult:
    """What ``run_compare`` found: per strategy its placement and simulated traffic."""

    config: CompareConfig  # what was asked
    manifest: CompareManifest  # the run's configuration and facts, as written to compare.json
    metrics: dict[str, dict[str, np.ndarray]]  # strategy -> metric -> float64 [B, L] (decode steps)
    placed: dict[str, PlacedStrategy]  # strategy -> its placement
    prefill_metrics: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # same, prefill steps (empty: none)

    @property
    def model(self) -> ModelInfo:
        """The traced model."""
        return self.manifest.model

    @property
    def reference(self) -> str:
        """The strategy whose median normalizes inter-node volume."""
        return self.manifest.reference

    @property
    def bounds(self) -> tuple[str, ...]:
        """The rows of ``metrics`` that are upper bounds (strategies.BOUNDS), not strategies."""
        return self.manifest.bounds

    def inter_BL(self, strategy: str) -> np.ndarray:
        return inter_bytes_BL(self.metrics[strategy])

    def normalized_B(self, strategy: str) -> np.ndarray:
        """Per-batch inter-node bytes (all layers) / median of the reference's, float [B]."""
        ref = np.median(self.inter_BL(self.reference).sum(1))
        return self.inter_BL(strategy).sum(1) / ref if ref > 0 else np.full(self.inter_BL(strategy).shape[0], np.nan)

    def time_normalized_B(
        self, strategy: str, what: Literal["a2a", "moe"] = "a2a", *, stage: Stage = "decode"
    ) -> np.ndarray:
        """Per-step predicted seconds (all layers) of ``what`` (``a2a``: dispatch + combine; ``moe``:
        with the experts) over the reference's median, float [B] (NaN where unknown)."""
        metrics = self.metrics if stage == "decode" else self.prefill_metrics
        if strategy not in metrics or self.reference not in metrics:
            return np.full(1, np.nan)

        def seconds_B(s: str) -> np.ndarray:
            m = metrics[s]
            return a2a_seconds_B(m) if what == "a2a" else m["moe_seconds"].sum(1)

        ref = float(np.median(seconds_B(self.reference)))
        return seconds_B(strategy) / ref if ref > 0 else np.full(len(seconds_B(strategy)), np.nan)

    @property
    def measure(self) -> Measure:
        """What the verdict ranks by (``compare_verdict``): ``moe`` (MoE-layer time), or ``a2a`` when the
        model's expert size is unknown."""
        v = self.manifest.verdict
        return "moe" if v is not None and v.by_moe_time else "a2a"

    def summary_rows(self) -> list[CompareRow]:
        """One row per strategy and bound (``summary.parquet``'s, ``compare_row.CompareRow``).
        ``oracle_captured``: the share of the oracle's saving over linear that the row reaches, (1 - v) / (1 - v_oracle) of median normalized times in the
        verdict's measure (``measure``: MoE-layer time, all-to-all time when the expert size is
        unknown); None without an oracle row, or when the oracle saves less than ``MIN_ORACLE_GAIN``
        (a share of noise is noise). Time columns: decode steps unless prefixed ``prefill_``."""
        med = {s: _q(self.time_normalized_B(s, self.measure), 0.5) for s in self.metrics}
        gain = 1.0 - med["oracle"] if "oracle" in med else 0.0
        gain = gain if gain >= MIN_ORACLE_GAIN else 0.0
        limit = self.manifest.max_node_load
        rows = []
        for s, m in self.metrics.items():
            nb = self.normalized_B(s)
            a2a, moe = self.time_normalized_B(s, "a2a"), self.time_normalized_B(s, "moe")
            load = self.placed[s].extra.get("busiest_node_load")
            gpu_load = m["tokens_per_rank_max"] / np.where(
                m["tokens_per_rank_mean"] > 0, m["tokens_per_rank_mean"], np.nan
            )
            pre = self.prefill_metrics.get(s)
            rows.append(
                CompareRow(
                    strategy=s,
                    is_bound=s in self.bounds,
                    a2a_time_normalized_median=_q(a2a, 0.5),
                    a2a_time_normalized_p10=_q(a2a, 0.1),
                    a2a_time_normalized_p90=_q(a2a, 0.9),
                    moe_time_normalized_median=_q(moe, 0.5),
                    moe_time_normalized_p10=_q(moe, 0.1),
                    moe_time_normalized_p90=_q(moe, 0.9),
                    a2a_seconds_per_step_median=a2a_seconds_median(m),
                    moe_seconds_per_step_median=float(np.median(m["moe_seconds"].sum(1))),
                    busiest_node_load=load,
                    over_node_load_limit=bool(
                        load is not None
                        and limit is not None
                        and load > self.placed[s].extra.get("node_load_limit", limit) + 1e-9
                    ),
                    busiest_gpu_load=float(np.nanmean(gpu_load)) if np.isfinite(gpu_load).any() else float("nan"),
                    oracle_captured=(1.0 - med[s]) / gain if gain > 0 else None,
                    inter_node_normalized_median=float(np.median(nb)),
                    inter_node_normalized_p10=float(np.quantile(nb, 0.1)),
                    inter_node_normalized_p90=float(np.quantile(nb, 0.9)),
                    inter_node_bytes_per_batch_median=float(np.median(self.inter_BL(s).sum(1))),
                    intra_node_bytes_per_batch_median=float(
                        np.median((m["dispatch_intra_bytes"] + m["combine_intra_bytes"]).sum(1))
                    ),
                    max_rank_dispatch_send_bytes_mean=float(m["max_rank_dispatch_send_bytes"].mean()),
                    tokens_per_rank_max_mean=float(m["tokens_per_rank_max"].mean()),
                    activated_experts_per_rank_max_mean=float(m["activated_experts_per_rank_max"].mean()),
                    router_match_rate=self.placed[s].router_match_rate,
                    groups_without_routed_requests=len(self.placed[s].extra.get("groups_without_routed_requests", [])),
                    prefill_a2a_time_normalized_median=_q(self.time_normalized_B(s, "a2a", stage="prefill"), 0.5),
                    prefill_moe_time_normalized_median=_q(self.time_normalized_B(s, "moe", stage="prefill"), 0.5),
                    prefill_inter_node_normalized_median=self._prefill_bytes_normalized(s, pre),
                )
            )
        return rows

    def _prefill_bytes_normalized(self, strategy: str, pre: dict[str, np.ndarray] | None) -> float:
        ref = self.prefill_metrics.get(self.reference)
        if pre is None or ref is None:
            return float("nan")
        r = float(np.median(inter_bytes_BL(ref).sum(1)))
        return float(np.median(inter_bytes_BL(pre).sum(1)) / r) if r > 0 else float("nan")


def _q(x: np.ndarray, q: float) -> float:
    """Quantile ``q`` of ``x``, NaN when ``x`` holds any NaN (an unknown term stays unknown)."""
    return float("nan") if np.isnan(x).any() else float(np.quantile(x, q))


def write_results(result: CompareResult, out: str | os.PathLike) -> list[Path]:
    """Write the files the dashboards read (documented in docs/placement.md; names, format and
    version from ``moetrace.results.COMPARE``); returns their paths, ``compare.json`` last."""
    import polars as pl

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_layers = np.asarray(result.model.moe_layers)
    frames, batch_frames, place_frames = [], [], []
    for s, m in result.metrics.items():
        B, L = m[METRICS[0]].shape
        ref_L = np.median(result.inter_BL(result.reference), axis=0)
        inter_BL = result.inter_BL(s)
        cols = {
            "strategy": [s] * (B * L),
            "batch": np.repeat(np.arange(B), L),
            "layer": np.tile(np.arange(L), B),
            "model_layer": np.tile(model_layers, B),
        }
        cols.update({k: v.reshape(-1) for k, v in m.items()})
        cols["inter_node_normalized"] = (inter_BL / np.where(ref_L > 0, ref_L, np.nan)).reshape(-1)
        frames.append(pl.DataFrame(cols))
        batch_frames.append(
            pl.DataFrame(
                {
                    "strategy": [s] * B,
                    "batch": np.arange(B),
                    **{
                        k: m[k].sum(1)  # over layers
                        for k in (
                            "dispatch_intra_bytes",
                            "dispatch_inter_bytes",
                            "combine_intra_bytes",
                            "combine_inter_bytes",
                        )
                    },
                    "inter_node_normalized": result.normalized_B(s),
                    "a2a_time_normalized": result.time_normalized_B(s, "a2a"),
                    "moe_time_normalized": result.time_normalized_B(s, "moe"),
                }
            )
        )
        place_frames.append((s, result.placed[s].placement.phy2log))
    num_ep, ranks_per_node = result.manifest.num_ep, result.manifest.ranks_per_node
    rows = []
    for s, phy2log_LP in place_frames:
        Lp, P = phy2log_LP.shape
        gpu_P = np.arange(P) // (P // num_ep)
        rows.append(
            pl.DataFrame(
                {
                    "strategy": [s] * (Lp * P),
                    "layer": np.repeat(np.arange(Lp), P),
                    "model_layer": np.repeat(model_layers, P),
                    "slot": np.tile(np.arange(P), Lp),
                    "gpu": np.tile(gpu_P, Lp),
                    "node": np.tile(gpu_P // ranks_per_node, Lp),
                    "expert": phy2log_LP.reshape(-1),
                }
            )
        )
    return [
        rf.write_result_table(out, rf.COMPARE, rf.COMPARE_LAYERS, pl.concat(frames)),
        rf.write_result_table(out, rf.COMPARE, rf.COMPARE_BATCHES, pl.concat(batch_frames)),
        rf.write_result_table(
            out, rf.COMPARE, rf.COMPARE_SUMMARY, pl.DataFrame([r.to_row() for r in result.summary_rows()])
        ),
        rf.write_result_table(out, rf.COMPARE, rf.COMPARE_PLACEMENTS, pl.concat(rows)),
        rf.write_result_json(
            out,
            rf.COMPARE,
            rf.COMPARE_MANIFEST,
            {**result.manifest.to_json(), "trace": rf.recorded_path(result.manifest.trace, results_dir=out)},
        ),  # last: names a complete directory
    ]
