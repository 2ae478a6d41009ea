"""Trace format v1: the explicit Arrow schemas and the manifest (docs/trace-format.md).

A trace is a directory::

    manifest.json            format, version, complete, model, backend, collection
    requests/<part>.parquet  one row per request
    routing/<part>.parquet   one row per token (prompt tokens, then generated tokens)

Shape legend (docs/architecture.md): T tokens, R requests, L MoE layers (``model.moe_layers``),
K top-k, X = L*K flattened ids of one token.

Out of scope here: file names (``layout``), writing and reading files (``writer``, ``reader``),
checking a trace (``validate``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeGuard

import pyarrow as pa

from moetrace.errors import TraceFormatError

FORMAT = "moetrace.trace"
VERSION = 1

Stage = Literal["prefill", "decode"]
STAGE_PREFILL: Final = "prefill"
STAGE_DECODE: Final = "decode"
#: the stages of a request, in position order
STAGES: Final = (STAGE_PREFILL, STAGE_DECODE)

#: the largest count (layers, experts, hidden size, ...) a manifest may state: bounds what a file can ask for
_MAX_COUNT = 1 << 20


def is_whole(v: object) -> TypeGuard[int]:
    """A JSON whole number (``8``; not ``8.0``, ``"8"`` or ``true``)."""
    return isinstance(v, int) and not isinstance(v, bool)


#: expert id written where nothing was recorded for a token (prefix-cache hit, final token)
NO_EXPERT = -1

#: the ``ModelInfo`` fields a manifest may leave out (None; absent from ``to_dict``): a manifest written
#: before a field existed still reads
_OPTIONAL: Final = (
    "n_group",
    "topk_group",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "weight_bytes_per_value",
)
#: the most bytes a stored weight may take (float64)
_MAX_WEIGHT_BYTES = 8.0


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """What the trace needs to know about the model that produced it (manifest ``model``)."""

    name: str  # preset name or path the user gave
    source: str  # hub id or local path of the weights/config
    architecture: str  # HF class name, e.g. "DeepseekV3ForCausalLM"
    num_hidden_layers: int  # all decoder layers, dense and MoE
    moe_layers: tuple[int, ...]  # model layer indices that route, ascending; column order of `experts`
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts chosen per token and layer
    num_shared_experts: int  # always-on experts (not traced)
    hidden_size: int  # model dimension (bytes per token of all-to-all = hidden_size * dtype bytes)
    n_group: int | None = None  # expert groups of a group-limited router (DeepSeek-V3: 8)
    topk_group: int | None = None  # groups a token may use (DeepSeek-V3: 4)
    # the expert sizes the cost model prices (None: the producer did not know; placement/cost.py then
    # falls back to a --model-config or the preset). From the HF config (presets.expert_sizes_from_hf_config):
    moe_intermediate_size: int | None = None  # one routed expert's FFN width: `moe_intermediate_size`, else
    #                                           `intermediate_size` (Mixtral, OLMoE, GPT-OSS, Llama-4)
    shared_expert_intermediate_size: int | None = None  # FFN width of ONE shared expert: DeepSeek-V2/V3
    #     (n_shared_experts of them): `moe_intermediate_size`; Qwen2-MoE (one): `shared_expert_intermediate_size`;
    #     Llama-4 (one): `intermediate_size`; None without shared experts
    weight_bytes_per_value: float | None = None  # bytes per expert weight of the release (bf16 2, fp8 1,
    #                                              MXFP4 4.25/8): `quantization_config`, else `torch_dtype`

    def __post_init__(self) -> None:
        for name in ("name", "source", "architecture"):
            if not isinstance(getattr(self, name), str):
                raise TraceFormatError(f"model `{name}` must be a string, got {getattr(self, name)!r}")
        for name, low in (
            ("num_hidden_layers", 1),
            ("num_experts", 1),
            ("top_k", 1),
            ("num_shared_experts", 0),
            ("hidden_size", 1),
            ("n_group", 1),
            ("topk_group", 1),
            ("moe_intermediate_size", 1),
            ("shared_expert_intermediate_size", 1),
        ):
            v = getattr(self, name)
            if v is None and name in _OPTIONAL:
                continue
            if not is_whole(v) or v < low or v > _MAX_COUNT:
                raise TraceFormatError(
                    f"model {self.name!r}: `{name}` must be a whole number in {low}..{_MAX_COUNT:,}, got {v!r}"
                )
        wb = self.weight_bytes_per_value
        if wb is not None:
            if isinstance(wb, bool) or not isinstance(wb, (int, float)) or not (0 < wb <= _MAX_WEIGHT_BYTES):
                raise TraceFormatError(
                    f"model {self.name!r}: `weight_bytes_per_value` must be a number in (0, {_MAX_WEIGHT_BYTES:g}], "
                    f"got {wb!r}"
                )
            object.__setattr__(self, "weight_bytes_per_value", float(wb))
        if not isinstance(self.moe_layers, (list, tuple)) or not all(is_whole(x) for x in self.moe_layers):
            raise TraceFormatError(
                f"model {self.name!r}: `moe_layers` must be a list of layer indices, got {self.moe_layers!r}"
            )
        if (self.n_group is None) != (self.topk_group is None):
            raise TraceFormatError(f"model {self.name!r}: `n_group` and `topk_group` go together (both or neither)")
        # both set or both None (checked above)
        if (
            self.n_group is not None
            and self.topk_group is not None
            and (self.num_experts % self.n_group or self.topk_group > self.n_group)
        ):
            raise TraceFormatError(
                f"model {self.name!r}: n_group={self.n_group} must divide num_experts={self.num_experts} and "
                f"topk_group={self.topk_group} must be <= n_group"
            )
        layers = list(self.moe_layers)
        if not layers:
            raise TraceFormatError(f"model {self.name!r}: moe_layers is empty; a trace needs at least one MoE layer")
        if layers != sorted(set(layers)):
            raise TraceFormatError(f"model {self.name!r}: moe_layers must be ascending and unique, got {layers}")
        if layers[0] < 0 or layers[-1] >= self.num_hidden_layers:
            raise TraceFormatError(
                f"model {self.name!r}: moe_layers {layers[0]}..{layers[-1]} outside 0..{self.num_hidden_layers - 1}"
            )
        if not (1 <= self.top_k <= self.num_experts):
            raise TraceFormatError(
                f"model {self.name!r}: top_k={self.top_k} must be in 1..num_experts={self.num_experts}"
            )
        if self.num_experts > 32767:
            raise TraceFormatError(f"model {self.name!r}: {self.num_experts} experts do not fit the int16 expert ids")
        object.__setattr__(self, "moe_layers", tuple(int(x) for x in layers))

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def group_limited(self) -> bool:
        """The router picks a token's experts from at most ``topk_group`` of its ``n_group`` groups of
        consecutive ids, fewer than all (DeepSeek-V3: 4 of 8)."""
        return self.n_group is not None and self.topk_group is not None and self.topk_group < self.n_group

    @property
    def ids_per_token(self) -> int:
        """X = L*K: length of the ``experts`` list of one routing row."""
        return len(self.moe_layers) * self.top_k

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        return {k: v for k, v in d.items() if v is not None}

    @classmethod
    def from_dict(cls, d: object) -> ModelInfo:  # d: a manifest's `model` value, any JSON (checked here)
        if d is None:
            raise TraceFormatError("manifest has no `model` section (name, moe_layers, num_experts, top_k, ...)")
        if not isinstance(d, dict):
            raise TraceFormatError(
                f"manifest `model` must be an object with the model's fields, got {type(d).__name__}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [n for n in names if n not in d and n not in _OPTIONAL]
        if missing:
            raise TraceFormatError(f"manifest `model` lacks {sorted(missing)}")
        try:
            return cls(**{k: d[k] for k in names if k in d})
        except (TypeError, ValueError) as exc:  # e.g. "top_k": "8", "moe_layers": 3
            raise TraceFormatError(f"manifest `model` has a field of the wrong type ({exc})") from exc


def routing_schema(ids_per_token: int, *, with_weights: bool) -> pa.Schema:
    """Schema of ``routing/*.parquet``.

    ``experts`` is ``fixed_size_list<int16>[L*K]``, row-major ``[layer][slot]``; ``weights`` (optional)
    has the same layout in float32.
    """
    fields = [
        pa.field("request_id", pa.int64(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("experts", pa.list_(pa.field("item", pa.int16(), nullable=False), ids_per_token), nullable=False),
    ]
    if with_weights:
        fields.append(
            pa.field("weights", pa.list_(pa.field("item", pa.float32(), nullable=False), ids_per_token), nullable=False)
        )
    return pa.schema(fields)


def requests_schema(*, with_text: bool) -> pa.Schema:
    """Schema of ``requests/*.parquet``; text columns only when the user opted in."""
    fields = [
        pa.field("request_id", pa.int64(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("output_tokens", pa.int32(), nullable=False),
    ]
    if with_text:
        fields += [pa.field("prompt_text", pa.string()), pa.field("output_text", pa.string())]
    return pa.schema(fields)


#: required columns and their types, for validation of files written by any tool
REQUIRED_ROUTING = {"request_id": pa.int64(), "position": pa.int32(), "stage": pa.string()}
REQUIRED_REQUESTS = {
    "request_id": pa.int64(),
    "dataset": pa.string(),
    "prompt_tokens": pa.int32(),
    "output_tokens": pa.int32(),
}


def new_manifest(*, model: ModelInfo, backend: dict[str, Any], collection: dict[str, Any]) -> dict[str, Any]:
    """A manifest for a trace being written (``complete: false``)."""
    if "name" not in backend:
        raise TraceFormatError("manifest `backend` needs a `name` (vllm, hf, synthetic, import, ...)")
    from moetrace import __version__

    return {
        "format": FORMAT,
        "version": VERSION,
        "complete": False,
        "model": model.to_dict(),
        "backend": dict(backend),
        "collection": dict(collection),
        "moetrace_version": __version__,
    }


def stages_of(trace_or_manifest: object, /) -> frozenset[str]:
    """The stages whose routing a trace recorded: ``manifest["collection"]["stages"]``.

    Takes a manifest dict or anything with a ``manifest`` dict (an opened ``Trace``). A trace whose
    manifest has no ``stages`` (every trace written before the key existed, and every collected or
    synthetic trace) recorded both. An imported single-stage capture (``import --stages
    decode-only``) lists one: its other stage's rows, if any, hold only ``-1`` (nothing recorded).
    Raises ``TraceFormatError`` when the key is present but not a non-empty list of distinct stage names.
    """
    manifest = (
        trace_or_manifest if isinstance(trace_or_manifest, Mapping) else getattr(trace_or_manifest, "manifest", None)
    )
    if not isinstance(manifest, Mapping):
        raise TypeError(f"stages_of takes a trace manifest (dict) or a Trace, got {type(trace_or_manifest).__name__}")
    collection = manifest.get("collection")
    stages = collection.get("stages") if isinstance(collection, Mapping) else None
    if stages is None:
        return frozenset(STAGES)
    if (
        not isinstance(stages, list)
        or not stages
        or len(set(map(str, stages))) != len(stages)
        or any(s not in STAGES for s in stages)
    ):
        raise TraceFormatError(
            f"manifest `collection.stages` must list the recorded stages out of {list(STAGES)} (distinct, at least one), "
            f"got {stages!r}"
        )
    return frozenset(stages)


def check_manifest_header(manifest: dict[str, Any], *, where: str) -> None:
    """Raise ``TraceFormatError`` unless ``manifest`` is a moetrace trace manifest of a known version."""
    if manifest.get("format") != FORMAT:
        raise TraceFormatError(
            f"{where}: `format` is {manifest.get('format')!r}, expected {FORMAT!r}; not a moetrace trace"
        )
    if not is_whole(manifest.get("version")) or manifest.get("version") != VERSION:  # not `true`, not 1.0
        raise TraceFormatError(
            f"{where}: trace format version {manifest.get('version')!r} is not supported (this moetrace reads {VERSION})"
        )
    if not isinstance(manifest.get("complete"), bool):
        raise TraceFormatError(f"{where}: `complete` must be true or false, got {manifest.get('complete')!r}")
    totals = manifest.get("totals")
    if totals is not None and (
        not isinstance(totals, dict)
        or any(not is_whole(v) or v < 0 for k, v in totals.items() if k in ("num_requests", "num_tokens"))
    ):
        raise TraceFormatError(
            f"{where}: `totals` must hold whole, non-negative num_requests and num_tokens, got {totals!r}"
        )
    for key in ("backend", "collection", "writer"):
        if key in manifest and not isinstance(manifest[key], dict):
            raise TraceFormatError(f"{where}: `{key}` must be an object, got {type(manifest[key]).__name__}")
    try:
        stages_of(manifest)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{where}: {exc}") from None
