"""``--format chaos``: the "Patterns behind Chaos" expert-selection request files (one JSON per request,
step 0 the prefill, then one decode token per step), built here to the layout of the public files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import TraceFormatError
from moetrace.tracer.importers import chaos, detect_format, import_trace
from moetrace.tracer.presets import model_info_for
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.validate import find_problems

runner = CliRunner()
LLAMA4 = model_info_for("llama4-maverick")  # 48 layers, MoE on the odd ones, 128 experts, top-1
QWEN3 = model_info_for("qwen3-30b-a3b-tiny")  # 48 layers, all MoE, top-8


def steps_of(ids_TLK: np.ndarray, prompt: int, info=LLAMA4) -> list[dict]:
    """A request file's steps for ids [T, L, K]: the prefill's tokens, then one token per step; dense layers null."""
    moe = {layer: l for l, layer in enumerate(info.moe_layers)}

    def step(rows: np.ndarray) -> dict:
        return {
            str(i): (None if i not in moe else [[int(x) for x in tok] for tok in rows[:, moe[i]]])
            for i in range(info.num_hidden_layers)
        }

    return [step(ids_TLK[:prompt])] + [step(ids_TLK[t : t + 1]) for t in range(prompt, len(ids_TLK))]


def make_request(rng: np.random.Generator, prompt: int, decode: int, info=LLAMA4) -> tuple[np.ndarray, list[dict]]:
    ids = rng.integers(0, info.num_experts, size=(prompt + decode, info.num_moe_layers, info.top_k))
    if info.top_k > 1:  # distinct ids per token, as a router picks them
        ids = np.stack([[rng.permutation(info.num_experts)[: info.top_k] for _ in range(ids.shape[1])] for _ in ids])
    return ids.astype(np.int16), steps_of(ids, prompt, info)


def subjects(root: Path) -> dict[str, list[tuple[int, np.ndarray]]]:
    """Two subject folders in the public subset's layout (``llama4-mmlu-<subject>/<n>.json``, pretty-printed)."""
    rng = np.random.default_rng(0)
    out: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, shapes in (
        ("llama4-mmlu-astronomy", [(3, 4), (5, 2)]),
        ("llama4-mmlu-anatomy", [(2, 3), (1, 1), (4, 0)]),
    ):
        folder = root / name
        folder.mkdir(parents=True)
        out[name] = []
        for n, (prompt, decode) in zip((10, 9, 100), shapes):  # numeric order, not text order: 9 before 10
            ids, steps = make_request(rng, prompt, decode)
            (folder / f"{n}.json").write_text(json.dumps(steps, indent=4))
            out[name].append((n, ids, prompt))
        (folder / "notes.json").write_text("{}")  # not a request file: never read
    return out


def test_requests_import_with_their_stages_subject_by_subject(tmp_path):
    src = tmp_path / "traffic-gen"
    made = subjects(src)
    assert detect_format(src).name == "chaos"
    assert detect_format(src / "llama4-mmlu-anatomy" / "9.json").name == "chaos"
    import_trace(src, out=tmp_path / "t", model=LLAMA4)
    assert find_problems(tmp_path / "t") == []
    tr = open_trace(tmp_path / "t")
    assert tr.manifest["backend"]["source_format"] == "chaos"
    assert tr.manifest["collection"]["stages"] == ["prefill", "decode"]
    req = tr.requests().collect().sort("request_id")
    # folders sorted by name (anatomy before astronomy), files by their number
    order = [(name, n) for name in sorted(made) for n, _, _ in sorted(made[name], key=lambda x: x[0])]
    assert req["dataset"].to_list() == [name for name, _ in order]
    by = {(name, n): (ids, p) for name in made for n, ids, p in made[name]}
    assert req["prompt_tokens"].to_list() == [by[k][1] for k in order]
    assert req["output_tokens"].to_list() == [len(by[k][0]) - by[k][1] for k in order]
    rt = tr.routing().collect().sort(["request_id", "position"])
    got = np.array(rt["experts"].to_list(), dtype=np.int16).reshape(-1, LLAMA4.num_moe_layers, 1)
    np.testing.assert_array_equal(got, np.concatenate([by[k][0] for k in order]))
    stages = rt["stage"].to_list()
    want = [s for k in order for s in ["prefill"] * by[k][1] + ["decode"] * (len(by[k][0]) - by[k][1])]
    assert stages == want


