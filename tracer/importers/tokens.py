"""Import format ``tokens``: JSONL of per-token, per-layer routing records.

Each line is ``{"request", "layer", "position", "stage", "experts"}``: ``request`` an int or string
id (one kind in a file: ``7`` and ``"7"`` would otherwise be one request), ``layer`` the model layer
index (one of the model's MoE layers), ``position`` 0-based in prompt + output, ``stage``
``prefill`` or ``decode``, ``experts`` the top-k expert ids (``-1`` allowed). Optional:
``dataset``; ``weights`` (the top-k routing weights, same length as ``experts``, on every record
or none: kept in the trace's ``weights`` column, ``0.0`` where nothing was recorded);
``prompt_tokens`` (below). Missing (position, layer) pairs become ``-1``. Detected by the first
record's keys (``request``, ``layer``, ``position``, ``experts``).

Teacher-forced captures (training frameworks, fine-tuning studies): one forward pass over
prompt + response, so no record says which stage it is. With a prompt span, the first ``P``
positions of a request are its prefill and the rest its decode (the response routes exactly as
decode would for those tokens): ``prompt_tokens`` on a request's records (every request then needs
it, one value per request), or ``--prompt-tokens N`` / ``--prompt-fraction F`` (``P`` =
``round(F * length)``, at least 1) for every request. ``stage`` is then not read; the manifest
records the span (``collection.prompt_span``).

Stages (``--stages``, ``base.StagesMode``):

``both`` (default)
    Every request has its prompt's routing (at least one prefill record, at position 0) and the file
    holds decode records.
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

Ids are checked against the model (``ids.check_ids``); ``--physical-map`` converts physical slot ids
first. Errors name the line of the offending record.

Shape legend: R requests, T tokens, L MoE layers, H all decoder layers, K top-k, X = L*K, N records
(one per token and layer) (legend: docs/architecture.md).

Out of scope: what a ``--model`` name means (the caller passes the ``ModelInfo``); streaming: the
file is read whole (polars), so its records must fit in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace.errors import ConfigError, TraceFormatError
from moetrace.tracer.importers.base import ImportFormat, Parsed, Requests, StagesMode
from moetrace.tracer.importers.jsonl import MAX_REQUEST_TOKENS, check_utf8, first_object, iter_json_lines
from moetrace.tracer.importers.options import PHYSICAL_MAP, PROMPT_SPAN, ImportOptions, check_allocation

if TYPE_CHECKING:  # numpy, polars and the writer load when a file is read, so `moetrace --help` stays light
    import numpy as np

    from moetrace.tracer.trace.schema import ModelInfo

#: the keys every record has (``stage`` only without a prompt span)
FIELDS = ("request", "layer", "position", "stage", "experts")

#: names record ``n`` (0-based, in file order) for an error: ``"in.jsonl:12"``
Where = Callable[[int], str]


def _record(n: int) -> str:
    return f"record {n + 1}"


def detect(head: bytes, src: Path) -> bool:
    """A JSON-lines file whose first record is an object with ``request``, ``layer``, ``position`` and
    ``experts`` (``stage`` may be missing: the reader then names it)."""
    first = first_object(head, src)
    return first is not None and {"request", "layer", "position", "experts"} <= set(first)


def with_weights(src: Path) -> bool:
    """Whether the file carries routing weights: its first record has ``weights`` (then every record needs them)."""
    with open(src, "rb") as f:
        head = f.read(1 << 16)
    first = first_object(head, src)
    return first is not None and "weights" in first


@dataclass(frozen=True)
class TokenRequests:
    """Per-(token, layer) records gathered into whole requests (``tokens_to_requests``)."""

    request_id_R: np.ndarray  # int64, ascending
    prompt_tokens_R: np.ndarray  # int32 >= 1
    output_tokens_R: np.ndarray  # int32 >= 0
    topk_ids_TLK: np.ndarray  # int16 [T, L, K], the ids as recorded (-1: no record), requests back to back
    topk_weights_TX: np.ndarray | None  # float32 [T, L*K] (0.0: no record), when the records carry weights
    start_R: np.ndarray  # int64: the first row of each request in topk_ids_TLK
    position_N: np.ndarray  # int64: each record's position in its request's rows (after a decode-only shift)


def tokens_to_requests(
    request_N: np.ndarray,
    layer_N: np.ndarray,
    position_N: np.ndarray,
    is_decode_N: np.ndarray | None,
    topk_ids_NK: np.ndarray,
    *,
    info: ModelInfo,
    stages: StagesMode = "both",
    span_N: np.ndarray | None = None,
    weights_NK: np.ndarray | None = None,
    options: ImportOptions | None = None,
    where: Where = _record,
    request_name: Callable[[int], Any] = int,
) -> TokenRequests:
    """Per-(token, layer) records → whole requests.

    ``request_N`` int64 ids, ``layer_N`` model layer indices, ``position_N`` 0-based, ``is_decode_N``
    bool (None with a span), ``topk_ids_NK`` int (the ids as recorded: ``check_ids`` runs on the
    result), ``weights_NK`` float or None. Requests come out in ascending id order; a request has
    positions ``0..max`` (pairs with no record are ``-1``). ``span_N``: the prompt length of each
    record's request (teacher-forced; the stage of a record is then ``position >= span``); else the
    stage comes from ``is_decode_N`` and a request's prompt ends at its first decode position.
    ``stages`` is what the capture recorded (module docstring). The ``[T, L, K]`` ids are estimated
    against ``options``' memory budget before they are allocated. Raises ``TraceFormatError`` naming
    the first offending record (``where(n)``) and request (``request_name(id)``: the id as the input wrote it).
    """
    import numpy as np

    from moetrace.tracer.trace.schema import NO_EXPERT

    options = options or ImportOptions()
    L, K = info.num_moe_layers, info.top_k
    if topk_ids_NK.ndim != 2 or topk_ids_NK.shape[1] != K:
        raise TraceFormatError(f"every record needs {K} experts (top_k of {info.name}); got shape {topk_ids_NK.shape}")
    ordinal_H = np.full(info.num_hidden_layers, -1, dtype=np.int64)
    ordinal_H[list(info.moe_layers)] = np.arange(L)
    bad_layer = (layer_N < 0) | (layer_N >= info.num_hidden_layers)
    bad_layer[~bad_layer] = ordinal_H[layer_N[~bad_layer]] < 0
    if bad_layer.any():
        n = int(np.flatnonzero(bad_layer)[0])
        raise TraceFormatError(
            f"{where(n)}: layer {int(layer_N[n])} is not a MoE layer of {info.name} (MoE layers: "
            f"{info.moe_layers[0]}..{info.moe_layers[-1]}, {L} of them); `layer` is the model layer index"
        )
    if (position_N < 0).any():
        n = int(np.flatnonzero(position_N < 0)[0])
        raise TraceFormatError(f"{where(n)}: negative position {int(position_N[n])}; positions are 0-based")
    # a decode-only capture numbering generated tokens from 0: one unrecorded prompt row (format v1: prompt_tokens >= 1)
    shift = int(stages == "decode-only" and decode_only_counts_generated(position_N))
    if (position_N + shift >= np.iinfo(np.int32).max).any():
        n = int(np.argmax(position_N))
        raise TraceFormatError(f"{where(n)}: position {int(position_N[n])} does not fit the trace's int32 positions")
    out_of_int16 = (topk_ids_NK < NO_EXPERT) | (topk_ids_NK > np.iinfo(np.int16).max)
    if out_of_int16.any():
        n = int(np.argwhere(out_of_int16)[0][0])
        raise TraceFormatError(
            f"{where(n)}: expert id {int(topk_ids_NK[out_of_int16][0])}; ids are 0..{info.num_experts - 1} or -1"
        )
    position_N = position_N + shift
    rids, first_N, inv = np.unique(request_N, return_index=True, return_inverse=True)
    R = len(rids)
    len_R = np.zeros(R, dtype=np.int64)
    np.maximum.at(len_R, inv, position_N + 1)
    if (len_R > MAX_REQUEST_TOKENS).any():
        n = int(np.argmax(position_N))
        raise TraceFormatError(
            f"{where(n)}: request {request_name(int(rids[inv[n]]))!r}: position {int(position_N[n]) - shift:,} makes a request of "
            f"{int(position_N[n]) + 1:,} tokens, more than the {MAX_REQUEST_TOKENS:,} one request may have; "
            "positions are 0-based token indices"
        )
    if span_N is not None:
        prompt_R = np.zeros(R, dtype=np.int64)
        prompt_R[inv] = span_N
        differs = prompt_R[inv] != span_N
        if differs.any():
            n = int(np.flatnonzero(differs)[0])
            raise TraceFormatError(
                f"{where(n)}: request {request_name(int(rids[inv[n]]))!r}: `prompt_tokens` {int(span_N[n])} differs from another record "
                f"of the request ({int(prompt_R[inv[n]])}); one prompt length per request"
            )
        short = prompt_R > len_R
        if short.any():
            r = int(np.flatnonzero(short)[0])
            raise TraceFormatError(
                f"{where(int(first_N[r]))}: request {request_name(int(rids[r]))!r}: a prompt of {int(prompt_R[r])} tokens, but its "
                f"positions end at {int(len_R[r]) - 1}; the prompt span must fit the request (--prompt-fraction "
                "scales with each request)"
            )
        is_decode_N = position_N >= prompt_R[inv]
    else:
        if is_decode_N is None:
            raise ValueError("is_decode_N is needed without a prompt span")
        _check_stages(is_decode_N, request_N=request_N, position_N=position_N, stages=stages, where=where)
        prompt_R = np.full(R, np.iinfo(np.int64).max, dtype=np.int64)  # first decode position
        np.minimum.at(prompt_R, inv[is_decode_N], position_N[is_decode_N])
        prompt_R = np.minimum(prompt_R, len_R)
    last_prefill = np.full(R, -1, dtype=np.int64)
    np.maximum.at(last_prefill, inv[~is_decode_N], position_N[~is_decode_N])
    wrong_N = ~is_decode_N & (position_N >= prompt_R[inv])
    if wrong_N.any():
        n = int(np.flatnonzero(wrong_N)[0])
        raise TraceFormatError(
            f"{where(n)}: request {request_name(int(rids[inv[n]]))!r}: a prefill position comes after a decode position (prefill at "
            f"{int(position_N[n])}, decode from {int(prompt_R[inv[n]])})"
        )
    no_prefill = (prompt_R < 1) | ((last_prefill < 0) & (stages == "both"))
    if no_prefill.any():
        r = int(np.flatnonzero(no_prefill)[0])
        raise TraceFormatError(
            f"{where(int(first_N[r]))}: request {request_name(int(rids[r]))!r}: no prefill record (with --stages both every request "
            "needs its prompt's routing, from position 0); a capture of generated tokens only imports with "
            "--stages decode-only"
        )
    starts = np.zeros(R, dtype=np.int64)
    np.cumsum(len_R[:-1], out=starts[1:])
    rows = int(len_R.sum())
    longest = int(np.argmax(len_R))
    check_allocation(
        rows * L * K * (2 + (4 if weights_NK is not None else 0)),
        f"positions up to {int(len_R[longest]) - 1} (request {request_name(int(rids[longest]))!r}) make {rows:,} rows of {L}x{K} ids "
        "(are the positions 0-based token indices?)",
        options=options,
    )
    topk_ids_TLK = np.full((rows, L, K), NO_EXPERT, dtype=np.int16)
    row = starts[inv] + position_N
    col = ordinal_H[layer_N]
    flat = row * L + col
    order = np.argsort(flat, kind="stable")
    same = flat[order][1:] == flat[order][:-1]
    if same.any():
        i = int(np.flatnonzero(same)[0])
        a, b = sorted((int(order[i]), int(order[i + 1])))
        raise TraceFormatError(
            f"{where(b)}: request {request_name(int(rids[inv[b]]))!r}, position {int(position_N[b]) - shift}, layer {int(layer_N[b])} "
            f"appears twice (first at {where(a)}); one record per request, position and layer"
        )
    topk_ids_TLK[row, col] = topk_ids_NK
    weights_TX = None
    if weights_NK is not None:
        weights_TLK = np.zeros((rows, L, K), dtype=np.float32)
        weights_TLK[row, col] = weights_NK
        weights_TX = weights_TLK.reshape(rows, L * K)
    return TokenRequests(
        request_id_R=rids.astype(np.int64),
        prompt_tokens_R=prompt_R.astype(np.int32),
        output_tokens_R=(len_R - prompt_R).astype(np.int32),
        topk_ids_TLK=topk_ids_TLK,
        topk_weights_TX=weights_TX,
        start_R=starts,
        position_N=position_N,
    )


def decode_only_counts_generated(position_N: np.ndarray) -> bool:
    """Whether a decode-only capture numbers generated tokens from 0 (its smallest position is 0),
    rather than counting the prompt too: then prompt lengths are unknown."""
    return bool(position_N.size) and int(position_N.min()) == 0


def _check_stages(
    is_decode_N: np.ndarray, *, request_N: np.ndarray, position_N: np.ndarray, stages: StagesMode, where: Where
) -> None:
    """Raise ``TraceFormatError`` when the records' stages contradict the declared ``stages``."""
    import numpy as np

    from moetrace.tracer.trace.schema import STAGE_DECODE, STAGE_PREFILL

    if not is_decode_N.size:
        return
    fix = {
        "both": "",
        "decode-only": "; a capture with prompt records imports with --stages both",
        "prefill-only": "; a capture with generated-token records imports with --stages both",
    }[stages]
    for stage, has_N, mode in (
        (STAGE_PREFILL, ~is_decode_N, "decode-only"),
        (STAGE_DECODE, is_decode_N, "prefill-only"),
    ):
        n = int(has_N.sum())
        if stages == mode and n:
            i = int(np.flatnonzero(has_N)[0])
            raise TraceFormatError(
                f"{where(i)}: {n} record(s) have stage '{stage}' (first: request {int(request_N[i])}, position "
                f"{int(position_N[i])}) but --stages {stages} declares a capture without {stage}{fix}"
            )
        if stages == "both" and not n:
            other = "decode-only" if stage == STAGE_PREFILL else "prefill-only"
            what = "generated tokens" if stage == STAGE_PREFILL else "prompt tokens"
            raise TraceFormatError(
                f"no record has stage '{stage}': a capture of {what} only imports with --stages {other}"
                + (
                    "; a teacher-forced capture (one pass over prompt + response) imports with its prompt span: "
                    "`prompt_tokens` per request, --prompt-tokens N or --prompt-fraction F"
                    if stage == STAGE_DECODE
                    else ""
                )
            )


