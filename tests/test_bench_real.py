"""``benchmarks/bench_real.py``, the script behind docs/placement.md's real-data tables, runs end to end
on logs in ESFT's format (two tasks of planted, task-specific routing; a tiny run: 2 nodes, one split,
a few steps), so that a change to what ``run_compare`` returns cannot break it unseen. Slow tier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from moetrace.tracer.importers import esft

ROOT = Path(__file__).resolve().parents[1]
V2LITE = esft.model_info()  # 26 MoE layers, 64 experts, top-6


def write_logs(root: Path) -> Path:
    """``expert_scores/<task>/expert_weights_<layer>.txt`` (a line per sequence: its tokens' ids, a blank
    field, their weights): 2 tasks of 24 sequences, each task routing mostly to its own half of the experts."""
    rng = np.random.default_rng(0)
    L, K, E = V2LITE.num_moe_layers, V2LITE.top_k, V2LITE.num_experts
    for t, task in enumerate(("law", "intent")):
        lines: list[list[str]] = [[] for _ in range(L)]
        for _ in range(24):
            T = int(rng.integers(6, 12))
            pref = rng.random((T, L, E)) + np.where((np.arange(E) // (E // 2)) == t, 1.0, 0.0)
            ids = np.argsort(-pref, axis=2)[:, :, :K]
            w = np.round(rng.dirichlet(np.ones(K), size=(T, L)), 4)
            for l in range(L):  # one line per sequence: its tokens' ids, then their weights
                a = "\t".join(str(int(x)) for x in ids[:, l].reshape(-1))
                b = "\t".join(repr(float(x)) for x in w[:, l].reshape(-1))
                lines[l].append(f"{a}\t\t{b}")
        folder = root / task
        folder.mkdir(parents=True)
        for l, layer in enumerate(V2LITE.moe_layers):
            (folder / f"expert_weights_{layer}.txt").write_text("\n".join(lines[l]) + "\n")
    return root


def test_bench_real_runs_and_writes_every_strategy_and_bound(tmp_path):
    logs = write_logs(tmp_path / "expert_scores")
    out = tmp_path / "rows.json"
    args = ["--esft", str(logs), "--work", str(tmp_path / "work"), "--nodes", "2", "--seeds", "0"]
    args += ["--orders", "shuffled,bursts", "--dedup", "expert", "--batches", "4", "--requests-per-node", "8"]
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_real.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    got = {(row["order"], row["strategy"]) for row in rows}
    for order in ("shuffled", "bursts"):
        assert {(order, s) for s in ("linear", "eplb", "joint", "ours", "oracle")} <= got
    assert {row["batch_requests"] for row in rows} == {16}  # 8 requests per node on 2 nodes
    assert "| 2 | ours" in r.stdout and "ours <= EPLB in MoE-layer and all-to-all time" in r.stdout
