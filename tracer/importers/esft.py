"""Import format ``esft``: DeepSeek's ESFT expert-score logs, per-token routing of DeepSeek-V2-Lite.

Source: deepseek-ai/ESFT (MIT licence), commit ``579a7711e4b332b4c57b47e378a0cf240d85caa6``,
``results/expert_scores/{intent,law,summary,translation}/expert_weights_{1..26}.txt``. The files are
written by ``scripts/expert/get_expert_scores.py`` (it sets the model config's ``log_expert_weights``;
the modeling code that writes the lines is not in that repository) and read back by ``parse_line`` in
``scripts/expert/generate_expert_config.py``. This reader follows that one:

- one file per MoE layer: ``expert_weights_{N}.txt`` holds model layer ``N`` (layer 0 of
  DeepSeek-V2-Lite is dense; ``generate_expert_config.py`` takes ``N - 1`` as the MoE ordinal);
- one line per sequence, and line ``i`` of every layer file of a folder is the same sequence. A
  sequence is one training example of the task (BOS, the user prompt, the assistant's answer, EOS)
  run teacher-forced in one forward pass;
- a line holds the top-k expert ids of every token, token-major (token ``t``'s ``K`` ids are fields
  ``t*K .. t*K+K-1``), tab-separated. Then comes an empty field (two tabs in a row), then the ``K``
  routing weights of every token in the same order. The weights are the softmax scores, not
  renormalised: DeepSeek-V2-Lite has ``norm_topk_prob`` false, so a token's six sum to less than 1.

Checked on the published files: 213 sequences (intent 127, law 33, summary 13, translation 40;
33,279 tokens, about 8,200 per task), each with the same token count in all 26 layer files. Read
token-major, no token holds one expert twice; read expert-major, thousands do.

Input: the ``expert_scores`` directory, whose task folders (any subfolder holding
``expert_weights_*.txt``) become the datasets, or one task folder. A task folder's sequences are
labelled with the folder's name, or with ``--dataset`` when only that folder is imported. Other files
(``summary.json``) are not read. Requests come out folder by folder (folders sorted by name), each
in its line order. The held-out requests of ``compare`` therefore arrive grouped by task.

Stages: the capture is teacher-forced, so no line says where the prompt ends. The first
``round(F * T)`` tokens of a ``T``-token sequence are its prefill (at least 1) and the rest its
decode: ``--prompt-fraction F``, default 0.5 (``DEFAULT_PROMPT_FRACTION``). ``--prompt-tokens N``
sets the same span for every sequence (a sequence of ``N`` tokens or fewer is refused). The
continuation routes as generating those tokens would. The manifest records the span
(``collection.prompt_span``).

The model: the logs come from ``deepseek-ai/ESFT-vanilla-lite``, DeepSeek-V2-Lite's architecture
and routing (27 layers, MoE layers 1..26, 64 routed experts and 2 shared, top-6, hidden 2048, expert
FFN 1408). ``model_info()`` is that model and ``moetrace import`` uses it when ``--model`` is left out.
A ``--model`` given must have the same MoE layers and top-k (its ids are checked as for every format).

Errors name the file and line: a line without the empty field between ids and weights, a field that
is not a number, a count of ids that is not a whole number of tokens or differs from the count of
weights, layer files of one folder with other line counts or token counts, a missing or extra layer
file, a weight that is not finite.

Shape legend: T tokens, L MoE layers, K top-k, X = L*K (legend: docs/architecture.md).

Out of scope: ``summary.json`` and ``results/expert_configs`` (aggregates the trace recomputes), the
ESFT training data (``datasets/``) and completions.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace.errors import TraceFormatError
from moetrace.tracer.importers.base import ImportFormat, Parsed, Requests, StagesMode
from moetrace.tracer.importers.ids import DescribeRow
from moetrace.tracer.importers.jsonl import MAX_REQUEST_TOKENS
from moetrace.tracer.importers.options import PROMPT_SPAN, ImportOptions, check_allocation

if TYPE_CHECKING:  # numpy and the schema (pyarrow) load when a capture is read, so `moetrace --help` stays light
    import numpy as np

    from moetrace.tracer.trace.schema import ModelInfo

#: a layer file's name; the number is the model layer index
LAYER_FILE = re.compile(r"^expert_weights_(\d+)\.txt$")
#: the share of each sequence taken as its prompt when neither --prompt-fraction nor --prompt-tokens is given
DEFAULT_PROMPT_FRACTION = 0.5
#: what ESFT's ``get_expert_scores.py`` ran (``--base_model_path``), with DeepSeek-V2-Lite's topology
SOURCE_MODEL = "deepseek-ai/ESFT-vanilla-lite"


#: DeepSeek-V2-Lite's expert sizes (its config.json: ``moe_intermediate_size`` 1408, each of the 2 shared
#: experts a routed-size MLP, BF16 weights), for a ``ModelInfo`` that carries expert sizes
EXPERT_SIZES: dict[str, Any] = {
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 1408,
    "weight_bytes_per_value": 2.0,
}


def model_info() -> ModelInfo:
    """DeepSeek-V2-Lite's routing topology (the model of every ESFT log; module docstring), with its
    expert sizes where ``ModelInfo`` has fields for them (``EXPERT_SIZES``)."""
    import dataclasses

    from moetrace.tracer.trace.schema import ModelInfo

    known = {f.name for f in dataclasses.fields(ModelInfo)}
    return ModelInfo(
        name="deepseek-v2-lite",
        source=SOURCE_MODEL,
        architecture="DeepseekV2ForCausalLM",
        num_hidden_layers=27,
        moe_layers=tuple(range(1, 27)),
        num_experts=64,
        top_k=6,
        num_shared_experts=2,
        hidden_size=2048,
        **{k: v for k, v in EXPERT_SIZES.items() if k in known},
    )


def _layer_files(folder: Path) -> dict[int, Path]:
    """The layer files of one folder: model layer -> path."""
    out = {}
    for p in folder.iterdir():
        m = LAYER_FILE.match(p.name)
        if m is not None and p.is_file():
            out[int(m[1])] = p
    return out


def _task_folders(src: Path) -> list[Path]:
    """The folders of ``src`` that hold layer files: ``[src]`` itself when it holds them, else its
    subfolders that do (sorted by name)."""
    if _layer_files(src):
        return [src]
    return sorted((p for p in src.iterdir() if p.is_dir() and _layer_files(p)), key=lambda p: p.name)


def detect(head: bytes, src: Path) -> bool:
    """A directory holding ``expert_weights_<N>.txt`` files, or whose subfolders hold them."""
    del head
    try:
        return src.is_dir() and bool(_task_folders(src))
    except OSError:
        return False


@dataclass(frozen=True)
class _Line:
    """One sequence of one layer file: its ids ``[T, K]`` (int64) and weights ``[T, K]`` (float64)."""

    ids_TK: np.ndarray
    weights_TK: np.ndarray


def _numbers(text: str, dtype: Any, *, what: str, where: str, first_field: int) -> np.ndarray:
    """The tab-separated numbers of ``text`` as ``dtype``; ``TraceFormatError`` naming the first field that is not one."""
    import numpy as np

    fields = text.split("\t")
    try:
        return np.array(fields, dtype=dtype)
    except (ValueError, OverflowError):
        for i, f in enumerate(fields):
            try:
                np.array([f], dtype=dtype)
            except (ValueError, OverflowError):
                kind = "a whole number" if dtype is np.int64 else "a number"
                raise TraceFormatError(
                    f"{where}: field {first_field + i + 1} ({what}) is {f!r}, not {kind}; a line is the tab-separated "
                    "expert ids of every token, an empty field (two tabs), then their weights"
                ) from None
        raise


def _parse_line(raw: bytes, *, K: int, where: str) -> _Line:
    """One line of a layer file (module docstring); ``TraceFormatError`` naming ``where`` (``file:line``)."""
    import numpy as np

    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{where}: not UTF-8 text ({exc.reason}); the logs are plain text") from None
    line = line.rstrip("\r\n")
    if not line:
        raise TraceFormatError(f"{where}: a blank line; each line is one sequence, none may be empty")
    parts = line.split("\t\t")
    if len(parts) != 2:
        why = "no empty field" if len(parts) == 1 else f"{len(parts) - 1} empty fields"
        raise TraceFormatError(
            f"{where}: {why} between the ids and the weights; a line is the tab-separated expert ids of every token, "
            "one empty field (two tabs), then their weights"
        )
    ids_text, weights_text = parts
    ids = _numbers(ids_text, np.int64, what="an expert id", where=where, first_field=0)
    n = len(ids)
    weights = _numbers(weights_text, np.float64, what="a routing weight", where=where, first_field=n + 1)
    if n % K:
        raise TraceFormatError(
            f"{where}: {n} expert ids, not a whole number of tokens of top-{K} ({K} ids per token, token after token)"
        )
    if len(weights) != n:
        raise TraceFormatError(f"{where}: {n} expert ids but {len(weights)} weights; one weight per id")
    if not np.isfinite(weights).all():
        i = int(np.flatnonzero(~np.isfinite(weights))[0])
        raise TraceFormatError(
            f"{where}: field {n + 2 + i} (a routing weight) is {float(weights[i])!r}; weights are finite"
        )
    bad = (ids < -1) | (ids > np.iinfo(np.int16).max)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TraceFormatError(f"{where}: field {i + 1} (an expert id) is {int(ids[i])}; ids are 0..E-1 (-1: none)")
    T = n // K
    if T > MAX_REQUEST_TOKENS:
        raise TraceFormatError(f"{where}: {T:,} tokens, more than the {MAX_REQUEST_TOKENS:,} one request may have")
    return _Line(ids_TK=ids.reshape(T, K), weights_TK=weights.reshape(T, K))


def _lines(path: Path) -> list[bytes]:
    """The lines of a layer file (the final newline ends the last line; it opens no empty one)."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines and lines[-1] in (b"", b"\r"):
        lines.pop()
    return lines


