"""``esft``: DeepSeek's ESFT expert logs (deepseek-ai/ESFT, commit 579a7711e4b3, ``results/expert_scores/<task>/
expert_weights_<layer>.txt``), written here in their exact layout from generated ids (no ESFT data is vendored):
one line per sequence, the top-6 ids of every token token after token, tab-separated, an empty field, then the
weights in the same order; line i of every layer file is the same sequence; file N is model layer N."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import TraceFormatError
from moetrace.tracer.importers import ImportOptions, detect_format, esft, import_trace
from moetrace.tracer.presets import model_info_for
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.validate import find_problems

V2LITE = esft.model_info()  # layers 1..26 of 27, 64 experts, top-6
L, K, E = V2LITE.num_moe_layers, V2LITE.top_k, V2LITE.num_experts
runner = CliRunner()


def sequences(lengths: list[int], seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sequence: ids [T, L, K] (K distinct experts per token and layer) and weights [T, L, K] rounded to
    4 decimals, as ESFT writes them."""
    rng = np.random.default_rng(seed)
    out = []
    for T in lengths:
        ids = np.argsort(rng.random((T, L, E)), axis=2)[:, :, :K]
        w = np.round(rng.dirichlet(np.ones(E), size=(T, L))[:, :, :K], 4)
        out.append((ids, w))
    return out


def line(ids_TK: np.ndarray, w_TK: np.ndarray) -> str:
    return (
        "\t".join(str(int(i)) for i in ids_TK.reshape(-1))
        + "\t\t"
        + "\t".join(repr(float(x)) for x in w_TK.reshape(-1))
    )


