"""The calibrated hardware presets (``moetrace/data/links/*.json``) and docs/placement.md's
"Calibration" tables, regenerated from the bundled measured tables (``moetrace/data/kernels/``).

Presets, in order (a later one takes the link classes its tables cannot show from an earlier one):

- ``h100``: DeepEP low-latency (copies per expert) from aiconfigurator's H100 SGLang 0.5.12 table
  plus its 0.5.6.post2 multi-node table (1, 2, 4, 8 nodes of 8: the inter-node link); DeepEP normal
  (copies per node) from the 0.5.12 table plus the 0.5.6.post2 multi-node rows, the 8-node ones
  held out (``NORMAL_HOLD_OUT``: they run below half the per-GPU RDMA rate of the 2- and 4-node
  rows and of DeepEP's own EP64 figure, a fabric effect the model does not have); the per-rank
  kernel derived from the normal fit (inside a node both send one copy per destination GPU).
- ``h200``, ``b200``: single-node tables only; the inter-node link from the ``h100`` fit.
  (aiconfigurator's h200_sxm 0.5.6.post2 multi-node tables repeat the H100 numbers under an H200
  label, so they are not used.)
- ``gb200``: DeepEP tables (4 GPUs per node) and TensorRT-LLM's NVLink all-to-all (copies per
  rank, MNNVL: EP 2..64 in one NVLink domain); the inter-node link from the ``h100`` fit.

Then the hold-out experiments the docs report (fit on some rows, predict the others), the DeepEP
H800 table (``deepep_legacy_ll.csv``: its own fit, and the ``h100`` preset's prediction), and the
wall time.

Run: .venv/bin/python benchmarks/bench_calibrate.py [--write] [--only h100,h200] [--no-experiments]
     .venv/bin/python benchmarks/bench_calibrate.py --vendor AICONFIGURATOR_GIT_DIR DEEPEP_GIT_DIR
(``--write`` replaces the bundled presets; ``--vendor`` rewrites ``data/kernels/`` from the two
repositories' git directories at HEAD.)
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from moetrace.placement import calibrate as C
from moetrace.placement.hardware import hardware_from_json
from moetrace.placement.kernel_tables import KernelRow, vendored_tables, write_csv

ROOT = Path(__file__).resolve().parents[1]
LINKS_DIR = ROOT / "data" / "links"
KERNELS_DIR = ROOT / "data" / "kernels"
#: the rows of each preset's tables held out of its fit (none but the degraded 8-node normal rows)
NORMAL_HOLD_OUT = "kernel=deepep-normal,nodes>=8"
PRESET_ORDER = ("h100", "h200", "b200", "gb200")
#: decode kernels above 256 tokens per GPU, prefill kernels above 4096: fit below, predict above
TOKENS_HOLD_OUT = "kernel=deepep-ll|trtllm-a2a,tokens>256;kernel=deepep-normal,tokens>4096"
#: hold-out experiments: (name, GPU kinds whose bundled rows are read, hold-out spec)
EXPERIMENTS = (
    ("h100, every 5th row held out", ("h100",), "every=5"),
    ("h100, large token counts held out", ("h100",), TOKENS_HOLD_OUT),
    ("h100, 8 nodes held out", ("h100",), "nodes>=8"),
    ("h200 predicted from h100", ("h100", "h200"), "gpu=h200"),
    ("h100 predicted from h200", ("h100", "h200"), "gpu=h100"),
    ("b200 predicted from gb200 (4 -> 8 GPUs per node)", ("gb200", "b200"), "gpu=b200"),
    ("gb200 predicted from b200 (8 -> 4 GPUs per node; DeepEP kernels)", ("gb200", "b200"), "gpu=gb200"),
    ("h200, large token counts held out", ("h200",), TOKENS_HOLD_OUT),
    ("b200, large token counts held out", ("b200",), TOKENS_HOLD_OUT),
    ("gb200, large token counts held out", ("gb200",), TOKENS_HOLD_OUT),
    ("b200, every 5th row held out", ("b200",), "every=5"),
    ("h800 (DeepEP), EP >= 64 held out", ("h800",), "ep>=64"),
)


def _git_show(repo: Path, path: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), "show", f"HEAD:{path}"], check=True, capture_output=True).stdout


def _git_head(repo: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


# ------------------------------------------------------------------------------ vendoring
AIC_DATA = "aic-core/src/aiconfigurator_core/systems/data"
#: (system, runtime folder, table) -> vendored file name
AIC_TABLES = [
    (sys_, ver, tab)
    for sys_ in ("h100_sxm", "h200_sxm", "b200_sxm", "gb200")
    for ver, tab in (("sglang/0.5.12", "wideep_deepep_ll_perf"), ("sglang/0.5.12", "wideep_deepep_normal_perf"))
] + [
    ("h100_sxm", "sglang/0.5.6.post2", "wideep_deepep_ll_perf"),
    ("h100_sxm", "sglang/0.5.6.post2", "wideep_deepep_normal_perf"),
    ("gb200", "trtllm/1.3.0rc10", "trtllm_alltoall_perf"),
]


def _vendored_name(system: str, ver: str, table: str) -> str:
    fw, v = ver.split("/")
    suffix = ".fastest_sms" if table == "wideep_deepep_normal_perf" else ""
    return f"{system}.{fw}-{v}.{table}{suffix}.parquet"


def _subset(table, name: str):
    """The rows of an aiconfigurator table the reader uses: the normal tables' fastest SM setting per
    shape (for dispatch and for combine), the TensorRT-LLM table's two-sided dispatch and combine."""
    cols = table.to_pydict()
    n = table.num_rows
    if name == "wideep_deepep_normal_perf":
        best: dict[tuple, list] = {}
        for i in range(n):
            key = tuple(
                cols[c][i] for c in ("device", "node_num", "hidden_size", "num_topk", "num_experts", "num_token")
            )
            b = best.setdefault(key, [math.inf, -1, math.inf, -1])
            if 0 < cols["dispatch_transmit_us"][i] < b[0]:
                b[0], b[1] = cols["dispatch_transmit_us"][i], i
            if 0 < cols["combine_transmit_us"][i] < b[2]:
                b[2], b[3] = cols["combine_transmit_us"][i], i
        keep = sorted({i for b in best.values() for i in (b[1], b[3]) if i >= 0})
        return table.take(keep)
    if name == "trtllm_alltoall_perf":
        keep = [
            i
            for i in range(n)
            if cols["kernel_source"][i] == "NVLinkTwoSided"
            and cols["op_name"][i] in ("alltoall_dispatch", "alltoall_combine")
        ]
        return table.take(keep)
    return table


