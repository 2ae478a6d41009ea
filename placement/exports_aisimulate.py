"""aisimulate's expert-popularity bundle (docs/exports.md): ``metadata.yaml`` and
``model_expert_popularity.parquet``, schema version 1, made from tokens per (MoE layer, expert) of a
trace or a load profile (``aisimulate_popularity``), in a folder named as aisimulate finds it
(``aisimulate_bundle_name``).

Shape legend (docs/architecture.md): L MoE layers, E logical experts, N rows (one per layer and expert).

Out of scope: choosing the format and reading the counts (``exports``, ``exports_counts``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moetrace.errors import ConfigError
from moetrace.tracer.trace.profile import is_profile
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "AISIMULATE_METADATA",
    "AISIMULATE_PARQUET",
    "AISIMULATE_SCHEMA_VERSION",
    "aisimulate_bundle_name",
    "aisimulate_popularity",
    "observation_source",
]


#: aisimulate's bundle files and schema (``aiconfigurator_core/sdk/expert_popularity.py``; docs/exports.md)
AISIMULATE_PARQUET = "model_expert_popularity.parquet"


AISIMULATE_METADATA = "metadata.yaml"


AISIMULATE_SCHEMA_VERSION = 1


def aisimulate_bundle_name(model_id: str) -> str:
    """aisimulate's folder name of a model's bundle: ``org/name`` -> ``org--name``."""
    parts = model_id.split("/")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"aisimulate names a bundle by the model's hub id <org>/<model>, got {model_id!r}: pass --model-id ORG/NAME"
        )
    return "--".join(parts)


def aisimulate_popularity(
    counts_LE: np.ndarray, *, model: ModelInfo, model_id: str, stage: str, provenance: dict[str, str]
) -> dict[str, bytes]:
    """aisimulate's expert-popularity bundle: ``{file name: bytes}`` of ``model_expert_popularity.parquet`` and
    ``metadata.yaml`` (schema version 1), from tokens per (MoE layer, expert) ``counts_LE``.

    One row per (MoE layer, expert), layer-major: ``layer_id`` (the model layer index), ``expert_id``,
    ``activation_count``, ``routed_token_count`` (the layer's tokens: its picks / top-k), ``token_hit_rate``
    (count / tokens), ``assignment_share`` (count / (tokens * top-k)) and ``popularity_rank`` (1 = most picked,
    ties by expert id), computed as aisimulate's validator recomputes them.
    """
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    L, E, K = model.num_moe_layers, model.num_experts, model.top_k
    if counts_LE.shape != (L, E) or counts_LE.dtype.kind not in "iu" or (counts_LE < 0).any():
        raise ConfigError(
            f"counts must be non-negative integers of shape ({L}, {E}), got {counts_LE.dtype} {counts_LE.shape}"
        )
    picks_L = counts_LE.sum(axis=1)
    for l in range(L):
        if picks_L[l] == 0:
            raise ConfigError(
                f"model layer {model.moe_layers[l]} has no routed token in the {stage} counts; aisimulate needs every "
                "MoE layer's popularity"
            )
        if picks_L[l] % K:
            raise ConfigError(
                f"model layer {model.moe_layers[l]}: {int(picks_L[l]):,} expert picks, not a whole number of tokens of "
                f"top-{K} (tokens with some slots unrecorded?); aisimulate checks picks = tokens x top-k"
            )
    tokens_L = picks_L // K
    layer_N = np.repeat(np.asarray(model.moe_layers, dtype=np.int32), E)
    expert_N = np.tile(np.arange(E, dtype=np.int32), L)
    count_N = counts_LE.reshape(-1).astype(np.uint64)
    routed_N = np.repeat(tokens_L.astype(np.uint64), E)
    hit_N = np.concatenate([counts_LE[l].astype(np.float64) / float(tokens_L[l]) for l in range(L)])
    share_N = np.concatenate([counts_LE[l].astype(np.float64) / float(tokens_L[l] * K) for l in range(L)])
    rank_LE = np.empty((L, E), dtype=np.int32)
    for l in range(L):
        order = np.lexsort((np.arange(E), -counts_LE[l].astype(np.int64)))
        rank_LE[l, order] = np.arange(1, E + 1, dtype=np.int32)
    schema = pa.schema(
        [
            pa.field("layer_id", pa.int32(), nullable=False),
            pa.field("expert_id", pa.int32(), nullable=False),
            pa.field("activation_count", pa.uint64(), nullable=False),
            pa.field("routed_token_count", pa.uint64(), nullable=False),
            pa.field("token_hit_rate", pa.float64(), nullable=False),
            pa.field("assignment_share", pa.float64(), nullable=False),
            pa.field("popularity_rank", pa.int32(), nullable=False),
        ]
    )
    table = pa.Table.from_arrays(
        [pa.array(a) for a in (layer_N, expert_N, count_N, routed_N, hit_N, share_N, rank_LE.reshape(-1))],
        schema=schema,
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    parquet = sink.getvalue().to_pybytes()
    phase = {"both": "prefill+decode"}.get(stage, stage)
    metadata = {
        "schema_version": AISIMULATE_SCHEMA_VERSION,
        "model": {"architecture": model.architecture, "id": model_id, "aliases": []},
        "routing": {
            "moe_layer_ids": [int(x) for x in model.moe_layers],
            "num_layers": model.num_hidden_layers,
            "num_routed_experts": E,
            "replication_factor": 1,
            "top_k": K,
        },
        "measurement": {
            "phase": phase,
            "count_semantics": "activation_count[layer, expert] is the number of recorded "
            f"{phase} tokens whose router selected that logical routed expert (exported by moetrace)",
            "token_hit_rate_denominator": "routed_token_count",
            "assignment_share_denominator": "routed_token_count * top_k",
            "popularity_rank_order": "activation_count descending, then expert_id ascending",
            "workload": {"total_routed_tokens": int(tokens_L.max())},
        },
        "provenance": provenance,
        "files": {
            "parquet": {"name": AISIMULATE_PARQUET, "sha256": hashlib.sha256(parquet).hexdigest(), "rows": L * E}
        },
    }
    text = yaml.safe_dump(metadata, sort_keys=False, allow_unicode=True)
    return {AISIMULATE_PARQUET: parquet, AISIMULATE_METADATA: text.encode("utf-8")}


def observation_source(path: Path) -> str:
    """Where the counts came from, without directories (aisimulate refuses private paths in metadata)."""
    if is_profile(path):
        return "moetrace load profile"
    tr = open_trace(path, require_complete=False)
    backend = tr.manifest.get("backend") if isinstance(tr.manifest.get("backend"), dict) else {}
    name = backend.get("name") if isinstance(backend, dict) else None
    fmt = backend.get("source_format") if isinstance(backend, dict) else None
    return f"moetrace trace ({name}{': ' + str(fmt) if fmt else ''})" if name else "moetrace trace"
