"""Replay placements through real ``torch.distributed.all_to_all_single`` collectives (``moetrace a2a``).

One process per EP rank. ``build_plan`` draws the same held-out global batches as ``compare``
(``compare._batches``, same seed), places each strategy (or reads placement files), and computes the
per-(batch, layer) send matrices (``a2a.send_matrices``), checked exactly against
``simulate_volume``. ``run_rank`` then, on every rank, for every strategy, batch and MoE layer:
builds the real dispatch buffer (one row of ``hidden_size`` values of ``dtype`` per token copy it
sends, stamped with its rank), calls ``all_to_all_single`` for dispatch and again for combine
(the received rows go back, reverse splits), times each (barrier first; ``perf_counter`` on gloo,
CUDA events on NCCL), checks every received row came from the rank it should, and records the
bytes of every split it actually sent. Rank 0 gathers the records (``gather_object``).

Ranks start either from torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in the
environment; ``moetrace a2a --torchrun``) or from ``launch_local``, which spawns them on this
machine with an ``env://`` rendezvous on a free port. Backend ``gloo`` runs on CPU (bytes exact,
times are loopback times); ``nccl`` needs one GPU per rank.

Shape legend (docs/architecture.md): B batches, L MoE layers, W EP ranks (GPUs), V strategies.

Out of scope: emulating slow inter-node links on one machine (no network namespaces: every link is
local, so measured *times* of a local run do not separate intra- from inter-node); the tensor
parallelism inside an EP rank (``TPd``: one process per EP rank); the expert computation itself.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np

from moetrace import results as rf
from moetrace.errors import ConfigError, MoetraceError, TraceFormatError
from moetrace.placement.a2a import A2AMismatchError, check_against_simulator, rank_link_bytes, send_matrices
from moetrace.placement.compare import CompareConfig, PlacedStrategy, TraceData, _batches, place_strategies
from moetrace.placement.grouping import groups_of_clusters, predict_clusters
from moetrace.placement.simulate import simulate_volume

__all__ = [
    "A2APlan", "A2ARunError", "Backend", "build_plan", "choose_backend", "first_mismatch", "format_summary",
    "launch_local", "placed_from_file", "raise_on_mismatch", "result_table", "run_a2a", "run_rank", "summary_rows",
    "write_a2a_results",
]

Backend = Literal["gloo", "nccl", "auto"]
PHASES = ("dispatch", "combine")
#: bytes per value on the wire of each supported dtype
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class A2ARunError(MoetraceError):
    "A rank of the collective replay failed (the message carries its last error line)."


@dataclass(frozen=True, kw_only=True)
class A2APlan:
    """Everything every rank needs to replay the collectives (pickled to each process)."""

    strategies: tuple[str, ...]  # V names, in run order
    sends_VBLWW: np.ndarray  # int64 [V, B, L, W, W] token copies src -> dst in dispatch (combine: transpose)
    sim_intra_VBL: np.ndarray  # float64 [V, B, L] simulator's dispatch intra-node bytes (combine equal)
    sim_inter_VBL: np.ndarray  # float64 [V, B, L] simulator's dispatch inter-node bytes (combine equal)
    ranks_per_node: int  # EP ranks per node; link (src, dst) is inter-node when their nodes differ
    hidden_size: int  # values per token row
    dtype: str  # a key of DTYPE_BYTES
    backend: str  # "gloo" or "nccl" (resolved, never "auto")
    warmup: int = 1  # untimed collectives before the first timed one
    model_layers: tuple[int, ...] = ()  # the model's index of each MoE layer, [L]
    config: dict[str, Any] = field(default_factory=dict)  # provenance written to a2a.json

    @property
    def world_size(self) -> int:
        return int(self.sends_VBLWW.shape[-1])

    @property
    def bytes_per_token(self) -> int:
        return self.hidden_size * DTYPE_BYTES[self.dtype]


# ---- the plan: batches, placements, send matrices ---------------------------------------------------
def placed_from_file(data: TraceData, cfg: CompareConfig, pf: Any, *, where: str) -> PlacedStrategy:
    """A ``PlacedStrategy`` from a loaded placement file ``pf`` (``exports.PlacementFile``), checked
    against the trace and deployment; a file with a grouping routes held-out requests by its prefill
    centroids (as ``compare`` does)."""
    m, dep = data.model, cfg.deployment
    L, P = pf.placement.phy2log.shape
    if L != m.num_moe_layers or int(pf.model["num_experts"]) != m.num_experts:
        raise TraceFormatError(f"{where}: placement of {L} MoE layers x {pf.model['num_experts']} experts; the trace has "
                               f"{m.num_moe_layers} x {m.num_experts} (place it from this trace's model)")
    if P % dep.num_ep or int(pf.deployment.get("num_ep", dep.num_ep)) != dep.num_ep:
        raise ConfigError(f"{where}: placement for EP{pf.deployment.get('num_ep')} ({P} slots); --config {dep.name} has "
                          f"EP{dep.num_ep} (re-run `moetrace place` with this --config)")
    g = pf.grouping
    if not g or "prefill_centroids" not in g:
        return PlacedStrategy(strategy=pf.strategy, placement=pf.placement)
    R = len(data.is_test_R)
    pred_R = predict_clusters(data.prefill_RLE.reshape(R, -1), np.asarray(g["prefill_centroids"], dtype=np.float64))
    return PlacedStrategy(strategy=pf.strategy, placement=pf.placement,
                          group_of_test_R=groups_of_clusters(pred_R, g["cluster_to_groups"]))


def build_plan(
    data: TraceData,
    *,
    cfg: CompareConfig,
    placed: dict[str, PlacedStrategy] | None = None,
    hidden_size: int = 0,
    dtype: str = "bfloat16",
    backend: str = "gloo",
) -> A2APlan:
    """The send matrices of every strategy over ``cfg.num_batches`` held-out global batches.

    ``placed``: name -> placement (e.g. from files); None: build ``cfg.strategies`` from the trace's
    training requests (``compare.place_strategies``). ``hidden_size`` 0: the model's. Raises
    ``A2AMismatchError`` if a matrix disagrees with ``simulate_volume`` (a bug, never expected).
    """
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    dep, m = cfg.deployment, data.model
    H = hidden_size or int(m.hidden_size)
    if H < 1:
        raise ConfigError(f"--hidden-size must be >= 1, got {H}")
    if placed is None:
        placed = place_strategies(data, cfg, cfg.strategies)
    bpt = H * DTYPE_BYTES[dtype]
    sends, intra, inter = [], [], []
    for name, ps in placed.items():
        rows, batch, src, _ = _batches(data, cfg, ps.group_of_test_R)
        kw = dict(placement=ps.placement, batch_T=batch, src_rank_T=src, num_batches=cfg.num_batches,
                  num_ranks=dep.num_ep, ranks_per_node=dep.ranks_per_node, dedup=cfg.dedup, policy=cfg.replica_policy)
        ids = data.test_topk_ids_TLK[rows]
        s_BLWW = send_matrices(ids, **kw)
        sim = simulate_volume(ids, bytes_per_token=bpt, **kw)
        check_against_simulator(s_BLWW, sim, ranks_per_node=dep.ranks_per_node, bytes_per_token=bpt, label=name)
        sends.append(s_BLWW)
        intra.append(sim["dispatch_intra_bytes"])
        inter.append(sim["dispatch_inter_bytes"])
    conf = {
        "deployment": dep.name, "gpus_per_node": dep.num_gpus_per_node, "num_ep": dep.num_ep, "num_nodes": dep.num_nodes,
        "ranks_per_node": dep.ranks_per_node, "num_batches": cfg.num_batches, "batch_requests": cfg.batch_requests,
        "dedup": cfg.dedup, "replica_policy": cfg.replica_policy, "seed": cfg.seed, "test_fraction": cfg.test_fraction,
        "trace": data.trace_path, "model": m.to_dict(),
    }
    return A2APlan(
        strategies=tuple(placed), sends_VBLWW=np.stack(sends), sim_intra_VBL=np.stack(intra), sim_inter_VBL=np.stack(inter),
        ranks_per_node=dep.ranks_per_node, hidden_size=H, dtype=dtype, backend=backend,
        model_layers=tuple(int(x) for x in m.moe_layers), config=conf,
    )


def choose_backend(backend: Backend, *, world_size: int, torchrun: bool) -> str:
    """``gloo`` or ``nccl``; ``auto`` takes nccl when there is a GPU per rank on this machine (under
    torchrun: any GPU). Raises ``ConfigError`` for nccl without enough GPUs, saying what to do."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = 1 if torchrun else world_size
    if backend == "auto":
        return "nccl" if n >= need else "gloo"
    if backend == "nccl" and n < need:
        raise ConfigError(
            f"--backend nccl needs one GPU per rank: {world_size} ranks, {n} GPU(s) visible here; run on a node with "
            f"{world_size} GPUs (or across nodes: torchrun --nnodes ... -m moetrace a2a --torchrun), or use --backend gloo "
            "to measure the bytes on CPU"
        )
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"--backend {backend!r} is not gloo, nccl or auto")
    return backend


