"""Import format ``sglang-dump``: SGLang's expert-distribution recorder in ``per_token`` mode (``.pt`` dumps).

Read from ``python/sglang/srt/eplb/expert_distribution.py`` (sgl-project/sglang, commit
02295fe5ac5c; no release tag pinned): a server started with ``--expert-distribution-recorder-mode per_token``
records between ``/start_expert_distribution_record`` and ``/stop_expert_distribution_record``;
``/dump_expert_distribution_record`` makes every rank write
``expert_distribution_recorder_{time}_{rank}.pt`` into ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``
(``torch.save`` of ``{"records": [...], "last_physical_to_logical_map": int [layers, slots]}``).
Each record is one forward pass of one rank: ``forward_pass_id``, ``rank``, ``input_ids``,
``positions``, ``extend_seq_lens``, ``forward_mode`` (SGLang's ``ForwardMode``: 1 extend, 2 decode,
3 mixed, 4 idle) and ``topk_ids_of_layer`` (int32 ``[layers, tokens, 8]``: the physical slot ids each
token was sent to, ``-1`` where nothing was recorded; SGLang keeps 8 columns, DeepSeek-V3's top-k, so
a model of smaller top-k leaves the rest ``-1``). The layer axis is SGLang's ``num_layers`` (all
decoder layers for DeepSeek; dense layers stay ``-1``) or the MoE layers.

Input: one such ``.pt``, or a directory of them (one per rank). Loaded only with
``torch.load(weights_only=True)`` (tensors, lists, numbers, strings: no code runs), after the sizes
its zip declares are checked against the memory budget.

Ids: physical slots, converted with the dump's own ``last_physical_to_logical_map`` (the map in
force when it was dumped: an EPLB rebalance during the recording makes earlier passes convert with
the later map, said in the notes), or ``--physical-map FILE``, which takes precedence.

Requests: the dump has no request ids (SGLang's ``rids`` field is commented out at that commit), so
**each forward pass of each rank becomes one request** (``collection.request_unit: "forward
pass"``): an extend (prefill) pass is a request whose prompt is the pass's tokens; a decode pass is
a request of one unrecorded prompt row and the pass's tokens as decode (``prompt_lengths_known:
false``); a mixed pass (chunked prefill with decode) counts as prefill (said in the notes); idle
passes hold no tokens and are skipped; other modes (speculative decoding) are refused. Loads per
stage, ``analyze``'s load analyses, ``compare``/``place`` with ungrouped strategies and ``export``
are meaningful on such a trace; per-request analyses and grouped strategies see passes, not requests.
Ranks that recorded the same pass (tensor parallelism without DP attention: every rank sees every
token) are refused in a directory: import one rank's file. The same pass means the same ``forward_pass_id``
with the same ``input_ids``, ``positions``, ``extend_seq_lens`` and routed ids (``topk_ids_of_layer``): the
record holds no request ids (``rids`` is commented out in ``_DetailSinglePassGatherer.on_forward_pass_start``,
still so in SGLang 0.5.23), and ``input_ids`` alone would take two DP-attention ranks whose one-request decode
passes emit the same token for tensor-parallel copies; their positions and routed experts differ.

``per_pass`` dumps (counts per pass, no per-token ids) are not detected as this format and, named with
``--format sglang-dump``, refused with where their loads go (``sglang-pass``, a load profile).

Shape legend: H layers of the dump's layer axis, L MoE layers, N tokens of a pass, K top-k,
P physical slots (legend: docs/architecture.md).

Out of scope: ``stat`` / ``stat_approx`` dumps (loads only: ``sglang-stat``), the ``misc_objects``
of DeepEP dispatches, ``global_physical_count`` (the ids give it).
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace._deps import require
from moetrace.errors import TraceFormatError
from moetrace.tracer.importers.base import ImportFormat, Parsed, Requests, StagesMode
from moetrace.tracer.importers.ids import physical_map_from_array
from moetrace.tracer.importers.options import PHYSICAL_MAP, ImportOptions, check_allocation
from moetrace.tracer.importers.sglang_pt import check_tensor, dump_files, load_dump, pickle_head, record_int

if TYPE_CHECKING:
    import numpy as np

    from moetrace.tracer.trace.schema import ModelInfo

#: SGLang's ForwardMode values (IntEnum of auto(): stable for these four across releases)
EXTEND, DECODE, MIXED, IDLE = 1, 2, 3, 4
#: the top-k columns SGLang's per-token gatherer keeps (``_DetailSinglePassGatherer._TOP_K_NUM``)
SGLANG_TOPK_COLUMNS = 8
#: passes per ``add_requests`` call
BATCH_PASSES = 256


def _is_dump(head: bytes) -> bool:
    # ``input_ids``: the per-token record's fourth key, which per_pass records (``sglang-pass``) do not hold
    return b"forward_pass_id" in head and b"gatherer_key" in head and b"input_ids" in head


def detect(head: bytes, src: Path) -> bool:
    """A torch ``.pt`` (a zip) whose pickle holds per-token records (``forward_pass_id``, ``gatherer_key``,
    ``input_ids``), or a directory of ``expert_distribution_recorder_*.pt`` files of that kind."""
    if src.is_dir():
        files = dump_files(src)
        return bool(files) and _is_dump(pickle_head(files[0]))
    return head.startswith(b"PK\x03\x04") and _is_dump(pickle_head(src))


def _pass_ids(rec: dict[str, Any], info: ModelInfo, where: str, options: ImportOptions) -> np.ndarray:
    """One record's ``topk_ids_of_layer`` as int64 ``[N, L, K]`` physical ids (MoE layers, the model's top-k)."""
    import numpy as np

    torch = require("torch", purpose="reading SGLang's .pt dumps")
    t = rec.get("topk_ids_of_layer")
    if (
        not isinstance(t, torch.Tensor)
        or t.dim() != 3
        or t.dtype.is_floating_point
        or t.dtype.is_complex
        or t.dtype == torch.bool
    ):
        raise TraceFormatError(
            f"{where}: `topk_ids_of_layer` must be an integer tensor [layers, tokens, top-k], got "
            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
        )
    check_tensor(t, f"{where}: `topk_ids_of_layer`", options, copies=3)  # int64, its MoE layers, [N, L, K]
    ids_HNK = t.numpy().astype(np.int64, copy=False)
    H, N, C = ids_HNK.shape
    K = info.top_k
    if C < K:
        raise TraceFormatError(
            f"{where}: {C} top-k columns recorded; {info.name} has top-k {K} (SGLang's per_token recorder keeps "
            f"{SGLANG_TOPK_COLUMNS})"
        )
    if (ids_HNK[:, :, K:] != -1).any():
        raise TraceFormatError(
            f"{where}: ids beyond the first {K} columns: the capture routed more than {info.name}'s top-k {K} "
            "(--model names another model)"
        )
    if H == info.num_hidden_layers:
        dense = np.ones(H, dtype=bool)
        dense[list(info.moe_layers)] = False
        if (ids_HNK[dense] != -1).any():
            layer = int(np.flatnonzero((ids_HNK[dense] != -1).any(axis=(1, 2)))[0])
            raise TraceFormatError(
                f"{where}: layer {int(np.flatnonzero(dense)[layer])} holds ids but is dense in {info.name} "
                "(--model names another model)"
            )
        ids_HNK = ids_HNK[list(info.moe_layers)]
    elif H != info.num_moe_layers:
        raise TraceFormatError(
            f"{where}: {H} layers recorded; {info.name} has {info.num_hidden_layers} layers, "
            f"{info.num_moe_layers} of them MoE (either count fits)"
        )
    return np.ascontiguousarray(ids_HNK[:, :, :K].transpose(1, 0, 2))


def _pass_fingerprint(rec: dict[str, Any], input_ids: list[Any], ids_NLK: np.ndarray) -> bytes:
    """What a rank's record of one pass holds that tells DP-attention ranks from TP ranks: its tokens, their
    positions and the experts they were routed to (``ids_NLK``, physical). Tensor-parallel ranks (without DP
    attention) run the same batch and route it alike, so all three match; DP-attention ranks run their own
    requests: a one-request decode pass on each may emit the same token, but not at the same position routed
    to the same experts in every layer."""
    import hashlib

    import numpy as np

    positions = rec.get("positions")
    h = hashlib.blake2b(digest_size=16)
    for part in (input_ids, positions if isinstance(positions, list) else None, rec.get("extend_seq_lens")):
        h.update(repr(part).encode())
    h.update(np.ascontiguousarray(ids_NLK).tobytes())
    return h.digest()


def parse(
    src: Path,
    *,
    info: ModelInfo,
    label: str,
    stages: StagesMode = "both",
    options: ImportOptions,
    with_weights: bool = False,
) -> Generator[Requests, None, Parsed]:
    """Every forward pass of the dump(s) in ``src``, one request each (module docstring); progress in bytes of
    the dump files, after each file."""
    import numpy as np

    from moetrace.tracer.trace.schema import NO_EXPERT

    del label, stages, with_weights  # the passes say their stage; no weights
    files = dump_files(src)
    if not files:
        raise TraceFormatError(f"{src}: no expert_distribution_recorder_*.pt files in the directory")
    total = sum(f.stat().st_size for f in files)
    passes: dict[int, dict[int, tuple[str, bytes]]] = {}  # forward_pass_id -> rank -> (where, _pass_fingerprint)
    mixed = 0
    rid = 0
    ranks: set[int] = set()
    stages_seen: set[str] = set()
    for i, path in enumerate(files):
        obj = load_dump(path, options, mode="per_token")
        records = obj["records"]
        if records and all(isinstance(r, dict) and "topk_ids_of_layer" not in r for r in records):
            raise TraceFormatError(
                f"{path.name}: a per_pass dump (expert counts per forward pass, no per-token ids): it gives loads, "
                "not a trace: import it as a load profile with --format sglang-pass (-o NAME.parquet), or record "
                "with --expert-distribution-recorder-mode per_token for a trace"
            )
        map_LP = None
        if options.physical_map is None:  # --physical-map (the driver's) wins over the dump's own map
            if obj.get("last_physical_to_logical_map") is None:
                raise TraceFormatError(
                    f"{path.name}: no last_physical_to_logical_map; pass --physical-map FILE (the map SGLang served "
                    "with)"
                )
            m = obj["last_physical_to_logical_map"]
            check_tensor(m, f"{path.name}: last_physical_to_logical_map", options)
            map_LP = physical_map_from_array(
                m.numpy() if hasattr(m, "numpy") else m, info, where=f"{path.name}: last_physical_to_logical_map"
            )
        for j, rec in enumerate(records):
            where = (
                f"{path.name}: record {j} (forward pass {rec.get('forward_pass_id') if isinstance(rec, dict) else '?'})"
            )
            if not isinstance(rec, dict):
                raise TraceFormatError(f"{where}: not a record (a dict), got {type(rec).__name__}")
            fid, rank, mode = (record_int(rec, k, where) for k in ("forward_pass_id", "rank", "forward_mode"))
            if mode == IDLE:
                continue
            if mode not in (EXTEND, DECODE, MIXED):
                raise TraceFormatError(
                    f"{where}: forward mode {mode} (speculative decoding?) is not imported; moetrace reads extend (1), "
                    "decode (2) and mixed (3) passes"
                )
            input_ids = rec.get("input_ids")
            if not isinstance(input_ids, list):
                raise TraceFormatError(f"{where}: `input_ids` must be a list of token ids")
            same_pass = passes.setdefault(fid, {})
            if rank in same_pass:
                raise TraceFormatError(f"{where}: rank {rank} recorded forward pass {fid} twice ({same_pass[rank][0]})")
            ids_NLK = _pass_ids(rec, info, where, options)
            if len(ids_NLK) != len(input_ids):
                raise TraceFormatError(f"{where}: {len(ids_NLK)} tokens of ids but {len(input_ids)} input_ids")
            key = _pass_fingerprint(rec, input_ids, ids_NLK)
            twin = next((w for w, key2 in same_pass.values() if key2 == key), None)
            if twin is not None:
                raise TraceFormatError(
                    f"{where}: the same pass as {twin} (the same tokens at the same positions, routed to the same "
                    "experts): ranks that see every token (tensor parallelism without DP attention) record each pass "
                    "once per rank; import one rank's file"
                )
            same_pass[rank] = (where, key)
            N = len(ids_NLK)
            if N == 0:
                continue
            check_allocation(N * info.ids_per_token * 8, f"{where}: {N:,} tokens", options=options)
            # a decode pass is one request of a placeholder prompt row (nothing recorded) and N generated tokens
            pad = 1 if mode == DECODE else 0

            def describe(t: int, moe: int, w: str = where, pad: int = pad) -> str:
                return f"{w}, token {t - pad}, layer {info.moe_layers[moe]}"

            if mode == DECODE:
                stages_seen.add("decode")
                ids_NLK = np.concatenate([np.full((1, *ids_NLK.shape[1:]), NO_EXPERT, dtype=ids_NLK.dtype), ids_NLK])
            else:
                mixed += mode == MIXED
                stages_seen.add("prefill")
            ranks.add(rank)
            yield Requests(
                request_id_R=np.array([rid], dtype=np.int64),
                prompt_tokens_R=np.array([1 if pad else N]),
                output_tokens_R=np.array([N if pad else 0]),
                topk_ids_TLK=ids_NLK,
                physical_map_LP=map_LP,
                describe_row=describe,
            )
            rid += 1
        done = sum(f.stat().st_size for f in files[: i + 1])
        yield Requests(  # the file's end: what is held is written, and the progress reported
            request_id_R=np.zeros(0, dtype=np.int64),
            prompt_tokens_R=np.zeros(0, dtype=np.int64),
            output_tokens_R=np.zeros(0, dtype=np.int64),
            topk_ids_TLK=np.zeros((0, info.num_moe_layers, info.top_k), dtype=np.int16),
            progress=(done, total),
            flush=True,
        )
    if rid == 0:
        raise TraceFormatError(f"{src.name}: the dump holds no forward pass with tokens")
    notes: list[str] = []
    if options.physical_map is None:
        notes.append(
            "physical slot ids converted with the dump's last_physical_to_logical_map (the map in force at the dump; "
            "passes recorded before an EPLB rebalance convert with it too)"
        )
    if mixed:
        notes.append(f"{mixed} mixed pass(es) (chunked prefill with decode tokens) counted as prefill")
    notes.append("no request ids in the dump: each forward pass of each rank is one request")
    return Parsed(
        notes=tuple(notes),
        collection={
            "stages": [s for s in ("prefill", "decode") if s in stages_seen],
            "request_unit": "forward pass",
            "source_ranks": sorted(ranks),
            "source_files": len(files),
        },
        prompt_lengths_known="decode" not in stages_seen,
        progress_total=total,
    )


FORMAT = ImportFormat(
    name="sglang-dump",
    help="SGLang expert-distribution per_token dump(s): a .pt, or a directory of one per rank",
    detect=detect,
    parse=parse,
    batch_requests=BATCH_PASSES,
    options=frozenset({PHYSICAL_MAP}),
)
