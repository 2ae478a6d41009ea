"""Import format ``sglang-stat``: SGLang's expert-distribution stat dumps and logical_count JSON → a load profile.

The fixtures follow SGLang's writer (python/sglang/srt/eplb/expert_distribution.py, _StatAccumulator.dump:
torch.save of {"rank", "logical_count" [passes, layers, experts], "average_utilization_rate_over_window"}).
The logical_count JSON follows SGLang 0.5.23's reader of ``--init-expert-location``
(python/sglang/srt/eplb/expert_location.py, ``compute_initial_expert_location_metadata``: ``json.loads``, then
``ExpertLocationMetadata.init_by_eplb`` takes the list through ``torch.tensor``, so whole numbers written as
floats, as in the DeepSeek-V3 files attached to sgl-project/sglang#6017, load there).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import SMALL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetrace.errors import MoetraceError, TraceFormatError
from moetrace.tracer.importers import detect_format, import_profile
from moetrace.tracer.trace.profile import open_profile

H, E = SMALL.num_hidden_layers, SMALL.num_experts
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _dump(path: Path, logical_count: torch.Tensor) -> Path:
    torch.save({"rank": 0, "logical_count": logical_count, "average_utilization_rate_over_window": 0.8}, path)
    return path


def _counts(num_passes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 40, (num_passes, H, E), dtype=torch.int32, generator=g)
    c[:, [h for h in range(H) if h not in SMALL.moe_layers]] = 0  # dense layers: zero, as SGLang records them
    return c


def test_stat_dump_imports_with_equal_counts(tmp_path):
    c = _counts(4)
    c[2] = 0  # a buffered slot without a pass
    src = _dump(tmp_path / "expert_distribution_recorder_1.pt", c)
    assert detect_format(src).name == "sglang-stat"
    prof = import_profile(src, out=tmp_path / "p.parquet", model=SMALL)
    assert prof.stages == ("mixed",) and prof.num_windows == 3
    want = c.numpy()[[0, 1, 3]][:, list(SMALL.moe_layers)]
    assert np.array_equal(prof.counts["mixed"], want)
    assert open_profile(tmp_path / "p.parquet") == prof
    assert prof.source["source_format"] == "sglang-stat" and prof.source["rank"] == 0


def test_logical_count_json_imports_as_one_window_per_stage_asked(tmp_path):
    c = _counts(1)[0]
    src = tmp_path / "logical_count.json"
    src.write_text(json.dumps({"logical_count": c.tolist()}))
    assert detect_format(src).name == "sglang-stat"
    prof = import_profile(src, out=tmp_path / "p.parquet", model=SMALL, stages="decode-only", dataset="chat")
    assert prof.stages == ("decode",) and prof.num_windows == 1 and prof.dataset_labels == ("chat",)
    assert np.array_equal(prof.total("decode"), c.numpy()[list(SMALL.moe_layers)])
    moe_only = tmp_path / "moe_only.json"  # rows of the MoE layers only
    moe_only.write_text(json.dumps({"logical_count": c.numpy()[list(SMALL.moe_layers)].tolist()}))
    again = import_profile(moe_only, out=tmp_path / "q.parquet", model=SMALL, stages="decode-only")
    assert np.array_equal(again.counts["decode"], prof.counts["decode"])


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        (np.ones((H, E + 1), np.int64), "17 experts per layer"),
        (np.ones((H + 2, E), np.int64), "6 layers"),
        (np.ones((H, E), np.int64), "which model 'small' has dense"),
        (-np.ones((3, E), np.int64), "negative"),
        (np.ones((3, E)) * 0.5, "holds 0.5 at layer 0, expert 0"),
    ],
)
def test_counts_that_do_not_fit_the_model_are_refused(tmp_path, counts, message):
    src = tmp_path / "lc.json"
    src.write_text(json.dumps({"logical_count": counts.tolist()}))
    with pytest.raises(TraceFormatError, match=message):
        import_profile(src, out=tmp_path / "p.parquet", model=SMALL)
    assert not (tmp_path / "p.parquet").exists()


def test_pt_files_load_without_pickle(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    src = tmp_path / "evil.pt"
    torch.save({"logical_count": _counts(1), "x": Evil()}, src)
    with pytest.raises(TraceFormatError, match="weights_only"):
        import_profile(src, out=tmp_path / "p.parquet", model=SMALL, source_format="sglang-stat")


@FUZZ
@given(
    body=st.one_of(
        st.binary(max_size=200),
        st.recursive(
            st.one_of(st.none(), st.booleans(), st.integers(-5, 10**20), st.floats(), st.text(max_size=5)),
            lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.just("logical_count"), inner, max_size=1),
            max_leaves=30,
        ).map(lambda v: json.dumps({"logical_count": v}).encode()),
    )
)
def test_fuzzed_inputs_never_raise_a_traceback(tmp_path_factory, body):
    d = tmp_path_factory.mktemp("f")
    src = d / "in.json"
    src.write_bytes(body)
    try:
        import_profile(src, out=d / "p.parquet", model=SMALL, source_format="sglang-stat")
    except MoetraceError:
        pass


DSV3 = "deepseek-v3-tiny"  # 61 decoder layers (3 dense), 256 experts: the shape of SGLang's published files


def test_sglang_0_5_23_published_logical_count_with_whole_floats_imports(tmp_path):
    """SGLang 0.5.23's ``--init-expert-location`` reader takes ``{"logical_count": [61][256]}`` of floats such as
    ``807392.0`` (the DeepSeek-V3 files attached to sgl-project/sglang#6017): they import, exactly as the ints."""
    from moetrace.tracer.presets import model_info_for

    info = model_info_for(DSV3)
    rng = np.random.default_rng(6017)
    c = rng.integers(0, 2_000_000, (info.num_hidden_layers, info.num_experts)).astype(np.float64)
    c[[h for h in range(info.num_hidden_layers) if h not in info.moe_layers]] = 0.0
    c[5, 7] = 807392.0
    src = tmp_path / "logical_count_decode.json"
    src.write_text(json.dumps({"logical_count": c.tolist()}))  # written as floats: "807392.0", "0.0"
    assert "807392.0" in src.read_text()
    assert detect_format(src).name == "sglang-stat"
    prof = import_profile(src, out=tmp_path / "p.parquet", model=info, stages="decode-only")
    want = c.astype(np.int64)[list(info.moe_layers)]
    assert prof.counts["decode"].dtype == np.int64 and np.array_equal(prof.counts["decode"][0], want)
    ints = tmp_path / "ints.json"
    ints.write_text(json.dumps({"logical_count": c.astype(np.int64).tolist()}))
    again = import_profile(ints, out=tmp_path / "q.parquet", model=info, stages="decode-only")
    assert np.array_equal(again.counts["decode"], prof.counts["decode"])


@pytest.mark.parametrize(
    ("value", "shape", "at", "shown"),
    [
        (12.5, (H, E), (1, 3), "holds 12.5 at layer 1, expert 3"),
        (float("nan"), (H, E), (3, 0), "holds nan at layer 3, expert 0"),
        (7.25, (2, H, E), (1, 3, 15), "holds 7.25 at pass 1, layer 3, expert 15"),
    ],
)
def test_a_fractional_count_is_refused_naming_the_value_and_where(tmp_path, value, shape, at, shown):
    c = np.zeros(shape)
    c[(..., 1, slice(None))] = 3.0  # an MoE layer with whole float counts
    c[at] = value
    src = tmp_path / "lc.json"
    src.write_text(json.dumps({"logical_count": c.tolist()}))  # json writes NaN for nan, as Python's json does
    with pytest.raises(TraceFormatError, match=re.escape(shown) + ".*not a whole token count"):
        import_profile(src, out=tmp_path / "p.parquet", model=SMALL)
    assert not (tmp_path / "p.parquet").exists()


def test_a_float_stat_dump_imports_when_whole(tmp_path):
    """A ``.pt`` holding float counts (a dump re-saved by hand) is read like the JSON: whole floats only."""
    c = _counts(2).to(torch.float32)
    src = _dump(tmp_path / "expert_distribution_recorder_2.pt", c)
    prof = import_profile(src, out=tmp_path / "p.parquet", model=SMALL)
    assert np.array_equal(prof.counts["mixed"], c.numpy().astype(np.int64)[:, list(SMALL.moe_layers)])
    c[1, SMALL.moe_layers[0], 2] = 0.5
    bad = _dump(tmp_path / "expert_distribution_recorder_3.pt", c)
    with pytest.raises(TraceFormatError, match=f"holds 0.5 at pass 1, layer {SMALL.moe_layers[0]}, expert 2"):
        import_profile(bad, out=tmp_path / "q.parquet", model=SMALL)