def _check_layers(folder: Path, files: dict[int, Path], info: ModelInfo) -> None:
    """Refuse a folder whose layer files are not exactly ``info``'s MoE layers."""
    want, have = set(info.moe_layers), set(files)
    if want == have:
        return
    fix = (
        ""
        if info.moe_layers == model_info().moe_layers
        else f" ({info.name}'s MoE layers are {info.moe_layers[0]}..{info.moe_layers[-1]}; ESFT's logs are "
        "DeepSeek-V2-Lite's, layers 1..26: leave --model out)"
    )
    if have - want:
        extra = sorted(have - want)
        raise TraceFormatError(
            f"{folder}: expert_weights_{extra[0]}.txt is not a MoE layer of {info.name}{fix}; the file number is "
            "the model layer index"
        )
    missing = sorted(want - have)
    shown = ", ".join(f"expert_weights_{h}.txt" for h in missing[:4]) + (", ..." if len(missing) > 4 else "")
    raise TraceFormatError(
        f"{folder}: no {shown} ({len(missing)} of {info.name}'s {len(want)} MoE layers missing{fix}); "
        "every MoE layer needs its file"
    )


def _prompt_span(T_R: np.ndarray, options: ImportOptions, *, where_R: list[str]) -> np.ndarray:
    """Each sequence's prompt length (module docstring: Stages), int64 [R]."""
    import numpy as np

    if options.prompt_tokens is not None:
        short = T_R <= options.prompt_tokens
        if short.any():
            r = int(np.flatnonzero(short)[0])
            raise TraceFormatError(
                f"{where_R[r]}: a sequence of {int(T_R[r])} tokens leaves nothing to decode after --prompt-tokens "
                f"{options.prompt_tokens}; lower it, or give --prompt-fraction (it scales with each sequence)"
            )
        return np.full(len(T_R), options.prompt_tokens, dtype=np.int64)
    fraction = options.prompt_fraction if options.prompt_fraction is not None else DEFAULT_PROMPT_FRACTION
    return np.clip(np.rint(fraction * T_R), 1, np.maximum(T_R, 1)).astype(np.int64)


