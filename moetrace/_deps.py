"""Lazy imports of heavy optional dependencies, with an error that says what to install."""

from __future__ import annotations

import importlib
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
