"""Dashboard tests without a browser: inputs, the HTML file, figure data against its sources, CLI."""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from browser.checks import check_all
from browser.figjson import figures_from_html
from browser.fixtures import make_trace, produced
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.dashboards.inputs import detect
from moetrace.dashboards.report import DashboardConfig, write_dashboard
from moetrace.dashboards.theme import downsample, layer_slider
from moetrace.errors import ConfigError, TraceFormatError
from moetrace.tracer.trace.reader import open_trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return make_trace(tmp_path_factory.mktemp("dash") / "trace")


def test_detect_names_what_it_expected(tmp_path):
    (tmp_path / "manifest.json").write_text('{"format": "something.else"}')
    with pytest.raises(TraceFormatError, match=r"not a trace, analysis or placement.*something.else"):
        detect(tmp_path)
    with pytest.raises(TraceFormatError, match="no such directory"):
        detect(tmp_path / "missing")
    with pytest.raises(TraceFormatError, match=r"found manifest.json \(format 'something.else'\)\)"):  # listed once
        detect(tmp_path)
    with pytest.raises(TraceFormatError, match="manifest.json: not a directory"):  # a file, not a missing path
        detect(tmp_path / "manifest.json")


def test_report_is_one_offline_file(trace, tmp_path):
    rep = write_dashboard([trace], out=tmp_path / "r.html")
    text = rep.path.read_text()
    assert rep.size_bytes == rep.path.stat().st_size > 3_000_000  # plotly.js is inside
    assert "overview" in rep.sections and rep.num_figures >= 1
    # no external resources of any kind
    assert not re.search(r"<script[^>]+src=", text)
    assert not re.search(r"<link[^>]+href=", text)
    assert "default-src 'none'" in text
    assert not (tmp_path / ".r.html.tmp").exists()


def test_overview_lengths_equal_requests_table(trace, tmp_path):
    rep = write_dashboard([trace], out=tmp_path / "r.html")
    figs = figures_from_html(rep.path.read_text())
    fig = figs["overview-lengths"]
    req = open_trace(trace).requests().collect()
    assert fig["source"].endswith("requests")
    by = {}
    for t in fig["data"]:
        by.setdefault(t["name"], []).append(np.asarray(t["y"]))
    assert sorted(by) == sorted(req["dataset"].unique().to_list())
    for ds, (prompt, output) in by.items():
        sub = req.filter(pl.col("dataset") == ds)
        np.testing.assert_array_equal(np.sort(prompt), np.sort(sub["prompt_tokens"].to_numpy()))
        np.testing.assert_array_equal(np.sort(output), np.sort(sub["output_tokens"].to_numpy()))
    assert "trace" in fig["layout"]["title"]["text"]  # names where the data comes from


def test_downsample_caps_and_says_so():
    idx, note = downsample(10, cap=20, seed=0)
    assert idx.tolist() == list(range(10)) and note == ""
    idx, note = downsample(100_000, cap=500, seed=3)
    assert idx.shape == (500,) and len(np.unique(idx)) == 500 and np.all(np.diff(idx) > 0)
    assert "500 of 100,000" in note
    again, _ = downsample(100_000, cap=500, seed=3)
    np.testing.assert_array_equal(idx, again)


def test_layer_slider_shows_one_layer_at_a_time():
    (slider,) = layer_slider(3, traces_per_layer=2, layer_labels=["3", "4", "5"], extra_visible=1)
    vis = [s["args"][0]["visible"] for s in slider["steps"]]
    assert vis[1] == [False, False, True, True, False, False, True]
    assert [s["label"] for s in slider["steps"]] == ["3", "4", "5"]


