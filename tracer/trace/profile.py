"""The load profile: expert token counts per (stage, MoE layer, expert), its own small versioned format.

What aggregate dumps hold (SGLang's expert-distribution ``stat`` dumps, TensorRT-LLM's expert
statistics) and what ``moetrace profile TRACE -o P`` reduces any trace to: no requests, no tokens,
only how many tokens each expert of each MoE layer received, optionally

- per **window** (``N`` consecutive slices of the capture: trace rows, engine iterations or
  forward passes; ``Window`` says which) — ``counts[stage]`` is always ``[N, L, E]`` (``N = 1``:
  the whole capture);
- per **dataset** (``datasets[stage][label]``, ``[L, E]``, when the source knew them);
- per **source rank** (``ranks[stage]``, ``[W, L, E]``: the EP rank that counted the tokens, when
  the engine wrote one file per rank).

Stages are ``prefill``, ``decode`` and ``mixed``: an engine recorder that counts every forward
pass without telling prefill from decode gives ``mixed`` (alone); a trace gives the stages it
recorded. Where datasets or ranks are given they add up to ``counts`` summed over windows.

One file (Parquet, written atomically), one explicit Arrow schema (``profile_schema``), one row per
(stage, scope, index, layer) holding the E counts of that layer::

    stage   string  "prefill" | "decode" | "mixed"
    scope   string  "window" | "dataset" | "rank"
    index   int32   window ordinal / dataset ordinal (header ``datasets``) / source rank
    layer   int32   MoE-layer ordinal (0 .. L-1, ``model.moe_layers`` order)
    counts  fixed_size_list<int64>[E]

The header is the schema metadata key ``moetrace.profile``: a JSON object with ``format``
(``"moetrace.profile"``), ``version``, ``model`` (``ModelInfo``), ``stages``, ``num_windows``,
``window`` (or null), ``datasets`` (labels, or null), ``num_ranks`` (or null), ``source``
(provenance: the source format, what it was reduced from, tool version; file names only, never
directories) and ``moetrace_version``. Readers refuse other formats and versions, and every row
that does not fit the header (a missing or repeated cell, a count below zero, ids outside the model).

Shape legend (docs/architecture.md): N windows (rows of anything else), L MoE layers, E logical
experts, W source ranks, T tokens, K top-k.

Out of scope: per-request analyses (a profile has no requests), importing engine dumps
(``tracer.importers``), reading a trace (``reader``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, get_args

import numpy as np

from moetrace.errors import ConfigError, OutputExistsError, TraceFormatError
from moetrace.inputs import loads_json, open_input
from moetrace.tracer.trace.schema import STAGE_DECODE, STAGE_PREFILL, ModelInfo, is_whole, stages_of

if TYPE_CHECKING:
    import pyarrow as pa

    from moetrace.tracer.trace.reader import Trace

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "PROFILE_STAGES",
    "STAGE_MIXED",
    "LoadProfile",
    "Window",
    "is_profile",
    "open_profile",
    "profile_from_trace",
    "profile_schema",
    "profile_summary",
    "write_profile",
]

PROFILE_FORMAT: Final = "moetrace.profile"
PROFILE_VERSION: Final = 1
#: the schema metadata key holding the header
HEADER_KEY: Final = b"moetrace.profile"
#: a recorder's count of every forward pass, prefill and decode not told apart
STAGE_MIXED: Final = "mixed"
ProfileStage = Literal["prefill", "decode", "mixed"]
PROFILE_STAGES: tuple[str, ...] = get_args(ProfileStage)
Scope = Literal["window", "dataset", "rank"]
WindowUnit = Literal["tokens", "iterations", "forward_passes", "seconds"]
WINDOW_UNITS: tuple[str, ...] = get_args(WindowUnit)
#: the most cells (windows x layers x experts) one stage may hold: 1 GiB of int64 counts
MAX_CELLS = 1 << 27
#: Parquet's magic bytes, at the start of every Parquet file
_MAGIC = b"PAR1"


@dataclass(frozen=True, kw_only=True)
class Window:
    """What one window of a profile spans."""

    unit: WindowUnit  # tokens (trace rows, in file order), iterations (engine steps), forward_passes, seconds
    size: float  # units per window (the last window may hold fewer); 1 for one iteration or pass each

    def __post_init__(self) -> None:
        if self.unit not in WINDOW_UNITS:
            raise TraceFormatError(f"window unit must be one of {', '.join(WINDOW_UNITS)}, got {self.unit!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, (int, float)) or not self.size > 0:
            raise TraceFormatError(f"window size must be a number above 0, got {self.size!r}")

    def to_json(self) -> dict[str, Any]:
        return {"unit": self.unit, "size": self.size}

    @classmethod
    def from_json(cls, d: object) -> Window:
        if not isinstance(d, dict) or set(d) != {"unit", "size"}:
            raise TraceFormatError(f"profile `window` must be null or an object with unit and size, got {d!r}")
        return cls(unit=d["unit"], size=d["size"])


@dataclass(frozen=True, kw_only=True)
class LoadProfile:
    """Expert token counts of one capture (module docstring). Arrays are int64, checked on construction."""

    model: ModelInfo  # the model the counts are of
    counts: Mapping[str, np.ndarray]  # stage -> int64 [N, L, E] tokens routed per window (N=1: whole capture)
    window_tokens: Window | None = None  # what one window is; None: one window, the whole capture
    datasets: Mapping[str, Mapping[str, np.ndarray]] | None = None  # stage -> dataset -> int64 [L, E], when known
    ranks: Mapping[str, np.ndarray] | None = None  # stage -> int64 [W, L, E] per source rank, when known
    source: dict[str, Any] = field(default_factory=dict)  # provenance (source format, reduced from, tool version)

    def __post_init__(self) -> None:
        m = self.model
        L, E = m.num_moe_layers, m.num_experts
        stages = list(self.counts)
        if not stages or any(s not in PROFILE_STAGES for s in stages) or len(set(stages)) != len(stages):
            raise TraceFormatError(f"a profile's stages are some of {list(PROFILE_STAGES)}, got {stages!r}")
        if STAGE_MIXED in stages and len(stages) > 1:
            raise TraceFormatError("stage `mixed` (prefill and decode not told apart) stands alone in a profile")
        counts = {s: _counts(self.counts[s], 3, (L, E), f"counts[{s!r}]") for s in _ordered(stages)}
        ns = {c.shape[0] for c in counts.values()}
        if len(ns) != 1 or ns == {0}:
            raise TraceFormatError(f"every stage holds the same number of windows, at least 1; got {sorted(ns)}")
        if self.window_tokens is None and ns != {1}:
            raise TraceFormatError(f"{ns.pop()} windows need a `window_tokens` saying what one window spans")
        if counts and max(ns) * L * E > MAX_CELLS:
            raise ConfigError(
                f"{max(ns):,} windows x {L} layers x {E} experts is more than {MAX_CELLS:,} counts per stage; "
                "use longer windows"
            )
        object.__setattr__(self, "counts", counts)
        for s, c in counts.items():
            _check_sum([c], f"counts[{s!r}]")
        totals = {s: c.sum(axis=0) for s, c in counts.items()}
        if self.datasets is not None:
            if set(self.datasets) != set(counts):
                raise TraceFormatError(
                    f"datasets are given for stages {sorted(self.datasets)}, counts for {sorted(counts)}"
                )
            ds: dict[str, dict[str, np.ndarray]] = {}
            for s in counts:
                per = self.datasets[s]
                if not per or any(not isinstance(k, str) or not k for k in per):
                    raise TraceFormatError(f"datasets[{s!r}] must map non-empty labels to counts")
                ds[s] = {k: _counts(per[k], 2, (L, E), f"datasets[{s!r}][{k!r}]") for k in sorted(per)}
                _check_sum(list(ds[s].values()), f"datasets[{s!r}]")
                if not np.array_equal(sum(ds[s].values()), totals[s]):
                    raise TraceFormatError(f"datasets[{s!r}] do not add up to the stage's counts")
            labels = {tuple(v) for v in ds.values()}
            if len(labels) != 1:
                raise TraceFormatError("every stage lists the same datasets")
            object.__setattr__(self, "datasets", ds)
        if self.ranks is not None:
            if set(self.ranks) != set(counts):
                raise TraceFormatError(f"ranks are given for stages {sorted(self.ranks)}, counts for {sorted(counts)}")
            rk = {s: _counts(self.ranks[s], 3, (L, E), f"ranks[{s!r}]") for s in counts}
            for s, r in rk.items():
                _check_sum([r], f"ranks[{s!r}]")
            if len({r.shape[0] for r in rk.values()}) != 1 or any(r.shape[0] == 0 for r in rk.values()):
                raise TraceFormatError("every stage holds the same number of source ranks, at least 1")
            for s, r in rk.items():
                if not np.array_equal(r.sum(axis=0), totals[s]):
                    raise TraceFormatError(f"ranks[{s!r}] do not add up to the stage's counts")
            object.__setattr__(self, "ranks", rk)
        if not isinstance(self.source, dict):
            raise TraceFormatError(f"profile `source` must be an object, got {type(self.source).__name__}")

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages counted, in ``PROFILE_STAGES`` order."""
        return tuple(self.counts)

    @property
    def num_windows(self) -> int:
        return int(next(iter(self.counts.values())).shape[0])

    @property
    def dataset_labels(self) -> tuple[str, ...]:
        """The datasets, sorted (empty when the profile does not know them)."""
        return () if self.datasets is None else tuple(next(iter(self.datasets.values())))

    @property
    def num_ranks(self) -> int | None:
        return None if self.ranks is None else int(next(iter(self.ranks.values())).shape[0])

    def total(self, stage: str) -> np.ndarray:
        """int64 [L, E]: the stage's counts over every window."""
        if stage not in self.counts:
            raise ConfigError(f"the profile holds no {stage} counts (it has {', '.join(self.stages)})")
        return self.counts[stage].sum(axis=0)

    def tokens_L(self, stage: str) -> np.ndarray:
        """float64 [L]: tokens routed at each MoE layer (counts / top-k)."""
        return self.total(stage).sum(axis=-1) / self.model.top_k

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LoadProfile):
            return NotImplemented
        return (
            self.model == other.model
            and self.window_tokens == other.window_tokens
            and self.source == other.source
            and _same(self.counts, other.counts)
            and _same_nested(self.datasets, other.datasets)
            and _same(self.ranks, other.ranks)
        )

    __hash__ = None  # type: ignore[assignment]  # holds arrays