def _read_folder(
    folder: Path, files: dict[int, Path], *, info: ModelInfo, options: ImportOptions
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], DescribeRow]:
    """One task folder: ids int16 [T, L, K], weights float32 [T, L*K], tokens per sequence int64 [R],
    each sequence's place (``file:line`` of its first layer file) and how to name an id's row in an error."""
    import numpy as np

    L, K = info.num_moe_layers, info.top_k
    ids_TLK = weights_TLK = None
    T_R = start_R = None
    first_file = files[info.moe_layers[0]]
    where_R: list[str] = []
    for l, layer in enumerate(info.moe_layers):
        path = files[layer]
        raw_lines = _lines(path)
        if T_R is None:  # the first layer's file fixes the sequences and their lengths
            if not raw_lines:
                raise TraceFormatError(f"{path}: empty; each line is one sequence")
            parsed = [_parse_line(raw, K=K, where=f"{path}:{i + 1}") for i, raw in enumerate(raw_lines)]
            T_R = np.array([len(p.ids_TK) for p in parsed], dtype=np.int64)
            start_R = np.concatenate([[0], np.cumsum(T_R)])
            T = int(start_R[-1])
            check_allocation(
                T * L * K * 6,
                f"{folder}: {len(T_R):,} sequences of {T:,} tokens in all",
                options=options,
            )
            ids_TLK = np.empty((T, L, K), dtype=np.int16)
            weights_TLK = np.empty((T, L, K), dtype=np.float32)
            where_R = [f"{path}:{i + 1}" for i in range(len(raw_lines))]
        elif len(raw_lines) != len(T_R):
            raise TraceFormatError(
                f"{path}: {len(raw_lines)} lines, but {first_file.name} has {len(T_R)}; line i of every layer file "
                "is the same sequence"
            )
        assert ids_TLK is not None and weights_TLK is not None and start_R is not None
        for i, raw in enumerate(raw_lines):
            p = parsed[i] if l == 0 else _parse_line(raw, K=K, where=f"{path}:{i + 1}")
            if len(p.ids_TK) != T_R[i]:
                raise TraceFormatError(
                    f"{path}:{i + 1}: {len(p.ids_TK)} tokens, but line {i + 1} of {first_file.name} has {int(T_R[i])}; "
                    "line i of every layer file is the same sequence"
                )
            lo, hi = int(start_R[i]), int(start_R[i + 1])
            ids_TLK[lo:hi, l] = p.ids_TK
            weights_TLK[lo:hi, l] = p.weights_TK
        if l == 0:
            del parsed
    assert ids_TLK is not None and weights_TLK is not None and T_R is not None and start_R is not None

    def describe_row(t: int, moe: int) -> str:
        r = int(np.searchsorted(start_R, t, side="right")) - 1
        return f"{files[info.moe_layers[moe]]}:{r + 1}: token {t - int(start_R[r])}"

    return ids_TLK, weights_TLK.reshape(len(ids_TLK), L * K), T_R, where_R, describe_row


