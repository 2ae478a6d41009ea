"""Calibration (placement/calibrate*.py, placement/kernel_tables.py, `moetrace calibrate` / `moetrace cost`):
a fit recovers known parameters from a table the step model itself generated, the readers, the
hold-out rule, the links file the CLI writes, and `cost` printing what `predict` computes."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ConfigError
from moetrace.placement import calibrate as C
from moetrace.placement import calibrate_fit, calibrate_traffic
from moetrace.placement.cost import Link, Links
from moetrace.placement.hardware import PRESETS, load_hardware
from moetrace.placement.kernel_tables import (
    CSV_COLUMNS,
    KernelRow,
    read_aiconfigurator,
    read_csv,
    read_table,
    vendored_tables,
    write_csv,
)
from moetrace.placement.step_model import BF16, FP8_E4M3_BLOCK128, Kernel, Phase, layer_seconds

runner = CliRunner()


def _kernel(*, fixed=10e-6, intra=200e9, inter=40e9, intra_lat=0.0, inter_lat=0.0, copies="expert") -> Kernel:
    links = Links(
        intra=Link(bytes_per_s=intra, latency_s=intra_lat), inter=Link(bytes_per_s=inter, latency_s=inter_lat)
    )
    return Kernel(
        name="deepep-ll",
        copies=copies,
        dispatch=Phase(value=FP8_E4M3_BLOCK128, links=links, fixed_s=fixed),
        combine=Phase(
            value=BF16,
            links=replace(links, intra=Link(bytes_per_s=intra * 0.8, latency_s=intra_lat)),
            fixed_s=fixed * 1.5,
        ),
        reduce_bytes_per_s=3.35e12,
    )


def _shapes(*, eps=(8, 16, 32), tokens=(1, 4, 16, 64, 256), kernel="deepep-ll") -> list[KernelRow]:
    rows = []
    for ep in eps:
        for hidden in (2048, 7168):
            for t in tokens:
                rows.append(
                    KernelRow(
                        kernel=kernel,
                        gpu="synthetic",
                        source="synthetic",
                        ep_size=ep,
                        gpus_per_node=8,
                        hidden=hidden,
                        top_k=8,
                        num_experts=256,
                        tokens_per_rank=t,
                        dispatch_type="fp8",
                        combine_type="bf16",
                        dispatch_us=math.nan,
                        combine_us=math.nan,
                    )
                )
    return rows


def _measured(rows, kernel) -> list[KernelRow]:
    d, c = C.predict(rows, kernel)
    return [replace(r, dispatch_us=float(a), combine_us=float(b)) for r, a, b in zip(rows, d, c, strict=True)]


def _rel(a: float, b: float) -> float:
    return abs(a / b - 1)


# ------------------------------------------------------------------------------ the fit
def test_round_trip_recovers_known_parameters():
    truth = _kernel()
    rows = _measured(_shapes(), truth)
    kf = C.fit_kernel(rows)
    k = kf.kernel
    for ph in ("dispatch", "combine"):
        got, want = getattr(k, ph), getattr(truth, ph)
        assert _rel(got.fixed_s, want.fixed_s) < 0.03, (ph, got.fixed_s)
        assert _rel(got.links.intra.bytes_per_s, want.links.intra.bytes_per_s) < 0.03
        assert _rel(got.links.inter.bytes_per_s, want.links.inter.bytes_per_s) < 0.03
        assert got.links.intra.latency_s == 0 and got.links.inter.latency_s == 0  # no latency in the data: none kept
    rep = kf.report()
    assert rep["dispatch"]["errors"]["train"]["all"]["median"] < 0.01
    assert {v["latency"] for v in rep["dispatch"]["latency_variants"]} == {"intra", "inter"}


def test_round_trip_keeps_a_latency_the_data_has():
    truth = _kernel(inter_lat=1e-6)
    rows = _measured(_shapes(eps=(8, 16, 32, 64)), truth)
    k = C.fit(rows)
    assert _rel(k.dispatch.links.inter.latency_s, 1e-6) < 0.05
    assert _rel(k.dispatch.links.inter.bytes_per_s, 40e9) < 0.03
    assert k.dispatch.links.intra.latency_s == 0  # the intra-node one is not in the data


def test_fast_evaluation_is_layer_seconds():
    """The fit's stacked evaluation prices every row exactly as predict (layer_seconds) does."""
    kernel = _kernel(intra_lat=3e-7, inter_lat=5e-7)
    rows = _shapes(tokens=(1, 37, 600, 3000))  # 3000 > TOKENS_SIMULATED: a scaled draw
    d, c = C.predict(rows, kernel)
    for ph, want in (("dispatch", d), ("combine", c)):
        ev = calibrate_fit._PhaseEval(rows, ph)
        p = getattr(kernel, ph)
        got = ev.seconds(p.links, p.fixed_s, kernel.reduce_bytes_per_s) * 1e6
        np.testing.assert_allclose(got, want, rtol=1e-12)
    r = rows[5]
    t = C.row_traffic(r)
    s = layer_seconds(t, kernel=kernel, hidden_size=r.hidden, ranks_per_node=r.gpus_per_node)
    assert d[5] == pytest.approx(s.dispatch.mean() * 1e6)


