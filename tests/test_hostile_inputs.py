"""Hostile inputs through the CLI, one table: every case ends in its exit code and one clean message.

Each row builds an input (a damaged trace, a hostile JSONL line, a bad option), runs one
``moetrace`` command as a user would, and asserts the exit code, one ``Error:`` line naming the
problem, no Python traceback, and (for valid inputs) the correct result. The classes follow the
reliability issue: readers trust nothing, bounded work for bounded input, errors that tell the
truth, and no silent overwrite of results. Concurrent writers: tests/test_writer_lock.py; the
reader's checks one by one: tests/test_reader_checks.py; fuzzing: tests/test_fuzz.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_small_trace
from typer.testing import CliRunner

from moetrace.cli import app

runner = CliRunner()
DEPLOY = ["--config", "DP2TP1EP2", "--gpus-per-node", "1", "--batches", "2"]


@dataclass(frozen=True)
class Case:
    build: Callable[[Path], list[str]]  # makes the input under a temp dir, returns the command line
    exit_code: int  # what the command must exit with
    message: str  # regex the single error line (or the output, when exit 0) must match


def _manifest(tmp: Path, **changes) -> Path:
    t = write_small_trace(tmp / "t", num_requests=8)
    m = json.loads((t / "manifest.json").read_text())
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            m[section][field] = value
        else:
            m[section] = value
    (t / "manifest.json").write_text(json.dumps(m))
    return t


def _raw_manifest(tmp: Path, text: str) -> Path:
    t = write_small_trace(tmp / "t", num_requests=8)
    (t / "manifest.json").write_text(text)
    return t


def _jsonl(tmp: Path, text: str | bytes) -> Path:
    f = tmp / "in.jsonl"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    return f


def _import(tmp: Path, text: str | bytes) -> list[str]:
    return ["import", str(_jsonl(tmp, text)), "--model", "olmoe-1b-7b-tiny", "-o", str(tmp / "out")]


def _nullable_requests(tmp: Path) -> Path:
    """The same values with nullable columns (another tool's writer): harmless, must validate."""
    t = write_small_trace(tmp / "t", num_requests=8)
    for f in (t / "requests").glob("*.parquet"):
        table = pq.read_table(f)
        schema = pa.schema([pa.field(fl.name, fl.type, nullable=True) for fl in table.schema])
        pq.write_table(table.cast(schema), f)
    m = json.loads((t / "manifest.json").read_text())
    del m["parts"]  # another tool's writer records no checksums
    (t / "manifest.json").write_text(json.dumps(m))
    return t


def _tokens_line(**over) -> str:
    rec = {"request": 0, "layer": 0, "position": 0, "stage": "prefill", "experts": [1, 2, 3, 4, 5, 6, 7, 8]}
    rec.update(over)
    return json.dumps(rec) + "\n"


CASES: dict[str, Case] = {
    # ---- validate rejects what later commands would choke on, tolerates what is harmless
    "float count in the manifest": Case(
        lambda d: ["validate", str(_manifest(d, model__top_k=2.0))], 1, r"`top_k` must be a whole number"
    ),
    "negative size": Case(
        lambda d: ["validate", str(_manifest(d, model__hidden_size=-4))], 1, r"`hidden_size` must be a whole number"
    ),
    "non-boolean complete": Case(
        lambda d: ["validate", str(_manifest(d, complete="yes"))], 1, r"`complete` must be true or false"
    ),
    "string layer list": Case(
        lambda d: ["validate", str(_manifest(d, model__moe_layers="1,2,3"))], 1, r"`moe_layers` must be a list"
    ),
    "over-large count": Case(
        lambda d: ["validate", str(_manifest(d, model__num_experts=10**30))], 1, r"`num_experts` must be a whole number"
    ),
    "Infinity in the manifest": Case(
        lambda d: [
            "validate",
            str(
                _raw_manifest(
                    d,
                    json.dumps(
                        json.loads((write_small_trace(d / "src").joinpath("manifest.json")).read_text())
                        | {"version": float("inf")}
                    ),
                )
            ),
        ],
        1,
        r"version",
    ),
    "complete but no parts": Case(lambda d: ["validate", str(_empty_complete(d))], 1, r"holds no committed parts"),
    "non-UTF-8 manifest": Case(lambda d: ["info", str(_raw_bytes_manifest(d))], 2, r"manifest\.json.*(UTF-8|JSON)"),
    "nullable columns, same values": Case(
        lambda d: ["validate", str(_nullable_requests(d))], 0, r"valid moetrace trace"
    ),
    # ---- the readers behind analyze / compare / dashboard
    "analyze a damaged part": Case(
        lambda d: ["analyze", str(_truncated(d)), "-o", str(d / "a")], 2, r"not readable as Parquet"
    ),
    "dashboard of a damaged trace": Case(
        lambda d: ["dashboard", str(_truncated(d)), "-o", str(d / "r.html")], 2, r"cannot read|damaged|validate"
    ),
    "dashboard of a non-UTF-8 manifest": Case(
        lambda d: ["dashboard", str(_raw_bytes_manifest(d)), "-o", str(d / "r.html")], 2, r"manifest\.json"
    ),
    # ---- bounded work for bounded input
    "compare asks for 10^12 batches": Case(
        lambda d: ["compare", str(write_small_trace(d / "t", num_requests=8)), *DEPLOY[:4], "--batches", str(10**12)],
        2,
        r"--batches",
    ),
    "import: a 120-byte line asking for gigabytes": Case(
        lambda d: _import(d, _tokens_line(position=4_000_000_000)), 2, r"position"
    ),
    "import: deeply nested JSON": Case(lambda d: _import(d, "[" * 100_000 + "]" * 100_000 + "\n"), 2, r"in\.jsonl"),
    "import: NaN experts": Case(lambda d: _import(d, _tokens_line(experts=[float("nan")] * 8)), 2, r"in\.jsonl"),
    "import: over-large request id": Case(lambda d: _import(d, _tokens_line(request=10**30)), 2, r"in\.jsonl"),
    "import: non-UTF-8 file": Case(lambda d: _import(d, b"\xff\xfe" + _tokens_line().encode("utf-16-le")), 2, r"UTF-8"),
    "import: a model directory without config.json": Case(
        lambda d: ["import", str(_jsonl(d, _tokens_line())), "--model", str(_mkdir(d / "ckpt")), "-o", str(d / "out")],
        2,
        r"config\.json",
    ),
    "negative seed": Case(
        lambda d: ["synth", "--model", "deepseek-v3-tiny", "--requests", "4", "--seed", "-1", "-o", str(d / "s")],
        2,
        r"seed",
    ),
    # ---- no silent overwrite of results
    "compare over existing results": Case(
        lambda d: _twice(d, ["compare", "{t}", *DEPLOY, "-o", str(d / "c")]),
        2,
        r"already holds compare results.*--overwrite",
    ),
    "place over an existing placement": Case(
        lambda d: _twice(d, ["place", "{t}", *DEPLOY[:4], "-o", str(d / "p.json")]),
        2,
        r"already holds placement results.*--overwrite",
    ),
}


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True)
    return p


