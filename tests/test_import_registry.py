"""``moetrace import``'s one registry of formats: detection from the first bytes, a binary format and a
directory fit with one registry row, undetectable inputs are clean errors listing the formats, and the
CLI's choices are the registry's names."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

import moetrace.tracer.importers as importers
from moetrace.cli import app
from moetrace.errors import ConfigError, TraceFormatError
from moetrace.tracer.importers import FORMATS, STAGES_MODES, ImportFormat, ReadResult, import_trace
from moetrace.tracer.presets import model_info_for
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.validate import find_problems

OLMOE = model_info_for("olmoe-1b-7b-tiny")  # 16 layers all MoE, 64 experts, top-8

# ---- a tiny binary format, as a test would add one: magic, then per request (prompt, output) as uint32
# ---- and its ids int16 [prompt + output, L, K] (-1: nothing recorded), little-endian
MAGIC = b"\x89I16\r\n\x1a\n"  # 0x89 is no UTF-8 start byte: the file is not text


def write_i16(path: Path, requests: list[tuple[int, int, np.ndarray]]) -> Path:
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(requests)))
        for prompt, output, ids_TLK in requests:
            f.write(struct.pack("<II", prompt, output) + ids_TLK.astype("<i2").tobytes())
    return path


def detect_i16(head: bytes, src: Path) -> bool:
    return head.startswith(MAGIC)


def read_i16(src: Path, *, writer, info, label, stages, progress, options) -> ReadResult:
    data = src.read_bytes()
    (num,), at = struct.unpack_from("<I", data, len(MAGIC)), len(MAGIC) + 4
    X = info.num_moe_layers * info.top_k
    for rid in range(num):
        prompt, output = struct.unpack_from("<II", data, at)
        at += 8
        ids_TX = np.frombuffer(data, dtype="<i2", count=(prompt + output) * X, offset=at).reshape(-1, X)
        at += ids_TX.nbytes
        writer.add_requests(
            request_id_R=np.array([rid]),
            dataset_R=[label],
            prompt_tokens_R=np.array([prompt]),
            output_tokens_R=np.array([output]),
            topk_ids_TX=ids_TX.astype(np.int16),
        )
        if progress is not None:
            progress(at, len(data))
    return ReadResult(datasets=frozenset({label}))


I16 = ImportFormat("i16", "test: magic bytes, then int16 ids", detect_i16, read_i16)


def planted(tokens: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = np.stack(
        [
            rng.permuted(np.tile(np.arange(OLMOE.num_experts), (OLMOE.num_moe_layers, 1)), axis=1)[:, :8]
            for _ in range(tokens)
        ]
    ).astype(np.int16)
    ids[-1] = -1  # the last generated token: nothing recorded (int16 0xffff)
    return ids


def test_a_binary_format_fits_with_one_registry_row(tmp_path, monkeypatch):
    truths = [(3, 2, planted(5, 0)), (4, 3, planted(7, 1))]
    src = write_i16(tmp_path / "run.i16", truths)
    with pytest.raises(
        TraceFormatError,
        match=r"run\.i16:1: binary data, not UTF-8 text .*none of the formats "
        r"moetrace imports: sglang \(.*\), tokens \(.*\)\. Pass --format",
    ):
        import_trace(src, out=tmp_path / "t", model=OLMOE)  # before the row: not detected, and no crash
    assert not (tmp_path / "t").exists()

    monkeypatch.setattr(importers, "FORMATS", (*FORMATS, I16))  # the registry row: nothing else changes
    calls: list[tuple[int, int]] = []
    stats = import_trace(src, out=tmp_path / "t", model=OLMOE, progress=lambda d, t: calls.append((d, t)))
    assert (stats.num_requests, stats.num_tokens) == (2, 12)
    assert find_problems(tmp_path / "t") == []
    tr = open_trace(tmp_path / "t")
    assert tr.manifest["backend"] == {"name": "import", "source_format": "i16", "source_file": src.name}
    assert tr.manifest["collection"]["datasets"] == ["run"] and tr.manifest["collection"]["stages"] == [
        "prefill",
        "decode",
    ]
    ta = tr.token_arrays()
    for rid, (_prompt, output, ids) in enumerate(truths):
        sel = ta.request_id_T == rid
        np.testing.assert_array_equal(ta.topk_ids_TLK[sel], ids)
        assert int(ta.is_decode_T[sel].sum()) == output
    assert calls[-1] == (src.stat().st_size,) * 2
    with pytest.raises(ConfigError, match="--stages decode-only applies to --format tokens; --format i16"):
        import_trace(src, out=tmp_path / "t2", model=OLMOE, stages="decode-only")


def test_a_directory_source_fits(tmp_path, monkeypatch):
    """A format reading a directory (as engine dumps of several files are) is detected and read the same way."""

    def detect(head: bytes, src: Path) -> bool:
        return src.is_dir() and (src / "run.i16").is_file()

    def read(src: Path, **kw) -> ReadResult:
        return read_i16(src / "run.i16", **kw)

    dump = tmp_path / "dump"
    dump.mkdir()
    write_i16(dump / "run.i16", [(2, 2, planted(4, 2))])
    monkeypatch.setattr(importers, "FORMATS", (*FORMATS, ImportFormat("i16dir", "test: a directory", detect, read)))
    stats = import_trace(dump, out=tmp_path / "t", model=OLMOE)
    assert stats.num_tokens == 4 and open_trace(tmp_path / "t").manifest["backend"]["source_format"] == "i16dir"


def _torch_like(path: Path) -> Path:
    path.write_bytes(b"PK\x03\x04" + np.random.default_rng(0).bytes(5000))  # torch.save writes a zip
    return path


def _safetensors_like(path: Path) -> Path:
    header = json.dumps({"x": {"dtype": "I16", "shape": [4], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + np.arange(-4, 0, dtype="<i2").tobytes())
    return path


@pytest.mark.parametrize(
    "make, what",
    [
        (lambda d: _torch_like(d / "x.pt"), r"x\.pt:1: binary data, not UTF-8"),
        (lambda d: _safetensors_like(d / "m.safetensors"), r"m\.safetensors:1: (binary data|not valid JSON)"),
        (
            lambda d: (d / "dir").mkdir() or (d / "dir" / "a.pt").touch() or d / "dir",
            r"dir: a directory \(1 entries: a\.pt\)",
        ),
        (lambda d: (d / "t.csv").write_text("a,b\n1,2\n") and d / "t.csv", r"t\.csv:1: not valid JSON"),
        (
            lambda d: (d / "r.jsonl").write_text('\n{"foo": 1}\n') and d / "r.jsonl",
            r"r\.jsonl:2: a record with keys \['foo'\]",
        ),
    ],
)
def test_undetectable_inputs_are_clean_errors_listing_the_formats(tmp_path, make, what):
    src = make(tmp_path)
    with pytest.raises(TraceFormatError) as exc:
        import_trace(src, out=tmp_path / "t", model=OLMOE)
    assert re.match(what, str(exc.value).removeprefix(str(tmp_path) + "/")), str(exc.value)
    for f in FORMATS:
        assert f"{f.name} ({f.help})" in str(exc.value)
    assert str(exc.value).endswith("Pass --format to say which.")
    assert not (tmp_path / "t").exists()


def test_empty_ambiguous_and_unknown_formats(tmp_path, monkeypatch):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n \n")
    with pytest.raises(TraceFormatError, match=r"e\.jsonl: empty file$"):
        import_trace(empty, out=tmp_path / "t", model=OLMOE)
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps({"meta_info": {}}) + "\n")
    with pytest.raises(ConfigError, match="unknown import format 'parquet'; choose from auto, sglang, tokens"):
        import_trace(src, out=tmp_path / "t", model=OLMOE, source_format="parquet")
    greedy = ImportFormat("greedy", "claims everything", lambda head, src: True, read_i16)
    monkeypatch.setattr(importers, "FORMATS", (*FORMATS, greedy))
    with pytest.raises(TraceFormatError, match=r"reads as several formats \(sglang, greedy\); pass --format"):
        import_trace(src, out=tmp_path / "t", model=OLMOE)


def test_text_formats_check_utf8_after_detection(tmp_path):
    """A JSONL file detected from its first line, with a bad byte further on: the format's reader names the line."""
    src = tmp_path / "r.jsonl"
    src.write_bytes(json.dumps({"meta_info": {}}).encode() + b"\n\xff\n")
    with pytest.raises(
        TraceFormatError, match=r"r\.jsonl:2: not UTF-8 text \(invalid start byte\); save the file as UTF-8"
    ):
        import_trace(src, out=tmp_path / "t", model=OLMOE)
    with pytest.raises(TraceFormatError, match=r"dir: a directory, not a JSON-lines file"):
        (tmp_path / "dir").mkdir()
        import_trace(tmp_path / "dir", out=tmp_path / "t", model=OLMOE, source_format="tokens")