def test_held_out_rows_are_not_fitted():
    truth = _kernel()
    rows = _measured(_shapes(), truth)
    spoiled = [
        replace(r, dispatch_us=r.dispatch_us * 10, combine_us=r.combine_us * 10) if r.tokens_per_rank >= 64 else r
        for r in rows
    ]
    kf = C.fit_kernel(spoiled, hold_out="tokens>=64")
    assert kf.held_out.sum() == sum(r.tokens_per_rank >= 64 for r in rows) > 0
    assert _rel(kf.kernel.dispatch.links.intra.bytes_per_s, 200e9) < 0.05  # the spoiled rows did not move it
    rep = kf.report()
    assert rep["rows"] == {"train": int((~kf.held_out).sum()), "held_out": int(kf.held_out.sum())}
    assert rep["dispatch"]["errors"]["held_out"]["all"]["median"] == pytest.approx(0.9, abs=0.02)  # pred/meas = 1/10


def test_hold_out_syntax():
    rows = _shapes()
    rule = C.parse_hold_out("ep>=16,tokens<16;hidden=2048|4096,ep=8")
    held = [rule(r, i) for i, r in enumerate(rows)]
    want = [(r.ep_size >= 16 and r.tokens_per_rank < 16) or (r.hidden == 2048 and r.ep_size == 8) for r in rows]
    assert held == want
    every = C.parse_hold_out("every=3")
    assert [every(r, i) for i, r in enumerate(rows[:7])] == [False, False, True, False, False, True, False]
    assert C.parse_hold_out("gpu=H100")(replace(rows[0], gpu="h100"), 0)
    assert C.parse_hold_out(None) is None
    for bad, msg in (
        ("tokens 3", "cannot read"),
        ("tokens>>3", "whole numbers"),
        ("colour=red", "unknown field"),
        ("every=1", "every=N"),
        ("tokens>=x", "whole numbers"),
        ("gpu>h1", "= or !="),
    ):
        with pytest.raises(ConfigError, match=msg):
            C.parse_hold_out(bad)
    with pytest.raises(ConfigError, match="holds out all"):
        C.fit_kernel(_measured(_shapes(tokens=(1, 4)), _kernel()), hold_out="tokens>=1")


def test_single_node_rows_take_the_inter_link_from_the_base():
    truth = _kernel()
    rows = _measured(_shapes(eps=(8,)), truth)
    base = load_hardware("h100")
    cal = C.calibrate(rows, base=base, name="x")
    k = cal.hardware.kernel("expert")
    assert k.dispatch.links.inter == base.kernel("expert").dispatch.links.inter
    assert "inter link from h100's deepep-ll kernel" in k.source
    assert set(cal.hardware.kernels) == {"expert", "node", "rank"}  # the others from the base, said so
    assert "taken whole from h100" in cal.derived["node"]


