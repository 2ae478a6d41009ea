"""Sharded collection into one trace directory, and the merge of shard manifests (no Ray needed; the
Ray path on a real two-node cluster is tests/test_ray_cluster.py)."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest

from moetrace.errors import ConfigError, TraceFormatError
from moetrace.tracer import sharding as S
from moetrace.tracer.backends.registry import BackendSettings, choose_backend
from moetrace.tracer.collect import CollectConfig, collect, parse_shard, shard_prompts
from moetrace.tracer.datasets import load_prompts
from moetrace.tracer.trace import merge as M
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.validate import find_problems

CONFIG = CollectConfig(model="olmoe-1b-7b-tiny", datasets=("bundled",), per_dataset=2, max_new_tokens=3, batch_size=4)


def test_parse_shard():
    assert parse_shard("3/8") == (3, 8)
    for bad, match in [("3", "S/N"), ("a/b", "S/N"), ("8/8", "0..N-1"), ("-1/4", "0..N-1")]:
        with pytest.raises(ConfigError, match=match):
            parse_shard(bad)


def test_the_backend_is_chosen_once_with_auto_rules(monkeypatch):
    cpu, gpu = BackendSettings(device="cpu"), BackendSettings(device="cuda")
    assert choose_backend("hf", settings=gpu) == "hf" and choose_backend("vllm", settings=cpu) == "vllm"
    assert choose_backend("auto", settings=cpu) == "hf"  # a CPU run never starts vLLM
    assert choose_backend("auto", settings=cpu, on_ray=True) == "vllm"  # shards run on the cluster's GPU nodes
    with pytest.raises(ConfigError, match="one of auto, vllm, hf, not 'sglang'"):
        choose_backend("sglang", settings=cpu)
    # on a GPU device auto takes vLLM exactly when it is importable and a GPU is visible
    from moetrace.tracer.backends import vllm as V

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    monkeypatch.setattr(V, "visible_gpu_count", lambda: 2)
    assert choose_backend("auto", settings=gpu) == "vllm" and choose_backend("auto", settings=cpu) == "hf"
    monkeypatch.setattr(V, "visible_gpu_count", lambda: 0)
    assert choose_backend("auto", settings=gpu) == "hf"


def test_ray_shards_reserve_what_the_backend_row_asks_for():
    from moetrace.tracer.backends.registry import BACKENDS
    from moetrace.tracer.backends.vllm import VllmEngineConfig

    assert BACKENDS["vllm"].num_gpus(BackendSettings(engine=VllmEngineConfig(tp=4, dp=2, ep=8))) == 8.0
    assert BACKENDS["vllm"].num_gpus(BackendSettings()) == 1.0  # VllmEngineConfig() by default
    assert BACKENDS["hf"].num_gpus(BackendSettings(device="cuda:1")) == 1.0
    assert BACKENDS["hf"].num_gpus(BackendSettings(device="cpu")) == 0.0


def test_shard_and_ray_shards_exclude_each_other(tmp_path):
    with pytest.raises(ConfigError, match="exclude each other"):
        S.run_collection(CONFIG, out=tmp_path / "t", shard=(0, 2), ray_shards=2)
    assert not (tmp_path / "t").exists()


def test_shards_partition_the_run_and_mix_datasets():
    prompts = load_prompts(["bundled"], per_dataset=3)
    shards = [shard_prompts(prompts, shard=s, num_shards=4) for s in range(4)]
    ids = sorted(p.request_id for sh in shards for p in sh)
    assert ids == list(range(len(prompts)))
    assert len({p.dataset for p in shards[0]}) >= 3  # interleaved ids: each shard gets several datasets
    with pytest.raises(Exception, match="outside 0..3"):
        shard_prompts(prompts, shard=4, num_shards=4)


@pytest.fixture(scope="module")
def sharded_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "trace"
    for s in (0, 2):  # shard 1 later: the merge must notice it missing
        collect(CONFIG, out=out, backend="hf", shard=(s, 3))
    return out


def test_merge_refuses_a_missing_shard_then_merges_all(sharded_trace):
    with pytest.raises(TraceFormatError, match=r"shards \[1\] of 3 have no manifest"):
        M.merge_shards(sharded_trace)
    result = collect(CONFIG, out=sharded_trace, backend="hf", shard=(1, 3))
    assert result.stats.num_requests == 3  # ids 1, 4, 7 of 10
    assert "shard 1/3: when every shard is done, run: moetrace merge-shards" in result.summary_lines()[1]
    manifest = M.merge_shards(sharded_trace)
    assert manifest["complete"] is True and manifest["totals"]["num_requests"] == 10
    assert [s["shard"] for s in manifest["shards"]] == [0, 1, 2]
    assert "shard" not in manifest["collection"] and manifest["collection"]["num_shards"] == 3
    assert find_problems(sharded_trace) == []
    tr = open_trace(sharded_trace)
    req = tr.requests().collect()
    assert sorted(req["request_id"].to_list()) == list(range(10))
    assert tr.routing().collect().height == manifest["totals"]["num_tokens"]
    # resuming a finished shard runs nothing and leaves the other shards' files alone
    before = sorted(p.name for p in (sharded_trace / "routing").iterdir())
    again = collect(CONFIG, out=sharded_trace, backend="hf", shard=(1, 3), on_existing="resume")
    assert again.stats.num_requests == 3 and again.num_new_requests == 0
    assert sorted(p.name for p in (sharded_trace / "routing").iterdir()) == before


def _shard_manifest(i: int, n: int, **over):
    m = {
        "format": "moetrace.trace",
        "version": 1,
        "complete": True,
        "model": {"name": "x", "moe_layers": [0, 1]},
        "backend": {"name": "vllm", "versions": {"vllm": "0.32.0", "torch": "2.9.0"}},
        "collection": {"datasets": ["gsm8k"], "seed": 0, "shard": i, "num_shards": n},
        "totals": {"num_requests": 5, "num_tokens": 50 + i},
    }
    for k, v in over.items():
        m[k] = v
    return m


def test_merge_manifests_checks_agreement():
    good = {i: _shard_manifest(i, 2) for i in range(2)}
    merged = M.merge_manifests(good)
    assert merged["totals"] == {"num_requests": 10, "num_tokens": 101} and merged["complete"]
    bad = copy.deepcopy(good)
    bad[1]["model"]["moe_layers"] = [0]
    bad[1]["collection"]["seed"] = 7
    with pytest.raises(TraceFormatError) as exc:
        M.merge_manifests(bad)
    assert "shard 1: model differs" in str(exc.value) and "shard 1: collection differs" in str(exc.value)
    unfinished = copy.deepcopy(good)
    unfinished[0]["complete"] = False
    with pytest.raises(TraceFormatError, match=r"shards \[0\] are not complete"):
        M.merge_manifests(unfinished)
    assert M.merge_manifests(unfinished, allow_incomplete=True)["complete"] is False
    with pytest.raises(TraceFormatError, match="no shard manifests"):
        M.merge_manifests({})


def test_clashing_request_ids_are_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "requests").mkdir()
    (tmp_path / "manifests").mkdir()
    for i in range(2):
        (tmp_path / "manifests" / f"shard-00{i}.json").write_text(json.dumps(_shard_manifest(i, 2)))
        pq.write_table(
            pa.table({"request_id": pa.array([3, 4 + i], pa.int64())}),
            tmp_path / "requests" / f"shard00{i}-000000.parquet",
        )
    with pytest.raises(TraceFormatError, match="written by two shards .e.g. 3 by shards 0 and 1"):
        M.merge_shards(tmp_path)
