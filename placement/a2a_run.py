"""Replay placements through real ``torch.distributed.all_to_all_single`` collectives (``moetrace a2a``).

One process per EP rank. ``build_plan`` draws the same held-out global batches as ``compare``
(``compare.held_out_batches``, same seed), places each strategy (or reads placement files), and computes the
per-(batch, layer) send matrices (``a2a.send_matrices``), checked exactly against
``simulate_volume``. ``run_rank`` then, on every rank, for every strategy, batch and MoE layer:
builds the real dispatch buffer (one row of ``hidden_size`` values of ``dtype`` per token copy it
sends, stamped with its rank), calls ``all_to_all_single`` for dispatch and again for combine
(the received rows go back, reverse splits), times each (barrier first; ``perf_counter`` on gloo,
CUDA events on NCCL), checks every received row came from the rank it should, and records the
bytes of every split it actually sent. Batches are the outer loop (strategies inside), and before
each batch every rank runs probes: empty collectives (gloo's fixed cost) and node-local ones
(loopback's rate). Rank 0 gathers the records (``gather_object``).

On emulated nodes the summary also predicts each strategy's time with the cost model
(``placement/cost.py``) on the replay's send matrices, its links as the run realised them
(``replay_cost``: the shaped node link, loopback's probed rate, the probed fixed cost per
collective), next to the measured time (docs/a2a.md, "The cost model against the replay").

Ranks start either from torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in the
environment; ``moetrace a2a --torchrun``) or from ``launch_local``, which spawns them on this
machine with an ``env://`` rendezvous on a free port. A local gloo run can emulate the nodes
(``netemu``: one network namespace per node, its link shaped to ``--link``; ranks of node i run in
namespace i, so only inter-node traffic is slowed); without root every link is loopback (bytes
exact, times do not separate the link classes; ``Network.note`` says so). Backend ``gloo`` runs on
CPU; ``nccl`` needs one GPU per rank, and ``run_smoke`` runs a 1-rank NCCL check on one GPU.

Deployments with ``TPd > 1`` are replayed at EP-rank granularity, as the simulator counts them: one
process per EP rank (its ``d`` tensor-parallel GPUs are one process).

Shape legend (docs/architecture.md): B batches, L MoE layers, W EP ranks (GPUs), V strategies,
G node groups (= nodes).

Out of scope: the tensor-parallel traffic inside an EP rank (``TPd``); NVLink-speed intra-node links
(local traffic runs at loopback speed); the expert computation itself.
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

import numpy as np

from moetrace import lifetime
from moetrace import results as rf
from moetrace.environ import environ
from moetrace.errors import ConfigError, MoetraceError, TraceFormatError
from moetrace.placement import netemu
from moetrace.placement.a2a import A2AMismatchError, Phase, check_against_simulator, rank_link_bytes, send_matrices
from moetrace.placement.compare import CompareConfig, PlacedStrategy, TraceData, held_out_batches, place_strategies
from moetrace.placement.cost import Link, Links
from moetrace.placement.exports import PlacementFile
from moetrace.placement.maps import Placement
from moetrace.placement.replica_routing import ReplicaPolicy
from moetrace.placement.routers import NoRouter
from moetrace.placement.simulate import simulate_volume
from moetrace.placement.step_model import DedupUnit, GpuTraffic, Kernel, ValueType, layer_seconds
from moetrace.placement.step_model import Phase as KernelPhase
from moetrace.sizes import human_bytes

__all__ = [
    "A2APlan",
    "A2ARunError",
    "Backend",
    "Network",
    "ReplayCost",
    "build_plan",
    "check_local_capacity",
    "choose_backend",
    "first_mismatch",
    "format_smoke",
    "format_summary",
    "launch_local",
    "local_capacity_problem",
    "machine_capacity",
    "placed_from_file",
    "plan_bytes_per_rank",
    "predicted_seconds_VBL",
    "raise_on_mismatch",
    "replay_cost",
    "replay_traffic",
    "result_table",
    "run_a2a",
    "run_rank",
    "run_smoke",
    "summary_rows",
    "write_a2a_results",
]

Backend = Literal["gloo", "nccl", "auto"]
PHASES: tuple[Phase, Phase] = ("dispatch", "combine")
#: bytes per value on the wire of each supported dtype
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: probe collectives of each kind (empty; node-local rows only) before every batch's collectives
PROBE_REPEATS = 4
#: bytes each rank sends to the other ranks of its node in a node-local probe (loopback's rate)
PROBE_INTRA_BYTES = 4 << 20


#: resident memory of one local rank: torch, numpy and moetrace imported and a gloo group up (measured:
#: ~310 MB each of 4 ranks, 187 MB of it anonymous, torch 2.x CPU on Linux x86-64); its plan and buffers add to it
RANK_RSS_BYTES = 320 * 2**20
#: the most local ranks per CPU core: beyond it they queue for cores, and the times measure the scheduler
MAX_RANKS_PER_CORE = 4
#: the share of the memory available now that the local ranks may plan to use
MEMORY_SHARE = 0.8


class A2ARunError(MoetraceError):
    "A rank of the collective replay failed (the message carries its last error line)."


def machine_capacity() -> tuple[int, int | None]:
    """CPU cores this process may run on and the memory available now (``MemAvailable`` of
    /proc/meminfo, bytes; None where there is no such file)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/proc/meminfo") as f:
            lines = f.readlines()
    except OSError:  # no /proc (macOS): memory unknown, only the cores are checked
        return cpus, None
    kb = [int(x.split()[1]) for x in lines if x.startswith("MemAvailable:")]
    return cpus, kb[0] * 1024 if kb else None


