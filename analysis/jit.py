"""Run a numba kernel, or its NumPy twin where this machine's numba cannot compile it.

numba compiles a kernel on its first call for the argument types. A numba that cannot (a compiler
bug of one release: a ``RecursionError`` in the parfor pass was seen with the numba of a GPU machine's
image, the class of numba/numba#9182) would end the command in a long traceback. :func:`run_kernel`
catches that once, warns naming the kernel and the numba version, and from then on runs the NumPy
version, which gives the same result more slowly (``analysis/kernels_numpy.py``; tests compare the
two). Errors a kernel raises while *running* (plain Python exceptions) are not caught: only numba's
own errors and a ``RecursionError``, which a compiled kernel without recursion cannot raise.

:func:`cached_kernel` builds a kernel once per process, or answers None where numba is not installed
(found once), so that a caller on a hot path decides its fallback once and never per call.

Out of scope: choosing between the two for speed (numba is always tried first).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

#: kernels whose compilation failed in this process: name -> the reason, said once
_FAILED: dict[str, str] = {}


def cached_kernel(
    cache: dict[str, Any], name: str, build: Callable[[], Callable[..., Any]]
) -> Callable[..., Any] | None:
    """``cache[name]``, set on the first call to ``build()`` (which imports numba and returns the njit
    dispatcher), or to None where numba is not installed."""
    if name not in cache:
        from importlib.util import find_spec

        cache[name] = build() if find_spec("numba") is not None else None
    return cache[name]


def _compile_errors() -> tuple[type[BaseException], ...]:
    from numba.core.errors import NumbaError

    return (NumbaError, RecursionError)


def run_kernel(name: str, kernel: Callable[[], Callable[..., Any]], fallback: Callable[..., Any], *args: Any) -> Any:
    """``kernel()(*args)``, or ``fallback(*args)`` once numba failed to compile kernel ``name``.

    ``kernel`` builds (or returns the cached) numba dispatcher; ``fallback`` is the NumPy function of
    the same signature and effect (it updates the same output arrays in place and returns the same).
    """
    if name in _FAILED:
        return fallback(*args)
    try:
        return kernel()(*args)
    except _compile_errors() as exc:  # a running njit kernel raises plain Python errors, never these
        import numba

        first = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ""
        _FAILED[name] = f"{type(exc).__name__}: {first}"
        warnings.warn(
            f"numba {numba.__version__} could not compile moetrace's {name} kernel ({_FAILED[name]}); "
            "using its NumPy version instead (same result, slower). Another numba release "
            "(pip install -U numba) may compile it",
            RuntimeWarning,
            stacklevel=2,
        )
        return fallback(*args)
