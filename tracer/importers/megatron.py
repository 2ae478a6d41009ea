"""Import format ``megatron-router``: Megatron-Core router traces (``--moe-routing-trace-path``).

Read from ``megatron/core/transformer/moe/router_trace.py`` (NVIDIA/Megatron-LM, tag
``core_v0.19.0``): training or inference started with ``--moe-routing-trace-path DIR`` writes one
``router_trace_rank{N}.jsonl`` per rank into ``DIR``, one line per (step, block, layer):
``{"step", "stage": "pre_dispatch", "block": "decoder" | "mtp", "layer", "rank", "num_tokens",
"topk", "top_indices": [[...] x topk] x num_tokens}`` (``mtp_idx`` on MTP records; ``hs_offset`` /
``logit_offset`` ... when the hidden-state or logits sidecars ``hidden_states_rank{N}.bin`` /
``logits_rank{N}.bin`` were captured). A step is a training iteration (the loop calls ``advance_step``) or, in
inference, one forward pass (a layer seen again starts the next step, or the engine calls ``advance_step``).

Layer numbering: two writers fill ``layer`` differently, and no field of the record says which.

- The forward hooks (``register_hooks``: training, and inference without routing replay) write the index in
  ``decoder.layers`` parsed from the router's module name (``_parse_router_module_name``): numbered from 0,
  the model layer index without pipeline parallelism (with it, the index is local to the stage, so such
  captures do not import).
- Inference with routing replay (``moe_enable_routing_replay``) hands the engine's recorded indices to
  ``RouterTracer.record_indices`` from ``TextGenerationController`` (``megatron/core/inference/
  text_generation_controllers/text_generation_controller.py``, same tag) with ``layer_ids`` = each
  ``RouterReplay``'s ``layer_number``: ``TransformerLayer.layer_number``, numbered from 1 (``build_layer(...,
  i + 1)`` in ``transformer_block.py``; global, the pipeline offset included).

So the numbering is read from the layers themselves: the decoder layers of each rank file's first step are
the model's MoE layers (numbered from 0) or those plus one (numbered from 1); the two sets never coincide for
a whole step, and the numbering under which more of them are MoE layers is read (from 0 on a tie, as a part
of a step that fits both is). Which one was read is said in the notes and kept as
``collection.layer_numbering``.

Input: the directory (every ``router_trace_rank*.jsonl`` in it, merged by step: requests come out
in (step, rank) order), or one rank's file. Records of the ``mtp`` block (multi-token-prediction
heads, not layers of ``--model``) are skipped and counted in the notes; the sidecars are not read
(the ids are in the JSONL).

Requests: the records carry no request ids and no stage, so **each forward pass of each rank
becomes one request** (``collection.request_unit: "forward pass"``) of prefill-stage tokens (the
manifest's ``collection.stages`` is ``["prefill"]``): the k-th record of a layer in a (rank, step)
belongs to the k-th pass of that step (training micro-batches), and every layer of a pass must
carry the same ``num_tokens``. Loads, ``analyze``'s load analyses, ``compare``/``place`` with
ungrouped strategies and ``export`` are meaningful on such a trace; per-request analyses and
grouped strategies see passes, not requests. Ranks that recorded identical ids for the same pass
(tensor parallelism: every rank routes the same tokens) are refused: import one rank's file.

Ids are the router's top-k (logical experts); ``--physical-map`` converts physical ones when a
custom router recorded those. Checked against the model (``ids.check_ids``).

Shape legend: N tokens of a pass, L MoE layers, K top-k (legend: docs/architecture.md).

Out of scope: the sidecars (hidden states, logits, ``router_state_rank{N}.pt``), pipeline-parallel
captures (hooks: stage-local layer indices; routing replay: each stage records its own layers, so a pass
is split over ranks), activation recomputation (a recomputed forward records again: capture without it),
``record_indices`` without ``layer_ids`` (MoE ordinals 0..L-1, where ``layer_number`` was never set).
"""

from __future__ import annotations

