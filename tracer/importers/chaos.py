"""Import format ``chaos``: the expert-selection traces of "Patterns behind Chaos" (per request, per step).

Source: the profiling traces published with Yu et al., "Patterns behind Chaos: Forecasting Data
Movement for Efficient Large-Scale MoE LLM Inference" (arXiv 2510.05497; first titled "Orders in
Chaos"), Hugging Face dataset ``core12345/MoE_expert_selection_trace``: DeepSeek-R1, Llama-4-Maverick,
Qwen3-235B (and Kimi-K2) served by SGLang on MMLU, HellaSwag, LiveCodeBench and other benchmarks,
``profiling_result/<org>/<model>/<benchmark>/<subject>/<n>.json``. The dataset is gated; a public
subset of its Llama-4-Maverick MMLU files is checked in at andronius-yang/cse223b-proj
(``traffic-gen/llama4-mmlu-{abstract_algebra,anatomy,astronomy}/<n>.json``, 387 requests), which is
what this reader was built against. Neither states a licence: read them where they are, never copy
them into a repository.

The file, as read in those files:

- one JSON file per request: a list of steps, in the order the engine ran them;
- a step is an object keyed by the model's layer index as a string (``"0"`` .. ``"47"`` for
  Llama-4-Maverick): a dense layer's value is ``null``; a MoE layer's is a list with one entry per
  token the step computed, each entry the token's routed expert ids (``top_k`` of them; Llama-4's
  one id is ``[17]``);
- step 0 is the request's prefill (every prompt token the step computed: 4..41 in the public
  subset); every later step is one decode step of one token (128 in the public subset).

Input: a directory whose folders (itself, or any folder below it) hold ``<n>.json`` files; each such
folder's requests form one dataset, named by its path below the input (``llama4-mmlu-anatomy``,
``mmlu/anatomy``), or by ``--dataset`` when the input is that folder itself; or a single ``<n>.json``
file (one request). Requests come out folder by folder (sorted by path), each folder's files in the
order of ``n``; the held-out requests of ``compare`` therefore arrive grouped by subject.

The model is not named in the files: ``--model`` is needed (``llama4-maverick``, ``deepseek-v3``
for R1, ``qwen3-235b-a22b``). Its layers are checked: every MoE layer has a list in every step,
every other layer is ``null`` or absent, no key outside the model's layers, ``top_k`` ids per token.

Errors name the file and step: a file that is not a list of steps, a step that is not an object, a
MoE layer without its list, a layer key the model does not have, a token's entry that is not a
list of ``top_k`` whole numbers, MoE layers of one step with different token counts, a decode step
of more than one token, an empty prefill.

Shape legend: T tokens, L MoE layers, K top-k (legend: docs/architecture.md).

Out of scope: the dataset's analysis and top-expert companions (aggregates the trace recomputes),
request text (the files hold none), routing weights (the files hold none).
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace.errors import TraceFormatError
from moetrace.inputs import read_input_json
from moetrace.tracer.importers.base import ImportFormat, Parsed, Requests, StagesMode
from moetrace.tracer.importers.jsonl import MAX_REQUEST_BYTES, MAX_REQUEST_TOKENS
from moetrace.tracer.importers.options import ImportOptions, check_allocation

if TYPE_CHECKING:  # numpy and the schema (pyarrow) load when a capture is read, so `moetrace --help` stays light
    import numpy as np

    from moetrace.tracer.trace.schema import ModelInfo

#: a request file's name; the number orders the requests of a folder
REQUEST_FILE = re.compile(r"^(\d+)\.json$")
#: how a request file starts: a list whose first step is an object keyed by a layer index
HEAD = re.compile(rb'^\s*\[\s*\{\s*"\d+"\s*:')
#: requests gathered before they are handed to the writer (one folder's, at most this many at a time)
BATCH_REQUESTS = 256


def _request_files(folder: Path) -> list[Path]:
    """The ``<n>.json`` files of ``folder``, in the order of ``n``."""
    found = []
    with os.scandir(folder) as it:
        for e in it:
            m = REQUEST_FILE.match(e.name)
            if m is not None and e.is_file(follow_symlinks=False):
                found.append((int(m[1]), Path(e.path)))
    return [p for _, p in sorted(found)]


def _folders(src: Path) -> list[tuple[Path, list[Path]]]:
    """``src`` and every folder below it that holds request files, each with its files, sorted by path
    (symlinks not followed)."""
    out = []
    for root, dirs, _ in os.walk(src):
        dirs.sort()
        if files := _request_files(Path(root)):
            out.append((Path(root), files))
    return sorted(out, key=lambda f: f[0].relative_to(src).parts)


def _looks_like_request(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return HEAD.match(f.read(256)) is not None
    except OSError:
        return False


def detect(head: bytes, src: Path) -> bool:
    """A ``<n>.json`` file (or a directory holding them, at any depth) whose text opens a list of steps
    keyed by layer index (``[{"0": ...``)."""
    try:
        if src.is_file():
            return REQUEST_FILE.match(src.name) is not None and HEAD.match(head) is not None
        if not src.is_dir():
            return False
        for root, dirs, _ in os.walk(src):
            dirs.sort()
            files = _request_files(Path(root))
            if files:
                return _looks_like_request(files[0])
    except OSError:
        return False
    return False


def _token_ids(entry: Any, *, K: int, where: str) -> np.ndarray:
    """One MoE layer of one step: its tokens' ids, int64 [T, K]; ``TraceFormatError`` naming ``where``."""
    import numpy as np

    if not isinstance(entry, list):
        raise TraceFormatError(f"{where}: {type(entry).__name__}, not a list of the step's tokens (each a list of ids)")
    for t, tok in enumerate(entry):
        if not isinstance(tok, list) or len(tok) != K or not all(type(i) is int for i in tok):
            raise TraceFormatError(
                f"{where}: token {t} is {str(tok)[:60]}, not a list of {K} whole numbers (the model's top-{K} ids); "
                "check --model"
            )
    try:
        return np.asarray(entry, dtype=np.int64).reshape(len(entry), K)
    except OverflowError:
        raise TraceFormatError(f"{where}: an expert id beyond 64 bits; ids are 0..E-1") from None


def parse_request(steps: Any, *, info: ModelInfo, where: str) -> tuple[int, np.ndarray]:
    """One request file's steps (module docstring): its prompt tokens and its ids int16 [T, L, K]
    (the prefill's tokens, then one per decode step)."""
    import numpy as np

    if not isinstance(steps, list) or not steps:
        raise TraceFormatError(f"{where}: not a list of steps (the prefill, then one object per decode step)")
    layers = {str(layer): l for l, layer in enumerate(info.moe_layers)}
    known = {str(i) for i in range(info.num_hidden_layers)}
    K = info.top_k
    rows: list[np.ndarray] = []
    for s, step in enumerate(steps):
        at = f"{where}: step {s}"
        if not isinstance(step, dict):
            raise TraceFormatError(f"{at} is {type(step).__name__}, not an object keyed by layer index")
        for key, value in step.items():
            if key not in known:
                raise TraceFormatError(
                    f"{at}: layer {key!r}, but {info.name} has layers 0..{info.num_hidden_layers - 1}; check --model"
                )
            if key not in layers and value is not None:
                raise TraceFormatError(
                    f"{at}: layer {key} routes tokens, but it is not a MoE layer of {info.name}; check --model"
                )
        per_layer = []
        for key in layers:
            if step.get(key) is None:
                raise TraceFormatError(
                    f"{at}: MoE layer {key} of {info.name} has no tokens (null or absent); every MoE layer routes every "
                    "step: check --model is the capture's model"
                )
            per_layer.append(_token_ids(step[key], K=K, where=f"{at}, layer {key}"))
        counts = {len(a) for a in per_layer}
        if len(counts) > 1:
            raise TraceFormatError(
                f"{at}: MoE layers route {sorted(counts)} tokens; every layer sees the step's tokens"
            )
        (n,) = counts
        if s == 0 and n == 0:
            raise TraceFormatError(f"{at}: the prefill routes no token")
        if s > 0 and n != 1:
            raise TraceFormatError(
                f"{at}: {n} tokens; after step 0 (the prefill) every step decodes one token of the request"
            )
        rows.append(np.stack(per_layer, axis=1))  # [n, L, K]
    ids_TLK = np.concatenate(rows)
    if len(ids_TLK) > MAX_REQUEST_TOKENS:
        raise TraceFormatError(
            f"{where}: {len(ids_TLK):,} tokens, more than the {MAX_REQUEST_TOKENS:,} one request may have"
        )
    bad = (ids_TLK < -1) | (ids_TLK > np.iinfo(np.int16).max)
    if bad.any():
        raise TraceFormatError(f"{where}: expert id {int(ids_TLK[bad][0])}; ids are 0..E-1")
    return len(rows[0]), ids_TLK.astype(np.int16)


def parse(
    src: Path,
    *,
    info: ModelInfo,
    label: str,
    stages: StagesMode = "both",
    options: ImportOptions,
    with_weights: bool = False,
) -> Generator[Requests, None, Parsed]:
    """Every request file under ``src`` (module docstring), a folder's requests at most ``BATCH_REQUESTS``
    per ``Requests``; progress in bytes of the files."""
    import numpy as np

    del stages, with_weights  # the files always hold both stages and never weights
    if src.is_file():
        groups = [(src.parent, [src], label)]
    else:
        groups = [(f, files, label if f == src else "/".join(f.relative_to(src).parts)) for f, files in _folders(src)]
        if not groups:
            raise TraceFormatError(f"{src}: no <n>.json request files here or below; not expert-selection traces")
    size = {p: p.stat().st_size for _, files, _ in groups for p in files}
    total = sum(size.values())
    done, next_id = 0, 0
    L, K = info.num_moe_layers, info.top_k
    for _, files, dataset in groups:
        for lo in range(0, len(files), BATCH_REQUESTS):
            chunk = files[lo : lo + BATCH_REQUESTS]
            prompt_R, ids = [], []
            for path in chunk:
                steps = read_input_json(path, max_bytes=MAX_REQUEST_BYTES)
                p, ids_TLK = parse_request(steps, info=info, where=str(path))
                prompt_R.append(p)
                ids.append(ids_TLK)
                done += size[path]
            T_R = np.array([len(a) for a in ids], dtype=np.int64)
            check_allocation(int(T_R.sum()) * L * K * 2 * 2, f"{len(chunk)} requests of {dataset}", options=options)
            R = len(chunk)
            names = [p.name for p in chunk]
            starts = np.concatenate([[0], np.cumsum(T_R)])

            def describe_row(t: int, moe: int, *, names: list[str] = names, starts: np.ndarray = starts) -> str:
                r = int(np.searchsorted(starts, t, side="right")) - 1
                return f"{names[r]}: token {t - int(starts[r])}, layer {info.moe_layers[moe]}"

            yield Requests(
                request_id_R=np.arange(next_id, next_id + R, dtype=np.int64),
                prompt_tokens_R=np.array(prompt_R, dtype=np.int64),
                output_tokens_R=T_R - np.array(prompt_R, dtype=np.int64),
                topk_ids_TLK=np.concatenate(ids),
                dataset_R=(dataset,) * R,
                describe_row=describe_row,
                progress=(done, total),
                flush=True,
            )
            next_id += R
    notes = (
        "step 0 of each request file is its prefill (the prompt tokens the engine computed), every later step "
        "one decode token",
    )
    return Parsed(notes=notes, collection={"steps": "prefill then one decode token per step"}, progress_total=total)


FORMAT = ImportFormat(
    name="chaos",
    help='"Patterns behind Chaos" expert-selection traces: <n>.json per request (steps of layer -> ids), or their folders',
    detect=detect,
    parse=parse,
)
