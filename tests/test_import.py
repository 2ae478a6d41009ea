"""``moetrace import``: SGLang /generate responses and per-token JSONL → trace format v1."""

from __future__ import annotations

import base64
import dataclasses
import json

import numpy as np
import pytest
from factories import MAV, planted_ids, sglang_response
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ModelError, TraceFormatError
from moetrace.tracer.importers import import_trace, sglang_response_rows
from moetrace.tracer.presets import model_info_for, resolve
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import stages_of
from moetrace.tracer.trace.validate import find_problems

OLMOE = model_info_for("olmoe-1b-7b-tiny")  # 16 layers all MoE, 64 experts, top-8


def test_sglang_response_rows_drop_dense_layers_and_mark_final_token():
    truth = planted_ids(5 + 3 - 1, MAV, 0)
    P, O, rows = sglang_response_rows(sglang_response(5, 3, truth, MAV), info=MAV)
    assert (P, O) == (5, 3) and rows.shape == (8, 24)
    np.testing.assert_array_equal(rows[:-1], truth.reshape(7, 24))
    assert (rows[-1] == -1).all()


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32", " UINT8 "])
def test_sglang_routed_experts_dtype_is_honoured(dtype):
    truth = planted_ids(5 + 3 - 1, MAV, 2)  # Maverick: 128 experts fit uint8
    resp = sglang_response(5, 3, truth, MAV, dtype=dtype.strip().lower())
    resp["meta_info"]["routed_experts_dtype"] = dtype  # SGLang strips and lower-cases the name
    P, O, rows = sglang_response_rows(resp, info=MAV)
    np.testing.assert_array_equal(rows[:-1], truth.reshape(7, 24))
    assert (rows[-1] == -1).all()


def test_sglang_uint16_with_start_len_and_more_than_256_experts():
    info = dataclasses.replace(OLMOE, num_experts=300)
    truth = planted_ids(6 + 2 - 1, info, 5)
    assert truth.max() >= 256  # needs uint16
    resp = sglang_response(6, 2, truth, info, start=3, all_layers=False, dtype="uint16")
    P, O, rows = sglang_response_rows(resp, info=info)
    assert (rows[:3] == -1).all() and (rows[-1] == -1).all()
    np.testing.assert_array_equal(rows[3:7], truth[3:].reshape(4, -1))


def test_sglang_wrong_dtype_is_a_clean_error(tmp_path):
    truth = planted_ids(4, MAV, 0)
    resp = sglang_response(3, 2, truth, MAV, dtype="uint8")
    as_int32 = dict(resp, meta_info={k: v for k, v in resp["meta_info"].items() if k != "routed_experts_dtype"})
    with pytest.raises(TraceFormatError, match="12 layers; expected 48"):
        sglang_response_rows(as_int32, info=MAV)  # a uint8 payload without its key reads as int32 (SGLang's default)
    as_int32["meta_info"]["routed_experts"] = base64.b64encode(b"\x01\x02\x03").decode()
    with pytest.raises(TraceFormatError, match="3 bytes, not a whole number of int32 ids"):
        sglang_response_rows(as_int32, info=MAV)
    for bad in ("float16", 8, ""):
        resp["meta_info"]["routed_experts_dtype"] = bad
        src = tmp_path / "r.jsonl"
        src.write_text(json.dumps(resp) + "\n")
        with pytest.raises(
            TraceFormatError,
            match=r"r.jsonl:1: request 0: meta_info.routed_experts_dtype must be one of int32, "
            r"uint16, uint8",
        ):
            import_trace(src, out=tmp_path / "t", model=MAV)
        assert not (tmp_path / "t").exists()


def test_sglang_start_len_leaves_skipped_prefix_unrecorded():
    truth = planted_ids(6 + 2 - 1, OLMOE, 1)
    P, O, rows = sglang_response_rows(sglang_response(6, 2, truth, OLMOE, start=4, all_layers=False), info=OLMOE)
    assert (rows[:4] == -1).all() and (rows[-1] == -1).all()
    np.testing.assert_array_equal(rows[4:7], truth[4:].reshape(3, -1))


