"""Model presets (``data/models/*.json``) and the routing topology of HF configs.

A preset names a real model (hub id, architecture, MoE facts from its config). ``<preset>-tiny`` is
the same architecture class and routing topology (layers, MoE-layer pattern, experts, top-k,
groups) with small hidden sizes, built from the bundled config with seeded random weights: it runs
on a CPU with nothing downloaded.

Out of scope: building the model itself (``hf``), engine flags (``vllm``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from moetrace.errors import ModelError
from moetrace.tracer.trace.schema import ModelInfo

TINY_SUFFIX = "-tiny"
#: tokenizer bundled for the tiny models (byte-level, see ``data/tokenizer``)
TINY_VOCAB_SIZE = 384


@dataclass(frozen=True, kw_only=True)
class Preset:
    """One model preset (a ``data/models/<name>.json`` file)."""

    name: str  # preset name, e.g. "deepseek-v3"
    hub_id: str  # Hugging Face hub id of the released weights
    architecture: str  # HF class name
    model_type: str  # HF config `model_type`
    num_hidden_layers: int  # decoder layers
    moe_layers: tuple[int, ...]  # layers that route
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts per token
    num_shared_experts: int  # always-on experts
    hidden_size: int  # model dimension
    n_group: int | None  # router groups (DeepSeek-V3)
    topk_group: int | None  # groups a token may use
    router: str  # one-line description of the routing function
    config: dict[str, Any]  # HF config fields of the full model
    tiny: dict[str, Any]  # overrides that make the -tiny variant

    def model_info(self, *, tiny: bool) -> ModelInfo:
        return ModelInfo(
            name=self.name + (TINY_SUFFIX if tiny else ""),
            source=f"moetrace:{self.name}{TINY_SUFFIX}" if tiny else self.hub_id,
            architecture=self.architecture,
            num_hidden_layers=self.num_hidden_layers,
            moe_layers=self.moe_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_shared_experts=self.num_shared_experts,
            hidden_size=int(self.tiny["hidden_size"]) if tiny else self.hidden_size,
            n_group=self.n_group,
            topk_group=self.topk_group,
        )

    def hf_config_dict(self, *, tiny: bool) -> dict[str, Any]:
        """Keyword arguments for the HF config class of this architecture."""
        d = {**self.config, "num_hidden_layers": self.num_hidden_layers, "hidden_size": self.hidden_size}
        if tiny:
            d.update(self.tiny)
            d["vocab_size"] = TINY_VOCAB_SIZE
            d["max_position_embeddings"] = 4096
        return d


@cache
def _load_all() -> dict[str, Preset]:
    out = {}
    for f in resources.files("moetrace.data").joinpath("models").iterdir():
        if f.name.endswith(".json"):
            d = json.loads(f.read_text())
            d["moe_layers"] = tuple(d["moe_layers"])
            d.setdefault("n_group", None)
            d.setdefault("topk_group", None)
            out[d["name"]] = Preset(**d)
    return dict(sorted(out.items()))


def list_presets() -> list[Preset]:
    return list(_load_all().values())


def is_preset(name: str) -> bool:
    base = name[: -len(TINY_SUFFIX)] if name.endswith(TINY_SUFFIX) else name
    return base in _load_all()


def get_preset(name: str) -> tuple[Preset, bool]:
    """Return ``(preset, tiny)`` for ``deepseek-v3`` or ``deepseek-v3-tiny``."""
    tiny = name.endswith(TINY_SUFFIX)
    base = name[: -len(TINY_SUFFIX)] if tiny else name
    presets = _load_all()
    if base not in presets:
        names = ", ".join(p for n in presets for p in (n, n + TINY_SUFFIX))
        raise ModelError(f"unknown model preset {name!r}; presets: {names}")
    return presets[base], tiny


def model_info_for(name: str) -> ModelInfo:
    """ModelInfo of a preset name (``deepseek-v3`` or ``deepseek-v3-tiny``)."""
    preset, tiny = get_preset(name)
    return preset.model_info(tiny=tiny)


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def moe_topology_from_hf_config(cfg: Any) -> dict[str, Any]:
    """Routing topology of an HF config (object or dict): moe_layers, num_experts, top_k, ...

    Handles DeepSeek-V2/V3 (``first_k_dense_replace``, ``moe_layer_freq``), Qwen2/3-MoE
    (``decoder_sparse_step``, ``mlp_only_layers``), Llama-4 (``moe_layers`` /
    ``interleave_moe_layer_step``), and all-MoE models (Mixtral, OLMoE, GPT-OSS). Raises
    ``ModelError`` for a config without routed experts.
    """
    text = _get(cfg, "text_config")
    if text is not None:  # multimodal wrappers (Llama-4) keep the LM in text_config
        cfg = text
    L = int(_get(cfg, "num_hidden_layers"))
    E = _get(cfg, "n_routed_experts", "num_local_experts", "num_experts")
    K = _get(cfg, "num_experts_per_tok", "moe_topk", "top_k")
    if not E or not K:
        mt = _get(cfg, "model_type", default="?")
        raise ModelError(f"model type {mt!r} has no routed experts in its config (not a Mixture-of-Experts model)")
    mt = _get(cfg, "model_type", default="")
    if _get(cfg, "first_k_dense_replace") is not None:
        freq = int(_get(cfg, "moe_layer_freq", default=1))
        k0 = int(_get(cfg, "first_k_dense_replace"))
        layers = [i for i in range(L) if i >= k0 and i % freq == 0]
    elif _get(cfg, "moe_layers") is not None:
        layers = sorted(int(x) for x in _get(cfg, "moe_layers"))
    elif _get(cfg, "interleave_moe_layer_step") is not None:
        step = int(_get(cfg, "interleave_moe_layer_step"))
        layers = list(range(step - 1, L, step))
    elif _get(cfg, "decoder_sparse_step") is not None:
        step = int(_get(cfg, "decoder_sparse_step"))
        skip = set(_get(cfg, "mlp_only_layers", default=[]) or [])
        layers = [i for i in range(L) if i not in skip and (i + 1) % step == 0]
    else:
        layers = list(range(L))
    return {
        "architecture": (_get(cfg, "architectures", default=[None]) or [None])[0] or mt,
        "num_hidden_layers": L,
        "moe_layers": tuple(layers),
        "num_experts": int(E),
        "top_k": int(K),
        "num_shared_experts": int(_get(cfg, "n_shared_experts", default=0) or (1 if mt.startswith("llama4") else 0)),
        "hidden_size": int(_get(cfg, "hidden_size")),
        "n_group": _get(cfg, "n_group"),
        "topk_group": _get(cfg, "topk_group"),
    }


def model_info_from_hf_config(cfg: Any, *, name: str, source: str) -> ModelInfo:
    """ModelInfo for a checkpoint given its HF config (object or dict)."""
    topo = moe_topology_from_hf_config(cfg)
    if topo["n_group"] in (None, 1):
        topo["n_group"] = topo["topk_group"] = None
    return ModelInfo(name=name, source=source, **topo)
