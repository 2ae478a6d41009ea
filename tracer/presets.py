"""Model names: what a ``--model`` name means (:func:`resolve`), the presets, the routing topology of HF configs.

A name is one of (decided once, by :func:`resolve`, for the HF and vLLM backends, ``import`` and
``synth``):

- a *preset* (``data/models/*.json``): a real model (hub id, architecture, MoE facts from its config);
- a *tiny preset* ``<preset>-tiny``: the same architecture class and routing topology (layers,
  MoE-layer pattern, experts, top-k, groups) with small hidden sizes, built from the bundled config
  with seeded random weights: it runs on a CPU with nothing downloaded;
- a *local* checkpoint directory holding a ``config.json`` (or the path of a config file itself),
  such as the ones ``make-checkpoint`` writes from a preset's vLLM-sized tiny config
  (``tiny_vllm``: real head dims, small widths; no model name of its own);
- a *hub* id ``org/name``.

Out of scope: building or loading the model (``backends.hf``), engine flags and checks
(``backends.vllm``), what a backend refuses (a ``-tiny`` preset on vLLM, a full-size model on a CPU).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from moetrace._deps import require
from moetrace.errors import ModelError
from moetrace.tracer.trace.schema import ModelInfo

TINY_SUFFIX = "-tiny"
#: the tiny models' byte-level tokenizer (``backends.hf.tiny_tokenizer``): 256 bytes, then pad, bos, eos
TINY_VOCAB_SIZE = 384
TINY_PAD_ID, TINY_BOS_ID, TINY_EOS_ID = 256, 257, 258
#: a hub id: ``org/name`` (one slash; a bare name is no hub id here)
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")

ModelKind = Literal["preset", "tiny-preset", "local", "hub"]
#: which engine a tiny config is sized for: "hf" (the ``-tiny`` presets: toy dims, fast on a CPU) or
#: "vllm" (``make-checkpoint``: real head dims that vLLM's attention kernels accept, small widths)
TinyEngine = Literal["hf", "vllm"]


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
    tiny: dict[str, Any]  # overrides that make the -tiny variant (toy dims, fast on a CPU)
    tiny_vllm: dict[str, Any] | None  # overrides over `config` that make the vLLM-sized tiny variant
    #                                   (real head dims, small widths); None: no such variant

    def tiny_overrides(self, *, engine: TinyEngine = "hf") -> dict[str, Any]:
        """The HF config fields a tiny variant changes: ``tiny`` (engine "hf") or ``tiny_vllm`` (engine "vllm").

        Both apply over ``config``. The "hf" ones set every dim to a toy size, head dims included;
        the "vllm" ones change widths and head counts only, so every field they leave out (head
        dims, MLA ranks, sliding window, routing) keeps the released model's value. Raises
        ``ModelError`` when the preset has no vLLM-sized variant.
        """
        if engine == "hf":
            return self.tiny
        if self.tiny_vllm is None:
            with_vllm = ", ".join(p.name for p in _load_all().values() if p.tiny_vllm is not None)
            raise ModelError(f"preset {self.name!r} has no vLLM-sized tiny config; presets with one: {with_vllm}")
        return self.tiny_vllm

    def model_info(self, *, tiny: bool, engine: TinyEngine = "hf") -> ModelInfo:
        """The routing topology of the full model or of a tiny variant (same topology, its own hidden
        size and expert sizes)."""
        sizes = expert_sizes_from_hf_config(
            {"model_type": self.model_type, **self.hf_config_dict(tiny=tiny, engine=engine)}
        )
        return ModelInfo(
            name=self.name + (TINY_SUFFIX if tiny else ""),
            source=f"moetrace:{self.name}{TINY_SUFFIX}" if tiny else self.hub_id,
            architecture=self.architecture,
            num_hidden_layers=self.num_hidden_layers,
            moe_layers=self.moe_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_shared_experts=self.num_shared_experts,
            hidden_size=int(self.tiny_overrides(engine=engine)["hidden_size"]) if tiny else self.hidden_size,
            n_group=self.n_group,
            topk_group=self.topk_group,
            moe_intermediate_size=sizes["moe_intermediate_size"],
            shared_expert_intermediate_size=sizes["shared_expert_intermediate_size"],
            weight_bytes_per_value=sizes["weight_bytes_per_value"],
        )

    def hf_config_dict(self, *, tiny: bool, engine: TinyEngine = "hf") -> dict[str, Any]:
        """Keyword arguments for the HF config class of this architecture, named as in the released config.json.

        ``tiny``: 4096 positions (unless the overrides say otherwise), the overrides of ``engine``
        (:meth:`tiny_overrides`), the tiny tokenizer's vocabulary and ids, untied embeddings.
        ``engine`` is ignored for the full model.
        """
        d = {**self.config, "num_hidden_layers": self.num_hidden_layers, "hidden_size": self.hidden_size}
        if tiny:
            d["max_position_embeddings"] = 4096
            d.update(self.tiny_overrides(engine=engine))
            d.update(
                vocab_size=TINY_VOCAB_SIZE,
                pad_token_id=TINY_PAD_ID,
                bos_token_id=TINY_BOS_ID,
                eos_token_id=TINY_EOS_ID,
                tie_word_embeddings=False,
            )
        return d

    def hf_config(self, *, tiny: bool, engine: TinyEngine = "hf") -> Any:
        """The transformers config object of :meth:`hf_config_dict` (needs ``transformers``; nothing downloaded)."""
        transformers = require("transformers", purpose="reading the model's HF config")
        return transformers.AutoConfig.for_model(self.model_type, **self.hf_config_dict(tiny=tiny, engine=engine))


@cache
def _load_all() -> dict[str, Preset]:
    out = {}
    for f in resources.files("moetrace.data").joinpath("models").iterdir():
        if f.name.endswith(".json"):
            d = json.loads(f.read_text())
            d["moe_layers"] = tuple(d["moe_layers"])
            d.setdefault("n_group", None)
            d.setdefault("topk_group", None)
            d.setdefault("tiny_vllm", None)
            out[d["name"]] = Preset(**d)
    return dict(sorted(out.items()))


def list_presets() -> list[Preset]:
    return list(_load_all().values())


def _preset_names() -> str:
    return ", ".join(p for n in _load_all() for p in (n, n + TINY_SUFFIX))


def hub_unreachable(*, timeout_s: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be reached from here (one short phrase), or None when it can.

    ``HF_HUB_OFFLINE`` set: offline by choice. Otherwise one TCP connection to the endpoint
    (``HF_ENDPOINT``, default huggingface.co) with ``timeout_s``, so an offline machine is told at
    once rather than after the hub client's retries.
    """
    import os
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme != "http" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or exc}"