def _empty_complete(tmp: Path) -> Path:
    t = write_small_trace(tmp / "t")
    for sub in ("requests", "routing"):
        for f in (t / sub).glob("*.parquet"):
            f.unlink()
    return t


def _truncated(tmp: Path) -> Path:
    t = write_small_trace(tmp / "t", num_requests=8)
    f = sorted((t / "routing").glob("*.parquet"))[0]
    f.write_bytes(f.read_bytes()[:100])
    return t


def _raw_bytes_manifest(tmp: Path) -> Path:
    t = write_small_trace(tmp / "t", num_requests=8)
    (t / "manifest.json").write_bytes(b'{"format": "moetrace.trace", "\xff\xfe": 1}')
    return t


def _twice(tmp: Path, args: list[str]) -> list[str]:
    trace = write_small_trace(tmp / "t", num_requests=12)
    args = [str(trace) if a == "{t}" else a for a in args]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    return args


@pytest.mark.parametrize("name", CASES)
def test_hostile_input(tmp_path, name):
    case = CASES[name]
    args = case.build(tmp_path)
    r = runner.invoke(app, args)
    out = r.output
    assert "Traceback" not in out and (r.exception is None or isinstance(r.exception, SystemExit)), (
        f"{name}: a traceback ({r.exception!r})\n{out}"
    )
    assert r.exit_code == case.exit_code, f"{name}: exit {r.exit_code}\n{out}"
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    if case.exit_code == 2:
        assert len(errors) == 1, f"{name}: expected one error line\n{out}"
        assert re.search(case.message, errors[0]), f"{name}: {errors[0]!r} does not match {case.message!r}"
    else:
        assert re.search(case.message, out), f"{name}: {out!r} does not match {case.message!r}"
