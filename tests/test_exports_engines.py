"""The engine exports added for issue #23: vllm-ascend's static expert map (from a placement) and
SGLang's ``logical_count`` (from a trace), each read back the way the consuming engine reads it.

The two readers below were written from the engines' loading code (docs/exports.md names the
files and versions); they are re-implementations of what those loaders check and compute, not
copies. ``tests/golden/exports/`` holds the vllm-ascend maps of the ``tests/golden/placement_v1``
placements (DP2TP4EP8, E=16, 8 redundant slots: 3 slots on each of 8 ranks).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import get_args, get_type_hints

import numpy as np
import pytest
from factories import stage_mask, write_trace
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.cli.place import export_cmd
from moetrace.errors import ConfigError
from moetrace.placement.baselines import linear
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.exports import (
    PLACEMENT_EXPORTS,
    TRACE_EXPORTS,
    CountStage,
    ExportFormat,
    PlacementFile,
    export_file,
    export_placement,
    load_placement,
    sglang_logical_count,
)
from moetrace.placement.maps import placement_from_phy2log
from moetrace.tracer.trace.schema import ModelInfo

PLACEMENTS = Path(__file__).parent / "golden" / "placement_v1"
GOLDEN = Path(__file__).parent / "golden" / "exports"
STRATEGIES = ("linear", "data", "joint")
runner = CliRunner()


# ------------------------------------------------------------------------------ vllm-ascend
def ascend_load(text: str, *, layer_id: int, ep_size: int, num_experts: int) -> tuple[np.ndarray | None, int]:
    """What vllm-ascend makes of an expert map for its MoE layer number ``layer_id`` (construction
    order; ``moe_layer_count`` is the MTP/draft layer): the physical→logical row it serves with
    ([P], physical id = rank * distinct-experts-of-rank-0 + local slot) and the physical count.

    Fails (AssertionError) where the engine would fail or silently serve something else: a layer
    beyond the table, ragged device lists (its tensor needs equal lengths), fewer devices than the
    EP size, ids outside 0..E-1, an expert twice on one device (one local slot per expert), an
    expert on no device, fewer physical slots than experts.
    """
    data = json.loads(text)
    count = data["moe_layer_count"]
    assert isinstance(count, int) and layer_id <= count, "Invalid EPLB Table"
    if layer_id == count:  # the draft layer takes only the slot count of layer 0
        return None, sum(len(d["device_expert"]) for d in data["layer_list"][0]["device_list"])
    devices = [d["device_expert"] for d in data["layer_list"][layer_id]["device_list"]]
    assert len({len(d) for d in devices}) == 1, "device lists of unequal length"
    assert len(devices) >= ep_size, f"{len(devices)} devices for EP size {ep_size}"
    physical_count = sum(len(d) for d in devices)
    assert physical_count >= num_experts, "fewer physical slots than experts"
    local_maps = []
    for experts in devices[:ep_size]:
        assert all(isinstance(e, int) and 0 <= e < num_experts for e in experts), experts
        assert len(set(experts)) == len(experts), f"an expert twice on one device: {experts}"
        m = np.full(num_experts, -1)
        m[experts] = np.arange(len(experts))
        local_maps.append(m)
    valid = int((local_maps[0] != -1).sum())
    phy = np.full(valid * ep_size, -1)
    for rank, m in enumerate(local_maps):
        for e in np.nonzero(m != -1)[0]:
            phy[rank * valid + m[e]] = e
    assert set(phy.tolist()) == set(range(num_experts)), "an expert on no device"
    return phy, physical_count


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vllm_ascend_map_is_the_golden_file_and_loads_as_the_placement(strategy):
    pf = load_placement(PLACEMENTS / f"{strategy}.json")
    text = export_placement(pf, fmt="vllm-ascend")
    assert text == (GOLDEN / f"{strategy}.vllm-ascend.json").read_text()
    data = json.loads(text)
    L, P = pf.placement.phy2log.shape
    W, E = pf.deployment.num_ep, pf.model.num_experts
    assert data["moe_layer_count"] == L == len(data["layer_list"])
    for i, layer in enumerate(data["layer_list"]):
        assert layer["layer_id"] == i and layer["device_count"] == W
        assert [d["device_id"] for d in layer["device_list"]] == list(range(W))
        phy, count = ascend_load(text, layer_id=i, ep_size=W, num_experts=E)
        assert count == P and count - E == 8  # the engine derives 8 redundant experts from the file
        np.testing.assert_array_equal(phy, pf.placement.phy2log[i])  # slot for slot what we placed
    assert ascend_load(text, layer_id=L, ep_size=W, num_experts=E) == (None, P)  # the MTP layer


def test_vllm_ascend_cli_writes_the_map(tmp_path):
    out = tmp_path / "eplb.json"
    r = runner.invoke(app, ["export", str(PLACEMENTS / "data.json"), "--format", "vllm-ascend", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_text() == (GOLDEN / "data.vllm-ascend.json").read_text()


def _placement_file(config: str, phy2log_LP: np.ndarray, *, gpus_per_node: int = 4) -> PlacementFile:
    L = phy2log_LP.shape[0]
    model = ModelInfo(
        name="m",
        source="test",
        architecture="Test",
        num_hidden_layers=L + 1,
        moe_layers=tuple(range(1, L + 1)),
        num_experts=4,
        top_k=2,
        num_shared_experts=0,
        hidden_size=8,
    )
    return PlacementFile(
        model=model,
        deployment=parse_deployment(config, num_gpus_per_node=gpus_per_node),
        strategy="eplb",
        placement=placement_from_phy2log(phy2log_LP, num_experts=4),
    )


def test_vllm_ascend_refuses_an_expert_twice_on_one_rank():
    # EP 2, 6 slots: rank 0 holds 0,1,2; rank 1 holds 3,3,0 in model layer 2 (the second MoE layer)
    pf = _placement_file("DP2TP1EP2", np.array([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 3, 0]]))
    with pytest.raises(ConfigError, match=r"EP rank 1 holds expert 3 twice in model layer 2 .*another strategy"):
        export_placement(pf, fmt="vllm-ascend")
    for fmt in ("sglang", "trtllm", "vllm"):  # engines that index slots, not (device, expert), take it
        export_placement(pf, fmt=fmt)


def test_vllm_ascend_refuses_ep_size_one():
    pf = _placement_file("DP1TP1EP1", linear(num_layers=1, num_experts=4, num_slots=4, num_ranks=1).phy2log)
    with pytest.raises(ConfigError, match="EP size 1"):
        export_placement(pf, fmt="vllm-ascend")


# ------------------------------------------------------------------------------ SGLang logical_count
MODEL = ModelInfo(  # layer 0 dense, layers 1..3 MoE
    name="m",
    source="test",
    architecture="Test",
    num_hidden_layers=4,
    moe_layers=(1, 2, 3),
    num_experts=6,
    top_k=2,
    num_shared_experts=0,
    hidden_size=8,
)


def _trace(tmp_path: Path, *, collection: dict | None = None) -> tuple[Path, np.ndarray, np.ndarray]:
    """A small trace on MODEL; returns it, its ids [T, L, K] and is_decode_T."""
    rng = np.random.default_rng(7)
    R, L, E, K = 9, 3, 6, 2
    ptok, otok = rng.integers(1, 12, size=R), rng.integers(1, 9, size=R)
    T = int((ptok + otok).sum())
    ids = np.argsort(rng.random((T, L, E)), axis=-1)[..., :K].astype(np.int16)
    ids[rng.random((T, L)) < 0.1] = -1  # some (token, layer) not recorded
    path = write_trace(
        tmp_path / "t",
        model=MODEL,
        dataset_R=["d"] * R,
        prompt_tokens_R=ptok,
        output_tokens_R=otok,
        topk_ids_TLK=ids,
        collection=collection,
    )
    return path, ids, stage_mask(ptok, otok)


def sglang_read_logical_count(text: str, *, num_layers: int, num_experts: int) -> np.ndarray:
    """SGLang's reading of ``--init-expert-location FILE.json``: a dict without
    ``physical_to_logical_map`` and with ``logical_count`` goes to its start-up EPLB, a 2-D count
    gaining a leading axis; the EPLB needs [*, num_layers, num_logical_experts] integer counts and
    sums (or, for the vec algorithms, chunks) the leading axis."""
    data = json.loads(text)
    assert "physical_to_logical_map" not in data and "logical_count" in data
    counts = np.asarray(data["logical_count"])
    if counts.ndim == 2:
        counts = counts[None]
    assert counts.shape[1:] == (num_layers, num_experts) and counts.dtype.kind == "i", (counts.shape, counts.dtype)
    return counts


@pytest.mark.parametrize("stage", ["decode", "prefill", "both"])
def test_logical_count_equals_the_traces_counts(tmp_path, stage):
    path, ids, dec_T = _trace(tmp_path)
    keep_T = {"decode": dec_T, "prefill": ~dec_T, "both": np.ones_like(dec_T)}[stage]
    expected_LE = np.zeros((3, 6), np.int64)  # plain numpy: one count per recorded (token, layer, slot)
    t, l, k = np.nonzero((ids >= 0) & keep_T[:, None, None])
    np.add.at(expected_LE, (l, ids[t, l, k]), 1)
    text = export_file(path, fmt="sglang-logical-count", stage=stage)
    got = sglang_read_logical_count(text, num_layers=4, num_experts=6)
    assert got.shape == (1, 4, 6)
    assert got[0, 0].tolist() == [0] * 6  # the dense layer
    np.testing.assert_array_equal(got[0, 1:], expected_LE)  # model layers 1..3 = MoE layers 0..2


def test_logical_count_cli_defaults_to_decode(tmp_path):
    path, ids, dec_T = _trace(tmp_path)
    out = tmp_path / "counts.json"
    r = runner.invoke(app, ["export", str(path), "--format", "sglang-logical-count", "-o", str(out), "-q"])
    assert r.exit_code == 0, r.output
    assert "expert counts" in r.output
    assert out.read_text() == export_file(path, fmt="sglang-logical-count", stage="decode")
    assert np.sum(json.loads(out.read_text())["logical_count"]) == int((ids[dec_T] >= 0).sum())


def test_logical_count_refuses_a_stage_the_trace_did_not_record(tmp_path):
    path, _, _ = _trace(tmp_path, collection={"stages": ["prefill"]})
    with pytest.raises(ConfigError, match="holds no decode counts: pass --stage prefill"):
        export_file(path, fmt="sglang-logical-count")


def test_sglang_logical_count_refuses_counts_of_another_shape():
    with pytest.raises(ConfigError, match=r"shape \(3 MoE layers, 6 experts\)"):
        sglang_logical_count(np.zeros((4, 6), np.int64), model=MODEL)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["{placement}", "--format", "sglang-logical-count"], "pass the trace directory"),
        (["{trace}", "--format", "sglang"], "converts a placement JSON: write one with `moetrace place"),
        (
            ["{placement}", "--format", "vllm-ascend", "--stage", "decode"],
            "--stage and --allow-incomplete read a trace",
        ),
    ],
)
def test_wrong_input_for_the_format_is_one_line(tmp_path, args, fragment):
    path, _, _ = _trace(tmp_path)
    where = {"{placement}": str(PLACEMENTS / "data.json"), "{trace}": str(path)}
    out = tmp_path / "o.json"
    r = runner.invoke(app, ["export", *[where.get(a, a) for a in args], "-o", str(out)])
    assert r.exit_code == 2 and fragment in " ".join(r.output.split()) and "Traceback" not in r.output, r.output
    assert not out.exists()


def test_cli_offers_exactly_the_librarys_formats_and_stages():
    hints = get_type_hints(inspect.unwrap(export_cmd), include_extras=True)
    assert get_args(get_args(hints["fmt"])[0]) == get_args(ExportFormat) == PLACEMENT_EXPORTS + TRACE_EXPORTS
    stage_literal, none = get_args(get_args(hints["stage"])[0])  # Literal[...] | None
    assert get_args(stage_literal) == get_args(CountStage) and none is type(None)
