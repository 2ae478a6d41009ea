"""Write llm-d-inference-sim's binary ``.moetrace`` files the way their converter writes them.

A line-by-line Python rendering of their Go code (MoE-Token-Router-Project/llm-d-inference-sim, Apache-2.0), kept
apart from moetrace's own reader and exporter so the tests compare two independent readings of the format:

- ``pkg/moetrace/converter.go`` (``Convert``: the top-level JSON object, metadata keys before ``trace``, the
  SHA-256 and size of the whole input), ``source.go`` (``validateSourceMetadata``, ``convertTraceArray``:
  records grouped by prompt, empty prompts, the record count) and ``accumulator.go`` (``add``: layer slots,
  positions, duplicate and missing routes, prefill counts) at commit ``50d57696955ef0aaae567e2b3978f911da10b0e5``;
- ``pkg/moetrace/writer.go`` (``newTraceWriter``, ``writePrompt``, ``finish``) at the same commit and
  ``pkg/moetrace/format.go`` (``writeHeader``, ``expertIDBytes``, ``promptBlockLength``) at commit
  ``24c1e2a001dad73d6d180c253b213c04a47e0c62``;
- ``their_test_source`` is ``makeTestSource`` of ``pkg/moetrace/converter_test.go`` at ``24c1e2a0``, written with
  ``json.MarshalIndent(source, "", "  ")`` as ``writeTestSource`` does.

Go's ``encoding/json`` is rendered by ``go_marshal``: compact, keys in struct order, ``<``, ``>``, ``&``, U+2028 and
U+2029 escaped as ``\\u003c`` ... (``HTMLEscape``), other control characters as Python escapes them (Go >= 1.22
writes ``\\b`` and ``\\f`` as Python does).

Run ``python tests/golden/make_llmd_moetrace_golden.py OUT.moetrace`` to write the converted test source.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from typing import Any

MAGIC = b"MOETRC01"
HEADER_SIZE = 112
INDEX_ENTRY_SIZE = 32
BLOCK_HEADER_SIZE = 32


def _html_escape(text: str) -> str:
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def go_marshal(obj: Any) -> bytes:
    """Go's ``json.Marshal`` of ``obj`` (dict keys in insertion order = struct field order)."""
    return _html_escape(json.dumps(obj, ensure_ascii=False, separators=(",", ":"))).encode("utf-8")


def go_marshal_indent(obj: Any) -> bytes:
    """Go's ``json.MarshalIndent(obj, "", "  ")``."""
    return _html_escape(json.dumps(obj, ensure_ascii=False, indent=2)).encode("utf-8")


def their_test_source() -> dict[str, Any]:
    """``makeTestSource`` (converter_test.go @ 24c1e2a0): 2 prompts, layers [1, 3], 4 experts, top-2."""
    prompts = [
        {"index": 0, "prompt": "first", "input_tokens": 2, "decode_tokens": 2, "generated_text": "ab"},
        {"index": 1, "prompt": "second", "input_tokens": 1, "decode_tokens": 1, "generated_text": "c"},
    ]
    layers = [1, 3]
    records = []
    for p in prompts:
        i = p["index"]
        for slot, layer in enumerate(layers):
            for pos in range(p["input_tokens"]):
                records.append(
                    {
                        "prompt": i,
                        "phase": "prefill",
                        "position": pos,
                        "token_id": 100 + i * 10 + pos,
                        "layer": layer,
                        "experts": [(pos + slot) % 4, (pos + slot + 1) % 4],
                        "gate_weights": [0.6, 0.4],
                    }
                )
        for d in range(p["decode_tokens"]):
            for slot, layer in enumerate(layers):
                records.append(
                    {
                        "prompt": i,
                        "phase": "decode",
                        "position": p["input_tokens"] + d,
                        "token_id": 200 + i * 10 + d,
                        "layer": layer,
                        "experts": [(d + slot) % 4, (d + slot + 1) % 4],
                        "gate_weights": [0.7, 0.3],
                    }
                )
    return {
        "model": "test/moe",
        "num_experts": 4,
        "top_k": 2,
        "sparse_layers": layers,
        "num_sparse_layers": len(layers),
        "num_prompts": len(prompts),
        "prompts": prompts,
        "trace": records,
    }


def source_from_routes(
    *,
    model: str,
    num_experts: int,
    top_k: int,
    sparse_layers: list[int],
    prompts: list[tuple[list[int], list[int], list[list[list[int]]]]],
) -> dict[str, Any]:
    """A source object (``trace_qwen_moe.py``'s layout) from per-prompt (input token ids, decode token ids,
    routes ``[position][layer slot][top_k]`` over input then decode positions)."""
    meta, records = [], []
    for i, (inp, dec, routes) in enumerate(prompts):
        meta.append(
            {"index": i, "prompt": "", "input_tokens": len(inp), "decode_tokens": len(dec), "generated_text": ""}
        )
        for pos, tok in enumerate([*inp, *dec]):
            for slot, layer in enumerate(sparse_layers):
                records.append(
                    {
                        "prompt": i,
                        "phase": "prefill" if pos < len(inp) else "decode",
                        "position": pos,
                        "token_id": tok,
                        "layer": layer,
                        "experts": list(routes[pos][slot]),
                    }
                )
    return {
        "model": model,
        "num_experts": num_experts,
        "top_k": top_k,
        "sparse_layers": sparse_layers,
        "num_sparse_layers": len(sparse_layers),
        "num_prompts": len(prompts),
        "prompts": meta,
        "trace": records,
    }


