"""Import routing recorded by other tools into trace format v1.

Source formats:

``sglang``
    JSONL of SGLang ``/generate`` responses from a server started with
    ``--enable-return-routed-experts`` and requests sent with ``"return_routed_experts": true``.
    Each line is one response object (or a JSON list of them, as a batched ``/generate`` returns).
    ``meta_info.routed_experts`` is base64 of little-endian ids, flattened
    ``[rows, num_layers, top_k]`` covering positions ``[routed_experts_start_len, seqlen - 1)``
    (``seqlen`` = ``prompt_tokens + completion_tokens``; the last generated token is never
    forwarded); ``num_layers`` is all decoder layers (dense ones hold zeros) or only the MoE ones.
    The ids are int32 unless ``meta_info.routed_experts_dtype`` names ``int32``, ``uint16`` or
    ``uint8`` (SGLang's optional compact encoding; released SGLang up to 0.5.23 sends int32 and no
    such key). Ids are logical experts from SGLang 0.5.16 on; 0.5.7 and 0.5.9 captured after the
    logical-to-physical remap (0.5.12 on some router paths), so their runs with EPLB, redundant
    experts or ``--init-expert-location`` returned physical slot ids (docs/collecting.md says how to
    tell).
    Optional top-level ``request_id`` (int) and ``dataset`` keys, added by the user, are kept;
    otherwise the request id is the response's order in the input and the dataset is ``--dataset``
    or the file stem.

``tokens``
    JSONL of per-token, per-layer records ``{"request", "layer", "position", "stage", "experts"}``:
    ``request`` an int or string id, ``layer`` the model layer index (one of the model's MoE
    layers), ``position`` 0-based in prompt + output, ``stage`` ``prefill`` or ``decode``,
    ``experts`` the top-k expert ids (``-1`` allowed); optional ``dataset``. Missing
    (position, layer) pairs become ``-1``.

Stages (``stages``, ``--stages``; ``tokens`` only, an SGLang response always carries both):

``both`` (default)
    Every request has its prompt's routing (prefill position 0) and the file holds decode records.
``decode-only``
    A capture of generated tokens only: every record is ``decode`` (a ``prefill`` record is an
    error: the file is not what was declared). Trace format v1 needs ``prompt_tokens >= 1``, so the
    prompt is kept as rows holding ``-1`` (nothing recorded): when the positions count the prompt
    (the file's smallest position is above 0), a request's prompt length is its first decode
    position; when they count generated tokens from 0, the prompt length is unknown, every request
    gets one ``-1`` prompt row, its positions move up by one, and the manifest records
    ``collection.prompt_lengths_known: false``.
``prefill-only``
    A capture of prompt tokens only: every record is ``prefill``; requests have no generated tokens.

The manifest records the stages as ``collection.stages`` (``schema.stages_of`` reads it).

Shape legend: R requests, T tokens, L MoE layers, H all decoder layers, K top-k, X = L*K, N records
of the ``tokens`` format (one per token and layer) (legend: docs/architecture.md).

Out of scope: what a ``--model`` name means (``presets.resolve``; the caller passes the
``ModelInfo``), collecting (``collect``, ``backends``), SGLang's other recorders (the ``per_token``
expert-distribution dumps carry physical ids and no request ids).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import numpy as np

from moetrace.errors import ConfigError, OutputExistsError, TraceFormatError
from moetrace.tracer.trace.schema import NO_EXPERT, STAGE_DECODE, STAGE_PREFILL, ModelInfo, is_whole
from moetrace.tracer.trace.layout import MANIFEST
from moetrace.tracer.trace.writer import OnExisting, TraceWriter, WriterStats
from moetrace.tracer.backends.vllm_convert import routed_experts_to_rows

SourceFormat = Literal["auto", "sglang", "tokens"]
#: which stages a capture recorded: the value of ``--stages``
StagesMode = Literal["both", "decode-only", "prefill-only"]
#: ``--stages`` -> the manifest's ``collection.stages``
RECORDED_STAGES: dict[str, list[str]] = {
    "both": [STAGE_PREFILL, STAGE_DECODE], "decode-only": [STAGE_DECODE], "prefill-only": [STAGE_PREFILL],
}


#: SGLang's ``meta_info.routed_experts_dtype`` values -> the little-endian dtype of the payload's ids
SGLANG_ROUTED_EXPERTS_DTYPES = {"int32": np.dtype("<i4"), "uint16": np.dtype("<u2"), "uint8": np.dtype("u1")}
#: the payload's dtype when a response has no ``routed_experts_dtype`` (every released SGLang)
SGLANG_DEFAULT_DTYPE = "int32"


def sglang_routed_experts_dtype(name: Any) -> np.dtype:
    """The id dtype named by ``meta_info.routed_experts_dtype`` (None: int32, what SGLang sends
    without the key). SGLang reads the name case-insensitively with surrounding spaces stripped."""
    if name is None:
        return SGLANG_ROUTED_EXPERTS_DTYPES[SGLANG_DEFAULT_DTYPE]
    if not isinstance(name, str) or name.strip().lower() not in SGLANG_ROUTED_EXPERTS_DTYPES:
        raise TraceFormatError(
            f"meta_info.routed_experts_dtype must be one of {', '.join(SGLANG_ROUTED_EXPERTS_DTYPES)}, got {name!r}"
        )
    return SGLANG_ROUTED_EXPERTS_DTYPES[name.strip().lower()]


def decode_sglang_routed_experts(payload: str, *, num_rows: int, top_k: int,
                                 dtype_name: str | None = None) -> np.ndarray:
    """SGLang's base64 payload as ``[num_rows, H, top_k]`` ids (H = the layers it recorded: all, or
    only the MoE layers), in the dtype ``dtype_name`` names (a ``meta_info.routed_experts_dtype`` value;
    None: int32)."""
    ids_dtype = sglang_routed_experts_dtype(dtype_name)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (ValueError, TypeError) as exc:
        raise TraceFormatError(f"routed_experts is not base64 ({exc})") from exc
    if len(raw) % ids_dtype.itemsize:
        raise TraceFormatError(f"routed_experts holds {len(raw)} bytes, not a whole number of {ids_dtype.name} ids")
    flat = np.frombuffer(raw, dtype=ids_dtype)
    if num_rows == 0:
        return flat.reshape(0, 0, top_k)
    if flat.size % (num_rows * top_k):
        raise TraceFormatError(
            f"routed_experts holds {flat.size} ids, not a multiple of {num_rows} rows x top_k {top_k}"
        )
    return flat.reshape(num_rows, -1, top_k)


def sglang_response_rows(resp: dict[str, Any], *, info: ModelInfo) -> tuple[int, int, np.ndarray]:
    """``(prompt_tokens, output_tokens, topk_ids_TX)`` of one SGLang ``/generate`` response."""
    meta = resp.get("meta_info")
    if not isinstance(meta, dict):
        raise TraceFormatError("no meta_info object (is this a /generate response?)")
    payload = meta.get("routed_experts")
    if payload is None:
        raise TraceFormatError(
            "meta_info has no routed_experts: start SGLang with --enable-return-routed-experts and send "
            '"return_routed_experts": true with each request'
        )
    P = _whole(meta.get("prompt_tokens"), "meta_info.prompt_tokens", low=1)
    O = _whole(meta.get("completion_tokens"), "meta_info.completion_tokens")
    start = _whole(meta.get("routed_experts_start_len") or 0, "meta_info.routed_experts_start_len")
    T = P + O
    if T * info.ids_per_token * 2 > MAX_REQUEST_BYTES:
        raise TraceFormatError(f"a request of {P}+{O} tokens would take {T * info.ids_per_token * 2:,} bytes of "
                               f"routing; more than {MAX_REQUEST_BYTES:,} for one request (check the token counts)")
    if not 0 <= start <= T - 1:
        raise TraceFormatError(f"routed_experts_start_len {start} outside 0..{T - 1}")
    if not isinstance(payload, str):
        raise TraceFormatError(f"meta_info.routed_experts must be a base64 string, got {type(payload).__name__}")
    arr = decode_sglang_routed_experts(payload, num_rows=T - 1 - start, top_k=info.top_k,
                                       dtype_name=meta.get("routed_experts_dtype"))
    if start:  # positions before the start were not returned: nothing recorded
        H = arr.shape[1] if arr.size else info.num_hidden_layers
        arr = np.concatenate([np.full((start, H, info.top_k), NO_EXPERT, dtype=np.int32),
                              arr.reshape(-1, H, info.top_k).astype(np.int32)])
    try:
        rows = routed_experts_to_rows(arr, moe_layers=info.moe_layers, num_hidden_layers=info.num_hidden_layers,
                                      num_experts=info.num_experts, prompt_tokens=P, output_tokens=O)
    except ValueError as exc:
        raise TraceFormatError(str(exc)) from exc
    return P, O, rows


#: the most tokens one imported request may have, and the most bytes its rows may take: a short line
#: that claims a huge request is refused before anything is allocated
MAX_REQUEST_TOKENS = 1 << 20
MAX_REQUEST_BYTES = 1 << 29


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def check_utf8(path: Path) -> None:
    """Raise ``TraceFormatError`` naming the line unless ``path`` is UTF-8 text (streamed, bounded memory)."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            try:
                dec.decode(chunk)
            except UnicodeDecodeError as exc:
                at = line + chunk[: exc.start].count(b"\n")
                raise TraceFormatError(f"{path}:{at}: not UTF-8 text ({exc.reason}); save the file as UTF-8") from None
            line += chunk.count(b"\n")
        try:
            dec.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise TraceFormatError(f"{path}:{line}: not UTF-8 text ({exc.reason}); save the file as UTF-8") from None


