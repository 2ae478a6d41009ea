"""Measured all-to-all kernel tables, read into one typed row (``KernelRow``) for ``moetrace calibrate``
(docs/placement.md, "Calibration").

Sources (each reader a pure function of a file; pyarrow is imported only for Parquet):

- **aiconfigurator** (ai-dynamo/aiconfigurator, Apache-2.0) Parquet tables, detected by their columns:

  - ``wideep_deepep_ll_perf.parquet``: DeepEP low-latency kernels under SGLang
    (``collector/wideep/sglang/collect_deepep_ll.py`` over ``deepep/test_low_latency.py``): per-rank
    ``num_token`` tokens, uniform routing (top-k of random scores), FP8 dispatch (``use_fp8=True``),
    BF16 combine, ``dispatch_avg_t_us`` / ``combine_avg_t_us`` (rank 0's kernel times);
  - ``wideep_deepep_normal_perf.parquet``: DeepEP normal kernels (``collect_deepep_normal.py`` over
    ``deepep/test_intranode.py``; multi-node rows from ``test_internode.py``), swept over SM counts:
    the fastest SM setting per shape is kept, for dispatch and combine separately (``note`` says
    which); ``*_transmit_us`` (a cached layout: the ``notify`` exchange is not included); FP8
    dispatch (the builds are SM90: the BF16 variant would exceed NVLink's bandwidth), BF16 combine.
    ``test_internode.py`` routes group-limited (top-k within the ``min(nodes, 4)`` nodes of highest
    score): rows of more than 4 nodes get ``routing="grouped:4"``;
  - ``trtllm_alltoall_perf.parquet``: TensorRT-LLM's NVLink all-to-all on GB200
    (``collector/network/slurm/collect_trtllm_alltoall.py``): ``NVLinkTwoSided`` (WideEP, MNNVL:
    one NVLink domain over the whole EP group) rows, dispatch in the run's ``moe_dtype`` (bf16,
    fp8, nvfp4), combine BF16 without reduction, ``latency`` in milliseconds, the collector's
    *balanced* routing (``routing="balanced"``: token ``i`` to the ``k`` GPUs of group ``i % (W/k)``).

  GPUs per node (the NVLink domain of the DeepEP rows): 4 on GB200/GB300, 8 elsewhere
  (``collect_deepep_ll.py``: "full node: 4 on GB200, 8 on B200/H200"), EP size =
  ``node_num * gpus_per_node``.
- **the user CSV** (also DeepEP's published table, ``data/kernels/deepep_legacy_ll.csv``): ``#``
  comment lines, then a header with the columns of ``CSV_COLUMNS`` (any order) and optionally
  ``routing`` (``uniform``, the default, or ``balanced``) and ``note``; one row per measurement.
  An empty ``dispatch_us`` or ``combine_us`` means "not measured" (NaN; that phase's fit skips it).

Routing (``KernelRow.routing``): ``uniform`` (top-k distinct experts, uniform), ``balanced``
(TensorRT-LLM's collector) or ``grouped:N`` (DeepSeek's group-limited routing with one group per
node: the N nodes of highest expert score, then the top-k experts on them).

A table row the kernels could not have run (experts not a multiple of the EP size: DeepEP asserts
it) is skipped with a note (``skipped``), not read: aiconfigurator's 8-node low-latency rows of
288 experts are such rows.

Out of scope: fitting and predicting (``calibrate``).
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from moetrace.errors import ConfigError

__all__ = [
    "KERNELS",
    "KERNEL_COPIES",
    "CSV_COLUMNS",
    "VALUE_NAMES",
    "ROUTINGS",
    "GPUS_PER_NODE",
    "gpus_per_node_of",
    "KernelRow",
    "read_table",
    "read_csv",
    "read_aiconfigurator",
    "rows_from_aiconfigurator",
    "vendored_tables",
    "write_csv",
]

#: kernel families and the copy model each sends with (``step_model.COPY_MODELS``)
KERNEL_COPIES = {"deepep-ll": "expert", "deepep-normal": "node", "trtllm-a2a": "rank"}
KERNELS = tuple(KERNEL_COPIES)
#: value types a row may name (``step_model.VALUE_TYPES`` plus NVFP4)
VALUE_NAMES = ("fp8", "bf16", "nvfp4")
ROUTINGS = ("uniform", "balanced", "grouped:N")
#: the columns of the user CSV, in the order ``write_csv`` writes them
CSV_COLUMNS = (
    "kernel",
    "gpu",
    "ep_size",
    "gpus_per_node",
    "hidden",
    "top_k",
    "num_experts",
    "tokens_per_rank",
    "dispatch_type",
    "combine_type",
    "dispatch_us",
    "combine_us",
)
_OPTIONAL_COLUMNS = ("routing", "note")
#: GPUs per node (NVLink domain of the single-node tables) by GPU kind; 8 for any other kind
GPUS_PER_NODE = {"gb200": 4, "gb300": 4}


def gpus_per_node_of(gpu: str) -> int:
    """GPUs in one node of ``gpu`` (4 on GB200/GB300, 8 otherwise)."""
    return GPUS_PER_NODE.get(gpu.lower(), 8)


@dataclass(frozen=True, kw_only=True)
class KernelRow:
    """One measured (or to-be-predicted) all-to-all shape: a kernel at one EP size and token count."""

    kernel: str  # KERNELS
    gpu: str  # "h100", "h200", "b200", "gb200", "h800", ...
    source: str  # the file (and line) it came from
    ep_size: int  # GPUs in the EP group (W)
    gpus_per_node: int  # GPUs sharing one NVLink domain (1: every copy over the network)
    hidden: int
    top_k: int
    num_experts: int
    tokens_per_rank: int
    dispatch_type: str  # VALUE_NAMES
    combine_type: str
    dispatch_us: float  # NaN: not measured
    combine_us: float
    routing: str = "uniform"  # ROUTINGS: how the benchmark chose experts
    note: str = ""  # what else the source says (SM counts chosen, ...)

    @property
    def copies(self) -> str:
        """The copy model of the row's kernel."""
        return KERNEL_COPIES[self.kernel]

    @property
    def nodes(self) -> int:
        return self.ep_size // self.gpus_per_node

    def settings(self) -> dict[str, Any]:
        """The row's settings (everything but the measured times), for a JSON ``rows`` entry."""
        d = asdict(self)
        del d["dispatch_us"], d["combine_us"]
        return d

    def check(self, where: str) -> KernelRow:
        """``self`` if consistent, else ``ConfigError`` naming ``where``."""
        if self.kernel not in KERNEL_COPIES:
            raise ConfigError(f"{where}: unknown kernel {self.kernel!r}; use one of {', '.join(KERNELS)}")
        for name in ("ep_size", "gpus_per_node", "hidden", "top_k", "num_experts", "tokens_per_rank"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}: `{name}` must be >= 1, got {getattr(self, name)}")
        if self.ep_size % self.gpus_per_node:
            raise ConfigError(
                f"{where}: ep_size {self.ep_size} is not a whole number of nodes of {self.gpus_per_node} GPUs"
            )
        if self.num_experts % self.ep_size or self.top_k > self.num_experts:
            raise ConfigError(
                f"{where}: {self.num_experts} experts do not divide over {self.ep_size} GPUs with top-{self.top_k} "
                "(experts must be a multiple of ep_size, top_k <= experts)"
            )
        for name in ("dispatch_type", "combine_type"):
            if getattr(self, name) not in VALUE_NAMES:
                raise ConfigError(f"{where}: `{name}` {getattr(self, name)!r} is not one of {', '.join(VALUE_NAMES)}")
        m = re.fullmatch(r"grouped:(\d{1,9})", self.routing, re.ASCII)  # ASCII digits, a count int() reads
        if self.routing not in ("uniform", "balanced") and not (m and 1 <= int(m.group(1)) <= self.nodes):
            raise ConfigError(
                f"{where}: `routing` {self.routing!r} is not uniform, balanced or grouped:N (N <= nodes = {self.nodes})"
            )
        for name in ("dispatch_us", "combine_us"):
            v = getattr(self, name)
            if not (math.isnan(v) or (v > 0 and math.isfinite(v))):
                raise ConfigError(f"{where}: `{name}` must be a positive time in microseconds (or empty), got {v}")
        return self


