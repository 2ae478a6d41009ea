"""The one registry of collection backends: name → how to build it, when ``auto`` picks it, its GPUs.

``moetrace collect --backend`` takes its choices and help from :data:`BACKENDS`;
:func:`choose_backend` (called once per run by ``sharding.run_collection``) resolves ``auto``
from it; ``collect`` builds the chosen backend through its row and drives it through the
``backends.base.CollectionBackend`` protocol; Ray shards reserve the row's GPUs.

Adding a backend: write a module in ``tracer/backends/`` with a class that has the protocol's four
methods (``check_environment``, ``load``, ``describe``, ``run``), then add one :class:`BackendEntry`
row here. Nothing else names backends.

Importing this module imports no backend module (and so no numpy, torch or vLLM): a row's
functions import theirs when called, so ``moetrace --help`` stays light.

Out of scope: what a backend does (``hf``, ``vllm``), the protocol itself (``base``), running one
(``collect``) or several (``sharding``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moetrace.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from moetrace.tracer.backends.base import CollectionBackend
    from moetrace.tracer.backends.vllm import VllmEngineConfig

#: what ``--backend`` accepts besides a backend's name
AUTO = "auto"


@dataclass(frozen=True, kw_only=True)
class BackendSettings:
    """A run's settings that decide how a backend is built; each backend takes what it needs."""

    device: str = "cpu"  # torch device of the HF backend (cpu, cuda, cuda:1, ...)
    dtype: str = "auto"  # torch dtype of the HF backend (tiny models run in float32)
    engine: VllmEngineConfig | None = None  # vLLM engine settings (None: VllmEngineConfig())


@dataclass(frozen=True, kw_only=True)
class BackendEntry:
    """One row of :data:`BACKENDS`."""

    name: str  # what --backend calls it; the manifest's backend.name
    description: str  # one line for --help and the docs
    build: Callable[[BackendSettings], CollectionBackend]  # the backend object of one run (imports its module)
    auto_here: Callable[[BackendSettings], bool]  # whether `auto` may pick it on this machine (rows tried in order)
    auto_when: str  # when `auto` picks it, in words (--help: "when ...", "otherwise")
    auto_on_ray: bool  # whether `auto` picks it for shards that Ray places on the cluster's GPU nodes
    num_gpus: Callable[[BackendSettings], float]  # GPUs one engine takes (what a Ray shard reserves)


# ---------------------------------------------------------------------------------------- vLLM
def _vllm_engine(settings: BackendSettings) -> VllmEngineConfig:
    from moetrace.tracer.backends.vllm import VllmEngineConfig

    return settings.engine if settings.engine is not None else VllmEngineConfig()


def _build_vllm(settings: BackendSettings) -> CollectionBackend:
    from moetrace.tracer.backends.vllm import VllmBackend

    return VllmBackend(engine=_vllm_engine(settings))


def _vllm_here(settings: BackendSettings) -> bool:
    if settings.device == "cpu" or importlib.util.find_spec("vllm") is None:
        return False
    from moetrace.tracer.backends.vllm import visible_gpu_count

    return visible_gpu_count() > 0  # counted without initialising CUDA before vLLM starts its workers


# ------------------------------------------------------------------------------------------ HF
def _build_hf(settings: BackendSettings) -> CollectionBackend:
    from moetrace.tracer.backends.hf import HfBackend

    return HfBackend(device=settings.device, dtype=settings.dtype)


#: the registry; ``auto`` takes the first row whose ``auto_here`` (or, on Ray, ``auto_on_ray``) holds
BACKENDS: dict[str, BackendEntry] = {
    e.name: e
    for e in (
        BackendEntry(
            name="vllm",
            description="vLLM on GPU nodes, routing from its routed-experts capture (docs/collecting.md)",
            build=_build_vllm,
            auto_here=_vllm_here,
            auto_when="when vLLM is importable, --device is not cpu and a GPU is visible, and for --ray-shards",
            auto_on_ray=True,
            num_gpus=lambda s: float(_vllm_engine(s).num_gpus),  # tp * dp
        ),
        BackendEntry(
            name="hf",
            description="HF transformers on CPU or GPU, routing from hooks on the model's routers (docs/hf-backend.md)",
            build=_build_hf,
            auto_here=lambda s: True,
            auto_when="otherwise",
            auto_on_ray=False,
            num_gpus=lambda s: 0.0 if s.device == "cpu" else 1.0,
        ),
    )
}


def backend_choices() -> tuple[str, ...]:
    """What ``--backend`` accepts: ``auto`` and every registered name, in registry order."""
    return (AUTO, *BACKENDS)


def get_backend(name: str) -> BackendEntry:
    """The registry row of backend ``name``; ``ConfigError`` for ``auto`` or an unknown name."""
    entry = BACKENDS.get(name)
    if entry is None:
        hint = " (choose_backend decides 'auto')" if name == AUTO else ""
        raise ConfigError(f"no collection backend {name!r}{hint}; backends: {', '.join(BACKENDS)}")
    return entry


def choose_backend(asked: str, *, settings: BackendSettings, on_ray: bool = False) -> str:
    """The backend a run uses; decided once per run (``sharding.run_collection`` calls it).

    A registered name is taken as asked. ``auto`` takes the first row of :data:`BACKENDS` that
    may run here (``auto_here``): vLLM when it is importable, ``settings.device`` is not ``cpu``
    and a GPU is visible, else HF transformers. For shards placed by Ray (``on_ray``) it takes the
    first row with ``auto_on_ray`` (vLLM): they run on the cluster's GPU nodes, not on the node
    that decides.
    """
    if asked in BACKENDS:
        return asked
    if asked != AUTO:
        raise ConfigError(f"--backend must be one of {', '.join(backend_choices())}, not {asked!r}")
    for entry in BACKENDS.values():
        if entry.auto_on_ray if on_ray else entry.auto_here(settings):
            return entry.name
    raise ConfigError("--backend auto: no registered backend can run here; name one with --backend")
