"""``export --format aisimulate-popularity``: aisimulate's model expert-popularity bundle (ai-dynamo/aisimulate, the
loader ``python/aisimulate/src/aiconfigurator_core/sdk/expert_popularity.py`` at commit 599f18f1, schema_version 1;
the database of PR ai-dynamo/aisimulate#89, consumed by #153).

``aisimulate_validate`` below is a rendering of their ``validate_expert_popularity_bundle`` (every check it makes:
two files only, ``schema_version``, public provenance keys, no private paths, the folder name from ``model.id``, the
Parquet name, SHA-256 and row count, the exact Arrow schema, the dense layer x expert grid, one routed-token count per
layer, picks = tokens x top-k, the hit rates and shares to 1e-15, the ranks). No file of theirs is vendored.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from factories import write_trace
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ConfigError
from moetrace.placement.exports import export_bundle, trace_expert_counts
from moetrace.tracer.trace.profile import LoadProfile, write_profile
from moetrace.tracer.trace.schema import ModelInfo

runner = CliRunner()
MODEL = ModelInfo(
    name="m",
    source="org/m-moe",
    architecture="TestMoeForCausalLM",
    num_hidden_layers=4,
    moe_layers=(1, 2, 3),
    num_experts=6,
    top_k=2,
    num_shared_experts=0,
    hidden_size=8,
)
SCHEMA = pa.schema(
    [
        pa.field("layer_id", pa.int32(), nullable=False),
        pa.field("expert_id", pa.int32(), nullable=False),
        pa.field("activation_count", pa.uint64(), nullable=False),
        pa.field("routed_token_count", pa.uint64(), nullable=False),
        pa.field("token_hit_rate", pa.float64(), nullable=False),
        pa.field("assignment_share", pa.float64(), nullable=False),
        pa.field("popularity_rank", pa.int32(), nullable=False),
    ]
)
PUBLIC = {
    "collection_checkpoint",
    "collection_result_sha256",
    "collector_code_sha256",
    "count_replication_factor",
    "framework",
    "framework_version",
    "image_reference",
    "image_sha256",
    "normalized_counts_sha256",
    "observation_source",
    "published_at",
    "routing_equivalence_evidence",
    "routing_observation_method",
}
PRIVATE = (re.compile(r"/(?:home|Users|scratch|fsx|lustre)/"), re.compile(r"\b10(?:[.][0-9]{1,3}){3}\b"))


def aisimulate_validate(bundle: Path) -> tuple[dict[str, Any], pa.Table]:
    """Their ``validate_expert_popularity_bundle`` (expert_popularity.py @ 599f18f1), every check an assertion."""
    assert sorted(p.name for p in bundle.iterdir()) == ["metadata.yaml", "model_expert_popularity.parquet"]
    meta = yaml.safe_load((bundle / "metadata.yaml").read_text(encoding="utf-8"))
    assert isinstance(meta, dict) and meta.get("schema_version") == 1
    assert not set(meta["provenance"]) - PUBLIC

    def visit(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, list):
            for v in value:
                visit(v)
        elif isinstance(value, str):
            assert not any(p.search(value) for p in PRIVATE), value

    visit(meta)
    parts = meta["model"]["id"].split("/")
    assert len(parts) == 2 and bundle.name == "--".join(parts)
    pmeta = meta["files"]["parquet"]
    assert pmeta["name"] == "model_expert_popularity.parquet"
    path = bundle / pmeta["name"]
    assert pmeta["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    table = pq.read_table(path)
    assert pmeta["rows"] == table.num_rows and table.schema == SCHEMA and table.num_rows
    routing = meta["routing"]
    layers, E, K = [int(x) for x in routing["moe_layer_ids"]], int(routing["num_routed_experts"]), int(routing["top_k"])
    assert layers and E > 0 and 0 < K <= E and table.num_rows == len(layers) * E
    cols = {n: table[n].to_numpy(zero_copy_only=False) for n in table.column_names}
    assert set(zip(cols["layer_id"].tolist(), cols["expert_id"].tolist())) == {(l, e) for l in layers for e in range(E)}
    for layer in layers:
        m = cols["layer_id"] == layer
        counts, routed, experts = cols["activation_count"][m], cols["routed_token_count"][m], cols["expert_id"][m]
        assert len(set(routed.tolist())) == 1 and int(routed[0]) > 0
        assert int(counts.sum(dtype=np.uint64)) == int(routed[0]) * K
        assert np.allclose(cols["token_hit_rate"][m], counts.astype(np.float64) / float(routed[0]), rtol=0, atol=1e-15)
        assert np.allclose(
            cols["assignment_share"][m], counts.astype(np.float64) / float(int(routed[0]) * K), rtol=0, atol=1e-15
        )
        order = np.lexsort((experts, -counts.astype(np.int64)))
        ranks = np.empty(E, dtype=np.int32)
        ranks[order] = np.arange(1, E + 1, dtype=np.int32)
        assert np.array_equal(cols["popularity_rank"][m], ranks)
    return meta, table


def _trace(tmp_path: Path) -> Path:
    rng = np.random.default_rng(9)
    R = 7
    ptok, otok = rng.integers(1, 10, size=R), rng.integers(1, 8, size=R)
    T = int((ptok + otok).sum())
    p = rng.dirichlet(np.ones(6) * 0.5)  # skewed popularity, ties unlikely
    ids = np.stack([[rng.choice(6, size=2, replace=False, p=p) for _ in range(3)] for _ in range(T)]).astype(np.int16)
    ids[np.cumsum(ptok + otok) - 1] = -1
    return write_trace(
        tmp_path / "t", model=MODEL, dataset_R=["d"] * R, prompt_tokens_R=ptok, output_tokens_R=otok, topk_ids_TLK=ids
    )


def _write(bundle: Path, files: dict[str, bytes]) -> Path:
    bundle.mkdir(parents=True)
    for name, data in files.items():
        (bundle / name).write_bytes(data)
    return bundle


@pytest.mark.parametrize("stage", ["decode", "prefill", "both"])
def test_aisimulate_599f18f1_bundle_validates_and_holds_the_traces_counts(tmp_path, stage):
    path = _trace(tmp_path)
    files = export_bundle(path, fmt="aisimulate-popularity", stage=stage)
    meta, table = aisimulate_validate(_write(tmp_path / "out" / "org--m-moe", files))
    counts_LE, _ = trace_expert_counts(path, stage=stage)
    got = table["activation_count"].to_numpy().reshape(3, 6)
    assert np.array_equal(got, counts_LE)
    assert table["layer_id"].to_numpy().tolist() == np.repeat([1, 2, 3], 6).tolist()
    assert meta["routing"]["moe_layer_ids"] == [1, 2, 3] and meta["routing"]["top_k"] == 2
    assert meta["model"]["id"] == "org/m-moe"
    assert meta["measurement"]["phase"] == {"both": "prefill+decode"}.get(stage, stage)
    assert export_bundle(path, fmt="aisimulate-popularity", stage=stage) == files  # byte-stable


def test_aisimulate_599f18f1_from_a_load_profile(tmp_path):
    counts = np.array([[[4, 2, 0, 0, 1, 1], [2, 2, 2, 2, 0, 0], [4, 4, 0, 0, 0, 0]]], dtype=np.int64)
    prof = tmp_path / "p.profile.parquet"
    write_profile(LoadProfile(model=MODEL, counts={"mixed": counts}), prof, overwrite=False)
    files = export_bundle(prof, fmt="aisimulate-popularity", model_id="acme/m")
    meta, table = aisimulate_validate(_write(tmp_path / "acme--m", files))
    assert table["routed_token_count"].to_numpy().tolist() == [4] * 18
    assert meta["measurement"]["phase"] == "prefill+decode"
    assert meta["provenance"]["observation_source"] == "moetrace load profile"


def test_aisimulate_599f18f1_refusals_are_one_line(tmp_path):
    path = _trace(tmp_path)
    with pytest.raises(ConfigError, match="name the output folder org--m-moe"):
        export_bundle(path, fmt="aisimulate-popularity", folder_name="popularity")
    with pytest.raises(ConfigError, match="--model-id ORG/NAME"):
        export_bundle(path, fmt="aisimulate-popularity", model_id="just-a-name")
    counts = np.zeros((1, 3, 6), dtype=np.int64)
    counts[0, :2, :2] = 3
    prof = tmp_path / "p.profile.parquet"
    write_profile(LoadProfile(model=MODEL, counts={"decode": counts}), prof, overwrite=False)
    with pytest.raises(ConfigError, match="model layer 3 has no routed token"):
        export_bundle(prof, fmt="aisimulate-popularity")
    counts[0, 2, 0] = 3  # 3 picks of top-2: not whole tokens
    write_profile(LoadProfile(model=MODEL, counts={"decode": counts}), prof, overwrite=True)
    with pytest.raises(ConfigError, match="3 expert picks, not a whole number of tokens of top-2"):
        export_bundle(prof, fmt="aisimulate-popularity")


def test_aisimulate_599f18f1_cli(tmp_path):
    path = _trace(tmp_path)
    out = tmp_path / "bundles" / "org--m-moe"
    r = runner.invoke(app, ["export", str(path), "--format", "aisimulate-popularity", "-o", str(out)])
    assert r.exit_code == 0, r.output
    aisimulate_validate(out)
    bad = tmp_path / "bundles" / "pop"
    r = runner.invoke(app, ["export", str(path), "--format", "aisimulate-popularity", "-o", str(bad)])
    assert r.exit_code != 0 and "name the output folder org--m-moe" in r.output and "Traceback" not in r.output
    assert not bad.exists()
    r = runner.invoke(
        app, ["export", str(path), "--format", "sglang-logical-count", "--model-id", "a/b", "-o", str(bad)]
    )
    assert r.exit_code != 0 and "--model-id applies to --format aisimulate-popularity" in r.output
