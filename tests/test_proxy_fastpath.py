"""The proxy's fast reading of prefill replies (moetrace/serving/engines.py) equals the plain one.

``Wire.parse_reply`` lifts the routed experts' base64 text out of the reply before the JSON parser
runs, ``b64decode`` decodes long texts in one numba pass (numpy without numba), ``moe_layers_of`` returns a
view: each is checked
against what it replaces (``json.loads``, ``base64.b64decode(validate=True)``, a copy of the MoE
layers) on valid replies and on replies built to defeat it (the key twice, in a text, escaped).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from typing import Any

import numpy as np
import pytest
from factories import TINY_MOE as MODEL
from hypothesis import given
from hypothesis import strategies as st

from moetrace.serving import engines
from moetrace.serving.engines import SglangWire, VllmWire, b64decode, loads_lifted, moe_layers_of


def _ids(T: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 16, size=(T, 4, 2)).astype(np.uint8)


def vllm_reply(ids: np.ndarray, **extra: Any) -> dict[str, Any]:
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    choice = {"index": 0, "text": "x", "routed_experts": base64.b64encode(buf.getvalue()).decode()}
    reply = {"id": "c", "choices": [choice], "usage": {"prompt_tokens": len(ids), "completion_tokens": 1}}
    reply["kv_transfer_params"] = {"remote_block_ids": [1, 2]}
    reply.update(extra)
    return reply


def sglang_reply(ids: np.ndarray) -> dict[str, Any]:
    text = base64.b64encode(np.ascontiguousarray(ids, dtype="<i4").tobytes()).decode()
    usage = {"prompt_tokens": len(ids), "completion_tokens": 1}
    return {"id": "c", "choices": [{"index": 0, "text": "x"}], "usage": usage, "sglext": {"routed_experts": text}}


def same_reading(wire: Any, data: bytes) -> None:
    fast, plain = wire.read_prefill(wire.parse_reply(data)), wire.read_prefill(json.loads(data))
    assert fast.problem == plain.problem and fast.carry == plain.carry
    if plain.routed_experts is None:
        assert fast.routed_experts is None
    else:
        assert np.array_equal(fast.routed_experts, plain.routed_experts)
        assert fast.routed_experts.dtype == plain.routed_experts.dtype


@pytest.mark.parametrize("T", [1, 5, 700])  # 700 tokens: a base64 text over 4096 characters (the numpy decoder)
def test_parse_reply_reads_what_json_loads_reads(T):
    ids = _ids(T)
    vllm, sgl = VllmWire(MODEL), SglangWire(MODEL, bootstrap_port=1)
    for wire, reply in ((vllm, vllm_reply(ids[:-1] if T > 1 else ids)), (sgl, sglang_reply(ids))):
        data = json.dumps(reply).encode()
        parsed = wire.parse_reply(data)
        holder = parsed["choices"][0] if wire is vllm else parsed["sglext"]
        assert isinstance(holder["routed_experts"], bytes)  # lifted out, not parsed
        same_reading(wire, data)


def test_parse_reply_parses_everything_when_lifting_is_ambiguous():
    wire, ids = VllmWire(MODEL), _ids(700)
    good = vllm_reply(ids)
    cases = [
        dict(good, choices=[dict(good["choices"][0], text='he said "routed_experts": "AAAA"')]),  # in a text
        dict(good, note={"routed_experts": "AAAA"}),  # the key twice (a second, nested one first)
        {"note": {"routed_experts": "AAAA"}, **good},
        dict(good, choices=[dict(good["choices"][0], routed_experts=good["choices"][0]["routed_experts"][:-4])]),
        dict(good, choices=[dict(good["choices"][0], routed_experts=None)]),
        dict(good, choices=[]),
    ]
    for reply in cases:
        data = json.dumps(reply).encode()
        same_reading(wire, data)
    text = json.dumps(good)
    i = text.index('"routed_experts": "') + len('"routed_experts": "')
    escaped = (text[:i] + f"\\u{ord(text[i]):04x}" + text[i + 1 :]).encode()  # legal JSON, an escape in the value
    assert json.loads(escaped) == good
    assert loads_lifted(escaped, "routed_experts")[1] is None  # an escape in the value: parsed whole
    same_reading(wire, escaped)
    with pytest.raises(ValueError):
        wire.parse_reply(b'{"choices": [{"routed_experts": "AAAA"}], ')  # not JSON: as json.loads


@pytest.mark.parametrize("n", [0, 1, 2, 3, 3071, 3072, 3073, 3074, 3075, 40000])
def test_b64decode_is_base64_b64decode(n):
    raw = np.random.default_rng(n).integers(0, 256, n).astype(np.uint8).tobytes()
    text = base64.b64encode(raw)
    assert bytes(b64decode(text)) == raw and bytes(b64decode(text.decode())) == raw


@pytest.mark.parametrize(
    "text",
    [
        b"A" * 5000 + b"=",
        b"A" * 4092 + b"=AAA",
        b"A" * 4092 + b"AA==AAAA",
        b"A" * 4000 + b"\n" + b"A" * 95,
        b"A" * 4094 + b"==",
        b"A" * 4093 + b"===",
        "é" * 4096,
    ],
)
def test_b64decode_refuses_what_base64_refuses(text):
    try:
        want: Any = base64.b64decode(text, validate=True)
    except ValueError as exc:
        want = (type(exc), str(exc))
    try:
        got: Any = bytes(b64decode(text))
    except ValueError as exc:
        got = (type(exc), str(exc))
    assert got == want


@given(
    raw=st.binary(min_size=3, max_size=600).map(lambda b: b[: len(b) - len(b) % 3]),
    bad=st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.sampled_from(b"=-_ \n\x00\xff"))),
)
def test_decoding_kernel_equals_its_numpy_twin(raw, bad):
    """Both decode every group of the alphabet to the same bytes, and both refuse a character outside it."""
    kernel = engines._b64_kernel()
    if kernel is None:
        pytest.skip("numba is not installed")
    chars = np.frombuffer(base64.b64encode(raw), np.uint8).copy()
    if bad is not None:
        chars[bad[0] % len(chars)] = bad[1]
    got = [np.zeros(len(chars) // 4 * 3, np.uint8) for _ in range(2)]
    pairs = chars.view(np.uint16)
    refused = [f(pairs, engines._B64_PAIRS, out) for f, out in zip((kernel, engines._b64_numpy), got)]
    assert refused[0] == refused[1] == (bad is not None)
    if bad is None:
        assert bytes(got[0]) == bytes(got[1]) == raw


def test_the_pair_table_is_two_characters_six_bits_each():
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    table = engines._B64_PAIRS
    for x in range(256):
        for y in range(256):
            got = int(table[int(np.frombuffer(bytes([x, y]), np.uint16)[0])])
            if x in alphabet and y in alphabet:
                assert got == alphabet.index(x) * 64 + alphabet.index(y)
            else:
                assert got == 0xFFFF


def test_moe_layers_of_is_the_copy_it_replaces():
    ids = _ids(9)
    assert np.array_equal(moe_layers_of(ids, MODEL), ids[:, [1, 2, 3], :])
    got = moe_layers_of(ids, dataclasses.replace(MODEL, moe_layers=(1, 3)))  # not consecutive: a copy
    assert np.array_equal(got, ids[:, [1, 3], :]) and got.flags.c_contiguous
