"""Tokens per (MoE layer, expert) for the counts exports: of a whole trace (``trace_expert_counts``)
or a load profile (``profile_counts``), per stage, and SGLang's ``{"logical_count": [H, E]}`` file made
from them (``sglang_logical_count``: token counts, from which SGLang runs its own EPLB at start-up).

Shape legend (docs/architecture.md): L MoE layers, H all decoder layers, E logical experts.

Out of scope: choosing the format (``exports``); aisimulate's bundle of the same counts
(``exports_aisimulate``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np

from moetrace.analysis.counts import count_trace
from moetrace.errors import ConfigError
from moetrace.tracer.trace.profile import STAGE_MIXED, LoadProfile, is_profile, open_profile
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import ModelInfo, Stage, stages_of

__all__ = ["CountStage", "counts_of", "profile_counts", "sglang_logical_count", "trace_expert_counts"]


CountStage = Literal["decode", "prefill", "both"]  # which tokens a counts export counts


def trace_expert_counts(
    trace: str | os.PathLike,
    *,
    stage: CountStage = "decode",
    allow_incomplete: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, ModelInfo]:
    """Tokens routed to each (MoE layer, expert) over a whole trace: int64 ``[L, E]`` and the model.

    ``stage``: ``decode`` (what moetrace's placements are built from), ``prefill`` or ``both``
    (every routed token, as SGLang's own recorder counts them; of a single-stage trace, its one
    stage). ``decode`` or ``prefill`` on a trace that did not record it (manifest
    ``collection.stages``) is refused. ``progress(tokens_done, tokens_total)`` goes to
    ``count_trace``. Memory: R * L * E counts per stage (``count_trace``).
    """
    tr = open_trace(trace, require_complete=not allow_incomplete)
    recorded = stages_of(tr)
    wanted: tuple[Stage, ...] = ("prefill", "decode") if stage == "both" else (stage,)
    missing = [s for s in wanted if s not in recorded]
    if stage != "both" and missing:
        raise ConfigError(
            f"{trace}: recorded {', '.join(sorted(recorded))} routing only (manifest collection.stages), "
            f"so it holds no {stage} counts: pass --stage {next(iter(sorted(recorded)))}"
        )
    counts = count_trace(
        tr, stages=[s for s in wanted if s in recorded], allow_incomplete=allow_incomplete, progress=progress
    )
    return counts.counts_RSLE.sum(axis=(0, 1), dtype=np.int64), tr.model


def profile_counts(prof: LoadProfile, *, stage: CountStage | None) -> np.ndarray:
    """A load profile's tokens per (MoE layer, expert), int64 ``[L, E]``: ``stage`` as for a trace
    (default decode); a profile of ``mixed`` counts (prefill and decode not told apart) gives them for
    ``both`` or no ``stage``, and refuses a single stage."""
    if STAGE_MIXED in prof.stages:
        if stage in ("decode", "prefill"):
            raise ConfigError(
                f"the profile's counts mix prefill and decode (the recorder does not tell them apart): leave out "
                f"--stage or pass --stage both, not --stage {stage}"
            )
        return prof.total(STAGE_MIXED)
    wanted = ("prefill", "decode") if stage == "both" else (stage or "decode",)
    if stage != "both" and wanted[0] not in prof.stages:
        raise ConfigError(
            f"the profile holds {', '.join(prof.stages)} counts only: pass --stage {prof.stages[0]} or both"
        )
    return sum((prof.total(s) for s in wanted if s in prof.stages), start=np.zeros_like(prof.total(prof.stages[0])))


def sglang_logical_count(counts_LE: np.ndarray, *, model: ModelInfo) -> str:
    """SGLang's ``--init-expert-location`` counts file: ``{"logical_count": [H, E]}``, integers.

    counts_LE: integer ``[L, E]`` tokens per (MoE layer, logical expert), L in ``model.moe_layers``
    order. Rows are all ``num_hidden_layers`` decoder layers (SGLang's expert-location layer count);
    dense layers' rows are zero, as in SGLang's own recorder dumps.
    """
    L, E = len(model.moe_layers), model.num_experts
    if counts_LE.shape != (L, E) or counts_LE.dtype.kind not in "iu" or (counts_LE < 0).any():
        raise ConfigError(
            f"counts must be non-negative integers of shape ({L} MoE layers, {E} experts), "
            f"got {counts_LE.dtype} {counts_LE.shape}"
        )
    full_HE = np.zeros((model.num_hidden_layers, E), dtype=np.int64)
    full_HE[np.asarray(model.moe_layers)] = counts_LE
    return json.dumps({"logical_count": full_HE.tolist()}) + "\n"


def counts_of(
    path: Path,
    fmt: str,
    *,
    stage: CountStage | None,
    allow_incomplete: bool,
    progress: Callable[[int, int], None] | None,
) -> tuple[np.ndarray, ModelInfo, str]:
    """``(counts_LE, model, stage counted)`` of a trace directory or a load profile, for the counts formats."""
    if is_profile(path):  # a load profile holds the counts already
        prof = open_profile(path)
        counted = "both" if STAGE_MIXED in prof.stages else (stage or "decode")
        return profile_counts(prof, stage=stage), prof.model, counted
    if not path.is_dir():
        raise ConfigError(
            f"{path}: --format {fmt} exports token counts from a trace or a load profile, not a placement: pass the "
            f"trace directory (e.g. `moetrace export traces/dsv3 --format {fmt} -o ...`)"
        )
    counts_LE, model = trace_expert_counts(
        path, stage=stage or "decode", allow_incomplete=allow_incomplete, progress=progress
    )
    return counts_LE, model, stage or "decode"
