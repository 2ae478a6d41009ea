"""The step model's parts that are not traffic: link classes (``Link``, ``Links``, ``parse_links``
for ``--link intra=...,inter=...``) and what one layer's experts cost (``ExpertCompute``: routed
experts, ``routed_seconds``, and shared ones, ``shared_seconds``; ``expert_compute_for``: their size,
from the user's config.json, else the trace's ``ModelInfo``, else the model's preset).

The step time itself (copy models, kernels, dispatch/expert/combine per GPU, the busiest GPU
charged) is ``step_model``; hardware presets and links files are ``hardware``
(docs/placement.md, "The step model").

Out of scope: attention and dense layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from moetrace.errors import ConfigError

if TYPE_CHECKING:
    from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "Link",
    "Links",
    "ExpertCompute",
    "DEFAULT_LINKS",
    "H100_HBM_BYTES_PER_S",
    "H100_BF16_FLOPS",
    "parse_links",
    "expert_compute_for",
    "missing_expert_keys",
    "expert_unknown_reason",
    "expert_seconds_BW",
]

InterNic = Literal["gpu", "node"]


@dataclass(frozen=True, kw_only=True)
class Link:
    """One link class, per GPU and direction."""

    bytes_per_s: float  # sustained bandwidth, bytes per second
    latency_s: float  # fixed cost of one message (one peer of one collective), seconds

    def __post_init__(self) -> None:
        if not (self.bytes_per_s > 0 and np.isfinite(self.bytes_per_s)):
            raise ConfigError(f"link bandwidth must be a positive number, got {self.bytes_per_s}")
        if not (self.latency_s >= 0 and np.isfinite(self.latency_s)):
            raise ConfigError(f"link latency must be >= 0, got {self.latency_s}")


@dataclass(frozen=True, kw_only=True)
class Links:
    """The two link classes of an expert-parallel deployment."""

    intra: Link  # between GPUs of one node (NVLink)
    inter: Link  # between GPUs of different nodes (RDMA), per GPU (inter_nic "gpu") or per node
    inter_nic: InterNic = "gpu"  # "gpu": every GPU has its own network link; "node": one link per node, shared

    def to_json(self) -> dict[str, object]:
        return {
            "intra_bytes_per_s": self.intra.bytes_per_s,
            "intra_latency_s": self.intra.latency_s,
            "inter_bytes_per_s": self.inter.bytes_per_s,
            "inter_latency_s": self.inter.latency_s,
            "inter_nic": self.inter_nic,
        }


#: DeepEP's normal kernels on H800 measure about 155 GB/s over NVLink inside a node and 43-58 GB/s
#: per GPU over RDMA between nodes (DeepEP README, "Normal kernels with NVLink and RDMA forwarding");
#: 0.4 us per RDMA message fits its low-latency table (dispatch of 128 tokens, top-8: 155 us at EP32,
#: 192 us at EP128, i.e. 37 us for 96 more peers); the NVLink message cost is an assumption (docs/placement.md).
DEFAULT_LINKS = Links(intra=Link(bytes_per_s=155e9, latency_s=0.2e-6), inter=Link(bytes_per_s=50e9, latency_s=0.4e-6))
#: H100 SXM: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16 (NVIDIA H100 datasheet)
H100_HBM_BYTES_PER_S = 3.35e12
H100_BF16_FLOPS = 989e12


@dataclass(frozen=True, kw_only=True)
class ExpertCompute:
    """What one MoE layer's experts cost on one GPU: the routed experts and the shared ones, each a
    gated MLP (three hidden x ffn matrices). Sizes: ``expert_compute_for``."""

    hidden_size: int  # model dimension of the full-size model
    ffn_size: int  # one routed expert's intermediate size (moe_intermediate_size)
    weight_bytes_per_value: float = 2.0  # bytes per weight (bf16 = 2, fp8 = 1)
    hbm_bytes_per_s: float = H100_HBM_BYTES_PER_S  # memory bandwidth per GPU
    peak_flops: float = H100_BF16_FLOPS  # dense matrix throughput per GPU, FLOP/s
    num_shared_experts: int = 0  # always-on experts of a layer, every token through each, on every GPU (0: none)
    shared_ffn_size: int = 0  # intermediate size of ONE shared expert (0: no shared-expert term)

    def __post_init__(self) -> None:
        if self.hidden_size < 1 or self.ffn_size < 1 or self.num_shared_experts < 0 or self.shared_ffn_size < 0:
            raise ConfigError(
                f"expert sizes must be positive: hidden {self.hidden_size}, ffn {self.ffn_size}, "
                f"{self.num_shared_experts} shared expert(s) of ffn {self.shared_ffn_size}"
            )
        if not (self.weight_bytes_per_value > 0 and np.isfinite(self.weight_bytes_per_value)):
            raise ConfigError(f"bytes per expert weight must be a positive number, got {self.weight_bytes_per_value}")

    @property
    def weight_bytes(self) -> float:
        """Bytes of one routed expert's weights (gate, up and down projections)."""
        return 3.0 * self.hidden_size * self.ffn_size * self.weight_bytes_per_value

    @property
    def flops_per_token(self) -> float:
        """FLOPs of one token through one routed expert (2 per multiply-add, three matrices)."""
        return 6.0 * self.hidden_size * self.ffn_size

    @property
    def shared_weight_bytes(self) -> float:
        """Bytes of ONE shared expert's weights."""
        return 3.0 * self.hidden_size * self.shared_ffn_size * self.weight_bytes_per_value

    @property
    def shared_flops_per_token(self) -> float:
        """FLOPs of one token through ONE shared expert."""
        return 6.0 * self.hidden_size * self.shared_ffn_size

    def routed_seconds(self, pairs_BW: np.ndarray, active_BW: np.ndarray) -> np.ndarray:
        """Seconds each GPU spends in one layer's routed experts, float64 [B, W]: the larger of reading
        the weights of its ``active_BW`` activated experts (memory-bound decode) and computing its
        ``pairs_BW`` (token, expert) pairs (compute-bound prefill)."""
        memory = np.asarray(active_BW, dtype=np.float64) * (self.weight_bytes / self.hbm_bytes_per_s)
        compute = np.asarray(pairs_BW, dtype=np.float64) * (self.flops_per_token / self.peak_flops)
        return np.maximum(memory, compute)

    def shared_seconds(self, tokens_BW: np.ndarray) -> np.ndarray:
        """Seconds each GPU spends in one layer's shared experts, float64 [B, W]: every GPU runs all
        ``num_shared_experts`` over the ``tokens_BW`` tokens it holds, the larger of reading their
        weights (nothing on a GPU without tokens) and computing ``tokens * num_shared`` token passes.
        Zeros without shared experts."""
        tokens = np.asarray(tokens_BW, dtype=np.float64)
        n = self.num_shared_experts
        if n == 0 or self.shared_ffn_size == 0:
            return np.zeros_like(tokens)
        memory = np.where(tokens > 0, n * self.shared_weight_bytes / self.hbm_bytes_per_s, 0.0)
        compute = tokens * (n * self.shared_flops_per_token / self.peak_flops)
        return np.maximum(memory, compute)

    def to_json(self) -> dict[str, object]:
        return {
            "hidden_size": self.hidden_size,
            "ffn_size": self.ffn_size,
            "weight_bytes_per_value": self.weight_bytes_per_value,
            "hbm_bytes_per_s": self.hbm_bytes_per_s,
            "peak_flops": self.peak_flops,
            "num_shared_experts": self.num_shared_experts,
            "shared_ffn_size": self.shared_ffn_size,
        }