# ---- one rank ---------------------------------------------------------------------------------------
def run_rank(rank: int, world_size: int, plan: A2APlan) -> list[dict[str, Any]] | None:
    """Replay ``plan`` as EP rank ``rank``; rank 0 returns every rank's record (others None).

    Initializes ``torch.distributed`` from ``env://`` unless a process group already exists (then
    uses and keeps it). A record: ``rank``, ``sent_VBL2W`` / ``recv_VBL2W`` (int64 bytes sent to /
    received from each rank, phase axis dispatch, combine), ``seconds_VBL2`` (float64 per collective),
    ``payload_errors`` (rows that arrived from the wrong rank), ``device``.
    """
    import torch
    import torch.distributed as dist

    if plan.world_size != world_size:
        raise ConfigError(f"{world_size} ranks started but the deployment has EP{plan.world_size}; start one process per EP rank")
    if plan.backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    own = not dist.is_initialized()
    if own:
        dist.init_process_group(plan.backend, init_method="env://", rank=rank, world_size=world_size)
    try:
        rec = _replay(rank, plan, device)
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(rec, gathered, dst=0)
        return gathered
    finally:
        if own:
            dist.destroy_process_group()


def _replay(rank: int, plan: A2APlan, device: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    V, B, L, W, _ = plan.sends_VBLWW.shape
    dt = getattr(torch, plan.dtype)
    cuda = device.type == "cuda"
    stamp_W = torch.tensor([float(w % 200 + 1) for w in range(W)], dtype=dt, device=device)  # exact in bf16
    out_rows = int(plan.sends_VBLWW[..., rank].sum(-1).max(initial=0))  # most rows this rank receives in dispatch
    in_rows = int(plan.sends_VBLWW[..., rank, :].sum(-1).max(initial=0))  # most rows it sends
    send_buf = torch.full((max(in_rows, 1), plan.hidden_size), float(stamp_W[rank]), dtype=dt, device=device)
    recv_buf = torch.empty((max(out_rows, 1), plan.hidden_size), dtype=dt, device=device)
    back_buf = torch.empty_like(send_buf)
    sent = np.zeros((V, B, L, 2, W), dtype=np.int64)
    recv = np.zeros((V, B, L, 2, W), dtype=np.int64)
    secs = np.zeros((V, B, L, 2))
    errors: list[str] = []

    def collective(out, inp, out_splits, in_splits) -> float:
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_to_all_single(out, inp, out_splits, in_splits)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        dist.all_to_all_single(out, inp, out_splits, in_splits)
        return time.perf_counter() - t0

    def nbytes(t, splits) -> np.ndarray:  # bytes of each split of the tensor actually passed
        return np.array([c.numel() * c.element_size() for c in torch.split(t, splits)], dtype=np.int64)

    def check(t, splits, want_W, what) -> None:
        want = torch.repeat_interleave(want_W, torch.tensor(splits, device=device))
        if not bool(t.eq(want[:, None]).all()) and len(errors) < 5:
            errors.append(f"rank {rank} {what}: a received row does not carry the stamp of the rank that should send it")

    for _ in range(plan.warmup):
        s = plan.sends_VBLWW[0, 0, 0]
        collective(recv_buf[: int(s[:, rank].sum())], send_buf[: int(s[rank].sum())], s[:, rank].tolist(), s[rank].tolist())
    for v in range(V):
        for b in range(B):
            for l in range(L):
                s = plan.sends_VBLWW[v, b, l]
                to_W, from_W = s[rank].tolist(), s[:, rank].tolist()  # rows sent to / received from each rank
                inp, out = send_buf[: sum(to_W)], recv_buf[: sum(from_W)]
                secs[v, b, l, 0] = collective(out, inp, from_W, to_W)
                sent[v, b, l, 0], recv[v, b, l, 0] = nbytes(inp, to_W), nbytes(out, from_W)
                back = back_buf[: sum(to_W)]
                secs[v, b, l, 1] = collective(back, out, to_W, from_W)  # combine: the received rows go back
                sent[v, b, l, 1], recv[v, b, l, 1] = nbytes(out, from_W), nbytes(back, to_W)
                where = f"{plan.strategies[v]} batch {b} layer {l}"
                check(out, from_W, stamp_W, f"{where} dispatch")
                check(back, to_W, stamp_W[rank].repeat(W), f"{where} combine")
    return {"rank": rank, "sent_VBL2W": sent, "recv_VBL2W": recv, "seconds_VBL2": secs, "payload_errors": errors,
            "device": str(torch.cuda.get_device_name(device) if cuda else "cpu"), "host": socket.gethostname()}


# ---- starting the ranks ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned(rank: int, world_size: int, port: int, fn: Callable, args: tuple, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    value = fn(rank, world_size, *args)
    if rank == 0:
        with open(result, "wb") as f:
            pickle.dump(value, f)


def launch_local(world_size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes on this machine (spawned,
    ``env://`` rendezvous on a free local port) and return rank 0's return value. A failing rank
    raises ``A2ARunError`` with its last error line."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="moetrace-a2a-") as d:
        result = str(Path(d) / "rank0.pkl")
        try:
            mp.spawn(_spawned, args=(world_size, _free_port(), fn, args, result), nprocs=world_size, join=True)
        except mp.ProcessRaisedException as exc:
            lines = [x for x in str(exc).splitlines() if x.strip()]
            raise A2ARunError(f"a rank failed: {lines[-1].strip() if lines else exc}") from None
        except mp.ProcessExitedException as exc:
            raise A2ARunError(f"a rank died: {exc}") from None
        with open(result, "rb") as f:
            return pickle.load(f)


def run_a2a(plan: A2APlan, *, torchrun: bool = False) -> list[dict[str, Any]] | None:
    """Run the replay: in this process as one rank of a torchrun job (``torchrun``; returns the
    records on rank 0, None elsewhere), or as ``plan.world_size`` local processes (returns the records)."""
    if torchrun:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ConfigError("--torchrun: RANK and WORLD_SIZE are not set; start the command with torchrun "
                              "(torchrun --nproc-per-node N -m moetrace a2a ... --torchrun)")
        return run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), plan)
    return launch_local(plan.world_size, run_rank, plan)


# ---- results ---------------------------------------------------------------------------------------
def _measured(plan: A2APlan, records: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Measured (intra, inter) bytes each rank sent, int64 [V, B, L, 2, W] (phase axis: dispatch, combine)."""
    W = plan.world_size
    node_W = np.arange(W) // plan.ranks_per_node
    sent = np.stack([r["sent_VBL2W"] for r in sorted(records, key=lambda r: r["rank"])], axis=-2)  # [V,B,L,2,W src,W dst]
    inter_WW = node_W[:, None] != node_W[None, :]
    return (sent * ~inter_WW).sum(-1), (sent * inter_WW).sum(-1)


def _predicted(plan: A2APlan) -> tuple[np.ndarray, np.ndarray]:
    """Predicted (intra, inter) bytes each rank sends, int64 [V, B, L, 2, W], from the send matrices."""
    out = [[rank_link_bytes(s, phase=p, ranks_per_node=plan.ranks_per_node, bytes_per_token=plan.bytes_per_token)
            for p in PHASES] for s in plan.sends_VBLWW]
    return (np.stack([np.stack([o[0] for o in v], axis=2) for v in out]),
            np.stack([np.stack([o[1] for o in v], axis=2) for v in out]))


def first_mismatch(plan: A2APlan, records: list[dict[str, Any]]) -> str | None:
    """The first collective whose measured bytes (per rank and link class) differ from the prediction,
    or whose received rows came from the wrong rank, as one line; None when all match exactly."""
    errors = [e for r in records for e in r["payload_errors"]]
    if errors:
        return errors[0]
    mi, me = _measured(plan, records)
    pi, pe = _predicted(plan)
    for cls, got, want in (("intra", mi, pi), ("inter", me, pe)):
        bad = np.argwhere(got != want)
        if len(bad):
            v, b, l, p, w = (int(x) for x in bad[0])
            return (f"{plan.strategies[v]} batch {b} layer {l} {PHASES[p]} rank {w}: measured {int(got[v, b, l, p, w])} "
                    f"{cls}-node bytes, predicted {int(want[v, b, l, p, w])} ({len(bad)} (collective, rank) pairs differ)")
    return None


def result_table(plan: A2APlan, records: list[dict[str, Any]]):
    """One row per (strategy, batch, layer, phase, rank): measured and predicted bytes, seconds (polars)."""
    import polars as pl

    V, B, L, W = plan.sends_VBLWW.shape[:4]
    mi, me = _measured(plan, records)
    pi, pe = _predicted(plan)
    secs = np.stack([r["seconds_VBL2"] for r in sorted(records, key=lambda r: r["rank"])], axis=-1)  # [V,B,L,2,W]
    idx = np.indices((V, B, L, 2, W)).reshape(5, -1)
    return pl.DataFrame({
        "strategy": np.asarray(plan.strategies)[idx[0]], "batch": idx[1], "layer": idx[2],
        "model_layer": np.asarray(plan.model_layers or range(L), dtype=np.int64)[idx[2]],
        "phase": np.asarray(PHASES)[idx[3]], "rank": idx[4],
        "measured_intra_bytes": mi.reshape(-1), "measured_inter_bytes": me.reshape(-1),
        "predicted_intra_bytes": pi.reshape(-1), "predicted_inter_bytes": pe.reshape(-1),
        "seconds": secs.reshape(-1),
    })


def summary_rows(plan: A2APlan, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per strategy: measured and simulated inter-node bytes per batch normalized to the reference's
    median (``linear`` when present, else the first strategy), and the median collective time (the
    slowest rank of each collective)."""
    _, me = _measured(plan, records)
    meas_VB = me.sum(axis=(2, 3, 4))
    sim_VB = 2 * plan.sim_inter_VBL.sum(2)  # dispatch + combine
    ref = plan.strategies.index("linear") if "linear" in plan.strategies else 0
    secs = np.stack([r["seconds_VBL2"] for r in records], axis=-1).max(-1)  # [V,B,L,2]

    def norm(x_VB, v):
        m = np.median(x_VB[ref])
        return float(np.median(x_VB[v]) / m) if m > 0 else float("nan")

    return [{
        "strategy": s, "reference": plan.strategies[ref],
        "measured_inter_node_normalized_median": norm(meas_VB, v), "simulated_inter_node_normalized_median": norm(sim_VB, v),
        "measured_inter_node_bytes_per_batch_median": float(np.median(meas_VB[v])),
        "simulated_inter_node_bytes_per_batch_median": float(np.median(sim_VB[v])),
        "dispatch_seconds_median": float(np.median(secs[v, ..., 0])), "combine_seconds_median": float(np.median(secs[v, ..., 1])),
    } for v, s in enumerate(plan.strategies)]


def format_summary(plan: A2APlan, records: list[dict[str, Any]]) -> str:
    """Header line, column titles and one row per strategy."""
    from moetrace.sizes import human_bytes

    c = plan.config
    lines = [
        f"{c.get('deployment')} ({c.get('num_nodes')} nodes), {plan.world_size} ranks on {plan.backend} ({records[0]['device']}), "
        f"{c.get('num_batches')} batches x {plan.sends_VBLWW.shape[2]} layers, hidden {plan.hidden_size} {plan.dtype}",
        f"{'strategy':<12} {'measured inter (norm.)':>23} {'simulated':>10} {'inter/batch':>12} {'dispatch s':>11} {'combine s':>10}",
    ]
    for r in summary_rows(plan, records):
        lines.append(f"{r['strategy']:<12} {r['measured_inter_node_normalized_median']:>23.3f} "
                     f"{r['simulated_inter_node_normalized_median']:>10.3f} "
                     f"{human_bytes(r['measured_inter_node_bytes_per_batch_median']):>12} "
                     f"{r['dispatch_seconds_median']:>11.2e} {r['combine_seconds_median']:>10.2e}")
    return "\n".join(lines)


def write_a2a_results(out: str | os.PathLike, plan: A2APlan, records: list[dict[str, Any]]) -> list[Path]:
    """Write ``collectives.parquet`` and ``a2a.json`` (names, format and version from
    ``moetrace.results.A2A``); ``a2a.json`` last. Returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mismatch = first_mismatch(plan, records)
    meta = {**plan.config, "strategies": list(plan.strategies), "backend": plan.backend, "world_size": plan.world_size,
            "hidden_size": plan.hidden_size, "dtype": plan.dtype, "bytes_per_token": plan.bytes_per_token,
            "device": records[0]["device"], "hosts": sorted({r["host"] for r in records}),
            "bytes_match": mismatch is None, "first_mismatch": mismatch, "summary": summary_rows(plan, records)}
    return [
        rf.write_result_table(out, rf.A2A, rf.A2A_COLLECTIVES, result_table(plan, records)),
        rf.write_result_json(out, rf.A2A, rf.A2A_MANIFEST, meta),
    ]


def raise_on_mismatch(plan: A2APlan, records: list[dict[str, Any]]) -> None:
    """Raise ``A2AMismatchError`` naming the first mismatch between measured and predicted bytes."""
    mismatch = first_mismatch(plan, records)
    if mismatch is not None:
        raise A2AMismatchError(f"measured all-to-all bytes differ from the simulator: {mismatch}")
