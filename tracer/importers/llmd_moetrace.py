"""Import format ``llmd-moetrace``: the binary ``.moetrace`` trace of llm-d-inference-sim's MoE fork.

The name ``.moetrace`` and the format are theirs, not moetrace's: MoE-Token-Router-Project/llm-d-inference-sim
(Apache-2.0) writes it with ``moe-trace-tool convert`` from the JSON of its ``trace_qwen_moe.py`` and replays it
with ``--moe-trace-path``. Read at commit ``24c1e2a001dad73d6d180c253b213c04a47e0c62``:
``pkg/moetrace/format.go`` (header, index entry, ``promptBlockLength``, ``expertIDBytes``) and
``pkg/moetrace/reader.go`` (``Open``, ``Validate``, ``ReadPrompt``); the writer side at commit
``50d57696955ef0aaae567e2b3978f911da10b0e5``: ``pkg/moetrace/writer.go``, ``accumulator.go``, ``source.go``,
``converter.go``, and ``docs/moe-trace-runtime.md`` (how the simulator charges each route). This reader
checks everything their ``Open`` + ``Validate`` + ``ReadPrompt`` check, and more (below).

Layout, all integers little-endian (format version 1):

- header, 112 bytes: ``MOETRC01`` magic [0:8], u32 version (1) [8:12], u32 header size (112) [12:16],
  u64 metadata offset (112) [16:24], u64 metadata length [24:32], u64 data offset (= 112 + metadata
  length) [32:40], u64 index offset [40:48], u64 index length (= prompts * 32) [48:56], u64 source JSON
  size [56:64], u32 prompts [64:68], u32 expert-id bytes (1 when ``num_experts`` <= 256, else 2) [68:72],
  u32 index entry size (32) [72:76], 4 zero bytes, the source JSON's SHA-256 [80:112];
- metadata: Go's ``json.Marshal`` of ``{"format_version", "model", "num_experts", "top_k",
  "sparse_layers" (the model layer index of each MoE layer), "num_prompts", "expert_id_bytes", "prompts":
  [{"index", "prompt", "input_tokens", "decode_tokens", "generated_text"}]}``;
- one block per prompt, back to back from the data offset: a 32-byte header (u32 prompt id, input tokens,
  decode tokens, layers, experts, top-k, expert-id bytes, 4 zero bytes), then u32 input token ids, u32
  decode token ids, u32 prefill counts ``[layer][expert]``, prefill routes ``[layer][position][top_k]``
  and decode routes ``[decode position][layer][top_k]`` (ids in 1 or 2 bytes);
- the index, 32 bytes per prompt: u32 prompt id, 4 zero bytes, u64 block offset, u64 block length, u32
  input tokens, u32 decode tokens; it ends the file.

How it becomes a trace: prompt ``i`` is request ``i``; its ``input_tokens`` rows are the prefill, its
``decode_tokens`` rows the decode (the routes of the recorded output tokens, each fed back in turn). The
route of a prompt's last output token is not kept (``-1``): a serving engine never feeds that token
through the model, and the simulator never charges it ("the route recorded for C is not charged",
``docs/moe-trace-runtime.md``); trace format v1 records no routing there either. Token ids, prompt text,
generated text and the source hash are not imported (the trace format has no column for token ids;
text stays out unless asked for elsewhere); the file's ``model`` name and source hash go to the manifest's
``collection.llmd_moetrace``.

Checked, each failure one ``TraceFormatError`` line naming the file and the prompt or offset: the magic
(a ``MOETRC01`` file of another layout, such as llama.cpp's ``llama-moe-trace`` tool, which uses the same
magic with a JSON header length in place of the version, is named as such), the header, index and block
sizes and offsets against the file's size (before anything is allocated; every read is bounded by them and
by ``--max-memory``), the metadata against the header and against ``--model`` (experts, top-k, the
``sparse_layers`` equal to the model's MoE layers), each block header against its index entry and the
metadata, the stored prefill counts against the prefill routes, and the ids (``ids.check_ids``: in range,
distinct in a token). The ids are the logical experts the router chose (the simulator charges them through
its own placement).

Shape legend: T tokens, L MoE layers, K top-k, E experts, X = L*K, P prompt (input) tokens, D decode tokens
(legend: docs/architecture.md).

Out of scope: their source JSON (``trace_qwen_moe.py``'s output, which ``moe-trace-tool convert`` reads) and
their fixed-placement JSON (written by ``moetrace export --format llmd-fixed-placement``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from moetrace.errors import TraceFormatError
from moetrace.tracer.importers.base import ImportFormat, Parsed, Requests, StagesMode
from moetrace.tracer.importers.jsonl import MAX_REQUEST_TOKENS
from moetrace.tracer.importers.options import ImportOptions, check_allocation

if TYPE_CHECKING:  # numpy and the writer load when a file is read, so `moetrace --help` stays light
    import numpy as np

    from moetrace.tracer.trace.schema import ModelInfo

MAGIC = b"MOETRC01"
FORMAT_VERSION = 1
HEADER_SIZE = 112
INDEX_ENTRY_SIZE = 32
BLOCK_HEADER_SIZE = 32
#: their ``expertIDBytes``: one byte up to 256 experts, two up to 65,536
MAX_EXPERTS = 65536
#: prompts per ``add_requests`` call (and per progress report)
BATCH_PROMPTS = 256
#: the commits read (module docstring)
SOURCE_COMMIT = "24c1e2a001dad73d6d180c253b213c04a47e0c62"
WRITER_COMMIT = "50d57696955ef0aaae567e2b3978f911da10b0e5"


def expert_id_bytes(num_experts: int) -> int:
    """Their ``expertIDBytes``: 1 for up to 256 experts, 2 for up to 65,536; ``ValueError`` otherwise."""
    if num_experts < 1:
        raise ValueError("num_experts must be positive")
    if num_experts <= 256:
        return 1
    if num_experts <= MAX_EXPERTS:
        return 2
    raise ValueError(f"num_experts {num_experts} exceeds the format limit of {MAX_EXPERTS}")


def prompt_block_length(P: int, D: int, L: int, E: int, K: int, width: int) -> int:
    """Their ``promptBlockLength``: the bytes of one prompt's block."""
    return BLOCK_HEADER_SIZE + 4 * P + 4 * D + 4 * L * E + (P + D) * L * K * width


