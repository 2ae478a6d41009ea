"""Lazy imports of heavy optional dependencies, with an error that says what to install."""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

from moetrace.errors import MissingDependencyError

# module name -> extra that provides it
_EXTRA = {
    "torch": "hf",
    "transformers": "hf",
    "vllm": "vllm",
    "datasets": "datasets",
    "ray": "ray",
    "sklearn": "analysis",
    "scipy": "analysis",
    "umap": "analysis",
    "numba": "analysis",
    "plotly": "viz",
}


def require(module: str, *, purpose: str) -> ModuleType:
    """Import ``module`` or raise ``MissingDependencyError`` naming the extra to install.

    ``purpose`` completes the sentence "... is needed for <purpose>".
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        extra = _EXTRA.get(top)
        hint = f"pip install 'moetrace[{extra}]'" if extra else f"pip install {top}"
        raise MissingDependencyError(
            f"`{top}` is needed for {purpose} but could not be imported ({exc}). Install it with: {hint}"
        ) from exc


def import_in_background(*modules: str) -> threading.Thread:
    """Start importing ``modules`` on a daemon thread and return it, for a command that will need them
    after a first step that leaves a core idle (scikit-learn takes 1.5 s to import: compare's
    counting pass runs beside it). Their first use finds them imported, or waits on the import lock
    for the import under way: never imports twice. A module that fails to import is left to
    ``require`` at its first use, whose error names what to install."""

    def run() -> None:
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError:
                return  # require() reports it where the module is needed, with what to install

    thread = threading.Thread(target=run, name="moetrace-imports", daemon=True)
    thread.start()
    return thread
