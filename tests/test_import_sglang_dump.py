"""``sglang-dump``: SGLang's expert-distribution recorder ``per_token`` dumps, built to the layout its writer uses
(``python/sglang/srt/eplb/expert_distribution.py``, commit 02295fe5ac5c: ``_DetailSinglePassGatherer.collect`` and
``_DetailAccumulator.dump``): ``torch.save({"records": [...], "last_physical_to_logical_map": [layers, slots]})``.
The record's fields are the same in SGLang 0.5.23 (the PyPI release, same file), which the DP-attention test cites."""

from __future__ import annotations

import io
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import save_expert_dump
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import TraceFormatError
from moetrace.tracer.importers import detect_format, import_trace
from moetrace.tracer.presets import model_info_for
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.validate import find_problems

DSV3 = model_info_for("deepseek-v3-tiny")  # dense first layer(s), group-limited router, top-8
OLMOE = model_info_for("olmoe-1b-7b-tiny")  # all 16 layers MoE, 64 experts, top-8
runner = CliRunner()


def logical_tokens(n: int, info, seed: int) -> np.ndarray:
    """Top-k ids as the model's router picks them (a group-limited router: from at most topk_group groups)."""
    rng = np.random.default_rng(seed)
    G, TG = info.n_group or 1, info.topk_group or 1
    size = info.num_experts // G

    def one() -> np.ndarray:
        groups = rng.choice(G, TG, replace=False)
        pool = np.concatenate([np.arange(g * size, (g + 1) * size) for g in groups])
        return rng.choice(pool, info.top_k, replace=False)

    return np.stack([np.stack([one() for _ in info.moe_layers]) for _ in range(n)])


def phy2log_of(info, redundant: int, seed: int) -> np.ndarray:
    """SGLang's physical_to_logical_map over all its layers (num_layers = all decoder layers)."""
    rng = np.random.default_rng(seed)
    E = info.num_experts
    return np.stack(
        [np.concatenate([rng.permutation(E), rng.choice(E, redundant)]) for _ in range(info.num_hidden_layers)]
    )


def record(fid: int, rank: int, mode: int, logical_NLK: np.ndarray, info, map_HP: np.ndarray) -> dict:
    """One pass as ``_DetailAccumulator.append`` stores it: physical ids [num_layers, tokens, 8], -1 elsewhere."""
    N = len(logical_NLK)
    H = info.num_hidden_layers
    slot_of = np.argsort(map_HP[:, : info.num_experts], axis=1)  # one physical slot per logical expert
    ids = np.full((H, N, 8), -1, dtype=np.int32)
    for i, layer in enumerate(info.moe_layers):
        ids[layer, :, : info.top_k] = slot_of[layer][logical_NLK[:, i]]
    return {
        "forward_pass_id": fid,
        "rank": rank,
        "gatherer_key": "primary",
        "input_ids": list(range(100, 100 + N)),
        "positions": list(range(N)),
        "extend_seq_lens": [N] if mode == 1 else None,
        "forward_mode": mode,
        "topk_ids_of_layer": torch.from_numpy(ids),
        "misc_objects": [],
        "global_physical_count": torch.zeros((H, map_HP.shape[1]), dtype=torch.int32),
    }


def test_per_token_dump_imports_logical_ids_one_request_per_pass(tmp_path):
    mp = phy2log_of(DSV3, redundant=4, seed=0)
    truths = [logical_tokens(n, DSV3, s) for s, n in enumerate((5, 3, 3))]
    records = [
        record(0, 0, 1, truths[0], DSV3, mp),  # extend: a prompt of 5 tokens
        record(1, 0, 4, truths[0][:0], DSV3, mp),  # idle: skipped
        record(2, 0, 2, truths[1], DSV3, mp),  # decode: 3 requests' one token each
        record(3, 0, 3, truths[2], DSV3, mp),  # mixed: counted as prefill
    ]
    src = save_expert_dump(tmp_path / "expert_distribution_recorder_1700000000.0_0.pt", records, mp)
    assert detect_format(src).name == "sglang-dump"
    res = runner.invoke(app, ["import", str(src), "-m", "deepseek-v3-tiny", "-o", str(tmp_path / "t")])
    assert res.exit_code == 0, res.output
    assert "each forward pass of each rank is one request" in res.output and "1 mixed pass" in res.output
    assert find_problems(tmp_path / "t") == []
    tr = open_trace(tmp_path / "t")
    coll = tr.manifest["collection"]
    assert coll["request_unit"] == "forward pass" and coll["stages"] == ["prefill", "decode"]
    assert coll["prompt_lengths_known"] is False and coll["source_ranks"] == [0]
    req = tr.requests().collect().sort("request_id")
    assert req["prompt_tokens"].to_list() == [5, 1, 3] and req["output_tokens"].to_list() == [0, 3, 0]
    ids = tr.token_arrays().topk_ids_TLK
    np.testing.assert_array_equal(ids[:5], truths[0])
    assert (ids[5] == -1).all()  # the decode pass's unrecorded prompt row
    np.testing.assert_array_equal(ids[6:9], truths[1])
    np.testing.assert_array_equal(ids[9:], truths[2])


