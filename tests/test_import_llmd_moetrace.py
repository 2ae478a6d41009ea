"""``llmd-moetrace``: llm-d-inference-sim's binary ``.moetrace`` (MoE-Token-Router-Project/llm-d-inference-sim,
format version 1, read at commits 24c1e2a0 (``pkg/moetrace/format.go``, ``reader.go``) and 50d57696 (``writer.go``,
``accumulator.go``, ``source.go``, ``converter.go``)), both ways, and its fixed-placement JSON (``installFixedPlacement``
in ``pkg/simulator/moe_trace_fidelity.go`` at 03a00a82).

The fixtures are written by ``tests/golden/make_llmd_moetrace_golden.py``, a rendering of their Go converter kept apart
from moetrace's reader and exporter; ``go_read`` below is a rendering of their ``Open`` + ``Validate`` + ``ReadPrompt``,
used to read what moetrace exports. No file of theirs is vendored.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from golden import make_llmd_moetrace_golden as golden  # tests/golden: the fixture writer
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ConfigError, TraceFormatError
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.exports import PlacementFile, export_file, export_placement, save_placement
from moetrace.placement.maps import placement_from_phy2log
from moetrace.tracer.importers import detect_format, import_trace
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.schema import ModelInfo
from moetrace.tracer.trace.validate import find_problems

runner = CliRunner()
# their converter test's model: layers 1 and 3 route, 4 experts, top-2
THEIRS = ModelInfo(
    name="test-moe",
    source="test/moe",
    architecture="Test",
    num_hidden_layers=4,
    moe_layers=(1, 3),
    num_experts=4,
    top_k=2,
    num_shared_experts=0,
    hidden_size=8,
)


def _model(E: int, K: int, layers: tuple[int, ...]) -> ModelInfo:
    return ModelInfo(
        name=f"m{E}",
        source=f"org/m{E}",
        architecture="Test",
        num_hidden_layers=max(layers) + 1,
        moe_layers=layers,
        num_experts=E,
        top_k=K,
        num_shared_experts=0,
        hidden_size=8,
    )


# ---------------------------------------------------------------- their reader (reader.go @ 24c1e2a0)
def go_read(data: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """What their ``Open`` + ``Validate`` accept and ``ReadPrompt`` returns, every check an assertion."""
    assert len(data) >= 112, "MoE trace is shorter than its header"
    assert data[:8] == b"MOETRC01", "invalid MoE trace magic"
    assert struct.unpack_from("<I", data, 12)[0] == 112 and struct.unpack_from("<I", data, 72)[0] == 32
    version, _, mo, ml, do, io, il, _ss, n, w = struct.unpack_from("<IIQQQQQQII", data, 8)
    assert version == 1 and w in (1, 2)
    size = len(data)
    for off, length in ((mo, ml), (io, il)):
        assert off <= size and length <= size - off
    assert mo == 112 and do == mo + ml and il == n * 32
    meta = json.loads(data[mo : mo + ml])
    assert meta["format_version"] == 1 and meta["num_prompts"] == n and meta["expert_id_bytes"] == w
    assert len(meta["prompts"]) == n and meta["sparse_layers"]
    assert w == (1 if meta["num_experts"] <= 256 else 2)
    L, E, K = len(meta["sparse_layers"]), meta["num_experts"], meta["top_k"]
    assert do <= io
    expected, prompts = do, []
    dt = "u1" if w == 1 else "<u2"
    for i in range(n):
        pid, off, length, P, D = struct.unpack_from("<I4xQQII", data, io + 32 * i)
        assert pid == i and off == expected and off + length <= io
        h = struct.unpack_from("<7I", data, off)
        assert h == (i, P, D, L, E, K, w), "prompt block header does not match"
        assert length == 32 + 4 * P + 4 * D + 4 * L * E + (P + D) * L * K * w
        m = meta["prompts"][i]
        assert m["index"] == i and m["input_tokens"] == P and m["decode_tokens"] == D
        pos = off + 32
        inp = np.frombuffer(data, "<u4", P, pos)
        pos += 4 * P
        dec = np.frombuffer(data, "<u4", D, pos)
        pos += 4 * D
        counts = np.frombuffer(data, "<u4", L * E, pos).reshape(L, E)
        pos += 4 * L * E
        pre = np.frombuffer(data, dt, L * P * K, pos).reshape(L, P, K)  # [layer][position][top_k]
        pos += w * L * P * K
        dr = np.frombuffer(data, dt, D * L * K, pos).reshape(D, L, K)  # [decode position][layer][top_k]
        pos += w * D * L * K
        assert pos == off + length, "prompt contains unread data"
        prompts.append({"input": inp, "decode": dec, "counts": counts, "prefill": pre, "decode_routes": dr})
        expected += length
    assert expected == io and io + il == size, "unexpected trailing data after prompt index"
    return meta, prompts


# ---------------------------------------------------------------- import
def _their_file(tmp_path: Path) -> tuple[Path, bytes]:
    source = golden.go_marshal_indent(golden.their_test_source())
    path = tmp_path / "instructcoder.moetrace"
    path.write_bytes(golden.convert(source))
    return path, source


def test_llmd_sim_24c1e2a0_their_converter_test_source_reads_back_as_their_test_asserts(tmp_path):
    path, _ = _their_file(tmp_path)
    meta, prompts = go_read(path.read_bytes())  # the golden writer and the Go reader agree
    assert meta["model"] == "test/moe" and meta["sparse_layers"] == [1, 3]
    p0 = prompts[0]  # converter_test.go's assertions
    assert p0["input"].tolist() == [100, 101] and p0["decode"].tolist() == [200, 201]
    assert p0["prefill"][1, 1].tolist() == [2, 3] and p0["decode_routes"][1, 0].tolist() == [1, 2]
    assert int(p0["counts"][0, 1]) == 2


def test_llmd_sim_24c1e2a0_import_of_their_test_source(tmp_path):
    path, source = _their_file(tmp_path)
    assert detect_format(path).name == "llmd-moetrace"
    notes: list[str] = []
    import_trace(path, out=tmp_path / "t", model=THEIRS, notes=notes.append)
    assert find_problems(tmp_path / "t") == []
    tr = open_trace(tmp_path / "t")
    req = tr.request_arrays
    assert req.request_id_R.tolist() == [0, 1]
    assert req.prompt_tokens_R.tolist() == [2, 1] and req.output_tokens_R.tolist() == [2, 1]
    ids = tr.token_arrays().topk_ids_TLK
    want = []
    for P, D in ((2, 2), (1, 1)):  # makeTestSource: experts (pos + slot) % 4, (pos + slot + 1) % 4
        for pos in range(P):
            want.append([[(pos + s) % 4, (pos + s + 1) % 4] for s in range(2)])
        for d in range(D):
            want.append([[(d + s) % 4, (d + s + 1) % 4] for s in range(2)] if d < D - 1 else [[-1, -1], [-1, -1]])
    assert ids.tolist() == want
    coll = tr.manifest["collection"]
    import hashlib

    assert coll["llmd_moetrace"] == {
        "model": "test/moe",
        "source_sha256": hashlib.sha256(source).hexdigest(),
        "source_size": len(source),
    }
    assert any("last output token (2 route(s)) is not kept" in n for n in notes)


def _llama_cpp_trace(path: Path) -> Path:
    """llama.cpp's llama-moe-trace layout: the same magic, then u32 header length and a JSON header."""
    header = b'{"format": "moetrace", "version": 1}'
    path.write_bytes(b"MOETRC01" + struct.pack("<I", len(header)) + header + bytes(64))
    return path


