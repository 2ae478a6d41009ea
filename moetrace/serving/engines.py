"""The wire formats of the engines behind the prefill–decode proxy: vLLM and SGLang.

Each ``Wire`` says how the proxy asks a prefill server for the prompt's routed experts, how it reads
them from the reply, and how it sends the request on to the chosen decode DP rank. Read from each
engine's source (files inside the installed package):

**vLLM 0.33.0** (wheel, commit 4ba787ec9):

- ``entrypoints/openai/completion/protocol.py`` / ``chat_completion/protocol.py``: each choice's
  ``routed_experts`` is "base64-encoded ``.npy`` bytes", shape ``(num_tokens - 1, num_layers,
  num_experts_per_tok)`` uint8/uint16/int32, ``None`` when ``enable_return_routed_experts`` is off
  server-side (no request field turns it on; ``routed_experts_prompt_start`` skips leading prompt
  positions); the response's ``kv_transfer_params`` (vLLM-specific) is what the decode request must
  carry. ``utils/serial_utils.py`` ``numpy2base64`` writes it (``np.save(..., allow_pickle=False)``).
  With ``max_tokens=1`` the array's rows are the prompt's positions (``usage.prompt_tokens``).
  The layer axis is all decoder layers (``routed_experts_capturer.py`` sizes it by
  ``get_total_num_hidden_layers()``, dense layers 0). 0.21.0 (sdist) sent nested lists, with the
  prompt's part as the response's ``prompt_routed_experts`` (layers by MoE ordinal): also read.
- ``entrypoints/generate/base/serving.py`` ``_get_data_parallel_rank``: the ``X-data-parallel-rank``
  header (an int; anything else is ignored) picks the engine; ``v1/engine/core_client.py`` sends the
  request to that engine instead of its own balancer; ``v1/engine/input_processor.py`` refuses a rank
  outside ``0 .. data_parallel_size - 1`` (``data_parallel_size_local`` on a server that serves its
  local engines only).
- Prefill–decode: vLLM's own proxy, ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``
  (vllm-project/vllm, read at commit 030ea52e): the prefill request is the client's with
  ``kv_transfer_params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id":
  None, "remote_block_ids": None, "remote_host": None, "remote_port": None}``, ``stream=False``,
  ``max_tokens=1`` (``max_completion_tokens=1`` when given), without ``stream_options``,
  ``min_tokens``, ``min_completion_tokens``; the decode request is the client's with the prefill
  reply's ``kv_transfer_params``, streamed back as it comes.
- **Limit**: ``config/vllm.py`` ``_verify_aux_output_compatibility`` refuses
  ``--enable-return-routed-experts`` together with the ``NixlConnector`` (and its Pull/Push forms),
  ``MoRIIOConnector`` and ``MooncakeConnector``: "PD auxiliary output is not supported". A vLLM
  prefill server that returns routed experts uses another connector (``LMCacheConnectorV1``,
  ``MooncakeStoreConnector``, ...), or is a routing probe without one (``pd=False``: the decode
  server prefills again).

**SGLang 0.5.23** (wheel):

- ``srt/entrypoints/openai/protocol.py``: ``CompletionRequest`` / ``ChatCompletionRequest`` take
  ``return_routed_experts`` and the PD fields ``bootstrap_host``, ``bootstrap_port``,
  ``bootstrap_room`` (``PDRoutingFields``); the response's ``sglext.routed_experts`` (``SglExt``) is
  ``meta_info["routed_experts"]`` (``openai/utils.py`` ``process_routed_experts_from_ret``): base64 of
  int32 ids, flattened ``[rows, layers, top_k]``, rows = prompt + output - 1, layers all decoder layers
  or the MoE ones (docs/collecting.md).
- ``srt/entrypoints/openai/serving_base.py`` ``extract_routed_dp_rank_from_header``: the
  ``X-Data-Parallel-Rank`` header sets ``routed_dp_rank`` over the body's (sgl-project/sglang#19832).
- Prefill–decode: the prefill and the decode request of a pair carry the same ``bootstrap_room`` and
  the prefill server's ``bootstrap_host`` / ``bootstrap_port`` and run together (the prefill waits for
  the decode's handshake: ``srt/disaggregation/prefill.py``). So the routing comes from a first
  prefill with ``bootstrap_host = "2.2.2.2"`` (``FAKE_BOOTSTRAP_HOST``, ``srt/disaggregation/utils.py``:
  the fake transfer, no decode peer; SGLang's own health check and warm-up send it), then the pair is
  sent with the decode rank chosen; the second prefill of the same prompt on the same server hits its
  radix cache.

**Reading a reply fast** (the proxy's hot path; the same results as ``json.loads`` and
``base64.b64decode(validate=True)``, tests/test_proxy_fastpath.py): ``Wire.parse_reply`` lifts the
routed experts' base64 text out of the body before the JSON parser runs (``loads_lifted``),
``b64decode`` decodes long texts in one numba pass, ``moe_layers_of`` returns a view of consecutive MoE layers.

Shape legend (docs/architecture.md): N rows returned, H layers returned, T prompt tokens, L MoE layers,
K top-k.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import json
import random
import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from moetrace.analysis.jit import cached_kernel, run_kernel
from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    "ENGINES",
    "Hop",
    "PrefillReply",
    "SglangWire",
    "VllmWire",
    "Wire",
    "moe_layers_of",
    "b64decode",
    "warm_up_decoding",
    "loads_lifted",
    "npy_array",
    "wire_for",
]

Engine = Literal["vllm", "sglang"]
ENGINES: tuple[str, ...] = ("vllm", "sglang")
#: SGLang's FAKE_BOOTSTRAP_HOST (srt/disaggregation/utils.py, 0.5.23): a prefill with no decode peer
SGLANG_FAKE_BOOTSTRAP_HOST = "2.2.2.2"
#: vLLM's prefill-side kv_transfer_params (toy_proxy_server.py)
VLLM_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
MAX_B64 = 1 << 28  # the longest routed-experts text read, characters (~200 MB of ids)
_LIFT_SENTINEL = b"\\u0000"  # JSON text of "\x00": never a base64 value
_AFTER_KEY = re.compile(rb"\s*:\s*\"")


@dataclass(frozen=True)
class PrefillReply:
    """What the proxy takes from a prefill server's reply."""

    routed_experts: np.ndarray | None  # int [T, L, K] the prompt's ids over the MoE layers; None: see problem
    problem: str  # "" when routed_experts is set, else why not ("no routing", "malformed: ...")
    carry: dict[str, Any]  # fields the decode request must carry (vLLM: kv_transfer_params)