def _ordered(stages: list[str]) -> list[str]:
    return [s for s in PROFILE_STAGES if s in stages]


def _same(a: Mapping[str, np.ndarray] | None, b: Mapping[str, np.ndarray] | None) -> bool:
    if a is None or b is None:
        return a is b
    return list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)


def _same_nested(
    a: Mapping[str, Mapping[str, np.ndarray]] | None, b: Mapping[str, Mapping[str, np.ndarray]] | None
) -> bool:
    if a is None or b is None:
        return a is b
    return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)


#: the most a block of counts may add up to: every total and partial sum of it then fits int64
MAX_COUNT_SUM = 1 << 62


def _check_sum(arrays: list[np.ndarray], what: str) -> None:
    """Refuse counts (>= 0) adding up to 2**62 or more (the float sum errs far below that)."""
    total = sum(float(a.sum(dtype=np.float64)) for a in arrays)
    if total >= MAX_COUNT_SUM:
        raise TraceFormatError(f"{what} add up to {total:.3g}, more than 2**62: their totals would overflow")


def _counts(x: object, ndim: int, tail: tuple[int, int], what: str) -> np.ndarray:
    """``x`` as a checked int64 array of ``ndim`` axes ending in ``tail`` (L, E), every count >= 0."""
    a = np.asarray(x)
    if a.dtype.kind not in "iu" or a.ndim != ndim or a.shape[-2:] != tail:
        raise TraceFormatError(
            f"{what} must be integer counts of shape ({'N, ' if ndim == 3 else ''}{tail[0]} MoE layers, "
            f"{tail[1]} experts), got {a.dtype} {a.shape}"
        )
    if a.size and int(a.min()) < 0:
        raise TraceFormatError(f"{what} holds a negative count ({int(a.min())})")
    if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise TraceFormatError(f"{what} holds a count beyond int64")
    return np.ascontiguousarray(a, dtype=np.int64)


