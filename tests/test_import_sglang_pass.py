"""``sglang-pass``: SGLang's expert-distribution recorder ``per_pass`` dumps → a load profile.

The fixtures follow SGLang's writer (``python/sglang/srt/eplb/expert_distribution.py``, commit 02295fe5ac5c:
``_SelectExpertsSinglePassGatherer.on_select_experts``/``collect`` and ``_DetailAccumulator.append``/``dump``):
each rank writes ``torch.save({"records": [{"forward_pass_id", "rank", "gatherer_key", "global_physical_count"}],
"last_physical_to_logical_map": [layers, slots]})`` as ``expert_distribution_recorder_{time}_{rank}.pt``, the count
an int32 ``[num_layers, physical slots]`` scatter-add of the physical ids the rank's tokens were routed to.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import SMALL, save_expert_dump
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import MoetraceError, TraceFormatError
from moetrace.tracer.importers import ImportOptions, detect_format, import_profile, import_trace
from moetrace.tracer.importers.sglang_pass import physical_to_logical_counts
from moetrace.tracer.trace.profile import open_profile

H, E, K = SMALL.num_hidden_layers, SMALL.num_experts, SMALL.top_k  # 4 layers (0 dense), 16 experts, top-2
runner = CliRunner()
#: a non-identity map over all 4 layers with 2 redundant slots per layer: slots 16 and 17 replicate experts
MAP_HP = np.stack([np.concatenate([np.roll(np.arange(E)[::-1], h), [(3 * h) % E, (5 + h) % E]]) for h in range(H)])
P = MAP_HP.shape[1]


def route(num_tokens: int, seed: int, info=SMALL, map_HP: np.ndarray = MAP_HP):
    """(logical ids [tokens, MoE layers, K], physical ids [num_layers, tokens, K]) as a router then SGLang's
    dispatch picks them: K distinct experts per token, each sent to one of its replicas at random."""
    rng = np.random.default_rng(seed)
    L, Ek, Kk = info.num_moe_layers, info.num_experts, info.top_k
    logical = np.array(
        [[rng.choice(Ek, Kk, replace=False) for _ in range(L)] for _ in range(num_tokens)], dtype=np.int64
    ).reshape(num_tokens, L, Kk)
    phys = np.full((info.num_hidden_layers, num_tokens, Kk), -1, dtype=np.int64)
    for i, layer in enumerate(info.moe_layers):
        for t in range(num_tokens):
            for k in range(Kk):
                phys[layer, t, k] = rng.choice(np.flatnonzero(map_HP[layer] == logical[t, i, k]))
    return logical, phys


def gpc(phys_HTK: np.ndarray, num_slots: int = P) -> torch.Tensor:
    """``global_physical_count`` as ``_SelectExpertsSinglePassGatherer`` accumulates it: int32 [num_layers, slots]."""
    out = np.zeros((phys_HTK.shape[0], num_slots), dtype=np.int32)
    for h in range(phys_HTK.shape[0]):
        ids = phys_HTK[h].reshape(-1)
        np.add.at(out[h], ids[ids >= 0], 1)
    return torch.from_numpy(out)


def rec(fid: int, rank: int, count: torch.Tensor) -> dict:
    return {"forward_pass_id": fid, "rank": rank, "gatherer_key": "primary", "global_physical_count": count}


def save(path: Path, records: list[dict], map_HP: np.ndarray | None = MAP_HP) -> Path:
    return save_expert_dump(path, records, map_HP)


def logical_LE(logical_TLK: np.ndarray) -> np.ndarray:
    """The hand count: tokens per logical expert of each MoE layer."""
    return np.stack([np.bincount(logical_TLK[:, i].reshape(-1), minlength=E) for i in range(logical_TLK.shape[1])])


def two_rank_dumps(d: Path) -> dict[tuple[int, int], np.ndarray]:
    """Rank 0 and 1 each record passes 0..3 (rank 1 idle in pass 1, both idle in pass 3; rank 0 writes its
    records out of order); returns the hand counts [L, E] per (pass, rank)."""
    d.mkdir(exist_ok=True)
    tokens = {(0, 0): 5, (1, 0): 3, (2, 0): 2, (3, 0): 0, (0, 1): 4, (1, 1): 0, (2, 1): 6, (3, 1): 0}
    want, recs = {}, {0: [], 1: []}
    for (fid, rank), n in tokens.items():
        logical, phys = route(n, seed=10 * fid + rank)
        want[(fid, rank)] = logical_LE(logical)
        recs[rank].append(rec(fid, rank, gpc(phys)))
    save(d / "expert_distribution_recorder_1700000000.5_0.pt", [recs[0][i] for i in (2, 0, 3, 1)])
    save(d / "expert_distribution_recorder_1700000000.5_1.pt", recs[1])
    return want


def test_per_pass_dumps_import_logical_counts_per_pass_and_rank(tmp_path):
    want = two_rank_dumps(tmp_path / "dumps")
    assert detect_format(tmp_path / "dumps").name == "sglang-pass"
    assert detect_format(next((tmp_path / "dumps").iterdir())).name == "sglang-pass"
    prof = import_profile(tmp_path / "dumps", out=tmp_path / "p.parquet", model=SMALL)
    assert prof.stages == ("mixed",) and prof.num_windows == 3  # pass 3 counted nothing: left out
    for n, fid in enumerate((0, 1, 2)):
        np.testing.assert_array_equal(prof.counts["mixed"][n], want[(fid, 0)] + want[(fid, 1)])
    assert prof.num_ranks == 2
    for rank in (0, 1):
        np.testing.assert_array_equal(prof.ranks["mixed"][rank], sum(want[(fid, rank)] for fid in range(4)))
    assert prof.window_tokens is not None and prof.window_tokens.unit == "forward_passes"
    assert prof.source["source_format"] == "sglang-pass" and prof.source["source_ranks"] == [0, 1]
    assert prof.source["forward_passes"] == 4 and prof.source["forward_passes_with_counts"] == 3
    assert open_profile(tmp_path / "p.parquet") == prof


def test_one_rank_file_prefill_only_and_a_dataset(tmp_path):
    want = two_rank_dumps(tmp_path / "dumps")
    one = tmp_path / "dumps" / "expert_distribution_recorder_1700000000.5_1.pt"
    prof = import_profile(one, out=tmp_path / "p.parquet", model=SMALL, stages="prefill-only", dataset="chat")
    assert prof.stages == ("prefill",) and prof.num_windows == 2  # rank 1 counted in passes 0 and 2
    np.testing.assert_array_equal(prof.counts["prefill"][1], want[(2, 1)])
    assert prof.ranks is None and prof.source["source_ranks"] == [1]  # ranks 0..W-1 not all there
    assert prof.dataset_labels == ("chat",)


def test_the_users_map_takes_precedence_over_the_dumps(tmp_path):
    logical, phys = route(7, seed=3)
    stale = np.stack([np.concatenate([np.arange(E), [0, 1]]) for _ in range(H)])
    src = save(tmp_path / "expert_distribution_recorder_1.0_0.pt", [rec(0, 0, gpc(phys))], stale)
    (tmp_path / "map.json").write_text(json.dumps({"physical_to_logical_map": MAP_HP.tolist()}))
    opts = ImportOptions(physical_map=tmp_path / "map.json")
    prof = import_profile(src, out=tmp_path / "p.parquet", model=SMALL, options=opts)
    np.testing.assert_array_equal(prof.total("mixed"), logical_LE(logical))
    assert prof.source["physical_map"] == "map.json"
    stale_prof = import_profile(src, out=tmp_path / "q.parquet", model=SMALL)
    assert not np.array_equal(stale_prof.total("mixed"), logical_LE(logical))


def test_physical_to_logical_counts_sums_replicas():
    map_LP = np.array([[2, 0, 1, 2], [0, 1, 2, 0]])
    c_NLP = np.array([[[1, 2, 3, 4], [5, 6, 7, 8]]])
    np.testing.assert_array_equal(physical_to_logical_counts(c_NLP, map_LP, 3), [[[2, 3, 5], [13, 6, 7]]])


def test_tensor_parallel_ranks_counting_the_same_tokens_are_refused(tmp_path):
    _, phys = route(4, seed=1)
    d = tmp_path / "dumps"
    d.mkdir()
    save(d / "expert_distribution_recorder_1.0_0.pt", [rec(0, 0, gpc(phys))])
    save(d / "expert_distribution_recorder_1.0_1.pt", [rec(0, 1, gpc(phys))])
    with pytest.raises(TraceFormatError, match="counted the same tokens in every forward pass.*one rank's file"):
        import_profile(d, out=tmp_path / "p.parquet", model=SMALL)
    assert not (tmp_path / "p.parquet").exists()


def test_more_passes_than_a_profile_holds_are_refused_while_reading(tmp_path, monkeypatch):
    from moetrace.tracer.trace import profile

    two_rank_dumps(tmp_path / "dumps")
    monkeypatch.setattr(profile, "MAX_CELLS", 2 * SMALL.num_moe_layers * E)  # room for two passes
    with pytest.raises(TraceFormatError, match="more than 2 forward passes x 3 layers x 16 experts"):
        import_profile(tmp_path / "dumps", out=tmp_path / "p.parquet", model=SMALL)


def _bad(tmp_path: Path, change) -> Path:
    _, phys = route(3, seed=2)
    r = rec(0, 0, gpc(phys))
    obj = {"records": [r], "last_physical_to_logical_map": torch.from_numpy(MAP_HP.copy())}
    change(obj, r)
    path = tmp_path / "expert_distribution_recorder_9.0_0.pt"
    torch.save(obj, path)
    return path


HOSTILE = {
    "counts at a dense layer": (
        lambda o, r: r["global_physical_count"].__setitem__((0, 0), 3),
        "layer 0, which is dense",
    ),
    "more slots than the map": (
        lambda o, r: r.update(global_physical_count=torch.zeros((H, P + 1), dtype=torch.int32)),
        f"{P + 1} physical slots counted, the physical-to-logical map has {P}",
    ),
    "a model with more layers": (
        lambda o, r: r.update(global_physical_count=torch.ones((9, P), dtype=torch.int32)),
        "9 layers counted",
    ),
    "float counts": (lambda o, r: r.update(global_physical_count=torch.ones((H, P))), "must be an integer tensor"),
    "a negative count": (lambda o, r: r["global_physical_count"].__setitem__((1, 0), -2), "a negative count"),
    "no map anywhere": (lambda o, r: o.pop("last_physical_to_logical_map"), "pass --physical-map FILE"),
    "a pass recorded twice": (lambda o, r: o["records"].append(dict(r)), "recorded forward pass 0 twice"),
    "a rank that is text": (lambda o, r: r.update(rank="0"), "`rank` must be a whole number"),
    "no pass counted anything": (lambda o, r: r["global_physical_count"].zero_(), "every count is zero"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_bad_dumps_are_one_clean_message(tmp_path, case):
    change, match = HOSTILE[case]
    src = _bad(tmp_path, change)
    with pytest.raises(TraceFormatError, match=re.escape(match) if "(" in match else match):
        import_profile(src, out=tmp_path / "p.parquet", model=SMALL, source_format="sglang-pass")
    assert not (tmp_path / "p.parquet").exists()


def test_the_other_sglang_dump_format_points_to_this_one(tmp_path):
    src = save(tmp_path / "expert_distribution_recorder_1.0_0.pt", [rec(0, 0, gpc(route(2, seed=0)[1]))])
    with pytest.raises(TraceFormatError, match="a per_pass dump.*--format sglang-pass"):
        import_trace(src, out=tmp_path / "t", model=SMALL, source_format="sglang-dump")
    per_token = dict(rec(0, 0, gpc(route(2, seed=0)[1])), input_ids=[1, 2], topk_ids_of_layer=torch.zeros((H, 2, 8)))
    src2 = save(tmp_path / "expert_distribution_recorder_2.0_0.pt", [per_token])
    assert detect_format(src2).name == "sglang-dump"
    with pytest.raises(TraceFormatError, match="a per_token dump.*--format sglang-dump"):
        import_profile(src2, out=tmp_path / "p.parquet", model=SMALL, source_format="sglang-pass")


def test_a_pickle_with_code_is_never_run(tmp_path):
    """weights_only=True: a dump whose pickle would call a function is refused, and the function never runs."""

    class Boom:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "ran",))

    buf = io.BytesIO()
    torch.save({"records": []}, buf)
    d = tmp_path / "dumps"
    d.mkdir()
    src = d / "expert_distribution_recorder_1.0_0.pt"
    hostile = {"records": [{"forward_pass_id": 0, "gatherer_key": "p", "global_physical_count": Boom()}]}
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(src, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith("data.pkl"):
                data = pickle.dumps(hostile, protocol=2)
            zout.writestr(item, data)
    assert detect_format(d).name == "sglang-pass"
    res = runner.invoke(app, ["import", str(d), "-m", "olmoe-1b-7b-tiny", "-o", str(tmp_path / "p.parquet")])
    assert res.exit_code == 2 and "weights_only=True" in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "ran").exists() and not (tmp_path / "p.parquet").exists()


def test_cli_imports_a_directory_and_info_reads_the_profile(tmp_path):
    from moetrace.tracer.presets import model_info_for

    olmoe = model_info_for("olmoe-1b-7b-tiny")  # 16 layers, all MoE, 64 experts, top-8
    map_HP = np.stack([np.concatenate([np.random.default_rng(h).permutation(64), [h, 63 - h]]) for h in range(16)])
    d = tmp_path / "dumps"
    d.mkdir()
    want = np.zeros((16, 64), np.int64)
    for rank in (0, 1):
        records = []
        for fid in range(3):
            logical, phys = route(2 + fid + rank, seed=fid * 7 + rank, info=olmoe, map_HP=map_HP)
            want += np.stack([np.bincount(logical[:, i].reshape(-1), minlength=64) for i in range(16)])
            records.append(rec(fid, rank, gpc(phys, num_slots=66)))
        save(d / f"expert_distribution_recorder_5.0_{rank}.pt", records, map_HP)
    out = tmp_path / "p.parquet"
    res = runner.invoke(app, ["import", str(d), "-m", "olmoe-1b-7b-tiny", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "load profile (sglang-pass" in res.output and "3 window(s)" in res.output
    np.testing.assert_array_equal(open_profile(out).total("mixed"), want)
    info = runner.invoke(app, ["info", str(out)])
    assert info.exit_code == 0, info.output
    assert "ranks      2" in info.output and "windows    3 of 1 forward_passes" in info.output
    assert f"{int(want.sum()):,}" in info.output
    # the map option reaches this profile format, and other profile formats refuse it by name
    (tmp_path / "map.json").write_text(json.dumps({"physical_to_logical_map": map_HP.tolist()}))
    again = ["import", str(d), "-m", "olmoe-1b-7b-tiny", "-o", str(out), "--overwrite"]
    res = runner.invoke(app, [*again, "--physical-map", str(tmp_path / "map.json")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, [*again, "--format", "sglang-stat", "--physical-map", str(tmp_path / "map.json")])
    assert res.exit_code == 2 and "--physical-map does not apply to --format sglang-stat" in res.output, res.output


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
#: ways to break a valid dump (applied to its first record or the whole object): each must be one clean refusal
BREAKS = {
    "a negative count": lambda o, r: r.update(global_physical_count=torch.full((H, P), -1, dtype=torch.int32)),
    "counts at the dense layer": lambda o, r: r.update(global_physical_count=torch.ones((H, P), dtype=torch.int32)),
    "more layers": lambda o, r: r.update(global_physical_count=torch.ones((H + 5, P), dtype=torch.int32)),
    "another slot count": lambda o, r: r.update(global_physical_count=torch.ones((H, P + 1), dtype=torch.int32)),
    "float counts": lambda o, r: r.update(global_physical_count=r["global_physical_count"].float()),
    "bool counts": lambda o, r: r.update(global_physical_count=r["global_physical_count"] > 0),
    "1-d counts": lambda o, r: r.update(global_physical_count=r["global_physical_count"].reshape(-1)),
    "a text pass id": lambda o, r: r.update(forward_pass_id="0"),
    "no pass id": lambda o, r: r.pop("forward_pass_id"),
    "a bool rank": lambda o, r: r.update(rank=True),
    "a negative rank": lambda o, r: r.update(rank=-1),
    "no map": lambda o, r: o.pop("last_physical_to_logical_map"),
    "a short map": lambda o, r: o.update(last_physical_to_logical_map=torch.zeros((H, E - 1), dtype=torch.int64)),
    "a float map": lambda o, r: o.update(last_physical_to_logical_map=torch.from_numpy(MAP_HP).float()),
    "records not a list": lambda o, r: o.update(records={"0": r}),
    "a record not a dict": lambda o, r: o["records"].append([1, 2]),
    "not a dict": lambda o, r: o.update(records=None),
}


@FUZZ
@given(
    values=st.lists(st.integers(0, 50), min_size=1, max_size=4 * 20),
    dtype=st.sampled_from([torch.int32, torch.int64, torch.uint8]),
    moe_rows_only=st.booleans(),
    records=st.integers(1, 3),
    breaks=st.sets(st.sampled_from(sorted(BREAKS)), max_size=2),
)
def test_fuzz_dumps_import_or_are_refused_never_a_traceback(tmp_path, values, dtype, moe_rows_only, records, breaks):
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        arr = np.resize(np.array(values), H * P).reshape(H, P)
        arr[0] = 0  # the dense layer
        count = torch.from_numpy(arr[1:] if moe_rows_only else arr).to(dtype)
        recs = [rec(fid, 0, count.clone()) for fid in range(records)]
        obj: dict = {"records": recs, "last_physical_to_logical_map": torch.from_numpy(MAP_HP)}
        for b in sorted(breaks):
            BREAKS[b](obj, recs[0])
        src = d / "expert_distribution_recorder_1.0_0.pt"
        torch.save(obj, src)
        try:
            prof = import_profile(src, out=d / "p.parquet", model=SMALL, source_format="sglang-pass")
        except MoetraceError as exc:
            assert not (d / "p.parquet").exists()
            assert breaks or not arr.any(), exc
            event("refused")
        else:
            assert not breaks
            assert int(prof.total("mixed").sum()) == records * int(arr.sum())
            assert open_profile(d / "p.parquet") == prof
            event("imported")
    finally:
        shutil.rmtree(d)