def _did_you_mean(name: str) -> str:
    """``"did you mean 'deepseek-v3-tiny'? "`` for a near miss of a preset name, else ``""``."""
    import difflib

    names = [p for n in _load_all() for p in (n, n + TINY_SUFFIX)]
    close = difflib.get_close_matches(name.lower(), names, n=2, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""


@dataclass(frozen=True, kw_only=True)
class ResolvedModel:
    """What one model name means (see :func:`resolve`)."""

    name: str  # the name as given; becomes ModelInfo.name
    kind: ModelKind  # preset | tiny-preset (built in memory) | local (checkpoint dir or config file) | hub (org/name)
    preset: Preset | None  # the preset of a "preset" or "tiny-preset" name, else None
    source: str  # what an engine loads: the preset's hub id, the local path or the hub id as given;
    #              "moetrace:<preset>-tiny" for a tiny preset (nothing to load); becomes ModelInfo.source
    config_path: Path | None  # the config.json of a "local" name, else None

    def model_info(self, *, hf_config: Any = None) -> ModelInfo:
        """The routing topology (layers, MoE layers, experts, top-k, groups) of the model.

        Presets: the bundled facts (``hf_config`` is not needed). Local and hub names: from
        ``hf_config`` when the caller loaded it (:meth:`hf_config`: transformers fills the
        architecture's defaults), else, for a local name, from its ``config.json`` read as JSON.
        A hub name without ``hf_config`` raises ``ModelError`` (its config is not downloaded here).
        """
        if self.preset is not None:
            return self.preset.model_info(tiny=self.kind == "tiny-preset")
        if hf_config is None:
            hf_config = self._config_json()
        return model_info_from_hf_config(hf_config, name=self.name, source=self.source)

    def hf_config(self) -> Any:
        """The transformers config object of the model (needs ``transformers``).

        Presets (tiny ones with the tiny tokenizer's ids): built from the bundled config, nothing
        downloaded. Local and hub names: ``AutoConfig.from_pretrained(source)`` (a hub id downloads its
        ``config.json``). Raises ``ModelError`` with one line when the config cannot be read.
        """
        if self.preset is not None:
            return self.preset.hf_config(tiny=self.kind == "tiny-preset")
        transformers = require("transformers", purpose="reading the model's HF config")
        unreachable = hub_unreachable() if self.kind == "hub" else None
        try:  # an unreachable hub: the local cache only, so the answer comes at once instead of after retries
            return transformers.AutoConfig.from_pretrained(self.source, local_files_only=unreachable is not None)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            hint = _did_you_mean(self.source.split("/")[-1])
            if unreachable is not None:
                raise ModelError(
                    f"{self.source!r} is not in the local Hugging Face cache and the hub is not reachable from here "
                    f"({unreachable}). {hint}Pass a preset (see `moetrace models`) "
                    "or a local checkpoint directory, or run where the hub is reachable."
                ) from exc
            raise ModelError(
                f"cannot read the config of {self.source!r} ({first}). {hint}"
                "Pass a local checkpoint directory, a reachable hub id, or a preset (see `moetrace models`)."
            ) from exc

    def _config_json(self) -> dict[str, Any]:
        if self.config_path is None:
            raise ModelError(
                f"{self.name!r} is a hub id and its config is not downloaded here: pass a preset (see `moetrace "
                "models`) or a local checkpoint directory / config.json"
            )
        try:
            cfg = json.loads(self.config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelError(f"{self.config_path}: not valid JSON ({exc})") from exc
        except UnicodeDecodeError as exc:
            raise ModelError(f"{self.config_path}: not a JSON text file ({exc})") from exc
        if not isinstance(cfg, dict):
            raise ModelError(f"{self.config_path}: not an HF config (a JSON object)")
        return cfg


def resolve(name: str) -> ResolvedModel:
    """What the model name ``name`` means; reads nothing but the file system, downloads nothing.

    In this order: a preset (``deepseek-v3``), a tiny preset (``deepseek-v3-tiny``), an existing
    local path (a checkpoint directory holding ``config.json``, or a config file), a hub id
    (``org/name``). Anything else, including an unknown ``...-tiny`` name, a missing local path and
    a directory without ``config.json``, raises ``ModelError`` (one line).
    """
    presets = _load_all()
    tiny = name.endswith(TINY_SUFFIX)
    base = name[: -len(TINY_SUFFIX)] if tiny else name
    if base in presets:
        p = presets[base]
        if tiny:
            return ResolvedModel(name=name, kind="tiny-preset", preset=p, source=f"moetrace:{name}", config_path=None)
        return ResolvedModel(name=name, kind="preset", preset=p, source=p.hub_id, config_path=None)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(
                f"{name}: a directory without config.json; a local checkpoint directory holds the model's config.json"
            )
        return ResolvedModel(name=name, kind="local", preset=None, source=name, config_path=path / "config.json")
    if path.is_file():
        return ResolvedModel(name=name, kind="local", preset=None, source=name, config_path=path)
    if tiny:
        raise ModelError(f"unknown model preset {name!r}; {_did_you_mean(name)}presets: {_preset_names()}")
    if _HUB_ID_RE.match(name):
        return ResolvedModel(name=name, kind="hub", preset=None, source=name, config_path=None)
    raise ModelError(
        f"model {name!r} is neither a preset, nor an existing checkpoint directory or config.json, nor a hub id "
        f"(org/name); {_did_you_mean(name)}presets: {_preset_names()}"
    )


def model_info_for(name: str) -> ModelInfo:
    """ModelInfo of a preset, tiny preset or local config, without loading anything (``resolve(name).model_info()``)."""
    return resolve(name).model_info()


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
    missing = [f for f in ("num_hidden_layers", "hidden_size") if _get(cfg, f) is None]
    if missing:
        raise ModelError(f"the model config has no {' or '.join(missing)}: not an HF transformers model config")
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
        "num_shared_experts": _num_shared_experts(cfg, mt),
        "hidden_size": int(_get(cfg, "hidden_size")),
        "n_group": _get(cfg, "n_group"),
        "topk_group": _get(cfg, "topk_group"),
    }


def _num_shared_experts(cfg: Any, model_type: str) -> int:
    """Always-on experts per MoE layer: ``n_shared_experts`` (DeepSeek-V2/V3, GLM-4.5), else one for
    Llama-4 and for a config with a ``shared_expert_intermediate_size`` (Qwen2-MoE, Qwen3-Next), else 0."""
    n = _get(cfg, "n_shared_experts")
    if n:
        return int(n)
    if model_type.startswith("llama4") or _size(_get(cfg, "shared_expert_intermediate_size")):
        return 1
    return 0


def _size(v: Any) -> int | None:
    """A config's width: a whole number >= 1, else None (absent, 0, a per-layer list, not a number)."""
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


#: bytes per weight of a quantized release by its ``quantization_config.quant_method``: FP8 (DeepSeek-V3,
#: the Qwen3 FP8 releases) 1; MXFP4 (gpt-oss: 4-bit values and one 8-bit scale per 32) 4.25/8
_QUANT_BYTES = {"fp8": 1.0, "mxfp4": 4.25 / 8}
#: bytes per weight of an unquantized release by its ``torch_dtype`` (transformers 5: ``dtype``)
_DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0, "float8_e4m3fn": 1.0}


