"""Import format ``sglang-pass``: SGLang's expert-distribution recorder in ``per_pass`` mode → a load profile.

Read from ``python/sglang/srt/eplb/expert_distribution.py`` (sgl-project/sglang, commit 02295fe5ac5c, no
release tag pinned): ``_Accumulator.get_class`` gives ``per_pass`` the ``_DetailAccumulator`` (as
``per_token``) but not the per-token gatherer: its records come from ``_SelectExpertsSinglePassGatherer``
(the default, and DeepEP normal mode) or ``_DeepepLowLatencySinglePassGatherer`` (DeepEP low-latency
mode), whose ``collect`` returns only ``global_physical_count``. A server started with
``--expert-distribution-recorder-mode per_pass`` records between ``/start_expert_distribution_record``
and ``/stop_expert_distribution_record``; ``/dump_expert_distribution_record`` makes every rank write
``expert_distribution_recorder_{time}_{rank}.pt`` into ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``:
``torch.save`` of ``{"records": [...], "last_physical_to_logical_map": int [layers, slots]}``, one record
per forward pass of that rank, ``{"forward_pass_id", "rank", "gatherer_key", "global_physical_count"}``,
``global_physical_count`` an int32 tensor ``[layers, physical slots]``: the tokens per physical slot
that the rank counted in that pass (select-experts gatherer: the ids its own tokens were routed to;
DeepEP low-latency: what its local slots received, zeros elsewhere). The layer axis is SGLang's
``num_layers`` (all decoder layers for DeepSeek, dense rows zero) or the MoE layers.

Input: one such ``.pt``, or a directory of them (one per rank). Loaded only with
``torch.load(weights_only=True)`` (tensors, lists, numbers, strings: no code runs), after the sizes its
zip declares are checked against the import's memory budget.

The profile: **windows are forward passes** (unit ``forward_passes``), in ``forward_pass_id`` order,
each the sum over the ranks that recorded that pass (passes no rank counted anything in are left out,
and counted in ``source``); the per-rank totals are the profile's ``ranks`` when the ranks recorded are
``0..W-1`` (else ``ranks`` is left out and ``source.source_ranks`` lists them). Physical slots become
logical experts by summing the slots of each expert (what SGLang's
``_convert_global_physical_count_to_logical_count`` does for ``stat`` dumps) through the dump's own
``last_physical_to_logical_map`` (the map in force at the dump: passes recorded before an EPLB
rebalance convert with it too), or ``--physical-map FILE``, which takes precedence. The records carry
no ``forward_mode`` at that commit (only the per-token gatherer records it), so prefill and decode are
counted together: ``--stages both`` (the default) gives the profile's ``mixed`` stage; ``decode-only``
/ ``prefill-only`` say the server ran one stage (a PD-disaggregated decode or prefill server).

Refused: ranks whose counts are identical in every pass (tensor parallelism without DP attention: every
rank counts every token; import one rank's file), a rank recording a pass twice, counts of dense layers,
shapes that do not fit ``--model`` or the map.

Detected by a torch zip whose pickle names ``forward_pass_id``, ``gatherer_key`` and
``global_physical_count`` but no ``input_ids`` (a per-token record's fourth key: ``sglang-dump``), or a
directory of ``expert_distribution_recorder_*.pt`` files of that kind.

Shape legend: N windows (forward passes), H layers of the dump's layer axis, L MoE layers, P physical
slots, E logical experts, W source ranks (legend: docs/architecture.md).

Out of scope: ``per_token`` dumps (``sglang-dump``: a trace), ``stat`` / ``stat_approx`` dumps
(``sglang-stat``), the utilization-rate metrics the recorder logs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace._deps import require
from moetrace.errors import TraceFormatError
from moetrace.tracer.importers.base import ImportFormat, Progress, StagesMode
from moetrace.tracer.importers.ids import physical_map_from_array, read_physical_map
from moetrace.tracer.importers.options import PHYSICAL_MAP, ImportOptions
from moetrace.tracer.importers.sglang_pt import check_tensor, dump_files, load_dump, pickle_head, record_int

if TYPE_CHECKING:
    import numpy as np

    from moetrace.tracer.trace.profile import LoadProfile
    from moetrace.tracer.trace.schema import ModelInfo

#: the count each per_pass record holds
KEY = "global_physical_count"
#: the most ranks a dump directory may hold (ranks index the profile's rank rows)
MAX_RANKS = 1 << 16
#: ``--stages`` -> the profile's stage
_STAGE = {"both": "mixed", "decode-only": "decode", "prefill-only": "prefill"}


def _is_pass_dump(head: bytes) -> bool:
    return b"forward_pass_id" in head and b"gatherer_key" in head and KEY.encode() in head and b"input_ids" not in head


def detect(head: bytes, src: Path) -> bool:
    """A torch ``.pt`` (a zip) whose pickle holds per_pass records (module docstring), or a directory of
    ``expert_distribution_recorder_*.pt`` files of that kind."""
    if src.is_dir():
        files = dump_files(src)
        return bool(files) and _is_pass_dump(pickle_head(files[0]))
    return head.startswith(b"PK\x03\x04") and _is_pass_dump(pickle_head(src))


def _map_of(
    obj: dict[str, Any], path: Path, info: ModelInfo, user_map: np.ndarray | None, options: ImportOptions
) -> np.ndarray:
    """The ``[L, P]`` physical-to-logical map that converts this file's counts."""
    if user_map is not None:
        return user_map
    m = obj.get("last_physical_to_logical_map")
    if m is None:
        raise TraceFormatError(
            f"{path.name}: no last_physical_to_logical_map; pass --physical-map FILE (the map SGLang served with)"
        )
    torch = require("torch", purpose="reading SGLang's .pt dumps")
    check_tensor(m, f"{path.name}: last_physical_to_logical_map", options)
    return physical_map_from_array(
        m.numpy() if isinstance(m, torch.Tensor) else m, info, where=f"{path.name}: last_physical_to_logical_map"
    )