def test_a_user_map_takes_precedence_and_a_directory_of_ranks_merges(tmp_path):
    mp = phy2log_of(OLMOE, redundant=0, seed=1)
    other = phy2log_of(OLMOE, redundant=0, seed=2)
    a, b = logical_tokens(4, OLMOE, 3), logical_tokens(2, OLMOE, 4)
    d = tmp_path / "dumps"
    d.mkdir()
    save_expert_dump(
        d / "expert_distribution_recorder_1.0_0.pt", [record(0, 0, 1, a, OLMOE, mp)], other
    )  # stale map inside
    r1 = record(0, 1, 1, b, OLMOE, mp)
    save_expert_dump(d / "expert_distribution_recorder_1.0_1.pt", [r1], other)
    (tmp_path / "map.json").write_text('{"physical_to_logical_map": ' + str(mp.tolist()) + "}")
    import_trace(d, out=tmp_path / "t", model=OLMOE, options=_opts(physical_map=tmp_path / "map.json"))
    ids = open_trace(tmp_path / "t").token_arrays().topk_ids_TLK
    np.testing.assert_array_equal(ids, np.concatenate([a, b]))
    # tensor parallelism without DP attention: every rank records the same pass
    save_expert_dump(d / "expert_distribution_recorder_1.0_1.pt", [record(0, 1, 1, a, OLMOE, mp)], other)
    with pytest.raises(TraceFormatError, match="the same pass as .*import one rank's file"):
        import_trace(d, out=tmp_path / "t2", model=OLMOE)


def test_sglang_0_5_23_dp_attention_ranks_decoding_the_same_token_are_not_tp_copies(tmp_path):
    """Two DP-attention ranks (``--enable-dp-attention``: each runs its own requests, in lockstep, so their
    records share ``forward_pass_id``), each decoding one request, emit the same token in a pass: the records'
    ``input_ids`` are equal, their routed experts are not (and here their positions are equal too). Records as
    SGLang 0.5.23's ``_DetailSinglePassGatherer.on_forward_pass_start`` / ``collect`` and
    ``_DetailAccumulator.append`` write them (``rids`` commented out there): they import as two ranks' passes."""
    mp = phy2log_of(OLMOE, redundant=0, seed=7)
    d = tmp_path / "dp2"
    d.mkdir()
    truths = {}
    for rank in (0, 1):
        recs = []
        for fid, (mode, n, token, pos) in enumerate([(1, 5, None, None), (2, 1, 42, 9), (2, 1, 7, 10 + 3 * rank)]):
            truths[rank, fid] = logical_tokens(n, OLMOE, seed=10 * rank + fid)
            rec = record(fid, rank, mode, truths[rank, fid], OLMOE, mp)
            if token is not None:  # a decode pass: the token the request emitted last, at its position
                rec.update(input_ids=[token], positions=[pos], extend_seq_lens=None)
            else:
                rec.update(input_ids=[200 + 5 * rank + t for t in range(n)])
            recs.append(rec)
        save_expert_dump(d / f"expert_distribution_recorder_1700000000.0_{rank}.pt", recs, mp)
    tr_dir = tmp_path / "t"
    import_trace(d, out=tr_dir, model=OLMOE)
    assert find_problems(tr_dir) == []
    tr = open_trace(tr_dir)
    assert tr.manifest["collection"]["source_ranks"] == [0, 1]
    ids = tr.token_arrays().topk_ids_TLK
    want = []
    for rank in (0, 1):  # files in rank order; a decode pass is one unrecorded prompt row, then its token
        for fid in range(3):
            if fid:
                want.append(np.full((1, OLMOE.num_moe_layers, OLMOE.top_k), -1))
            want.append(truths[rank, fid])
    np.testing.assert_array_equal(ids, np.concatenate(want))


