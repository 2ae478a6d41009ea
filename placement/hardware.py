"""Hardware presets and links files: the step model's kernel parameters per copy model, and the
``--link`` option that picks them (docs/placement.md, "The step model").

A links file (``moetrace calibrate -o FILE.json`` writes one; the bundled presets in
``moetrace/data/links/`` are such files) is JSON::

    {"format": "moetrace-links", "version": 1, "name": "h100", "gpu": "...", "source": "...",
     "kernels": {"expert": KERNEL, "node": KERNEL, "rank": KERNEL}, ...}

with ``KERNEL`` as ``step_model.Kernel.to_json`` writes it. Anything else in the file (the fit's
``rows``, ``fit``) is kept for the reader and ignored here.

``--link`` takes a preset name (``h100``, ``h200``, ``b200``, ``gb200``), a links file, or the
override ``intra=BW[,LAT],inter=BW[,LAT],dispatch=fp8|bf16`` on top of the default preset (both
phases of every kernel then see those links; dispatch copies carry that value type), or a preset
or file followed by ``:`` and an override (``h200:inter=25GB/s``).

Out of scope: fitting (``calibrate``); per-fabric congestion.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from moetrace.errors import ConfigError
from moetrace.placement.cost import ExpertCompute, Link, Links, parse_links
from moetrace.placement.step_model import BF16, COPY_MODELS, FP8_E4M3_BLOCK128, VALUE_TYPES, Kernel, Phase, ValueType

__all__ = [
    "LINKS_FORMAT",
    "Hardware",
    "CostModel",
    "PRESETS",
    "DEFAULT_PRESET",
    "preset",
    "default_hardware",
    "hardware_from_json",
    "hardware_of_links",
    "load_hardware",
]

LINKS_FORMAT = "moetrace-links"
#: the bundled presets (``moetrace/data/links/<name>.json``)
PRESETS = ("h100", "h200", "b200", "gb200")
#: the preset every command uses unless ``--link`` says otherwise
DEFAULT_PRESET = "h100"


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """A deployment's all-to-all kernels, one per copy model, and where their parameters come from."""

    name: str  # preset name or file stem
    source: str  # the measured tables the parameters were fitted to (or "assumed: ...")
    kernels: Mapping[str, Kernel]  # copy model name ("expert", "rank", "node") -> its kernel
    gpu: str = ""  # the GPU kind the parameters describe

    def kernel(self, copies: str) -> Kernel:
        """The kernel that sends copies this way."""
        if copies not in self.kernels:
            raise ConfigError(
                f"links {self.name!r} has no kernel for copies per {copies}; it has {', '.join(self.kernels)}"
            )
        return self.kernels[copies]

    def with_links(self, links_spec: str) -> Hardware:
        """Every kernel overridden by ``intra=BW[,LAT],inter=BW[,LAT],dispatch=fp8|bf16`` (the parts
        given): link classes for both phases, the value type of dispatch copies."""
        parts = [p.strip() for p in links_spec.split(",")]
        dispatch = [p.partition("=")[2].strip().lower() for p in parts if p.lower().startswith("dispatch=")]
        rest = ",".join(p for p in parts if not p.lower().startswith("dispatch="))
        if len(dispatch) > 1 or (dispatch and dispatch[0] not in VALUE_TYPES):
            raise ConfigError(
                f"--link: dispatch={','.join(dispatch)} is not one value type; write dispatch=fp8 or dispatch=bf16"
            )
        kernels = {}
        for k, kern in self.kernels.items():
            d = replace(kern.dispatch, links=parse_links(rest, base=kern.dispatch.links))
            if dispatch:
                d = replace(d, value=VALUE_TYPES[dispatch[0]])
            kernels[k] = replace(
                kern, dispatch=d, combine=replace(kern.combine, links=parse_links(rest, base=kern.combine.links))
            )
        return replace(self, name=f"{self.name}:{links_spec}", kernels=kernels)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": LINKS_FORMAT,
            "version": 1,
            "name": self.name,
            "gpu": self.gpu,
            "source": self.source,
            "kernels": {k: v.to_json() for k, v in self.kernels.items()},
        }


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Kernels and expert computation: everything the step time needs besides the traffic."""

    hardware: Hardware = field(default_factory=lambda: default_hardware())  # the kernels per copy model
    expert: ExpertCompute | None = None  # None: the model's expert size is unknown (no expert term)

    def kernel(self, copies: str) -> Kernel:
        """The kernel that sends copies this way (the hardware's)."""
        return self.hardware.kernel(copies)


def hardware_of_links(links: Links, *, name: str = "links", dispatch: ValueType = FP8_E4M3_BLOCK128) -> Hardware:
    """Every copy model's kernel on the same ``links``, no fixed cost, ``dispatch`` values out and
    BF16 back: a hand-set machine (tests, what-ifs), not a measured one."""
    kernels = {
        c: Kernel(
            name=f"{name}-{c}",
            copies=c,  # type: ignore[arg-type]
            dispatch=Phase(value=dispatch, links=links),
            combine=Phase(value=BF16, links=links),
            source="assumed",
        )
        for c in COPY_MODELS
    }
    return Hardware(name=name, source="assumed", kernels=kernels)


# ------------------------------------------------------------------------------ reading
def _num(d: Mapping[str, Any], key: str, where: str) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{where}: `{key}` must be a number, got {v!r}")
    return float(v)


def _links(d: Any, where: str) -> Links:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where}: `links` must be an object")
    nic = d.get("inter_nic", "gpu")
    if nic not in ("gpu", "node"):
        raise ConfigError(f'{where}: `inter_nic` must be "gpu" or "node", got {nic!r}')
    return Links(
        intra=Link(bytes_per_s=_num(d, "intra_bytes_per_s", where), latency_s=_num(d, "intra_latency_s", where)),
        inter=Link(bytes_per_s=_num(d, "inter_bytes_per_s", where), latency_s=_num(d, "inter_latency_s", where)),
        inter_nic=nic,
    )


