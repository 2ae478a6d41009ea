"""Starting a replay's ranks: in this process under torchrun, or as local processes (loopback or emulated nodes).

Ranks start either from torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in the
environment; ``moetrace a2a --torchrun``) or from ``launch_local``, which starts them on this
machine with an ``env://`` rendezvous on a free port: gloo ranks forked from a fork server that has
imported torch once (``rank_start_method``), NCCL ranks spawned. A local gloo run can emulate the nodes
(``netemu``: one network namespace per node, its link shaped to ``--link``; ranks of node i run in
namespace i, so only inter-node traffic is slowed); without root every link is loopback (bytes
exact, times do not separate the link classes; ``Network.note`` says so). Backend ``gloo`` runs on
CPU; ``nccl`` needs one GPU per rank.

Out of scope: what a rank does (``rank``), the one-GPU check (``smoke``).
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from moetrace import lifetime
from moetrace.environ import environ
from moetrace.errors import ConfigError, MoetraceError
from moetrace.placement import netemu
from moetrace.placement.replay.network import Network
from moetrace.placement.replay.plan import A2APlan
from moetrace.placement.replay.rank import RankRecord, run_rank

__all__ = ["RANK_PRELOAD", "A2ARunError", "launch_local", "rank_start_method", "run_a2a"]


class A2ARunError(MoetraceError):
    "A rank of the collective replay failed (the message carries its last error line)."


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: what the rank server imports once, so that a rank forked from it imports none of it again (torch alone
#: is ~2.5 CPU-seconds a process: the eight ranks of a small local run spent more CPU importing than replaying)
RANK_PRELOAD = ("torch", "torch.distributed", "moetrace.placement.replay.rank")


def rank_start_method() -> Literal["forkserver", "spawn"]:
    """How ``launch_local`` starts ranks: forked from multiprocessing's fork server, which imports
    ``RANK_PRELOAD`` once (where the platform has one: Linux, macOS), else spawned (each rank a fresh
    interpreter). The fork server is started here on first use, once per process, and lives as long as
    this process does. It starts with ``netemu.EmulatedNodes.spawn_env()`` (c10d's C++ log level, read
    when torch loads: so in the server, once, for every rank it forks, on loopback too). A fork server something else
    in this process started first is used as it is (ranks then import what it did not)."""
    import multiprocessing
    from multiprocessing import forkserver

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    forkserver.set_forkserver_preload(list(RANK_PRELOAD))
    with environ(netemu.EmulatedNodes.spawn_env()):
        forkserver.ensure_running()
    return "forkserver"


def _spawned(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    result: str,
    netns_W: tuple[str, ...],
    env: dict[str, str],
    parent_env: dict[str, str],
) -> None:
    # a rank never outlives its parent (SIGKILL too): this process, or the fork server, which exits with it
    lifetime.die_with_parent()
    # the environment the run was started in, as a spawned rank inherits it (a fork server's child
    # inherits the server's, from when the server started)
    os.environ.clear()
    os.environ.update(parent_env)
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
    start_method: Literal["forkserver", "spawn"] | None = None,
) -> Any:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes on this machine (started by
    ``start_method``, by default ``rank_start_method()``; each sees this process's environment of the
    call; ``env://`` rendezvous on a free local port) and return rank 0's return value. With ``nodes``,
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
    method = start_method or rank_start_method()
    with (
        tempfile.TemporaryDirectory(prefix="moetrace-a2a-") as d,
        lifetime.guard(paths=[d]),  # ranks and temp dir go with this process, however it ends
        environ(start_env),
    ):
        result = str(Path(d) / "rank0.pkl")
        try:
            ctx = mp.start_processes(
                _spawned,
                args=(world_size, _free_port(), fn, args, result, netns_W, env, dict(os.environ)),
                nprocs=world_size,
                join=False,
                start_method=method,
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
) -> tuple[list[RankRecord] | None, Network]:
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
) -> tuple[list[RankRecord] | None, Network]:
    """``run_a2a`` for local ranks (``plan.world_size`` processes on this machine)."""
    args = (plan, str(bar.path))
    G = plan.world_size // plan.ranks_per_node
    if plan.backend != "gloo" and emulate:
        raise ConfigError(
            "--emulate-nodes needs --backend gloo (it shapes the TCP links between ranks on this machine); "
            "with NCCL, run on real nodes"
        )

    def unshaped(why: str, links: str = "loopback") -> tuple[list[RankRecord] | None, Network]:
        note = (
            ""
            if G < 2
            else (f"note: inter-node time is not emulated ({why}): all links are {links}; bytes are measured exactly")
        )
        if note:
            say(note)
        # NCCL ranks keep spawn, the start method the GPU runs were checked with
        method: Literal["spawn"] | None = "spawn" if plan.backend == "nccl" else None
        records = launch_local(plan.world_size, run_rank, *args, poll=bar.poll, start_method=method)
        return records, Network(mode="loopback", note=note)

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