# ------------------------------------------------------------------------------------ the file
def profile_schema(num_experts: int, *, header: dict[str, Any] | None = None) -> pa.Schema:
    """The one Arrow schema of a profile file of a model with ``num_experts`` experts (module docstring)."""
    import pyarrow as pa

    schema = pa.schema(
        [
            pa.field("stage", pa.string(), nullable=False),
            pa.field("scope", pa.string(), nullable=False),
            pa.field("index", pa.int32(), nullable=False),
            pa.field("layer", pa.int32(), nullable=False),
            pa.field("counts", pa.list_(pa.field("item", pa.int64(), nullable=False), num_experts), nullable=False),
        ]
    )
    if header is not None:
        schema = schema.with_metadata({HEADER_KEY: json.dumps(header).encode()})
    return schema


def _header(p: LoadProfile) -> dict[str, Any]:
    from moetrace import __version__

    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "model": p.model.to_dict(),
        "stages": list(p.stages),
        "num_windows": p.num_windows,
        "window": None if p.window_tokens is None else p.window_tokens.to_json(),
        "datasets": None if p.datasets is None else list(p.dataset_labels),
        "num_ranks": p.num_ranks,
        "source": p.source,
        "moetrace_version": __version__,
    }


def _blocks(p: LoadProfile) -> list[tuple[str, Scope, np.ndarray]]:
    """(stage, scope, int64 [n, L, E]) of every block the file holds, in file order."""
    out: list[tuple[str, Scope, np.ndarray]] = []
    for s in p.stages:
        out.append((s, "window", p.counts[s]))
        if p.datasets is not None:
            out.append((s, "dataset", np.stack([p.datasets[s][d] for d in p.dataset_labels])))
        if p.ranks is not None:
            out.append((s, "rank", p.ranks[s]))
    return out


