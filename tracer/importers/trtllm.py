"""Import format ``trtllm-stats``: TensorRT-LLM's expert statistics directory → a load profile.

Read from TensorRT-LLM's writer, ``tensorrt_llm/_torch/expert_statistic.py`` (``ExpertStatistic``;
read at commit 0fccc5b9 of NVIDIA/TensorRT-LLM; docs/profile.md), and its callers in the fused-MoE
modules (``ExpertStatistic.set_layer(self.layer_idx)``, ``maybe_add_info(self.num_slots, ...)``).
The PyTorch backend runs with ``EXPERT_STATISTIC_ITER_RANGE=start-stop`` and
``EXPERT_STATISTIC_PATH=DIR``; at iteration ``stop`` every rank writes into ``DIR``:

- ``meta_info.json`` (rank 0): ``{"num_experts": E, "num_experts_per_token": K}``;
- ``rank{r}.safetensors``: one int64 tensor ``[E]`` per key ``"{iteration}_{layer}"``: how many
  tokens rank r routed to each expert at that decoder layer in that iteration (``torch.bincount``
  of the selected ids, summed over the layer's calls in the iteration).

Iterations become windows (unit ``iterations``, one each, in iteration order; an iteration a rank
did not record counts zero there), ranks the profile's source ranks, their sum its counts (with
attention data parallelism each rank routes its own tokens; with attention TP every rank counts
the same tokens, so the counts are W times the tokens and the loads' shape is unchanged). With
TensorRT-LLM's load balancer on, the counts are of physical slots (``num_experts`` = slots): refused,
as ids that do not fit the model are (layers that are not MoE layers, another top-k). The files are
read with ``safetensors`` (numpy), never pickle. Like SGLang's recorder it counts prefill and decode
iterations together: ``--stages both`` gives the profile's ``mixed`` stage (``decode-only`` for a
disaggregated generation server's dump).

Detected as a directory holding ``meta_info.json`` and ``rank*.safetensors``.

Shape legend: N windows (iterations), W ranks, L MoE layers, E experts.

Out of scope: TensorRT-LLM's other dumps (the dispatch-matrix ``rank{r}_numtokens.json`` of some
forks is ignored).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from moetrace.errors import TraceFormatError
from moetrace.tracer.importers.base import ImportFormat, Progress, StagesMode
from moetrace.tracer.importers.options import ImportOptions, check_allocation

if TYPE_CHECKING:
    from moetrace.tracer.trace.profile import LoadProfile
    from moetrace.tracer.trace.schema import ModelInfo

META = "meta_info.json"
RANK_RE = re.compile(r"^rank(\d+)\.safetensors$")
KEY_RE = re.compile(r"^(\d+)_(\d+)$")
#: the most ranks and (iteration, layer) keys one import reads
MAX_RANKS = 1 << 14
MAX_KEYS = 1 << 22
#: the most counts (iterations x layers x experts) one profile of this format holds
MAX_CELLS = 1 << 27
#: the most tokens all counts together may add up to (every sum then fits int64)
MAX_TOTAL = float(1 << 62)
_STAGE = {"both": "mixed", "decode-only": "decode", "prefill-only": "prefill"}


def _rank_files(src: Path) -> dict[int, Path]:
    out: dict[int, Path] = {}
    for p in src.iterdir():
        m = RANK_RE.match(p.name)
        if m and p.is_file():
            r = int(m.group(1))
            if r in out:  # rank1 and rank01 name one rank: neither may silently replace the other
                a, b = sorted((out[r].name, p.name))
                raise TraceFormatError(f"{src}: {a} and {b} both name rank {r}; keep one of them")
            out[r] = p
    return out


def detect(head: bytes, src: Path) -> bool:
    """A directory with ``meta_info.json`` and at least one ``rank{r}.safetensors``."""
    try:
        return src.is_dir() and (src / META).is_file() and bool(_rank_files(src))
    except OSError:
        return False


def _meta(src: Path, info: ModelInfo) -> None:
    p = src / META
    from moetrace.inputs import read_input_json

    meta = read_input_json(p, max_bytes=1 << 20)  # a regular file (a pipe never blocks), bounded integers
    if not isinstance(meta, dict):
        raise TraceFormatError(
            f"{p}: expected {{'num_experts': E, 'num_experts_per_token': K}}, got {meta!r:.80} (rank 0 recorded nothing?)"
        )
    E, K = meta.get("num_experts"), meta.get("num_experts_per_token")
    if E != info.num_experts:
        raise TraceFormatError(
            f"{p}: num_experts {E!r}, model {info.name!r} has {info.num_experts}; with TensorRT-LLM's load balancer "
            "on, the statistics count physical slots, not logical experts: record without it, or check --model"
        )
    if K != info.top_k:
        raise TraceFormatError(f"{p}: num_experts_per_token {K!r}, model {info.name!r} routes top-{info.top_k}")


def read_profile(
    src: Path,
    *,
    info: ModelInfo,
    label: str | None,
    stages: StagesMode,
    progress: Progress | None,
    options: ImportOptions | None = None,
) -> LoadProfile:
    """The load profile of one TensorRT-LLM expert statistics directory (module docstring)."""
    import numpy as np

    from moetrace._deps import require
    from moetrace.tracer.trace.profile import LoadProfile, Window

    st = require("safetensors", purpose="reading TensorRT-LLM's expert statistics (rank*.safetensors)")
    if not src.is_dir():
        raise TraceFormatError(f"{src}: TensorRT-LLM's expert statistics are a directory (EXPERT_STATISTIC_PATH)")
    _meta(src, info)
    files = _rank_files(src)
    W = max(files) + 1 if files else 0
    missing = sorted(set(range(W)) - set(files))
    if not files or missing or W > MAX_RANKS:
        raise TraceFormatError(
            f"{src}: rank files rank0..rank{W - 1}.safetensors expected, missing {missing[:5] or 'all'}"
            if W <= MAX_RANKS
            else f"{src}: more than {MAX_RANKS} ranks"
        )
    ordinal = {layer: i for i, layer in enumerate(info.moe_layers)}
    L, E = info.num_moe_layers, info.num_experts
    cells: dict[tuple[int, int, int], np.ndarray] = {}  # (rank, iteration, MoE ordinal) -> [E]
    total = 0.0  # every count read so far (a float: the bound is checked, never the exact sum)
    for done, r in enumerate(sorted(files)):
        f = files[r]
        try:
            with st.safe_open(str(f), framework="numpy") as h:
                keys = list(h.keys())
                if len(cells) + len(keys) > MAX_KEYS:
                    raise TraceFormatError(f"{src}: more than {MAX_KEYS:,} (iteration, layer) records")
                for key in keys:
                    m = KEY_RE.match(key)
                    if m is None:
                        raise TraceFormatError(f"{f}: tensor {key[:40]!r} is not named '<iteration>_<layer>'")
                    it, layer = int(m.group(1)), int(m.group(2))
                    if layer not in ordinal:
                        raise TraceFormatError(
                            f"{f}: {key!r} counts layer {layer}, which is not a MoE layer of model {info.name!r} "
                            f"(MoE layers {list(info.moe_layers)[:6]}...): wrong --model?"
                        )
                    a = h.get_tensor(key)
                    if a.dtype.kind not in "iu" or a.shape != (E,):
                        raise TraceFormatError(
                            f"{f}: {key!r} is {a.dtype} {a.shape}, expected whole counts of the {E} experts"
                        )
                    if a.size and int(a.min()) < 0:
                        raise TraceFormatError(f"{f}: {key!r} holds a negative count")
                    # every count non-negative: no partial sum exceeds the grand total, kept below 2**62 (int64)
                    total += float(a.sum(dtype=np.float64))
                    if total >= MAX_TOTAL:
                        raise TraceFormatError(
                            f"{f}: {key!r}: the counts add up to 2**62 or more tokens, past what a profile's "
                            "totals hold; the file is damaged"
                        )
                    cells[(r, it, ordinal[layer])] = a.astype(np.int64)
        except TraceFormatError:
            raise
        except Exception as exc:  # safetensors raises its own errors (SafetensorError, ...) for damaged files
            raise TraceFormatError(
                f"{f}: not a readable safetensors file ({type(exc).__name__}: {str(exc)[:160]})"
            ) from None
        if progress is not None:
            progress(done + 1, len(files))
    if not cells:
        raise TraceFormatError(f"{src}: the rank files hold no counts (was EXPERT_STATISTIC_ITER_RANGE reached?)")
    iters = sorted({it for _, it, _ in cells})
    col = {it: i for i, it in enumerate(iters)}
    N = len(iters)
    if N * L * E > MAX_CELLS:
        raise TraceFormatError(
            f"{src}: {N:,} iterations x {L} layers x {E} experts: more than the {MAX_CELLS:,} counts one profile "
            "holds; record fewer iterations (EXPERT_STATISTIC_ITER_RANGE)"
        )
    # the windows' and the ranks' counts, summed as they are placed (never a [ranks, iterations, ...] array: a
    # few files naming many ranks and iterations would ask for W times the profile), and the profile's copies
    check_allocation(
        (N + W) * L * E * 8 * 2,
        f"{src}: {W} ranks, {N:,} iterations x {L} layers x {E} experts",
        options=options,
        kind="counts",
    )
    counts = np.zeros((N, L, E), np.int64)
    per_WLE = np.zeros((W, L, E), np.int64)
    for (r, it, l), a in cells.items():
        counts[col[it], l] += a
        per_WLE[r, l] += a
    stage = _STAGE[stages]
    return LoadProfile(
        model=info,
        counts={stage: counts},
        window_tokens=Window(unit="iterations", size=1) if N > 1 else None,
        datasets=None if label is None else {stage: {label: counts.sum(axis=0)}},
        ranks={stage: per_WLE},
        source={
            "source_format": "trtllm-stats",
            "source_file": src.name,  # the directory's name only
            "iterations": [iters[0], iters[-1]],
            "num_iterations": N,
        },
    )


FORMAT = ImportFormat(
    name="trtllm-stats",
    help="TensorRT-LLM expert statistics directory (EXPERT_STATISTIC_PATH: meta_info.json, rank*.safetensors): a load profile",
    detect=detect,
    read=None,
    stages_modes=True,
    produces="profile",
    read_profile=read_profile,
)
