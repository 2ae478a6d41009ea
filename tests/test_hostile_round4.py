"""Hostile inputs, round four (issue 38), through the CLI: importers estimate every allocation from the shape
an input declares before making it, integers written inside text options take ASCII digits only, and
messages name only options the command has.

Each case asserts the exit code, exactly one ``Error:`` line matching the expected message, no traceback,
every ``--option`` the line names an option of that command, and every file under the case's folder
hashing the same before and after; a SIGALRM turns a hang (or minutes of work on a declared shape) into a
failure (``hostile.run_case_naming_own_options``, which round three's cases run through too). One case
runs in a subprocess under ``RLIMIT_AS``: the default budget follows the limit.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hostile import DEPLOY, Case, run_case_naming_own_options, trace_in

torch = pytest.importorskip("torch")
TINY = "olmoe-1b-7b-tiny"  # 16 layers, all MoE, 64 experts, top-8


def _huge(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A view of one stored zero declaring ``shape``: ``torch.save`` keeps it as a view (a file of ~1 KB)."""
    return torch.zeros(1, dtype=dtype).expand(*shape)


def _stat_pt(d: Path) -> Path:
    p = d / "expert_distribution_recorder_1.pt"
    torch.save({"rank": 0, "logical_count": _huge(10**9, 16, 64)}, p)
    return p


def _map() -> torch.Tensor:
    return torch.arange(64, dtype=torch.int64).repeat(16, 1)


def _pass_pt(d: Path) -> Path:
    rec = {"forward_pass_id": 0, "rank": 0, "gatherer_key": "primary", "global_physical_count": _huge(16, 10**12)}
    p = d / "expert_distribution_recorder_1_0.pt"
    torch.save({"records": [rec], "last_physical_to_logical_map": _map()}, p)
    return p


def _token_record(ids: torch.Tensor) -> dict:
    return {
        "forward_pass_id": 0,
        "rank": 0,
        "gatherer_key": "primary",
        "forward_mode": 1,
        "input_ids": [1],
        "positions": [0],
        "topk_ids_of_layer": ids,
    }


def _dump_pt(d: Path, *, huge_map: bool = False) -> Path:
    ids = torch.zeros((16, 1, 8), dtype=torch.int32) if huge_map else _huge(16, 10**10, 8, dtype=torch.int32)
    p = d / "expert_distribution_recorder_1_0.pt"
    torch.save(
        {"records": [_token_record(ids)], "last_physical_to_logical_map": _huge(16, 10**12) if huge_map else _map()}, p
    )
    return p


def _sglang_line(d: Path) -> Path:
    """One ~150-byte response declaring a 500,001-token request whose ids start at its last position:
    DeepSeek-V3's 61 layers x top-8 of padding, about 2.6 GB to convert."""
    meta = {"prompt_tokens": 500000, "completion_tokens": 1, "routed_experts_start_len": 500000, "routed_experts": ""}
    p = d / "resp.jsonl"
    p.write_text(json.dumps({"meta_info": meta}) + "\n")
    return p


def _trtllm(d: Path, *, count: int = 1, iterations: int = 100) -> Path:
    from safetensors.numpy import save_file

    src = d / "stats"
    src.mkdir()
    (src / "meta_info.json").write_text(json.dumps({"num_experts": 64, "num_experts_per_token": 8}))
    dtype = np.uint64 if count >= 2**63 else np.int64
    save_file({f"{it}_0": np.full(64, count, dtype=dtype) for it in range(iterations)}, str(src / "rank0.safetensors"))
    return src


def _lost_part(d: Path) -> Path:
    t = trace_in(d)
    sorted((t / "requests").glob("*.parquet"))[0].unlink()
    return t


def _incomplete(d: Path) -> Path:
    t = trace_in(d)
    m = json.loads((t / "manifest.json").read_text())
    m["complete"] = False
    (t / "manifest.json").write_text(json.dumps(m))
    return t


def _import(src: Path, out: Path, *extra: str, model: str = TINY) -> list[str]:
    return ["import", str(src), "--model", model, "-o", str(out), *extra]