import hashlib
import heapq
import re
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace.errors import TraceFormatError
from moetrace.tracer.importers.base import ImportFormat, Parsed, Requests, StagesMode
from moetrace.tracer.importers.jsonl import MAX_REQUEST_TOKENS, check_utf8, first_object, iter_json_lines, whole
from moetrace.tracer.importers.options import PHYSICAL_MAP, ImportOptions, check_allocation

if TYPE_CHECKING:
    import numpy as np

    from moetrace.tracer.trace.schema import ModelInfo

#: a rank's file name
RANK_FILE = re.compile(r"^router_trace_rank(\d+)\.jsonl$")
#: the keys that make a record one of the router tracer's
KEYS = {"step", "layer", "rank", "top_indices"}
#: passes per ``add_requests`` call
BATCH_PASSES = 256
#: how each numbering of ``layer`` is named in the notes and ``collection.layer_numbering``
NUMBERING = {
    0: "from 0 (decoder.layers index: the router tracer's forward hooks, training and inference)",
    1: "from 1 (TransformerLayer.layer_number: inference with routing replay, RouterTracer.record_indices)",
}
#: records of a rank file's first step the numbering is read from, at most
_NUMBERING_RECORDS = 1 << 16


def _first_step_layers(path: Path) -> set[int]:
    """The decoder-block ``layer`` values of ``path``'s first step (records that do not parse are left to
    ``_passes``, which names them)."""
    layers: set[int] = set()
    step: Any = None
    try:
        for n, (_, rec) in enumerate(iter_json_lines(path)):
            if n >= _NUMBERING_RECORDS or not isinstance(rec, dict):
                break
            if step is not None and rec.get("step") != step:
                break
            step = rec.get("step")
            if rec.get("block", "decoder") == "mtp" or "mtp_idx" in rec:
                continue
            layer = rec.get("layer")
            if isinstance(layer, int) and not isinstance(layer, bool):
                layers.add(layer)
    except TraceFormatError:
        pass
    return layers


def layer_numbering(files: list[Path], info: ModelInfo) -> tuple[int, bool]:
    """Where ``layer`` counts from (0 or 1, module docstring) and whether both fitted (read as 0), from the
    first step of every rank file: the numbering under which more of its layers are MoE layers (0 on a tie)."""
    seen: set[int] = set()
    for f in files:
        seen |= _first_step_layers(f)
    from_0 = set(info.moe_layers)
    from_1 = {layer + 1 for layer in info.moe_layers}
    if len(seen & from_1) > len(seen & from_0):
        return 1, False
    return 0, bool(seen) and seen <= from_0 and seen <= from_1 and seen != from_0


def _rank_files(src: Path) -> list[Path]:
    """The rank files of a directory in rank order, or ``[src]`` for a file."""
    if not src.is_dir():
        return [src]
    found = ((m, p) for p in src.iterdir() if (m := RANK_FILE.match(p.name)) is not None)
    return [p for _, p in sorted(found, key=lambda mp: int(mp[0][1]))]


def detect(head: bytes, src: Path) -> bool:
    """A directory holding ``router_trace_rank*.jsonl`` files, or a JSON-lines file whose first record has
    ``step``, ``layer``, ``rank`` and ``top_indices``."""
    if src.is_dir():
        files = _rank_files(src)
        if not files or not files[0].is_file():
            return False
        with open(files[0], "rb") as f:
            first = first_object(f.read(1 << 16), files[0])
    else:
        first = first_object(head, src)
    return first is not None and KEYS <= set(first)


def precheck(src: Path) -> None:
    """Every rank file is a regular file of UTF-8 text."""
    files = _rank_files(src)
    if not files:
        raise TraceFormatError(f"{src}: no router_trace_rank*.jsonl files in the directory")
    for f in files:
        if not f.is_file():
            raise TraceFormatError(f"{f}: not a regular file")
        check_utf8(f)


#: one pass: (step, rank, micro-batch, where, ids [N, L, K] or None per layer)
Pass = tuple[int, int, int, str, list[Any]]