# ------------------------------------------------------------------------------ the user CSV
_INT_COLUMNS = ("ep_size", "gpus_per_node", "hidden", "top_k", "num_experts", "tokens_per_rank")
_FLOAT_COLUMNS = ("dispatch_us", "combine_us")


def read_csv(path: str | Path, *, text: str | None = None) -> list[KernelRow]:
    """Rows of a user CSV (module docstring); ``ConfigError`` naming the file, line and column of
    anything wrong. ``text``: the file's content, already read."""
    path = Path(path)
    name = path.name
    if text is None:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read kernel table {path}: {e}") from None
    lines = [(i + 1, ln) for i, ln in enumerate(text.splitlines()) if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise ConfigError(f"{name}: no header line; the first line must name the columns: {','.join(CSV_COLUMNS)}")
    header_no, header_line = lines[0]
    header = [h.strip() for h in next(csv.reader([header_line]))]
    missing = [c for c in CSV_COLUMNS if c not in header]
    unknown = [c for c in header if c not in CSV_COLUMNS and c not in _OPTIONAL_COLUMNS]
    if missing or unknown:
        what = (f"missing column(s) {', '.join(missing)}" if missing else "") + (
            ("; " if missing and unknown else "") + f"unknown column(s) {', '.join(unknown)}" if unknown else ""
        )
        raise ConfigError(f"{name}:{header_no}: {what}; the header is {','.join(CSV_COLUMNS)}[,routing][,note]")
    if len(set(header)) != len(header):
        raise ConfigError(f"{name}:{header_no}: a column is named twice")
    rows = []
    for line_no, line in lines[1:]:
        cells = [c.strip() for c in next(csv.reader([line]))]
        where = f"{name}:{line_no}"
        if len(cells) != len(header):
            raise ConfigError(f"{where}: {len(cells)} values for {len(header)} columns")
        rec = dict(zip(header, cells, strict=True))
        kw: dict[str, Any] = {}
        for col in _INT_COLUMNS:
            try:
                kw[col] = int(rec[col])
            except ValueError:
                raise ConfigError(f"{where}: column `{col}`: {rec[col]!r} is not a whole number") from None
        for col in _FLOAT_COLUMNS:
            if rec[col] == "":
                kw[col] = math.nan
                continue
            try:
                kw[col] = float(rec[col])
            except ValueError:
                raise ConfigError(f"{where}: column `{col}`: {rec[col]!r} is not a time in microseconds") from None
        row = KernelRow(
            kernel=rec["kernel"],
            gpu=rec["gpu"].lower(),
            source=where,
            dispatch_type=rec["dispatch_type"].lower(),
            combine_type=rec["combine_type"].lower(),
            routing=(rec.get("routing") or "uniform").lower(),
            note=rec.get("note", ""),
            **kw,
        )
        rows.append(row.check(where))
    if not rows:
        raise ConfigError(f"{name}: a header but no rows")
    return rows


def write_csv(rows: Iterable[KernelRow], *, comments: Sequence[str] = ()) -> str:
    """The user CSV of ``rows`` (``read_csv`` reads it back), ``comments`` as ``#`` lines on top."""
    out = io.StringIO()
    for c in comments:
        out.write(f"# {c}\n")
    w = csv.writer(out, lineterminator="\n")
    w.writerow([*CSV_COLUMNS, "routing", "note"])
    for r in rows:
        w.writerow([*(_fmt(getattr(r, c)) for c in CSV_COLUMNS), r.routing, r.note])
    return out.getvalue()


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return str(v)


# ------------------------------------------------------------------------------ aiconfigurator
_DEVICE_GPU = (  # (pattern in the `device` column, GPU kind): most specific first
    (r"GB300", "gb300"),
    (r"GB200", "gb200"),
    (r"B300", "b300"),
    (r"B200", "b200"),
    (r"H200", "h200"),
    (r"H100", "h100"),
    (r"H800", "h800"),
    (r"H20", "h20"),
)


def _gpu_of_device(device: str) -> str:
    for pat, gpu in _DEVICE_GPU:
        if re.search(pat, device, re.IGNORECASE):
            return gpu
    return re.sub(r"[^a-z0-9]+", "-", device.lower().removeprefix("nvidia ")).strip("-") or "unknown"


def _need(cols: dict[str, list], names: Sequence[str], where: str) -> None:
    missing = [c for c in names if c not in cols]
    if missing:
        raise ConfigError(f"{where}: missing column(s) {', '.join(missing)}")


def rows_from_aiconfigurator(
    cols: dict[str, list], *, source: str, gpu: str | None = None, skipped: list[str] | None = None
) -> list[KernelRow]:
    """Rows of one aiconfigurator table given as columns (name -> list of values), detected by its
    columns (module docstring). ``gpu`` overrides the kind read from the ``device`` column; rows
    that cannot have run are left out, one line each appended to ``skipped``."""

    def kind(i: int) -> str:
        return gpu or _gpu_of_device(str(cols["device"][i]) if "device" in cols else "unknown")

    n = len(next(iter(cols.values()))) if cols else 0
    rows: list[KernelRow] = []
    if "dispatch_avg_t_us" in cols:  # DeepEP low latency
        _need(cols, ("node_num", "hidden_size", "num_token", "num_topk", "num_experts", "combine_avg_t_us"), source)
        for i in range(n):
            g = gpus_per_node_of(kind(i))
            rows.append(
                KernelRow(
                    kernel="deepep-ll",
                    gpu=kind(i),
                    source=source,
                    ep_size=int(cols["node_num"][i]) * g,
                    gpus_per_node=g,
                    hidden=int(cols["hidden_size"][i]),
                    top_k=int(cols["num_topk"][i]),
                    num_experts=int(cols["num_experts"][i]),
                    tokens_per_rank=int(cols["num_token"][i]),
                    dispatch_type="fp8",
                    combine_type="bf16",
                    dispatch_us=float(cols["dispatch_avg_t_us"][i]),
                    combine_us=float(cols["combine_avg_t_us"][i]),
                )
            )
    elif "dispatch_transmit_us" in cols:  # DeepEP normal: the fastest SM setting per shape
        _need(
            cols,
            ("node_num", "hidden_size", "num_token", "num_topk", "num_experts", "combine_transmit_us", "dispatch_sms"),
            source,
        )
        best: dict[tuple, list] = {}  # shape -> [dispatch us, its SMs, combine us, its SMs]
        for i in range(n):
            key = (kind(i), int(cols["node_num"][i]), int(cols["hidden_size"][i]), int(cols["num_topk"][i]),
                   int(cols["num_experts"][i]), int(cols["num_token"][i]))  # fmt: skip
            d, c = float(cols["dispatch_transmit_us"][i]), float(cols["combine_transmit_us"][i])
            ds = int(cols["dispatch_sms"][i])
            cs = int(cols["combine_sms"][i]) if "combine_sms" in cols else ds
            b = best.setdefault(key, [math.inf, 0, math.inf, 0])
            if d > 0 and d < b[0]:
                b[0], b[1] = d, ds
            if c > 0 and c < b[2]:
                b[2], b[3] = c, cs
        for (g_kind, nodes, hidden, k, e, t), (d, ds, c, cs) in best.items():
            g = gpus_per_node_of(g_kind)
            groups = min(nodes, 4)  # test_internode.py: --num-topk-groups defaults to min(num_nodes, 4)
            rows.append(
                KernelRow(
                    kernel="deepep-normal",
                    gpu=g_kind,
                    source=source,
                    ep_size=nodes * g,
                    gpus_per_node=g,
                    hidden=hidden,
                    top_k=k,
                    num_experts=e,
                    tokens_per_rank=t,
                    dispatch_type="fp8",
                    combine_type="bf16",
                    dispatch_us=d if math.isfinite(d) else math.nan,
                    combine_us=c if math.isfinite(c) else math.nan,
                    routing="uniform" if groups == nodes else f"grouped:{groups}",
                    note=f"fastest SMs: dispatch {ds}, combine {cs}",
                )
            )
    elif "latency" in cols and "op_name" in cols:  # TensorRT-LLM NVLink all-to-all
        _need(
            cols,
            ("kernel_source", "moe_dtype", "num_tokens", "hidden_size", "topk", "num_experts", "moe_ep_size"),
            source,
        )
        dtype = {"bfloat16": "bf16", "bf16": "bf16", "fp8": "fp8", "nvfp4": "nvfp4"}
        meas: dict[tuple[str, int, int, int, int, int, str], dict[str, float]] = {}
        for i in range(n):
            if cols["kernel_source"][i] != "NVLinkTwoSided":
                continue  # the one-sided (CutlassMoE) kernels: a different kernel, left out
            op = str(cols["op_name"][i])
            if op not in ("alltoall_dispatch", "alltoall_combine"):
                continue  # prepare (routing metadata) and the low-precision combine are other kernels
            dt = dtype.get(str(cols["moe_dtype"][i]))
            if dt is None:
                raise ConfigError(f"{source}: unknown moe_dtype {cols['moe_dtype'][i]!r}")
            mkey = (kind(i), int(cols["moe_ep_size"][i]), int(cols["hidden_size"][i]), int(cols["topk"][i]),
                   int(cols["num_experts"][i]), int(cols["num_tokens"][i]), dt)  # fmt: skip
            meas.setdefault(mkey, {})[op] = float(cols["latency"][i]) * 1e3  # ms -> us
        for (g_kind, ep, hidden, k, e, t, dt), m in meas.items():
            rows.append(
                KernelRow(
                    kernel="trtllm-a2a",
                    gpu=g_kind,
                    source=source,
                    ep_size=ep,
                    gpus_per_node=ep,  # MNNVL: the whole EP group is one NVLink domain
                    hidden=hidden,
                    top_k=k,
                    num_experts=e,
                    tokens_per_rank=t,
                    dispatch_type=dt,
                    combine_type="bf16",
                    dispatch_us=m.get("alltoall_dispatch", math.nan),
                    combine_us=m.get("alltoall_combine", math.nan),
                    routing="balanced",
                    note="NVLinkTwoSided",
                )
            )
    else:
        raise ConfigError(
            f"{source}: not an aiconfigurator all-to-all table (wideep_deepep_ll_perf, wideep_deepep_normal_perf "
            "or trtllm_alltoall_perf columns)"
        )
    kept: list[KernelRow] = []
    bad: dict[tuple[str, str, int, int, int], int] = {}
    for r in rows:
        if r.num_experts % r.ep_size:
            bkey = (r.kernel, r.gpu, r.ep_size, r.nodes, r.num_experts)
            bad[bkey] = bad.get(bkey, 0) + 1
            continue
        kept.append(r.check(source))
    if skipped is not None:
        for (kernel, g_kind, ep, nodes, e), count in bad.items():
            skipped.append(
                f"{source}: {count} {kernel} {g_kind} rows at EP{ep} ({nodes} nodes) with {e} experts left out: "
                "experts not a multiple of the EP size (the kernel asserts it)"
            )
    return kept


def read_aiconfigurator(
    path: str | Path, *, gpu: str | None = None, data: bytes | None = None, skipped: list[str] | None = None
) -> list[KernelRow]:
    """Rows of an aiconfigurator Parquet table (``rows_from_aiconfigurator``); ``data``: its bytes."""
    from moetrace._deps import require

    pq = require("pyarrow.parquet", purpose="reading aiconfigurator's Parquet tables")
    path = Path(path)
    try:
        table = pq.read_table(io.BytesIO(data) if data is not None else path)
    except Exception as e:  # pyarrow raises several kinds for a file that is not Parquet
        raise ConfigError(f"cannot read {path.name} as Parquet: {e}") from None
    return rows_from_aiconfigurator(table.to_pydict(), source=path.name, gpu=gpu, skipped=skipped)


def read_table(path: str | Path, *, gpu: str | None = None, skipped: list[str] | None = None) -> list[KernelRow]:
    """Rows of any supported table: ``.parquet`` (aiconfigurator) or ``.csv`` (the user CSV, DeepEP's)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"kernel table {path} does not exist (give aiconfigurator .parquet files or a .csv)")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return read_aiconfigurator(path, gpu=gpu, skipped=skipped)
    if suffix in (".csv", ".txt"):
        return read_csv(path)
    with path.open("rb") as f:
        head = f.read(4)
    if head == b"PAR1":
        return read_aiconfigurator(path, gpu=gpu, skipped=skipped)
    return read_csv(path)


# ------------------------------------------------------------------------------ the vendored tables
#: the measured tables bundled in ``moetrace/data/kernels/`` per GPU kind (data/kernels/README.md)
VENDORED = {
    "h100": (
        "h100_sxm.sglang-0.5.12.wideep_deepep_ll_perf.parquet",
        "h100_sxm.sglang-0.5.12.wideep_deepep_normal_perf.fastest_sms.parquet",
        "h100_sxm.sglang-0.5.6.post2.wideep_deepep_ll_perf.parquet",
        "h100_sxm.sglang-0.5.6.post2.wideep_deepep_normal_perf.fastest_sms.parquet",
    ),
    "h200": (
        "h200_sxm.sglang-0.5.12.wideep_deepep_ll_perf.parquet",
        "h200_sxm.sglang-0.5.12.wideep_deepep_normal_perf.fastest_sms.parquet",
    ),
    "b200": (
        "b200_sxm.sglang-0.5.12.wideep_deepep_ll_perf.parquet",
        "b200_sxm.sglang-0.5.12.wideep_deepep_normal_perf.fastest_sms.parquet",
    ),
    "gb200": (
        "gb200.sglang-0.5.12.wideep_deepep_ll_perf.parquet",
        "gb200.sglang-0.5.12.wideep_deepep_normal_perf.fastest_sms.parquet",
        "gb200.trtllm-1.3.0rc10.trtllm_alltoall_perf.parquet",
    ),
    "h800": ("deepep_legacy_ll.csv", "deepep_ll_pure_rdma_2025_02.csv"),
}


def vendored_tables(gpu: str, *, skipped: list[str] | None = None) -> list[KernelRow]:
    """The bundled measured rows of one GPU kind (``VENDORED``)."""
    gpu = gpu.lower()
    if gpu not in VENDORED:
        raise ConfigError(f"no bundled kernel tables for {gpu!r}; bundled: {', '.join(VENDORED)} (or give table files)")
    rows: list[KernelRow] = []
    base = resources.files("moetrace.data").joinpath("kernels")
    for name in VENDORED[gpu]:
        f = base.joinpath(name)
        if name.endswith(".parquet"):
            rows += read_aiconfigurator(Path(name), data=f.read_bytes(), gpu=gpu, skipped=skipped)
        else:
            rows += read_csv(Path(name), text=f.read_text(encoding="utf-8"))
    return rows
