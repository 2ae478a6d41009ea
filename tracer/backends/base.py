"""The one seam every collection backend sits behind: :class:`CollectionBackend`, and what it is given.

A backend is one object per run, built by its row in ``backends.registry``. ``collect`` calls it
in this order, and only through these four methods:

1. :meth:`~CollectionBackend.check_environment`, once, before anything is loaded or written: what
   must be installed and present (packages, GPUs, environment switches), and whether it can do
   what the run asks (``GenerationConfig.record_weights``). Raises a ``MoetraceError`` whose one
   line names what to install or change.
2. :meth:`~CollectionBackend.load`: the model (or where the engine will load it from), and its
   routing topology, which the trace writer records.
3. :meth:`~CollectionBackend.describe`: what the manifest's ``backend`` section says about it.
   Every backend says it in the same key style (:meth:`BackendDescription.manifest_section`):
   ``{"name": ..., "versions": {package: version, ...}, <its own settings>...}``.
4. :meth:`~CollectionBackend.run`: the engine loop. It writes every prompt not yet in
   ``writer.completed_request_ids`` (resume) through the one ``TraceWriter``, commits as it
   goes, and reports each commit to ``on_progress``; every generation setting it reads is in the
   one :class:`GenerationConfig`.

Importing this module imports nothing heavy; a backend module imports its engine (torch,
transformers, vLLM) only inside these methods, so ``moetrace --help`` works on a bare install.

Out of scope: which backends exist and which ``--backend auto`` picks (``registry``), prompts
(``datasets``), model names (``presets.resolve``), opening the trace and resuming it (``collect``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from moetrace.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from moetrace.tracer.datasets import PromptRecord
    from moetrace.tracer.presets import ResolvedModel
    from moetrace.tracer.trace.schema import ModelInfo
    from moetrace.tracer.trace.writer import TraceWriter

#: ``on_progress(requests, tokens)``: what this run has committed so far (cumulative)
OnProgress = Callable[[int, int], None]


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """How every request is generated and what is kept of it: the same for every backend."""

    max_new_tokens: int = 64  # generated tokens per request at most
    temperature: float = 0.0  # 0 = greedy; > 0 samples, seeded from `seed`
    seed: int = 0  # seeds the -tiny models' weights and, with temperature > 0, the sampling
    chat_template: bool = True  # apply the tokenizer's chat template when it has one
    batch_size: int = 8  # requests per generation batch where the backend batches itself (HF)
    store_text: bool = False  # keep prompt and output text in the trace (the engine detokenizes only then)
    record_weights: bool = False  # also store routing weights (a backend that cannot, refuses in check_environment)

    def __post_init__(self) -> None:  # checked before anything is loaded or written
        for name in ("max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")


#: keys of the manifest's ``backend`` section that the seam writes itself
RESERVED_KEYS = ("name", "versions")


@dataclass(frozen=True, kw_only=True)
class BackendDescription:
    """What a backend says about itself in the trace manifest (:meth:`CollectionBackend.describe`)."""

    versions: Mapping[str, str]  # installed version of each package that ran, e.g. {"vllm": "0.22.1", "torch": "2.9.0"}
    settings: Mapping[str, Any] = field(default_factory=dict)  # its own JSON-ready settings (device, engine, ...)

    def manifest_section(self, name: str) -> dict[str, Any]:
        """The manifest's ``backend`` section: ``{"name": name, "versions": {...}, **settings}``."""
        clash = sorted(set(RESERVED_KEYS) & set(self.settings))
        if clash:
            raise ValueError(f"backend settings may not use the reserved keys {clash}")
        return {"name": name, "versions": dict(self.versions), **self.settings}


@runtime_checkable
class CollectionBackend(Protocol):
    """One collection engine for one run; ``collect`` calls the methods in the order below, once each."""

    def check_environment(self, generation: GenerationConfig) -> None:
        """Fail early, before anything is loaded or written, with a ``MoetraceError`` naming what to
        install or change: missing packages, no GPU, a setting this backend cannot honour."""
        ...

    def load(self, resolved: ResolvedModel, generation: GenerationConfig) -> ModelInfo:
        """Load the model ``resolved`` names (or check what the engine will load) and return its
        routing topology, which the trace records."""
        ...

    def describe(self) -> BackendDescription:
        """Versions and settings of what runs (after :meth:`load`), for the manifest."""
        ...

    def run(
        self,
        prompts: Sequence[PromptRecord],
        *,
        writer: TraceWriter,
        generation: GenerationConfig,
        on_progress: OnProgress | None = None,
    ) -> None:
        """Generate every prompt not in ``writer.completed_request_ids`` and write its routing rows
        through ``writer``; commit as requests finish; after each commit call ``on_progress(requests,
        tokens)`` with what this run has written so far."""
        ...