def _opts(**kw):
    from moetrace.tracer.importers import ImportOptions

    return ImportOptions(**kw)


def _bad_dump(tmp_path: Path, change) -> Path:
    mp = phy2log_of(OLMOE, redundant=2, seed=5)
    rec = record(0, 0, 1, logical_tokens(3, OLMOE, 6), OLMOE, mp)
    obj = {"records": [rec], "last_physical_to_logical_map": torch.from_numpy(mp)}
    change(obj, rec)
    path = tmp_path / "expert_distribution_recorder_9.0_0.pt"
    torch.save(obj, path)
    return path


HOSTILE = {
    "a per_pass dump": (
        lambda o, r: o.update(records=[{k: v for k, v in r.items() if k != "topk_ids_of_layer"}]),
        "a per_pass dump.*--format sglang-pass",
    ),
    "ids from a model with more layers": (
        lambda o, r: r.update(topk_ids_of_layer=torch.zeros((40, 3, 8), dtype=torch.int32)),
        "40 layers recorded; olmoe-1b-7b-tiny has 16 layers",
    ),
    "speculative decoding passes": (lambda o, r: r.update(forward_mode=5), "forward mode 5 .*speculative"),
    "a slot beyond the map": (
        lambda o, r: r["topk_ids_of_layer"].__setitem__((0, 0, 0), 500),
        r"record 0 \(forward pass 0\), token 0, layer 0: physical id 500 outside the map's 0..65",
    ),
    "complex-typed ids": (
        lambda o, r: r.update(topk_ids_of_layer=r["topk_ids_of_layer"].to(torch.complex64)),
        "must be an integer tensor",
    ),
    "no map anywhere": (lambda o, r: o.pop("last_physical_to_logical_map"), "pass --physical-map FILE"),
    "a map that misses an expert": (
        lambda o, r: o["last_physical_to_logical_map"].fill_(0),
        "does not hold every one of the 64 logical experts",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_dumps_are_one_clean_message(tmp_path, case):
    change, match = HOSTILE[case]
    src = _bad_dump(tmp_path, change)
    res = runner.invoke(app, ["import", str(src), "-m", "olmoe-1b-7b-tiny", "-o", str(tmp_path / "t")])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
    import re

    assert re.search(match, res.output.replace("\n", " ")), res.output
    assert not (tmp_path / "t").exists()


def test_a_pickle_with_code_is_never_run(tmp_path):
    """weights_only=True: a dump whose pickle would call a function is refused, and the function never runs."""
    import pickle

    class Boom:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "ran",))

    buf = io.BytesIO()
    torch.save({"records": []}, buf)
    src = tmp_path / "expert_distribution_recorder_1.0_0.pt"
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(src, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith("data.pkl"):
                data = pickle.dumps(
                    {"records": [{"forward_pass_id": 0, "gatherer_key": "p", "input_ids": Boom()}]}, protocol=2
                )
            zout.writestr(item, data)
    res = runner.invoke(app, ["import", str(src), "-m", "olmoe-1b-7b-tiny", "-o", str(tmp_path / "t")])
    assert res.exit_code == 2 and "weights_only=True" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "ran").exists()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mode=st.integers(0, 6),
    ids=st.lists(st.integers(-3, 80), min_size=1, max_size=16 * 2 * 8),
    tokens=st.integers(0, 3),
    layers=st.sampled_from([16, 15, 1]),
    cols=st.sampled_from([8, 4]),
    fid=st.one_of(st.integers(0, 3), st.just("x"), st.none()),
)
def test_fuzz_dumps_never_a_traceback(tmp_path, mode, ids, tokens, layers, cols, fid):
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        mp = phy2log_of(OLMOE, redundant=2, seed=0)
        arr = np.resize(np.array(ids, dtype=np.int32), layers * tokens * cols).reshape(layers, tokens, cols)
        rec = {
            "forward_pass_id": fid,
            "rank": 0,
            "gatherer_key": "primary",
            "input_ids": list(range(tokens)),
            "forward_mode": mode,
            "topk_ids_of_layer": torch.from_numpy(arr),
        }
        src = save_expert_dump(d / "expert_distribution_recorder_1.0_0.pt", [rec], mp)
        res = runner.invoke(app, ["import", str(src), "-m", "olmoe-1b-7b-tiny", "-o", str(d / "t")])
        assert res.exit_code in (0, 2), res.output
        assert "Traceback" not in res.output
        if res.exit_code == 0:
            assert find_problems(d / "t") == []
    finally:
        shutil.rmtree(d)
