"""``import --stages``: captures that logged only generated tokens (or only the prompt), end to end.

A decode-only capture in the ``tokens`` format (Mixtral's shape: 32 MoE layers, 8 experts, top-2),
as public routing captures of GSM8K/HumanEval generations are, goes through import → the manifest's
``collection.stages`` → validate → analyze, which skips what needs the missing stage with a reason.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from moetrace.analysis.run import AnalyzeConfig, analyze
from moetrace.cli import app
from moetrace.errors import ConfigError, TraceFormatError
from moetrace.tracer.importers import import_trace
from moetrace.tracer.presets import model_info_for
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import stages_of
from moetrace.tracer.trace.validate import find_problems

MIXTRAL = model_info_for("mixtral-8x7b-tiny")  # 32 layers, all MoE, 8 experts, top-2
runner = CliRunner()


def capture(stage: str, *, requests: int = 8, tokens: int = 6, start: int = 0, seed: int = 0) -> list[dict]:
    """Per-token records of one stage: two datasets that prefer different experts, positions from ``start``."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(requests):
        ds = "gsm8k" if r % 2 == 0 else "humaneval"
        hot = [0, 1, 2, 3] if ds == "gsm8k" else [4, 5, 6, 7]
        for pos in range(start, start + tokens):
            for layer in MIXTRAL.moe_layers:
                out.append(
                    {
                        "request": f"{ds}-{r}",
                        "layer": layer,
                        "position": pos,
                        "stage": stage,
                        "experts": rng.choice(hot, 2, replace=False).tolist(),
                        "dataset": ds,
                    }
                )
    return out


def write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def cli_import(src, out, *extra):
    return runner.invoke(
        app, ["import", src, "--model", "mixtral-8x7b-tiny", "--format", "tokens", "-o", str(out), *extra]
    )


