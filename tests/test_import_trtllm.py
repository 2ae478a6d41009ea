"""Import format ``trtllm-stats``: TensorRT-LLM's expert statistics directory → a load profile.

The fixture follows TensorRT-LLM's writer (tensorrt_llm/_torch/expert_statistic.py, ExpertStatistic._set_iter):
meta_info.json {"num_experts", "num_experts_per_token"} and rank{r}.safetensors with one int64 bincount
[num_experts] per "<iteration>_<layer>" key.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import SMALL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from moetrace.errors import MoetraceError, TraceFormatError
from moetrace.tracer.importers import detect_format, import_profile
from moetrace.tracer.trace.profile import open_profile

E, K = SMALL.num_experts, SMALL.top_k
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _stats(d: Path, *, ranks: int = 2, iters=(100, 101, 102), layers=SMALL.moe_layers, seed: int = 0, meta=None):
    d.mkdir()
    (d / "meta_info.json").write_text(json.dumps(meta or {"num_experts": E, "num_experts_per_token": K}))
    g = torch.Generator().manual_seed(seed)
    records = {}
    for r in range(ranks):
        rec = {}
        for it in iters:
            for layer in layers:
                ids = torch.randint(0, E, (30, K), generator=g)
                rec[f"{it}_{layer}"] = torch.bincount(ids.flatten(), minlength=E)
        save_file(rec, str(d / f"rank{r}.safetensors"))
        records[r] = rec
    return d, records


def test_statistics_import_with_windows_per_iteration_and_ranks(tmp_path):
    src, rec = _stats(tmp_path / "stats")
    assert detect_format(src).name == "trtllm-stats"
    prof = import_profile(src, out=tmp_path / "p.parquet", model=SMALL, stages="decode-only")
    assert prof.stages == ("decode",) and prof.num_windows == 3 and prof.num_ranks == 2
    for n, it in enumerate((100, 101, 102)):
        for l, layer in enumerate(SMALL.moe_layers):
            want = sum(rec[r][f"{it}_{layer}"].numpy() for r in (0, 1))
            assert np.array_equal(prof.counts["decode"][n, l], want)
    assert prof.ranks is not None
    assert np.array_equal(prof.ranks["decode"][1, 0], sum(rec[1][f"{it}_1"].numpy() for it in (100, 101, 102)))
    assert open_profile(tmp_path / "p.parquet") == prof
    assert prof.source["iterations"] == [100, 102]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"layers": (0, 1)}, "counts layer 0, which is not a MoE layer"),
        ({"meta": {"num_experts": E + 4, "num_experts_per_token": K}}, "physical slots"),
        ({"meta": {"num_experts": E, "num_experts_per_token": K + 1}}, "top-2"),
    ],
)
def test_statistics_that_do_not_fit_the_model_are_refused(tmp_path, kw, message):
    src, _ = _stats(tmp_path / "stats", **kw)
    with pytest.raises(TraceFormatError, match=message):
        import_profile(src, out=tmp_path / "p.parquet", model=SMALL)


def test_a_missing_rank_file_is_named(tmp_path):
    src, _ = _stats(tmp_path / "stats", ranks=3)
    (src / "rank1.safetensors").unlink()
    with pytest.raises(TraceFormatError, match=r"missing \[1\]"):
        import_profile(src, out=tmp_path / "p.parquet", model=SMALL)


def test_two_files_naming_one_rank_are_refused_not_merged(tmp_path):
    src, _ = _stats(tmp_path / "stats", ranks=2)
    (src / "rank01.safetensors").write_bytes((src / "rank1.safetensors").read_bytes())  # rank1 and rank01
    with pytest.raises(TraceFormatError, match=r"rank01.safetensors and rank1.safetensors both name rank 1"):
        import_profile(src, out=tmp_path / "p.parquet", model=SMALL)
    assert not (tmp_path / "p.parquet").exists()


def test_a_meta_info_with_a_huge_integer_is_one_error(tmp_path):
    src, _ = _stats(tmp_path / "stats")
    (src / "meta_info.json").write_text('{"num_experts": ' + "9" * 4400 + ', "num_experts_per_token": 2}')
    with pytest.raises(TraceFormatError, match="digits"):
        import_profile(src, out=tmp_path / "p.parquet", model=SMALL)


@FUZZ
@given(
    meta=st.binary(max_size=80) | st.just(json.dumps({"num_experts": E, "num_experts_per_token": K}).encode()),
    blob=st.binary(max_size=300),
    head=st.sampled_from([b"", b"\x10\x00\x00\x00\x00\x00\x00\x00", b'\x40\x00\x00\x00\x00\x00\x00\x00{"1_1":']),
)
def test_fuzzed_directories_never_raise_a_traceback(tmp_path_factory, meta, blob, head):
    d = tmp_path_factory.mktemp("f") / "stats"
    d.mkdir()
    (d / "meta_info.json").write_bytes(meta)
    (d / "rank0.safetensors").write_bytes(head + blob)
    try:
        import_profile(d, out=d.parent / "p.parquet", model=SMALL, source_format="trtllm-stats")
    except MoetraceError:
        pass
