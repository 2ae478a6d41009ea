"""Hostile inputs, round three (issue 38), through the CLI: outputs never replace inputs or another
command's output, readers verify the checksums of what they stream, load-profile totals cannot overflow,
inputs are regular files (a named pipe never hangs a command), over-long integers and 2**63 options give
one line.

Each case asserts the exit code, exactly one ``Error:`` line matching the expected message, no traceback,
every ``--option`` the line names an option of that command, and that every file the case names as a target
hashes the same before and after (``hostile.run_case_naming_own_options``). A SIGALRM turns a hang into a
failure. Kills of the replacing writers: tests/test_replace_kills.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hostile import DEPLOY, Case, run_case_naming_own_options, trace_in
from typer.testing import CliRunner

from moetrace.cli import app

runner = CliRunner()


def _placement(tmp: Path) -> Path:
    t = trace_in(tmp)
    p = tmp / "p.json"
    r = runner.invoke(app, ["place", str(t), *DEPLOY, "-o", str(p)])
    assert r.exit_code == 0, r.output
    return p


def _results(tmp: Path, manifest: str, fmt: str) -> Path:
    """A results folder whose manifest names ``fmt`` (what another command wrote)."""
    d = tmp / "res"
    d.mkdir()
    (d / manifest).write_text(json.dumps({"format": fmt, "version": 1}))
    (d / "layers.parquet").write_bytes(b"PAR1 not really")
    return d


def _jsonl(tmp: Path) -> Path:
    rec = {"request": 0, "layer": 0, "position": 0, "stage": "prefill", "experts": [1, 2, 3, 4, 5, 6, 7, 8]}
    f = tmp / "in.jsonl"
    f.write_text(json.dumps(rec) + "\n")
    return f


def _import(src: Path, out: Path) -> list[str]:
    return ["import", str(src), "--model", "olmoe-1b-7b-tiny", "-o", str(out), "--overwrite"]


def _flip_id(tmp: Path) -> Path:
    """A trace whose first routing part has one expert id changed to another valid id (rows still valid)."""
    t = trace_in(tmp)
    f = sorted((t / "routing").glob("*.parquet"))[0]
    table = pq.read_table(f)
    flat = pa.compute.list_flatten(table.column("experts")).to_numpy().copy()
    i = int(np.flatnonzero(flat >= 0)[0])
    flat[i] = (flat[i] + 1) % 16
    col = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.int16()), table.schema.field("experts").type.list_size)
    pq.write_table(table.set_column(table.schema.get_field_index("experts"), "experts", col), f)
    return t


def _shift_prompt(tmp: Path) -> Path:
    """A trace whose requests part says one more prompt token and one fewer output token for a request:
    every row stays valid, only the prefill/decode split moves (the checksum alone tells)."""
    t = trace_in(tmp)
    f = sorted((t / "requests").glob("*.parquet"))[0]
    table = pq.read_table(f)
    i = int(np.flatnonzero(table.column("output_tokens").to_numpy() > 0)[0])
    p, o = table.column("prompt_tokens").to_numpy().copy(), table.column("output_tokens").to_numpy().copy()
    p[i], o[i] = p[i] + 1, o[i] - 1
    idx = table.schema.get_field_index
    table = table.set_column(
        idx("prompt_tokens"), table.schema.field("prompt_tokens"), pa.array(p, table.schema.field("prompt_tokens").type)
    )
    table = table.set_column(
        idx("output_tokens"), table.schema.field("output_tokens"), pa.array(o, table.schema.field("output_tokens").type)
    )
    pq.write_table(table, f)
    return t


def _profile(tmp: Path, *, huge: bool = False) -> Path:
    """A load profile of the small trace; ``huge``: every count rewritten to 2**61 (totals past int64)."""
    p = tmp / "prof.parquet"
    r = runner.invoke(app, ["profile", str(trace_in(tmp)), "-o", str(p)])
    assert r.exit_code == 0, r.output
    if huge:
        table = pq.read_table(p)
        counts = table.column("counts").combine_chunks()
        values = np.full(len(counts.flatten()), 1 << 61, np.int64)
        col = pa.FixedSizeListArray.from_arrays(pa.array(values), type=counts.type)
        table = table.set_column(table.schema.get_field_index("counts"), table.schema.field("counts"), col)
        pq.write_table(table, p)
    return p


def _fifo_manifest(tmp: Path) -> Path:
    t = trace_in(tmp)
    (t / "manifest.json").unlink()
    os.mkfifo(t / "manifest.json")
    return t


def _fifo(p: Path) -> Path:
    os.mkfifo(p)
    return p


def _long_int_manifest(tmp: Path) -> Path:
    t = trace_in(tmp)
    m = (t / "manifest.json").read_text()
    (t / "manifest.json").write_text(m.replace('"num_experts": 16', '"num_experts": ' + "7" * 5000, 1))
    assert "7" * 5000 in (t / "manifest.json").read_text()
    return t


def _long_int_config(tmp: Path) -> Path:
    f = tmp / "config.json"
    f.write_text('{"moe_intermediate_size": ' + "9" * 5000 + "}")
    return f


def _long_int_placement(tmp: Path) -> Path:
    p = _placement(tmp)
    d = json.loads(p.read_text())
    p.write_text(json.dumps(d).replace('"version": 1', '"version": ' + "1" * 4400, 1))
    return p


CASES: dict[str, Case] = {
    # ---- outputs never replace inputs (--overwrite or not)
    "analyze T -o T --overwrite": Case(
        lambda d: ["analyze", str(trace_in(d)), "-o", str(d / "t"), "--overwrite"], r"is the input"
    ),
    "analyze T -o parent-of-T --overwrite": Case(
        lambda d: ["analyze", str(trace_in(d)), "-o", str(d), "--overwrite"], r"contains the input"
    ),
    "place T -o T/manifest.json --overwrite": Case(
        lambda d: ["place", str(trace_in(d)), *DEPLOY, "-o", str(d / "t" / "manifest.json"), "--overwrite"],
        r"is inside the input",
    ),
    "profile T -o T/manifest.json --overwrite": Case(
        lambda d: ["profile", str(trace_in(d)), "-o", str(d / "t" / "manifest.json"), "--overwrite"],
        r"is inside the input",
    ),
    "dashboard T -o T/manifest.json --overwrite": Case(
        lambda d: ["dashboard", str(trace_in(d)), "-o", str(d / "t" / "manifest.json"), "--overwrite"],
        r"is inside the input",
    ),
    "export P -o P --overwrite": Case(
        lambda d: ["export", str(_placement(d)), "--format", "sglang", "-o", str(d / "p.json"), "--overwrite"],
        r"is the input",
    ),
    "import F -o F --overwrite": Case(lambda d: _import(_jsonl(d), d / "in.jsonl"), r"is the input"),
    "compare T -o T --overwrite": Case(
        lambda d: ["compare", str(trace_in(d)), *DEPLOY, "-o", str(d / "t"), "--overwrite"], r"is the input"
    ),
    "advise T -o parent-of-T --overwrite": Case(
        lambda d: ["advise", str(trace_in(d)), *DEPLOY, "-o", str(d), "--overwrite"], r"contains the input"
    ),
    "advise with --current a pipe": Case(
        lambda d: ["advise", str(trace_in(d)), *DEPLOY, "--current", str(_fifo(d / "cur.json")), "-o", str(d / "a")],
        r"cur\.json is a named pipe",
    ),
    # ---- --overwrite replaces only the command's own kind of output
    "analyze over compare results": Case(
        lambda d: [
            "analyze",
            str(trace_in(d)),
            "-o",
            str(_results(d, "compare.json", "moetrace.compare")),
            "--overwrite",
        ],
        r"holds `moetrace compare` results.*replaces only its own",
    ),
    "analyze over another trace": Case(
        lambda d: ["analyze", str(trace_in(d)), "-o", str(trace_in(d, "other")), "--overwrite"], r"holds a trace"
    ),
    "import over analysis results": Case(
        lambda d: _import(_jsonl(d), _results(d, "manifest.json", "moetrace.analysis")),
        r"holds `moetrace analyze` results",
    ),
    "export over another trace's manifest": Case(
        lambda d: [
            "export",
            str(_placement(d)),
            "--format",
            "sglang",
            "-o",
            str(trace_in(d, "u") / "manifest.json"),
            "--overwrite",
        ],
        r"holds a file of the trace",
    ),  # fmt: skip
    "place over a file of a results folder": Case(
        lambda d: [
            "place",
            str(trace_in(d)),
            *DEPLOY,
            "-o",
            str(_results(d, "a2a.json", "moetrace.a2a") / "layers.parquet"),
            "--overwrite",
        ],
        r"a file of the results folder",
    ),  # fmt: skip
    "profile over a placement": Case(
        lambda d: ["profile", str(trace_in(d, "t2")), "-o", str(_placement(d)), "--overwrite"],
        r"holds a moetrace\.placement file",
    ),
    # ---- readers verify the checksums of what they stream
    "analyze of a flipped id": Case(
        lambda d: ["analyze", str(_flip_id(d)), "-o", str(d / "a")],
        r"routing/part-\d+\.parquet is not the file.*moetrace validate",
    ),
    "profile of a flipped id": Case(
        lambda d: ["profile", str(_flip_id(d)), "-o", str(d / "p.parquet")],
        r"routing/part-\d+\.parquet is not the file",
    ),
    "place of a flipped id": Case(
        lambda d: ["place", str(_flip_id(d)), *DEPLOY, "-o", str(d / "p.json")],
        r"routing/part-\d+\.parquet is not the file",
    ),
    "compare of a prompt/stage shift": Case(
        lambda d: ["compare", str(_shift_prompt(d)), *DEPLOY, "--batches", "2"],
        r"requests/part-\d+\.parquet is not the file",
    ),
    "analyze of a prompt/stage shift": Case(
        lambda d: ["analyze", str(_shift_prompt(d)), "-o", str(d / "a")], r"requests/part-\d+\.parquet is not the file"
    ),
    # ---- load-profile totals never overflow
    "info of a profile past int64": Case(lambda d: ["info", str(_profile(d, huge=True))], r"more than 2\*\*62"),
    "analyze of a profile past int64": Case(
        lambda d: ["analyze", str(_profile(d, huge=True)), "-o", str(d / "a")], r"more than 2\*\*62"
    ),
    "export of a profile past int64": Case(
        lambda d: ["export", str(_profile(d, huge=True)), "--format", "sglang-logical-count", "-o", str(d / "c.json")],
        r"more than 2\*\*62",
    ),
    # ---- inputs are regular files: a named pipe is refused, never read
    "info of a trace whose manifest is a pipe": Case(
        lambda d: ["info", str(_fifo_manifest(d))], r"manifest\.json is a named pipe"
    ),
    "analyze of a trace whose manifest is a pipe": Case(
        lambda d: ["analyze", str(_fifo_manifest(d)), "-o", str(d / "a")], r"manifest\.json is a named pipe"
    ),
    "profile of a trace whose manifest is a pipe": Case(
        lambda d: ["profile", str(_fifo_manifest(d)), "-o", str(d / "p.parquet")], r"manifest\.json is a named pipe"
    ),
    "place with --model-config a pipe": Case(
        lambda d: [
            "place",
            str(trace_in(d)),
            *DEPLOY,
            "--model-config",
            str(_fifo(d / "c.json")),
            "-o",
            str(d / "p.json"),
        ],
        r"--model-config .*c\.json is a named pipe",
    ),
    "info of a profile that is a pipe": Case(lambda d: ["info", str(_fifo(d / "x.parquet"))], r"x\.parquet"),
    # ---- integers of more than 4,300 digits, options of 2**63
    "info of a manifest with a 5000-digit integer": Case(
        lambda d: ["info", str(_long_int_manifest(d))], r"an integer of 5,000 digits"
    ),
    "place with a 5000-digit --model-config": Case(
        lambda d: [
            "place",
            str(trace_in(d)),
            *DEPLOY,
            "--model-config",
            str(_long_int_config(d)),
            "-o",
            str(d / "p.json"),
        ],
        r"an integer of 5,000 digits",
    ),
    "export of a placement with a 4400-digit integer": Case(
        lambda d: ["export", str(_long_int_placement(d)), "--format", "sglang", "-o", str(d / "e.json")],
        r"4,400 digits",
    ),
    "profile --window-tokens 2**63": Case(
        lambda d: ["profile", str(trace_in(d)), "-o", str(d / "p.parquet"), "--window-tokens", str(2**63)],
        r"--window-tokens must be below 2\*\*63",
    ),
    "analyze --batch-size 2**64": Case(
        lambda d: ["analyze", str(trace_in(d)), "-o", str(d / "a"), "--batch-size", str(2**64)],
        r"--batch-size must be below 2\*\*63",
    ),
    "a2a --hidden-size -2**63": Case(
        lambda d: ["a2a", str(trace_in(d)), *DEPLOY, "--hidden-size", str(-(2**63)), "-o", str(d / "a")],
        r"--hidden-size must be below 2\*\*63",
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_round3(tmp_path, name):
    run_case_naming_own_options(CASES[name], tmp_path, name)