@dataclass(frozen=True)
class Hop:
    """One request the proxy sends to an engine server."""

    server: str  # "decode" or "prefill"
    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]
    headers: dict[str, str]


_NPY_HEADER = re.compile(
    r"""\{\s*'descr':\s*'([<>|=]?[iu][1248])',\s*'fortran_order':\s*(True|False),\s*'shape':\s*\(([\d,\s]*)\),?\s*\}"""
)


@functools.lru_cache(maxsize=4096)  # replies for one prompt length share their header (~100 bytes each)
def _npy_header(header: bytes) -> tuple[np.dtype, int, tuple[int, ...], Literal["C", "F"]] | None:
    """The dtype, element count, shape and order an ``np.save`` header states; None for another header."""
    m = _NPY_HEADER.match(header.decode("latin-1"))
    if m is None:
        return None
    shape = tuple(int(x) for x in m.group(3).replace(",", " ").split())
    count = int(np.prod(shape)) if shape else 1
    return np.dtype(m.group(1)), count, shape, "F" if m.group(2) == "True" else "C"


def npy_array(data: bytes | np.ndarray) -> np.ndarray:
    """An integer array from ``.npy`` bytes (or a uint8 array of them: a view of it is returned),
    never unpickling. The header ``np.save`` writes is read with a pattern (``np.load`` parses it with
    ``ast``: ~0.5 ms, most of a decision); any other header goes through ``np.load(...,
    allow_pickle=False)``. ValueError when it is not an integer array."""
    head = bytes(data[:12])
    if head[:6] == b"\x93NUMPY" and len(data) >= 10:
        if head[6] == 1:
            n, start = int.from_bytes(head[8:10], "little"), 10
        else:
            n, start = int.from_bytes(head[8:12], "little"), 12
        known = _npy_header(bytes(data[start : start + n]))
        if known is not None:
            dtype, count, shape, order = known
            flat = np.frombuffer(data, dtype=dtype, count=count, offset=start + n)
            return flat.reshape(shape, order=order)
    raw = data if isinstance(data, bytes) else np.asarray(data).tobytes()  # the rare header np.load must read
    arr = np.load(io.BytesIO(raw), allow_pickle=False)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"expected integer ids, got {arr.dtype}")
    return arr


