"""The builders of small traces with planted structure (``factories``: ``profile_trace``,
``sample_topk``) do what the analysis tests rely on."""

from __future__ import annotations

import numpy as np
from factories import profile_trace, sample_topk

from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.validate import find_problems


# ---------------------------------------------------------------------------------- builder tests
def test_profile_trace_is_valid_and_follows_its_profile(tmp_path):
    E = 6
    prof = np.ones((2, 2, 1, E))
    prof[0, :, 0, 0] = 50.0  # dataset 0 strongly prefers expert 0
    path = profile_trace(tmp_path / "t", profiles_DSLE=prof, requests_per_dataset=20, top_k=1)
    assert find_problems(path) == []
    arr = open_trace(path).token_arrays()
    assert arr.topk_ids_TLK.shape[1:] == (1, 1)
    assert (arr.topk_ids_TLK[:, 0, 0] == 0).mean() > 0.4  # half the tokens are dataset 0, ~90% of those on expert 0


def test_sample_topk_draws_distinct_ids():
    rng = np.random.default_rng(1)
    ids = sample_topk(rng, np.ones((500, 3, 8)), 4)
    srt = np.sort(ids, axis=-1)
    assert np.all(srt[..., 1:] != srt[..., :-1])