_RATE_UNITS = {  # to bytes per second
    "gb/s": 1e9,
    "gbps": 1e9 / 8,  # the networking convention: gigabits
    "gbit": 1e9 / 8,
    "mb/s": 1e6,
    "mbit": 1e6 / 8,
    "tb/s": 1e12,
    "gb": 1e9,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def _rate(text: str) -> float:
    m = re.fullmatch(_NUM + r"\s*([A-Za-z/]*)", text.strip())
    unit = (m.group(2) or "GB/s").lower() if m else ""
    if not m or unit not in _RATE_UNITS:
        raise ConfigError(
            f"--link: bandwidth {text!r} is not a rate; write e.g. 155GB/s, 400Gbit or 50 (GB/s); units: "
            + ", ".join(_RATE_UNITS)
        )
    return float(m.group(1)) * _RATE_UNITS[unit]


def _time(text: str) -> float:
    m = re.fullmatch(_NUM + r"\s*([A-Za-z]*)", text.strip())
    unit = (m.group(2) or "us").lower() if m else ""
    if not m or unit not in _TIME_UNITS:
        raise ConfigError(f"--link: latency {text!r} is not a time; write e.g. 2us, 0.5ms or 3 (us)")
    return float(m.group(1)) * _TIME_UNITS[unit]


def parse_links(spec: str | None, *, base: Links = DEFAULT_LINKS) -> Links:
    """``intra=BW[,LAT],inter=BW[,LAT]`` (either class may be left out: it keeps ``base``'s) to ``Links``.

    BW: a number with a unit (``155GB/s``, ``400Gbit``; a bare number is GB/s); LAT: a time
    (``2us``, ``0.5ms``; a bare number is microseconds).
    """
    if spec is None or not spec.strip():
        return base
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for part in spec.split(","):
        part = part.strip()
        if "=" in part:
            key, _, value = part.partition("=")
            key = key.strip().lower()
            if key not in ("intra", "inter"):
                raise ConfigError(f"--link: unknown link class {key!r}; write intra=BW[,LAT],inter=BW[,LAT]")
            if key in found:
                raise ConfigError(f"--link: {key} given twice")
            current = found[key] = [value]
        elif current is None or len(current) >= 2:
            raise ConfigError(f"--link: cannot read {part!r} in {spec!r}; write intra=BW[,LAT],inter=BW[,LAT]")
        else:
            current.append(part)
    links = {"intra": base.intra, "inter": base.inter}
    for key, vals in found.items():
        old = links[key]
        links[key] = Link(bytes_per_s=_rate(vals[0]), latency_s=_time(vals[1]) if len(vals) > 1 else old.latency_s)
    return Links(intra=links["intra"], inter=links["inter"], inter_nic=base.inter_nic)


#: bytes per expert weight of the released checkpoints that are not BF16: DeepSeek-V3 ships FP8,
#: gpt-oss MXFP4 (4-bit values with one 8-bit scale per 32)
_WEIGHT_BYTES = {"deepseek-v3": 1.0, "gpt-oss-120b": 4.25 / 8}


#: what ``expert_compute_for`` reads, by its ModelInfo / config.json name
_SIZE_KEYS = ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size", "weight_bytes_per_value")
#: the keys without which the routed experts' size is unknown
_NEEDED_KEYS = ("hidden_size", "moe_intermediate_size")

Sizes = dict[str, object]  # some of _SIZE_KEYS and "num_shared_experts", None where a source does not say


def _preset_sizes(model: ModelInfo) -> tuple[Sizes, bool] | None:
    """The expert sizes of the full-size preset that ``model`` is (its name or hub id) or mirrors (a
    ``-tiny`` preset: its name, or its source ``moetrace:<preset>-tiny``), and whether it mirrors it;
    None for any other model."""
    from moetrace.tracer.presets import TINY_SUFFIX, list_presets

    for text in (model.name, model.source.removeprefix("moetrace:")):
        tiny = text.endswith(TINY_SUFFIX)
        base = text[: -len(TINY_SUFFIX)] if tiny else text
        preset = next((p for p in list_presets() if base in (p.name, p.hub_id)), None)
        if preset is not None:
            info = preset.model_info(tiny=False)
            sizes: Sizes = {k: getattr(info, k) for k in _SIZE_KEYS}
            sizes["num_shared_experts"] = info.num_shared_experts
            if sizes["weight_bytes_per_value"] is None:
                sizes["weight_bytes_per_value"] = _WEIGHT_BYTES.get(preset.name)
            return sizes, tiny
    return None


def _config_sizes(config: dict[str, object]) -> Sizes:
    """The expert sizes a user's HF config.json states (``presets.expert_sizes_from_hf_config``; the
    shared-expert count only where the config names shared experts). ``ConfigError`` naming a key that
    is present but not a width (not a whole number >= 1, a per-layer list)."""
    from moetrace.tracer.presets import expert_sizes_from_hf_config

    if not isinstance(config, dict):
        raise ConfigError(f"--model-config: an HF config is a JSON object, got {type(config).__name__}")
    text = config.get("text_config")
    lm = text if isinstance(text, dict) else config  # multimodal wrappers (Llama-4) keep the LM in text_config
    for key in ("hidden_size", "moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size"):
        v = lm.get(key)
        zero_ok = key == "shared_expert_intermediate_size"  # 0: no shared expert
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (0 if zero_ok else 1)):
            if key == "intermediate_size" and lm.get("moe_intermediate_size") is not None:
                continue  # the dense layers' width, not read
            raise ConfigError(f"--model-config: `{key}` must be a whole number >= 1, got {v!r}")
    sizes: Sizes = dict(expert_sizes_from_hf_config(config))
    model_type = str(lm.get("model_type") or config.get("model_type") or "")
    names_shared = (
        "n_shared_experts" in lm or "shared_expert_intermediate_size" in lm or model_type.startswith("llama4")
    )
    if not names_shared:  # a config silent on shared experts leaves the trace's count standing
        sizes.pop("num_shared_experts")
        sizes.pop("shared_expert_intermediate_size")
    return sizes