def _weight_bytes(outer: Any, cfg: Any) -> float | None:
    """Bytes per expert weight the config's release stores, or None when it does not say (or says it
    in a way not read here): ``quantization_config`` (``quant_method`` fp8 / mxfp4; ``bits`` of GPTQ / AWQ;
    the weights' ``num_bits`` of compressed-tensors), else ``torch_dtype``. ``outer``: the config as
    given (a multimodal wrapper keeps these outside its ``text_config``)."""
    q = _get(outer, "quantization_config") or _get(cfg, "quantization_config")
    if q is not None:
        if not isinstance(q, dict):
            q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
        method = str(getattr(q.get("quant_method"), "value", q.get("quant_method")) or "").lower()
        if method in _QUANT_BYTES:
            return _QUANT_BYTES[method]
        bits = _size(q.get("bits"))
        groups = q.get("config_groups")
        if bits is None and isinstance(groups, dict):
            weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)]
            found = {_size(w.get("num_bits")) for w in weights if isinstance(w, dict)}
            bits = found.pop() if len(found) == 1 else None
        return bits / 8 if bits is not None and bits <= 16 else None
    dtype = _get(outer, "torch_dtype", "dtype") or _get(cfg, "torch_dtype", "dtype")
    return _DTYPE_BYTES.get(str(dtype).removeprefix("torch.")) if dtype is not None else None