def _md_table(text: str, heading: str) -> list[list[str]]:
    """The first markdown table after ``heading``: rows of cells (header and rule dropped)."""
    part = text[text.index(heading) :]
    rows, seen = [], False
    for ln in part.splitlines()[1:]:
        if ln.startswith("|"):
            seen = True
            rows.append([c.strip() for c in ln.strip("|").split("|")])
        elif seen:
            break
    return rows[2:]


def vendor(aic: Path, deepep: Path) -> None:
    import pyarrow.parquet as pq

    KERNELS_DIR.mkdir(exist_ok=True)
    aic_head, deepep_head = _git_head(aic), _git_head(deepep)
    readme = [
        "# Measured all-to-all kernel tables",
        "",
        "`moetrace calibrate` fits the step model to these (`placement/kernel_tables.py` reads them;",
        "`benchmarks/bench_calibrate.py --vendor` rewrites this folder from the two repositories below).",
        "",
        "## ai-dynamo/aiconfigurator (Apache-2.0, LICENSE.aiconfigurator)",
        "",
        f"Commit `{aic_head}`, under `{AIC_DATA}/`:",
        "",
        "| file here | upstream path | rows kept |",
        "|---|---|---|",
    ]
    for system, ver, table in AIC_TABLES:
        up = f"{system}/comm/{ver}/{table}.parquet"
        t = pq.read_table(io.BytesIO(_git_show(aic, f"{AIC_DATA}/{up}")))
        sub = _subset(t, table)
        name = _vendored_name(system, ver, table)
        pq.write_table(sub, KERNELS_DIR / name, compression="zstd")
        how = {
            "wideep_deepep_normal_perf": "the fastest SM setting per shape (dispatch and combine)",
            "trtllm_alltoall_perf": "NVLinkTwoSided dispatch and combine",
        }.get(table, "all")
        readme.append(f"| `{name}` | `{up}` | {sub.num_rows} of {t.num_rows}: {how} |")
    (KERNELS_DIR / "LICENSE.aiconfigurator").write_bytes(_git_show(aic, "LICENSE"))
    readme += [
        "",
        "What was measured (collectors at the same commit): `collector/wideep/sglang/collect_deepep_ll.py` over",
        "`deepep/test_low_latency.py` (uniform routing, FP8 dispatch, BF16 combine, one node: 8 GPUs, 4 on GB200);",
        "`collect_deepep_normal.py` over `deepep/test_intranode.py` (uniform routing, FP8 dispatch on SM90 builds,",
        "BF16 combine, swept over 4..24 SMs); the 0.5.6.post2 multi-node rows from `deepep/test_internode.py`",
        "(8 GPUs per node; normal kernels route group-limited to `min(nodes, 4)` nodes);",
        "`collector/network/slurm/collect_trtllm_alltoall.py` (TensorRT-LLM MNNVL all-to-all, balanced routing,",
        "latency in ms, combine without reduction).",
        "",
        "## deepseek-ai/DeepEP (MIT, LICENSE.deepep)",
        "",
    ]
    (KERNELS_DIR / "LICENSE.deepep").write_bytes(_git_show(deepep, "LICENSE"))
    # the current table (docs/legacy.md) and the first published one (README.md of the initial commit)
    legacy = _git_show(deepep, "docs/legacy.md").decode()
    cur = _md_table(legacy, "### Low-latency kernels with pure RDMA")
    first_commit = "ebfe47e46fa86a5b41be96c326a92f62ed6721da"
    first = _md_table(
        subprocess.run(
            ["git", "-C", str(deepep), "show", f"{first_commit}:README.md"], check=True, capture_output=True, text=True
        ).stdout,
        "### Low-latency kernels with pure RDMA",
    )

    def us(cell: str) -> float:
        return float(re.match(r"([0-9.]+)", cell).group(1))  # type: ignore[union-attr]

    def rows_of(table: list[list[str]], gpn_of) -> list[KernelRow]:
        out = []
        for cells in table:
            ep = int(cells[0])
            out.append(
                KernelRow(
                    kernel="deepep-ll",
                    gpu="h800",
                    source="",
                    ep_size=ep,
                    gpus_per_node=gpn_of(ep),
                    hidden=7168,
                    top_k=8,
                    num_experts=288 if 288 % ep == 0 else 256,
                    tokens_per_rank=128,
                    dispatch_type="fp8",
                    combine_type="bf16",
                    dispatch_us=us(cells[1]),
                    combine_us=us(cells[4]),
                )
            )
        return out

    first_eps = {int(c[0]): (c[1], c[4]) for c in first}
    changed = [c for c in cur if first_eps.get(int(c[0])) != (c[1], c[4])]
    changed_eps = {int(c[0]) for c in changed}
    cur_rows = rows_of(cur, lambda ep: 8 if ep in changed_eps else 1)
    common = [
        "hidden 7168, top-8, 128 tokens per GPU, FP8 dispatch, BF16 combine, H800 with one CX7 400 Gb/s NIC per GPU;",
        "experts: tests/test_low_latency.py runs 288 (DeepSeek-V3's 256 + 32 redundant); DeepEP asserts experts % EP == 0,",
        "which 288 fails at EP 64/128/256: those rows assume 256 (uniform per-expert copies hardly depend on the count)",
    ]
    text = write_csv(
        cur_rows,
        comments=[
            f"DeepEP low-latency kernels, deepseek-ai/DeepEP@{deepep_head} docs/legacy.md",
            '"Low-latency kernels with pure RDMA" (MIT License, LICENSE.deepep), transcribed by benchmarks/bench_calibrate.py;',
            *common,
            f"EP {', '.join(str(e) for e in sorted(changed_eps))}: re-measured on 2025-06-05 (commit de8cfca3, 'low-latency kernels now",
            "leverage NVLink as much as possible', PR #173): same-node copies over NVLink, gpus_per_node 8;",
            "the other rows are unchanged since the first table (pure RDMA): gpus_per_node 1",
        ],
    )
    (KERNELS_DIR / "deepep_legacy_ll.csv").write_text(text)
    first_rows = [r for r in rows_of(first, lambda ep: 1) if r.ep_size in changed_eps]
    text = write_csv(
        first_rows,
        comments=[
            f"DeepEP low-latency kernels before NVLink was used, deepseek-ai/DeepEP@{first_commit} README.md",
            '"Low-latency kernels with pure RDMA" (MIT License, LICENSE.deepep): the rows later re-measured',
            "(the others are in deepep_legacy_ll.csv, unchanged); every copy over RDMA: gpus_per_node 1;",
            *common,
        ],
    )
    (KERNELS_DIR / "deepep_ll_pure_rdma_2025_02.csv").write_text(text)
    readme += [
        f'Commit `{deepep_head}`: `docs/legacy.md`, "Low-latency kernels with pure RDMA" (H800, 128 tokens per GPU,',
        "hidden 7168, top-8, FP8 dispatch, BF16 combine) as `deepep_legacy_ll.csv`. Its EP 8..64 rows were re-measured",
        "on 2025-06-05 with NVLink for same-node copies (commit `de8cfca3`, PR #173; the heading still says pure RDMA):",
        "they carry `gpus_per_node` 8, the unchanged EP 128/256 rows 1. The table as first published (pure RDMA,",
        f"commit `{first_commit}`, README.md) for the re-measured EP sizes is `deepep_ll_pure_rdma_2025_02.csv`.",
        "The test (`tests/legacy/test_low_latency.py`) runs 288 experts, which EP 64/128/256 cannot divide: those rows assume 256.",
        "",
    ]
    (KERNELS_DIR / "README.md").write_text("\n".join(readme))
    total = sum(f.stat().st_size for f in KERNELS_DIR.iterdir())
    print(f"wrote {len(list(KERNELS_DIR.iterdir()))} files, {total / 1024:.0f} KiB, to {KERNELS_DIR}")