def write_profile(profile: LoadProfile, path: str | os.PathLike, *, overwrite: bool) -> None:
    """Write ``profile`` to the file ``path`` atomically (never half-written).

    Raises ``OutputExistsError`` when ``path`` exists and ``overwrite`` is False, or is a directory.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moetrace.atomic import atomic_path

    out = Path(path)
    if out.is_dir():
        raise OutputExistsError(f"{out} is a directory; a load profile is one file (e.g. -o profile.parquet)")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} already exists; choose another -o, or --overwrite to replace it")
    L, E = profile.model.num_moe_layers, profile.model.num_experts
    cols: dict[str, list[Any]] = {"stage": [], "scope": [], "index": [], "layer": []}
    mats = []
    for stage, scope, block in _blocks(profile):
        n = block.shape[0]
        cols["stage"] += [stage] * (n * L)
        cols["scope"] += [scope] * (n * L)
        cols["index"].append(np.repeat(np.arange(n, dtype=np.int32), L))
        cols["layer"].append(np.tile(np.arange(L, dtype=np.int32), n))
        mats.append(block.reshape(n * L, E))
    flat = np.concatenate(mats).reshape(-1)
    schema = profile_schema(E, header=_header(profile))
    table = pa.Table.from_arrays(
        [
            pa.array(cols["stage"], pa.string()),
            pa.array(cols["scope"], pa.string()),
            pa.array(np.concatenate(cols["index"]), pa.int32()),
            pa.array(np.concatenate(cols["layer"]), pa.int32()),
            pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.int64()), E),
        ],
        schema=schema,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        pq.write_table(table, tmp)


def is_profile(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file holding a moetrace load profile (any version): a Parquet file whose
    schema metadata names ``moetrace.profile``. Never raises for other inputs (directories, traces,
    text, damaged files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path)
    try:
        if not p.is_file():
            return False
        with open_input(p) as f:  # never blocks on a pipe swapped in
            if f.read(4) != _MAGIC:
                return False
        meta = pq.read_schema(p).metadata or {}
    except (OSError, pa.ArrowException):
        return False
    return HEADER_KEY in meta


def _read_header(p: Path, meta: dict[bytes, bytes] | None) -> dict[str, Any]:
    raw = (meta or {}).get(HEADER_KEY)
    if raw is None:
        raise TraceFormatError(f"{p}: a Parquet file without a `moetrace.profile` header; not a moetrace load profile")
    header = loads_json(raw, where=f"{p}: the profile header")  # bounded integers
    if not isinstance(header, dict):
        raise TraceFormatError(f"{p}: the profile header must be a JSON object")
    if header.get("format") != PROFILE_FORMAT:
        raise TraceFormatError(f"{p}: `format` is {header.get('format')!r}, expected {PROFILE_FORMAT!r}")
    if header.get("version") != PROFILE_VERSION:
        raise TraceFormatError(
            f"{p}: load profile version {header.get('version')!r} is not supported (this moetrace reads "
            f"{PROFILE_VERSION}); upgrade moetrace"
        )
    return header


def open_profile(path: str | os.PathLike) -> LoadProfile:
    """Read the load profile file ``path``, checking every row against its header.

    Raises ``TraceFormatError`` naming the problem for anything else (not a profile, another
    version, a damaged file, a row that does not fit the model).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path)
    if p.is_dir():
        raise TraceFormatError(f"{p} is a directory; a load profile is one file (`moetrace profile` writes one)")
    try:
        with open_input(p, what=str(p)) as f:  # a regular file only: a pipe or device is refused, never read
            if f.read(4) != _MAGIC:
                raise TraceFormatError(f"{p}: not a Parquet file; not a moetrace load profile")
        pf = pq.ParquetFile(p)
        header = _read_header(p, pf.schema_arrow.metadata)
        model = ModelInfo.from_dict(header.get("model"))
        expected = profile_schema(model.num_experts)
        if not pf.schema_arrow.remove_metadata().equals(expected):
            raise TraceFormatError(
                f"{p}: columns {pf.schema_arrow.remove_metadata()} differ from a profile's {expected}"
            )
        table = pf.read()
    except (pa.ArrowException, OSError) as exc:
        raise TraceFormatError(f"{p}: cannot be read as a load profile ({str(exc)[:200]})") from None
    except TraceFormatError as exc:
        msg = str(exc)
        raise TraceFormatError(msg if msg.startswith(str(p)) else f"{p}: {msg}") from None
    try:
        return _from_table(header, model, table)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{p}: {exc}") from None