def _pass_counts(rec: dict[str, Any], info: ModelInfo, P: int, where: str, options: ImportOptions) -> np.ndarray:
    """One record's ``global_physical_count`` as int64 ``[L, P]`` at the model's MoE layers."""
    import numpy as np

    torch = require("torch", purpose="reading SGLang's .pt dumps")
    t = rec.get(KEY)
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TraceFormatError(
            f"{where}: `{KEY}` must be an integer tensor [layers, physical slots], got "
            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
        )
    if t.dtype == torch.bool:
        raise TraceFormatError(f"{where}: `{KEY}` must hold whole counts, got booleans")
    check_tensor(t, f"{where}: `{KEY}`", options, copies=2)  # int64, then its MoE layers
    c_HP = t.numpy().astype(np.int64, copy=False)
    H, slots = c_HP.shape
    if slots != P:
        raise TraceFormatError(
            f"{where}: {slots} physical slots counted, the physical-to-logical map has {P} (a map of another "
            "deployment?)"
        )
    if c_HP.size and int(c_HP.min()) < 0:
        raise TraceFormatError(f"{where}: a negative count ({int(c_HP.min())})")
    if H == info.num_hidden_layers:
        dense = np.ones(H, dtype=bool)
        dense[list(info.moe_layers)] = False
        busy = np.flatnonzero(dense & c_HP.any(axis=1))
        if busy.size:
            raise TraceFormatError(
                f"{where}: counts at layer {int(busy[0])}, which is dense in {info.name} (--model names another model)"
            )
        return c_HP[list(info.moe_layers)]
    if H != info.num_moe_layers:
        raise TraceFormatError(
            f"{where}: {H} layers counted; {info.name} has {info.num_hidden_layers} layers, "
            f"{info.num_moe_layers} of them MoE (either count fits)"
        )
    return c_HP


def physical_to_logical_counts(counts_LP: np.ndarray, map_LP: np.ndarray, num_experts: int) -> np.ndarray:
    """Tokens per physical slot ``[..., L, P]`` → tokens per logical expert (int64 ``[..., L, E]``): each expert
    gets the sum of its slots (``map_LP``: int ``[L, P]``, logical expert of every slot)."""
    import numpy as np

    c = np.asarray(counts_LP, dtype=np.int64)
    lead = c.shape[:-2]
    L, P = map_LP.shape
    flat_NLP = c.reshape(-1, L, P)
    out_NLE = np.zeros((flat_NLP.shape[0], L, num_experts), dtype=np.int64)
    for layer in range(L):
        np.add.at(out_NLE[:, layer].T, map_LP[layer], flat_NLP[:, layer].T)
    return out_NLE.reshape(*lead, L, num_experts)