def test_one_subject_folder_one_file_and_top_8(tmp_path):
    made = subjects(tmp_path / "src")
    import_trace(tmp_path / "src" / "llama4-mmlu-anatomy", out=tmp_path / "a", model=LLAMA4, dataset="anatomy")
    req = open_trace(tmp_path / "a").requests().collect()
    assert req["dataset"].to_list() == ["anatomy"] * 3
    import_trace(tmp_path / "src" / "llama4-mmlu-anatomy" / "100.json", out=tmp_path / "b", model=LLAMA4)
    assert open_trace(tmp_path / "b").requests().collect()["prompt_tokens"].to_list() == [4]
    ids, steps = make_request(np.random.default_rng(1), 3, 2, QWEN3)
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "0.json").write_text(json.dumps(steps))
    import_trace(tmp_path / "q", out=tmp_path / "c", model=QWEN3)
    rt = open_trace(tmp_path / "c").routing().collect().sort("position")
    np.testing.assert_array_equal(np.array(rt["experts"].to_list()).reshape(ids.shape), ids)
    del made


def _write(tmp_path: Path, steps) -> Path:
    folder = tmp_path / "bad" / "sub"
    folder.mkdir(parents=True)
    (folder / "7.json").write_text(json.dumps(steps))
    return tmp_path / "bad"


def _good() -> list[dict]:
    return make_request(np.random.default_rng(2), 3, 2)[1]


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("not a list", r"7\.json: not a list of steps"),
        ("step not object", r"7\.json: step 1 is list, not an object keyed by layer index"),
        ("moe layer null", r"7\.json: step 2: MoE layer 5 of llama4-maverick has no tokens"),
        ("dense layer routes", r"7\.json: step 0: layer 4 routes tokens, but it is not a MoE layer of llama4-maverick"),
        ("unknown layer", r"7\.json: step 0: layer '48', but llama4-maverick has layers 0\.\.47; check --model"),
        ("top-2 entry", r"7\.json: step 0, layer 1: token 0 is \[1, 2\], not a list of 1 whole numbers"),
        ("token counts differ", r"7\.json: step 0: MoE layers route \[2, 3\] tokens"),
        ("two-token decode", r"7\.json: step 1: 2 tokens; after step 0 \(the prefill\)"),
        ("empty prefill", r"7\.json: step 0: the prefill routes no token"),
        ("not json", r"7\.json: not valid JSON"),
    ],
)
def test_malformed_files_are_refused_naming_the_file_and_step(tmp_path, how, message):
    steps = _good()
    if how == "not a list":
        steps = {"0": None}
    elif how == "step not object":
        steps[1] = []
    elif how == "moe layer null":
        steps[2]["5"] = None
    elif how == "dense layer routes":
        steps[0]["4"] = [[1]]
    elif how == "unknown layer":
        steps[0]["48"] = None
    elif how == "top-2 entry":
        steps[0]["1"][0] = [1, 2]
    elif how == "token counts differ":
        steps[0]["1"] = steps[0]["1"][:2]
    elif how == "two-token decode":
        steps[1] = steps[0]
        for key, v in steps[1].items():
            steps[1][key] = None if v is None else v[:2]
    elif how == "empty prefill":
        steps[0] = {k: (None if v is None else []) for k, v in steps[0].items()}
    src = _write(tmp_path, steps)
    if how == "not json":
        (src / "sub" / "7.json").write_text('[{"0": null, ')
    with pytest.raises(TraceFormatError) as exc:
        import_trace(src, out=tmp_path / "t", model=LLAMA4, source_format="chaos")
    assert re.search(message, str(exc.value)), str(exc.value)
    assert not (tmp_path / "t").exists()


def test_detection_is_strict_and_the_cli_needs_the_model(tmp_path):
    subjects(tmp_path / "src")
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "3.json").write_text('{"logical_count": [[1, 2]]}')
    (tmp_path / "named.json").write_text(json.dumps(_good()))
    for path in (tmp_path / "empty", tmp_path / "other", tmp_path / "named.json"):
        assert not chaos.detect(path.read_bytes()[:4096] if path.is_file() else b"", path)
    res = runner.invoke(app, ["import", str(tmp_path / "src"), "-o", str(tmp_path / "t")])
    assert res.exit_code == 2 and "needs --model" in res.output, res.output
    res = runner.invoke(app, ["import", str(tmp_path / "src"), "--model", "llama4-maverick", "-o", str(tmp_path / "t")])
    assert res.exit_code == 0, res.output
    assert "5 requests" in res.output and "step 0 of each request file is its prefill" in res.output
    res = runner.invoke(
        app, ["import", str(tmp_path / "src"), "--model", "qwen3-30b-a3b-tiny", "-o", str(tmp_path / "u")]
    )
    assert res.exit_code != 0 and "check --model" in res.output, res.output
    assert "Traceback" not in res.output
