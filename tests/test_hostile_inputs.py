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
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from factories import write_small_trace
from typer.testing import CliRunner

from moetrace.cli import app

runner = CliRunner()
DEPLOY = ["--config", "DP2TP1EP2", "--gpus-per-node", "1", "--batches", "2"]


@dataclass(frozen=True)
class Case:
    build: Callable[[Path], list[str]]  # makes the input under a temp dir, returns the command line
    exit_code: int  # what the command must exit with
    message: str  # regex the single error line (or the output, when exit 0) must match
    intact: Callable[[Path], None] | None = None  # afterwards: asserts the data the command must not touch


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


def _parts(tmp: Path, name: str = "t") -> Path:
    """A trace of 8 requests in several parts (so one can go missing)."""
    return write_small_trace(tmp / name, num_requests=8, part_tokens=20)


def _lose(tmp: Path, *subs: str, keep_parts: bool = True) -> Path:
    """A complete trace whose second part lost its files under ``subs`` (both: a whole part pair)."""
    t = _parts(tmp)
    for sub in subs:
        sorted((t / sub).glob("*.parquet"))[1].unlink()
    if not keep_parts:  # an older trace: no part list, only totals
        _edit_manifest(t, lambda m: m.pop("parts"))
    return t


def _edit_manifest(t: Path, change: Callable[[dict], object]) -> Path:
    m = json.loads((t / "manifest.json").read_text())
    change(m)
    (t / "manifest.json").write_text(json.dumps(m))
    return t


def _flip_in_range(tmp: Path) -> Path:
    """One expert id changed to another valid id: only the checksum can tell."""
    t = write_small_trace(tmp / "t", num_requests=8)
    f = sorted((t / "routing").glob("*.parquet"))[0]
    table = pq.read_table(f)
    flat = pa.compute.list_flatten(table.column("experts")).to_numpy().copy()
    flat[0] = (flat[0] + 1) % 16 if flat[0] >= 0 else 0
    col = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.int16()), table.schema.field("experts").type.list_size)
    pq.write_table(table.set_column(3, "experts", col), f)
    return t


def _zigzag(n: int) -> bytes:
    n <<= 1
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([b])
        out += bytes([b | 0x80])


def _footer_rows(tmp: Path, which: int) -> Path:
    """A requests part whose footer claims one row more than its pages hold: ``which`` 0 patches the
    file's row count, 1 a column chunk's value count (the same bytes, i64 field 3 = 8 rows)."""
    t = write_small_trace(tmp / "t", num_requests=8)
    f = sorted((t / "requests").glob("*.parquet"))[0]
    data, n = f.read_bytes(), pq.read_metadata(f).num_rows
    start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    footer, pat = data[start:-8], b"\x16" + _zigzag(n)
    at = [i for i in range(len(footer)) if footer.startswith(pat, i)][which]
    new = footer[:at] + b"\x16" + _zigzag(n + 1) + footer[at + len(pat) :]
    f.write_bytes(data[:start] + new + data[-8:])
    return t


def _same_bytes(path: Path, before: bytes) -> Callable[[Path], None]:
    def check(_tmp: Path) -> None:
        assert path.read_bytes() == before, f"{path} changed"

    return check


def _into_trace(tmp: Path, args: Callable[[Path], list[str]]) -> list[str]:
    """``args(trace)``; records the manifest's bytes for :func:`_trace_intact`."""
    t = write_small_trace(tmp / "t", num_requests=8)
    (tmp / "manifest.before").write_bytes((t / "manifest.json").read_bytes())
    return args(t)


def _other(tmp: Path) -> Path:
    """Another trace, the input of a command aimed into ``tmp / "t"`` (its own input: test_hostile_round3.py)."""
    return write_small_trace(tmp / "s", num_requests=8)


def _trace_intact(tmp: Path) -> None:
    t = tmp / "t"
    assert (t / "manifest.json").read_bytes() == (tmp / "manifest.before").read_bytes()
    from moetrace.tracer.trace.validate import find_problems

    assert find_problems(t) == []


def _symlink_out(tmp: Path, name: str) -> Path:
    target = tmp / "precious.txt"
    target.write_text("keep me")
    (tmp / name).symlink_to(target)
    return tmp / name


def _precious_intact(tmp: Path) -> None:
    assert (tmp / "precious.txt").read_text() == "keep me"


