"""`moetrace collect` end to end on -tiny models: output, privacy, refusal, kill and resume; and the
backend seam: a backend registered in a test runs through `collect` like HF and vLLM do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from factories import planted_rows
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.validate import find_problems

runner = CliRunner()
FAST = ["--model", "olmoe-1b-7b-tiny", "--max-new-tokens", "6"]


def _rows(path):
    arr = open_trace(path).token_arrays()
    order = np.lexsort((arr.position_T, arr.request_id_T))
    return arr.request_id_T[order], arr.position_T[order], arr.topk_ids_TLK[order]


def test_collect_writes_a_valid_trace_without_text(tmp_path):
    out = tmp_path / "t"
    res = runner.invoke(app, ["collect", *FAST, "--dataset", "math-word,code", "--per-dataset", "3", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "6 new requests" in res.output
    assert find_problems(out) == []
    t = open_trace(out)
    req = t.requests().collect()
    assert sorted(req["dataset"].to_list()) == ["code"] * 3 + ["math-word"] * 3
    assert "prompt_text" not in req.columns and "output_text" not in req.columns
    assert (req["output_tokens"] == 6).all()
    m = t.manifest
    import torch
    import transformers

    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    assert m["backend"] == {"name": "hf", "versions": versions, "device": "cpu"}  # the one key style
    assert m["collection"]["datasets"] == ["math-word", "code"]
    assert m["model"]["architecture"] == "OlmoeForCausalLM" and m["model"]["num_experts"] == 64
    for f in t.requests_files():
        assert "prompt_text" not in pq.read_schema(f).names


def test_store_text_is_opt_in(tmp_path):
    out = tmp_path / "t"
    res = runner.invoke(
        app, ["collect", *FAST, "--dataset", "chat", "--num-requests", "2", "--store-text", "-o", str(out)]
    )
    assert res.exit_code == 0, res.output
    req = open_trace(out).requests().collect()
    assert all(isinstance(x, str) and x for x in req["prompt_text"].to_list())
    assert find_problems(out) == []


def test_refuses_existing_output_and_full_size_model_on_cpu(tmp_path):
    out = tmp_path / "t"
    assert (
        runner.invoke(app, ["collect", *FAST, "--dataset", "chat", "--num-requests", "1", "-o", str(out)]).exit_code
        == 0
    )
    res = runner.invoke(app, ["collect", *FAST, "--dataset", "chat", "--num-requests", "1", "-o", str(out)])
    assert res.exit_code == 2 and "--resume" in res.output
    res = runner.invoke(
        app,
        [
            "collect",
            "--model",
            "mixtral-8x7b-tiny",
            "--dataset",
            "chat",
            "--num-requests",
            "1",
            "--resume",
            "-o",
            str(out),
        ],
    )
    assert res.exit_code == 2 and "different model" in res.output
    res = runner.invoke(app, ["collect", "--model", "deepseek-v3", "-o", str(tmp_path / "big")])
    assert res.exit_code == 2 and "deepseek-v3-tiny" in res.output and "671B" in res.output
    assert not (tmp_path / "big").exists()


def test_sigkill_then_resume_loses_nothing_and_duplicates_nothing(tmp_path):
    """Kill -9 mid-collection, resume, and compare with an uninterrupted run of the same command."""
    args = [*FAST, "--dataset", "math-word,chat", "--per-dataset", "6", "--batch-size", "2", "--max-new-tokens", "12"]
    ref = tmp_path / "ref"
    assert runner.invoke(app, ["collect", *args, "-o", str(ref)]).exit_code == 0

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "moetrace", "collect", *args, "-o", str(out)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    deadline = time.time() + 120
    while time.time() < deadline and len(list((out / "requests").glob("*.parquet"))) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed = len(list((out / "requests").glob("*.parquet")))
    assert 2 <= committed < 6, "the kill should land mid-run"
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    assert any("complete" in p for p in find_problems(out))
    before = open_trace(out, require_complete=False).requests().collect().height

    res = runner.invoke(app, ["collect", *args, "-o", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    assert f"{12 - before} new requests" in res.output
    assert find_problems(out) == []
    rid, pos, ids = _rows(out)
    rid0, pos0, ids0 = _rows(ref)
    assert np.array_equal(rid, rid0) and np.array_equal(pos, pos0)
    assert np.array_equal(np.sort(ids, -1), np.sort(ids0, -1))


def test_collect_from_a_local_checkpoint_directory(tmp_path):
    """`--model PATH` loads config, weights and tokenizer through transformers' real loaders."""
    from moetrace.tracer.backends.hf import build_tiny_model, tiny_tokenizer

    model, _ = build_tiny_model("mixtral-8x7b-tiny", seed=3)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    tiny_tokenizer().save_pretrained(ckpt)
    out = tmp_path / "t"
    res = runner.invoke(
        app,
        [
            "collect",
            "--model",
            str(ckpt),
            "--dataset",
            "code",
            "--num-requests",
            "2",
            "--max-new-tokens",
            "4",
            "-o",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    t = open_trace(out)
    assert t.model.source == str(ckpt) and t.model.architecture == "MixtralForCausalLM"
    assert (t.model.num_experts, t.model.top_k, t.model.num_moe_layers) == (8, 2, 32)
    assert find_problems(out) == []


def test_info_summarizes(tmp_path):
    out = tmp_path / "t"
    assert (
        runner.invoke(
            app, ["collect", *FAST, "--dataset", "chat,code", "--num-requests", "4", "-o", str(out)]
        ).exit_code
        == 0
    )
    res = runner.invoke(app, ["info", str(out)])
    assert res.exit_code == 0
    assert "olmoe-1b-7b-tiny" in res.output and "16 MoE layers of 16, 64 experts, top-8" in res.output
    assert "chat" in res.output and "total" in res.output


def test_vllm_backend_fails_early_without_writing(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; this checks the message when it is not")
    res = runner.invoke(
        app, ["collect", "--model", "deepseek-v3", "--backend", "vllm", "--dataset", "chat", "-o", str(tmp_path / "v")]
    )
    assert res.exit_code == 2 and "moetrace[vllm]" in res.output
    assert not (tmp_path / "v").exists()


def test_sharded_collection_from_the_cli(tmp_path):
    """Two shards into one directory, then merge-shards: same rows as one unsharded run."""
    out, ref = tmp_path / "sharded", tmp_path / "ref"
    args = [*FAST, "--dataset", "math-word,chat", "--num-requests", "6", "--max-new-tokens", "3"]
    for s in ("0/2", "1/2"):
        res = runner.invoke(app, ["collect", *args, "--shard", s, "-o", str(out)])
        assert res.exit_code == 0, res.output
        assert "merge-shards" in res.output
    assert not (out / "manifest.json").exists()
    res = runner.invoke(app, ["merge-shards", str(out)])
    assert res.exit_code == 0 and "2 shards merged (complete)" in res.output, res.output
    assert find_problems(out) == []
    assert runner.invoke(app, ["collect", *args, "-o", str(ref)]).exit_code == 0
    rid, pos, ids = _rows(out)
    rid0, pos0, ids0 = _rows(ref)
    assert np.array_equal(rid, rid0) and np.array_equal(pos, pos0)
    assert np.array_equal(np.sort(ids, -1), np.sort(ids0, -1))
    assert runner.invoke(app, ["collect", *args, "--shard", "2/2", "-o", str(out)]).exit_code != 0


@pytest.mark.parametrize("flag, value", [("--max-new-tokens", "0"), ("--batch-size", "0"), ("--temperature", "-1")])
def test_bad_generation_settings_fail_before_anything_is_written(tmp_path, flag, value):
    out = tmp_path / "t"
    res = runner.invoke(
        app,
        [
            "collect",
            "--model",
            "olmoe-1b-7b-tiny",
            "--dataset",
            "chat",
            "--num-requests",
            "1",
            flag,
            value,
            "-o",
            str(out),
        ],
    )
    assert res.exit_code == 2 and flag in res.output, res.output
    assert not out.exists()


# ---------------------------------------------------------------------------- the backend seam


def test_a_backend_is_one_registry_row_through_collect(planted_backend, tmp_path):
    """`auto` reads the registry, `collect` drives the backend only through the protocol, once each
    step, and the manifest's backend section has the one key style; resume and progress work as for
    every backend."""
    from moetrace.tracer.collect import CollectConfig
    from moetrace.tracer.sharding import run_collection

    config = CollectConfig(model="mixtral-8x7b", datasets=("math-word", "code"), per_dataset=3, max_new_tokens=4)
    out, started, progress = tmp_path / "t", [], []
    result = run_collection(
        config, out=out, on_start=lambda *a: started.append(a), on_progress=lambda r, t: progress.append(r)
    )
    assert result.backend == "planted" and result.num_new_requests == 6
    assert planted_backend.built[0].calls == ["check_environment", "load", "describe", "run"]
    assert started == [(6, 6)] and progress == [1, 2, 3, 4, 5, 6]
    assert "backend planted, model mixtral-8x7b" in "\n".join(result.summary_lines())
    assert find_problems(out) == []
    t = open_trace(out)
    assert t.manifest["backend"] == {"name": "planted", "versions": {"planted": "1.0"}, "rows": "seeded by request id"}
    ta = t.token_arrays()
    for rid in range(6):
        sel = ta.request_id_T == rid
        want = planted_rows(rid, int(sel.sum()), num_layers=32, num_experts=8, top_k=2).reshape(-1, 32, 2)
        assert np.array_equal(ta.topk_ids_TLK[sel][np.argsort(ta.position_T[sel])], want)

    again = run_collection(config, out=out, backend="planted", on_existing="resume")
    assert again.num_new_requests == 0 and again.stats.num_requests == 6
    assert planted_backend.built[1].calls == ["check_environment", "load", "describe", "run"]


def test_a_backend_that_fails_leaves_no_fresh_directory(planted_backend, tmp_path):
    from moetrace.tracer.collect import CollectConfig, collect

    config = CollectConfig(model="mixtral-8x7b", datasets=("chat",), num_requests=2)
    planted_backend.fail_in_run = True
    with pytest.raises(RuntimeError, match="the engine died"):
        collect(config, out=tmp_path / "t", backend="planted")
    assert not (tmp_path / "t").exists()


def test_every_registered_backend_builds_without_its_engine():
    """Each registry row builds an object with the protocol's methods, importing no torch or vLLM."""
    code = (
        "import sys; from moetrace.tracer.backends.base import CollectionBackend; "
        "from moetrace.tracer.backends.registry import BACKENDS, BackendSettings; "
        "built = {n: e.build(BackendSettings()) for n, e in BACKENDS.items()}; "
        "assert all(isinstance(b, CollectionBackend) for b in built.values()), built; "
        "heavy = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]; assert not heavy, heavy; "
        "print(sorted(built))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "['hf', 'vllm']"