def _expert_id_bytes(n: int) -> int:
    if n < 1:
        raise ValueError("num_experts must be positive")
    if n <= 256:
        return 1
    if n <= 65536:
        return 2
    raise ValueError(f"num_experts {n} exceeds the format limit of 65536")


class _Prompt:
    """``promptAccumulator``."""

    def __init__(self, meta: dict[str, Any], src: dict[str, Any], slots: dict[int, int]) -> None:
        self.meta = meta
        P, D, L, K = meta["input_tokens"], meta["decode_tokens"], src["num_sparse_layers"], src["top_k"]
        if P < 0 or D < 0:
            raise ValueError(f"prompt {meta['index']} has negative token counts")
        self.P, self.D, self.L, self.K, self.E, self.slots = P, D, L, K, src["num_experts"], slots
        self.inp, self.dec = [0] * P, [0] * D
        self.inp_seen, self.dec_seen = [False] * P, [False] * D
        self.pre_seen, self.dec_route_seen = [False] * (P * L), [False] * (D * L)
        self.counts = [0] * (L * self.E)
        self.pre_routes, self.dec_routes = [0] * (L * P * K), [0] * (D * L * K)

    def add(self, r: dict[str, Any]) -> None:
        i = self.meta["index"]
        if r["layer"] not in self.slots:
            raise ValueError(f"prompt {i} uses non-sparse layer {r['layer']}")
        slot = self.slots[r["layer"]]
        if not 0 <= r["token_id"] <= 0xFFFFFFFF:
            raise ValueError(f"prompt {i} has token_id {r['token_id']} outside uint32 range")
        if len(r["experts"]) != self.K:
            raise ValueError(f"prompt {i} layer {r['layer']} position {r['position']} has {len(r['experts'])} experts")
        if len(set(r["experts"])) != self.K or not all(0 <= e < self.E for e in r["experts"]):
            raise ValueError(f"prompt {i} has a repeated or out-of-range expert")
        if r["phase"] == "prefill":
            pos = r["position"]
            if not 0 <= pos < self.P:
                raise ValueError(f"prompt {i} has invalid prefill position {pos}")
            seen = slot * self.P + pos
            if self.pre_seen[seen]:
                raise ValueError(f"duplicate prefill route for prompt {i}")
            self.pre_seen[seen] = True
            if self.inp_seen[pos] and self.inp[pos] != r["token_id"]:
                raise ValueError(f"prompt {i} prefill position {pos} has inconsistent token IDs")
            self.inp_seen[pos], self.inp[pos] = True, r["token_id"]
            self.pre_routes[seen * self.K : seen * self.K + self.K] = r["experts"]
            for e in r["experts"]:
                self.counts[slot * self.E + e] += 1
        elif r["phase"] == "decode":
            pos = r["position"] - self.P
            if not 0 <= pos < self.D:
                raise ValueError(f"prompt {i} has invalid decode position {r['position']}")
            seen = pos * self.L + slot
            if self.dec_route_seen[seen]:
                raise ValueError(f"duplicate decode route for prompt {i}")
            self.dec_route_seen[seen] = True
            if self.dec_seen[pos] and self.dec[pos] != r["token_id"]:
                raise ValueError(f"prompt {i} decode position {r['position']} has inconsistent token IDs")
            self.dec_seen[pos], self.dec[pos] = True, r["token_id"]
            self.dec_routes[seen * self.K : seen * self.K + self.K] = r["experts"]
        else:
            raise ValueError(f"prompt {i} has unsupported phase {r['phase']!r}")

    def expected_records(self) -> int:
        return (self.P + self.D) * self.L

    def validate_complete(self) -> None:
        if not all(self.inp_seen) or not all(self.dec_seen) or not all(self.pre_seen) or not all(self.dec_route_seen):
            raise ValueError(f"prompt {self.meta['index']} is missing routes or token ids")


def _block(p: _Prompt, width: int) -> bytes:
    """``writePrompt``'s bytes for one prompt."""
    m = p.meta
    out = struct.pack("<7I4x", m["index"], p.P, p.D, p.L, p.E, p.K, width)
    out += struct.pack(f"<{p.P}I", *p.inp) + struct.pack(f"<{p.D}I", *p.dec)
    out += struct.pack(f"<{len(p.counts)}I", *p.counts)
    fmt = "B" if width == 1 else "H"
    out += struct.pack(f"<{len(p.pre_routes)}{fmt}", *p.pre_routes)
    out += struct.pack(f"<{len(p.dec_routes)}{fmt}", *p.dec_routes)
    want = BLOCK_HEADER_SIZE + 4 * p.P + 4 * p.D + 4 * p.L * p.E + (p.P + p.D) * p.L * p.K * width
    assert len(out) == want, (len(out), want)
    return out