def test_llmd_sim_24c1e2a0_llama_cpp_file_with_the_same_magic_is_named(tmp_path):
    path = _llama_cpp_trace(tmp_path / "code-0.moetrace")
    with pytest.raises(TraceFormatError, match="none of the formats"):
        detect_format(path)
    r = runner.invoke(
        app, ["import", str(path), "--format", "llmd-moetrace", "-m", "mixtral-8x7b", "-o", str(tmp_path / "t")]
    )
    assert r.exit_code != 0 and "llama-moe-trace" in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "t").exists()


def _patch(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def _malformed(data: bytes) -> list[tuple[str, bytes, str]]:
    """(case, bytes, fragment of the one-line error)."""
    n = struct.unpack_from("<I", data, 64)[0]
    mo, ml = struct.unpack_from("<QQ", data, 16)
    io = struct.unpack_from("<Q", data, 40)[0]
    first_block = mo + ml
    meta = json.loads(data[mo : mo + ml])
    mb = golden.go_marshal(dict(meta, num_experts=5))
    assert len(mb) == ml
    return [
        ("short", data[:50], "shorter than the 112-byte"),
        ("cut", data[:-7], "goes past the end of the file"),
        ("trailing", data + b"\0", "bytes after the index"),
        ("version", _patch(data, 8, "<I", 2), "version 2"),
        ("width", _patch(data, 68, "<I", 3), "expert id width 3"),
        ("prompts", _patch(data, 64, "<I", n + 1), "index of"),
        ("metadata json", data[:mo] + b"{" * ml + data[mo + ml :], "not JSON"),
        ("metadata experts", data[:mo] + mb + data[mo + ml :], "has 5 experts"),
        ("block header", _patch(data, first_block + 12, "<I", 9), "block header"),
        ("count", _patch(data, first_block + 32 + 4 * 4, "<I", 7), "stored prefill count"),
        ("expert id", _patch(data, io - 1, "<B", 9), "expert id 9"),
        # prompt 0's first decode route (2+2 token ids, 2x4 counts, 2x2x2 prefill ids before it): [0, 1] -> [1, 1]
        ("duplicate expert", _patch(data, first_block + 32 + 16 + 32 + 8, "<B", 1), "appears twice"),
        ("index offset", _patch(data, io + 8, "<Q", first_block + 1), "back to back"),
    ]


THEIR_FILE = golden.convert(golden.go_marshal_indent(golden.their_test_source()))


@pytest.mark.parametrize("case", [c for c, _, _ in _malformed(THEIR_FILE)])
def test_llmd_sim_24c1e2a0_malformed_file_is_one_line_and_leaves_nothing(tmp_path, case):
    _, data, fragment = next(m for m in _malformed(THEIR_FILE) if m[0] == case)
    path = tmp_path / "bad.moetrace"
    path.write_bytes(data)
    out = tmp_path / "t"
    with pytest.raises(TraceFormatError) as err:
        import_trace(path, out=out, model=THEIRS, source_format="llmd-moetrace")
    msg = str(err.value)
    assert fragment in msg and "\n" not in msg and str(path) in msg, msg
    assert not out.exists()


def test_llmd_sim_24c1e2a0_model_mismatch_names_both(tmp_path):
    path, _ = _their_file(tmp_path)
    with pytest.raises(TraceFormatError, match=r"4 experts, top-k 2 and sparse layers 1..3 .*pass the model"):
        import_trace(path, out=tmp_path / "t", model=_model(8, 2, (1, 3)))


# ---------------------------------------------------------------- export, and the round trip
def _routes(rng: np.random.Generator, T: int, L: int, E: int, K: int) -> np.ndarray:
    return np.argsort(rng.random((T, L, E)), axis=-1)[..., :K].astype(np.int16)


def _write_trace(path: Path, model: ModelInfo, seed: int) -> tuple[Path, np.ndarray, np.ndarray, np.ndarray]:
    from factories import write_trace

    rng = np.random.default_rng(seed)
    R = 5
    ptok, otok = rng.integers(1, 9, size=R), rng.integers(1, 6, size=R)
    ids = _routes(rng, int((ptok + otok).sum()), model.num_moe_layers, model.num_experts, model.top_k)
    ends = np.cumsum(ptok + otok)
    ids[ends - 1] = -1  # the last generated token: never fed back
    write_trace(path, model=model, dataset_R=["d"] * R, prompt_tokens_R=ptok, output_tokens_R=otok, topk_ids_TLK=ids)
    return path, ids, ptok, otok


@pytest.mark.parametrize("E, K, layers", [(8, 2, (1, 2, 4)), (300, 3, (0, 1))])  # 1- and 2-byte ids
def test_llmd_sim_24c1e2a0_export_is_their_converters_bytes_and_imports_back(tmp_path, E, K, layers):
    model = _model(E, K, layers)
    path, ids, ptok, otok = _write_trace(tmp_path / "t", model, seed=E)
    data = export_file(path, fmt="llmd-moetrace")
    assert isinstance(data, bytes)
    meta, prompts = go_read(data)  # their reader accepts it
    assert meta["model"] == model.source and meta["sparse_layers"] == list(layers)
    # their converter, fed the same routes (the last output token's route: the one before it, as exported)
    starts = np.concatenate([[0], np.cumsum(ptok + otok)])
    source_prompts = []
    for r in range(len(ptok)):
        rows = ids[starts[r] : starts[r + 1]].copy()
        rows[-1] = rows[-2]
        source_prompts.append(([0] * int(ptok[r]), [0] * int(otok[r]), rows.tolist()))
    source = golden.source_from_routes(
        model=model.source, num_experts=E, top_k=K, sparse_layers=list(layers), prompts=source_prompts
    )
    theirs = bytearray(golden.convert(golden.go_marshal_indent(source)))
    theirs[56:64] = bytes(8)  # the source JSON's size and hash: moetrace has no source JSON and writes zeros
    theirs[80:112] = bytes(32)
    assert data == bytes(theirs)
    # and back: the same trace (request ids renumbered 0..R-1 in request-id order)
    (tmp_path / "x.moetrace").write_bytes(data)
    import_trace(tmp_path / "x.moetrace", out=tmp_path / "back", model=model)
    back = open_trace(tmp_path / "back")
    assert back.request_arrays.prompt_tokens_R.tolist() == ptok.tolist()
    assert back.request_arrays.output_tokens_R.tolist() == otok.tolist()
    assert np.array_equal(back.token_arrays().topk_ids_TLK, ids)


def test_llmd_sim_24c1e2a0_export_refuses_unrecorded_routes(tmp_path):
    from factories import write_trace

    model = _model(8, 2, (1, 2))
    rng = np.random.default_rng(3)
    ids = _routes(rng, 6, 2, 8, 2)
    ids[2, 1] = -1  # a prefix-cache hit in the prompt
    path = write_trace(
        tmp_path / "t",
        model=model,
        dataset_R=["d"],
        prompt_tokens_R=np.array([4]),
        output_tokens_R=np.array([2]),
        topk_ids_TLK=ids,
    )
    with pytest.raises(ConfigError, match=r"request 3, position 2, layer 2 has no recorded expert"):
        export_file(path, fmt="llmd-moetrace")
    r = runner.invoke(app, ["export", str(path), "--format", "llmd-moetrace", "-o", str(tmp_path / "x.moetrace")])
    assert r.exit_code != 0 and "no recorded expert" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x.moetrace").exists()


def test_llmd_sim_24c1e2a0_cli_round_trip(tmp_path):
    model = _model(8, 2, (1, 2, 4))
    path, ids, _, _ = _write_trace(tmp_path / "t", model, seed=11)
    out = tmp_path / "x.moetrace"
    r = runner.invoke(app, ["export", str(path), "--format", "llmd-moetrace", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == export_file(path, fmt="llmd-moetrace")


# ---------------------------------------------------------------- fixed placement (moe_trace_fidelity.go @ 03a00a82)
def go_install_fixed_placement(text: str, *, num_layers: int, slots: int, gpus: int, experts: int) -> list:
    """Their ``installFixedPlacement``: per layer, each logical expert's GPUs in slot order; every check an assertion."""
    data = json.loads(text)
    assert data.get("num_layers", 0) in (0, num_layers) and data.get("num_physical_experts", 0) in (0, slots)
    p2l = data["physical_to_logical"]
    assert len(p2l) == num_layers and slots % gpus == 0
    per_gpu = slots // gpus
    out = []
    for layer, row in enumerate(p2l):
        assert len(row) == slots, f"layer {layer} has {len(row)} slots"
        placement: list[list[int]] = [[] for _ in range(experts)]
        for phys, logical in enumerate(row):
            assert 0 <= logical < experts
            gpu = phys // per_gpu
            assert gpu not in placement[logical], f"layer {layer} maps expert {logical} twice to GPU {gpu}"
            placement[logical].append(gpu)
        assert all(placement), "an expert without a replica"
        out.append(placement)
    return out


def _placement(config: str, phy2log_LP: np.ndarray) -> PlacementFile:
    L = phy2log_LP.shape[0]
    return PlacementFile(
        model=_model(4, 2, tuple(range(1, L + 1))),
        deployment=parse_deployment(config, num_gpus_per_node=4),
        strategy="eplb",
        placement=placement_from_phy2log(phy2log_LP, num_experts=4),
    )


def test_llmd_sim_03a00a82_fixed_placement_loads_as_the_placement(tmp_path):
    phy2log = np.array([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 2]])
    pf = _placement("DP2TP1EP2", phy2log)
    text = export_placement(pf, fmt="llmd-fixed-placement")
    got = go_install_fixed_placement(text, num_layers=2, slots=6, gpus=2, experts=4)
    for l in range(2):
        for e in range(4):
            assert got[l][e] == [p // 3 for p in range(6) if phy2log[l, p] == e]
    save_placement(pf, tmp_path / "p.json")
    out = tmp_path / "fixed.json"
    r = runner.invoke(app, ["export", str(tmp_path / "p.json"), "--format", "llmd-fixed-placement", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_text() == text


def test_llmd_sim_03a00a82_fixed_placement_refuses_an_expert_twice_on_one_gpu():
    pf = _placement("DP2TP1EP2", np.array([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 3, 0]]))
    with pytest.raises(ConfigError, match=r"EP rank 1 holds expert 3 twice in model layer 2"):
        export_placement(pf, fmt="llmd-fixed-placement")
