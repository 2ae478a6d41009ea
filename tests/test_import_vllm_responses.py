"""``vllm-responses``: vLLM's OpenAI-compatible server responses with routed experts, written here as each release's
server writes them (read in vLLM's source; docs/collecting.md names the files):

- 0.33.0 (wheel): ``choices[i].routed_experts`` = ``numpy2base64(output.routed_experts)`` (``utils/serial_utils.py``:
  ``np.save(buffer, array, allow_pickle=False)``, base64), ``[prompt + output - 1, num_hidden_layers, top_k]`` uint8
  (<= 256 experts) or uint16; the request's ``routed_experts_prompt_start`` leaves out the first prompt positions;
- 0.22.0 (wheel): the same array through ``np.save(buf, ...)`` + ``base64.b64encode`` in ``completion/serving.py``;
- 0.21.0 (sdist): ``prompt_routed_experts`` on the response and ``routed_experts`` on each choice as nested lists
  (``.tolist()``), the layer axis by MoE ordinal.

The response objects carry the fields the pydantic models of those releases dump (``CompletionResponse``,
``ChatCompletionResponse``); no vLLM is imported.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from moetrace.errors import TraceFormatError
from moetrace.tracer.importers import detect_format, import_trace
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import ModelInfo
from moetrace.tracer.trace.validate import find_problems

runner = CliRunner()
MODEL = ModelInfo(  # layer 0 dense, 1..3 MoE
    name="m",
    source="org/m",
    architecture="Test",
    num_hidden_layers=4,
    moe_layers=(1, 2, 3),
    num_experts=8,
    top_k=2,
    num_shared_experts=0,
    hidden_size=8,
)
WIDE = ModelInfo(**{**MODEL.to_dict(), "num_experts": 300})  # uint16 ids


def _ids(rng: np.random.Generator, N: int, model: ModelInfo) -> np.ndarray:
    """[N, H, K] as vLLM >= 0.22 returns them: decoder-layer axis, dense layer 0 all zero."""
    H, E, K = model.num_hidden_layers, model.num_experts, model.top_k
    ids = np.argsort(rng.random((N, H, E)), axis=-1)[..., :K]
    ids[:, 0] = 0
    return ids.astype(np.uint8 if E <= 256 else np.uint16)


def numpy2base64(array: np.ndarray) -> str:  # vllm/utils/serial_utils.py @ v0.33.0
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def completion(choices: list[dict[str, Any]], P: int, O: int, **extra: Any) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "org/m",
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {"prompt_tokens": P, "total_tokens": P + O, "completion_tokens": O, "prompt_tokens_details": None},
        "kv_transfer_params": None,
        **extra,
    }


def completion_choice(routed: Any, *, index: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "index": index,
        "text": "x",
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "token_ids": None,
        "routed_experts": routed,
        "weight_versions": None,
        **extra,
    }


def chat(routed: Any, P: int, O: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "org/m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x"},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": routed,
                "weight_versions": None,
            }
        ],
        "usage": {"prompt_tokens": P, "total_tokens": P + O, "completion_tokens": O},
        "prompt_token_ids": None,
    }


def _rows(arr_NHK: np.ndarray, model: ModelInfo, T: int) -> np.ndarray:
    """The trace rows moetrace should keep: MoE layers, T rows, the last -1."""
    out = np.full((T, model.num_moe_layers, model.top_k), -1, dtype=np.int16)
    out[: T - 1] = arr_NHK[: T - 1][:, list(model.moe_layers)]
    return out


def _write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_vllm_0_33_completion_and_chat_responses(tmp_path):
    rng = np.random.default_rng(1)
    a, b = _ids(rng, 7 + 4 - 1, MODEL), _ids(rng, 5 + 3 - 1, MODEL)
    src = _write(
        tmp_path / "resp.jsonl",
        [
            completion([completion_choice(numpy2base64(a))], 7, 4, request_id=40, dataset="gsm8k"),
            chat(numpy2base64(b), 5, 3),
        ],
    )
    assert detect_format(src).name == "vllm-responses"
    import_trace(src, out=tmp_path / "t", model=MODEL)
    assert find_problems(tmp_path / "t") == []
    tr = open_trace(tmp_path / "t")
    req = tr.request_arrays
    assert req.request_id_R.tolist() == [40, 41] and req.dataset_R.tolist() == ["gsm8k", "resp"]
    assert req.prompt_tokens_R.tolist() == [7, 5] and req.output_tokens_R.tolist() == [4, 3]
    ids = tr.token_arrays().topk_ids_TLK
    assert np.array_equal(ids, np.concatenate([_rows(a, MODEL, 11), _rows(b, MODEL, 8)]))


def test_vllm_0_22_uint16_ids_of_a_model_over_256_experts(tmp_path):
    rng = np.random.default_rng(2)
    a = _ids(rng, 6 + 2 - 1, WIDE)
    assert a.dtype == np.uint16
    buf = io.BytesIO()
    np.save(buf, a)  # 0.22.0 completion/serving.py
    payload = base64.b64encode(buf.getvalue()).decode("ascii")
    src = _write(tmp_path / "r.jsonl", [completion([completion_choice(payload)], 6, 2)])
    import_trace(src, out=tmp_path / "t", model=WIDE)
    assert np.array_equal(open_trace(tmp_path / "t").token_arrays().topk_ids_TLK, _rows(a, WIDE, 8))


def test_vllm_0_33_routed_experts_prompt_start_leaves_those_positions_unrecorded(tmp_path):
    rng = np.random.default_rng(3)
    full = _ids(rng, 9 + 3 - 1, MODEL)
    src = _write(tmp_path / "r.jsonl", [completion([completion_choice(numpy2base64(full[4:]))], 9, 3)])
    import_trace(src, out=tmp_path / "t", model=MODEL)
    got = open_trace(tmp_path / "t").token_arrays().topk_ids_TLK
    want = _rows(full, MODEL, 12)
    want[:4] = -1
    assert np.array_equal(got, want)


def test_vllm_0_21_split_nested_lists_by_moe_ordinal(tmp_path):
    rng = np.random.default_rng(4)
    H, L = MODEL.num_hidden_layers, MODEL.num_moe_layers  # vLLM 0.21 sizes the axis by its MoE count (all layers)
    moe = np.argsort(rng.random((6 + 3 - 1, L, 8)), axis=-1)[..., :2]
    arr = np.zeros((len(moe), H, 2), dtype=np.int16)
    arr[:, :L] = moe  # rows 0..L-1 are the MoE layers in order, the rest stay 0
    resp = completion([completion_choice(arr[6:].tolist())], 6, 3, prompt_routed_experts=arr[:6].tolist())
    src = _write(tmp_path / "r.jsonl", [resp])
    notes: list[str] = []
    import_trace(src, out=tmp_path / "t", model=MODEL, notes=notes.append)
    want = np.full((9, L, 2), -1, dtype=np.int16)
    want[:8] = moe
    assert np.array_equal(open_trace(tmp_path / "t").token_arrays().topk_ids_TLK, want)
    assert any("0.21" in n for n in notes)
    arr[2, 1] = 0  # what 0.21 returns for a prefix-cache hit
    _write(src, [completion([completion_choice(arr[6:].tolist())], 6, 3, prompt_routed_experts=arr[:6].tolist())])
    with pytest.raises(
        TraceFormatError, match=r"r.jsonl:1: request 0 \(choice 0\): position 2, layer 2: .*prefix cach"
    ):
        import_trace(src, out=tmp_path / "t2", model=MODEL)
    assert not (tmp_path / "t2").exists()


def test_vllm_0_33_several_choices_need_their_token_ids(tmp_path):
    rng = np.random.default_rng(5)
    a, b = _ids(rng, 4 + 2 - 1, MODEL), _ids(rng, 4 + 3 - 1, MODEL)
    choices = [completion_choice(numpy2base64(a), index=0), completion_choice(numpy2base64(b), index=1)]
    src = _write(tmp_path / "r.jsonl", [completion(choices, 4, 5)])
    with pytest.raises(TraceFormatError, match="return_token_ids"):
        import_trace(src, out=tmp_path / "t", model=MODEL)
    for c, O in zip(choices, (2, 3)):
        c["prompt_token_ids"], c["token_ids"] = [1, 2, 3, 4], list(range(O))
    _write(src, [completion(choices, 4, 5)])
    import_trace(src, out=tmp_path / "t", model=MODEL)
    tr = open_trace(tmp_path / "t")
    assert tr.request_arrays.output_tokens_R.tolist() == [2, 3]
    assert np.array_equal(tr.token_arrays().topk_ids_TLK, np.concatenate([_rows(a, MODEL, 6), _rows(b, MODEL, 7)]))


@pytest.mark.parametrize(
    "routed, P, O, fragment",
    [
        (None, 4, 2, "routed_experts is null: start vLLM with --enable-return-routed-experts"),
        ("not base64!", 4, 2, "not base64"),
        ("aGVsbG8=", 4, 2, "not of a .npy array file"),
        ("rows", 4, 3, "cover 8 tokens; a request of 4+3 tokens needs 6"),  # more rows than the tokens
        ("big", 4, 2, "ids outside 0..7"),
    ],
)
def test_vllm_0_33_malformed_response_is_one_line(tmp_path, routed, P, O, fragment):
    rng = np.random.default_rng(6)
    if routed == "rows":
        routed = numpy2base64(_ids(rng, 8, MODEL))
    elif routed == "big":
        arr = _ids(rng, P + O - 1, MODEL)
        arr[1, 2, 0] = 9
        routed = numpy2base64(arr)
    src = _write(tmp_path / "r.jsonl", [completion([completion_choice(routed)], P, O)])
    out = tmp_path / "t"
    try:
        import_trace(src, out=out, model=MODEL)
    except TraceFormatError as exc:
        msg = str(exc)
    else:
        msg = ""
    assert fragment in msg and "\n" not in msg and msg.startswith(f"{src}:1: request 0"), msg
    assert not out.exists()


def test_vllm_0_33_cli_import_and_a_bad_line(tmp_path):
    from moetrace.cli import app
    from moetrace.tracer.presets import resolve

    mixtral = resolve("mixtral-8x7b").model_info()  # 32 layers, all MoE, 8 experts, top-2
    a = _ids(np.random.default_rng(7), 5 + 2 - 1, mixtral)
    a[:, 0] = np.argsort(np.random.default_rng(8).random((6, 8)), axis=-1)[:, :2]  # layer 0 routes too
    src = _write(tmp_path / "r.jsonl", [chat(numpy2base64(a), 5, 2)])
    r = runner.invoke(app, ["import", str(src), "-m", "mixtral-8x7b", "-o", str(tmp_path / "t")])
    assert r.exit_code == 0, r.output
    assert "1 requests, 7 tokens" in r.output
    src.write_text(src.read_text() + "{not json\n")
    r = runner.invoke(app, ["import", str(src), "-m", "mixtral-8x7b", "-o", str(tmp_path / "t2")])
    assert r.exit_code != 0 and "r.jsonl:2: not valid JSON" in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "t2").exists()
