"""Import format ``sglang-stat``: SGLang's expert-distribution ``stat`` / ``stat_approx`` dumps → a load profile.

Read from SGLang's recorder, ``python/sglang/srt/eplb/expert_distribution.py`` (``_StatAccumulator.dump``,
``_convert_global_physical_count_to_logical_count``; read at commit 02295fe5 of sgl-project/sglang,
release v0.5.x; docs/profile.md). The server runs with ``--expert-distribution-recorder-mode stat``
(or ``stat_approx``, DeepEP normal mode); ``/start_expert_distribution_record``, requests,
``/dump_expert_distribution_record`` then write, on rank 0, ``expert_distribution_recorder_<time>.pt``
into ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``: ``torch.save`` of a dict with ``rank`` (int),
``logical_count`` (int tensor ``[N, H, E]``: logical-expert token counts of each buffered forward
pass, summed over ranks; ``H`` = the model's layers, dense ones zero) and
``average_utilization_rate_over_window`` (float or None). The counts are logical already (the
recorder maps physical slots back with its ``physical_to_logical_map``).

Also read: the JSON SGLang's ``--init-expert-location`` takes, ``{"logical_count": [[...]]}``:
``[H, E]`` (one window) or ``[N, H, E]``. Checked against SGLang 0.5.23 (the PyPI release):
``python/sglang/srt/eplb/expert_location.py``, ``compute_initial_expert_location_metadata`` reads it with
``json.loads`` and ``init_by_eplb`` turns the list into a tensor with ``torch.tensor``, so counts written as
floats load there; the published DeepSeek-V3 files (``[61][256]``, attached to sgl-project/sglang#6017) hold
whole numbers written that way (``807392.0``). moetrace reads such floats as the counts they are and refuses
any other float (a fraction, NaN, infinity, or 2**53 and beyond), naming the value and its (pass,) layer and
expert.

The ``.pt`` is loaded with ``torch.load(weights_only=True)`` only (no pickle of arbitrary
objects). Rows are all decoder layers (dense rows must be zero) or the MoE layers alone; experts
must be the model's ``num_experts``; anything else is refused with the shapes found. Forward
passes become windows (unit ``forward_passes``; passes with no count left out: SGLang's buffer
holds zeros where no pass was recorded, and is circular, so its order is not time order once it
wrapped). The recorder counts prefill and decode passes together: ``--stages both`` (the default)
gives the profile's ``mixed`` stage; ``decode-only`` / ``prefill-only`` say the server ran one
stage (a PD-disaggregated decode or prefill server).

Detected by a zip (``torch.save``) whose pickle names ``logical_count``, or a JSON object with a
``logical_count`` key.

Shape legend: N windows (forward passes), H decoder layers, L MoE layers, E experts.

Out of scope: SGLang's ``per_pass`` / ``per_token`` dumps (physical ids per token: a trace, not a
profile), the ``/generate`` responses (``sglang``).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace.errors import TraceFormatError
from moetrace.tracer.importers.base import ImportFormat, Progress, StagesMode
from moetrace.tracer.importers.options import ImportOptions, check_allocation, check_declared_shape

if TYPE_CHECKING:
    import numpy as np

    from moetrace.tracer.trace.profile import LoadProfile
    from moetrace.tracer.trace.schema import ModelInfo

#: the key SGLang's dump and its --init-expert-location JSON hold the counts under
KEY = "logical_count"
#: the largest pickle member a detection looks into (a stat dump's pickle is a few hundred bytes)
_MAX_PICKLE = 1 << 20
#: the largest JSON file read (a [N, H, E] list of ints)
_MAX_JSON = 1 << 30
#: bytes in memory per byte of a JSON file of counts, at most (``"0,"``: an 8-byte pointer, then 8 in the array)
_JSON_BYTES_PER_BYTE = 8
#: the largest count read from a float (2**53: beyond it a float is no longer an exact whole number)
_MAX_FLOAT_COUNT = float(2**53)
_ZIP = b"PK\x03\x04"
#: ``--stages`` -> the profile's stage
_STAGE = {"both": "mixed", "decode-only": "decode", "prefill-only": "prefill"}


def _pickle_names_key(src: Path) -> bool:
    try:
        with zipfile.ZipFile(src) as z:
            for info in z.infolist():
                if info.filename.endswith("data.pkl") and info.file_size <= _MAX_PICKLE:
                    data = z.read(info)
                    return KEY.encode() in data and b"records" not in data
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, RuntimeError):
        return False
    return False


def detect(head: bytes, src: Path) -> bool:
    """A ``torch.save`` zip whose pickle names ``logical_count``, or a JSON object holding that key."""
    if head.startswith(_ZIP):
        return src.is_file() and _pickle_names_key(src)
    text = head.lstrip()
    return text.startswith(b"{") and b'"' + KEY.encode() + b'"' in head


def _load_pt(src: Path, options: ImportOptions | None) -> tuple[Any, dict[str, Any]]:
    from moetrace._deps import require
    from moetrace.tracer.importers.sglang_pt import check_declared_bytes

    torch = require("torch", purpose="reading SGLang's expert-distribution .pt dumps")
    check_declared_bytes(src, options)
    try:
        obj = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds (UnpicklingError, RuntimeError, ...) for a bad file
        raise TraceFormatError(
            f"{src}: not a loadable torch.save file ({type(exc).__name__}: {str(exc)[:160]}); "
            "moetrace loads .pt dumps with weights_only=True only"
        ) from None
    if not isinstance(obj, dict) or KEY not in obj:
        what = f"keys {sorted(map(str, obj))[:6]}" if isinstance(obj, dict) else type(obj).__name__
        raise TraceFormatError(f"{src}: expected SGLang's stat dump (a dict with {KEY!r}), got {what}")
    counts = obj[KEY]
    if not isinstance(counts, torch.Tensor):
        raise TraceFormatError(f"{src}: {KEY!r} must be a tensor, got {type(counts).__name__}")
    # a view's shape, not its storage: a 2 KB file may declare [10**7, 61, 256] over one stored count; read as
    # int64, its MoE layers picked and its empty passes dropped (three copies), before anything is computed
    check_declared_shape(tuple(counts.shape), f"{src}: {KEY!r}", options=options, copies=3)
    extra = {"rank": obj.get("rank")} if isinstance(obj.get("rank"), int) else {}
    rate = obj.get("average_utilization_rate_over_window")
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        extra["average_utilization_rate_over_window"] = float(rate)
    return counts.detach().cpu().numpy(), extra


def _load_json(src: Path, options: ImportOptions | None) -> Any:
    import numpy as np

    from moetrace.inputs import read_input_json

    # a regular file only (a pipe never blocks), at most _MAX_JSON bytes, integers of bounded digits; its lists
    # in memory (a pointer, then an int64, per number of at least two bytes of text) checked against the budget
    check_allocation(
        src.stat().st_size * _JSON_BYTES_PER_BYTE, f"{src}: a JSON file of {src.stat().st_size:,} bytes",
        options=options, kind="parsed counts",
    )  # fmt: skip
    obj = read_input_json(src, max_bytes=_MAX_JSON)
    if not isinstance(obj, dict) or KEY not in obj:
        raise TraceFormatError(f'{src}: expected {{"{KEY}": [[...]]}} as SGLang\'s --init-expert-location takes')
    try:
        arr = np.array(obj[KEY])
    except (ValueError, TypeError, OverflowError) as exc:
        raise TraceFormatError(f"{src}: {KEY!r} is not a rectangular list of counts ({str(exc)[:120]})") from None
    return arr


def _whole_floats(a: np.ndarray, where: str) -> np.ndarray:
    """Counts written as floats (SGLang's published DeepSeek-V3 files hold ``807392.0``; its loader takes them
    through ``torch.tensor``) as int64; ``TraceFormatError`` naming the first value that is not a whole count
    and where it is (``[layers, experts]`` or ``[passes, layers, experts]``)."""
    import numpy as np

    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(a) | (a != np.floor(a)) | (np.abs(a) >= _MAX_FLOAT_COUNT)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        names = ("pass", "layer", "expert")[3 - a.ndim :]
        place = ", ".join(f"{n} {i}" for n, i in zip(names, at))
        raise TraceFormatError(
            f"{where}: {KEY!r} holds {float(a[at])!r} at {place} (indices from 0 along {list(a.shape)}): "
            "not a whole token count (counts written as floats, like 807392.0, are read; fractions are not)"
        )
    return a.astype(np.int64)


def logical_count_to_NLE(counts: np.ndarray, *, info: ModelInfo, where: str) -> np.ndarray:
    """SGLang's ``logical_count`` (``[H, E]`` or ``[N, H, E]``, H all decoder layers or the MoE ones)
    as int64 ``[N, L, E]`` at the model's MoE layers; ``TraceFormatError`` for anything that does not fit."""
    import numpy as np

    a = np.asarray(counts)
    if a.dtype.kind not in "iuf" or a.ndim not in (2, 3):
        raise TraceFormatError(
            f"{where}: {KEY!r} must hold whole counts [layers, experts] or [passes, layers, experts], "
            f"got {a.dtype} of shape {a.shape}"
        )
    if a.dtype.kind == "f":
        a = _whole_floats(a, where)
    a = a[None] if a.ndim == 2 else a
    N, H, E = a.shape
    if E != info.num_experts:
        raise TraceFormatError(
            f"{where}: {E} experts per layer, model {info.name!r} has {info.num_experts} (wrong --model, or "
            "counts of physical slots with redundant experts: SGLang's stat dump holds logical experts)"
        )
    if a.size and int(a.min()) < 0:
        raise TraceFormatError(f"{where}: a negative count ({int(a.min())})")
    if H == info.num_hidden_layers:
        dense = [h for h in range(H) if h not in set(info.moe_layers)]
        busy = [h for h in dense if a[:, h].any()]
        if busy:
            raise TraceFormatError(
                f"{where}: counts at layer(s) {busy[:5]}, which model {info.name!r} has dense (MoE layers "
                f"{list(info.moe_layers)[:5]}...): wrong --model?"
            )
        a = a[:, list(info.moe_layers)]
    elif H != info.num_moe_layers:
        raise TraceFormatError(
            f"{where}: {H} layers, model {info.name!r} has {info.num_hidden_layers} layers of which "
            f"{info.num_moe_layers} MoE: wrong --model?"
        )
    return a.astype(np.int64)


