"""The one train/held-out split of a trace's requests: ``compare``, ``advise`` and the replay draw the same.

A placement is fitted on the training requests and judged on the held-out ones; every command that
splits a trace calls ``held_out_R``, so one ``--seed`` and ``--test-fraction`` name one split
everywhere (a placement file records them: ``moetrace route replay`` re-draws its split from them).

Shape legend (docs/architecture.md): R requests.

Out of scope: which held-out tokens are kept and how steps are drawn from them (``compare``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["held_out_R"]


def held_out_R(num_requests: int, *, test_fraction: float, seed: int) -> np.ndarray:
    """Which requests are held out, bool [R]: ``round(R * test_fraction)`` of them (at least one, and
    at least one left to train on), a uniform draw seeded by ``seed``. Needs ``R >= 2``."""
    R = num_requests
    rng = np.random.default_rng(seed)
    n_test = min(max(1, int(round(R * test_fraction))), R - 1)
    is_test_R = np.zeros(R, dtype=bool)
    is_test_R[rng.permutation(R)[:n_test]] = True
    return is_test_R