def _expert_sources(model: ModelInfo, config: dict[str, object] | None) -> list[Sizes]:
    """Where the expert sizes come from, in order: the user's config, the trace's ModelInfo, the
    preset. A ``-tiny`` preset stands for the full model it mirrors: its own toy sizes are skipped."""
    sources = [] if config is None else [_config_sizes(config)]
    preset = _preset_sizes(model)
    if preset is None or not preset[1]:
        recorded: Sizes = {k: getattr(model, k) for k in _SIZE_KEYS}
        recorded["num_shared_experts"] = model.num_shared_experts
        sources.append(recorded)
    if preset is not None:
        sources.append(preset[0])
    return sources


def _first(sources: list[Sizes], key: str) -> object:
    """The value of ``key`` in the first source that states it (None: none does)."""
    return next((s[key] for s in sources if s.get(key) is not None), None)


def missing_expert_keys(model: ModelInfo, config: dict[str, object] | None = None) -> list[str]:
    """The keys (ModelInfo and config.json names) that no source gives, leaving the routed experts'
    size unknown: ``[]`` when ``expert_compute_for`` finds it, else e.g. ``["moe_intermediate_size"]``."""
    sources = _expert_sources(model, config)
    return [k for k in _NEEDED_KEYS if _first(sources, k) is None]