def detect(head: bytes, src: Path) -> bool:
    """A file starting with ``MOETRC01`` whose header-size field (bytes 12..16) is 112."""
    return (
        src.is_file() and head[:8] == MAGIC and len(head) >= 16 and struct.unpack_from("<I", head, 12)[0] == HEADER_SIZE
    )


@dataclass(frozen=True)
class Header:
    """The fixed header (module docstring)."""

    version: int
    metadata_offset: int
    metadata_length: int
    data_offset: int
    index_offset: int
    index_length: int
    source_size: int
    num_prompts: int
    expert_id_bytes: int
    source_sha256: bytes


def read_header(raw: bytes, *, where: str) -> Header:
    """The header from the file's first 112 bytes (their ``readHeader``)."""
    if len(raw) < HEADER_SIZE:
        raise TraceFormatError(f"{where}: {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte .moetrace header")
    if raw[:8] != MAGIC:
        raise TraceFormatError(
            f"{where}: starts with {raw[:8]!r}, not the .moetrace magic {MAGIC!r} (llm-d-inference-sim's MoE trace)"
        )
    header_size = struct.unpack_from("<I", raw, 12)[0]
    if header_size != HEADER_SIZE:
        raise TraceFormatError(
            f"{where}: a {MAGIC.decode()} file whose header-size field is {header_size}, not {HEADER_SIZE}: not "
            "llm-d-inference-sim's layout (llama.cpp's llama-moe-trace tool writes the same magic followed by a JSON "
            "header; that layout is not imported)"
        )
    entry_size = struct.unpack_from("<I", raw, 72)[0]
    if entry_size != INDEX_ENTRY_SIZE:
        raise TraceFormatError(f"{where}: index entry size {entry_size}; version 1 has {INDEX_ENTRY_SIZE}")
    version, _, mo, ml, do, io, il, ss, n, w = struct.unpack_from("<IIQQQQQQII", raw, 8)
    if version != FORMAT_VERSION:
        raise TraceFormatError(f"{where}: .moetrace version {version}; this reader knows version {FORMAT_VERSION}")
    if w not in (1, 2):
        raise TraceFormatError(f"{where}: expert id width {w} bytes; the format stores ids in 1 or 2")
    return Header(version, mo, ml, do, io, il, ss, n, w, bytes(raw[80:112]))


def _region(offset: int, length: int, size: int, name: str, where: str) -> None:
    if offset > size or length > size - offset:
        raise TraceFormatError(
            f"{where}: the {name} region [{offset:,}, {offset + length:,}) goes past the end of the file "
            f"({size:,} bytes); the file is cut short or damaged"
        )