def parse(
    src: Path,
    *,
    info: ModelInfo,
    label: str,
    stages: StagesMode = "both",
    options: ImportOptions,
    with_weights: bool = True,
) -> Generator[Requests, None, Parsed]:
    """Every sequence of the ESFT logs under ``src``, one task folder per ``Requests`` (its dataset: the
    folder's name, ``label`` for ``src`` itself); progress in bytes of the logs."""
    import numpy as np

    del stages, with_weights  # always both: the prompt span splits each teacher-forced sequence; always weights
    folders = _task_folders(src)
    if not folders:
        raise TraceFormatError(f"{src}: no expert_weights_<N>.txt here or in its subfolders; not ESFT expert logs")
    layer_files = {f: _layer_files(f) for f in folders}
    for f in folders:
        _check_layers(f, layer_files[f], info)
    total = sum(p.stat().st_size for fs in layer_files.values() for p in fs.values())
    done, next_id = 0, 0
    for folder in folders:
        files = layer_files[folder]
        ids_TLK, weights_TX, T_R, where_R, describe_row = _read_folder(folder, files, info=info, options=options)
        prompt_R = _prompt_span(T_R, options, where_R=where_R)
        R = len(T_R)
        done += sum(p.stat().st_size for p in files.values())
        yield Requests(
            request_id_R=np.arange(next_id, next_id + R, dtype=np.int64),
            prompt_tokens_R=prompt_R,
            output_tokens_R=T_R - prompt_R,
            topk_ids_TLK=ids_TLK,
            dataset_R=(label if folder == src else folder.name,) * R,
            topk_weights_TX=weights_TX,
            describe_row=describe_row,
            progress=(done, total),
            flush=True,
        )
        next_id += R
    span: dict[str, Any]
    if options.prompt_tokens is not None:
        span, what = {"prompt_tokens": options.prompt_tokens}, f"the first {options.prompt_tokens} tokens"
    else:
        fraction = options.prompt_fraction if options.prompt_fraction is not None else DEFAULT_PROMPT_FRACTION
        span, what = {"prompt_fraction": fraction}, f"the first {fraction:g} of its tokens"
    notes = (
        f"teacher-forced sequences: {what} stand in for each one's prompt (prefill), the rest for its decode "
        "(--prompt-fraction F, default 0.5, or --prompt-tokens N)",
    )
    return Parsed(notes=notes, collection={"prompt_span": span}, progress_total=total)


FORMAT = ImportFormat(
    name="esft",
    help="DeepSeek ESFT expert logs: a folder of expert_weights_<layer>.txt (DeepSeek-V2-Lite), or their parent",
    detect=detect,
    parse=parse,
    options=frozenset({PROMPT_SPAN}),
    with_weights=lambda src: True,
    model=model_info,
)