def _b64_pair_table() -> np.ndarray:
    """Two base64 characters -> their 12 bits, uint16 [65536] indexed by the two bytes read as one native
    uint16 (as ``np.frombuffer(text, np.uint16)`` reads them); 0xFFFF where either is outside the alphabet."""
    six = np.full(256, 255, np.uint16)
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    six[np.frombuffer(alphabet, np.uint8)] = np.arange(64, dtype=np.uint16)
    first, second = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")  # [first char, second char]
    word = np.frombuffer(np.stack([first, second], axis=-1).astype(np.uint8).tobytes(), np.uint16).reshape(256, 256)
    table = np.full(65536, 0xFFFF, np.uint16)
    ok = (six[first] < 64) & (six[second] < 64)
    table[word[ok]] = (six[first[ok]] << 6) | six[second[ok]]
    return table


_B64_PAIRS = _b64_pair_table()  # two base64 characters -> their 12 bits; 0xFFFF: not both in the alphabet
_B64_PAIRS.flags.writeable = False
_B64_NUMPY_FROM = 4096  # characters: shorter texts go to the C decoder whole


def b64decode(text: str | bytes) -> bytes | np.ndarray:
    """``base64.b64decode(text, validate=True)``, faster on the long texts of routed experts: every
    4-character group but the last is decoded in one numba pass (``_b64_kernel``: two lookups of a
    character pair's 12 bits per group, ~0.4 ns a character against the C decoder's ~2.2 on this
    project's VM), or where numba is missing by numpy (``_b64_numpy``: the same lookups, vectorised); the
    last group (its padding) by ``base64.b64decode``. Same bytes (a uint8 array, or bytes for short texts),
    same acceptance: any character outside the alphabet before the last group, or a length not a
    multiple of 4, sends the whole text through ``base64.b64decode`` for its own error (or result)."""
    data = text.encode("ascii", "replace") if isinstance(text, str) else text
    n = len(data)
    if n < _B64_NUMPY_FROM or n % 4:
        return base64.b64decode(text, validate=True)
    try:
        tail = base64.b64decode(data[n - 4 :], validate=True)
    except (binascii.Error, ValueError):
        return base64.b64decode(text, validate=True)  # its error, about the whole text
    body = 3 * (n // 4 - 1)
    out = np.empty(body + len(tail), np.uint8)
    pairs = np.frombuffer(data, np.uint16, count=(n - 4) // 2)
    if _b64_kernel() is None:
        bad = _b64_numpy(pairs, _B64_PAIRS, out)
    else:
        bad = run_kernel("base64 decoding", _b64_kernel, _b64_numpy, pairs, _B64_PAIRS, out)
    if bad:
        return base64.b64decode(text, validate=True)
    out[body:] = np.frombuffer(tail, np.uint8)
    return out


def _b64_numpy(pairs: np.ndarray, table: np.ndarray, out: np.ndarray) -> bool:
    """The decoding kernel's NumPy twin: the 4-character groups of a text read as character pairs (``pairs``:
    uint16, its length even) into the first ``3 * len(pairs) // 2`` bytes of ``out`` (uint8); True (and
    ``out`` unspecified) when a character is outside the alphabet (``table``: ``_b64_pair_table``)."""
    twelve = table.take(pairs)
    if twelve.max(initial=0) > 4095:
        return True
    q = twelve.reshape(-1, 2).astype(np.uint32)
    v = (q[:, 0] << 12) | q[:, 1]  # the group's 24 bits
    body = out[: 3 * len(q)].reshape(-1, 3)
    body[:, 0] = v >> 16
    body[:, 1] = (v >> 8) & 255
    body[:, 2] = v & 255
    return False


_KERNELS: dict[str, Any] = {}


def _b64_kernel() -> Any:
    """The numba decoding kernel (``_b64_numpy``'s signature and effect), compiled on first use (cached on
    disk by numba), or None where numba is not installed (looked up once per process)."""
    return cached_kernel(_KERNELS, "b64", _build_b64_kernel)


def _build_b64_kernel() -> Any:
    import numba

    @numba.njit(cache=True, nogil=True)
    def decode_pairs(pairs, table, out):
        j = 0
        for i in range(0, pairs.shape[0], 2):
            hi = np.int64(table[pairs[i]])
            lo = np.int64(table[pairs[i + 1]])
            if (hi | lo) > 4095:
                return True
            v = (hi << 12) | lo
            out[j] = (v >> 16) & 255
            out[j + 1] = (v >> 8) & 255
            out[j + 2] = v & 255
            j += 3
        return False

    return decode_pairs


def warm_up_decoding() -> None:
    """Compile (or load from numba's cache) the decoding kernel, so that no request pays it. Without numba:
    nothing to do."""
    if _b64_kernel() is not None:
        b64decode(base64.b64encode(bytes(3 * _B64_NUMPY_FROM // 4)))


def loads_lifted(data: bytes, key: str) -> tuple[Any, bytes | None]:
    """``json.loads(data)`` with the one long string value of ``key`` lifted out, unparsed: returns
    the reply (that value replaced by ``"\\x00"``) and the value's raw bytes. The generic parser then
    reads only the small rest of the reply (a prefill's routed experts are ~90 % of its bytes).
    Lifted only when it is unambiguous: ``key`` occurs once, unescaped, its value is a string without
    escapes; otherwise (and when the caller finds the marker elsewhere than expected) the whole body
    is parsed and the bytes are None. ValueError when ``data`` is not JSON, as ``json.loads``."""
    pat = b'"' + key.encode() + b'"'
    i = data.find(pat)
    m = _AFTER_KEY.match(data, i + len(pat)) if i > 0 else None
    if m is not None:
        start = m.end()
        end = data.find(b'"', start)
        if end > 0 and data.find(b"\\", start, end) < 0 and data.find(pat, end) < 0:
            return json.loads(data[:start] + _LIFT_SENTINEL + data[end:]), data[start:end]
    return json.loads(data), None


def moe_layers_of(ids_NHK: np.ndarray, model: ModelInfo) -> np.ndarray:
    """The MoE layers of routed ids returned over all decoder layers (H = ``num_hidden_layers``) or
    over the MoE layers already (H = L). ValueError naming the shape otherwise. Consecutive MoE
    layers (every model here: the dense ones come first) are a view, not a copy."""
    H, L = ids_NHK.shape[1], len(model.moe_layers)
    if H == L:
        return ids_NHK
    if H == model.num_hidden_layers:
        layers = list(model.moe_layers)
        if layers == list(range(layers[0], layers[0] + L)):
            return ids_NHK[:, layers[0] : layers[0] + L, :]
        return np.take(ids_NHK, layers, axis=1)  # C-contiguous (``ids[:, list]`` is not)
    raise ValueError(
        f"routed experts have {H} layers; {model.name} has {model.num_hidden_layers} decoder layers, {L} of them MoE"
    )


def _prompt_tokens(reply: dict[str, Any]) -> int | None:
    usage = reply.get("usage")
    n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and n >= 0 else None


def _prefill_common(body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for k in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(k, None)
    return out


class Wire:
    """How one engine is spoken to (module docstring). ``pd``: the servers run prefill–decode
    disaggregation (the KV cache moves from the prefill to the decode server); without it the prefill
    server is a routing probe and the decode server computes the prompt again."""

    name: Engine

    def __init__(self, model: ModelInfo, *, pd: bool = True, bootstrap_port: int | None = None) -> None:
        self.model = model
        self.pd = pd
        self.bootstrap_port = bootstrap_port

    def prefill_hop(self, path: str, body: dict[str, Any], request_id: str) -> Hop:
        raise NotImplementedError

    def parse_reply(self, data: bytes) -> Any:
        """A prefill reply's JSON (ValueError when it is not JSON), its routed experts left as the
        raw bytes of their base64 text when they could be lifted out (``loads_lifted``)."""
        reply, raw = loads_lifted(data, "routed_experts")
        if raw is None:
            return reply
        holder = self._routing_holder(reply)
        if holder is None or holder.get("routed_experts") != "\x00":  # the marker is elsewhere: parse it all
            return json.loads(data)
        holder["routed_experts"] = raw
        return reply

    def _routing_holder(self, reply: Any) -> dict[str, Any] | None:
        """The object of ``reply`` whose ``routed_experts`` carries the routing."""
        raise NotImplementedError

    def read_prefill(self, reply: Any) -> PrefillReply:
        raise NotImplementedError

    def decode_hops(
        self, path: str, body: dict[str, Any], request_id: str, rank: int, carry: dict[str, Any], prefill_host: str
    ) -> list[Hop]:
        """The decode request (last) and any request that must run beside it (SGLang's prefill of a pair)."""
        raise NotImplementedError

    def _ids(self, ids_NHK: np.ndarray, prompt: int | None) -> tuple[np.ndarray | None, str]:
        if ids_NHK.ndim != 3 or ids_NHK.shape[2] != self.model.top_k:
            return (
                None,
                f"malformed: routed experts of shape {ids_NHK.shape}, expected [tokens, layers, {self.model.top_k}]",
            )
        if ids_NHK.dtype.kind not in "iu":
            return None, f"malformed: routed experts of dtype {ids_NHK.dtype}, expected integers"
        try:
            ids = moe_layers_of(ids_NHK, self.model)
        except ValueError as exc:
            return None, f"malformed: {exc}"
        if prompt is not None:
            if len(ids) < prompt:
                return None, f"malformed: {len(ids)} rows of routed experts for a prompt of {prompt} tokens"
            ids = ids[:prompt]
        if not len(ids):
            return None, "no routing"
        return ids, ""


class VllmWire(Wire):
    name: Engine = "vllm"

    def _routing_holder(self, reply: Any) -> dict[str, Any] | None:
        choices = reply.get("choices") if isinstance(reply, dict) else None
        first = choices[0] if isinstance(choices, list) and choices else None
        return first if isinstance(first, dict) else None

    def prefill_hop(self, path: str, body: dict[str, Any], request_id: str) -> Hop:
        out = _prefill_common(body)
        if self.pd:
            out["kv_transfer_params"] = dict(VLLM_REMOTE_DECODE)
        return Hop("prefill", path, out, {"X-Request-Id": request_id})

    def read_prefill(self, reply: Any) -> PrefillReply:
        if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list) or not reply["choices"]:
            return PrefillReply(None, "malformed: the reply has no choices", {})
        kv = reply.get("kv_transfer_params")
        carry = {"kv_transfer_params": kv} if self.pd and isinstance(kv, dict) else {}
        choice = reply["choices"][0]
        raw = choice.get("routed_experts") if isinstance(choice, dict) else None
        prompt = _prompt_tokens(reply)
        if raw is None and reply.get("prompt_routed_experts") is not None:  # vLLM 0.21: nested lists, MoE ordinal
            raw, prompt = reply["prompt_routed_experts"], None
        if raw is None:
            return PrefillReply(None, "no routing", carry)
        try:
            if isinstance(raw, (str, bytes)):
                if len(raw) > MAX_B64:
                    raise ValueError(f"routed experts text of {len(raw)} characters")
                arr = npy_array(b64decode(raw))
            else:
                arr = np.asarray(raw)
        except (ValueError, TypeError, OSError, binascii.Error, EOFError) as exc:
            return PrefillReply(None, f"malformed: routed experts are not base64 of an .npy array ({exc})", carry)
        ids, problem = self._ids(arr, prompt)
        return PrefillReply(ids, problem, carry)

    def decode_hops(
        self, path: str, body: dict[str, Any], request_id: str, rank: int, carry: dict[str, Any], prefill_host: str
    ) -> list[Hop]:
        out = dict(body)
        out.update(carry)
        return [Hop("decode", path, out, {"X-Request-Id": request_id, "X-data-parallel-rank": str(rank)})]


class SglangWire(Wire):
    name: Engine = "sglang"

    def _routing_holder(self, reply: Any) -> dict[str, Any] | None:
        ext = reply.get("sglext") if isinstance(reply, dict) else None
        return ext if isinstance(ext, dict) else None

    def prefill_hop(self, path: str, body: dict[str, Any], request_id: str) -> Hop:
        out = _prefill_common(body)
        out["return_routed_experts"] = True
        if self.pd:
            out["bootstrap_host"] = SGLANG_FAKE_BOOTSTRAP_HOST
        return Hop("prefill", path, out, {"X-Request-Id": request_id})

    def read_prefill(self, reply: Any) -> PrefillReply:
        if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
            return PrefillReply(None, "malformed: the reply has no choices", {})
        ext = reply.get("sglext")
        raw = ext.get("routed_experts") if isinstance(ext, dict) else None
        if raw is None:
            return PrefillReply(None, "no routing", {})
        try:
            if not isinstance(raw, (str, bytes)) or len(raw) > MAX_B64:
                raise ValueError("expected a base64 text")
            flat = np.frombuffer(b64decode(raw), dtype="<i4")
        except (ValueError, binascii.Error) as exc:
            return PrefillReply(None, f"malformed: sglext.routed_experts is not base64 of int32 ids ({exc})", {})
        prompt = _prompt_tokens(reply)
        usage = reply.get("usage") or {}
        rows = (prompt or 0) + int(usage.get("completion_tokens") or 0) - 1 if prompt else 0
        K = self.model.top_k
        if rows <= 0 or flat.size % (rows * K):
            return PrefillReply(
                None, f"malformed: {flat.size} routed expert ids do not split into {rows} rows of top-{K}", {}
            )
        ids, problem = self._ids(flat.reshape(rows, flat.size // (rows * K), K), prompt)
        return PrefillReply(ids, problem, {})

    def decode_hops(
        self, path: str, body: dict[str, Any], request_id: str, rank: int, carry: dict[str, Any], prefill_host: str
    ) -> list[Hop]:
        headers = {"X-Request-Id": request_id, "X-Data-Parallel-Rank": str(rank)}
        if not self.pd:
            return [Hop("decode", path, dict(body), headers)]
        pd = {
            "bootstrap_host": prefill_host,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": random.getrandbits(63),
        }
        prefill = dict(body, **pd, stream=False)
        prefill.pop("stream_options", None)
        return [
            Hop("prefill", path, prefill, {"X-Request-Id": request_id + "-p"}),
            Hop("decode", path, dict(body, **pd), headers),
        ]


def wire_for(engine: str, model: ModelInfo, *, pd: bool = True, bootstrap_port: int | None = None) -> Wire:
    """The wire of ``engine`` ("vllm" or "sglang")."""
    if engine == "vllm":
        return VllmWire(model, pd=pd)
    if engine == "sglang":
        if pd and bootstrap_port is None:
            raise ValueError(
                "SGLang prefill–decode needs the prefill servers' bootstrap port: pass --bootstrap-port "
                "(their --disaggregation-bootstrap-port), or --no-pd for a routing probe without KV transfer"
            )
        return SglangWire(model, pd=pd, bootstrap_port=bootstrap_port)
    raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
