"""Import format ``tokens``: JSONL of per-token, per-layer routing records.

Each line is ``{"request", "layer", "position", "stage", "experts"}``: ``request`` an int or string
id, ``layer`` the model layer index (one of the model's MoE layers), ``position`` 0-based in prompt
+ output, ``stage`` ``prefill`` or ``decode``, ``experts`` the top-k expert ids (``-1`` allowed);
optional ``dataset``. Missing (position, layer) pairs become ``-1``. Detected by the first record's
keys (``request``, ``layer``, ``position``, ``experts``).

Stages (``--stages``, ``base.StagesMode``):

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

Shape legend: R requests, T tokens, L MoE layers, H all decoder layers, K top-k, X = L*K, N records
(one per token and layer) (legend: docs/architecture.md).

Out of scope: what a ``--model`` name means (the caller passes the ``ModelInfo``); streaming: the
file is read whole (polars), so its records must fit in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace.errors import TraceFormatError
from moetrace.tracer.importers.base import ImportFormat, Progress, ReadResult, StagesMode
from moetrace.tracer.importers.jsonl import check_utf8, first_object

if TYPE_CHECKING:  # numpy, polars and the writer load when a file is read, so `moetrace --help` stays light
    import numpy as np

    from moetrace.tracer.trace.schema import ModelInfo
    from moetrace.tracer.trace.writer import TraceWriter

#: the keys every record has
FIELDS = ("request", "layer", "position", "stage", "experts")


def detect(head: bytes, src: Path) -> bool:
    """A JSON-lines file whose first record is an object with ``request``, ``layer``, ``position`` and
    ``experts`` (``stage`` may be missing: the reader then names it)."""
    first = first_object(head, src)
    return first is not None and {"request", "layer", "position", "experts"} <= set(first)


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
    import numpy as np

    from moetrace.tracer.trace.schema import NO_EXPERT

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
    return (
        rids.astype(np.int64),
        prompt_R.astype(np.int32),
        (len_R - prompt_R).astype(np.int32),
        topk_ids_TLK.reshape(-1, L * K),
    )


def decode_only_counts_generated(position_N: np.ndarray) -> bool:
    """Whether a decode-only capture numbers generated tokens from 0 (its smallest position is 0),
    rather than counting the prompt too: then prompt lengths are unknown."""
    return bool(position_N.size) and int(position_N.min()) == 0


def _check_stages(
    is_decode_N: np.ndarray, *, request_N: np.ndarray, position_N: np.ndarray, stages: StagesMode
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


def read(
    src: Path,
    *,
    writer: TraceWriter,
    info: ModelInfo,
    label: str,
    stages: StagesMode = "both",
    progress: Progress | None = None,
) -> ReadResult:
    """Add the requests of a ``tokens`` file to ``writer`` in one batch (one progress report: the whole file)."""
    import numpy as np
    import polars as pl

    try:
        df = pl.read_ndjson(src, infer_schema_length=None)
    except (pl.exceptions.PolarsError, OSError, ValueError) as exc:  # polars' own errors on malformed JSON
        raise TraceFormatError(f"{src}: cannot be read as JSON lines ({str(exc).splitlines()[0][:300]})") from None
    missing = [c for c in FIELDS if c not in df.columns]
    if missing:
        raise TraceFormatError(f"{src}: records lack {missing}; each needs request, layer, position, stage, experts")
    kinds = {
        "request": ("an integer or a string", df["request"].dtype.is_integer() or df["request"].dtype == pl.String),
        "layer": ("an integer", df["layer"].dtype.is_integer()),
        "position": ("an integer", df["position"].dtype.is_integer()),
        "stage": ("'prefill' or 'decode'", df["stage"].dtype == pl.String),
        "experts": (
            "a list of integers",
            isinstance(df["experts"].dtype, pl.List) and df["experts"].dtype.inner.is_integer(),
        ),
    }
    for col, (kind, ok) in kinds.items():
        if not ok:
            raise TraceFormatError(f"{src}: `{col}` must be {kind} in every record; read as {df[col].dtype}")
    for col in FIELDS:
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
        raise TraceFormatError(
            f"{src}: a record has {int(lens[lens != info.top_k][0])} experts; {info.name} has top_k {info.top_k}"
        )
    topk_ids_NK = np.asarray(_int64(df["experts"].list.explode(), "experts", src)).reshape(-1, info.top_k)
    position_N = _int64(df["position"], "position", src)
    try:
        rid_R, prompt_R, output_R, topk_ids_TX = tokens_to_requests(
            request_N,
            _int64(df["layer"], "layer", src),
            position_N,
            (df["stage"] == "decode").to_numpy(),
            topk_ids_NK,
            info=info,
            stages=stages,
        )
    except TraceFormatError as exc:
        raise TraceFormatError(f"{src}: {exc}") from exc
    if "dataset" in df.columns and df["dataset"].dtype not in (pl.String, pl.Null):
        raise TraceFormatError(
            f"{src}: `dataset` must be a string label in every record; read as {df['dataset'].dtype}"
        )
    if "dataset" in df.columns:
        first = (
            pl.DataFrame({"r": request_N, "d": df["dataset"].cast(pl.String)})
            .group_by("r", maintain_order=True)
            .first()
        )
        by_id = dict(zip(first["r"].to_list(), first["d"].to_list()))
        ds_R = [by_id[int(r)] or label for r in rid_R]
    else:
        ds_R = [label] * len(rid_R)
    writer.add_requests(
        request_id_R=rid_R, dataset_R=ds_R, prompt_tokens_R=prompt_R, output_tokens_R=output_R, topk_ids_TX=topk_ids_TX
    )
    if progress is not None:  # one batch: the whole file
        size = src.stat().st_size
        progress(size, size)
    return ReadResult(
        datasets=frozenset(ds_R),
        prompt_lengths_known=not (stages == "decode-only" and decode_only_counts_generated(position_N)),
    )


FORMAT = ImportFormat(
    name="tokens",
    help="JSONL of per-token records {request, layer, position, stage, experts}",
    detect=detect,
    precheck=check_utf8,
    read=read,
    stages_modes=True,
)