def test_bad_inputs_are_clean_errors(trace, tmp_path):
    with pytest.raises(ConfigError, match="no inputs"):
        write_dashboard([], out=tmp_path / "r.html")
    with pytest.raises(ConfigError, match="max_points"):
        write_dashboard([trace], out=tmp_path / "r.html", config=DashboardConfig(max_points=0))
    res = CliRunner().invoke(app, ["dashboard", str(tmp_path / "nope"), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 2 and "no such directory" in res.output and "Traceback" not in res.output


def test_cli_writes_and_reports_size(trace, tmp_path):
    out = tmp_path / "sub" / "report.html"
    res = CliRunner().invoke(app, ["dashboard", str(trace), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert out.exists() and f"wrote {out}" in res.output and "MiB" in res.output


# ---------------------------------------------------------------- with the real producers' results
@pytest.fixture(scope="module")
def prod():
    return produced()  # the test set-up installs every producer: a broken install fails here


def test_html_figures_equal_result_files(prod, tmp_path):
    rep = write_dashboard([prod.trace, prod.analysis, prod.compare], out=tmp_path / "r.html")
    figs = figures_from_html(rep.path.read_text())
    checked = check_all({k: v["data"] for k, v in figs.items()}, prod)
    assert len(checked) >= 15
    for key in checked:  # each figure names the file it was drawn from, and the trace
        assert Path(figs[key]["source"]).is_file(), key
        assert "trace trace" in figs[key]["layout"]["title"]["text"], key
    # the decision first: placement, then load, structure, and the trace last
    assert rep.sections == ("placement", "imbalance", "correlation", "clusters", "classifiers", "overview")
    assert any("all-to-all measurements" in o for o in rep.omitted)


def test_results_alone_find_their_trace(prod, tmp_path):
    rep = write_dashboard([prod.compare], out=tmp_path / "r.html")
    assert rep.sections == ("placement", "overview")  # overview from the trace compare.json names
    assert any("no `moetrace analyze` results" in o for o in rep.omitted)


def test_absent_results_are_omitted_not_errors(prod, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(prod.analysis, partial)
    for name in ("embedding.parquet", "classify_accuracy.parquet", "classify_confusion.parquet", "expert_load.parquet"):
        (partial / name).unlink()
    rep = write_dashboard([partial], out=tmp_path / "r.html")
    assert "clusters" not in rep.sections and "classifiers" not in rep.sections
    assert "imbalance" in rep.sections and "correlation" in rep.sections
    assert any(o.startswith("clusters: no embedding.parquet") for o in rep.omitted)
    figs = figures_from_html(rep.path.read_text())
    assert "imbalance-expert-load" not in figs and "imbalance-if-prefill" in figs
    assert "expert_load.parquet absent" in rep.path.read_text()


def test_two_results_of_one_kind_get_their_own_sections(prod, tmp_path):
    other = tmp_path / "again"
    shutil.copytree(prod.analysis, other)
    rep = write_dashboard([prod.analysis, other], out=tmp_path / "r.html")
    assert "a0-imbalance" in rep.sections and "a1-imbalance" in rep.sections
    assert rep.sections.count("overview") == 1  # both name the same trace


def test_scatter_cap_is_applied_and_shown(prod, tmp_path):
    rep = write_dashboard([prod.analysis], out=tmp_path / "r.html", config=DashboardConfig(max_points=25, seed=1))
    figs = figures_from_html(rep.path.read_text())
    fig = figs["clusters-tsne-prefill"]
    total = (
        pl.read_parquet(prod.analysis / "embedding.parquet")
        .filter((pl.col("method") == "tsne") & (pl.col("stage") == "prefill"))
        .height
    )
    assert sum(len(t["x"]) for t in fig["data"]) == 25 < total
    notes = [a["text"] for a in fig["layout"].get("annotations", [])]
    assert any(f"25 of {total}" in n for n in notes)


def test_compare_json_is_recognised(prod):
    assert detect(prod.compare).kind == "placement"
    assert detect(prod.analysis).kind == "analysis"
    assert detect(prod.trace).kind == "trace"


def test_placement_box_axis_is_chosen_from_the_ratios(prod, tmp_path):
    """The normalized-volume box plot's y axis spans the data around 1, not 0..max (hiding 4-5 %)."""
    rep = write_dashboard([prod.trace, prod.compare], out=tmp_path / "r.html")
    fig = figures_from_html(rep.path.read_text())["placement-normalized"]
    lo, hi = fig["layout"]["yaxis"]["range"]
    ys = np.concatenate([np.asarray(t["y"], dtype=float) for t in fig["data"]])
    assert 0 <= lo <= np.percentile(ys, 1) and hi >= np.percentile(ys, 99)
    assert lo < 1.0 < hi and "rangemode" not in fig["layout"]["yaxis"]
    assert hi < np.max(ys) * 1.5  # chosen from the data, not plotly's autorange


def test_ratio_range_for_ratios_near_one():
    from moetrace.dashboards.section_placement import ratio_range

    lo, hi = ratio_range([np.array([0.95, 0.97, 1.0, 1.02]), np.array([0.9, 0.96, 1.04])])
    assert 0.85 < lo < 0.9 and 1.04 < hi < 1.1
    lo, hi = ratio_range([np.ones(10)])  # all equal: still a visible span around 1
    assert lo < 1.0 < hi and hi - lo >= 0.02
    assert ratio_range([np.array([0.0, 0.5, 1.0])])[0] == 0.0  # never below 0 for non-negative ratios


def test_random_weight_traces_get_a_banner(tmp_path):
    """A ``-tiny`` preset trace (model source ``moetrace:...``) is flagged on its overview; a real one is not."""
    import json

    from moetrace.dashboards.section_overview import RANDOM_WEIGHTS_BANNER, random_weights

    t = make_trace(tmp_path / "tiny", num_requests=8)
    mpath = t / "manifest.json"
    manifest = json.loads(mpath.read_text())
    assert not random_weights(manifest)
    rep = write_dashboard([t], out=tmp_path / "real.html")
    assert RANDOM_WEIGHTS_BANNER not in rep.path.read_text()
    manifest["model"]["source"] = "moetrace:qwen3-moe-tiny"
    mpath.write_text(json.dumps(manifest))
    assert random_weights(manifest)
    assert random_weights({"model": {"source": "x"}, "backend": {"name": "hf", "weights": "seeded random weights"}})
    text = write_dashboard([t], out=tmp_path / "tiny.html").path.read_text()
    overview = text.split('<section id="overview">', 1)[1].split("</section>", 1)[0]
    assert (
        overview.split("</h2>", 1)[1].lstrip().startswith(f'<p class="banner" role="alert">{RANDOM_WEIGHTS_BANNER}</p>')
    )


def test_random_weight_banner_on_analysis_sections(prod, tmp_path):
    import json

    shutil.copytree(prod.trace, tmp_path / "trace")
    shutil.copytree(prod.analysis, tmp_path / "analysis")
    for name in ("trace", "analysis"):  # point the analysis at the copied trace
        m = tmp_path / name / "manifest.json"
        text = m.read_text().replace(str(prod.trace), str(tmp_path / "trace"))
        d = json.loads(text)
        if name == "trace":
            d["model"]["source"] = "moetrace:qwen3-moe-tiny"
        m.write_text(json.dumps(d))
    text = write_dashboard([tmp_path / "analysis"], out=tmp_path / "r.html").path.read_text()
    for key in ("overview", "imbalance", "correlation", "clusters", "classifiers"):
        sec = text.split(f'<section id="{key}">', 1)[1].split("</section>", 1)[0]
        assert 'class="banner"' in sec, key


# ---------------------------------------------------------------- summary card, long tables, colours, progress
def _compare_results(path: Path, medians: dict[str, float]):
    """A ``compare`` results directory holding only a summary table with these normalized medians
    (its compare.json: the golden one of tests/golden/compare_v1, another deployment)."""
    import json

    from moetrace.dashboards.inputs import detect
    from moetrace.dashboards.results import Results

    path.mkdir()
    pl.DataFrame({"strategy": list(medians), "inter_node_normalized_median": list(medians.values())}).write_parquet(
        path / "summary.parquet"
    )
    golden = json.loads((Path(__file__).parent / "golden" / "compare_v1" / "compare.json").read_text())
    manifest = {**golden, "num_batches": 30, "deployment": "DP8TP1EP8", "num_nodes": 2}
    (path / "compare.json").write_text(json.dumps(manifest))
    return Results.from_input(detect(path))


def test_best_placement_headline_names_deployable_strategies_only(tmp_path):
    from moetrace.dashboards.summary import placement_headline

    h = placement_headline(_compare_results(tmp_path / "a", {"linear": 1.0, "eplb": 0.9, "data": 0.5, "improved": 0.5,
                                                             "oracle": 0.2}))  # fmt: skip
    assert h.value == "0.50×" and h.href == "placement"
    assert h.label.startswith("data-based") and " = improved" in h.label and "50% fewer" in h.label
    assert "oracle 0.20×" in h.detail and "oracle" not in h.label  # a bound is quoted, never named best
    h = placement_headline(_compare_results(tmp_path / "b", {"linear": 1.0, "eplb": 1.25}))
    assert h.value == "1.25×" and "25% more" in h.label
    assert placement_headline(_compare_results(tmp_path / "c", {"linear": 1.0, "oracle": 0.3})) is None


def test_long_tables_fold_into_details():
    from moetrace.dashboards.page import COLLAPSE_ROWS, Section, Table, render_page

    def page(n: int, summary: str = "") -> str:
        t = Table(key="t", header=("setting", "value"), rows=tuple((f"k{i}", i) for i in range(n)), summary=summary)
        return render_page([Section(key="s", title="S", tables=(t,))], title="x", subtitle="")

    assert "<details" not in page(COLLAPSE_ROWS)
    text = page(COLLAPSE_ROWS + 1, summary="Settings: 13 rows")
    assert '<details data-key="t-details"><summary>Settings: 13 rows</summary>' in text
    assert "<summary>setting: 13 rows</summary>" in page(COLLAPSE_ROWS + 1)  # a default summary line


def test_summary_card_links_must_exist():
    from moetrace.dashboards.page import Headline, Section, render_page

    h = Headline(key="k", title="T", value="1×", label="l", detail="d", href="missing", link="L", source="f")
    with pytest.raises(ValueError, match="not on the page"):
        render_page([Section(key="s", title="S")], title="x", subtitle="", headlines=[h])
    assert '<div id="summary"' not in render_page([Section(key="s", title="S")], title="x", subtitle="")


def test_expert_load_colour_views():
    """Log colours spread a skewed layer over the scale where linear colours crush it; per layer, every
    layer's busiest expert is the top colour; NaN (nothing routed) is level 0."""
    from moetrace.dashboards.section_imbalance import load_views

    z = np.array([[[40.0, 0.5, 0.25, 0.0], [1.0, 1.0, 1.0, 1.0], [np.nan] * 4]])  # one scope, 3 layers
    views, ticks = load_views(z)
    assert views["linear"][0, 0].tolist() == [255, 4, 3, 1]  # everything but the hot expert near the bottom
    # log: 0.5 sits log(0.5/0.25)/log(40/0.25) = 14% of the way up, 9x higher than linear puts it
    assert views["log"][0, 0].tolist() == [255, 36, 1, 1]
    assert views["layer"][0, 1].tolist() == [255] * 4 and views["layer"][0, 0, 0] == 255
    assert all(v[0, 2].tolist() == [0] * 4 for v in views.values())
    vals, text = ticks["log"]
    assert text[:3] == ["0.5×", "1×", "2×"] and vals == sorted(vals) and 1 <= vals[0] and vals[-1] <= 255


def test_nice_ticks():
    from moetrace.dashboards.theme import nice_linear_ticks, nice_log_ticks

    assert nice_log_ticks(0.01, 30) == [0.01, 0.1, 1.0, 10.0]
    assert nice_log_ticks(0.3, 4) == [0.5, 1.0, 2.0]
    assert nice_log_ticks(0.8, 1.3) == [1.0]
    assert nice_linear_ticks(3.7) == [0.0, 1.0, 2.0, 3.0]


def test_progress_counts_sections_and_the_page(prod, tmp_path):
    calls = []
    write_dashboard([prod.trace, prod.analysis, prod.compare], out=tmp_path / "r.html",
                    progress=lambda done, total: calls.append((done, total)))  # fmt: skip
    assert {t for _, t in calls} == {1 + 4 + 1 + 1}  # overview, 4 analysis sections, placement, the page
    assert [d for d, _ in calls] == list(range(8))


def test_cli_quiet_and_no_tty_draw_no_bar(trace, tmp_path):
    for args in ([], ["--quiet"]):
        res = CliRunner().invoke(app, ["dashboard", str(trace), "-o", str(tmp_path / "r.html"), "--overwrite", *args])
        assert res.exit_code == 0, res.output
        assert res.output.startswith("wrote ") and "steps/s" not in res.output


# ---------------------------------------------------------------- compare results with predicted time per step
#: strategy -> medians normalized to linear's: (all-to-all time, MoE time, inter-node bytes), its busiest
#: node's load and whether that is over compare.json's max_node_load (1.10)
TIMED = {
    "linear": (1.0, 1.0, 1.0, 1.0, False),
    "eplb": (0.95, 0.97, 0.98, 1.0, False),
    "data": (0.80, 0.90, 0.60, 1.04, False),
    "joint": (0.70, 0.85, 0.50, 1.45, True),  # the fastest, but its router overloads a node
    "oracle": (0.50, 0.70, 0.30, 1.0, False),  # a bound
}
_SPREAD_B = np.array([0.9, 0.95, 1.0, 1.05, 1.1])  # per-batch values around each median (B = 5)


def _timed_compare(
    path: Path, rows=TIMED, *, timed: bool = True, num_prefill_batches: int = 3, verdict: dict | None = None
) -> Path:
    """A complete ``compare`` results directory written by hand with the columns ``compare`` writes
    with its cost model (``timed``), or as results written before it have them (bytes alone). The
    model of tests/golden/compare_v1: 2 MoE layers, 16 experts on 8 GPUs of 2 nodes."""
    import json

    path.mkdir()
    L, P, B = 2, 16, len(_SPREAD_B)
    summary, batches, layers, places = [], [], [], []
    for s, (a2a, moe, inter, load, over) in rows.items():
        row = {
            "strategy": s,
            "is_bound": s == "oracle",
            "oracle_captured": None,
            "inter_node_normalized_median": inter,
            "inter_node_normalized_p10": inter * 0.9,
            "inter_node_normalized_p90": inter * 1.1,
            "inter_node_bytes_per_batch_median": inter * 1e6,
            "intra_node_bytes_per_batch_median": 2e6,
            "max_rank_dispatch_send_bytes_mean": 5e4,
            "tokens_per_rank_max_mean": 12.0,
            "activated_experts_per_rank_max_mean": 2.0,
            "router_match_rate": 0.9 if s in ("data", "joint") else None,
            "groups_without_routed_requests": 0,
            "busiest_node_load": load if s in ("data", "joint") or timed else None,
        }
        if timed:
            row |= {
                "a2a_time_normalized_median": a2a,
                "a2a_time_normalized_p10": a2a * 0.95,
                "a2a_time_normalized_p90": a2a * 1.05,
                "moe_time_normalized_median": moe,
                "moe_time_normalized_p10": moe * 0.95,
                "moe_time_normalized_p90": moe * 1.05,
                "a2a_seconds_per_step_median": a2a * 400e-6,
                "moe_seconds_per_step_median": moe * 1.2e-3,
                "over_node_load_limit": over,
                "busiest_gpu_load": 1.3,
                "prefill_a2a_time_normalized_median": a2a + 0.05 if num_prefill_batches else float("nan"),
                "prefill_moe_time_normalized_median": moe + 0.05 if num_prefill_batches else float("nan"),
                "prefill_inter_node_normalized_median": inter + 0.05 if num_prefill_batches else float("nan"),
            }
        summary.append(row)
        batch = {"strategy": [s] * B, "batch": np.arange(B), "inter_node_normalized": inter * _SPREAD_B}
        if timed:
            batch |= {"a2a_time_normalized": a2a * _SPREAD_B, "moe_time_normalized": moe * _SPREAD_B}
        batches.append(pl.DataFrame(batch))
        layer = {
            "strategy": [s] * (B * L),
            "batch": np.repeat(np.arange(B), L),
            "layer": np.tile(np.arange(L), B),
            "model_layer": np.tile([1, 2], B),
            "dispatch_intra_bytes": np.full(B * L, 1e5),
            "dispatch_inter_bytes": inter * np.repeat(_SPREAD_B, L) * 4e5,
            "combine_intra_bytes": np.full(B * L, 1e5),
            "combine_inter_bytes": inter * np.repeat(_SPREAD_B, L) * 4e5,
            "inter_node_normalized": inter * np.repeat(_SPREAD_B, L),
        }
        if timed:
            d = a2a * np.repeat(_SPREAD_B, L) * np.tile([80e-6, 120e-6], B)
            layer |= {"dispatch_seconds": d, "combine_seconds": d, "expert_seconds": d / 2, "moe_seconds": 2.5 * d}
        layers.append(pl.DataFrame(layer))
        places.append(
            pl.DataFrame(
                {
                    "strategy": [s] * (L * P),
                    "layer": np.repeat(np.arange(L), P),
                    "model_layer": np.repeat([1, 2], P),
                    "slot": np.tile(np.arange(P), L),
                    "gpu": np.tile(np.arange(P) // 2, L),
                    "node": np.tile(np.arange(P) // 8, L),
                    "expert": np.tile(np.arange(P)[::-1] if s != "linear" else np.arange(P), L),
                }
            )
        )
    pl.DataFrame(summary).write_parquet(path / "summary.parquet")
    pl.concat(batches).write_parquet(path / "batches.parquet")
    pl.concat(layers).write_parquet(path / "layers.parquet")
    pl.concat(places).write_parquet(path / "placements.parquet")
    golden = json.loads((Path(__file__).parent / "golden" / "compare_v1" / "compare.json").read_text())
    strategies = [s for s in rows if s != "oracle"]
    manifest = {**golden, "strategies": strategies, "bounds": ["oracle"] if "oracle" in rows else []}
    manifest["bound_kinds"] = {"oracle": "joint"} if "oracle" in rows else {}
    manifest["grouping"] = {s: g for s, g in golden["grouping"].items() if s in strategies}
    if timed:
        manifest |= {
            "max_node_load": 1.10,
            "prefill_dedup": "node",
            "links": {
                "intra_bytes_per_s": 155e9,
                "intra_latency_s": 1e-6,
                "inter_bytes_per_s": 50e9,
                "inter_latency_s": 3e-6,
                "inter_nic": "gpu",
            },
            "expert": None,
            "prefill_tokens_per_node": 8192,
            "num_prefill_batches": num_prefill_batches,
        }
    if verdict is not None:
        manifest["verdict"] = verdict
    (path / "compare.json").write_text(json.dumps(manifest))
    return path


def _headline(path: Path):
    from moetrace.dashboards.results import Results
    from moetrace.dashboards.summary import placement_headline

    return placement_headline(Results.from_input(detect(path)))


def _section(text: str, key: str) -> str:
    return text.split(f'<section id="{key}">', 1)[1].split("</section>", 1)[0]


def test_best_deployable_placement_is_ranked_by_predicted_time(tmp_path):
    """The card names the fastest strategy within the node-load limit, with its time, bytes and load,
    the copy models and links; the faster one over the limit gets a line of its own, never "best"."""
    h = _headline(_timed_compare(tmp_path / "c"))
    assert h.title == "Best deployable placement vs linear" and h.value == "−20%"
    assert h.label == (
        "data-based (core paper): −20% predicted all-to-all time per step (−40% inter-node bytes), node load 1.04"
    )
    assert h.note == ("joint (ours) would be 30% faster but sends 1.45× an even share to one node (the limit is 1.10×)")
    assert "joint" not in h.label and "oracle" not in h.label  # over the limit, a bound: never best
    for words in (
        "decode one copy per (token, expert), as DeepEP's low-latency kernels send",
        "prefill one copy per node, as DeepEP's normal kernels send",
        "NVLink 155 GB/s, RDMA 50 GB/s per GPU",
        "its MoE layers (dispatch + experts + combine) −10%",
        "its prefill all-to-all −15%",
        "bounds, not deployable: oracle −50%",
        "median over 10 held-out batches",
    ):
        assert words in h.detail, words


def test_no_placement_beating_linear_is_said(tmp_path):
    slower = {"linear": TIMED["linear"], "eplb": (1.02, 1.01, 0.99, 1.0, False), "data": (1.05, 1.0, 0.7, 1.02, False)}
    h = _headline(_timed_compare(tmp_path / "slower", slower, num_prefill_batches=0))
    assert h.value == "none" and h.note == ""
    assert h.label == (
        "no placement beats linear on predicted all-to-all time; closest: EPLB: +2.0% predicted all-to-all time per "
        "step (−1.0% inter-node bytes), node load 1.00"
    )
    assert "prefill" not in h.detail  # no prefill step simulated: no prefill copy model, no prefill time
    # the only faster one is over the limit: not deployable, named on its own line
    over = {"linear": TIMED["linear"], "eplb": slower["eplb"], "joint": TIMED["joint"]}
    h = _headline(_timed_compare(tmp_path / "over", over))
    assert h.value == "none" and h.label.startswith("no deployable placement beats linear on predicted all-to-all time")
    assert h.note.startswith("joint (ours) would be 30% faster but sends 1.45× an even share to one node")


def test_summary_card_names_each_stages_winner_with_its_copy_model(tmp_path):
    """One line per simulated stage on the card: decode and prefill can have different winners, and
    each names the copy model it was simulated with (the over-limit joint and the bound never win)."""
    d = _timed_compare(tmp_path / "c")
    summary = pl.read_parquet(d / "summary.parquet")
    prefill = {"linear": 1.0, "eplb": 0.9, "data": 1.02, "joint": 0.6, "oracle": 0.5}
    summary.with_columns(
        pl.col("strategy").replace_strict(prefill, return_dtype=pl.Float64).alias("prefill_a2a_time_normalized_median")
    ).write_parquet(d / "summary.parquet")
    decode = (
        "decode (one copy per (token, expert), as DeepEP's low-latency kernels send): data-based (core paper) −20% "
        "predicted all-to-all time per step vs linear"
    )
    assert _headline(d).lines == (
        decode,
        "prefill (one copy per node, as DeepEP's normal kernels send): EPLB −10% predicted all-to-all time per step "
        "vs linear",
    )
    text = write_dashboard([d], out=tmp_path / "r.html").path.read_text()
    card = text.split('<div id="summary"', 1)[1].split("</div></div>", 1)[0]
    assert card.count('<div class="h-line">') == 2
    assert "prefill (one copy per node, as DeepEP&#x27;s normal kernels send): EPLB −10%" in card
    # no prefill step simulated: the decode line alone
    assert _headline(_timed_compare(tmp_path / "d", num_prefill_batches=0)).lines == (decode,)


def test_placement_section_shows_time_first_and_bounds_apart(tmp_path):
    d = _timed_compare(tmp_path / "c")
    rep = write_dashboard([d], out=tmp_path / "r.html")
    text = rep.path.read_text()
    assert rep.headlines == ("placement",) and "placement" in rep.sections
    card = text.split('<div id="summary"', 1)[1].split("</div></div>", 1)[0]
    assert '<div class="h-note">joint (ours) would be 30% faster' in card
    sec = _section(text, "placement")
    table = sec.split('<table data-key="placement-summary" class="nowrap">', 1)[1].split("</table>", 1)[0]
    header = re.findall(r"<th>(.*?)</th>", table)
    assert header[:3] == ["strategy", "all-to-all / step", "all-to-all vs median (p10–p90)"]
    assert header.index("MoE vs median (p10–p90)") < header.index("inter-node bytes vs median (p10–p90)")
    assert header.index("inter-node bytes vs median (p10–p90)") < header.index(
        "busiest node&#x27;s requests / even share"
    )
    assert len(set(header)) == len(header)  # one column per quantity: the spread sits in the median's cell
    rows = re.findall(r"<tr>(.*?)</tr>", table.split("<tbody>", 1)[1])
    assert [re.findall(r"<td[^>]*>(.*?)</td>", r)[0] for r in rows] == [
        "linear (vLLM default)", "joint (ours)", "EPLB", "data-based (core paper)"]  # fmt: skip  # the recommended second
    cells = {re.findall(r"<td[^>]*>(.*?)</td>", r)[0]: re.findall(r"<td[^>]*>(.*?)</td>", r) for r in rows}
    assert cells["data-based (core paper)"][1:3] == ["320 µs", "0.800 (0.760–0.840)"]
    assert "1.45 ⚠ over 1.10" in cells["joint (ours)"] and "1.04" in cells["data-based (core paper)"]
    assert header[-3:] == [  # prefill was simulated
        "prefill all-to-all (normalized median)",
        "prefill MoE (normalized median)",
        "prefill inter-node bytes (normalized median)",
    ]
    bounds = sec.split('<table data-key="placement-summary-bounds" class="nowrap">', 1)[1].split("</table>", 1)[0]
    assert "oracle" in bounds and "oracle" not in table
    assert "links: NVLink 155 GB/s (1 µs per message), RDMA 50 GB/s (3 µs per message) per GPU" in sec


def test_time_figures_equal_result_files(tmp_path):
    from browser.checks import check_placement

    d = _timed_compare(tmp_path / "c")
    figs = figures_from_html(write_dashboard([d], out=tmp_path / "r.html").path.read_text())
    checked = check_placement({k: v["data"] for k, v in figs.items()}, d)
    assert {"placement-time", "placement-moe-time", "placement-layers-time"} <= set(checked)
    order = list(figs)
    assert order.index("placement-time") < order.index("placement-normalized")  # time before bytes


def test_old_compare_directory_still_shows_bytes(tmp_path):
    """Results written before the cost model: the bytes headline and table as before, no time figures."""
    d = _timed_compare(tmp_path / "old", timed=False)
    h = _headline(d)
    assert h.title == "Best placement vs linear" and h.value == "0.50×"
    assert h.label == "joint (ours): 50% fewer inter-node bytes" and h.note == ""
    rep = write_dashboard([d], out=tmp_path / "r.html")
    text = rep.path.read_text()
    figs = figures_from_html(text)
    assert "placement-normalized" in figs and not {"placement-time", "placement-layers-time"} & set(figs)
    table = _section(text, "placement").split('<table data-key="placement-summary">', 1)[1]
    assert re.findall(r"<th>(.*?)</th>", table.split("</thead>", 1)[0])[:4] == [
        "strategy", "inter-node (normalized median)", "p10", "p90"]  # fmt: skip
    assert "dedup per expert" in _section(text, "placement") and "predicted" not in text.split("<main", 1)[1]


def test_unknown_expert_size_leaves_moe_time_out(tmp_path):
    """No expert size, no MoE-layer time (NaN columns): the card says so, the table shows -, no MoE figure."""
    rows = {s: (a2a, float("nan"), inter, load, over) for s, (a2a, _, inter, load, over) in TIMED.items()}
    d = _timed_compare(tmp_path / "c", rows)
    h = _headline(d)
    assert h.value == "−20%" and "MoE-layer time not predicted: the model's expert size is unknown" in h.detail
    text = write_dashboard([d], out=tmp_path / "r.html").path.read_text()
    figs = figures_from_html(text)
    assert "placement-time" in figs and "placement-moe-time" not in figs
    table = _section(text, "placement").split('data-key="placement-summary"', 1)[1].split("</table>", 1)[0]
    data_row = [r for r in re.findall(r"<tr>(.*?)</tr>", table) if "data-based" in r][0]
    header = re.findall(r"<th>(.*?)</th>", table)
    # "-" in every row: no column, the caption says so once
    assert "MoE layers / step" not in header and "MoE vs median (p10–p90)" not in header
    assert "The same in every row, so not a column: MoE layers / step -; MoE vs median (p10–p90) -" in text
    assert len(re.findall(r"<td[^>]*>(.*?)</td>", data_row)) == len(header)


def test_recommended_on_top_and_bounds_apart_in_the_per_layer_lines(prod, tmp_path):
    """ours (the recommended strategy; joint in results without it) is drawn last (on top), thickest and
    first in the legend; bounds are dotted, in their own legend group; strategies and bounds never share
    a group."""
    from moetrace.dashboards.section_placement import BOUNDS_GROUP, STRATEGY_NAMES, recommended_of

    figs = figures_from_html(write_dashboard([prod.compare], out=tmp_path / "r.html").path.read_text())
    lines = figs["placement-layers-share"]["data"]
    rec = recommended_of([k for k, v in STRATEGY_NAMES.items() if v in {t["name"] for t in lines}])
    assert lines[-1]["name"] == STRATEGY_NAMES[rec] and lines[-1]["legendrank"] == 0
    assert lines[-1]["line"]["width"] > max(t["line"]["width"] for t in lines[:-1])
    bounds = [t for t in lines if t.get("legendgroup") == BOUNDS_GROUP]
    assert {t["name"] for t in bounds} == {STRATEGY_NAMES["oracle"], STRATEGY_NAMES["perfect_routing"]}
    assert all(t["line"]["dash"] == "dot" and t["legendrank"] > 1000 for t in bounds)
    boxes = [t["name"] for t in figs["placement-normalized"]["data"]]
    assert boxes[:2] == [STRATEGY_NAMES["linear"], STRATEGY_NAMES[rec]]  # reference, then the recommended
    assert set(boxes[-2:]) == {t["name"] for t in bounds}  # bounds last, right of the separator


def test_node_holdings_of_a_hand_made_placement():
    """Two nodes of one GPU, 4 experts, one layer: linear holds 0,1 | 2,3; the other swaps 1 and 2."""
    from moetrace.dashboards.section_placement import node_holdings

    rows = []
    for s, experts in (("linear", [0, 1, 2, 3]), ("data", [0, 2, 1, 3])):
        rows += [dict(strategy=s, layer=0, model_layer=1, slot=p, gpu=p // 2, node=p // 2, expert=e)
                 for p, e in enumerate(experts)]  # fmt: skip
    places = pl.DataFrame(rows)
    tokens = {"a": [6, 0, 2, 0], "b": [0, 1, 1, 6]}  # dataset a mostly expert 0 and 2, b mostly 3
    load = pl.DataFrame(
        [dict(dataset=d, layer=0, expert=e, tokens=v) for d, vs in tokens.items() for e, v in enumerate(vs)]
        + [dict(dataset="all", layer=0, expert=e, tokens=tokens["a"][e] + tokens["b"][e]) for e in range(4)]
    )
    lin, data = node_holdings(places, "linear", load=load), node_holdings(places, "data", load=load)
    np.testing.assert_allclose(lin.moved_G, [0, 0])
    np.testing.assert_allclose(data.moved_G, [1, 1])  # expert 2 on node 0, expert 1 on node 1
    assert data.datasets == ("a", "b")
    np.testing.assert_allclose(data.share_GD, [[1.0, 1 / 8], [0.0, 7 / 8]])  # node 0 serves a, node 1 serves b
    np.testing.assert_allclose(data.tokens_W, [9 / 8, 7 / 8])  # 9 and 7 of 16 tokens, even share 8


# ---------------------------------------------------------------- a load profile's results (docs/profile.md)
def test_dashboard_on_a_load_profiles_results(trace, tmp_path, monkeypatch):
    """profile → analyze → compare → dashboard, as docs/profile.md runs them: every section drawn has
    data; what needs requests says why in one line; nothing claims held-out requests or a trace."""
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    runner = CliRunner()
    for argv in (
        ["profile", str(trace), "-o", "p.parquet"],
        ["analyze", "p.parquet", "-o", "an"],
        ["compare", "p.parquet", "--config", "DP2TP4EP8", "--gpus-per-node", "4", "--batches", "30", "-o", "cmp"],
        ["dashboard", "an", "cmp", "-o", "d.html"],
    ):
        res = runner.invoke(app, argv)
        assert res.exit_code == 0, (argv, res.output)
    text = (tmp_path / "d.html").read_text()
    assert "Traceback" not in res.output
    assert "not shown: overview: the results are of a load profile (p.parquet): it holds no requests" in res.output
    figs = figures_from_html(text)
    assert {"placement-time", "imbalance-if-decode", "correlation-prefill-decode"} <= set(figs)
    for key, fig in figs.items():  # no empty figure: every one has a trace with values
        assert fig["data"], key
        assert "profile p.parquet" in fig["layout"]["title"]["text"], key
    # the node holdings read the analysis of the same profile: the datasets each node serves
    assert "placement-serves" in figs and "placement-tokens" in figs
    text = html.unescape(text)
    assert "give `moetrace analyze` results" not in text
    # one line each for what needs requests
    assert "IF distribution over random batches: skipped, needs requests to form random batches" in text
    assert "prefill↔decode per request: skipped, needs each request" in text
    placement = _section(text, "placement")
    assert "held out for evaluation" not in placement and "requests it never saw" not in placement
    assert "load profile: tokens drawn from its expert loads" in placement
    assert "Evaluated on tokens drawn from the load profile's loads" in placement
    assert "the recommended strategy" not in placement  # joint needs requests: not in these results
    card = text.split('<div id="summary"', 1)[1].split("</div></div>", 1)[0]
    assert "in-sample batches" in card and "held-out" not in card


def test_dashboard_refuses_to_show_a_complete_trace_that_lost_parts(tmp_path):
    """A finished trace is checked against its manifest before its overview is drawn (issue #25): a
    lost requests+routing pair is named, never shown as a smaller whole trace."""
    from factories import write_small_trace

    trace = write_small_trace(tmp_path / "t", num_requests=8, part_tokens=20)
    parts = sorted((trace / "requests").glob("*.parquet"))
    assert len(parts) > 1
    lost = parts[-1].name
    (trace / "requests" / lost).unlink()
    (trace / "routing" / lost).unlink()
    r = CliRunner().invoke(app, ["dashboard", str(trace), "-o", str(tmp_path / "d.html")])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "overview of" in r.output and lost.removesuffix(".parquet") in r.output


def test_the_card_ranks_by_moe_layer_time_when_compare_did(tmp_path):
    """Results whose compare.json ``verdict`` ranks by MoE-layer time: the card names the fastest
    deployable strategy in MoE-layer time, all-to-all time beside it, and so do the stage lines; a
    strategy faster in all-to-all time but slower in MoE-layer time is not named."""
    rows = dict(TIMED)
    rows["eplb"] = (0.95, 0.80, 0.98, 1.0, False)  # slower all-to-all than data (0.80), faster MoE layer (0.90)
    verdict = {  # as compare writes it (compare_verdict), without the decision per stage (written before it)
        "measure": "moe_time",
        "ranking": ["eplb", "data", "linear"],
        "recommended": "eplb",
        "over_node_load_limit": [],
        "time_normalized": {"linear": 1.0, "data": 0.9, "eplb": 0.8},
        "a2a_time_normalized": {"linear": 1.0, "data": 0.8, "eplb": 0.95},
    }
    h = _headline(_timed_compare(tmp_path / "m", rows, verdict=verdict))
    assert h.value == "−20%" and h.label.startswith("EPLB: −20% predicted MoE-layer time per step")
    assert "its all-to-all (dispatch + combine) −5.0%" in h.detail and h.detail.startswith("Decode MoE layers")
    assert h.lines[0].endswith("EPLB −20% predicted MoE-layer time per step vs linear")
    assert "its prefill MoE layers −15%" in h.detail
    plain = _headline(_timed_compare(tmp_path / "a", rows))  # no verdict: all-to-all time, as before
    assert plain.label.startswith("data-based (core paper): −20% predicted all-to-all time per step")