def test_sglang_jsonl_several_requests_batched_line_and_labels(tmp_path):
    shapes = [(5, 3), (2, 1), (7, 4)]
    truths = [planted_ids(p + o - 1, MAV, i) for i, (p, o) in enumerate(shapes)]
    resps = [sglang_response(p, o, t, MAV) for (p, o), t in zip(shapes, truths)]
    resps[2]["dataset"] = "code"
    src = tmp_path / "gsm8k-run.jsonl"
    src.write_text(json.dumps(resps[0]) + "\n" + json.dumps(resps[1:]) + "\n")  # a batched response list
    stats = import_trace(src, out=tmp_path / "t", model=MAV)
    assert (stats.num_requests, stats.num_tokens) == (3, sum(p + o for p, o in shapes))
    assert find_problems(tmp_path / "t") == []
    tr = open_trace(tmp_path / "t")
    assert tr.manifest["backend"] == {"name": "import", "source_format": "sglang", "source_file": src.name}
    assert tr.manifest["collection"]["datasets"] == ["code", "gsm8k-run"]
    assert tr.manifest["collection"]["stages"] == ["prefill", "decode"] and stages_of(tr) == {"prefill", "decode"}
    ta = tr.token_arrays()
    for rid, ((p, o), t) in enumerate(zip(shapes, truths)):
        sel = ta.request_id_T == rid
        assert ta.is_decode_T[sel].tolist() == [False] * p + [True] * o
        np.testing.assert_array_equal(ta.topk_ids_TLK[sel][:-1], t)


def test_sglang_errors_name_the_fix(tmp_path):
    resp = sglang_response(3, 2, planted_ids(4, MAV, 0), MAV)
    del resp["meta_info"]["routed_experts"]
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps(resp) + "\n")
    with pytest.raises(TraceFormatError, match=r"r.jsonl:1: .*--enable-return-routed-experts"):
        import_trace(src, out=tmp_path / "t", model=MAV)
    short = sglang_response(3, 2, planted_ids(4, MAV, 0), MAV)
    short["meta_info"]["completion_tokens"] = 5  # rows no longer match the token counts
    src.write_text(json.dumps(short) + "\n")
    with pytest.raises(TraceFormatError, match="not a multiple|cover"):
        import_trace(src, out=tmp_path / "t2", model=MAV)
    wrong_model = sglang_response(3, 2, planted_ids(4, MAV, 0), MAV)
    src.write_text(json.dumps(wrong_model) + "\n")
    with pytest.raises(TraceFormatError):
        import_trace(src, out=tmp_path / "t3", model=OLMOE)


def token_records(truths: dict, prompts: dict, info, *, skip=()):
    out = []
    for rid, t in truths.items():
        for pos in range(t.shape[0]):
            for li, layer in enumerate(info.moe_layers):
                if (rid, pos, layer) in skip:
                    continue
                out.append(
                    {
                        "request": rid,
                        "layer": layer,
                        "position": pos,
                        "stage": "prefill" if pos < prompts[rid] else "decode",
                        "experts": t[pos, li].tolist(),
                        "dataset": f"ds-{rid}",
                    }
                )
    return out


def test_tokens_jsonl_round_trip_with_gaps(tmp_path):
    truths = {"req-b": planted_ids(6, MAV, 3), "req-a": planted_ids(4, MAV, 4)}
    prompts = {"req-b": 4, "req-a": 1}
    recs = token_records(truths, prompts, MAV, skip={("req-b", 2, 5)})
    for r in recs:
        r["dataset"] = "chat" if r["request"] == "req-b" else "code"
    rng = np.random.default_rng(0)
    src = tmp_path / "tokens.jsonl"
    src.write_text("".join(json.dumps(recs[i]) + "\n" for i in rng.permutation(len(recs))))  # any order
    import_trace(src, out=tmp_path / "t", model=MAV)
    assert find_problems(tmp_path / "t") == []
    tr = open_trace(tmp_path / "t")
    assert tr.manifest["backend"]["source_format"] == "tokens"
    req = tr.requests().collect().sort("request_id")
    ta = tr.token_arrays()
    for name, t in truths.items():
        rid = req.filter(req["dataset"] == ("chat" if name == "req-b" else "code"))["request_id"][0]
        sel = ta.request_id_T == rid
        got = ta.topk_ids_TLK[sel]
        want = t.copy()
        if name == "req-b":
            want[2, MAV.moe_layers.index(5)] = -1  # the missing record
        np.testing.assert_array_equal(got, want)
        assert int(ta.is_decode_T[sel].sum()) == t.shape[0] - prompts[name]
    assert sorted(req["request_id"].to_list()) == [0, 1]  # string ids numbered 0..R-1