def _placement(
    tmp: Path, change: Callable[[dict], object] | None = None, *, strategy: str = "linear", redundancy: int = 0
) -> Path:
    """A placement JSON of the small trace (``moetrace place``), then ``change`` applied to its JSON."""
    t = write_small_trace(tmp / "t", num_requests=12)
    p = tmp / "p.json"
    r = runner.invoke(
        app,
        ["place", str(t), *DEPLOY[:4], "--strategy", strategy, "--redundancy", str(redundancy), "-o", str(p)],
    )
    assert r.exit_code == 0, r.output
    if change is not None:
        d = json.loads(p.read_text())
        change(d)
        p.write_text(json.dumps(d))
    return p


def _export(p: Path, tmp: Path) -> list[str]:
    return ["export", str(p), "--format", "sglang", "-o", str(tmp / "out.json")]


def _a2a(p: Path, tmp: Path) -> list[str]:
    return [
        "a2a", str(tmp / "t"), *DEPLOY[:4], "--batches", "1", "--placement", str(p), "-o", str(tmp / "a"),
        "--no-emulate-nodes",
    ]  # fmt: skip


def _drop_expert(d: dict) -> None:
    d["phy2log"][0][0] = d["phy2log"][0][1]  # expert 0 of layer 0 loses its only slot
    d["logcnt"][0] = [sum(row == e for row in d["phy2log"][0]) for e in range(len(d["logcnt"][0]))]


def _twice_on_node(d: dict) -> None:
    """A grouped placement (2 redundant slots) whose node 0 holds its first expert twice: a slot of node 0
    whose expert node 1 also holds takes it, so every expert keeps a slot."""
    row = d["phy2log"][0]
    half = len(row) // 2
    j = next(j for j in range(1, half) if row[j] in row[half:])
    row[j] = row[0]
    E = len(d["logcnt"][0])
    slots_LE = [[[i for i, x in enumerate(r) if x == e] for e in range(E)] for r in d["phy2log"]]
    M = max(len(x) for le in slots_LE for x in le)
    d["logcnt"] = [[len(x) for x in le] for le in slots_LE]
    d["log2phy"] = [[x + [-1] * (M - len(x)) for x in le] for le in slots_LE]


def _big_model(tmp: Path) -> Path:
    """A tiny trace of a model with 64 MoE layers x top-512 (32,768 ids per token)."""
    from dataclasses import replace

    from factories import SMALL

    model = replace(SMALL, num_hidden_layers=64, moe_layers=tuple(range(64)), num_experts=1024, top_k=512)
    return write_small_trace(tmp / "t", num_requests=4, model=model)


