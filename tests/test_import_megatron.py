"""``megatron-router``: Megatron-Core router traces, built to the layout its writer uses
(``megatron/core/transformer/moe/router_trace.py``, tag core_v0.19.0: ``RouterTracer._make_index_record`` and
``_flush_records_to_disk``): one ``router_trace_rank{N}.jsonl`` per rank, one line per (step, block, layer).

Inference traces (same tag): ``TextGenerationController`` (``megatron/core/inference/text_generation_controllers/
text_generation_controller.py``) passes the engine's recorded indices to ``RouterTracer.record_indices`` with
``layer_ids`` = each ``RouterReplay``'s ``layer_number`` (``TransformerLayer.layer_number``, numbered from 1:
``transformer_block.py`` builds layer ``i`` with ``layer_number=i + 1``) and calls ``advance_step()`` after each
forward pass; the training hooks write the ``decoder.layers`` index, numbered from 0."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from factories import write_jsonl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import TraceFormatError
from moetrace.tracer.importers import detect_format, import_trace
from moetrace.tracer.presets import model_info_for
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.validate import find_problems

MIXTRAL = model_info_for("mixtral-8x7b-tiny")  # 32 layers, all MoE, 8 experts, top-2
runner = CliRunner()


def ids(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack(
        [np.stack([rng.choice(8, 2, replace=False) for _ in MIXTRAL.moe_layers]) for _ in range(n)]
    )  # [N, L, K]


def lines(step: int, rank: int, pass_NLK: np.ndarray, *, mtp: bool = False, base: int = 0, info=MIXTRAL) -> list[dict]:
    """The records of one pass in ``_make_index_record``'s key order, ``top_indices`` last as the flush adds it;
    ``base=1``: ``layer`` is ``layer_number``, as ``record_indices`` writes it from the inference engine."""
    out = [
        {
            "step": step,
            "stage": "pre_dispatch",
            "block": "decoder",
            "layer": layer + base,
            "rank": rank,
            "num_tokens": len(pass_NLK),
            "topk": info.top_k,
            "top_indices": pass_NLK[:, i].tolist(),
        }
        for i, layer in enumerate(info.moe_layers)
    ]
    if mtp:  # a multi-token-prediction head's record: not a layer of the model
        out.append({**out[0], "block": "mtp", "mtp_idx": 0, "layer": 0})
    return out


def test_rank_files_merge_by_step_one_request_per_pass(tmp_path):
    d = tmp_path / "trace"
    d.mkdir()
    p = {(s, r, m): ids(3 + s + r + m, 10 * s + r + 5 * m) for s in range(2) for r in range(2) for m in range(2)}
    for r in range(2):  # two micro-batches per step: each layer appears twice per step, in order
        recs = []
        for s in range(2):
            a, b = lines(s, r, p[(s, r, 0)], mtp=True), lines(s, r, p[(s, r, 1)])
            recs += a + b
        write_jsonl(d / f"router_trace_rank{r}.jsonl", recs)
    (d / "logits_rank0.bin").write_bytes(b"\0" * 16)  # a sidecar: not read
    assert detect_format(d).name == "megatron-router"
    res = runner.invoke(app, ["import", str(d), "-m", "mixtral-8x7b-tiny", "-o", str(tmp_path / "t")])
    assert res.exit_code == 0, res.output
    assert "4 record(s) of MTP heads skipped" in res.output  # one per (step, rank)
    assert find_problems(tmp_path / "t") == []
    tr = open_trace(tmp_path / "t")
    coll = tr.manifest["collection"]
    assert coll["stages"] == ["prefill"] and coll["request_unit"] == "forward pass" and coll["source_ranks"] == [0, 1]
    order = [(s, r, m) for s in range(2) for r in range(2) for m in range(2)]  # merged by step, then rank
    req = tr.requests().collect().sort("request_id")
    assert req["prompt_tokens"].to_list() == [len(p[k]) for k in order]
    np.testing.assert_array_equal(tr.token_arrays().topk_ids_TLK, np.concatenate([p[k] for k in order]))


def test_one_rank_file_imports_and_tp_duplicates_are_refused(tmp_path):
    a = ids(4, 0)
    f = write_jsonl(tmp_path / "router_trace_rank0.jsonl", lines(0, 0, a) + lines(1, 0, ids(2, 1)))
    import_trace(f, out=tmp_path / "t", model=MIXTRAL)
    assert open_trace(tmp_path / "t").token_arrays().topk_ids_TLK.shape[0] == 6
    d = tmp_path / "tp"
    d.mkdir()
    write_jsonl(d / "router_trace_rank0.jsonl", lines(0, 0, a))
    write_jsonl(d / "router_trace_rank1.jsonl", lines(0, 1, a))  # tensor parallel: the same tokens on both ranks
    with pytest.raises(TraceFormatError, match="same ids as rank 0 for step 0.*import one rank's file"):
        import_trace(d, out=tmp_path / "t2", model=MIXTRAL)


DSV3 = model_info_for("deepseek-v3-tiny")  # 61 layers, the first 3 dense, 256 experts in 8 groups, top-8


def dsv3_ids(n: int, seed: int) -> np.ndarray:
    """[N, L, K] ids a group-limited router picks (top-8 from at most 4 of the 8 groups)."""
    rng = np.random.default_rng(seed)

    def one() -> np.ndarray:
        pool = np.concatenate([np.arange(g * 32, (g + 1) * 32) for g in rng.choice(8, 4, replace=False)])
        return rng.choice(pool, 8, replace=False)

    return np.stack([np.stack([one() for _ in DSV3.moe_layers]) for _ in range(n)])


@pytest.mark.parametrize(("info", "make"), [(MIXTRAL, ids), (DSV3, dsv3_ids)], ids=["mixtral", "deepseek-v3"])
def test_core_v0_19_0_inference_traces_numbered_from_1_import(tmp_path, info, make):
    """Inference with routing replay writes ``layer_number`` (from 1): it imports as the same passes a
    hooks capture numbered from 0 gives, said in the notes (before: refused, pipeline parallelism blamed)."""
    p = {(s, r): make(2 + s + r, 7 * s + r) for s in range(3) for r in range(2)}
    runs = {}
    for base in (0, 1):
        d = tmp_path / f"from{base}"
        d.mkdir()
        for r in range(2):  # advance_step() after each forward pass: one step per pass
            write_jsonl(
                d / f"router_trace_rank{r}.jsonl",
                [x for s in range(3) for x in lines(s, r, p[(s, r)], base=base, info=info)],
            )
        res = runner.invoke(app, ["import", str(d), "-m", info.name, "-o", str(tmp_path / f"t{base}")])
        assert res.exit_code == 0, res.output
        assert find_problems(tmp_path / f"t{base}") == []
        runs[base] = (res.output, open_trace(tmp_path / f"t{base}"))
    order = [(s, r) for s in range(3) for r in range(2)]
    for base, (output, tr) in runs.items():
        np.testing.assert_array_equal(tr.token_arrays().topk_ids_TLK, np.concatenate([p[k] for k in order]))
        assert tr.manifest["collection"]["layer_numbering"] == f"from {base}"
        assert ("layer N is model layer N - 1" in output) == (base == 1)


def test_a_layer_outside_the_model_names_the_numbering_read(tmp_path):
    recs = lines(0, 0, ids(2, 0), base=1)
    recs[3]["layer"] = 40  # numbered from 1 (the others are 1..32), and 40 is past Mixtral's 32 layers
    d = tmp_path / "trace"
    d.mkdir()
    write_jsonl(d / "router_trace_rank0.jsonl", recs)
    with pytest.raises(
        TraceFormatError, match=r"layer 40 is not a MoE layer .*numbered from 1 .*1\.\.32.*Wrong --model"
    ):
        import_trace(d, out=tmp_path / "t", model=MIXTRAL)


def _rec(**over) -> str:
    base = lines(0, 0, ids(2, 3))
    base[0].update(over)
    return "".join(json.dumps(r) + "\n" for r in base)


HOSTILE = {
    "a dense layer index": (_rec(layer=40), r"rank0.jsonl:1: layer 40 is not a MoE layer"),
    "another top-k": (_rec(topk=4), r"rank0.jsonl:1: topk 4; mixtral-8x7b-tiny has top-k 2"),
    "num_tokens disagreeing with the rows": (_rec(num_tokens=9), r"rank0.jsonl:1: num_tokens 9 but 2 rows"),
    "an expert id of another model": (
        _rec(top_indices=[[0, 9], [1, 2]]),
        r"rank0.jsonl:1 \(step 0, rank 0\), token 0, layer 0: expert id 9, but mixtral-8x7b-tiny has 8 experts",
    ),
    "a huge step claiming nothing": (_rec(step=10**30), r"rank0.jsonl:1: `step` must be a whole number"),
    "a string id": (_rec(top_indices=[["a", 1], [1, 2]]), r"rank0.jsonl:1: `top_indices` must hold whole numbers"),
    "steps going backwards": (
        "".join(json.dumps(r) + "\n" for r in lines(1, 0, ids(1, 0)) + lines(0, 0, ids(1, 1))),
        r"rank0.jsonl:33: step 0 after step 1",
    ),
    "layers of one pass with different token counts": (
        "".join(json.dumps(r) + "\n" for r in lines(0, 0, ids(2, 0))[:5] + lines(0, 0, ids(3, 0))[5:]),
        r"step 0, rank 0, pass 0: layers carry different num_tokens \(\[2, 3\]\)",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_router_traces_are_one_clean_message(tmp_path, case):
    text, match = HOSTILE[case]
    d = tmp_path / "trace"
    d.mkdir()
    (d / "router_trace_rank0.jsonl").write_text(text)
    res = runner.invoke(
        app, ["import", str(d), "-m", "mixtral-8x7b-tiny", "-o", str(tmp_path / "t"), "--format", "megatron-router"]
    )
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
    assert re.search(match, res.output.replace("\n", " ")), res.output
    assert not (tmp_path / "t").exists()


def test_a_named_pipe_among_the_rank_files_is_refused(tmp_path):
    import os

    d = tmp_path / "trace"
    d.mkdir()
    os.mkfifo(d / "router_trace_rank0.jsonl")
    res = runner.invoke(
        app, ["import", str(d), "-m", "mixtral-8x7b-tiny", "-o", str(tmp_path / "t"), "--format", "megatron-router"]
    )
    assert res.exit_code == 2 and "not a regular file" in res.output and "Traceback" not in res.output


_value = st.one_of(st.integers(-2, 40), st.none(), st.text(max_size=2), st.lists(st.integers(-1, 9), max_size=3))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    recs=st.lists(
        st.fixed_dictionaries(
            {
                "step": st.one_of(st.integers(0, 2), _value),
                "layer": st.one_of(st.integers(0, 33), _value),
                "rank": st.one_of(st.just(0), _value),
                "top_indices": st.one_of(st.lists(st.lists(st.integers(-1, 9), min_size=2, max_size=2)), _value),
            },
            optional={"block": st.sampled_from(["decoder", "mtp", "x"]), "topk": _value, "num_tokens": _value},
        ),
        min_size=1,
        max_size=10,
    )
)
def test_fuzz_router_traces_never_a_traceback(tmp_path, recs):
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        (d / "in").mkdir()
        write_jsonl(d / "in" / "router_trace_rank0.jsonl", recs)
        res = runner.invoke(
            app, ["import", str(d / "in"), "-m", "mixtral-8x7b-tiny", "-o", str(d / "t"), "--format", "megatron-router"]
        )
        assert res.exit_code in (0, 2), res.output
        assert "Traceback" not in res.output
        if res.exit_code == 0:
            assert find_problems(d / "t") == []
    finally:
        shutil.rmtree(d)
