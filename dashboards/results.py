"""Read access to a results directory for the sections: its tables, its trace, its label.

A results directory is what ``moetrace analyze``, ``compare``, ``a2a`` or ``advise`` wrote: a manifest
(``manifest.json``, ``compare.json``, ``a2a.json`` or ``advice.json``; the last three typed, read by
the sections as ``compare``, ``a2a`` and ``advice``) naming the trace it was computed from and a set
of Parquet/JSON files. A section asks for a file by its name in ``moetrace.results`` and gets ``None``
when it is absent (that section is then left out, with a note).

Out of scope: recognising directories (``inputs``), drawing (``section_*``), the file names and
formats (``moetrace.results``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moetrace import results as rf
from moetrace.dashboards.inputs import Input
from moetrace.dashboards.page import Figure
from moetrace.dashboards.records import A2AManifest, AdviceManifest
from moetrace.placement.compare_manifest import CompareManifest


@dataclass(frozen=True, kw_only=True)
class Results:
    """One results directory."""

    path: Path  # the directory
    manifest: dict[str, Any]  # its manifest
    kind: str  # "analysis", "placement", "a2a" or "advice"
    compare_manifest: CompareManifest | None = None  # the typed compare.json of a "placement" result
    a2a_manifest: A2AManifest | None = None  # the typed a2a.json of an "a2a" result
    advice_manifest: AdviceManifest | None = None  # the typed advice.json of an "advice" result

    @classmethod
    def from_input(cls, inp: Input) -> Results:
        return cls(
            path=inp.path,
            manifest=inp.manifest,
            kind=inp.kind,
            compare_manifest=inp.compare,
            a2a_manifest=inp.a2a,
            advice_manifest=inp.advice,
        )

    @property
    def compare(self) -> CompareManifest:
        """The typed ``compare.json`` of a ``moetrace compare`` results directory (``ValueError`` for other kinds)."""
        if self.compare_manifest is None:
            raise ValueError(f"{self.path}: {self.kind} results, not `moetrace compare` results")
        return self.compare_manifest

    @property
    def a2a(self) -> A2AManifest:
        """The typed ``a2a.json`` of a ``moetrace a2a`` results directory (``ValueError`` for other kinds)."""
        if self.a2a_manifest is None:
            raise ValueError(f"{self.path}: {self.kind} results, not `moetrace a2a` results")
        return self.a2a_manifest

    @property
    def advice(self) -> AdviceManifest:
        """The typed ``advice.json`` of a ``moetrace advise`` results directory (``ValueError`` for other kinds)."""
        if self.advice_manifest is None:
            raise ValueError(f"{self.path}: {self.kind} results, not `moetrace advise` results")
        return self.advice_manifest

    def has(self, name: str) -> bool:
        return (self.path / name).is_file()

    def table(self, name: str) -> pl.DataFrame | None:
        """The Parquet file ``name`` as a DataFrame, or None when it was not computed."""
        return pl.read_parquet(self.path / name) if self.has(name) else None

    def json(self, name: str) -> Any:
        return json.loads((self.path / name).read_text()) if self.has(name) else None

    def source(self, name: str) -> str:
        """How a figure cites the file it was drawn from."""
        return str(self.path / name)

    def figure(self, key: str, figure: Any, *, file: str, caption: str, max_width: int | None = None) -> Figure:
        """A section's figure drawn from this result's file ``file``, cited under it."""
        return Figure(key=key, figure=figure, source=self.source(file), caption=caption, max_width=max_width)

    @property
    def trace_path(self) -> Path | None:
        """The trace, or the load profile, the results were computed from (as the producer recorded it)."""
        t = self.manifest.get("trace")
        p = t.get("path") if isinstance(t, dict) else t if isinstance(t, str) else None
        return rf.resolve_recorded(p, results_dir=self.path) if p else self.profile_path

    @property
    def profile_path(self) -> Path | None:
        """The load profile the results were computed from: ``analyze``'s manifest ``profile.path``, or
        ``compare.json``'s ``trace`` when its tokens were drawn from a profile (``tokens_from``); None for
        the results of a trace. A profile has no requests: what needs them is not in these results."""
        prof = self.manifest.get("profile")
        if isinstance(prof, dict) and isinstance(prof.get("path"), str):
            return rf.resolve_recorded(prof["path"], results_dir=self.path)
        m = self.compare_manifest
        if m is not None and m.tokens_from is not None and m.trace:
            return rf.resolve_recorded(m.trace, results_dir=self.path)
        return None

    @property
    def model_name(self) -> str:
        t = self.manifest.get("trace")
        m = (t.get("model") if isinstance(t, dict) else None) or self.manifest.get("model") or {}
        return str(m.get("name", "unknown model")) if isinstance(m, dict) else str(m)

    @property
    def trace_label(self) -> str:
        """Short name for section titles when several results are shown: ``<trace dir> / <results dir>``."""
        tp = self.trace_path
        return f"{tp.name if tp else '?'} / {self.path.name}"

    @property
    def label(self) -> str:
        """``trace <name> (<model>), results <dir>`` (``profile <name>`` for a load profile's results): the
        provenance line of every figure."""
        tp = self.trace_path
        trace = f"{'profile' if self.profile_path else 'trace'} {tp.name}" if tp else "trace unknown"
        return f"{trace} ({self.model_name}), {self.kind} results {self.path.name}"


def layer_order(df: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ``(layer, model_layer)`` of a results table, sorted by layer: (layer_L, model_layer_L)."""
    u = df.select("layer", "model_layer").unique().sort("layer")
    return u["layer"].to_numpy(), u["model_layer"].to_numpy()


def datasets_all_last(values: list[str]) -> list[str]:
    """Dataset labels sorted, with the pooled ``"all"`` scope last."""
    named = sorted(v for v in set(values) if v != "all")
    return named + (["all"] if "all" in values else [])


def pivot_LZ(df: pl.DataFrame, *, x: str, x_order: list[Any], value: str, layers_L: np.ndarray) -> np.ndarray:
    """``value`` as a dense ``[L, Z]`` float array, Z the columns ``x_order`` (NaN where a cell is absent)."""
    xi = {v: i for i, v in enumerate(x_order)}
    li = {int(v): i for i, v in enumerate(layers_L)}
    out = np.full((len(layers_L), len(x_order)), np.nan)
    sub = df.filter(pl.col(x).is_in(list(x_order)) & pl.col("layer").is_in(list(li)))
    if sub.height:
        col = sub[x].replace_strict(xi, return_dtype=pl.Int64).to_numpy()
        row = sub["layer"].cast(pl.Int64).replace_strict(li, return_dtype=pl.Int64).to_numpy()
        out[row, col] = sub[value].cast(pl.Float64).fill_null(np.nan).to_numpy()
    return out


def box_stats(values_B: np.ndarray) -> dict[str, float]:
    """Exact quartiles (numpy's linear interpolation), mean, min and max of ``values_B``; NaNs ignored.

    Figures draw boxes from these numbers instead of shipping every value to the browser.
    """
    v = np.asarray(values_B, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {
            "q1": np.nan,
            "median": np.nan,
            "q3": np.nan,
            "mean": np.nan,
            "lowerfence": np.nan,
            "upperfence": np.nan,
            "n": 0,
        }
    q1, med, q3 = np.quantile(v, [0.25, 0.5, 0.75])
    return {
        "q1": float(q1),
        "median": float(med),
        "q3": float(q3),
        "mean": float(v.mean()),
        "lowerfence": float(v.min()),
        "upperfence": float(v.max()),
        "n": int(v.size),
    }