def _from_table(header: dict[str, Any], model: ModelInfo, table: pa.Table) -> LoadProfile:
    L, E = model.num_moe_layers, model.num_experts
    stages = header.get("stages")
    if not isinstance(stages, list) or not stages or any(s not in PROFILE_STAGES for s in stages):
        raise TraceFormatError(f"`stages` must list some of {list(PROFILE_STAGES)}, got {stages!r}")
    n = header.get("num_windows")
    if not is_whole(n) or not 1 <= n <= MAX_CELLS:
        raise TraceFormatError(f"`num_windows` must be a whole number >= 1, got {n!r}")
    window = None if header.get("window") is None else Window.from_json(header["window"])
    labels = header.get("datasets")
    if labels is not None and (
        not isinstance(labels, list)
        or not labels
        or any(not isinstance(d, str) or not d for d in labels)
        or len(set(labels)) != len(labels)
    ):
        raise TraceFormatError(f"`datasets` must be null or a list of distinct labels, got {labels!r}")
    w = header.get("num_ranks")
    if w is not None and (not is_whole(w) or not 1 <= w <= 1 << 20):
        raise TraceFormatError(f"`num_ranks` must be null or a whole number >= 1, got {w!r}")
    source = header.get("source", {})
    if not isinstance(source, dict):
        raise TraceFormatError("`source` must be an object")
    sizes: dict[str, int] = {"window": n, "dataset": len(labels or []), "rank": w or 0}
    if n * L * E > MAX_CELLS:
        raise TraceFormatError(f"{n:,} windows x {L} layers x {E} experts is more than {MAX_CELLS:,} counts per stage")
    blocks = {(s, scope): np.full((sizes[scope], L, E), -1, np.int64) for s in stages for scope in sizes}
    stage_N = np.asarray(table.column("stage").to_pylist(), dtype=object)
    scope_N = np.asarray(table.column("scope").to_pylist(), dtype=object)
    index_N = table.column("index").to_numpy()
    layer_N = table.column("layer").to_numpy()
    counts = table.column("counts").combine_chunks()
    values_NE = counts.flatten().to_numpy().reshape(-1, E) if len(counts) else np.zeros((0, E), np.int64)
    for (s, scope), block in blocks.items():
        rows = np.flatnonzero((stage_N == s) & (scope_N == scope))
        idx, lay = index_N[rows], layer_N[rows]
        bad = (idx < 0) | (idx >= block.shape[0]) | (lay < 0) | (lay >= L)
        if bad.any():
            r = rows[np.flatnonzero(bad)[0]]
            raise TraceFormatError(
                f"row {r}: {s} {scope} {index_N[r]} at MoE layer {layer_N[r]} is outside the header's "
                f"{block.shape[0]} {scope}(s) x {L} layers"
            )
        cell = idx.astype(np.int64) * L + lay
        if len(np.unique(cell)) != len(cell):
            raise TraceFormatError(f"a ({s}, {scope}, index, layer) row appears twice")
        if len(cell) != block.shape[0] * L:
            raise TraceFormatError(f"{s} {scope}: {len(cell)} rows, the header asks for {block.shape[0] * L}")
        block.reshape(-1, E)[cell] = values_NE[rows]
    known = {(s, scope) for s in stages for scope in sizes}
    stray = {(str(a), str(b)) for a, b in zip(stage_N, scope_N)} - known
    if stray:
        raise TraceFormatError(f"rows of (stage, scope) {sorted(stray)[:3]} that the header does not list")
    return LoadProfile(
        model=model,
        counts={s: blocks[(s, "window")] for s in stages},
        window_tokens=window,
        datasets=None
        if labels is None
        else {s: {d: blocks[(s, "dataset")][i] for i, d in enumerate(labels)} for s in stages},
        ranks=None if w is None else {s: blocks[(s, "rank")] for s in stages},
        source=source,
    )