def test_grouped_routing_matches_the_brute_force_draw():
    rng = np.random.default_rng(1)
    ids = calibrate_traffic._grouped_ids(rng, 20000, 256, 8, 8, 4)
    s = np.sort(ids, axis=1)
    assert (s[:, 1:] != s[:, :-1]).all() and ids.min() >= 0 and ids.max() < 256
    nodes = np.array([len(set(r)) for r in ids // 32])
    assert nodes.max() <= 4
    sc = rng.random((20000, 256))  # the routing DeepEP's test_internode.py draws
    keep = np.argsort(-sc.reshape(-1, 8, 32).max(2), axis=1)[:, :4]
    mask = np.zeros((20000, 8), bool)
    np.put_along_axis(mask, keep, True, axis=1)
    sc[~np.repeat(mask, 32, axis=1)] = -1
    brute = np.array([len(set(r)) for r in np.argsort(-sc, axis=1)[:, :8] // 32])
    assert nodes.mean() == pytest.approx(brute.mean(), abs=0.03)


# ------------------------------------------------------------------------------ readers
def _ll_table(path, device="NVIDIA H100 80GB HBM3", node_num=(1, 1), experts=(256, 256)):
    t = pa.table(
        {
            "framework": ["sglang"] * 2,
            "device": [device] * 2,
            "op_name": ["ll"] * 2,
            "node_num": list(node_num),
            "hidden_size": [7168, 4096],
            "num_token": [128, 1],
            "num_topk": [8, 2],
            "num_experts": list(experts),
            "combine_avg_t_us": [67.0, 14.0],
            "dispatch_avg_t_us": [36.7, 13.0],
        }
    )
    pq.write_table(t, path)
    return path


def test_read_aiconfigurator_low_latency(tmp_path):
    rows = read_aiconfigurator(_ll_table(tmp_path / "ll.parquet", node_num=(2, 1)))
    assert [(r.kernel, r.gpu, r.ep_size, r.gpus_per_node, r.hidden, r.top_k, r.tokens_per_rank) for r in rows] == [
        ("deepep-ll", "h100", 16, 8, 7168, 8, 128),
        ("deepep-ll", "h100", 8, 8, 4096, 2, 1),
    ]
    assert (rows[0].dispatch_type, rows[0].combine_type, rows[0].dispatch_us, rows[0].combine_us) == (
        "fp8",
        "bf16",
        36.7,
        67.0,
    )
    gb = read_aiconfigurator(_ll_table(tmp_path / "gb.parquet", device="NVIDIA GB200"))
    assert {(r.gpu, r.ep_size, r.gpus_per_node) for r in gb} == {("gb200", 4, 4)}
    skipped: list[str] = []
    rows = read_table(_ll_table(tmp_path / "bad.parquet", node_num=(8, 1), experts=(288, 256)), skipped=skipped)
    assert len(rows) == 1 and len(skipped) == 1 and "288 experts" in skipped[0]


def test_read_aiconfigurator_normal_keeps_the_fastest_sms(tmp_path):
    n = 6
    t = pa.table(
        {
            "device": ["NVIDIA H200"] * n,
            "node_num": [1, 1, 1, 8, 8, 8],
            "hidden_size": [7168] * n,
            "num_token": [4096] * n,
            "num_topk": [8] * n,
            "num_experts": [256] * n,
            "dispatch_sms": [8, 16, 24, 8, 16, 24],
            "dispatch_transmit_us": [900.0, 500.0, 510.0, 7000.0, 6000.0, 6500.0],
            "dispatch_notify_us": [0.0] * n,
            "combine_sms": [8, 16, 24, 8, 16, 24],
            "combine_transmit_us": [1900.0, 1000.0, 980.0, 9000.0, 9500.0, 9900.0],
            "combine_notify_us": [0.0] * n,
        }
    )
    pq.write_table(t, tmp_path / "n.parquet")
    rows = sorted(read_aiconfigurator(tmp_path / "n.parquet"), key=lambda r: r.ep_size)
    assert [(r.kernel, r.ep_size, r.dispatch_us, r.combine_us, r.routing) for r in rows] == [
        ("deepep-normal", 8, 500.0, 980.0, "uniform"),
        ("deepep-normal", 64, 6000.0, 9000.0, "grouped:4"),  # test_internode.py: top-4 nodes of 8
    ]
    assert rows[0].note == "fastest SMs: dispatch 16, combine 24"


def test_read_aiconfigurator_trtllm(tmp_path):
    recs = [  # (kernel_source, moe_dtype, op_name, ep, tokens, latency ms)
        ("NVLinkTwoSided", "bfloat16", "alltoall_dispatch", 8, 128, 0.0347),
        ("NVLinkTwoSided", "bfloat16", "alltoall_combine", 8, 128, 0.0375),
        ("NVLinkTwoSided", "bfloat16", "alltoall_prepare", 8, 128, 0.014),
        ("NVLinkTwoSided", "nvfp4", "alltoall_dispatch", 8, 128, 0.0199),
        ("NVLinkTwoSided", "nvfp4", "alltoall_combine", 8, 128, 0.0374),
        ("NVLinkTwoSided", "nvfp4", "alltoall_combine_low_precision", 8, 128, 0.0362),
        ("NVLinkOneSided", "nvfp4", "alltoall_dispatch", 8, 128, 0.022),
    ]
    cols = dict(
        zip(
            ("kernel_source", "moe_dtype", "op_name", "moe_ep_size", "num_tokens", "latency"),
            zip(*recs, strict=True),
            strict=True,
        )
    )
    t = pa.table(
        {
            **{k: list(v) for k, v in cols.items()},
            "device": ["NVIDIA GB200"] * 7,
            "hidden_size": [7168] * 7,
            "topk": [8] * 7,
            "num_experts": [256] * 7,
        }
    )
    pq.write_table(t, tmp_path / "t.parquet")
    rows = sorted(read_aiconfigurator(tmp_path / "t.parquet"), key=lambda r: r.dispatch_type)
    assert [(r.kernel, r.dispatch_type, r.combine_type, r.routing, r.gpus_per_node) for r in rows] == [
        ("trtllm-a2a", "bf16", "bf16", "balanced", 8),
        ("trtllm-a2a", "nvfp4", "bf16", "balanced", 8),
    ]
    assert rows[0].dispatch_us == pytest.approx(34.7) and rows[1].combine_us == pytest.approx(37.4)  # ms -> us


def test_csv_round_trip_and_comments(tmp_path):
    rows = _measured(_shapes(eps=(8,), tokens=(1, 64)), _kernel())
    text = write_csv(rows, comments=["a measured table", "second line"])
    assert text.startswith("# a measured table\n# second line\n" + ",".join(CSV_COLUMNS))
    (tmp_path / "t.csv").write_text(text)
    back = read_table(tmp_path / "t.csv")
    assert [r.settings() | {"source": ""} for r in back] == [r.settings() | {"source": ""} for r in rows]
    assert back[0].source == "t.csv:4"
    np.testing.assert_allclose([r.dispatch_us for r in back], [r.dispatch_us for r in rows], rtol=1e-5)


HEADER = ",".join(CSV_COLUMNS)


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (
            "deepep-ll,h100,8,8,7168,8,256,128,fp8,bf16,36.7,67\ndeepep-ll,h100,8,8,7168,eight,256,128,fp8,bf16,36.7,67",
            r"t\.csv:4: column `top_k`: 'eight'",
        ),
        ("deepep-ll,h100,8,8,7168,8,256,128,fp8,bf16,fast,67", r"t\.csv:3: column `dispatch_us`"),
        ("deepep-ll,h100,8,8,7168,8,256,128,fp4,bf16,36.7,67", r"t\.csv:3: `dispatch_type` 'fp4'"),
        ("deepep-ll,h100,8,8,7168,8,250,128,fp8,bf16,36.7,67", r"t\.csv:3: 250 experts do not divide over 8"),
        ("deepep-xx,h100,8,8,7168,8,256,128,fp8,bf16,36.7,67", r"t\.csv:3: unknown kernel 'deepep-xx'"),
        ("deepep-ll,h100,8,8,7168,8,256,128,fp8,bf16,36.7", r"t\.csv:3: 11 values for 12 columns"),
        ("deepep-ll,h100,8,8,7168,8,256,128,fp8,bf16,-3,67", r"t\.csv:3: `dispatch_us` must be a positive time"),
        ("deepep-ll,h100,12,8,7168,8,96,128,fp8,bf16,3,67", r"t\.csv:3: ep_size 12 is not a whole number of nodes"),
    ],
)
def test_bad_csv_names_file_line_and_column(tmp_path, body, where):
    (tmp_path / "t.csv").write_text(f"# comment\n{HEADER}\n{body}\n")
    with pytest.raises(ConfigError, match=where):
        read_csv(tmp_path / "t.csv")


def test_bad_csv_header(tmp_path):
    (tmp_path / "t.csv").write_text("kernel,gpu,ep_size,colour\n")
    with pytest.raises(ConfigError, match=r"t\.csv:1: missing column\(s\) gpus_per_node.*unknown column\(s\) colour"):
        read_csv(tmp_path / "t.csv")
    (tmp_path / "e.csv").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="no header"):
        read_csv(tmp_path / "e.csv")


def test_empty_time_is_not_measured(tmp_path):
    (tmp_path / "t.csv").write_text(f"{HEADER}\ndeepep-ll,h100,8,8,7168,8,256,128,fp8,bf16,,67\n")
    (row,) = read_csv(tmp_path / "t.csv")
    assert math.isnan(row.dispatch_us) and row.combine_us == 67


def test_vendored_tables_and_presets():
    for gpu in ("h100", "h200", "b200", "gb200", "h800"):
        rows = vendored_tables(gpu)
        assert rows and all(r.gpu == gpu for r in rows)
    assert {r.kernel for r in vendored_tables("gb200")} == {"deepep-ll", "deepep-normal", "trtllm-a2a"}
    assert {r.nodes for r in vendored_tables("h100")} == {1, 2, 4, 8}
    for name in PRESETS:
        hw = load_hardware(name)
        assert set(hw.kernels) == {"expert", "node", "rank"}
        assert all(k.source.startswith(("fitted to", "derived from")) for k in hw.kernels.values()), name
        assert hw.kernel("expert").dispatch.value.name == "fp8" and hw.kernel("expert").combine.value.name == "bf16"


# ------------------------------------------------------------------------------ the CLI
def test_cli_calibrate_writes_a_links_file(tmp_path):
    truth = _kernel()
    rows = _measured(_shapes(eps=(8, 16), tokens=(1, 16, 256)), truth)
    (tmp_path / "t.csv").write_text(write_csv(rows))
    out = tmp_path / "mine.json"
    res = runner.invoke(app, ["calibrate", str(tmp_path / "t.csv"), "--hold-out", "tokens=16", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "deepep-ll (copies per expert):" in res.output and "held_out" in res.output
    assert re.search(r"deepep-ll\s+synthetic\s+16\s+8\s+7168", res.output)  # the per-row table
    hw = load_hardware(str(out))
    assert hw.name == "mine" and set(hw.kernels) == {"expert", "node", "rank"}
    assert _rel(hw.kernel("expert").dispatch.links.inter.bytes_per_s, 40e9) < 0.03
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == len(rows) and sum(r["held_out"] for r in doc["rows"]) == sum(
        r.tokens_per_rank == 16 for r in rows
    )
    r0 = doc["rows"][0]
    for key in (
        "measured_dispatch_us",
        "predicted_dispatch_us",
        "measured_combine_us",
        "predicted_combine_us",
        "held_out",
        "ep_size",
        "tokens_per_rank",
    ):
        assert key in r0
    assert r0["predicted_dispatch_us"] == pytest.approx(r0["measured_dispatch_us"], rel=0.02)
    assert doc["fit"]["kernels"]["expert"]["dispatch"]["errors"]["held_out"]["all"]["n"] > 0
    again = runner.invoke(app, ["calibrate", str(tmp_path / "t.csv"), "-o", str(out)])
    assert again.exit_code == 2 and "already exists" in again.output
    bad = runner.invoke(app, ["calibrate", str(tmp_path / "t.csv"), "--hold-out", "tokens=>3"])
    assert bad.exit_code == 2 and "whole numbers" in bad.output and "Traceback" not in bad.output
    none = runner.invoke(app, ["calibrate"])
    assert none.exit_code == 2 and "--gpu" in none.output


def test_cli_cost_prints_what_predict_computes(tmp_path):
    hw = load_hardware("h100")
    k = hw.kernel("expert")
    row = KernelRow(kernel="deepep-ll", gpu="h100", source="", ep_size=32, gpus_per_node=8, hidden=7168, top_k=8,
                    num_experts=256, tokens_per_rank=128, dispatch_type="fp8", combine_type="bf16",
                    dispatch_us=math.nan, combine_us=math.nan)  # fmt: skip
    d, c = C.predict([row], k)
    args = [
        "cost",
        "--ep",
        "32",
        "--hidden",
        "7168",
        "--top-k",
        "8",
        "--experts",
        "256",
        "--tokens-per-gpu",
        "128",
        "--link",
        "h100",
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert (
        f"{d[0]:10.1f} us" in res.output
        and f"{c[0]:10.1f} us" in res.output
        and f"{d[0] + c[0]:10.1f} us" in res.output
    )
    assert "EP 32 = 4 node(s) x 8 GPUs" in res.output and "links h100" in res.output
    bf = runner.invoke(app, [*args, "--dispatch-type", "bf16"])
    d_bf, _ = C.predict([replace(row, dispatch_type="bf16")], k)
    assert f"{d_bf[0]:10.1f} us" in bf.output and d_bf[0] > d[0]
    # routing by per-expert loads: all load on experts 0..7 (GPU 0) is slower than uniform
    (tmp_path / "loads.csv").write_text("expert,count\n" + "".join(f"{e},{100 if e < 8 else 0}\n" for e in range(256)))
    skew = runner.invoke(app, [*args, "--loads", str(tmp_path / "loads.csv")])
    assert skew.exit_code == 0, skew.output and "per-expert loads" in skew.output
    d_skew, _ = C.predict([row], k, loads_E=[100.0 if e < 8 else 0.0 for e in range(256)])
    assert f"{d_skew[0]:10.1f} us" in skew.output and d_skew[0] > d[0]
    bad = runner.invoke(app, [*args[:-2], "--experts", "250"])
    assert bad.exit_code == 2 and "do not divide" in bad.output
