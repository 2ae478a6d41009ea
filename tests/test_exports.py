"""Placement files and their routers (placement/routers.py, placement/exports.py): every router kind
round-trips through the file, files written before the router kind was recorded still load into the
right router, and the engine exports stay byte for byte what they were.

``tests/golden/placement_v1/`` holds placement files written by moetrace before placement files
carried ``grouping.router_kind`` (planted two-domain trace of test_placement_compare, DP2TP4EP8 on
nodes of 4 GPUs, 8 redundant slots; the trace path in ``source`` shortened), and the SGLang,
TensorRT-LLM and vLLM exports that version made of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.baselines import linear
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.exports import (
    PlacementFile,
    export_placement,
    load_placement,
    save_placement,
)
from moetrace.placement.routers import (
    ROUTERS,
    CentroidRouter,
    NoRouter,
    PriceRouter,
    Router,
    fit_router,
)
from moetrace.placement.strategies import STRATEGIES
from moetrace.tracer.trace.schema import ModelInfo

GOLDEN = Path(__file__).parent / "golden" / "placement_v1"
EXPECTED_ROUTER = {"linear": NoRouter, "data": CentroidRouter, "joint": PriceRouter}
SUFFIX = {"sglang": "sglang.json", "trtllm": "trtllm.yaml", "vllm": "vllm.json"}

E, L, G = 16, 2, 2
MODEL = ModelInfo(
    name="m",
    source="test",
    architecture="Test",
    num_hidden_layers=3,
    moe_layers=(1, 2),
    num_experts=E,
    top_k=2,
    num_shared_experts=0,
    hidden_size=8,
)
DEP = parse_deployment("DP2TP4EP8", num_gpus_per_node=4)


def _routers() -> dict[str, Router]:
    """One router of every kind over the planted model on G nodes."""
    rng = np.random.default_rng(0)
    return {
        "none": NoRouter(),
        "centroid": CentroidRouter(
            num_groups=G,
            cluster_to_groups=((0,), (1,), (0, 1)),
            prefill_centroids_CF=rng.random((3, L * E)),
            decode_centroids_CF=rng.random((3, L * E)),
            match_rate=0.75,
        ),
        "price": PriceRouter(num_groups=G, node_prices_G=(0.0125, -0.003), match_rate=0.5),
    }


def test_every_router_kind_has_a_router_of_the_test_set():
    assert set(_routers()) == set(ROUTERS)


def test_every_strategy_names_a_router_kind_and_only_grouped_ones_route():
    for s in STRATEGIES:
        assert s.router in ROUTERS, s.name
        # a router needs the grouping; a grouped placement may be served router-free (joint_free)
        assert s.grouped or s.router == NoRouter.kind, s.name


@pytest.mark.parametrize("kind", sorted(ROUTERS))
def test_placement_file_round_trips_every_router_kind(kind, tmp_path):
    router = _routers()[kind]
    pf = PlacementFile(
        model=MODEL,
        deployment=DEP,
        strategy="s",
        placement=linear(num_layers=L, num_experts=E, num_slots=E, num_ranks=DEP.num_ep),
        router=router,
    )
    save_placement(pf, tmp_path / "a.json")
    section = json.loads((tmp_path / "a.json").read_text())["grouping"]
    assert section is None if kind == "none" else section["router_kind"] == kind  # the kind is written, first
    got = load_placement(tmp_path / "a.json")
    assert type(got.router) is type(router) and got.router.to_json() == router.to_json()
    assert got.model == MODEL and got.deployment == DEP
    save_placement(got, tmp_path / "b.json")
    assert (tmp_path / "b.json").read_bytes() == (tmp_path / "a.json").read_bytes()


@pytest.mark.parametrize("strategy", sorted(EXPECTED_ROUTER))
def test_files_of_older_moetrace_load_into_their_router_and_export_unchanged(strategy, tmp_path):
    old = GOLDEN / f"{strategy}.json"
    section = json.loads(old.read_text())["grouping"]
    assert section is None or "router_kind" not in section  # written before the kind was recorded
    pf = load_placement(old)
    assert type(pf.router) is EXPECTED_ROUTER[strategy]
    if isinstance(pf.router, PriceRouter):
        assert (
            list(pf.router.node_prices_G) == section["node_prices"]
            and pf.router.match_rate == section["router_match_rate"]
        )
    if isinstance(pf.router, CentroidRouter):
        assert [list(g) for g in pf.router.cluster_to_groups] == section["cluster_to_groups"]
        np.testing.assert_array_equal(pf.router.prefill_centroids_CF, section["prefill_centroids"])
    for fmt, suffix in SUFFIX.items():  # byte for byte what the older moetrace exported
        assert export_placement(pf, fmt=fmt) == (GOLDEN / f"{strategy}.{suffix}").read_text(), fmt
    save_placement(pf, tmp_path / "new.json")  # written again: the same file with the kind recorded
    new = json.loads((tmp_path / "new.json").read_text())
    old_obj = json.loads(old.read_text())
    if section is not None:
        assert new["grouping"].pop("router_kind") == pf.router.kind
        assert list(new["grouping"]) == list(section)
        if "decode_centroids" in section:  # the older writer printed float32 digits; both hold 6 decimals
            for key in ("decode_centroids", "prefill_centroids"):
                np.testing.assert_allclose(new["grouping"].pop(key), old_obj["grouping"].pop(key), atol=1e-6)
                section.pop(key)
        assert new["grouping"] == section
    assert {k: v for k, v in new.items() if k != "grouping"} == {k: v for k, v in old_obj.items() if k != "grouping"}


def test_unknown_router_kind_is_refused_cleanly(tmp_path):
    d = json.loads((GOLDEN / "joint.json").read_text())
    d["grouping"]["router_kind"] = "oracle"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(
        TraceFormatError, match=r"router_kind` 'oracle' is not a router this moetrace knows \(none, centroid, price\)"
    ):
        load_placement(bad)
    r = CliRunner().invoke(app, ["export", str(bad), "--format", "sglang", "-o", str(tmp_path / "o.json")])
    assert r.exit_code == 2 and "router_kind" in r.output and "Traceback" not in r.output


def test_explicit_kind_wins_over_keys(tmp_path):
    """A new file is read by its kind, not by which keys it happens to hold."""
    d = json.loads((GOLDEN / "joint.json").read_text())
    d["grouping"]["router_kind"] = "centroid"  # node prices, but declared a centroid router: its centroids are missing
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(TraceFormatError, match="grouping `decode_centroids` has shape"):
        load_placement(bad)


@pytest.mark.parametrize(
    "corrupt, fragment",
    [
        (lambda d: d["grouping"].__setitem__("cluster_to_groups", [[0], [2]]), "list of group lists (groups 0..1)"),
        (lambda d: d["deployment"].__setitem__("num_nodes", 4), "disagrees with DP2TP4EP8 on nodes of 4 GPUs"),
        (lambda d: d["deployment"].pop("config"), "`deployment` needs `config`"),
        (lambda d: d["model"].pop("top_k"), "manifest `model` lacks ['top_k']"),
    ],
)
def test_broken_sections_name_the_problem(corrupt, fragment, tmp_path):
    d = json.loads((GOLDEN / "data.json").read_text())
    corrupt(d)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(
        TraceFormatError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace(".", r"\.")
    ):
        load_placement(bad)


def test_fit_router_builds_the_registry_kind():
    assert isinstance(fit_router("none", grouping=None, provenance={}, num_groups=G), NoRouter)
    r = fit_router("price", grouping=None, provenance={"router_price": [0.5, -0.5]}, num_groups=G)
    assert isinstance(r, PriceRouter) and r.node_prices_G == (0.5, -0.5) and r.match_rate is None
    with pytest.raises(ConfigError, match="clustering"):
        fit_router("centroid", grouping=None, provenance={}, num_groups=G)


def test_routers_route_held_out_requests_from_their_prefill():
    """Centroid: nearest prefill centroid, its groups in turn; price: node share minus price, held-out rows only."""
    prefill_RLE = np.zeros((4, L, E), dtype=np.uint16)
    prefill_RLE[[0, 2], :, :8] = 3  # requests 0 and 2 use experts 0..7, requests 1 and 3 experts 8..15
    prefill_RLE[[1, 3], :, 8:] = 3
    is_test_R = np.array([False, True, True, True])
    placement = linear(num_layers=L, num_experts=E, num_slots=E, num_ranks=DEP.num_ep)  # node 0 holds experts 0..7
    c = np.zeros((2, L * E))
    c[0] = prefill_RLE[0].reshape(-1)
    c[1] = prefill_RLE[1].reshape(-1)
    centroid = CentroidRouter(
        num_groups=G, cluster_to_groups=((1,), (0,)), prefill_centroids_CF=c, decode_centroids_CF=c
    )
    routes = centroid.route(prefill_RLE, placement=placement, is_test_R=is_test_R, decode_RLE=prefill_RLE)
    assert routes.group_R.tolist() == [1, 0, 1, 0] and routes.match_rate == 1.0
    price = PriceRouter(num_groups=G, node_prices_G=(0.0, 0.0))
    routes = price.route(prefill_RLE, placement=placement, is_test_R=is_test_R)
    assert routes.group_R.tolist() == [0, 1, 0, 1] and routes.match_rate is None  # row 0 is training: not routed
    expensive = PriceRouter(num_groups=G, node_prices_G=(2.0, 0.0))  # a price above any share sends everyone to node 1
    assert expensive.route(prefill_RLE, placement=placement, is_test_R=is_test_R).group_R.tolist() == [0, 1, 1, 1]
    assert NoRouter().route(prefill_RLE, placement=placement, is_test_R=is_test_R).group_R is None