def write_task(folder: Path, seqs: list[tuple[np.ndarray, np.ndarray]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for l, layer in enumerate(V2LITE.moe_layers):
        text = "".join(line(ids[:, l], w[:, l]) + "\n" for ids, w in seqs)
        (folder / f"expert_weights_{layer}.txt").write_text(text)
    return folder


def scores_dir(root: Path) -> tuple[Path, dict[str, list[tuple[np.ndarray, np.ndarray]]]]:
    """An ``expert_scores`` folder of two tasks (unequal sizes and lengths) and a summary.json that is not read."""
    tasks = {"law": sequences([9, 4, 7], seed=1), "intent": sequences([5, 2], seed=2)}
    for name, seqs in tasks.items():
        write_task(root / name, seqs)
        (root / name / "summary.json").write_text('{"token_scores": {}}')
    return root, tasks


def read_back(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids [T, L, K], weights [T, L, K] and positions of a trace, in row order."""
    tr = open_trace(path)
    df = tr.routing().collect().sort(["request_id", "position"])
    ids = np.array(df["experts"].to_list(), dtype=np.int16).reshape(-1, L, K)
    w = np.array(df["weights"].to_list(), dtype=np.float32).reshape(-1, L, K)
    return ids, w, df["position"].to_numpy()


def test_the_logs_import_as_requests_of_their_task_with_ids_and_weights(tmp_path):
    src, tasks = scores_dir(tmp_path / "expert_scores")
    assert detect_format(src).name == "esft" and detect_format(src / "law").name == "esft"
    import_trace(src, out=tmp_path / "t", model=V2LITE)
    assert find_problems(tmp_path / "t") == []
    tr = open_trace(tmp_path / "t")
    assert tr.model == V2LITE and tr.manifest["backend"]["source_format"] == "esft"
    assert tr.manifest["collection"]["prompt_span"] == {"prompt_fraction": 0.5}
    assert tr.manifest["collection"]["stages"] == ["prefill", "decode"]
    req = tr.requests().collect().sort("request_id")
    # folders in name order (intent before law), each in its line order; round(0.5 * T), at least 1
    assert req["dataset"].to_list() == ["intent"] * 2 + ["law"] * 3
    lengths = [5, 2, 9, 4, 7]
    assert req["prompt_tokens"].to_list() == [max(1, round(0.5 * t)) for t in lengths]
    assert (req["prompt_tokens"] + req["output_tokens"]).to_list() == lengths
    ids, w, pos = read_back(tmp_path / "t")
    want = [s for name in ("intent", "law") for s in tasks[name]]
    np.testing.assert_array_equal(ids, np.concatenate([i for i, _ in want]))
    np.testing.assert_array_equal(w, np.concatenate([x for _, x in want]).astype(np.float32))
    assert pos.tolist() == [p for t in lengths for p in range(t)]


def test_one_task_folder_and_the_prompt_span_options(tmp_path):
    src, tasks = scores_dir(tmp_path / "expert_scores")
    import_trace(src / "law", out=tmp_path / "a", model=V2LITE, options=ImportOptions(prompt_fraction=0.25))
    req = open_trace(tmp_path / "a").requests().collect().sort("request_id")
    assert req["dataset"].to_list() == ["law"] * 3 and req["prompt_tokens"].to_list() == [2, 1, 2]
    assert open_trace(tmp_path / "a").manifest["collection"]["prompt_span"] == {"prompt_fraction": 0.25}
    import_trace(src / "law", out=tmp_path / "b", model=V2LITE, dataset="legal", options=ImportOptions(prompt_tokens=3))
    req = open_trace(tmp_path / "b").requests().collect().sort("request_id")
    assert req["dataset"].to_list() == ["legal"] * 3 and req["prompt_tokens"].to_list() == [3, 3, 3]
    with pytest.raises(TraceFormatError, match=r"law/expert_weights_1\.txt:2: a sequence of 4 tokens leaves nothing"):
        import_trace(src / "law", out=tmp_path / "c", model=V2LITE, options=ImportOptions(prompt_tokens=4))
    assert not (tmp_path / "c").exists()


def _replace_line(folder: Path, layer: int, n: int, new: str) -> None:
    p = folder / f"expert_weights_{layer}.txt"
    lines = p.read_text().split("\n")
    lines[n - 1] = new
    p.write_text("\n".join(lines))


def _fields(folder: Path, layer: int, n: int) -> tuple[list[str], list[str]]:
    ids, w = (folder / f"expert_weights_{layer}.txt").read_text().split("\n")[n - 1].split("\t\t")
    return ids.split("\t"), w.split("\t")


def _break(how: str, folder: Path) -> None:
    ids, w = _fields(folder, 5, 2)
    if how == "no empty field":
        _replace_line(folder, 5, 2, "\t".join(ids + w))
    elif how == "not a number":
        _replace_line(folder, 5, 2, "\t".join(ids[:3] + ["x"] + ids[4:]) + "\t\t" + "\t".join(w))
    elif how == "partial token":
        _replace_line(folder, 5, 2, "\t".join(ids[:-1]) + "\t\t" + "\t".join(w[:-1]))
    elif how == "ids and weights":
        _replace_line(folder, 5, 2, "\t".join(ids) + "\t\t" + "\t".join(w[:-1]))
    elif how == "bad weight":
        _replace_line(folder, 5, 2, "\t".join(ids) + "\t\t" + "\t".join(["nan", *w[1:]]))
    elif how == "blank line":
        _replace_line(folder, 5, 2, "")
    elif how == "token count":
        _replace_line(folder, 5, 2, "\t".join(ids[:-6]) + "\t\t" + "\t".join(w[:-6]))
    elif how == "line count":
        p = folder / "expert_weights_5.txt"
        p.write_text("\n".join(p.read_text().split("\n")[1:]))
    elif how == "expert twice":
        _replace_line(folder, 5, 2, "\t".join([ids[1], *ids[1:]]) + "\t\t" + "\t".join(w))
    elif how == "id beyond E":
        _replace_line(folder, 5, 2, "\t".join(["64", *ids[1:]]) + "\t\t" + "\t".join(w))
    elif how == "missing layer":
        (folder / "expert_weights_5.txt").unlink()
    elif how == "extra layer":
        (folder / "expert_weights_27.txt").write_text((folder / "expert_weights_5.txt").read_text())


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("no empty field", r"expert_weights_5\.txt:2: no empty field between the ids and the weights"),
        ("not a number", r"expert_weights_5\.txt:2: field 4 \(an expert id\) is 'x', not a whole number"),
        ("partial token", r"expert_weights_5\.txt:2: 23 expert ids, not a whole number of tokens of top-6"),
        ("ids and weights", r"expert_weights_5\.txt:2: 24 expert ids but 23 weights"),
        ("bad weight", r"expert_weights_5\.txt:2: field 26 \(a routing weight\) is nan"),
        ("blank line", r"expert_weights_5\.txt:2: a blank line"),
        ("token count", r"expert_weights_5\.txt:2: 3 tokens, but line 2 of expert_weights_1\.txt has 4"),
        ("line count", r"expert_weights_5\.txt: 2 lines, but expert_weights_1\.txt has 3"),
        ("expert twice", r"expert_weights_5\.txt:2: token 0"),
        ("id beyond E", r"expert_weights_5\.txt:2: token 0"),
        ("missing layer", r"law: no expert_weights_5\.txt \(1 of deepseek-v2-lite's 26 MoE layers missing\)"),
        ("extra layer", r"law: expert_weights_27\.txt is not a MoE layer of deepseek-v2-lite"),
    ],
)
def test_malformed_logs_are_refused_naming_the_file_and_line(tmp_path, how, message):
    src, _ = scores_dir(tmp_path / "expert_scores")
    _break(how, src / "law")
    with pytest.raises(TraceFormatError) as exc:
        import_trace(src, out=tmp_path / "t", model=V2LITE)
    assert re.search(message, str(exc.value)), str(exc.value)
    assert not (tmp_path / "t").exists()


def test_another_models_topology_is_refused_and_detection_is_strict(tmp_path):
    src, _ = scores_dir(tmp_path / "expert_scores")
    want = (
        r"intent: expert_weights_1\.txt is not a MoE layer of deepseek-v3-tiny \(deepseek-v3-tiny's MoE layers are "
        r"3\.\.60; ESFT's logs are DeepSeek-V2-Lite's, layers 1\.\.26: leave --model out\)"
    )
    with pytest.raises(TraceFormatError, match=want):
        import_trace(src, out=tmp_path / "t", model=model_info_for("deepseek-v3-tiny"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "other" / "sub").mkdir(parents=True)
    (tmp_path / "other" / "sub" / "expert_weights.txt").write_text("1\t\t0.5\n")
    for path in (tmp_path / "empty", tmp_path / "other", src / "law" / "expert_weights_1.txt"):
        assert not esft.detect(b"", path)


def test_cli_imports_without_model_and_other_formats_still_need_one(tmp_path):
    src, _ = scores_dir(tmp_path / "expert_scores")
    res = runner.invoke(app, ["import", str(src), "--format", "esft", "-o", str(tmp_path / "t"), "--quiet"])
    assert res.exit_code == 0, res.output
    assert "5 requests, 27 tokens" in res.output and "teacher-forced sequences" in res.output
    res = runner.invoke(app, ["validate", str(tmp_path / "t")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["import", str(src), "-o", str(tmp_path / "u"), "--prompt-fraction", "0.2", "--quiet"])
    assert res.exit_code == 0, res.output  # detected without --format
    assert open_trace(tmp_path / "u").manifest["collection"]["prompt_span"] == {"prompt_fraction": 0.2}
    other = tmp_path / "r.jsonl"
    other.write_text('{"request": 0, "layer": 0, "position": 0, "stage": "prefill", "experts": [1, 2]}\n')
    res = runner.invoke(app, ["import", str(other), "-o", str(tmp_path / "v")])
    assert res.exit_code == 2 and "--format tokens needs --model" in res.output, res.output
    res = runner.invoke(app, ["import", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "w")])
    assert res.exit_code == 2 and "missing.jsonl: no such file" in res.output, res.output