def test_decode_only_capture_imports_validates_and_analyses_skip_with_reason(tmp_path):
    src = write(tmp_path / "mixtral-gen.jsonl", capture("decode"))
    res = cli_import(src, tmp_path / "t", "--stages", "decode-only")
    assert res.exit_code == 0, res.output
    assert "8 requests" in res.output and "decode stage only" in res.output
    tr = open_trace(tmp_path / "t")
    assert tr.manifest["collection"]["stages"] == ["decode"] and stages_of(tr) == {"decode"}
    assert tr.manifest["collection"]["prompt_lengths_known"] is False  # positions counted generated tokens
    req = tr.requests().collect()
    assert req["prompt_tokens"].to_list() == [1] * 8 and req["output_tokens"].to_list() == [6] * 8
    ta = tr.token_arrays()
    assert (ta.topk_ids_TLK[~ta.is_decode_T] == -1).all()  # the prompt row: nothing recorded
    assert (ta.topk_ids_TLK[ta.is_decode_T] >= 0).all()
    assert find_problems(tmp_path / "t") == []
    assert runner.invoke(app, ["validate", str(tmp_path / "t")]).exit_code == 0

    out = tmp_path / "res"
    res = runner.invoke(
        app,
        [
            "analyze",
            str(tmp_path / "t"),
            "-o",
            str(out),
            "--only",
            "imbalance,correlation,classify",
            "--batch-size",
            "4",
        ],
    )
    assert res.exit_code == 0, res.output
    assert (
        "prefill↔decode correlation: skipped (needs prefill and decode routing; this trace recorded decode only "
        "(its manifest's collection.stages); run it on a trace that has prefill routing)" in res.output
    )
    assert "dataset classification: skipped (needs prefill routing" in res.output
    man = json.loads((out / "manifest.json").read_text())
    assert man["trace"]["stages"] == ["decode"]
    assert set(man["skipped"]) == {"prefill_decode", "classify"}
    assert "\n" not in man["skipped"]["prefill_decode"]
    assert not (out / "prefill_decode_pooled.parquet").exists() and not (out / "classify_accuracy.parquet").exists()
    import polars as pl

    imb = pl.read_parquet(out / "imbalance.parquet")
    assert set(imb["stage"]) == {"decode"} and imb["imbalance_factor"].is_finite().all()
    assert set(pl.read_parquet(out / "dataset_correlation.parquet")["stage"]) == {"decode"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["correlation"]["prefill_decode_skipped"] == man["skipped"]["prefill_decode"]
    assert summary["classify"]["skipped"] == man["skipped"]["classify"]
    html = tmp_path / "report.html"
    res = runner.invoke(app, ["dashboard", str(tmp_path / "t"), str(out), "-o", str(html)])
    assert res.exit_code == 0, res.output
    page = html.read_text()
    assert "prefill↔decode: skipped (needs prefill and decode routing" in page
    assert (
        "decode only (the other stage&#x27;s rows hold -1); prompt lengths unknown" in page
        or "decode only (the other stage's rows hold -1); prompt lengths unknown" in page
    )


def test_decode_only_positions_counting_the_prompt_keep_its_length(tmp_path):
    src = write(tmp_path / "abs.jsonl", capture("decode", requests=2, start=5))
    import_trace(src, out=tmp_path / "t", model=MIXTRAL, stages="decode-only")
    tr = open_trace(tmp_path / "t")
    assert "prompt_lengths_known" not in tr.manifest["collection"]
    req = tr.requests().collect()
    assert req["prompt_tokens"].to_list() == [5, 5] and req["output_tokens"].to_list() == [6, 6]
    assert find_problems(tmp_path / "t") == []


def test_strict_default_refuses_a_decode_only_capture_naming_the_option(tmp_path):
    src = write(tmp_path / "gen.jsonl", capture("decode", requests=2))
    res = cli_import(src, tmp_path / "t")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "no record has stage 'prefill'" in res.output and "--stages decode-only" in res.output
    assert not (tmp_path / "t").exists()
    gen_only = [dict(r, request="no-prompt") for r in capture("decode", requests=1, tokens=2)]
    mixed = capture("prefill", requests=2, tokens=3) + capture("decode", requests=2, start=3) + gen_only
    with pytest.raises(
        TraceFormatError, match=r"m.jsonl:\d+: request 'no-prompt': no prefill record .*--stages decode-only"
    ):
        import_trace(write(tmp_path / "m.jsonl", mixed), out=tmp_path / "t2", model=MIXTRAL)


def test_prefill_only_capture(tmp_path):
    src = write(tmp_path / "prompts.jsonl", capture("prefill", requests=6, tokens=4))
    res = cli_import(src, tmp_path / "t")
    assert res.exit_code == 2 and "no record has stage 'decode'" in res.output and "--stages prefill-only" in res.output
    res = cli_import(src, tmp_path / "t", "--stages", "prefill-only")
    assert res.exit_code == 0, res.output
    tr = open_trace(tmp_path / "t")
    assert tr.manifest["collection"]["stages"] == ["prefill"] and stages_of(tr.manifest) == {"prefill"}
    req = tr.requests().collect()
    assert req["prompt_tokens"].to_list() == [4] * 6 and req["output_tokens"].to_list() == [0] * 6
    assert find_problems(tmp_path / "t") == []
    summary = analyze(
        tmp_path / "t",
        tmp_path / "res",
        config=AnalyzeConfig(only=("imbalance", "correlation", "classify"), batch_size=2),
    )
    assert "recorded prefill only" in summary["correlation"]["prefill_decode_skipped"]
    assert "mean_accuracy" in summary["classify"]  # classification uses prefill counts: it runs
    assert set(summary["imbalance"]["mean_if"]["all"]) == {"prefill"}


def test_a_record_contradicting_the_declared_stages_is_a_clear_error(tmp_path):
    mixed = capture("prefill", requests=2, tokens=3) + capture("decode", requests=2, start=3)
    src = write(tmp_path / "mixed.jsonl", mixed)
    res = cli_import(src, tmp_path / "t", "--stages", "decode-only")
    assert res.exit_code == 2 and "Traceback" not in res.output
    line = res.output.strip().splitlines()
    assert any(
        "stage 'prefill'" in ln
        and "--stages decode-only declares a capture without prefill" in ln
        and "--stages both" in ln
        for ln in line
    )
    assert not (tmp_path / "t").exists()
    with pytest.raises(TraceFormatError, match=r"record\(s\) have stage 'decode' .*--stages prefill-only"):
        import_trace(src, out=tmp_path / "t", model=MIXTRAL, stages="prefill-only")
    import_trace(src, out=tmp_path / "t", model=MIXTRAL)  # what it is: both stages
    assert stages_of(open_trace(tmp_path / "t")) == {"prefill", "decode"}


def test_stages_apply_to_the_tokens_format_only(tmp_path):
    sg = {"meta_info": {"prompt_tokens": 2, "completion_tokens": 1, "routed_experts": ""}}
    src = write(tmp_path / "sg.jsonl", [sg])
    with pytest.raises(ConfigError, match="--stages decode-only applies to --format tokens"):
        import_trace(src, out=tmp_path / "t", model=MIXTRAL, stages="decode-only")


def test_stages_of_old_and_bad_manifests(tmp_path):
    assert stages_of({"collection": {"datasets": ["x"]}}) == {"prefill", "decode"}  # written before the key: both
    assert stages_of({}) == {"prefill", "decode"}
    for bad in ([], ["warmup"], "decode", ["decode", "decode"]):
        with pytest.raises(TraceFormatError, match="collection.stages"):
            stages_of({"collection": {"stages": bad}})
    src = write(tmp_path / "gen.jsonl", capture("decode", requests=2))
    import_trace(src, out=tmp_path / "t", model=MIXTRAL, stages="decode-only")
    man = json.loads((tmp_path / "t" / "manifest.json").read_text())
    man["collection"]["stages"] = ["decode", "warmup"]
    (tmp_path / "t" / "manifest.json").write_text(json.dumps(man))
    res = runner.invoke(app, ["validate", str(tmp_path / "t")])
    assert res.exit_code == 1 and "collection.stages" in res.output


def test_validate_catches_ids_in_a_stage_the_manifest_says_was_not_recorded(tmp_path):
    src = write(
        tmp_path / "both.jsonl", capture("prefill", requests=2, tokens=2) + capture("decode", requests=2, start=2)
    )
    import_trace(src, out=tmp_path / "t", model=MIXTRAL)
    man = json.loads((tmp_path / "t" / "manifest.json").read_text())
    man["collection"]["stages"] = ["decode"]  # a false claim: the prefill rows hold ids
    (tmp_path / "t" / "manifest.json").write_text(json.dumps(man))
    probs = find_problems(tmp_path / "t")
    assert probs == [
        "routing: 4 prefill rows hold expert ids but the manifest's `collection.stages` ['decode'] says "
        "prefill was not recorded (its rows must be -1)"
    ]


def test_placement_on_a_decode_only_trace_refuses_grouped_strategies_and_runs_the_rest(tmp_path):
    src = write(tmp_path / "gen.jsonl", capture("decode", requests=16))
    assert cli_import(src, tmp_path / "t", "--stages", "decode-only").exit_code == 0
    args = [
        "compare",
        str(tmp_path / "t"),
        "--config",
        "DP2TP2EP4",
        "--gpus-per-node",
        "2",
        "--batches",
        "5",
        "--batch-requests",
        "4",
    ]
    res = runner.invoke(app, [*args, "--strategies", "linear,data"])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "strategy 'data' groups requests and routes each by its prefill routing" in res.output
    assert "decode only" in res.output and "linear" in res.output  # names the way out
    res = runner.invoke(app, [*args, "--strategies", "linear,eplb"])
    assert res.exit_code == 0, res.output
    assert "upper bounds" not in res.output  # the bounds start from the joint placement, which needs prefill
    src = write(tmp_path / "pre.jsonl", capture("prefill", requests=16))
    assert cli_import(src, tmp_path / "p", "--stages", "prefill-only").exit_code == 0
    res = runner.invoke(
        app,
        [
            "place",
            str(tmp_path / "p"),
            "--config",
            "DP2TP2EP4",
            "--gpus-per-node",
            "2",
            "--strategy",
            "eplb",
            "-o",
            str(tmp_path / "x.json"),
        ],
    )
    assert res.exit_code != 0 and "recorded prefill routing only" in res.output
