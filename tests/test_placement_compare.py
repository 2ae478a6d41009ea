"""End to end: a planted trace → place/compare/export through the CLI and the library."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from factories import PLANTED, planted_trace
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.compare import CompareConfig, expert_copy_floor, load_trace_data, run_compare
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.exports import export_placement, load_placement
from moetrace.placement.report import compare_notes, format_compare_summary
from moetrace.placement.routers import CentroidRouter
from moetrace.placement.strategies import STRATEGIES, STRATEGY_NAMES

E, K, L = 16, 2, 2
MODEL = PLANTED  # 2 MoE layers of E experts, top-K


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return planted_trace(tmp_path_factory.mktemp("t") / "planted", structured=True)


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    return planted_trace(tmp_path_factory.mktemp("t") / "flat", structured=False)


def _cfg(**kw):
    # 2 nodes x 4 GPUs, 2 experts per GPU: linear puts experts 0..7 on node 0, so each domain is split
    return CompareConfig(
        deployment=parse_deployment("DP2TP4EP8", num_gpus_per_node=4),
        num_batches=50,
        num_batch_requests=8,
        strategies=("linear", "round_robin", "eplb", "data", "improved", "joint"),
        **kw,
    )


def test_grouped_placers_remove_inter_node_traffic_on_planted_domains(planted):
    data = load_trace_data(planted, test_fraction=0.25, seed=0)
    res = run_compare(data, _cfg())
    norm = {r.strategy: r.inter_node_normalized_median for r in res.summary_rows()}
    assert norm["linear"] == pytest.approx(1.0)
    assert norm["data"] == norm["improved"] == norm["joint"] == 0.0  # every token finds its experts on its node
    # the oracle is the fastest row found within the node-load limit (predicted all-to-all time per step)
    t = {r.strategy: r for r in res.summary_rows()}
    within = [s for s, r in t.items() if not r.is_bound and not r.over_node_load_limit]
    assert all(t["oracle"].a2a_time_normalized_median <= t[s].a2a_time_normalized_median for s in within)
    assert norm["round_robin"] > 0.5 and norm["eplb"] > 0.5
    assert res.placed["data"].router_match_rate == 1.0


def test_nobody_wins_on_structureless_traces(flat):
    data = load_trace_data(flat, test_fraction=0.25, seed=0)
    res = run_compare(data, _cfg())
    for r in res.summary_rows():  # the bounds fit the 20 held-out requests themselves: they may overfit
        if not r.is_bound:
            assert 0.85 < r.inter_node_normalized_median < 1.15, r


def test_expert_copy_floor_is_below_any_membership_and_routing():
    """The floor bounds (1 - local share) / (1 - 1/G) for every J-per-node membership and any routing."""
    rng = np.random.default_rng(0)
    R, L, E, G = 30, 3, 12, 3
    J = E // G
    x_RLE = rng.poisson(rng.gamma(0.5, 2.0, (R, L, E)))
    x_RLE[:, :, 0] += 1
    floor = expert_copy_floor(x_RLE, rows=np.arange(R), num_groups=G, num_slots=E)
    share_RLE = x_RLE / x_RLE.sum(axis=(1, 2), keepdims=True)
    # each request's own top-J experts of every layer: the ceiling the floor is built from
    ceiling = np.mean([np.sort(share_RLE[r], axis=1)[:, -J:].sum() for r in range(R)])
    assert floor == pytest.approx((1 - ceiling) / (1 - 1 / G))
    for _ in range(300):
        member_LGE = np.zeros((L, G, E), dtype=bool)
        for l in range(L):
            member_LGE[l, np.repeat(np.arange(G), J), rng.permutation(E)] = True
        node_R = rng.integers(0, G, R)
        local = np.mean([(share_RLE[r] * member_LGE[:, node_R[r], :]).sum() for r in range(R)])
        assert (1 - local) / (1 - 1 / G) >= floor - 1e-12
    # tight: G requests, each using only its own block of J experts, placed block by block
    block_RLE = np.zeros((G, L, E))
    for g in range(G):
        block_RLE[g, :, g * J : (g + 1) * J] = rng.integers(1, 5, (L, J))
    assert expert_copy_floor(block_RLE, rows=np.arange(G), num_groups=G, num_slots=E) == pytest.approx(0.0)


def test_compare_reports_the_floor_with_expert_copies(planted, flat):
    for trace, planted_domains in ((planted, True), (flat, False)):
        res = run_compare(load_trace_data(trace, test_fraction=0.25, seed=0), _cfg(dedup="expert"))
        floor = res.manifest.expert_copy_floor
        if planted_domains:  # every request uses 8 experts, a node holds 8: nothing has to cross
            assert floor == pytest.approx(0.0)
        for r in res.summary_rows():
            assert r.inter_node_normalized_median >= floor - 0.05, r  # 50 small batches: a little noise
        floor_line = next(ln for ln in format_compare_summary(res).splitlines() if ln.startswith("floor"))
        assert floor_line.split()[1] == f"{floor:.3f}" and "inter-node bytes, proven for any placement" in floor_line
    no_floor = run_compare(load_trace_data(planted, test_fraction=0.25, seed=0), _cfg(dedup="rank"))  # not proven
    assert no_floor.manifest.expert_copy_floor is None


def test_cli_place_compare_export_roundtrip(planted, tmp_path):
    runner = CliRunner()
    out = tmp_path / "p.json"
    r = runner.invoke(
        app,
        [
            "place",
            str(planted),
            "--config",
            "DP2TP4EP8",
            "--gpus-per-node",
            "4",
            "--strategy",
            "data",
            "--redundancy",
            "8",
            "-o",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    pf = load_placement(out)
    assert pf.placement.phy2log.shape == (L, E + 8)
    assert isinstance(pf.router, CentroidRouter) and pf.router.num_clusters == 2

    sg = json.loads(export_placement(pf, fmt="sglang"))
    assert list(sg) == ["physical_to_logical_map"]  # SGLang passes the dict as keyword arguments
    full = np.array(sg["physical_to_logical_map"])
    assert full.shape == (3, E + 8)  # rows = num_hidden_layers; dense layer 0 trivial
    np.testing.assert_array_equal(full[1:], pf.placement.phy2log)
    np.testing.assert_array_equal(full[0], np.arange(E + 8) % E)

    tr = yaml.safe_load(export_placement(pf, fmt="trtllm"))
    assert tr["num_slots"] == E + 8 and tr["layer_updates_per_iter"] == 0
    assert sorted(tr["initial_global_assignments"]) == [1, 2]  # keyed by decoder-layer index
    assert tr["initial_global_assignments"][2] == pf.placement.phy2log[1].tolist()

    vout = tmp_path / "v.json"
    r = runner.invoke(app, ["export", str(out), "--format", "vllm", "-o", str(vout)])
    assert r.exit_code == 0, r.output
    vl = json.loads(vout.read_text())
    # vLLM's proposed eplb_config.initial_expert_map_path (PR #49572) reads a bare list: one
    # physical->logical row per MoE layer (or one shared row), never an object
    assert isinstance(vl, list) and vl == pf.placement.phy2log.tolist()
    assert len(vl) == L and all(len(row) == E + 8 and set(row) == set(range(E)) for row in vl)

    res = tmp_path / "res"
    r = runner.invoke(
        app,
        [
            "compare",
            str(planted),
            "--config",
            "DP2TP4EP8",
            "--gpus-per-node",
            "4",
            "--strategies",
            "linear,data",
            "--batches",
            "20",
            "--batch-requests",
            "8",
            "-o",
            str(res),
        ],
    )
    assert r.exit_code == 0, r.output
    import polars as pl

    layers = pl.read_parquet(res / "layers.parquet")
    assert layers.height == 4 * 20 * L and set(layers["strategy"]) == {"linear", "data", "perfect_routing", "oracle"}
    places = pl.read_parquet(res / "placements.parquet")
    assert places.filter(pl.col("strategy") == "data").height == L * E


def test_bad_inputs_give_clean_errors(planted, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["place", str(planted), "--config", "DP2TP4EP6", "-o", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "must cover the same GPUs" in r.output
    r = runner.invoke(
        app,
        [
            "place",
            str(planted),
            "--config",
            "DP2TP4EP8",
            "--gpus-per-node",
            "4",
            "--redundancy",
            "3",
            "-o",
            str(tmp_path / "x.json"),
        ],
    )
    assert r.exit_code == 2 and "do not divide over EP8" in r.output
    bad = tmp_path / "bad.json"
    good = tmp_path / "good.json"
    assert (
        runner.invoke(
            app,
            [
                "place",
                str(planted),
                "--config",
                "DP2TP4EP8",
                "--gpus-per-node",
                "4",
                "--strategy",
                "linear",
                "-o",
                str(good),
            ],
        ).exit_code
        == 0
    )
    d = json.loads(good.read_text())
    d["phy2log"][0][0] = d["phy2log"][0][1]  # expert 0 vanishes from layer 0
    bad.write_text(json.dumps(d))
    with pytest.raises(TraceFormatError, match="no slot"):
        load_placement(bad)
    r = runner.invoke(app, ["export", str(bad), "--format", "sglang", "-o", str(tmp_path / "o.json")])
    assert r.exit_code == 2 and "invalid placement" in r.output


@pytest.mark.parametrize(
    "corrupt, fragment",
    [
        (lambda d: d.__setitem__("deployment", []), "`deployment` must be a JSON object"),
        (lambda d: d["deployment"].__setitem__("num_ep", 0), "must be positive integers"),
        (lambda d: d["model"].__setitem__("num_experts", "16"), "must be positive integers"),
        (lambda d: d["model"].__setitem__("moe_layers", [1, 7]), "ascending distinct layer indices in 0..2"),
        (
            lambda d: d.__setitem__("phy2log", [[0.5] * 8] * 2),
            "`phy2log` must be a rectangular array of 64-bit integers",
        ),
        (lambda d: d["phy2log"][0].__setitem__(0, 10**30), "`phy2log` must be a rectangular array"),
        (lambda d: d.__setitem__("grouping", [1]), "`grouping` must be a JSON object"),
        (lambda d: d["grouping"].__setitem__("decode_centroids", [[1.0, 2.0], [3.0]]), "rectangular array of numbers"),
    ],
)
def test_corrupted_placement_files_raise_format_errors(planted, tmp_path, corrupt, fragment):
    """Regression: wrong types in a placement JSON crashed load_placement (TypeError, ZeroDivisionError, ...)
    or were silently truncated (float slot ids) instead of a clean TraceFormatError."""
    good = tmp_path / "good.json"
    r = CliRunner().invoke(
        app,  # data: a centroid router, whose decode_centroids the last case corrupts
        ["place", str(planted), "--config", "DP2TP4EP8", "--gpus-per-node", "4", "--strategy", "data", "-o", str(good)],
    )
    assert r.exit_code == 0, r.output
    d = json.loads(good.read_text())
    corrupt(d)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(TraceFormatError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        load_placement(bad)


def test_strategy_list_errors_name_the_problem():
    """Regression: `--strategies ,` said `unknown strategies []`; an empty list now says none was given."""
    with pytest.raises(ConfigError, match="no strategy given; choose from linear"):
        CompareConfig(deployment=parse_deployment("DP2TP4EP8", num_gpus_per_node=4), strategies=())
    with pytest.raises(ConfigError, match=r"unknown strategies \['foo'\]"):
        CompareConfig(deployment=parse_deployment("DP2TP4EP8", num_gpus_per_node=4), strategies=("linear", "foo"))


def _docs_strategy_rows() -> dict[str, tuple[str, str, str]]:
    """strategy -> (grouped, description, router) columns of the table under "## Strategies" in docs/placement.md."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "placement.md").read_text()
    section = text.split("## Strategies", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    return {cells[0].strip("| `"): (cells[1].strip(), cells[2], cells[3].rstrip(" |").strip("`")) for cells in rows}


def test_every_registered_strategy_is_in_the_docs_table_and_the_cli_help():
    """The registry is the one list: docs/placement.md's table and both commands' help follow it."""
    docs = _docs_strategy_rows()
    assert list(docs) == list(STRATEGY_NAMES), (
        "docs/placement.md's strategies table differs from placement/strategies.py"
    )
    for s in STRATEGIES:
        assert docs[s.name] == ("yes" if s.grouped else "no", s.description, s.router), s.name
    for cmd in ("place", "compare"):
        r = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
        assert r.exit_code == 0, r.output
        for name in STRATEGY_NAMES:
            assert re.search(rf"(?<![a-z_]){name}(?![a-z_])", r.output), f"`moetrace {cmd} --help` does not list {name}"


def test_cli_rejects_unknown_strategies_cleanly(planted, tmp_path):
    runner = CliRunner()
    r = runner.invoke(
        app, ["place", str(planted), "--config", "DP2TP4EP8", "--strategy", "best", "-o", str(tmp_path / "x.json")]
    )
    assert r.exit_code == 2 and "best" in r.output and "Traceback" not in r.output
    r = runner.invoke(
        app, ["compare", str(planted), "--config", "DP2TP4EP8", "--gpus-per-node", "4", "--strategies", "linear,best"]
    )
    assert r.exit_code == 2 and "unknown strategies ['best']; choose from " + ", ".join(STRATEGY_NAMES) in r.output


def test_compare_prints_the_library_summary(planted):
    """compare_cmd echoes placement.report's text: header, one aligned row per strategy."""
    r = CliRunner().invoke(
        app,
        [
            "compare",
            str(planted),
            "--config",
            "DP2TP4EP8",
            "--gpus-per-node",
            "4",
            "--strategies",
            "linear,data",
            "--batches",
            "10",
            "--batch-requests",
            "8",
        ],
    )
    assert r.exit_code == 0, r.output
    assert r.output.startswith("note: no -o: the results are printed, nothing is saved")  # said before the work
    assert r.output.rstrip().endswith("nothing saved (no -o): add -o DIR to keep the results for `moetrace dashboard`")
    lines = r.output.splitlines()[1:]
    assert lines[0].startswith("DP2TP4EP8 (2 nodes), 64 train / 16 test requests, 10 decode steps of 8 requests")
    assert (
        lines[1].startswith("copies: decode: one copy per (token, expert)")
        and "prefill: one copy per remote node" in lines[1]
    )
    assert lines[2].startswith("step model: h100 (fitted to measured tables); decode kernel deepep-ll: dispatch fp8")
    assert lines[3].startswith("links: NVLink 254 GB/s") and "MoE-layer time n/a" in lines[3]
    t = lines[:4] + lines[lines.index("decode steps:") :]  # the table under its stage's title
    head = t[5].split()
    assert head[:3] == ["strategy", "a2a", "time"] and head.index("inter") > head.index(
        "MoE"
    )  # time first, bytes after
    row = dict(zip(["strategy", "a2a", "p10", "p90", "moe", "bytes"], t[6].split()))
    assert row["strategy"] == "linear" and row["a2a"] == "1.000" and row["bytes"] == "1.000" and row["moe"] == "n/a"
    assert t[6].split()[-4:-2] == ["-", "1.00"]  # linear routes nothing: even nodes
    row = t[7].split()
    assert row[0] == "data" and row[-4] == "100%"  # every token local: the router matches its decode
    assert t[8].startswith("upper bounds (they see the held-out requests' decode; not deployable")
    assert [ln.split()[0] for ln in t[9:11]] == ["perfect_routing", "oracle"]
    data = load_trace_data(planted, test_fraction=0.2, seed=0)
    res = run_compare(
        data,
        CompareConfig(
            deployment=parse_deployment("DP2TP4EP8", num_gpus_per_node=4),
            num_batches=10,
            num_batch_requests=8,
            strategies=("linear", "data"),
        ),
    )
    summary = format_compare_summary(res).splitlines()
    assert summary == lines[: len(summary)]
    held_out = "warning: 16 held-out request(s) (fewer than 20): every step draws from the same few"
    small = "note: 1 decode token a GPU per step (8 requests over 8 EP ranks): an all-to-all this small is mostly"
    notes = compare_notes(res)
    assert [n[: len(held_out)] for n in notes[:1]] == [held_out]  # 80 requests, a fifth held out
    assert [n[: len(small)] for n in notes[1:]] == [small]  # --batch-requests 8 on 8 GPUs
    res.placed["data"].extra["groups_without_routed_requests"] = [1]
    assert compare_notes(res)[2:] == [  # 16 held-out requests on 2 nodes: too few to reach both by chance
        "note: data: 1 group(s) had no held-out request routed to them; those nodes idled in every step "
        "(more held-out requests or fewer clusters avoid this)"
    ]
    many = replace(res, manifest=replace(res.manifest, num_test_requests=2000))  # at scale: the router's doing
    assert "although 2000 requests were held out" in compare_notes(many)[-1]


def test_the_verdict_follows_moe_layer_time_where_all_to_all_time_ranks_otherwise():
    """compare's verdict (compare.json ``verdict``, the printed verdict line) ranks the deployable
    strategies within the node-load limit by MoE-layer time, all-to-all time beside it: a placement
    whose all-to-all is faster but whose slowest GPU reads more experts loses."""
    from moetrace.placement.compare import PlacedStrategy, compare_verdict
    from moetrace.placement.maps import placement_from_phy2log
    from moetrace.placement.report import verdict_line

    B, L = 5, 2

    def metrics(a2a: float, expert: float) -> dict[str, np.ndarray]:
        d = np.full((B, L), a2a / 2 / L)
        return {"dispatch_seconds": d, "combine_seconds": d, "moe_seconds": 2 * d + expert / L}

    m = {
        "linear": metrics(1.0, 1.0),
        "a2a_fast": metrics(0.8, 1.3),  # all-to-all 0.80 of linear, MoE layer 2.1 / 2.0
        "moe_fast": metrics(0.9, 0.9),  # all-to-all 0.90, MoE layer 1.8 / 2.0
        "over": metrics(0.5, 0.5),  # fastest, but its router overloads a node
    }
    pl = placement_from_phy2log(np.tile(np.arange(4), (L, 1)), num_experts=4)
    placed = {
        s: PlacedStrategy(
            strategy=s, placement=pl, extra={"busiest_node_load": 1.5 if s == "over" else 1.0, "node_load_limit": 1.1}
        )
        for s in m
    }
    v = compare_verdict(m, placed, list(m), reference="linear", measure="moe")
    assert v.measure == "moe_time" and v.by_moe_time and v.ranking == ("moe_fast", "linear", "a2a_fast")
    assert v.recommended == "moe_fast" and v.over_node_load_limit == ("over",)
    assert v.time_normalized["a2a_fast"] == pytest.approx(1.05) and v.a2a_time_normalized["a2a_fast"] == 0.8
    a2a = compare_verdict(m, placed, list(m), reference="linear", measure="a2a")  # expert size unknown
    assert a2a.ranking == ("a2a_fast", "moe_fast", "linear") and a2a.recommended == "a2a_fast"
    assert not a2a.by_moe_time and a2a.stages == {}
    line = verdict_line(v, reference="linear")
    assert line.startswith(
        "verdict (MoE-layer time, deployable within the node-load limit): recommended moe_fast 0.900"
    )
    assert "(all-to-all 0.900)" in line and "a2a_fast 1.050 (0.800)" in line


def test_simulating_beside_the_placing_changes_no_result(planted, tmp_path, monkeypatch):
    """Held-out tokens read first (each strategy simulated while the next is placed) or after placing (the
    large-trace path): the same result files, provenance and verdict included."""
    import polars as pl

    from moetrace.placement import compare
    from moetrace.placement.compare import write_results

    cfg = replace(_cfg(), strategies=("linear", "eplb", "data", "joint", "joint_free", "ours"))
    outs = {}
    for name, limit in (("beside", compare.EARLY_HELD_OUT_BYTES), ("after", 0)):
        monkeypatch.setattr(compare, "EARLY_HELD_OUT_BYTES", limit)
        data = load_trace_data(planted, test_fraction=0.25, seed=0, held_out_tokens=False)
        assert (compare.held_out_nbytes(data) <= limit) == (name == "beside")
        outs[name] = tmp_path / name
        outs[name].mkdir()
        write_results(run_compare(data, cfg), outs[name])
    files = sorted(f.name for f in outs["beside"].iterdir())
    assert files == sorted(f.name for f in outs["after"].iterdir()) and "compare.json" in files
    for f in files:
        a, b = outs["beside"] / f, outs["after"] / f
        if f.endswith(".parquet"):
            assert pl.read_parquet(a).equals(pl.read_parquet(b), null_equal=True), f
        else:
            assert json.loads(a.read_text()) == json.loads(b.read_text()), f


def test_the_held_out_bytes_estimate_is_what_is_read(planted):
    from moetrace.placement.compare import held_out_nbytes, with_held_out_tokens

    data = load_trace_data(planted, test_fraction=0.25, seed=0, held_out_tokens=False)
    read = with_held_out_tokens(data)
    assert read.test_topk_ids_TLK is not None and read.test_prefill_ids_TLK is not None
    assert held_out_nbytes(data) == read.test_topk_ids_TLK.nbytes + read.test_prefill_ids_TLK.nbytes > 0
    assert held_out_nbytes(read) == 0  # already read: nothing more to hold


def test_the_held_out_tokens_collected_in_the_counting_pass_are_those_read_after(planted):
    """One pass over the trace (``load_trace_data``) or a second one (``with_held_out_tokens``): the same
    arrays; over ``held_out_max_bytes`` they are left for the second pass."""
    from moetrace.placement.compare import with_held_out_tokens

    counted = load_trace_data(planted, test_fraction=0.25, seed=0, held_out_tokens=False)
    assert counted.test_topk_ids_TLK is None
    after = with_held_out_tokens(counted)
    once = load_trace_data(planted, test_fraction=0.25, seed=0)
    for f in ("test_topk_ids_TLK", "test_req_T", "test_prefill_ids_TLK", "test_prefill_req_T"):
        assert getattr(after, f) is not None and np.array_equal(getattr(once, f), getattr(after, f)), f
    assert np.array_equal(once.decode_RLE, counted.decode_RLE)
    nbytes = once.test_topk_ids_TLK.nbytes + once.test_prefill_ids_TLK.nbytes  # what was read (the bound is more)
    assert load_trace_data(planted, test_fraction=0.25, seed=0, held_out_max_bytes=1 << 30).test_req_T is not None
    assert load_trace_data(planted, test_fraction=0.25, seed=0, held_out_max_bytes=nbytes - 1).test_req_T is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_simulation_threads_yield_to_the_placing():
    """compare's simulation threads run at a higher nice value than the thread that places (the critical path)."""
    import os
    import threading

    from moetrace.placement import compare

    seen = {}

    def worker() -> None:
        compare.behind_the_placing()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["nice"] == min(before + compare.SIMULATION_NICE, 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the placing's own thread