def _phase(d: Any, where: str) -> Phase:
    if not isinstance(d, Mapping) or not isinstance(d.get("value"), Mapping):
        raise ConfigError(f"{where}: a phase needs `value`, `links` and `fixed_s`")
    v = d["value"]
    value = ValueType(
        name=str(v.get("name", "")),
        bytes_per_value=_num(v, "bytes_per_value", where),
        scale_bytes=float(v.get("scale_bytes", 0.0)),
        block=int(v.get("block", 0)),
    )
    return Phase(value=value, links=_links(d.get("links"), where), fixed_s=_num(d, "fixed_s", where))


def hardware_from_json(doc: Any, *, name: str) -> Hardware:
    """A ``Hardware`` from a links file's JSON (``ConfigError`` naming what is wrong)."""
    if not isinstance(doc, Mapping) or doc.get("format") != LINKS_FORMAT:
        raise ConfigError(
            f'{name}: not a moetrace links file (want "format": "{LINKS_FORMAT}"); write one with `moetrace calibrate -o FILE.json`'
        )
    if doc.get("version") != 1:
        raise ConfigError(f"{name}: links file version {doc.get('version')!r} is not supported (this moetrace reads 1)")
    ks = doc.get("kernels")
    if not isinstance(ks, Mapping) or not ks:
        raise ConfigError(f"{name}: `kernels` must map copy models ({', '.join(COPY_MODELS)}) to kernels")
    kernels = {}
    for copies, k in ks.items():
        where = f"{name}: kernel for copies per {copies}"
        if copies not in COPY_MODELS or not isinstance(k, Mapping):
            raise ConfigError(f"{name}: unknown copy model {copies!r}; use {', '.join(COPY_MODELS)}")
        kernels[copies] = Kernel(
            name=str(k.get("name", copies)),
            copies=copies,
            dispatch=_phase(k.get("dispatch"), where + " dispatch"),
            combine=_phase(k.get("combine"), where + " combine"),
            reduce_bytes_per_s=_num(k, "reduce_bytes_per_s", where),
            source=str(k.get("source", "")),
        )
    return Hardware(
        name=str(doc.get("name", name)), source=str(doc.get("source", "")), gpu=str(doc.get("gpu", "")), kernels=kernels
    )


@functools.cache
def preset(name: str) -> Hardware:
    """A bundled preset by name (read once per process; ``Hardware`` is frozen)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown hardware preset {name!r}; choose one of {', '.join(PRESETS)}, or give a links file")
    text = resources.files("moetrace.data").joinpath("links").joinpath(f"{name}.json").read_text()
    return hardware_from_json(json.loads(text), name=name)


def default_hardware() -> Hardware:
    """The default preset (``DEFAULT_PRESET``)."""
    return preset(DEFAULT_PRESET)


def load_hardware(spec: str | None) -> Hardware:
    """What ``--link`` names: ``None``/empty (the default preset), a preset name, a links file
    (``.json``), an override ``intra=...,inter=...`` of the default, or ``PRESET_OR_FILE:OVERRIDE``."""
    if spec is None or not spec.strip():
        return default_hardware()
    spec = spec.strip()
    head, override = spec, ""
    if "=" in spec:
        if ":" in spec.split("=", 1)[0]:
            head, _, override = spec.partition(":")
        else:
            head, override = "", spec
    if not head:
        hw = default_hardware()
    elif head.lower() in PRESETS:
        hw = preset(head.lower())
    else:
        path = Path(head)
        if not path.is_file():
            raise ConfigError(
                f"--link: {head!r} is neither a preset ({', '.join(PRESETS)}) nor a links file; "
                "write a preset name, FILE.json, or intra=BW[,LAT],inter=BW[,LAT]"
            )
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"--link: cannot read links file {path.name}: {e}") from None
        hw = hardware_from_json(doc, name=path.stem)
    return hw.with_links(override) if override else hw