def _words(output: str) -> str:
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())  # without rich's box and line breaks


def test_cli_choices_come_from_the_registry():
    params = {p.name: p for p in typer.main.get_command(app).commands["import"].params}
    for f in FORMATS:
        assert f"{f.name}: {f.help}" in params["source_format"].help
    names = ["auto", *(f.name for f in FORMATS)]
    res = CliRunner().invoke(app, ["import", "x.jsonl", "-m", "olmoe-1b-7b-tiny", "-o", "t", "--format", "bogus"])
    assert res.exit_code == 2 and "is not one of " + ", ".join(repr(n) for n in names) in _words(res.output)
    res = CliRunner().invoke(app, ["import", "x.jsonl", "-m", "olmoe-1b-7b-tiny", "-o", "t", "--stages", "bogus"])
    assert "is not one of " + ", ".join(repr(m) for m in STAGES_MODES) in _words(res.output)
    for name in names:  # every registry name is a valid choice: the next error is the missing file
        res = CliRunner().invoke(
            app, ["import", "no-such.jsonl", "-m", "olmoe-1b-7b-tiny", "-o", "t", "--format", name]
        )
        assert res.exit_code == 2 and "no-such.jsonl: no such file" in res.output, res.output


def test_bad_text_input_never_costs_an_existing_trace_under_overwrite(tmp_path: Path) -> None:
    """The UTF-8 check runs before the output is touched: --overwrite over a good trace with a file
    that turns out not to be UTF-8 keeps the good trace."""
    from moetrace.errors import TraceFormatError
    from moetrace.tracer.importers import import_trace
    from moetrace.tracer.presets import resolve
    from moetrace.tracer.trace.reader import open_trace

    info = resolve("mixtral-8x7b").model_info()
    good = tmp_path / "good.jsonl"
    rows = [
        {"request": 0, "layer": layer, "position": p, "stage": "prefill" if p == 0 else "decode", "experts": [0, 1]}
        for p in range(2)
        for layer in info.moe_layers
    ]
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "trace"
    import_trace(good, out=out, model=info, source_format="tokens")
    before = open_trace(out).manifest
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(good.read_bytes() + b'{"request": 1, "layer": 0, "stage": "\xff"}\n')
    with pytest.raises(TraceFormatError, match="UTF-8"):
        import_trace(bad, out=out, model=info, source_format="tokens", on_existing="overwrite")
    assert open_trace(out).manifest == before