def read_profile(
    src: Path,
    *,
    info: ModelInfo,
    label: str | None,
    stages: StagesMode,
    progress: Progress | None,
    options: ImportOptions | None = None,
) -> LoadProfile:
    """The load profile of the per_pass dump(s) in ``src`` (module docstring)."""
    import numpy as np

    from moetrace.tracer.trace.profile import MAX_CELLS, LoadProfile, Window

    options = options or ImportOptions()
    files = dump_files(src)
    if not files:
        raise TraceFormatError(f"{src}: no expert_distribution_recorder_*.pt files in the directory")
    user_map = read_physical_map(options.physical_map, info) if options.physical_map is not None else None
    L, E = info.num_moe_layers, info.num_experts
    pass_LE: dict[int, np.ndarray] = {}  # forward_pass_id -> int64 [L, E], summed over ranks
    rank_LE: dict[int, np.ndarray] = {}  # rank -> int64 [L, E], summed over passes
    seen: dict[tuple[int, int], tuple[str, bytes]] = {}  # (pass, rank) -> (where, digest of its counts)
    for i, path in enumerate(files):
        obj = load_dump(path, options, mode="per_pass")
        records = obj["records"]
        if records and all(isinstance(r, dict) and "topk_ids_of_layer" in r for r in records):
            raise TraceFormatError(
                f"{path.name}: a per_token dump (ids per token): import it as a trace with --format sglang-dump"
            )
        map_LP = _map_of(obj, path, info, user_map, options)
        for j, rec in enumerate(records):
            fid_seen = rec.get("forward_pass_id") if isinstance(rec, dict) else "?"
            where = f"{path.name}: record {j} (forward pass {fid_seen})"
            if not isinstance(rec, dict):
                raise TraceFormatError(f"{where}: not a record (a dict), got {type(rec).__name__}")
            fid = record_int(rec, "forward_pass_id", where, nonnegative=True)
            rank = record_int(rec, "rank", where, nonnegative=True)
            if rank >= MAX_RANKS:
                raise TraceFormatError(f"{where}: rank {rank}; moetrace reads at most {MAX_RANKS} ranks")
            if (fid, rank) in seen:
                raise TraceFormatError(
                    f"{where}: rank {rank} recorded forward pass {fid} twice ({seen[(fid, rank)][0]})"
                )
            if fid not in pass_LE and (len(pass_LE) + 1) * L * E > MAX_CELLS:
                raise TraceFormatError(
                    f"{where}: more than {len(pass_LE):,} forward passes x {L} layers x {E} experts, over the "
                    f"{MAX_CELLS:,} counts one profile holds; import fewer passes (one dump per recording window)"
                )
            c_LE = physical_to_logical_counts(_pass_counts(rec, info, map_LP.shape[1], where, options), map_LP, E)
            seen[(fid, rank)] = (where, hashlib.blake2b(c_LE.tobytes(), digest_size=16).digest() if c_LE.any() else b"")
            pass_LE[fid] = pass_LE[fid] + c_LE if fid in pass_LE else c_LE
            rank_LE[rank] = rank_LE[rank] + c_LE if rank in rank_LE else c_LE
        if progress is not None:
            progress(i + 1, len(files))
    if not pass_LE:
        raise TraceFormatError(f"{src.name}: the dump holds no forward pass (was the recorder started?)")
    ranks = sorted(rank_LE)
    fids = sorted(fid for fid, c in pass_LE.items() if c.any())
    if not fids:
        raise TraceFormatError(f"{src.name}: every count is zero; record while requests run, then dump")
    if len(ranks) > 1:
        digests: dict[int, list[bytes]] = {}  # pass -> the digests of the ranks that counted something in it
        for (fid, _), (_, digest) in seen.items():
            if digest:
                digests.setdefault(fid, []).append(digest)
        shared = [d for d in digests.values() if len(d) > 1]
        if shared and all(len(set(d)) == 1 for d in shared):
            raise TraceFormatError(
                f"{src.name}: ranks {ranks[:4]} counted the same tokens in every forward pass (tensor parallelism "
                "without DP attention: every rank counts every token); import one rank's file"
            )
    W = ranks[-1] + 1
    dense_ranks = ranks == list(range(W))
    N = len(fids)
    counts_NLE = np.stack([pass_LE[fid] for fid in fids])
    stage = _STAGE[stages]
    source: dict[str, Any] = {
        "source_format": "sglang-pass",
        "source_file": src.name,  # the name only: the user's directories stay out
        "source_files": len(files),
        "source_ranks": ranks,
        "forward_passes": len(pass_LE),
        "forward_passes_with_counts": N,
        "forward_pass_ids": [fids[0], fids[-1]],
        "physical_map": options.physical_map.name
        if options.physical_map is not None
        else "last_physical_to_logical_map",
    }
    return LoadProfile(
        model=info,
        counts={stage: counts_NLE},
        window_tokens=Window(unit="forward_passes", size=1) if N > 1 else None,
        datasets=None if label is None else {stage: {label: counts_NLE.sum(axis=0)}},
        ranks={stage: np.stack([rank_LE[r] for r in ranks])} if dense_ranks else None,
        source=source,
    )


FORMAT = ImportFormat(
    name="sglang-pass",
    help="SGLang expert-distribution per_pass dump(s): a .pt, or a directory of one per rank: a load profile",
    detect=detect,
    read=None,
    stages_modes=True,
    options=frozenset({PHYSICAL_MAP}),
    produces="profile",
    read_profile=read_profile,
)