def read_profile(
    src: Path,
    *,
    info: ModelInfo,
    label: str | None,
    stages: StagesMode,
    progress: Progress | None,
    options: ImportOptions | None = None,
) -> LoadProfile:
    """The load profile of one SGLang stat dump (``.pt``) or logical_count JSON (module docstring)."""
    from moetrace.inputs import open_input
    from moetrace.tracer.trace.profile import LoadProfile, Window

    with open_input(src) as f:  # a regular file only: a named pipe is refused, never waited on
        is_zip = f.read(4) == _ZIP
    counts, extra = _load_pt(src, options) if is_zip else (_load_json(src, options), {})
    c_NLE = logical_count_to_NLE(counts, info=info, where=str(src))
    keep = c_NLE.reshape(c_NLE.shape[0], -1).any(axis=1)
    if not keep.any():
        raise TraceFormatError(f"{src}: every count is zero; record while requests run, then dump")
    c_NLE = c_NLE[keep]
    stage = _STAGE[stages]
    if progress is not None:
        progress(1, 1)
    return LoadProfile(
        model=info,
        counts={stage: c_NLE},
        window_tokens=Window(unit="forward_passes", size=1) if c_NLE.shape[0] > 1 else None,
        datasets=None if label is None else {stage: {label: c_NLE.sum(axis=0)}},
        source={
            "source_format": "sglang-stat",
            "source_file": src.name,  # the name only: the user's directories stay out
            "kind": "torch.save dump" if is_zip else "logical_count JSON",
            "forward_passes_with_counts": int(keep.sum()),
            **extra,
        },
    )


FORMAT = ImportFormat(
    name="sglang-stat",
    help="SGLang expert-distribution stat/stat_approx dump (.pt) or logical_count JSON: a load profile",
    detect=detect,
    read=None,
    stages_modes=True,
    produces="profile",
    read_profile=read_profile,
)