def local_capacity_problem(
    world_size: int, *, num_cpus: int, mem_available_bytes: int | None, extra_bytes_per_rank: int = 0
) -> str | None:
    """Why ``world_size`` local ranks are more than this machine can run (one line), or None when they fit.

    Pure: ``num_cpus`` cores (at most ``MAX_RANKS_PER_CORE`` ranks each), ``mem_available_bytes`` (None:
    unknown, not checked), of which ``MEMORY_SHARE`` for ``RANK_RSS_BYTES + extra_bytes_per_rank`` per rank.
    """
    if world_size > MAX_RANKS_PER_CORE * num_cpus:
        return (
            f"{world_size} local ranks on {num_cpus} CPU core(s): at most {MAX_RANKS_PER_CORE} per core run "
            "without queueing for cores (times then measure the scheduler)"
        )
    need = world_size * (RANK_RSS_BYTES + extra_bytes_per_rank)
    if mem_available_bytes is not None and need > MEMORY_SHARE * mem_available_bytes:
        return (
            f"{world_size} local ranks need about {human_bytes(need)} of memory "
            f"({human_bytes(RANK_RSS_BYTES + extra_bytes_per_rank)} each), {human_bytes(mem_available_bytes)} is "
            "available"
        )
    return None


def check_local_capacity(world_size: int, *, extra_bytes_per_rank: int = 0, force: bool = False) -> str | None:
    """Refuse (``ConfigError``, one line) a local run of more ranks than this machine can run
    (``local_capacity_problem`` on ``machine_capacity``); with ``force``, return that line as a
    warning instead. None when they fit."""
    cpus, mem = machine_capacity()
    why = local_capacity_problem(
        world_size, num_cpus=cpus, mem_available_bytes=mem, extra_bytes_per_rank=extra_bytes_per_rank
    )
    if why is None:
        return None
    if not force:
        raise ConfigError(
            f"{why}; run a smaller deployment, start the ranks on several machines with torchrun (--torchrun), "
            "or pass --force to start them anyway"
        )
    return f"warning: {why}; starting them anyway (--force)"


def plan_bytes_per_rank(plan: A2APlan) -> int:
    """Memory each rank needs on top of ``RANK_RSS_BYTES``: its unpickled plan and its send, receive and
    combine buffers (the most rows any rank sends or receives in one collective)."""
    s = plan.sends_VBLWW
    rows = 2 * int(s.sum(-1).max(initial=0)) + int(s.sum(-2).max(initial=0))
    return int(s.nbytes + plan.sim_intra_VBL.nbytes + plan.sim_inter_VBL.nbytes) + rows * plan.bytes_per_token


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
def placed_from_file(data: TraceData, cfg: CompareConfig, pf: PlacementFile, *, where: str) -> PlacedStrategy:
    """A ``PlacedStrategy`` from a loaded placement file ``pf``, checked against the trace and
    deployment; a file with a router routes the held-out requests by it from their prefill (as
    ``compare`` does)."""
    m, dep = data.model, cfg.deployment
    L, P = pf.placement.phy2log.shape
    if L != m.num_moe_layers or pf.model.num_experts != m.num_experts:
        raise TraceFormatError(
            f"{where}: placement of {L} MoE layers x {pf.model.num_experts} experts; the trace has "
            f"{m.num_moe_layers} x {m.num_experts} (place it from this trace's model)"
        )
    if P % dep.num_ep or pf.deployment.num_ep != dep.num_ep:
        raise ConfigError(
            f"{where}: placement for EP{pf.deployment.num_ep} ({P} slots); --config {dep.name} has "
            f"EP{dep.num_ep} (re-run `moetrace place` with this --config)"
        )
    if isinstance(pf.router, NoRouter):
        return PlacedStrategy(strategy=pf.strategy, placement=pf.placement)
    if pf.router.num_groups != dep.num_groups:
        raise ConfigError(
            f"{where}: its {pf.router.kind} router sends requests to {pf.router.num_groups} nodes; --config "
            f"{dep.name} on nodes of {dep.num_gpus_per_node} GPUs has {dep.num_groups} (re-run `moetrace place` "
            "with this --config and --gpus-per-node)"
        )
    if "prefill" not in data.stages:
        raise ConfigError(f"{where}: its router reads prefill routing, which this trace did not record")
    routes = pf.router.route(data.prefill_RLE, placement=pf.placement, is_test_R=data.is_test_R)
    return PlacedStrategy(
        strategy=pf.strategy, placement=pf.placement, router=pf.router, group_of_test_R=routes.group_R
    )


class _Routing(TypedDict):
    """The keyword arguments ``send_matrices`` and ``simulate_volume`` share (see ``simulate.layer_copies``)."""

    placement: Placement
    batch_T: np.ndarray
    src_rank_T: np.ndarray
    num_batches: int
    num_ranks: int
    ranks_per_node: int
    dedup: DedupUnit
    policy: ReplicaPolicy


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
        rows, batch, src, _ = held_out_batches(data, cfg, ps.group_of_test_R)
        kw = _Routing(
            placement=ps.placement,
            batch_T=batch,
            src_rank_T=src,
            num_batches=cfg.num_batches,
            num_ranks=dep.num_ep,
            ranks_per_node=dep.ranks_per_node,
            dedup=cfg.dedup,
            policy=cfg.replica_policy,
        )
        assert data.test_topk_ids_TLK is not None  # read with test_req_T, which held_out_batches needed
        ids = data.test_topk_ids_TLK[rows]
        s_BLWW = send_matrices(ids, **kw)
        sim = simulate_volume(ids, bytes_per_token=bpt, **kw)
        check_against_simulator(s_BLWW, sim, ranks_per_node=dep.ranks_per_node, bytes_per_token=bpt, label=name)
        sends.append(s_BLWW)
        intra.append(sim["dispatch_intra_bytes"])
        inter.append(sim["dispatch_inter_bytes"])
    conf = {
        "deployment": dep.name,
        "gpus_per_node": dep.num_gpus_per_node,
        "num_ep": dep.num_ep,
        "num_nodes": dep.num_nodes,
        "ranks_per_node": dep.ranks_per_node,
        "num_batches": cfg.num_batches,
        "batch_requests": cfg.batch_requests,
        "dedup": cfg.dedup,
        "replica_policy": cfg.replica_policy,
        "seed": cfg.seed,
        "test_fraction": cfg.test_fraction,
        "trace": data.trace_path,
        "model": m.to_dict(),
    }
    return A2APlan(
        strategies=tuple(placed),
        sends_VBLWW=np.stack(sends),
        sim_intra_VBL=np.stack(intra),
        sim_inter_VBL=np.stack(inter),
        ranks_per_node=dep.ranks_per_node,
        hidden_size=H,
        dtype=dtype,
        backend=backend,
        model_layers=tuple(int(x) for x in m.moe_layers),
        config=conf,
    )