def _whole(value: Any, name: str, where: str, *, low: int = 0, high: int = 2**32 - 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise TraceFormatError(
            f"{where}: metadata `{name}` must be a whole number in {low}..{high:,}, got {value!r:.60}"
        )
    return value


@dataclass(frozen=True)
class Metadata:
    """The JSON metadata, checked against the header."""

    model: str
    num_experts: int
    top_k: int
    sparse_layers: tuple[int, ...]
    prompts: list[tuple[int, int]]  # (input_tokens, decode_tokens) per prompt, in index order


def read_metadata(raw: bytes, header: Header, *, where: str) -> Metadata:
    """The metadata JSON (their ``Open``'s checks, and the types)."""
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TraceFormatError(f"{where}: the metadata is not JSON ({exc.__class__.__name__}: {exc})"[:300]) from None
    if not isinstance(meta, dict):
        raise TraceFormatError(f"{where}: the metadata must be a JSON object, got {type(meta).__name__}")
    version = _whole(meta.get("format_version"), "format_version", where)
    n = _whole(meta.get("num_prompts"), "num_prompts", where)
    width = _whole(meta.get("expert_id_bytes"), "expert_id_bytes", where)
    if version != FORMAT_VERSION or n != header.num_prompts or width != header.expert_id_bytes:
        raise TraceFormatError(
            f"{where}: the metadata (format_version {version}, num_prompts {n}, expert_id_bytes {width}) does not "
            f"match the header (version {header.version}, {header.num_prompts} prompts, {header.expert_id_bytes}-byte ids)"
        )
    E = _whole(meta.get("num_experts"), "num_experts", where, low=1, high=MAX_EXPERTS)
    K = _whole(meta.get("top_k"), "top_k", where, low=1, high=E)
    if expert_id_bytes(E) != width:
        raise TraceFormatError(
            f"{where}: {width}-byte expert ids for {E} experts; the format uses {expert_id_bytes(E)}"
        )
    layers = meta.get("sparse_layers")
    if not isinstance(layers, list) or not layers:
        raise TraceFormatError(f"{where}: metadata `sparse_layers` must be a non-empty list of layer indices")
    sparse = tuple(_whole(x, "sparse_layers[]", where, high=1 << 20) for x in layers)
    prompts = meta.get("prompts")
    if not isinstance(prompts, list) or len(prompts) != n:
        got = len(prompts) if isinstance(prompts, list) else type(prompts).__name__
        raise TraceFormatError(f"{where}: metadata `prompts` must list {n} prompts, got {got}")
    counts = []
    for i, p in enumerate(prompts):
        if not isinstance(p, dict):
            raise TraceFormatError(f"{where}: metadata prompts[{i}] must be an object")
        if _whole(p.get("index"), f"prompts[{i}].index", where) != i:
            raise TraceFormatError(f"{where}: metadata prompts[{i}] has index {p.get('index')}; indices run 0..{n - 1}")
        counts.append(
            (
                _whole(p.get("input_tokens"), f"prompts[{i}].input_tokens", where),
                _whole(p.get("decode_tokens"), f"prompts[{i}].decode_tokens", where),
            )
        )
    model = meta.get("model")
    return Metadata(str(model) if model is not None else "", E, K, sparse, counts)


@dataclass(frozen=True)
class IndexEntry:
    offset: int
    length: int
    input_tokens: int
    decode_tokens: int


def read_index(raw: bytes, header: Header, meta: Metadata, *, size: int, where: str) -> list[IndexEntry]:
    """The prompt index, checked as their ``Open`` and ``Validate`` check it (offsets contiguous from the data
    offset, each block's length from its token counts, the index ending the file)."""
    L, E, K, w = len(meta.sparse_layers), meta.num_experts, meta.top_k, header.expert_id_bytes
    entries = []
    expected = header.data_offset
    for i in range(header.num_prompts):
        pid, _, off, length, P, D = struct.unpack_from("<IIQQII", raw, i * INDEX_ENTRY_SIZE)
        at = f"{where}: prompt {i}"
        if pid != i:
            raise TraceFormatError(f"{at}: its index entry names prompt {pid}")
        if off != expected:
            raise TraceFormatError(
                f"{at}: its block starts at offset {off:,}; blocks are back to back, expected {expected:,}"
            )
        _region(off, length, size, f"prompt {i} block", where)
        if off + length > header.index_offset:
            raise TraceFormatError(f"{at}: its block runs into the prompt index")
        if (P, D) != meta.prompts[i]:
            raise TraceFormatError(
                f"{at}: the index says {P} input + {D} decode tokens, the metadata {meta.prompts[i][0]} + "
                f"{meta.prompts[i][1]}"
            )
        want = prompt_block_length(P, D, L, E, K, w)
        if length != want:
            raise TraceFormatError(f"{at}: block of {length:,} bytes; {P} input + {D} decode tokens take {want:,}")
        entries.append(IndexEntry(off, length, P, D))
        expected += length
    if expected != header.index_offset:
        raise TraceFormatError(
            f"{where}: the prompt blocks end at offset {expected:,} but the index starts at {header.index_offset:,}"
        )
    if header.index_offset + header.index_length != size:
        raise TraceFormatError(f"{where}: {size - header.index_offset - header.index_length:,} bytes after the index")
    return entries


def _read_exact(f: BinaryIO, offset: int, n: int, what: str, where: str) -> bytes:
    f.seek(offset)
    data = f.read(n)
    if len(data) != n:
        raise TraceFormatError(f"{where}: {what}: the file ends {n - len(data):,} bytes early")
    return data


def prompt_rows(block: bytes, entry: IndexEntry, meta: Metadata, width: int, *, prompt: int, where: str) -> np.ndarray:
    """One prompt block as trace rows: int16 ``[P + D, L, K]``, prefill then decode, the last decode row -1."""
    import numpy as np

    L, E, K = len(meta.sparse_layers), meta.num_experts, meta.top_k
    P, D = entry.input_tokens, entry.decode_tokens
    at = f"{where}: prompt {prompt}"
    h = struct.unpack_from("<7I", block, 0)
    if h != (prompt, P, D, L, E, K, width):
        raise TraceFormatError(
            f"{at}: block header (prompt, input, decode, layers, experts, top_k, id bytes) = {h}, expected "
            f"{(prompt, P, D, L, E, K, width)}"
        )
    pos = BLOCK_HEADER_SIZE + 4 * (P + D)  # token ids: not imported
    counts_LE = np.frombuffer(block, dtype="<u4", count=L * E, offset=pos).reshape(L, E)
    pos += 4 * L * E
    dt = np.dtype("u1") if width == 1 else np.dtype("<u2")
    prefill_LPK = np.frombuffer(block, dtype=dt, count=L * P * K, offset=pos).reshape(L, P, K)
    pos += width * L * P * K
    decode_DLK = np.frombuffer(block, dtype=dt, count=D * L * K, offset=pos).reshape(D, L, K)
    ids_TLK = np.empty((P + D, L, K), dtype=np.int16)
    ids_TLK[:P] = prefill_LPK.transpose(1, 0, 2)
    ids_TLK[P:] = decode_DLK
    bad_TLK = ids_TLK >= E
    if bad_TLK.any():
        t, l, _ = (int(x) for x in np.argwhere(bad_TLK)[0])
        raise TraceFormatError(
            f"{at}: {_row(t, P)}, layer {meta.sparse_layers[l]}: expert id {int(ids_TLK[t, l].max())}, but the file "
            f"has {E} experts (0..{E - 1})"
        )
    got_LE = np.zeros((L, E), dtype=np.int64)
    for l in range(L):
        got_LE[l] = np.bincount(prefill_LPK[l].reshape(-1).astype(np.int64), minlength=E)[:E]
    if not np.array_equal(got_LE, counts_LE):
        l, e = (int(x) for x in np.argwhere(got_LE != counts_LE)[0])
        raise TraceFormatError(
            f"{at}: stored prefill count {int(counts_LE[l, e])} of expert {e} in layer {meta.sparse_layers[l]}, but "
            f"its prefill routes pick it {int(got_LE[l, e])} times; the block is damaged"
        )
    if D:
        ids_TLK[-1] = -1  # the last output token is never fed back (module docstring)
    return ids_TLK


def _row(t: int, P: int) -> str:
    return f"input position {t}" if t < P else f"decode position {t - P}"


def parse(
    src: Path,
    *,
    info: ModelInfo,
    label: str,
    stages: StagesMode = "both",
    options: ImportOptions,
    with_weights: bool = False,
) -> Generator[Requests, None, Parsed]:
    """Every prompt of the ``.moetrace`` file ``src``, one ``Requests`` each (module docstring); progress in
    bytes of ``src``."""
    import numpy as np

    del label, stages, with_weights  # always both: input tokens are prefill, decode tokens decode
    where = str(src)
    size = src.stat().st_size
    with open(src, "rb") as f:
        header = read_header(f.read(HEADER_SIZE), where=where)
        _region(header.metadata_offset, header.metadata_length, size, "metadata", where)
        _region(header.index_offset, header.index_length, size, "index", where)
        if header.metadata_offset != HEADER_SIZE:
            raise TraceFormatError(
                f"{where}: metadata at offset {header.metadata_offset:,}; version 1 puts it at {HEADER_SIZE}"
            )
        if header.data_offset != header.metadata_offset + header.metadata_length:
            raise TraceFormatError(f"{where}: the data offset {header.data_offset:,} does not follow the metadata")
        if header.index_length != header.num_prompts * INDEX_ENTRY_SIZE:
            raise TraceFormatError(
                f"{where}: index of {header.index_length:,} bytes for {header.num_prompts:,} prompts of {INDEX_ENTRY_SIZE}"
            )
        if header.data_offset > header.index_offset:
            raise TraceFormatError(f"{where}: the data region starts after the prompt index")
        check_allocation(header.metadata_length, f"{where}: metadata", options=options)
        meta = read_metadata(
            _read_exact(f, header.metadata_offset, header.metadata_length, "metadata", where), header, where=where
        )
        _check_model(meta, info, where)
        entries = read_index(
            _read_exact(f, header.index_offset, header.index_length, "index", where),
            header,
            meta,
            size=size,
            where=where,
        )
        dropped = 0
        for i, entry in enumerate(entries):
            P, D = entry.input_tokens, entry.decode_tokens
            if P < 1:
                raise TraceFormatError(
                    f"{where}: prompt {i} has no input tokens; a trace request needs a prompt of at least one token"
                )
            if P + D > MAX_REQUEST_TOKENS:
                raise TraceFormatError(
                    f"{where}: prompt {i}: {P + D:,} tokens, more than the {MAX_REQUEST_TOKENS:,} one request may have"
                )
            check_allocation(
                entry.length + (P + D) * info.ids_per_token * 4,
                f"{where}: prompt {i} ({P + D:,} tokens)",
                options=options,
            )
            block = _read_exact(f, entry.offset, entry.length, f"prompt {i} block", where)
            dropped += 1 if D else 0
            yield Requests(
                request_id_R=np.array([i], dtype=np.int64),
                prompt_tokens_R=np.array([P]),
                output_tokens_R=np.array([D]),
                topk_ids_TLK=prompt_rows(block, entry, meta, header.expert_id_bytes, prompt=i, where=where),
                describe_row=_describe(where, i, P, info),
                progress=(entry.offset + entry.length, size),
            )
    notes = [
        f"the route of each prompt's last output token ({dropped} route(s)) is not kept: a server never feeds that "
        "token through the model, and llm-d-inference-sim does not charge it either",
        "token ids, prompt and generated text are not imported",
    ]
    if meta.model and meta.model not in (info.source, info.name):
        notes.insert(0, f"the file names model {meta.model!r}; imported as {info.name} ({info.source})")
    return Parsed(
        notes=tuple(notes),
        collection={
            "llmd_moetrace": {
                "model": meta.model,
                "source_sha256": header.source_sha256.hex(),
                "source_size": header.source_size,
            }
        },
    )


def _check_model(meta: Metadata, info: ModelInfo, where: str) -> None:
    if (meta.num_experts, meta.top_k) != (info.num_experts, info.top_k) or meta.sparse_layers != tuple(info.moe_layers):
        layers = meta.sparse_layers
        raise TraceFormatError(
            f"{where}: the trace ({meta.model or 'unnamed model'}) has {meta.num_experts} experts, top-k {meta.top_k} "
            f"and sparse layers {layers[0]}..{layers[-1]} ({len(layers)}); --model {info.name} has {info.num_experts}, "
            f"top-k {info.top_k} and MoE layers {info.moe_layers[0]}..{info.moe_layers[-1]} ({info.num_moe_layers}): "
            "pass the model that recorded it"
        )


def _describe(where: str, prompt: int, P: int, info: ModelInfo) -> Callable[[int, int], str]:
    return lambda t, l: f"{where}: prompt {prompt}, {_row(t, P)}, layer {info.moe_layers[l]}"


FORMAT = ImportFormat(
    name="llmd-moetrace",
    help="llm-d-inference-sim's binary .moetrace trace (magic MOETRC01; their format, not moetrace's)",
    detect=detect,
    parse=parse,
    batch_requests=BATCH_PROMPTS,
)