def test_tokens_errors(tmp_path):
    t = planted_ids(3, MAV, 0)
    bad_layer = token_records({0: t}, {0: 2}, MAV)
    bad_layer[0]["layer"] = 2  # a dense layer of Maverick
    src = tmp_path / "x.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in bad_layer))
    with pytest.raises(TraceFormatError, match="layer 2 is not a MoE layer"):
        import_trace(src, out=tmp_path / "t1", model=MAV)
    order = token_records({0: t}, {0: 2}, MAV)
    for r in order:
        r["stage"] = "decode" if r["position"] == 0 else "prefill"
    src.write_text("".join(json.dumps(r) + "\n" for r in order))
    with pytest.raises(TraceFormatError, match="prefill position comes after a decode"):
        import_trace(src, out=tmp_path / "t2", model=MAV, source_format="tokens")
    nostage = [{k: v for k, v in r.items() if k != "stage"} for r in token_records({0: t}, {0: 2}, MAV)]
    src.write_text("".join(json.dumps(r) + "\n" for r in nostage))
    with pytest.raises(TraceFormatError, match=r"lack \['stage'\]"):
        import_trace(src, out=tmp_path / "t3", model=MAV, source_format="tokens")
    src.write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(TraceFormatError, match="Pass --format"):
        import_trace(src, out=tmp_path / "t4", model=MAV)


def test_model_from_hf_config_file(tmp_path):
    cfg = {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 6,
        "first_k_dense_replace": 2,
        "moe_layer_freq": 1,
        "n_routed_experts": 32,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "hidden_size": 256,
        "n_group": 4,
        "topk_group": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    info = resolve(str(tmp_path)).model_info()
    assert info.moe_layers == (2, 3, 4, 5) and info.num_experts == 32 and info.n_group == 4
    cfg_file = str(tmp_path / "config.json")
    assert resolve(cfg_file).model_info() == dataclasses.replace(info, name=cfg_file, source=cfg_file)
    with pytest.raises(ModelError, match="neither a preset"):
        resolve(str(tmp_path / "nothing")).model_info()
    with pytest.raises(ModelError, match="hub id and its config is not downloaded"):
        resolve("deepseek-ai/DeepSeek-V3-Base").model_info()


def test_cli_import_and_clean_errors(tmp_path):
    truth = planted_ids(4, OLMOE, 0)
    src = tmp_path / "s.jsonl"
    src.write_text(json.dumps(sglang_response(3, 2, truth, OLMOE)) + "\n")
    runner = CliRunner()
    res = runner.invoke(app, ["import", str(src), "--model", "olmoe-1b-7b-tiny", "-o", str(tmp_path / "t")])
    assert res.exit_code == 0, res.output
    assert "1 requests, 5 tokens" in res.output
    res = runner.invoke(app, ["import", str(src), "--model", "olmoe-1b-7b-tiny", "-o", str(tmp_path / "t")])
    assert res.exit_code == 2 and "already holds a trace" in res.output and "Traceback" not in res.output
    assert "--resume" not in res.output and "--overwrite" in res.output  # import has no resume
    res = runner.invoke(
        app, ["import", str(src), "--model", "olmoe-1b-7b-tiny", "-o", str(tmp_path / "t"), "--overwrite"]
    )
    assert res.exit_code == 0


@pytest.mark.parametrize(
    "change, match",
    [
        ({"layer": "x"}, "`layer` must be an integer"),
        ({"position": 0.5}, "`position` must be an integer"),  # was silently truncated to 0
        ({"experts": None}, r"x.jsonl:1: no `experts` \(null or missing\)"),
        ({"experts": [None, *range(1, 8)]}, "x.jsonl:1: `experts` holds null"),
        ({"position": 3_000_000_000}, "does not fit"),
    ],
)
def test_tokens_wrong_field_types_are_clean_errors_and_leave_nothing(tmp_path, change, match):
    rec = {"request": 1, "layer": 0, "position": 0, "stage": "prefill", "experts": list(range(8)), **change}
    src = tmp_path / "x.jsonl"
    src.write_text(json.dumps(rec) + "\n")
    with pytest.raises(TraceFormatError, match=match):
        import_trace(src, out=tmp_path / "t", model=OLMOE)
    assert not (tmp_path / "t").exists()  # a corrected re-run is not blocked by a partial trace


def test_sglang_bad_or_duplicate_request_ids_are_clean_errors(tmp_path):
    resp = sglang_response(3, 2, planted_ids(4, OLMOE, 0), OLMOE, request_id=7)
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps(resp) + "\n" + json.dumps(resp) + "\n")
    with pytest.raises(TraceFormatError, match="r.jsonl:2: request_id 7 appears twice"):
        import_trace(src, out=tmp_path / "t", model=OLMOE)
    src.write_text(json.dumps({**resp, "request_id": "abc"}) + "\n")
    with pytest.raises(TraceFormatError, match="r.jsonl:1"):
        import_trace(src, out=tmp_path / "t", model=OLMOE)
    assert not (tmp_path / "t").exists()