def choose_backend(
    backend: Backend, *, world_size: int, torchrun: bool, num_gpus: int | None = None, smoke: bool = False
) -> tuple[str, str]:
    """``(backend, note)``: ``gloo`` or ``nccl``, and a one-line note when ``auto`` could not take the
    GPUs it saw (empty otherwise). ``auto`` takes nccl when there is a GPU per rank on this machine
    (under torchrun: any GPU). ``num_gpus``: GPUs visible (None: ask torch). Raises ``ConfigError``
    for nccl without enough GPUs, saying what to do (``--smoke`` when there is at least one).
    ``smoke`` (``run_smoke``): nccl on one GPU, refused without one, under torchrun or with gloo."""
    if backend not in ("gloo", "nccl", "auto"):
        raise ConfigError(f"--backend {backend!r} is not gloo, nccl or auto")
    n = _visible_gpus() if num_gpus is None else num_gpus
    if smoke:
        if torchrun or backend == "gloo":
            raise ConfigError("--smoke is a 1-rank NCCL check in this process; drop --torchrun and --backend gloo")
        if n < 1:
            raise ConfigError("--smoke needs a CUDA GPU and none is visible here; use --backend gloo to replay on CPU")
        return "nccl", ""
    need = 1 if torchrun else world_size
    hint = (
        f"; --smoke runs a 1-rank NCCL all_to_all on cuda:0 (a GPU check, not the {world_size}-rank replay)"
        if n
        else ""
    )
    if backend == "auto":
        if n >= need:
            return "nccl", ""
        if n:
            return (
                "gloo",
                f"note: {world_size} ranks but {n} GPU(s) here (NCCL needs one per rank): using gloo on CPU{hint}",
            )
        return "gloo", ""
    if backend == "nccl" and n < need:
        raise ConfigError(
            f"--backend nccl needs one GPU per rank: {world_size} ranks, {n} GPU(s) visible here; run on a node with "
            f"{world_size} GPUs (or across nodes: torchrun --nnodes ... -m moetrace a2a --torchrun), or use --backend gloo "
            f"to measure the bytes on CPU{hint}"
        )
    return backend, ""


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class Network:
    """How the links between nodes were realized in a run (written to ``a2a.json`` as ``network``)."""

    mode: str  # "emulated" (a namespace per node, shaped links), "loopback" (one machine, no link shaped), "torchrun"
    link: str = ""  # the --link spec each emulated node's link was shaped to ("" unless emulated)
    qdisc: str = ""  # shaping of a node's egress: "netem" (rate and latency) or "tbf" (rate only); "" unless emulated
    note: str = ""  # one line: why not emulated, or what of --link is not (empty when all is as asked)
    link_bytes_G2: tuple[tuple[int, int], ...] = ()  # [G][2] bytes the shapers sent out of / into each node

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "link": self.link,
            "qdisc": self.qdisc,
            "note": self.note,
            "link_bytes": [list(x) for x in self.link_bytes_G2],
        }


# ---- one rank ---------------------------------------------------------------------------------------
def run_rank(
    rank: int, world_size: int, plan: A2APlan, progress_path: str | None = None
) -> list[dict[str, Any]] | None:
    """Replay ``plan`` as EP rank ``rank``; rank 0 returns every rank's record (others None).

    ``progress_path``: rank 0 writes there the number of batches it has finished, after each one (the
    parent of local ranks reads it for its progress bar).

    Initializes ``torch.distributed`` from ``env://`` unless a process group already exists (then
    uses and keeps it). A record: ``rank``, ``sent_VBL2W`` / ``recv_VBL2W`` (int64 bytes sent to /
    received from each rank, phase axis dispatch, combine), ``seconds_VBL2`` (float64 per collective),
    ``payload_errors`` (rows that arrived from the wrong rank), ``device``.
    """
    import torch
    import torch.distributed as dist

    if plan.world_size != world_size:
        raise ConfigError(
            f"{world_size} ranks started but the deployment has EP{plan.world_size}; start one process per EP "
            "rank (with TPd > 1, an EP rank's d GPUs are one process)"
        )
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
        rec = _replay(rank, plan, device, progress_path if rank == 0 else None)
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(rec, gathered, dst=0)
        return gathered
    finally:
        if own:
            dist.destroy_process_group()