def _collect_lock_link(tmp: Path) -> list[str]:
    out = tmp / "s"
    out.mkdir()
    (tmp / "precious.txt").write_text("keep me")
    (out / ".writer.lock").symlink_to(tmp / "precious.txt")
    return ["synth", "--model", "deepseek-v3-tiny", "--requests", "4", "-o", str(out), "--overwrite"]


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
    # ---- the trace against its own manifest: lost parts, wrong totals, checksums, footers, field types
    "analyze: a lost part pair": Case(
        lambda d: ["analyze", str(_lose(d, "requests", "routing")), "-o", str(d / "a")],
        2,
        r"file\(s\) of parts the manifest lists are missing: requests/part-000001.*--allow-incomplete",
    ),
    "info: a lost requests part": Case(
        lambda d: ["info", str(_lose(d, "requests"))], 2, r"missing: requests/part-000001\.parquet"
    ),
    "place: a lost part pair of an older trace (totals only)": Case(
        lambda d: [
            "place",
            str(_lose(d, "requests", "routing", keep_parts=False)),
            *DEPLOY[:4],
            "-o",
            str(d / "p.json"),
        ],  # fmt: skip
        2,
        r"totals\.num_requests is 8 but the committed parts hold \d requests",
    ),
    "compare: a part added after the trace finished": Case(
        lambda d: [
            "compare",
            str(_edit_manifest(_parts(d), lambda m: m["parts"].pop(sorted(m["parts"])[-1]))),
            *DEPLOY,
        ],
        2,
        r"committed part\(s\) the manifest does not list",
    ),
    "info --allow-incomplete reads what is there": Case(
        lambda d: ["info", str(_lose(d, "requests", "routing")), "--allow-incomplete"], 0, r"requests"
    ),
    "validate: an expert id flipped to another valid id": Case(
        lambda d: ["validate", str(_flip_in_range(d))], 1, r"routing/part-000000\.parquet: its SHA-256 differs"
    ),
    "validate: a footer claiming a row its pages lack": Case(
        lambda d: ["validate", str(_footer_rows(d, 0))], 1, r"the footer says 9 rows but its row groups hold 8"
    ),
    "validate: a column chunk claiming a value too many": Case(
        lambda d: ["validate", str(_footer_rows(d, 1))], 1, r"row group 0 says 8 rows but column `request_id` holds 9"
    ),
    "validate: version true": Case(lambda d: ["validate", str(_manifest(d, version=True))], 1, r"version"),
    "validate: version 1.0": Case(lambda d: ["validate", str(_manifest(d, version=1.0))], 1, r"version"),
    "validate: a writer flag that is a string": Case(
        lambda d: ["validate", str(_manifest(d, writer__with_text="no"))],
        1,
        r"`writer\.with_text` must be true or false",
    ),
    "validate: a part entry without its checksum": Case(
        lambda d: [
            "validate",
            str(
                _edit_manifest(
                    write_small_trace(d / "t"), lambda m: m["parts"]["part-000000.parquet"].pop("routing_sha256")
                )
            ),
        ],
        1,
        r"`parts\.part-000000\.parquet` must hold",
    ),
    "validate: totals that do not match": Case(
        lambda d: ["validate", str(_manifest(d, totals={"num_requests": 8, "num_tokens": 7}))],
        1,
        r"totals\.num_tokens is 7 but the committed parts hold \d+ routing rows",
    ),
    "validate: an older trace without checksums says so": Case(
        lambda d: ["validate", str(_edit_manifest(write_small_trace(d / "t"), lambda m: m.pop("parts")))],
        0,
        r"valid moetrace trace.*\n.*lists no parts and no checksums",
    ),
    # ---- every output path: never into a trace, over a file, through a link or into a device
    "dashboard -o TRACE/manifest.json": Case(
        lambda d: _into_trace(d, lambda t: ["dashboard", str(_other(d)), "-o", str(t / "manifest.json")]),
        2,
        r"is inside the trace .*--overwrite",
        _trace_intact,
    ),
    "export -o into a trace": Case(
        lambda d: _into_trace(
            d, lambda t: ["export", str(_other(d)), "--format", "sglang-logical-count", "-o", str(t / "c.json")]
        ),
        2,
        r"is inside the trace",
        _trace_intact,
    ),
    "analyze -o a trace directory": Case(
        lambda d: _into_trace(d, lambda t: ["analyze", str(_other(d)), "-o", str(t)]),
        2,
        r"holds a trace",
        _trace_intact,
    ),
    "analyze -o a folder inside a trace": Case(
        lambda d: _into_trace(d, lambda t: ["analyze", str(_other(d)), "-o", str(t / "routing" / "x")]),
        2,
        r"is inside the trace",
        _trace_intact,
    ),
    "place -o into a trace": Case(
        lambda d: _into_trace(
            d, lambda t: ["place", str(_other(d)), *DEPLOY[:4], "-o", str(t / "requests" / "p.json")]
        ),
        2,
        r"is inside the trace",
        _trace_intact,
    ),
    "make-checkpoint --overwrite of a trace": Case(
        lambda d: _into_trace(d, lambda t: ["make-checkpoint", "deepseek-v3", "-o", str(t)]),
        2,
        r"holds a trace",
        _trace_intact,
    ),
    "dashboard over an existing file": Case(
        lambda d: ["dashboard", str(write_small_trace(d / "t")), "-o", str(_existing(d / "r.html"))],
        2,
        r"r\.html already exists.*--overwrite",
        lambda d: _same_bytes(d / "r.html", b"mine")(d),
    ),
    "dashboard -o a symbolic link": Case(
        lambda d: ["dashboard", str(write_small_trace(d / "t")), "-o", str(_symlink_out(d, "r.html")), "--overwrite"],
        2,
        r"symbolic link",
        _precious_intact,
    ),
    "export -o a symbolic link": Case(
        lambda d: [*_export(_placement(d), d)[:-1], str(_symlink_out(d, "e.json")), "--overwrite"],
        2,
        r"symbolic link",
        _precious_intact,
    ),
    "compare -o a symbolic link": Case(
        lambda d: ["compare", str(write_small_trace(d / "t")), *DEPLOY, "-o", str(_symlink_out(d, "c")), "--overwrite"],
        2,
        r"symbolic link",
        _precious_intact,
    ),
    "export -o a device node": Case(
        lambda d: [*_export(_placement(d), d)[:-1], os.devnull, "--overwrite"],
        2,
        r"not a regular file",
    ),
    "dashboard -o a named pipe": Case(
        lambda d: ["dashboard", str(write_small_trace(d / "t")), "-o", str(_fifo(d / "r.html")), "--overwrite"],
        2,
        r"not a regular file",
    ),
    "synth with a symlinked .writer.lock": Case(
        _collect_lock_link, 2, r"\.writer\.lock is a symbolic link", _precious_intact
    ),
    # ---- placement files: validated before export or a2a use them
    "export: an expert without a slot": Case(
        lambda d: _export(_placement(d, _drop_expert), d),
        2,
        r"invalid placement: 1 \(layer, expert\) pairs have no slot",
    ),
    "a2a: an expert without a slot": Case(
        lambda d: _a2a(_placement(d, _drop_expert), d), 2, r"invalid placement: 1 \(layer, expert\) pairs have no slot"
    ),
    "a2a: a node holding an expert twice (grouped)": Case(
        lambda d: _a2a(_placement(d, _twice_on_node, strategy="data", redundancy=2), d),
        2,
        r"node 0 holds expert \d+ twice",
    ),
    "export: slot counts that do not match": Case(
        lambda d: _export(_placement(d, lambda p: p.update(num_slots=p["num_slots"] + 2)), d),
        2,
        r"`num_slots` is \d+ but phy2log holds \d+ slots",
    ),
    "export: UTF-16 JSON": Case(
        lambda d: _export(_rewrite(_placement(d), lambda text: text.encode("utf-16")), d), 2, r"not UTF-8"
    ),
    "export: deeply nested JSON": Case(
        lambda d: _export(_rewrite(_placement(d), lambda _t: b"[" * 100_000 + b"]" * 100_000), d),
        2,
        r"nested too deeply",
    ),
    "export: a billion layers": Case(
        lambda d: _export(_placement(d, lambda p: p["model"].update(num_hidden_layers=10**9)), d),
        2,
        r"positive integers \(at most 1,048,576\)",
    ),
    # ---- memory: estimated before it is allocated, refused with the figure and the knob
    "synth: 10^12 requests": Case(
        lambda d: ["synth", "--model", "deepseek-v3-tiny", "--requests", str(10**12), "-o", str(d / "s")],
        2,
        r"needs about [\d.]+ TiB of memory.*lower --requests",
    ),
    "compare: simulated tokens beyond the machine's memory": Case(
        lambda d: [
            "compare",
            str(_big_model(d)),
            "--config",
            "DP2TP1EP2",
            "--gpus-per-node",
            "1",
            "--batches",
            "100000",
            "--batch-requests",
            "200",
        ],  # fmt: skip
        2,
        r"simulating 20,000,000 tokens .* needs about [\d.]+ TiB of memory.*--batches or --batch-requests",
    ),
    "a2a: simulated tokens beyond the machine's memory": Case(
        lambda d: [
            "a2a",
            str(_big_model(d)),
            "--config",
            "DP2TP1EP2",
            "--gpus-per-node",
            "1",
            "--batches",
            "100000",
            "--batch-requests",
            "200",
            "-o",
            str(d / "a"),
        ],  # fmt: skip
        2,
        r"needs about [\d.]+ TiB of memory",
    ),
    # ---- negative seeds: one message in every command
    "analyze: negative seed": Case(
        lambda d: ["analyze", str(write_small_trace(d / "t")), "-o", str(d / "a"), "--seed", "-3"], 2, r"--seed must be"
    ),
    "compare: negative seed": Case(
        lambda d: ["compare", str(write_small_trace(d / "t")), *DEPLOY, "--seed", "-1"], 2, r"--seed must be"
    ),
    "place: seed above 2^32": Case(
        lambda d: [
            "place",
            str(write_small_trace(d / "t")),
            *DEPLOY[:4],
            "-o",
            str(d / "p.json"),
            "--seed",
            str(2**40),
        ],
        2,
        r"--seed must be",
    ),
    "dashboard: negative seed": Case(
        lambda d: ["dashboard", str(write_small_trace(d / "t")), "-o", str(d / "r.html"), "--seed", "-1"],
        2,
        r"--seed must be",
    ),
    "make-checkpoint: negative seed": Case(
        lambda d: ["make-checkpoint", "deepseek-v3", "-o", str(d / "c"), "--seed", "-1"], 2, r"--seed must be"
    ),
    "collect: negative seed": Case(
        lambda d: ["collect", "--model", "olmoe-1b-7b-tiny", "-o", str(d / "c"), "--seed", "-5"], 2, r"--seed must be"
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


def _existing(p: Path) -> Path:
    p.write_bytes(b"mine")
    return p


def _fifo(p: Path) -> Path:
    os.mkfifo(p)
    return p


def _rewrite(p: Path, to_bytes: Callable[[str], bytes]) -> Path:
    p.write_bytes(to_bytes(p.read_text()))
    return p


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
    if case.intact is not None:
        case.intact(tmp_path)