def expert_unknown_reason(model: ModelInfo, config: dict[str, object] | None = None) -> str:
    """The line a command prints when the MoE-layer time is n/a, naming the missing key and the fix;
    ``""`` when the expert size is known."""
    missing = missing_expert_keys(model, config)
    if not missing:
        return ""
    keys = " or ".join(f"`{k}`" for k in missing)
    if config is None:
        return f"MoE-layer time n/a: the trace's model records no {keys}; pass --model-config config.json"
    return (
        f"--model-config: neither it nor the trace's model gives {keys} (the routed expert's FFN width: "
        "`moe_intermediate_size`, else `intermediate_size`)"
    )


def expert_compute_for(model: ModelInfo, *, config: dict[str, object] | None = None) -> ExpertCompute | None:
    """The experts of one MoE layer of ``model`` (a trace's ``ModelInfo``), or None when the routed
    experts' size is unknown (never guessed; ``missing_expert_keys`` names what is missing).

    Each size comes from the first source that states it: ``config`` (the user's HF config.json,
    parsed: ``--model-config``), the ModelInfo's fields (``hidden_size``, ``moe_intermediate_size``,
    ``num_shared_experts``, ``shared_expert_intermediate_size``, ``weight_bytes_per_value``), the
    preset of the model's name or hub id. A ``-tiny`` preset is priced as the full model it mirrors
    (its own toy sizes are skipped). Weights are BF16 unless a source says otherwise (a preset's
    release: ``_WEIGHT_BYTES``). Shared experts are priced only where their width is known.
    ``ConfigError`` when ``config`` states a size that is not one, or when even with ``config`` the
    routed experts' size is unknown (a config given for nothing is an error, not a quiet n/a).
    """
    sources = _expert_sources(model, config)
    hidden, ffn = _first(sources, "hidden_size"), _first(sources, "moe_intermediate_size")
    if not isinstance(hidden, int) or not isinstance(ffn, int):
        if config is not None:
            raise ConfigError(expert_unknown_reason(model, config))
        return None
    num_shared = _first(sources, "num_shared_experts")
    shared_ffn = _first(sources, "shared_expert_intermediate_size")
    shared = isinstance(num_shared, int) and num_shared > 0 and isinstance(shared_ffn, int) and shared_ffn > 0
    wb = _first(sources, "weight_bytes_per_value")
    return ExpertCompute(
        hidden_size=hidden,
        ffn_size=ffn,
        weight_bytes_per_value=float(wb) if isinstance(wb, (int, float)) else 2.0,
        num_shared_experts=int(num_shared) if shared else 0,  # type: ignore[call-overload]
        shared_ffn_size=int(shared_ffn) if shared else 0,  # type: ignore[call-overload]
    )


def expert_seconds_BW(pairs_BW: np.ndarray, active_BW: np.ndarray, *, expert: ExpertCompute) -> np.ndarray:
    """Seconds each GPU spends in one layer's routed experts, float64 [B, W]: the larger of reading the
    weights of its ``active_BW`` activated experts and computing its ``pairs_BW`` (token, expert) pairs
    (``ExpertCompute.routed_seconds``; the shared experts: ``ExpertCompute.shared_seconds``)."""
    return expert.routed_seconds(pairs_BW, active_BW)