# ------------------------------------------------------------------------------- from a trace
def profile_from_trace(
    trace: Trace | str | os.PathLike,
    *,
    window_tokens: int | None = None,
    allow_incomplete: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> LoadProfile:
    """Reduce a trace to its load profile in one streaming pass over its routing rows.

    ``window_tokens``: rows per window, counted over the trace's rows in file order (requests one
    after another, so a window is a slice of requests, not of time); None: one window. Counts every
    recorded id (``-1`` skipped) of the stages the trace recorded, per window and per dataset.
    Memory: one batch of rows plus the counts (``N * L * E`` per stage and ``D * L * E``).
    ``progress(rows_done, rows_total)`` after each batch.
    """
    from moetrace.tracer.trace.reader import Trace, open_trace

    tr = trace if isinstance(trace, Trace) else open_trace(trace, require_complete=not allow_incomplete)
    if window_tokens is not None and (not is_whole(window_tokens) or window_tokens < 1):
        raise ConfigError(f"window tokens must be a whole number >= 1, got {window_tokens!r}")
    m = tr.model
    L, E, K = m.num_moe_layers, m.num_experts, m.top_k
    total_rows = tr.num_tokens()
    N = 1 if window_tokens is None else max(1, -(-total_rows // window_tokens))
    if N * L * E > MAX_CELLS:
        raise ConfigError(
            f"{total_rows:,} rows in windows of {window_tokens:,} make {N:,} windows; with {L} layers x {E} experts "
            f"that is more than {MAX_CELLS:,} counts per stage: use longer windows"
        )
    recorded = [s for s in (STAGE_PREFILL, STAGE_DECODE) if s in stages_of(tr)]
    req = tr.request_arrays if tr.part_names() else None
    labels: list[str] = sorted(set(req.dataset_R.tolist())) if req is not None else []
    dataset_R = np.searchsorted(labels, req.dataset_R) if req is not None else np.zeros(0, np.int64)
    D = len(labels)
    win = {s: np.zeros(N * L * E, np.int64) for s in recorded}
    per_ds = {s: np.zeros(max(D, 1) * L * E, np.int64) for s in recorded}
    layer_cell_LK = (np.arange(L, dtype=np.int64) * E)[:, None].repeat(K, axis=1)
    done = 0
    for b in tr.iter_token_arrays(batch_tokens=1 << 14):
        T = len(b.row_T)
        ids_TLK = b.topk_ids_TLK.astype(np.int64)
        ok_TLK = ids_TLK >= 0
        cell_TLK = layer_cell_LK[None] + ids_TLK
        w_T = (np.arange(done, done + T) // window_tokens) if window_tokens else np.zeros(T, np.int64)
        d_T = dataset_R[b.row_T]
        for s in recorded:
            keep_T = b.is_decode_T if s == STAGE_DECODE else ~b.is_decode_T
            sel = ok_TLK & keep_T[:, None, None]
            base = cell_TLK[sel]
            shape = (T, L, K)
            win[s] += np.bincount(np.broadcast_to((w_T * L * E)[:, None, None], shape)[sel] + base, minlength=N * L * E)
            per_ds[s] += np.bincount(
                np.broadcast_to((d_T * L * E)[:, None, None], shape)[sel] + base, minlength=max(D, 1) * L * E
            )
        done += T
        if progress is not None:
            progress(done, total_rows)
    if progress is not None:
        progress(total_rows, total_rows)
    if not recorded:  # cannot happen: stages_of names at least one
        raise TraceFormatError(f"{tr.path}: records no stage")
    source: dict[str, Any] = {
        "source_format": "moetrace.trace",
        "reduced_from": tr.path.name,  # the trace's name only: the user's directories stay out (privacy)
        "trace_backend": tr.manifest.get("backend", {}).get("name"),
        "num_requests": 0 if req is None else len(req.request_id_R),
        "num_rows": total_rows,
    }
    return LoadProfile(
        model=m,
        counts={s: win[s].reshape(N, L, E) for s in recorded},
        window_tokens=None if window_tokens is None else Window(unit="tokens", size=window_tokens),
        datasets={s: {d: per_ds[s].reshape(-1, L, E)[i] for i, d in enumerate(labels)} for s in recorded}
        if D
        else None,
        source=source,
    )


def profile_summary(path: str | os.PathLike) -> str:
    """The text ``moetrace info`` prints for a profile: model, stages, windows, tokens per stage and dataset."""
    from moetrace.sizes import human_bytes

    p = open_profile(path)
    m = p.model
    win = p.window_tokens
    lines = [
        f"profile    {path}  (moetrace load profile v{PROFILE_VERSION}: expert counts, no requests)",
        f"model      {m.name}  [{m.architecture}]  source {m.source}",
        f"routing    {m.num_moe_layers} MoE layers of {m.num_hidden_layers}, {m.num_experts} experts, top-{m.top_k}"
        + (f", {m.n_group} groups (top-{m.topk_group})" if m.n_group else ""),
        f"source     {p.source}",
        f"windows    {p.num_windows}" + (f" of {win.size:g} {win.unit}" if win is not None else " (the whole capture)"),
        f"ranks      {p.num_ranks if p.num_ranks is not None else 'not recorded'}",
        f"size       {human_bytes(Path(path).stat().st_size)}",
        "",
        f"{'stage':<10} {'dataset':<16} {'tokens per MoE layer (mean)':>28} {'routed ids':>14}",
    ]
    for s in p.stages:
        scopes: list[tuple[str, np.ndarray]] = [("all", p.total(s))]
        if p.datasets is not None:
            scopes += list(p.datasets[s].items())
        for label, c_LE in scopes:
            lines.append(f"{s:<10} {label:<16} {c_LE.sum(-1).mean() / m.top_k:>28,.1f} {int(c_LE.sum()):>14,}")
    if STAGE_MIXED in p.stages:
        lines.append("mixed = prefill and decode counted together (the recorder does not tell them apart)")
    return "\n".join(lines)