CASES: dict[str, Case] = {
    # ---- every allocation estimated from the declared shape, checked against the budget before it is made
    "sglang-stat .pt declaring [10**9, 16, 64] over one count": Case(
        lambda d: _import(_stat_pt(d), d / "p.parquet", "--format", "sglang-stat"),
        r"'logical_count' declares shape \[1000000000, 16, 64\].*over the import's budget.*--max-memory",
    ),
    "sglang-pass .pt whose counts declare [16, 10**12]": Case(
        lambda d: _import(_pass_pt(d), d / "p.parquet", "--format", "sglang-pass"),
        r"global_physical_count` declares shape \[16, 1000000000000\].*over the import's budget",
    ),
    "sglang-dump .pt whose ids declare [16, 10**10, 8]": Case(
        lambda d: _import(_dump_pt(d), d / "t", "--format", "sglang-dump"),
        r"topk_ids_of_layer` declares shape \[16, 10000000000, 8\].*over the import's budget",
    ),
    "sglang-dump .pt whose map declares 10**12 slots": Case(
        lambda d: _import(_dump_pt(d, huge_map=True), d / "t", "--format", "sglang-dump"),
        r"last_physical_to_logical_map declares shape \[16, 1000000000000\]",
    ),
    "sglang line of 150 bytes declaring 2.6 GB of padding": Case(
        lambda d: _import(_sglang_line(d), d / "t", "--max-memory", "0.5", model="deepseek-v3"),
        r"resp\.jsonl:1: request 0: a request of 500,000\+1 tokens from position 500,000: 2\.\d GiB.*--max-memory",
    ),
    "trtllm-stats counts over the budget": Case(
        lambda d: _import(_trtllm(d), d / "p.parquet", "--format", "trtllm-stats", "--max-memory", "0.001"),
        r"1 ranks, 100 iterations x 16 layers x 64 experts: 1\.6 MiB of counts in memory, over the import's budget",
    ),
    "trtllm-stats counts adding up past int64": Case(
        lambda d: _import(_trtllm(d, count=2**63, iterations=1), d / "p.parquet", "--format", "trtllm-stats"),
        r"rank0\.safetensors: '0_0': the counts add up to 2\*\*62 or more",
    ),
    # ---- integers inside text options: ASCII digits, bounded
    "compare --route-on first-decode:<Arabic-Indic 3>": Case(
        lambda d: ["compare", str(trace_in(d)), *DEPLOY, "--route-on", "first-decode:\u0663"],
        r"--route-on first-decode:N: '\u0663' is not a whole number written with the digits 0-9",
    ),
    "compare --route-on first-decode:<full-width 3>": Case(
        lambda d: ["compare", str(trace_in(d)), *DEPLOY, "--route-on", "first-decode:\uff13"],
        r"--route-on first-decode:N: '\uff13' is not a whole number written with the digits 0-9",
    ),
    "compare --route-on first-decode:<superscript 2>": Case(
        lambda d: ["compare", str(trace_in(d)), *DEPLOY, "--route-on", "first-decode:\u00b2"],
        r"is not a whole number written with the digits 0-9",
    ),
    "compare --route-on first-decode:<5000 digits>": Case(
        lambda d: ["compare", str(trace_in(d)), *DEPLOY, "--route-on", "first-decode:" + "1" * 5000],
        r"--route-on first-decode:N: 1{24}\.\.\. is outside 1\.\.65,536",
    ),
    "place --config DP<full-width 2>TP1EP2": Case(
        lambda d: [
            "place",
            str(trace_in(d)),
            "--config",
            "DP\uff12TP1EP2",
            "--gpus-per-node",
            "1",
            "-o",
            str(d / "p.json"),
        ],
        r"is not of the form DPaTPbEPc",
    ),
    "place --config with a 5000-digit count": Case(
        lambda d: ["place", str(trace_in(d)), "--config", "DP" + "1" * 5000 + "TP1EP2", "-o", str(d / "p.json")],
        r"a count of more than 9 digits",
    ),
    # ---- messages name only options the command has (advise shares compare's simulation)
    "advise --steps 10**12": Case(
        lambda d: ["advise", str(trace_in(d)), *DEPLOY, "--steps", str(10**12), "-o", str(d / "a")],
        r"--steps 1000000000000 x .*lower --steps or --decode-tokens-per-gpu",
    ),
    "advise --prefill-tokens-per-gpu 10**11": Case(
        lambda d: ["advise", str(trace_in(d)), *DEPLOY, "--prefill-tokens-per-gpu", str(10**11), "-o", str(d / "a")],
        r"--prefill-tokens-per-gpu 100000000000: at most",
    ),
    "advise of a trace with a lost part": Case(
        lambda d: ["advise", str(_lost_part(d)), *DEPLOY, "-o", str(d / "a")],
        r"the trace is damaged \(run `moetrace validate [^`]+`\)\.$",
    ),
    "dashboard of a trace with a lost part": Case(
        lambda d: ["dashboard", str(_lost_part(d)), "-o", str(d / "r.html")], r"the trace is damaged"
    ),
    "advise of an incomplete trace": Case(
        lambda d: ["advise", str(_incomplete(d)), *DEPLOY, "-o", str(d / "a")],
        r"Resume it with `moetrace collect --resume` \(an import or a synth runs again\)\.$",
    ),
    "analyze of a trace with a lost part keeps its hint": Case(
        lambda d: ["analyze", str(_lost_part(d)), "-o", str(d / "a")], r"Pass --allow-incomplete to read what is there"
    ),
    "analyze of an incomplete trace keeps its hint": Case(
        lambda d: ["analyze", str(_incomplete(d)), "-o", str(d / "a")],
        r"moetrace collect --resume.*Pass --allow-incomplete to read the committed part",
    ),
    "advise --decode-tokens-per-gpu 0": Case(
        lambda d: ["advise", str(trace_in(d)), *DEPLOY, "--decode-tokens-per-gpu", "0", "-o", str(d / "a")],
        r"--decode-tokens-per-gpu and --prefill-tokens-per-gpu must be >= 1",
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_round4(tmp_path, name):
    run_case_naming_own_options(CASES[name], tmp_path, name)


def test_default_budget_follows_rlimit_as(tmp_path):
    """Without --max-memory, under an address-space limit, the 150-byte line's 2.6 GB is refused before it is
    allocated (the budget is half of what the process may still map), not a MemoryError."""
    src = _sglang_line(tmp_path)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(
        [sys.executable, "-m", "moetrace", *_import(src, tmp_path / "t", model="deepseek-v3")],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "over the import's budget" in errors[0] and "half the available memory" in errors[0]
    assert not (tmp_path / "t").exists()