# ------------------------------------------------------------------------------ presets
def _pure_rdma_error(kernel) -> tuple[float, float]:
    """Median and worst relative error (dispatch and combine together) on DeepEP's pure-RDMA rows (H800, one
    NVLink domain per GPU: every copy over the NIC), EP 8..256: the only rows beyond EP 64."""
    rows = [r for r in vendored_tables("h800") if r.gpus_per_node == 1]
    d, c = C.predict(rows, kernel)
    meas_d = np.array([r.dispatch_us for r in rows])
    meas_c = np.array([r.combine_us for r in rows])
    e = C.errors(np.concatenate([d, c]), np.concatenate([meas_d, meas_c]))
    return float(e["median"]), float(e["worst"])


def build_presets(only: set[str] | None) -> dict[str, C.Calibration]:
    cals: dict[str, C.Calibration] = {}
    base = None
    for name in PRESET_ORDER:
        if only and name not in only and name != "h100":
            continue
        rows = vendored_tables(name)
        hold = NORMAL_HOLD_OUT if name == "h100" else None
        t0 = time.perf_counter()
        cal = C.calibrate(rows, hold_out=hold, base=base, name=name, gpu=name)
        if name == "h100" and cal.hardware.kernel("expert").dispatch.links.inter.latency_s > 0:
            # the per-peer RDMA latency the H100 tables (EP 16..64) keep must also hold where the peers
            # are many more: DeepEP's pure-RDMA rows reach EP 256; kept only if it helps there too
            alt = C.calibrate(rows, hold_out=hold, base=base, name=name, gpu=name, no_latency=("expert.inter",))
            (e_with, w_with), (e_without, w_without) = (
                _pure_rdma_error(cal.hardware.kernel("expert")),
                _pure_rdma_error(alt.hardware.kernel("expert")),
            )
            note = (
                f"expert.inter latency: median (worst) error on DeepEP's pure-RDMA H800 rows (EP 8..256, deepep_legacy_ll.csv and "
                f"deepep_ll_pure_rdma_2025_02.csv) {e_with * 100:.1f}% ({w_with * 100:.0f}%) with it, "
                f"{e_without * 100:.1f}% ({w_without * 100:.0f}%) without"
            )
            if e_without < e_with:
                cal = alt
                note += ": left out"
            cal.notes.append(note)
            print(note, file=sys.stderr)
        print(f"{name}: {len(rows)} rows, fitted in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        cals[name] = cal
        if name == "h100":
            base = cal.hardware
    return cals


def _table(cals: dict[str, C.Calibration], title: str) -> str:
    out = [
        f"### {title}",
        "",
        "| preset | kernel | phase | rows fitted | median / worst (fitted) | rows held out | median / worst (held out) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, cal in cals.items():
        for kf in cal.fits.values():
            rep = kf.report()
            for ph in ("dispatch", "combine"):
                e = rep[ph]["errors"]
                tr, ho = e.get("train", {}).get("all"), e.get("held_out", {}).get("all")

                def cell(x):
                    return f"{x['median'] * 100:.1f} % / {x['worst'] * 100:.0f} %" if x else "-"

                out.append(
                    f"| {name} | {rep['kernel']} | {ph} | {tr['n'] if tr else 0} | {cell(tr)} | {ho['n'] if ho else 0} | {cell(ho)} |"
                )
    return "\n".join(out)


def _params_table(cals: dict[str, C.Calibration]) -> str:
    out = [
        "| preset | copies | kernel | phase | fixed µs | intra GB/s | intra µs/msg | inter GB/s | inter µs/msg | source |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, cal in cals.items():
        for copies, k in cal.hardware.kernels.items():
            for ph in ("dispatch", "combine"):
                p = getattr(k, ph)
                out.append(
                    f"| {name} | {copies} | {k.name} | {ph} ({p.value.name}) | {p.fixed_s * 1e6:.1f} | {p.links.intra.bytes_per_s / 1e9:.0f} |"
                    f" {p.links.intra.latency_s * 1e6:.2f} | {p.links.inter.bytes_per_s / 1e9:.1f} | {p.links.inter.latency_s * 1e6:.2f} | {k.source} |"
                )
    return "\n".join(out)


def _per_gpu_table(cal: C.Calibration, name: str) -> str:
    out = []
    for kf in cal.fits.values():
        for ph in ("dispatch", "combine"):
            meas = np.array([getattr(r, f"{ph}_us") for r in kf.rows])
            pred = getattr(kf, ph).predicted_us
            for split, m in (("fitted", ~kf.held_out), ("held out", kf.held_out)):
                if not m.any():
                    continue
                for key, sel in (
                    ("all", np.ones(len(kf.rows), bool)),
                    *(
                        (f"{n} node(s)", np.array([r.nodes == n for r in kf.rows]))
                        for n in sorted({r.nodes for r in kf.rows})
                        if len({r.nodes for r in kf.rows}) > 1
                    ),
                ):
                    e = C.errors(pred[m & sel], meas[m & sel])
                    if e["n"]:
                        out.append(
                            f"| {name} | {kf.kernel.name} | {ph} | {split} | {key} | {e['n']} | {e['median'] * 100:.1f} % | {e['worst'] * 100:.0f} % |"
                        )
    return "\n".join(out)


def deepep_rows_table(kernel, rows: list[KernelRow], label: str) -> str:
    d, c = C.predict(rows, kernel)
    out = [
        f"| {label} | EP | GPUs per node | measured dispatch µs | predicted | ratio | measured combine µs | predicted | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, pd_, pc in zip(rows, d, c, strict=True):
        out.append(
            f"| {r.source.split(':')[0]} | {r.ep_size} | {r.gpus_per_node} | {r.dispatch_us:.0f} | {pd_:.0f} | {pd_ / r.dispatch_us:.2f} | {r.combine_us:.0f} | {pc:.0f} | {pc / r.combine_us:.2f} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="replace the bundled presets (data/links/*.json)")
    ap.add_argument("--only", default="", help="presets to fit (h100 is always fitted: the others take its inter link)")
    ap.add_argument("--no-experiments", action="store_true")
    ap.add_argument(
        "--vendor", nargs=2, metavar=("AICONFIGURATOR", "DEEPEP"), help="rewrite data/kernels/ from these git dirs"
    )
    args = ap.parse_args()
    if args.vendor:
        vendor(Path(args.vendor[0]), Path(args.vendor[1]))
        return
    t_all = time.perf_counter()
    only = {x for x in args.only.split(",") if x} or None
    cals = build_presets(only)
    if args.write:
        for name, cal in cals.items():
            doc = json.loads(C.calibration_text(cal))
            hardware_from_json(doc, name=name)  # what --link reads
            # the bundled preset keeps the fit's report but not its per-row predictions (megabytes; every
            # command reads the default preset): `moetrace calibrate --gpu NAME -o FILE.json` writes them
            n_rows = len(doc.pop("rows", []))
            doc["rows_note"] = (
                f"{n_rows} rows; `moetrace calibrate --gpu {name} -o FILE.json` writes each with its prediction"
            )
            (LINKS_DIR / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
            print(f"wrote {LINKS_DIR / f'{name}.json'}", file=sys.stderr)
    t_fit = time.perf_counter() - t_all
    print("## Fitted parameters\n")
    print(_params_table(cals))
    print()
    print(_table(cals, "Presets: error on the rows each was fitted to (and held out)"))
    print()
    print("| preset | kernel | phase | rows | which | n | median | worst |\n|---|---|---|---|---|---|---|---|")
    for name, cal in cals.items():
        print(_per_gpu_table(cal, name))
    print()
    if not args.no_experiments:
        print("### Hold-out experiments\n")
        print(
            "| experiment | kernel | phase | rows fitted | median / worst (fitted) | rows held out | median / worst (held out) |\n|---|---|---|---|---|---|---|"
        )
        base = cals["h100"].hardware
        for title, gpus, spec in EXPERIMENTS:
            rows = [r for g in gpus for r in vendored_tables(g)]
            if "DeepEP kernels" in title:
                rows = [r for r in rows if r.kernel.startswith("deepep")]
            cal = C.calibrate(rows, hold_out=spec, base=base, name="x")
            for kf in cal.fits.values():
                rep = kf.report()
                for ph in ("dispatch", "combine"):
                    e = rep[ph]["errors"]
                    tr, ho = e.get("train", {}).get("all"), e.get("held_out", {}).get("all")
                    f = lambda x: f"{x['median'] * 100:.1f} % / {x['worst'] * 100:.0f} %" if x and x["n"] else "-"  # noqa: E731
                    print(
                        f"| {title} (`{spec}`) | {rep['kernel']} | {ph} | {tr['n'] if tr else 0} | {f(tr)} | {ho['n'] if ho else 0} | {f(ho)} |"
                    )
        print()
        print("### DeepEP's low-latency table (H800)\n")
        h800 = vendored_tables("h800")
        cal = C.calibrate(h800, base=base, name="h800", gpu="h800")
        print(C.format_fit(cal))
        print()
        print(deepep_rows_table(cal.hardware.kernel("expert"), h800, "fitted to these rows (h800)"))
        print()
        print(deepep_rows_table(base.kernel("expert"), h800, "the h100 preset"))
    print(f"\nwall time: presets {t_fit:.1f} s, all {time.perf_counter() - t_all:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