def _replay(rank: int, plan: A2APlan, device: Any, progress_path: str | None = None) -> dict[str, Any]:
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
            errors.append(
                f"rank {rank} {what}: a received row does not carry the stamp of the rank that should send it"
            )

    for _ in range(plan.warmup):
        s = plan.sends_VBLWW[0, 0, 0]
        collective(
            recv_buf[: int(s[:, rank].sum())], send_buf[: int(s[rank].sum())], s[:, rank].tolist(), s[rank].tolist()
        )
    # the probes: an empty collective (gloo's fixed cost) and one of node-local rows only (loopback's rate)
    g = plan.ranks_per_node
    peer_rows = -(-PROBE_INTRA_BYTES // (plan.bytes_per_token * (g - 1))) if g > 1 else 0
    local_W = [peer_rows if w // g == rank // g and w != rank else 0 for w in range(W)]
    probe_in = torch.full((max(sum(local_W), 1), plan.hidden_size), float(stamp_W[rank]), dtype=dt, device=device)
    probe_out = torch.empty_like(probe_in)
    empty_W = [0] * W
    empty_s = np.zeros((B, PROBE_REPEATS))
    intra_s = np.full((B, PROBE_REPEATS), np.nan)
    for b in range(B):  # batches outer, strategies inner: a drift in the machine's load touches all strategies alike
        for i in range(PROBE_REPEATS):
            empty_s[b, i] = collective(probe_out[:0], probe_in[:0], empty_W, empty_W)
            if g > 1:
                intra_s[b, i] = collective(probe_out[: sum(local_W)], probe_in[: sum(local_W)], local_W, local_W)
        for v in range(V):
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
        if progress_path is not None:
            Path(progress_path).write_text(str(b + 1))
    return {
        "rank": rank,
        "sent_VBL2W": sent,
        "recv_VBL2W": recv,
        "seconds_VBL2": secs,
        "probe_empty_seconds_BN": empty_s,
        "probe_intra_seconds_BN": intra_s,
        "probe_intra_bytes": int(sum(local_W)) * plan.bytes_per_token,
        "payload_errors": errors,
        "device": str(torch.cuda.get_device_name(device) if cuda else "cpu"),
        "host": socket.gethostname(),
    }


# ---- starting the ranks ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    result: str,
    netns_W: tuple[str, ...],
    env: dict[str, str],
) -> None:
    lifetime.die_with_parent()  # a rank never outlives the run that started it (SIGKILL of the parent too)
    if netns_W:
        netemu.enter_netns(
            netns_W[rank]
        )  # before any socket: the rendezvous and gloo's pairs live in the node's namespace
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.update(env)
    value = fn(rank, world_size, *args)
    if rank == 0:
        with open(result, "wb") as f:
            pickle.dump(value, f)


def launch_local(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    nodes: netemu.EmulatedNodes | None = None,
    ranks_per_node: int = 1,
    poll: Callable[[], None] | None = None,
) -> Any:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes on this machine (spawned,
    ``env://`` rendezvous on a free local port) and return rank 0's return value. With ``nodes``,
    rank ``r`` runs in emulated node ``r // ranks_per_node``'s namespace (gloo on its link, rendezvous
    at node 0). ``poll()`` is called about twice a second while the ranks run (progress). A failing rank
    raises ``A2ARunError`` with its last error line."""
    import torch.multiprocessing as mp

    netns_W: tuple[str, ...] = ()
    env: dict[str, str] = {}
    if nodes is not None:
        if world_size != ranks_per_node * nodes.num_nodes:
            raise ConfigError(f"{world_size} ranks do not fill {nodes.num_nodes} emulated nodes of {ranks_per_node}")
        netns_W = tuple(nodes.namespaces[r // ranks_per_node] for r in range(world_size))
        env = nodes.rank_env()
    start_env = nodes.spawn_env() if nodes is not None else {}
    with (
        tempfile.TemporaryDirectory(prefix="moetrace-a2a-") as d,
        lifetime.guard(paths=[d]),  # ranks and temp dir go with this process, however it ends
        environ(start_env),
    ):
        result = str(Path(d) / "rank0.pkl")
        try:
            ctx = mp.spawn(
                _spawned, args=(world_size, _free_port(), fn, args, result, netns_W, env), nprocs=world_size, join=False
            )
            while not ctx.join(timeout=0.5):
                if poll is not None:
                    poll()
        except mp.ProcessRaisedException as exc:
            lines = [x for x in str(exc).splitlines() if x.strip()]
            raise A2ARunError(f"a rank failed: {lines[-1].strip() if lines else exc}") from None
        except mp.ProcessExitedException as exc:
            raise A2ARunError(f"a rank died: {exc}") from None
        with open(result, "rb") as f:
            return pickle.load(f)


def run_a2a(
    plan: A2APlan,
    *,
    torchrun: bool = False,
    emulate: bool | None = None,
    link: str = netemu.DEFAULT_LINK,
    log: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[dict[str, Any]] | None, Network]:
    """Run the replay: in this process as one rank of a torchrun job (``torchrun``; the records on
    rank 0, None elsewhere), or as ``plan.world_size`` local processes. Returns ``(records, network)``.

    Local runs of more than one node: ``emulate`` True puts each node in its own network namespace
    with its link shaped to ``link`` (``RATE[,LATENCY]``, ``netemu.parse_link``; raises
    ``ConfigError`` when namespaces cannot be made here); False keeps every link loopback; None
    emulates when ``netemu.probe`` says it can (root, ``ip``/``tc`` working, ``MOETRACE_NO_NETNS``
    unset), else keeps loopback. ``log`` gets the one-line notes (not emulated, netem missing).
    ``progress(batches_done, batches_total)``: local runs only, as rank 0 finishes each batch.
    """
    say = log or (lambda _msg: None)
    if torchrun:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ConfigError(
                "--torchrun: RANK and WORLD_SIZE are not set; start the command with torchrun "
                "(torchrun --nproc-per-node N -m moetrace a2a ... --torchrun)"
            )
        return run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), plan), Network(mode="torchrun")
    spec = netemu.parse_link(link)
    with tempfile.TemporaryDirectory(prefix="moetrace-a2a-progress-") as d, lifetime.guard(paths=[d]):
        return _run_local(plan, spec, emulate, say, _BatchProgress(Path(d) / "batches", plan, progress))


class _BatchProgress:
    """The file rank 0 writes its finished batches to, and ``poll()`` passing them on to ``progress``."""

    def __init__(self, path: Path, plan: A2APlan, progress: Callable[[int, int], None] | None) -> None:
        self.path, self.total, self.progress, self.done = path, int(plan.sends_VBLWW.shape[1]), progress, -1

    def poll(self) -> None:
        if self.progress is None:
            return
        try:
            text = self.path.read_text()
        except FileNotFoundError:  # rank 0 has not finished a batch yet
            text = "0"
        done = int(text) if text.strip().isdigit() else self.done  # a write caught half-way: next poll
        if done != self.done:
            self.done = done
            self.progress(done, self.total)


def _run_local(
    plan: A2APlan, spec: netemu.Link, emulate: bool | None, say: Callable[[str], None], bar: _BatchProgress
) -> tuple[list[dict[str, Any]] | None, Network]:
    """``run_a2a`` for local ranks (``plan.world_size`` processes on this machine)."""
    args = (plan, str(bar.path))
    G = plan.world_size // plan.ranks_per_node
    if plan.backend != "gloo" and emulate:
        raise ConfigError(
            "--emulate-nodes needs --backend gloo (it shapes the TCP links between ranks on this machine); "
            "with NCCL, run on real nodes"
        )

    def unshaped(why: str, links: str = "loopback") -> tuple[list[dict[str, Any]] | None, Network]:
        note = (
            ""
            if G < 2
            else (f"note: inter-node time is not emulated ({why}): all links are {links}; bytes are measured exactly")
        )
        if note:
            say(note)
        return launch_local(plan.world_size, run_rank, *args, poll=bar.poll), Network(mode="loopback", note=note)

    if plan.backend != "gloo":
        return unshaped("NCCL", "this machine's GPU links")
    if G < 2 or emulate is False:
        return unshaped("--no-emulate-nodes")
    ok, why = netemu.probe()
    if not ok:
        if emulate:
            raise ConfigError(
                f"--emulate-nodes: network namespaces cannot be made here ({why}); run as root, "
                "or use --no-emulate-nodes"
            )
        return unshaped(why)
    stale = netemu.remove_stale()
    if stale:
        say(f"note: removed {len(stale)} network namespace(s) left by killed runs: {', '.join(stale)}")
    with netemu.emulated_nodes(G, spec) as nodes:
        for n in nodes.notes:
            say(f"note: {n}")
        records = launch_local(
            plan.world_size, run_rank, *args, nodes=nodes, ranks_per_node=plan.ranks_per_node, poll=bar.poll
        )
        counted = nodes.link_bytes()
    return records, Network(
        mode="emulated",
        link=spec.spec,
        qdisc=nodes.node_qdisc,
        note="; ".join(nodes.notes),
        link_bytes_G2=tuple((int(a), int(b)) for a, b in counted),
    )


# ---- one GPU: the NCCL smoke check ------------------------------------------------------------------
def run_smoke(plan: A2APlan, *, device_index: int = 0) -> list[dict[str, Any]]:
    """A 1-rank NCCL check on ``cuda:<device_index>`` (for a machine with fewer GPUs than ranks).

    Per (strategy, batch, layer): one ``all_to_all_single`` with world size 1 of the batch's whole
    dispatch (every rank's token copies, ``sends_VBLWW[v, b, l].sum()`` rows of ``hidden_size``
    values, grouped by sending rank and stamped with it; input and output splits ``[rows]``), timed
    with CUDA events. Checks the rows arrive unchanged and their bytes equal the simulator's dispatch
    total (intra + inter); raises ``A2AMismatchError`` otherwise. Returns one row per strategy:
    ``collectives``, ``bytes_per_collective_median``, ``seconds_median``, ``gbytes_per_second_median``.

    Out of scope: links between GPUs (with one rank NCCL copies on the device; the W-rank replay
    needs W GPUs), combine (the same copy back).
    """
    import torch
    import torch.distributed as dist

    if _visible_gpus() <= device_index:
        raise ConfigError(f"--smoke needs a CUDA GPU (cuda:{device_index}); none is visible here")
    if dist.is_initialized():
        raise ConfigError("--smoke runs its own 1-rank process group; a process group already exists")
    torch.cuda.set_device(device_index)
    device = torch.device("cuda", device_index)
    dt = getattr(torch, plan.dtype)
    V, B, L, W, _ = plan.sends_VBLWW.shape
    stamp_W = torch.tensor([float(w % 200 + 1) for w in range(W)], dtype=dt, device=device)
    rows_max = max(int(plan.sends_VBLWW.sum(axis=(-1, -2)).max(initial=0)), 1)
    send_buf = torch.empty((rows_max, plan.hidden_size), dtype=dt, device=device)
    recv_buf = torch.empty_like(send_buf)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:

        def once(n: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_to_all_single(recv_buf[:n], send_buf[:n], [n], [n])
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        once(rows_max)  # warm-up: NCCL's communicator starts on the first collective
        out = []
        for v, name in enumerate(plan.strategies):
            secs, nbytes = [], []
            for b in range(B):
                for l in range(L):
                    per_src_W = torch.tensor(plan.sends_VBLWW[v, b, l].sum(-1), device=device)
                    n = int(per_src_W.sum())
                    send_buf[:n] = torch.repeat_interleave(stamp_W, per_src_W)[:, None]
                    secs.append(once(n))
                    got = recv_buf[:n].numel() * recv_buf.element_size()
                    want = plan.sim_intra_VBL[v, b, l] + plan.sim_inter_VBL[v, b, l]
                    if got != want or not bool(recv_buf[:n].eq(send_buf[:n]).all()):
                        raise A2AMismatchError(
                            f"--smoke {name} batch {b} layer {l}: {got} bytes moved (simulator: "
                            f"{want:.0f}) or a row arrived changed"
                        )
                    nbytes.append(got)
            med_s = float(np.median(secs))
            out.append(
                {
                    "strategy": name,
                    "collectives": len(secs),
                    "bytes_per_collective_median": float(np.median(nbytes)),
                    "seconds_median": med_s,
                    "gbytes_per_second_median": float(np.median(np.asarray(nbytes) / np.maximum(secs, 1e-12)) / 1e9),
                    "device": torch.cuda.get_device_name(device),
                }
            )
        return out
    finally:
        dist.destroy_process_group()


def format_smoke(plan: A2APlan, rows: list[dict[str, Any]]) -> str:
    """Header line, column titles and one row per strategy of ``run_smoke``'s result."""
    from moetrace.sizes import human_bytes

    lines = [
        f"NCCL smoke check on 1 GPU ({rows[0]['device'] if rows else '?'}): each {plan.config.get('deployment')} "
        f"batch's dispatch ({plan.world_size} ranks' rows) as one all_to_all_single of world size 1, "
        f"hidden {plan.hidden_size} {plan.dtype}",
        f"{'strategy':<12} {'collectives':>11} {'bytes (median)':>15} {'seconds':>10} {'GB/s':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r['strategy']:<12} {r['collectives']:>11} {human_bytes(r['bytes_per_collective_median']):>15} "
            f"{r['seconds_median']:>10.2e} {r['gbytes_per_second_median']:>8.2f}"
        )
    return "\n".join(lines)


# ---- results ---------------------------------------------------------------------------------------
def _measured(plan: A2APlan, records: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Measured (intra, inter) bytes each rank sent, int64 [V, B, L, 2, W] (phase axis: dispatch, combine)."""
    W = plan.world_size
    node_W = np.arange(W) // plan.ranks_per_node
    sent = np.stack(
        [r["sent_VBL2W"] for r in sorted(records, key=lambda r: r["rank"])], axis=-2
    )  # [V,B,L,2,W src,W dst]
    inter_WW = node_W[:, None] != node_W[None, :]
    return (sent * ~inter_WW).sum(-1), (sent * inter_WW).sum(-1)


def _predicted(plan: A2APlan) -> tuple[np.ndarray, np.ndarray]:
    """Predicted (intra, inter) bytes each rank sends, int64 [V, B, L, 2, W], from the send matrices."""
    out = [
        [
            rank_link_bytes(s, phase=p, ranks_per_node=plan.ranks_per_node, bytes_per_token=plan.bytes_per_token)
            for p in PHASES
        ]
        for s in plan.sends_VBLWW
    ]
    return (
        np.stack([np.stack([o[0] for o in v], axis=2) for v in out]),
        np.stack([np.stack([o[1] for o in v], axis=2) for v in out]),
    )


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
            return (
                f"{plan.strategies[v]} batch {b} layer {l} {PHASES[p]} rank {w}: measured {int(got[v, b, l, p, w])} "
                f"{cls}-node bytes, predicted {int(want[v, b, l, p, w])} ({len(bad)} (collective, rank) pairs differ)"
            )
    return None


def result_table(plan: A2APlan, records: list[dict[str, Any]]):
    """One row per (strategy, batch, layer, phase, rank): measured and predicted bytes, seconds (polars)."""
    import polars as pl

    V, B, L, W = plan.sends_VBLWW.shape[:4]
    mi, me = _measured(plan, records)
    pi, pe = _predicted(plan)
    secs = np.stack([r["seconds_VBL2"] for r in sorted(records, key=lambda r: r["rank"])], axis=-1)  # [V,B,L,2,W]
    idx = np.indices((V, B, L, 2, W)).reshape(5, -1)
    return pl.DataFrame(
        {
            "strategy": np.asarray(plan.strategies)[idx[0]],
            "batch": idx[1],
            "layer": idx[2],
            "model_layer": np.asarray(plan.model_layers or range(L), dtype=np.int64)[idx[2]],
            "phase": np.asarray(PHASES)[idx[3]],
            "rank": idx[4],
            "measured_intra_bytes": mi.reshape(-1),
            "measured_inter_bytes": me.reshape(-1),
            "predicted_intra_bytes": pi.reshape(-1),
            "predicted_inter_bytes": pe.reshape(-1),
            "seconds": secs.reshape(-1),
        }
    )


# ---- the cost model against the replay --------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ReplayCost:
    """The cost model's links as an emulated run realised them, and gloo's fixed cost per collective."""

    links: Links  # inter: the shaped node link's payload rate (inter_nic "node"); intra: loopback's probed rate
    fixed_seconds: float  # median empty all_to_all_single (slowest rank): software, barrier skew, peer messages
    wire_overhead: float  # link bytes per inter-node payload byte (netemu.WIRE_BYTES_PER_PAYLOAD_BYTE)
    intra_probe_seconds: float | None  # median node-local probe (slowest rank), fixed cost included; None: not run
    intra_probe_bytes: int  # bytes each rank sent (and received) in that probe
    note: str = ""  # what the calibration could not measure (empty when all was)

    def to_json(self) -> dict[str, Any]:
        return {
            "links": self.links.to_json(),
            "fixed_seconds": self.fixed_seconds,
            "wire_overhead": self.wire_overhead,
            "intra_probe_seconds": self.intra_probe_seconds,
            "intra_probe_bytes": self.intra_probe_bytes,
            "note": self.note,
        }


def replay_cost(plan: A2APlan, records: list[dict[str, Any]], network: Network | None) -> ReplayCost | None:
    """The cost model of an emulated run (``network.mode == "emulated"``), else None (loopback or
    torchrun: every link is what the machine has, and the model's link classes mean nothing there).

    inter: the emulated link, one per node (``inter_nic="node"``: a node's ranks share its veth), its
    payload rate ``rate_bit / 8 / netemu.WIRE_BYTES_PER_PAYLOAD_BYTE`` (TCP/IP and Ethernet headers,
    the reverse direction's ACKs); intra: loopback's rate from the node-local probe, ``bytes /
    (probe seconds - fixed seconds)``; both message latencies 0: gloo sends every peer a message in
    every collective (an empty split too), so per-message costs and the link's one-way delay are in
    ``fixed_seconds``, the empty probe's median, which ``predicted_seconds_VBL`` adds to every collective.
    """
    if network is None or network.mode != "emulated":
        return None
    notes: list[str] = []
    overhead = netemu.WIRE_BYTES_PER_PAYLOAD_BYTE
    inter = Link(bytes_per_s=netemu.parse_link(network.link).rate_bit / 8 / overhead, latency_s=0.0)
    empty = np.stack([r["probe_empty_seconds_BN"] for r in records]).max(0)  # [B, N] slowest rank
    fixed = float(np.median(empty))
    nbytes = int(max(r["probe_intra_bytes"] for r in records))
    intra_s: float | None = None
    if plan.ranks_per_node == 1:
        intra = inter
        notes.append("one rank per node: no node-local traffic, the intra link is unused")
    else:
        intra_s = float(np.median(np.stack([r["probe_intra_seconds_BN"] for r in records]).max(0)))
        if intra_s > fixed:
            intra = Link(bytes_per_s=nbytes / (intra_s - fixed), latency_s=0.0)
        else:
            intra = Link(bytes_per_s=nbytes / intra_s, latency_s=0.0)
            notes.append(
                "the node-local probe was not slower than an empty collective: loopback's rate is its bytes over "
                "its whole time (the fixed cost not subtracted)"
            )
    return ReplayCost(
        links=Links(intra=intra, inter=inter, inter_nic="node"),
        fixed_seconds=fixed,
        wire_overhead=overhead,
        intra_probe_seconds=intra_s,
        intra_probe_bytes=nbytes,
        note="; ".join(notes),
    )


def replay_traffic(sends_NWW: np.ndarray, *, ranks_per_node: int) -> GpuTraffic:
    """The cost model's per-GPU traffic of the collectives the replay ran: copies sent and received
    and distinct peers per link class, float64 [N, W] each, from send matrices int [N, W, W]
    (``[n, src, dst]``, dispatch; combine is the reverse and costs the same): the copy model's
    traffic, as ``send_matrices`` builds the matrices from its copies."""
    s = np.asarray(sends_NWW, dtype=np.float64)
    node_W = np.arange(s.shape[-1]) // ranks_per_node
    inter_WW = node_W[:, None] != node_W[None, :]
    si, se = s * ~inter_WW, s * inter_WW
    return GpuTraffic(
        send_intra=si.sum(-1),
        recv_intra=si.sum(-2),
        send_inter=se.sum(-1),
        recv_inter=se.sum(-2),
        peers_send_intra=(si > 0).sum(-1).astype(np.float64),
        peers_recv_intra=(si > 0).sum(-2).astype(np.float64),
        peers_send_inter=(se > 0).sum(-1).astype(np.float64),
        peers_recv_inter=(se > 0).sum(-2).astype(np.float64),
    )


def replay_kernel(cost: ReplayCost) -> Kernel:
    """The step model's kernel of a replay: raw bytes both ways (a copy is ``bytes_per_token`` bytes:
    ``hidden_size`` = that count of one-byte values), the run's links and fixed cost per collective,
    no reduction (the replay sends the same copies back and sums nothing)."""
    raw = KernelPhase(value=ValueType(name="raw", bytes_per_value=1.0), links=cost.links, fixed_s=cost.fixed_seconds)
    return Kernel(
        name="replay", copies="rank", dispatch=raw, combine=raw, reduce_bytes_per_s=math.inf, source=cost.note
    )


def predicted_seconds_VBL(plan: A2APlan, cost: ReplayCost) -> np.ndarray:
    """The step model's seconds of each dispatch (= its combine here), float64 [V, B, L]:
    ``step_model.layer_seconds`` on the replay's send matrices with ``replay_kernel(cost)``."""
    V, B, L, W, _ = plan.sends_VBLWW.shape
    traffic = replay_traffic(plan.sends_VBLWW.reshape(V * B * L, W, W), ranks_per_node=plan.ranks_per_node)
    secs = layer_seconds(
        traffic, kernel=replay_kernel(cost), hidden_size=plan.bytes_per_token, ranks_per_node=plan.ranks_per_node
    )
    return secs.dispatch.reshape(V, B, L)


def summary_rows(plan: A2APlan, records: list[dict[str, Any]], network: Network | None = None) -> list[dict[str, Any]]:
    """Per strategy: measured and simulated inter-node bytes per batch normalized to the reference's
    median (``linear`` when present, else the first strategy), and the median collective times (the
    slowest rank of each collective): dispatch, combine, and both of one (batch, layer)
    (``layer_seconds_median``).

    Time per batch: dispatch + combine of every layer, summed over layers (seconds; measured: the
    slowest rank of each collective). ``measured_time_normalized_median``: its median over batches
    over the reference's; on emulated nodes (``replay_cost``) ``predicted_time_normalized_median``
    the same of the cost model's seconds (``predicted_seconds_VBL``) and ``predicted_over_measured``
    their ratio (None elsewhere).
    """
    _, me = _measured(plan, records)
    meas_VB = me.sum(axis=(2, 3, 4))
    sim_VB = 2 * plan.sim_inter_VBL.sum(2)  # dispatch + combine
    ref = plan.strategies.index("linear") if "linear" in plan.strategies else 0
    secs = np.stack([r["seconds_VBL2"] for r in records], axis=-1).max(-1)  # [V,B,L,2]
    time_VB = secs.sum(axis=(2, 3))
    cost = replay_cost(plan, records, network)
    pred_VB = None if cost is None else 2 * predicted_seconds_VBL(plan, cost).sum(2)

    def norm(x_VB, v):
        m = np.median(x_VB[ref])
        return float(np.median(x_VB[v]) / m) if m > 0 else float("nan")

    rows = []
    for v, s in enumerate(plan.strategies):
        pred = None if pred_VB is None else norm(pred_VB, v)
        meas = norm(time_VB, v)
        rows.append(
            {
                "strategy": s,
                "reference": plan.strategies[ref],
                "measured_inter_node_normalized_median": norm(meas_VB, v),
                "simulated_inter_node_normalized_median": norm(sim_VB, v),
                "measured_inter_node_bytes_per_batch_median": float(np.median(meas_VB[v])),
                "simulated_inter_node_bytes_per_batch_median": float(np.median(sim_VB[v])),
                "dispatch_seconds_median": float(np.median(secs[v, ..., 0])),
                "combine_seconds_median": float(np.median(secs[v, ..., 1])),
                "layer_seconds_median": float(np.median(secs[v].sum(-1))),
                "measured_seconds_per_batch_median": float(np.median(time_VB[v])),
                "predicted_seconds_per_batch_median": None if pred_VB is None else float(np.median(pred_VB[v])),
                "measured_time_normalized_median": meas,
                "predicted_time_normalized_median": pred,
                "predicted_over_measured": None if pred is None else pred / meas,
            }
        )
    return rows


def _links_line(network: Network | None) -> str:
    if network is None or network.mode == "torchrun":
        return "links: as the torchrun job's hosts and devices have them"
    if network.mode == "loopback":
        return "links: all local to this machine (inter-node time not emulated)"
    return f"links: a network namespace per node, inter-node links shaped to {network.link} ({network.qdisc})"


def _cost_line(cost: ReplayCost | None, network: Network | None) -> str:
    if cost is None:
        return "time prediction: none (the cost model's link classes need emulated nodes; " + (
            "links here are the torchrun job's)"
            if network is not None and network.mode == "torchrun"
            else "links here are all local)"
        )
    return (
        f"cost model: inter {cost.links.inter.bytes_per_s * 8 / 1e6:.4g} Mbit/s of payload per node (the link's rate / "
        f"{cost.wire_overhead:.3f} wire bytes per payload byte: TCP/IP headers, ACKs), intra (loopback, probed) "
        f"{cost.links.intra.bytes_per_s / 1e9:.2f} GB/s, fixed {cost.fixed_seconds * 1e3:.2f} ms per collective (empty probe)"
        + (f"; {cost.note}" if cost.note else "")
    )


def format_summary(plan: A2APlan, records: list[dict[str, Any]], network: Network | None = None) -> str:
    """Header lines, column titles and one row per strategy (the time columns: dispatch + combine
    summed over layers per batch, median, over the reference's; predicted: the cost model, on
    emulated nodes only)."""
    from moetrace.sizes import human_bytes

    c = plan.config
    lines = [
        f"{c.get('deployment')} ({c.get('num_nodes')} nodes), {plan.world_size} ranks on {plan.backend} ({records[0]['device']}), "
        f"{c.get('num_batches')} batches x {plan.sends_VBLWW.shape[2]} layers, hidden {plan.hidden_size} {plan.dtype}",
        _links_line(network),
        _cost_line(replay_cost(plan, records, network), network),
        f"{'strategy':<12} {'measured inter (norm.)':>23} {'simulated':>10} {'inter/batch':>12} {'dispatch s':>11} {'combine s':>10} "
        f"{'layer s':>9} {'time (norm.)':>13} {'predicted':>10} {'pred/meas':>10}",
    ]

    def opt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for r in summary_rows(plan, records, network):
        lines.append(
            f"{r['strategy']:<12} {r['measured_inter_node_normalized_median']:>23.3f} "
            f"{r['simulated_inter_node_normalized_median']:>10.3f} "
            f"{human_bytes(r['measured_inter_node_bytes_per_batch_median']):>12} "
            f"{r['dispatch_seconds_median']:>11.2e} {r['combine_seconds_median']:>10.2e} "
            f"{r['layer_seconds_median']:>9.2e} {r['measured_time_normalized_median']:>13.3f} "
            f"{opt(r['predicted_time_normalized_median']):>10} {opt(r['predicted_over_measured']):>10}"
        )
    return "\n".join(lines)


def write_a2a_results(
    out: str | os.PathLike, plan: A2APlan, records: list[dict[str, Any]], network: Network | None = None
) -> list[Path]:
    """Write ``collectives.parquet`` and ``a2a.json`` (names, format and version from
    ``moetrace.results.A2A``; ``network``: how the links were realized); ``a2a.json`` last. Returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mismatch = first_mismatch(plan, records)
    cost = replay_cost(plan, records, network)
    meta = {
        **plan.config,
        "trace": rf.recorded_path(plan.config["trace"], results_dir=out),  # relative to the results
        "strategies": list(plan.strategies),
        "backend": plan.backend,
        "world_size": plan.world_size,
        "hidden_size": plan.hidden_size,
        "dtype": plan.dtype,
        "bytes_per_token": plan.bytes_per_token,
        "device": records[0]["device"],
        "hosts": sorted({r["host"] for r in records}),
        "bytes_match": mismatch is None,
        "first_mismatch": mismatch,
        "summary": summary_rows(plan, records, network),
        "network": network.to_dict() if network is not None else None,
        "cost_model": None if cost is None else cost.to_json(),
    }
    return [
        rf.write_result_table(out, rf.A2A, rf.A2A_COLLECTIVES, result_table(plan, records)),
        rf.write_result_json(out, rf.A2A, rf.A2A_MANIFEST, meta),
    ]


def raise_on_mismatch(plan: A2APlan, records: list[dict[str, Any]]) -> None:
    """Raise ``A2AMismatchError`` naming the first mismatch between measured and predicted bytes."""
    mismatch = first_mismatch(plan, records)
    if mismatch is not None:
        raise A2AMismatchError(f"measured all-to-all bytes differ from the simulator: {mismatch}")