def _passes(path: Path, info: ModelInfo, skipped: list[int], base: int = 0) -> Iterator[Pass]:
    """The passes of one rank file in step order; ``skipped[0]`` counts the MTP records passed over; ``layer``
    counts from ``base`` (``layer_numbering``)."""
    import numpy as np

    L, K = info.num_moe_layers, info.top_k
    ordinal = {layer: i for i, layer in enumerate(info.moe_layers)}
    step: int | None = None
    rank: int | None = None
    by_layer: list[list[tuple[str, np.ndarray]]] = [[] for _ in range(L)]

    def emit() -> Iterator[Pass]:
        count = max((len(x) for x in by_layer), default=0)
        for m in range(count):
            layers = [x[m] if m < len(x) else None for x in by_layer]
            where = next(w for w in (x[0] if x else None for x in layers) if w is not None)
            sizes = {len(x[1]) for x in layers if x is not None}
            if len(sizes) > 1:
                raise TraceFormatError(
                    f"{where}: step {step}, rank {rank}, pass {m}: layers carry different num_tokens "
                    f"({sorted(sizes)}); every layer of a forward pass routes the same tokens"
                )
            yield step or 0, rank or 0, m, where, [x[1] if x is not None else None for x in layers]
        for x in by_layer:
            x.clear()

    for n, rec in iter_json_lines(path):
        where = f"{path}:{n}"
        if not isinstance(rec, dict) or not KEYS <= set(rec):
            raise TraceFormatError(f"{where}: not a router-trace record (needs {sorted(KEYS)})")
        try:
            s = whole(rec["step"], "step", high=2**62)
            r = whole(rec["rank"], "rank", high=1 << 20)
            layer = whole(rec["layer"], "layer", high=1 << 20)
        except TraceFormatError as exc:
            raise TraceFormatError(f"{where}: {exc}") from None
        if rec.get("block", "decoder") == "mtp" or "mtp_idx" in rec:
            skipped[0] += 1
            continue
        if rec.get("block", "decoder") != "decoder" or rec.get("stage", "pre_dispatch") != "pre_dispatch":
            raise TraceFormatError(
                f"{where}: block {rec.get('block')!r}, stage {rec.get('stage')!r}; the router tracer writes block "
                "'decoder' or 'mtp' and stage 'pre_dispatch'"
            )
        if rank is not None and r != rank:
            raise TraceFormatError(f"{where}: rank {r} in the file of rank {rank}; one rank per file")
        if step is not None and s < step:
            raise TraceFormatError(f"{where}: step {s} after step {step}; the tracer writes steps in order")
        if step is not None and s != step:
            yield from emit()
        step, rank = s, r
        if layer - base not in ordinal:
            first, last = info.moe_layers[0] + base, info.moe_layers[-1] + base
            hint = (
                f"; the layers look like MoE ordinals 0..{L - 1}, which this importer does not read"
                if layer < L and base == 0
                else ""
            )
            raise TraceFormatError(
                f"{where}: layer {layer} is not a MoE layer of {info.name} (read as numbered {NUMBERING[base]}: "
                f"its MoE layers are {first}..{last}){hint}. Wrong --model, or a capture of part of the model "
                "(pipeline parallelism: each stage records its own layers, the hooks' indices local to the stage)"
            )
        layer -= base
        if "topk" in rec and rec["topk"] != K:
            raise TraceFormatError(f"{where}: topk {rec['topk']!r}; {info.name} has top-k {K}")
        top = rec["top_indices"]
        if not isinstance(top, list) or len(top) > MAX_REQUEST_TOKENS:
            raise TraceFormatError(f"{where}: `top_indices` must be a list of at most {MAX_REQUEST_TOKENS:,} tokens")
        if "num_tokens" in rec and rec["num_tokens"] != len(top):
            raise TraceFormatError(f"{where}: num_tokens {rec['num_tokens']!r} but {len(top)} rows of top_indices")
        if not all(isinstance(row, list) and len(row) == K for row in top):
            raise TraceFormatError(f"{where}: every row of `top_indices` must hold {K} ids (top-k of {info.name})")
        try:
            ids = np.array(top, dtype=np.int64).reshape(len(top), K)
        except (ValueError, TypeError, OverflowError):
            raise TraceFormatError(f"{where}: `top_indices` must hold whole numbers") from None
        if (ids < -1).any() or (ids > np.iinfo(np.int16).max).any():
            raise TraceFormatError(f"{where}: an id outside -1..{np.iinfo(np.int16).max}")
        by_layer[ordinal[layer]].append((where, ids))
    if step is not None:
        yield from emit()


