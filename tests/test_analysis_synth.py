"""analyze on `moetrace synth` traces: the measured statistics follow the generator's planted knobs."""

from __future__ import annotations

import polars as pl
from factories import tiny_model

import moetrace.tracer.synth as synth
from moetrace.analysis.affinity import affinity_table, pair_counts
from moetrace.analysis.correlation import prefill_decode_pooled
from moetrace.analysis.counts import count_trace

MODEL = tiny_model(num_layers=3, num_experts=16, top_k=2)
SHORT = {
    d: {"prompt_median": 40, "prompt_sigma": 0.2, "output_median": 30, "output_sigma": 0.2} for d in ("gsm8k", "mbpp")
}


def _synth(path, **knobs):
    plan = synth.SynthPlan(
        datasets=("gsm8k", "mbpp"),
        num_requests=120,
        seed=0,
        knobs=synth.SynthKnobs.from_dict({"lengths": SHORT, "request_spread": 0.0, **knobs}),
    )
    synth.synthesize(path, model=MODEL, plan=plan)
    return path


def test_pooled_prefill_decode_correlation_tracks_pd_mix(tmp_path):
    r = []
    for i, mix in enumerate((0.0, 0.5, 1.0)):
        c = count_trace(_synth(tmp_path / f"p{i}", pd_mix=mix, layer_affinity=0.0))
        r.append(prefill_decode_pooled(c).filter(pl.col("dataset") != "all")["pearson"].mean())
    assert r[0] < r[1] < r[2]
    assert r[2] > 0.9


def test_cross_layer_affinity_tracks_layer_affinity(tmp_path):
    u = []
    for i, a in enumerate((0.0, 0.4, 0.8)):
        aff = affinity_table(pair_counts(_synth(tmp_path / f"a{i}", layer_affinity=a)))
        u.append(aff["uncertainty_coefficient"].mean())
    assert u[0] < 0.05
    assert u[0] < u[1] < u[2]