def _int64(column: Any, name: str, where: Where) -> np.ndarray:
    """A polars integer column as int64 numpy, or a clean error naming the record when a value does not fit 64 bits."""
    import polars as pl

    try:
        return column.cast(pl.Int64, strict=True).to_numpy()
    except pl.exceptions.InvalidOperationError:
        bad = column.cast(pl.Int64, strict=False).is_null() & column.is_not_null()
        n = int(bad.arg_true()[0]) if bad.any() else 0
        raise TraceFormatError(f"{where(n)}: `{name}` holds a whole number beyond 64 bits") from None


def _lines(src: Path) -> Where:
    """``where(n)``: ``"src:LINE"`` of the ``n``-th record (0-based, blank lines skipped as polars does); found by
    reading the file again, so only on the way to an error."""

    def where(n: int) -> str:
        seen = -1
        with open(src, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                if raw.strip():
                    seen += 1
                    if seen == n:
                        return f"{src}:{line_no}"
        return f"{src}: record {n + 1}"

    return where


def _first_not_whole(column: Any) -> int | None:
    """The index of the first value of a polars column read with the wrong type that is not a whole number, None
    when it cannot be told (polars turned ``7`` into ``"7"`` among strings)."""
    import polars as pl

    if column.dtype == pl.String:
        bad = ~column.str.contains(r"^-?[0-9]+$")
    elif column.dtype.is_float():
        bad = column != column.floor()
    else:
        return None
    bad = bad.fill_null(False)
    return int(bad.arg_true()[0]) if bad.any() else None


def _mixed_request_kinds(src: Path) -> str | None:
    """``"src:LINE"`` of the first record whose ``request`` is of the other JSON kind (int vs string) than the
    first record's, None when every id has one kind. Streams the file (only run when the ids read as strings)."""
    kind: type | None = None
    for n, obj in iter_json_lines(src):
        if not isinstance(obj, dict) or "request" not in obj:
            continue
        this = str if isinstance(obj["request"], str) else int
        if kind is None:
            kind = this
        elif this is not kind:
            return f"{src}:{n}"
    return None


def parse(
    src: Path,
    *,
    info: ModelInfo,
    label: str,
    stages: StagesMode = "both",
    options: ImportOptions,
    with_weights: bool = False,
) -> Generator[Requests, None, Parsed]:
    """The requests of a ``tokens`` file, all in one ``Requests`` (one progress report: the whole file)."""
    import numpy as np
    import polars as pl

    where = _lines(src)
    try:
        df = pl.read_ndjson(src, infer_schema_length=None)
    except (pl.exceptions.PolarsError, OSError, ValueError) as exc:  # polars' own errors on malformed JSON
        raise TraceFormatError(f"{src}: cannot be read as JSON lines ({str(exc).splitlines()[0][:300]})") from None
    cli_span = options.prompt_tokens is not None or options.prompt_fraction is not None
    has_span = cli_span or "prompt_tokens" in df.columns
    if has_span and stages != "both":
        raise ConfigError(
            f"a prompt span (teacher-forced capture) gives both stages; leave --stages at both, not {stages}"
        )
    if cli_span and "prompt_tokens" in df.columns:
        raise ConfigError(
            f"{src}: the records carry `prompt_tokens`; --prompt-tokens / --prompt-fraction would override them "
            "(leave the options out, or drop the field)"
        )
    needed = [c for c in FIELDS if not (has_span and c == "stage")]
    missing = [c for c in needed if c not in df.columns]
    if missing:
        raise TraceFormatError(
            f"{src}: records lack {missing}; each needs request, layer, position, stage, experts (`stage` may "
            "go when a prompt span is given)"
        )
    int_kind = ("an integer", lambda s: s.dtype.is_integer())
    kinds: dict[str, tuple[str, Callable[[Any], bool]]] = {
        "request": ("an integer or a string", lambda s: s.dtype.is_integer() or s.dtype == pl.String),
        "layer": int_kind,
        "position": int_kind,
        "experts": ("a list of integers", lambda s: isinstance(s.dtype, pl.List) and s.dtype.inner.is_integer()),
    }
    if not has_span:
        kinds["stage"] = ("'prefill' or 'decode'", lambda s: s.dtype == pl.String)
    if "prompt_tokens" in df.columns:
        kinds["prompt_tokens"] = int_kind
    if "weights" in df.columns:
        kinds["weights"] = ("a list of numbers", lambda s: isinstance(s.dtype, pl.List) and s.dtype.inner.is_numeric())
    for col, (kind, ok_type) in kinds.items():
        if df[col].null_count():
            n = int(df[col].is_null().arg_true()[0])
            raise TraceFormatError(f"{where(n)}: no `{col}` (null or missing); every record needs one")
        if not ok_type(df[col]):
            at = _first_not_whole(df[col]) if kind == "an integer" else None
            raise TraceFormatError(
                f"{where(at) if at is not None else src}: `{col}` must be {kind} in every record; the file's "
                f"values read as {df[col].dtype}"
            )
    if df["experts"].list.explode().null_count():
        n = int(df["experts"].list.eval(pl.element().is_null().any()).list.first().arg_true()[0])
        raise TraceFormatError(f"{where(n)}: `experts` holds null; use -1 where no expert was recorded")
    if not has_span:
        bad_stage = ~df["stage"].is_in(["prefill", "decode"])
        if bad_stage.any():
            n = int(bad_stage.arg_true()[0])
            raise TraceFormatError(f"{where(n)}: stage must be 'prefill' or 'decode', got {df['stage'][n]!r}")
    req = df["request"]
    if req.dtype.is_integer():
        request_N = _int64(req, "request", where)
        display: Callable[[int], Any] = int
    else:  # string ids: numbered in order of first appearance; an int id among them is refused
        if req.str.contains(r"^-?[0-9]+$").any():  # polars reads 7 as "7" among strings: look at the JSON kinds
            mixed = _mixed_request_kinds(src)
            if mixed is not None:
                raise TraceFormatError(
                    f'{mixed}: `request` mixes integer and string ids in one file (7 and "7" would be one '
                    "request); write every id as the same kind"
                )
        names = list(dict.fromkeys(req.to_list()))
        codes = {r: i for i, r in enumerate(names)}
        request_N = np.array([codes[r] for r in req.to_list()], dtype=np.int64)
        display = names.__getitem__
    lens = df["experts"].list.len().to_numpy()
    if (lens != info.top_k).any():
        n = int(np.flatnonzero(lens != info.top_k)[0])
        raise TraceFormatError(f"{where(n)}: {int(lens[n])} experts; {info.name} has top_k {info.top_k}")
    topk_ids_NK = np.asarray(_int64(df["experts"].list.explode(), "experts", where)).reshape(-1, info.top_k)
    weights_NK = None
    if "weights" in df.columns:
        if not with_weights:
            raise TraceFormatError(
                f"{where(0)}: the first record has no `weights` but others do; weights go on every record or none"
            )
        wlens = df["weights"].list.len().to_numpy()
        if (wlens != info.top_k).any():
            n = int(np.flatnonzero(wlens != info.top_k)[0])
            raise TraceFormatError(f"{where(n)}: {int(wlens[n])} weights; one per expert (top_k {info.top_k})")
        flat_w = df["weights"].list.explode()
        if flat_w.null_count():
            n = int(df["weights"].list.eval(pl.element().is_null().any()).list.first().arg_true()[0])
            raise TraceFormatError(f"{where(n)}: `weights` holds null; use 0.0 where no expert was recorded")
        weights_NK = flat_w.cast(pl.Float64).to_numpy().reshape(-1, info.top_k)
        if not np.isfinite(weights_NK).all():
            n = int(np.argwhere(~np.isfinite(weights_NK))[0][0])
            raise TraceFormatError(f"{where(n)}: `weights` must be finite numbers")
        weights_NK = weights_NK.astype(np.float32)
    elif with_weights:
        raise TraceFormatError(f"{where(0)}: `weights` on some records only; weights go on every record or none")
    position_N = _int64(df["position"], "position", where)
    span_N = None
    if "prompt_tokens" in df.columns:
        span_N = _int64(df["prompt_tokens"], "prompt_tokens", where)
        if (span_N < 1).any():
            n = int(np.flatnonzero(span_N < 1)[0])
            raise TraceFormatError(f"{where(n)}: `prompt_tokens` must be >= 1, got {int(span_N[n])}")
    elif cli_span:
        _, inv = np.unique(request_N, return_inverse=True)
        len_R = np.zeros(int(inv.max()) + 1 if inv.size else 0, dtype=np.int64)
        np.maximum.at(len_R, inv, position_N + 1)
        if options.prompt_tokens is not None:
            span_R = np.full(len(len_R), options.prompt_tokens, dtype=np.int64)
        else:
            span_R = np.clip(np.rint((options.prompt_fraction or 0.0) * len_R), 1, np.maximum(len_R, 1)).astype(
                np.int64
            )
        span_N = span_R[inv]
    layer_N = _int64(df["layer"], "layer", where)
    tr = tokens_to_requests(
        request_N,
        layer_N,
        position_N,
        None if has_span else (df["stage"] == "decode").to_numpy(),
        topk_ids_NK,
        info=info,
        stages=stages,
        span_N=span_N,
        weights_NK=weights_NK,
        options=options,
        where=where,
        request_name=display,
    )

    def describe_row(t: int, moe: int) -> str:
        r = int(np.searchsorted(tr.start_R, t, side="right")) - 1
        pos, layer = t - int(tr.start_R[r]), info.moe_layers[moe]
        at = np.flatnonzero((request_N == tr.request_id_R[r]) & (tr.position_N == pos) & (layer_N == layer))
        line = where(int(at[0])) if at.size else f"{src}"
        return f"{line}: request {display(int(tr.request_id_R[r]))!r}, position {pos}, layer {layer}"

    notes: list[str] = []
    collection: dict[str, Any] = {}
    if span_N is not None:
        collection["prompt_span"] = (
            {"prompt_tokens": options.prompt_tokens}
            if options.prompt_tokens is not None
            else {"prompt_fraction": options.prompt_fraction}
            if options.prompt_fraction is not None
            else {"prompt_tokens": "per request (records' prompt_tokens)"}
        )
        if "stage" in df.columns:
            notes.append("stages come from the prompt span; the records' `stage` values were not read")
    if "dataset" in df.columns and df["dataset"].dtype not in (pl.String, pl.Null):
        raise TraceFormatError(
            f"{src}: `dataset` must be a string label in every record; the file's values read as {df['dataset'].dtype}"
        )
    rid_R = tr.request_id_R
    if "dataset" in df.columns:
        first = (
            pl.DataFrame({"r": request_N, "d": df["dataset"].cast(pl.String)})
            .group_by("r", maintain_order=True)
            .first()
        )
        by_id = dict(zip(first["r"].to_list(), first["d"].to_list()))
        ds_R = tuple(by_id[int(r)] or label for r in rid_R)
    else:
        ds_R = (label,) * len(rid_R)
    yield Requests(
        request_id_R=rid_R,
        prompt_tokens_R=tr.prompt_tokens_R,
        output_tokens_R=tr.output_tokens_R,
        topk_ids_TLK=tr.topk_ids_TLK,
        dataset_R=ds_R,
        topk_weights_TX=tr.topk_weights_TX,
        describe_row=describe_row,
        flush=True,
    )
    return Parsed(
        closing_notes=tuple(notes),
        collection=collection,
        prompt_lengths_known=not (stages == "decode-only" and decode_only_counts_generated(position_N)),
    )


FORMAT = ImportFormat(
    name="tokens",
    help="JSONL of per-token records {request, layer, position, stage, experts}",
    detect=detect,
    precheck=check_utf8,
    parse=parse,
    stages_modes=True,
    options=frozenset({PHYSICAL_MAP, PROMPT_SPAN}),
    with_weights=with_weights,
)
