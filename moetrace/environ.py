"""Environment variables set for a block and restored after it (core: imports nothing of the stages).

Out of scope: which variables a command sets (the callers: ``cli.common.third_party_bars``,
``placement.replay.launch.launch_local``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["environ"]


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in this process's environment for the block (children started in it inherit
    them), then restore what was there (a variable that was not set is removed again)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