def convert(source_bytes: bytes) -> bytes:
    """``Convert``: the ``.moetrace`` bytes their ``moe-trace-tool convert`` writes for this input JSON."""
    src = json.loads(source_bytes)
    if not isinstance(src, dict):
        raise ValueError("input JSON must be a top-level object")
    keys = list(src)
    if "trace" not in src:
        raise ValueError("input JSON does not contain a trace array")
    for k in ("model", "num_experts", "top_k", "sparse_layers", "num_sparse_layers", "num_prompts", "prompts"):
        if k in src and keys.index(k) > keys.index("trace"):
            raise ValueError(f"{k} metadata must precede trace")
    # validateSourceMetadata
    if not src.get("model"):
        raise ValueError("trace model is empty")
    if not 1 <= src["num_experts"] <= 65536 or not 1 <= src["top_k"] <= src["num_experts"]:
        raise ValueError("invalid num_experts or top_k")
    layers = src["sparse_layers"]
    if src["num_sparse_layers"] != len(layers) or not layers or len(set(layers)) != len(layers) or min(layers) < 0:
        raise ValueError("invalid sparse layers")
    prompts = src["prompts"]
    if src["num_prompts"] != len(prompts) or not prompts or any(p["index"] != i for i, p in enumerate(prompts)):
        raise ValueError("invalid prompts")
    width = _expert_id_bytes(src["num_experts"])
    meta = {
        "format_version": 1,
        "model": src["model"],
        "num_experts": src["num_experts"],
        "top_k": src["top_k"],
        "sparse_layers": list(layers),
        "num_prompts": src["num_prompts"],
        "expert_id_bytes": width,
        "prompts": [
            {
                "index": p["index"],
                "prompt": p["prompt"],
                "input_tokens": p["input_tokens"],
                "decode_tokens": p["decode_tokens"],
                "generated_text": p["generated_text"],
            }
            for p in prompts
        ],
    }
    meta_bytes = go_marshal(meta)
    slots = {layer: s for s, layer in enumerate(layers)}
    body = bytearray()
    index = []
    offset = HEADER_SIZE + len(meta_bytes)

    def write(p: _Prompt) -> None:
        nonlocal offset
        p.validate_complete()
        if p.meta["index"] != len(index):
            raise ValueError(f"expected prompt {len(index)}, got {p.meta['index']}")
        block = _block(p, width)
        index.append((p.meta["index"], offset, len(block), p.P, p.D))
        body.extend(block)
        offset += len(block)

    nxt, cur, count = 0, None, 0
    for r in src["trace"]:
        if not 0 <= r["prompt"] < len(prompts):
            raise ValueError(f"trace record {count} has invalid prompt {r['prompt']}")
        if cur is None or r["prompt"] != cur.meta["index"]:
            if cur is not None:
                if r["prompt"] < cur.meta["index"]:
                    raise ValueError("trace records are not grouped by prompt")
                write(cur)
                nxt, cur = cur.meta["index"] + 1, None
            while nxt < r["prompt"]:
                empty = _Prompt(prompts[nxt], src, slots)
                if empty.expected_records():
                    raise ValueError(f"missing trace records for prompt {nxt}")
                write(empty)
                nxt += 1
            cur = _Prompt(prompts[r["prompt"]], src, slots)
        cur.add(r)
        count += 1
    if cur is not None:
        write(cur)
        nxt = cur.meta["index"] + 1
    while nxt < len(prompts):
        empty = _Prompt(prompts[nxt], src, slots)
        if empty.expected_records():
            raise ValueError(f"missing trace records for prompt {nxt}")
        write(empty)
        nxt += 1
    if count != sum((p["input_tokens"] + p["decode_tokens"]) * len(layers) for p in prompts):
        raise ValueError("record count does not match the prompts")
    index_offset = offset
    index_bytes = b"".join(struct.pack("<I4xQQII", *e) for e in index)
    header = MAGIC + struct.pack(
        "<IIQQQQQQIII4x",
        1,
        HEADER_SIZE,
        HEADER_SIZE,
        len(meta_bytes),
        HEADER_SIZE + len(meta_bytes),
        index_offset,
        len(index_bytes),
        len(source_bytes),
        len(prompts),
        width,
        INDEX_ENTRY_SIZE,
    )
    header += hashlib.sha256(source_bytes).digest()
    assert len(header) == HEADER_SIZE
    return header + meta_bytes + bytes(body) + index_bytes


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    with open(argv[1], "wb") as f:
        f.write(convert(go_marshal_indent(their_test_source())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