def expert_sizes_from_hf_config(cfg: Any) -> dict[str, Any]:
    """What the cost model needs of one MoE layer's experts, from an HF config (object or dict), None
    where the config does not say (``ModelInfo``'s fields of the same names, documented there):

    - ``hidden_size``;
    - ``moe_intermediate_size``: the routed expert's FFN width: ``moe_intermediate_size`` (DeepSeek,
      Qwen-MoE), else ``intermediate_size`` (Mixtral, OLMoE, GPT-OSS, Llama-4, whose experts use it);
      a per-layer list is not read (None);
    - ``num_shared_experts`` (as the routing topology counts them) and ``shared_expert_intermediate_size``:
      the width of ONE shared expert: ``shared_expert_intermediate_size`` (Qwen2-MoE, Qwen3-Next: one
      shared expert of that width), else the routed expert's (DeepSeek-V2/V3, GLM-4.5: each of
      ``n_shared_experts`` is a routed-size MLP; Llama-4: one of ``intermediate_size``); None without;
    - ``weight_bytes_per_value``: bytes per weight of the release (``quantization_config``, else
      ``torch_dtype``).

    Reads no routed-expert count: a config with only the sizes (a user's ``--model-config``) works.
    """
    outer = cfg
    text = _get(cfg, "text_config")
    if text is not None:  # multimodal wrappers (Llama-4) keep the LM in text_config
        cfg = text
    mt = str(_get(cfg, "model_type", default="") or _get(outer, "model_type", default="") or "")
    moe = _get(cfg, "moe_intermediate_size")
    ffn = _size(moe) if moe is not None else _size(_get(cfg, "intermediate_size"))
    shared = _num_shared_experts(cfg, mt)
    shared_ffn = None
    if shared:
        given = _get(cfg, "shared_expert_intermediate_size")
        shared_ffn = _size(given) if given is not None else ffn
    return {
        "hidden_size": _size(_get(cfg, "hidden_size")),
        "moe_intermediate_size": ffn,
        "num_shared_experts": shared,
        "shared_expert_intermediate_size": shared_ffn,
        "weight_bytes_per_value": _weight_bytes(outer, cfg),
    }


def model_info_from_hf_config(cfg: Any, *, name: str, source: str) -> ModelInfo:
    """ModelInfo for a checkpoint given its HF config (object or dict): the routing topology and the
    expert sizes (:func:`expert_sizes_from_hf_config`)."""
    topo = moe_topology_from_hf_config(cfg)
    if topo["n_group"] in (None, 1):
        topo["n_group"] = topo["topk_group"] = None
    sizes = expert_sizes_from_hf_config(cfg)
    return ModelInfo(
        name=name,
        source=source,
        **topo,
        moe_intermediate_size=sizes["moe_intermediate_size"],
        shared_expert_intermediate_size=sizes["shared_expert_intermediate_size"],
        weight_bytes_per_value=sizes["weight_bytes_per_value"],
    )