def _iter_json_lines(path: Path, consumed: list[int] | None = None) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` of each non-blank line; ``consumed[0]`` is kept at the bytes read so far."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if consumed is not None:
                consumed[0] += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(f"{path}:{n}: not UTF-8 text ({exc.reason}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line, parse_constant=_reject_constant)
            except RecursionError:
                raise TraceFormatError(f"{path}:{n}: JSON nested too deeply to be a record") from None
            except ValueError as exc:  # json.JSONDecodeError is a ValueError, as is NaN/Infinity
                raise TraceFormatError(f"{path}:{n}: not valid JSON ({exc})") from None
            yield n, obj


def _whole(value: Any, name: str, *, low: int = 0, high: int = MAX_REQUEST_TOKENS) -> int:
    """``value`` as an int in ``low..high``: a JSON whole number, not a float, string or boolean."""
    if not is_whole(value) or not low <= value <= high:
        raise TraceFormatError(f"`{name}` must be a whole number in {low}..{high:,}, got {value!r}")
    return value


def detect_format(path: Path) -> Literal["sglang", "tokens"]:
    """The source format of a JSONL file, from its first record."""
    for n, obj in _iter_json_lines(path):
        first = obj[0] if isinstance(obj, list) and obj else obj
        if isinstance(first, dict) and "meta_info" in first:
            return "sglang"
        if isinstance(first, dict) and {"request", "layer", "position", "experts"} <= set(first):
            return "tokens"
        keys = sorted(first) if isinstance(first, dict) else type(first).__name__
        raise TraceFormatError(
            f"{path}:{n}: neither an SGLang /generate response (meta_info) nor a per-token record "
            f"(request, layer, position, stage, experts); found {keys}. Pass --format to say which."
        )
    raise TraceFormatError(f"{path}: empty file")


def import_trace(
    path: str | os.PathLike,
    *,
    out: str | os.PathLike,
    model: ModelInfo,
    source_format: SourceFormat = "auto",
    dataset: str | None = None,
    stages: StagesMode = "both",
    on_existing: OnExisting = "refuse",
    progress: Callable[[int, int], None] | None = None,
) -> WriterStats:
    """Convert one input file into the trace directory ``out``; returns what was written.

    ``stages``: which stages the capture recorded (module docstring); ``decode-only`` and
    ``prefill-only`` apply to the ``tokens`` format and are recorded as ``collection.stages``.

    ``progress(bytes_done, bytes_total)`` is called over the input file's bytes after each committed
    batch of requests, last with ``bytes_done == bytes_total``.
    """
    src = Path(path)
    if not src.is_file():
        raise TraceFormatError(f"{src}: no such file")
    check_utf8(src)
    if stages not in RECORDED_STAGES:
        raise ConfigError(f"stages must be one of {', '.join(RECORDED_STAGES)}, got {stages!r}")
    fmt = detect_format(src) if source_format == "auto" else source_format
    if fmt == "sglang" and stages != "both":
        raise ConfigError(f"--stages {stages} applies to --format tokens; SGLang /generate responses always carry "
                          "both stages (leave --stages at both)")
    label = dataset or src.stem
    backend = {"name": "import", "source_format": fmt, "source_file": str(src)}
    collection: dict[str, Any] = {"datasets": [label] if dataset else [], "imported_from": src.name,
                                  "stages": RECORDED_STAGES[stages]}
    created = not Path(out).exists()
    if on_existing == "refuse" and (Path(out) / MANIFEST).exists():
        raise OutputExistsError(f"{out} already holds a trace; choose another -o, or --overwrite to replace it")
    try:
        with TraceWriter(out, model=model, backend=backend, collection=collection, on_existing=on_existing) as writer:
            if fmt == "sglang":
                datasets = _import_sglang(src, writer=writer, info=model, label=label, progress=progress)
            else:
                datasets, prompts_known = _import_tokens(src, writer=writer, info=model, label=label, stages=stages)
                if not prompts_known:
                    collection["prompt_lengths_known"] = False
                if progress is not None:  # one batch: the whole file
                    size = src.stat().st_size
                    progress(size, size)
            writer.update_manifest(collection={**collection, "datasets": sorted(datasets)})
    except TraceFormatError:
        if created:  # bad input: leave no partial trace behind that would block a corrected re-run
            shutil.rmtree(out, ignore_errors=True)
        raise
    return writer.stats()


def _import_sglang(src: Path, *, writer: TraceWriter, info: ModelInfo, label: str,
                   progress: Callable[[int, int], None] | None = None) -> set[str]:
    seen: set[str] = set()
    ids: set[int] = set()
    index = 0
    batch: list[tuple[int, str, int, int, np.ndarray]] = []
    size = src.stat().st_size
    consumed = [0]

    def flush() -> None:
        if not batch:
            return
        writer.add_requests(
            request_id_R=np.array([b[0] for b in batch], dtype=np.int64),
            dataset_R=[b[1] for b in batch],
            prompt_tokens_R=np.array([b[2] for b in batch], dtype=np.int32),
            output_tokens_R=np.array([b[3] for b in batch], dtype=np.int32),
            topk_ids_TX=np.concatenate([b[4] for b in batch]),
        )
        batch.clear()
        if progress is not None:
            progress(min(consumed[0], size), size)

    for n, obj in _iter_json_lines(src, consumed):
        for resp in obj if isinstance(obj, list) else [obj]:
            if not isinstance(resp, dict):
                raise TraceFormatError(f"{src}:{n}: expected a response object, got {type(resp).__name__}")
            try:
                P, O, rows = sglang_response_rows(resp, info=info)
                rid = _whole(resp["request_id"], "request_id", high=2**63 - 1) if "request_id" in resp else index
            except (TraceFormatError, KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"{src}:{n}: {exc}") from exc
            if rid in ids:
                raise TraceFormatError(f"{src}:{n}: request_id {rid} appears twice; request ids must be unique")
            ids.add(rid)
            ds = str(resp.get("dataset", label))
            seen.add(ds)
            batch.append((rid, ds, P, O, rows))
            index += 1
            if len(batch) >= 512:
                flush()
    flush()
    if progress is not None:
        progress(size, size)
    return seen


def tokens_to_requests(
    request_N: np.ndarray,
    layer_N: np.ndarray,
    position_N: np.ndarray,
    is_decode_N: np.ndarray,
    topk_ids_NK: np.ndarray,
    *,
    info: ModelInfo,
    stages: StagesMode = "both",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-(token, layer) records → ``(request_id_R, prompt_tokens_R, output_tokens_R, topk_ids_TX)``.

    ``request_N`` int64 ids, ``layer_N`` model layer indices, ``position_N`` 0-based,
    ``is_decode_N`` bool, ``topk_ids_NK`` int. Requests come out in ascending id order; a request
    has positions ``0..max`` (pairs with no record are ``-1``) and its prefill positions must be
    exactly ``0..P-1``. ``stages`` is what the capture recorded (module docstring): a record of
    another stage is an error; under ``decode-only`` positions counted from 0 move up by one (see
    ``decode_only_counts_generated``). Raises ``TraceFormatError`` naming the first offending request.
    """
    L, K = info.num_moe_layers, info.top_k
    if topk_ids_NK.ndim != 2 or topk_ids_NK.shape[1] != K:
        raise TraceFormatError(f"every record needs {K} experts (top_k of {info.name}); got shape {topk_ids_NK.shape}")
    ordinal_H = np.full(info.num_hidden_layers, -1, dtype=np.int64)
    ordinal_H[list(info.moe_layers)] = np.arange(L)
    bad_layer = (layer_N < 0) | (layer_N >= info.num_hidden_layers)
    bad_layer[~bad_layer] = ordinal_H[layer_N[~bad_layer]] < 0
    if bad_layer.any():
        raise TraceFormatError(
            f"layer {int(layer_N[bad_layer][0])} is not a MoE layer of {info.name} (MoE layers: "
            f"{info.moe_layers[0]}..{info.moe_layers[-1]}, {L} of them); `layer` is the model layer index"
        )
    if (position_N < 0).any():
        raise TraceFormatError(f"negative position {int(position_N.min())}; positions are 0-based")
    # a decode-only capture numbering generated tokens from 0: one unrecorded prompt row (format v1: prompt_tokens >= 1)
    shift = int(stages == "decode-only" and decode_only_counts_generated(position_N))
    if (position_N + shift >= np.iinfo(np.int32).max).any():
        raise TraceFormatError(f"position {int(position_N.max())} does not fit the trace's int32 positions")
    if ((topk_ids_NK < NO_EXPERT) | (topk_ids_NK >= info.num_experts)).any():
        raise TraceFormatError(f"expert ids outside 0..{info.num_experts - 1} (or -1)")
    _check_stages(is_decode_N, request_N=request_N, position_N=position_N, stages=stages)
    position_N = position_N + shift
    rids, inv = np.unique(request_N, return_inverse=True)
    R = len(rids)
    len_R = np.zeros(R, dtype=np.int64)
    np.maximum.at(len_R, inv, position_N + 1)
    prompt_R = np.full(R, np.iinfo(np.int64).max, dtype=np.int64)  # first decode position
    np.minimum.at(prompt_R, inv[is_decode_N], position_N[is_decode_N])
    prompt_R = np.minimum(prompt_R, len_R)
    last_prefill = np.full(R, -1, dtype=np.int64)
    np.maximum.at(last_prefill, inv[~is_decode_N], position_N[~is_decode_N])
    wrong = last_prefill >= prompt_R
    if wrong.any():
        raise TraceFormatError(f"request {rids[wrong][0]}: a prefill position comes after a decode position")
    if (prompt_R < 1).any():
        raise TraceFormatError(
            f"request {rids[prompt_R < 1][0]}: no prefill position 0 (with --stages both every request needs its "
            "prompt's routing); a capture of generated tokens only imports with --stages decode-only"
        )
    starts = np.zeros(R, dtype=np.int64)
    np.cumsum(len_R[:-1], out=starts[1:])
    try:
        topk_ids_TLK = np.full((int(len_R.sum()), L, K), NO_EXPERT, dtype=np.int16)
    except MemoryError:
        raise TraceFormatError(
            f"positions up to {int(position_N.max())} need {int(len_R.sum())} rows of {L}x{K} ids: more than fits "
            "in memory (are the positions 0-based token indices?)"
        ) from None
    row = starts[inv] + position_N
    col = ordinal_H[layer_N]
    flat = row * L + col
    if len(np.unique(flat)) != len(flat):
        raise TraceFormatError("a (request, position, layer) appears twice")
    topk_ids_TLK[row, col] = topk_ids_NK
    return rids.astype(np.int64), prompt_R.astype(np.int32), (len_R - prompt_R).astype(np.int32), topk_ids_TLK.reshape(-1, L * K)


def decode_only_counts_generated(position_N: np.ndarray) -> bool:
    """Whether a decode-only capture numbers generated tokens from 0 (its smallest position is 0),
    rather than counting the prompt too: then prompt lengths are unknown."""
    return bool(position_N.size) and int(position_N.min()) == 0


def _check_stages(is_decode_N: np.ndarray, *, request_N: np.ndarray, position_N: np.ndarray, stages: StagesMode) -> None:
    """Raise ``TraceFormatError`` when the records' stages contradict the declared ``stages``."""
    if not is_decode_N.size:
        return
    fix = {"both": "", "decode-only": "; a capture with prompt records imports with --stages both",
           "prefill-only": "; a capture with generated-token records imports with --stages both"}[stages]
    for stage, has_N, mode in ((STAGE_PREFILL, ~is_decode_N, "decode-only"), (STAGE_DECODE, is_decode_N, "prefill-only")):
        n = int(has_N.sum())
        if stages == mode and n:
            i = int(np.flatnonzero(has_N)[0])
            raise TraceFormatError(
                f"{n} record(s) have stage '{stage}' (first: request {int(request_N[i])}, position "
                f"{int(position_N[i])}) but --stages {stages} declares a capture without {stage}{fix}"
            )
        if stages == "both" and not n:
            other = "decode-only" if stage == STAGE_PREFILL else "prefill-only"
            what = "generated tokens" if stage == STAGE_PREFILL else "prompt tokens"
            raise TraceFormatError(
                f"no record has stage '{stage}': a capture of {what} only imports with --stages {other}"
            )


def _int64(column: Any, name: str, src: Path) -> np.ndarray:
    """A polars integer column as int64 numpy, or a clean error when a value does not fit 64 bits."""
    import polars as pl

    try:
        return column.cast(pl.Int64, strict=True).to_numpy()
    except pl.exceptions.InvalidOperationError:
        raise TraceFormatError(f"{src}: `{name}` holds whole numbers beyond 64 bits") from None


def _import_tokens(src: Path, *, writer: TraceWriter, info: ModelInfo, label: str,
                   stages: StagesMode = "both") -> tuple[set[str], bool]:
    """Import a ``tokens`` file; returns the dataset labels and whether the prompt lengths are known."""
    import polars as pl

    try:
        df = pl.read_ndjson(src, infer_schema_length=None)
    except (pl.exceptions.PolarsError, OSError, ValueError) as exc:  # polars' own errors on malformed JSON
        raise TraceFormatError(f"{src}: cannot be read as JSON lines ({str(exc).splitlines()[0][:300]})") from None
    missing = [c for c in ("request", "layer", "position", "stage", "experts") if c not in df.columns]
    if missing:
        raise TraceFormatError(f"{src}: records lack {missing}; each needs request, layer, position, stage, experts")
    kinds = {
        "request": ("an integer or a string", df["request"].dtype.is_integer() or df["request"].dtype == pl.String),
        "layer": ("an integer", df["layer"].dtype.is_integer()),
        "position": ("an integer", df["position"].dtype.is_integer()),
        "stage": ("'prefill' or 'decode'", df["stage"].dtype == pl.String),
        "experts": ("a list of integers",
                    isinstance(df["experts"].dtype, pl.List) and df["experts"].dtype.inner.is_integer()),
    }
    for col, (kind, ok) in kinds.items():
        if not ok:
            raise TraceFormatError(f"{src}: `{col}` must be {kind} in every record; read as {df[col].dtype}")
    for col in ("request", "layer", "position", "stage", "experts"):
        if df[col].null_count():
            raise TraceFormatError(f"{src}: {df[col].null_count()} record(s) have no `{col}` (null)")
    if df["experts"].list.explode().null_count():
        raise TraceFormatError(f"{src}: `experts` lists hold nulls; use -1 where no expert was recorded")
    found = set(df["stage"].unique().to_list())
    if not found <= {"prefill", "decode"}:
        raise TraceFormatError(f"{src}: stage must be 'prefill' or 'decode', found {sorted(map(str, found))}")
    req = df["request"]
    if req.dtype.is_integer():
        request_N = _int64(req, "request", src)
    else:  # string ids: numbered in order of first appearance
        codes = {r: i for i, r in enumerate(dict.fromkeys(req.cast(pl.String).to_list()))}
        request_N = np.array([codes[r] for r in req.cast(pl.String).to_list()], dtype=np.int64)
    lens = df["experts"].list.len().to_numpy()
    if (lens != info.top_k).any():
        raise TraceFormatError(f"{src}: a record has {int(lens[lens != info.top_k][0])} experts; {info.name} has top_k {info.top_k}")
    topk_ids_NK = np.asarray(_int64(df["experts"].list.explode(), "experts", src)).reshape(-1, info.top_k)
    position_N = _int64(df["position"], "position", src)
    try:
        rid_R, prompt_R, output_R, topk_ids_TX = tokens_to_requests(
            request_N, _int64(df["layer"], "layer", src), position_N,
            (df["stage"] == "decode").to_numpy(), topk_ids_NK, info=info, stages=stages,
        )
    except TraceFormatError as exc:
        raise TraceFormatError(f"{src}: {exc}") from exc
    if "dataset" in df.columns and df["dataset"].dtype not in (pl.String, pl.Null):
        raise TraceFormatError(f"{src}: `dataset` must be a string label in every record; read as {df['dataset'].dtype}")
    if "dataset" in df.columns:
        first = (pl.DataFrame({"r": request_N, "d": df["dataset"].cast(pl.String)})
                 .group_by("r", maintain_order=True).first())
        by_id = dict(zip(first["r"].to_list(), first["d"].to_list()))
        ds_R = [by_id[int(r)] or label for r in rid_R]
    else:
        ds_R = [label] * len(rid_R)
    writer.add_requests(request_id_R=rid_R, dataset_R=ds_R, prompt_tokens_R=prompt_R, output_tokens_R=output_R,
                        topk_ids_TX=topk_ids_TX)
    return set(ds_R), not (stages == "decode-only" and decode_only_counts_generated(position_N))