def parse(
    src: Path,
    *,
    info: ModelInfo,
    label: str,
    stages: StagesMode = "both",
    options: ImportOptions,
    with_weights: bool = False,
) -> Generator[Requests, None, Parsed]:
    """Every forward pass of every rank file in ``src``, one request of prefill tokens each (module docstring)."""
    import numpy as np

    del label, stages, with_weights  # passes carry one stage and no weights; the label is every request's
    L, K = info.num_moe_layers, info.top_k
    files = _rank_files(src)
    skipped = [0]
    base, both_fit = layer_numbering(files, info)
    merged = heapq.merge(*(_passes(f, info, skipped, base) for f in files), key=lambda p: (p[0], p[1], p[2]))
    rid = 0
    ranks: set[int] = set()
    seen_step: tuple[int, int] | None = None
    fingerprints: dict[bytes, str] = {}
    for step, rank, micro, where, layers in merged:
        if seen_step is None or seen_step[0] != step:
            fingerprints.clear()  # identical ids are looked for among the ranks of one step
        seen_step = (step, rank)
        N = next(len(x) for x in layers if x is not None)
        if N == 0:
            continue
        check_allocation(N * L * K * 8, f"{where}: a pass of {N:,} tokens", options=options)
        ids_NLK = np.full((N, L, K), -1, dtype=np.int64)
        for i, x in enumerate(layers):
            if x is not None:
                ids_NLK[:, i] = x
        key = hashlib.blake2b(ids_NLK.tobytes() + micro.to_bytes(4, "little"), digest_size=16).digest()
        if key in fingerprints:
            raise TraceFormatError(
                f"{where}: rank {rank} recorded the same ids as {fingerprints[key]} for step {step}: ranks that route "
                "the same tokens (tensor parallelism) record each pass once per rank; import one rank's file"
            )
        fingerprints[key] = f"rank {rank}"

        def describe(t: int, moe: int, w: str = where, s: int = step, r: int = rank) -> str:
            return f"{w} (step {s}, rank {r}), token {t}, layer {info.moe_layers[moe]}"

        ranks.add(rank)
        yield Requests(
            request_id_R=np.array([rid], dtype=np.int64),
            prompt_tokens_R=np.array([N]),
            output_tokens_R=np.zeros(1, dtype=np.int64),
            topk_ids_TLK=ids_NLK,
            describe_row=describe,
        )
        rid += 1
    if rid == 0:
        raise TraceFormatError(f"{src}: no decoder-layer records with tokens")
    notes = [
        "no request ids or stages in router traces: each forward pass of each rank is one request of prefill tokens"
    ]
    if base == 1:
        notes.append(f"layers numbered {NUMBERING[1]}: layer N is model layer N - 1")
    elif both_fit:
        notes.append(
            "the first step's layers fit both numberings (from 0 and from 1; part of a step): read as numbered "
            f"{NUMBERING[0]}"
        )
    if skipped[0]:
        notes.append(f"{skipped[0]} record(s) of MTP heads skipped (not layers of {info.name})")
    return Parsed(
        notes=tuple(notes),
        collection={
            "stages": ["prefill"],
            "request_unit": "forward pass",
            "source_ranks": sorted(ranks),
            "layer_numbering": f"from {base}",
        },
        progress_total=sum(f.stat().st_size for f in files),  # passes merge across files: one report, at the end
    )


FORMAT = ImportFormat(
    name="megatron-router",
    help="Megatron-Core router traces: the directory of router_trace_rank*.jsonl files, or one of them",
    detect=detect,
    precheck=precheck,
    parse=parse,
    batch_requests=BATCH_PASSES,
    options=frozenset({PHYSICAL_MAP}),
)
