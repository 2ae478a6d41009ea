"""Emulated multi-node links on one machine: a network namespace per node, shaped by ``tc``.

``emulated_nodes(G, link)`` builds, for one run, G *node* namespaces and one *hub* namespace (all
created here, named ``moetrace-<pid>-<token>-n<i>`` / ``-hub``, so concurrent runs never collide and
no existing host interface, address or route is touched):

- the hub holds a bridge ``br0``; node ``i`` is joined to it by a veth pair (``v<i>`` in the hub,
  ``NODE_IF`` inside node ``i``) with address ``10.77.0.<i+1>/24`` (the subnet exists only inside
  these namespaces);
- each node's link is shaped in both directions to ``link.rate_bit`` (a full-duplex NIC): the
  node's egress by ``netem rate .. delay ..`` (or ``tbf`` when the kernel has no netem: rate only,
  ``notes`` says so), the hub port's egress (= the node's ingress) by ``tbf``;
- loopback is up in every node namespace, so traffic between two processes of one node (to the
  node's own address) takes the local route over ``lo`` and is *not* shaped.

A process joins node ``i`` with ``enter_netns(namespaces[i])`` (``setns``, before it opens any
socket); gloo then binds ``GLOO_SOCKET_IFNAME=NODE_IF`` and rendezvous at ``addrs[0]``
(``rank_env``). ``link_bytes`` reads the shaping qdiscs' byte counters, which count exactly the
inter-node traffic. Leaving the context deletes every namespace (their veths, bridge and qdiscs go
with them), also on an exception, Ctrl-C or SIGTERM, and, through a supervisor process
(``moetrace.lifetime.guard``) started before the first namespace, when this process is killed by
SIGKILL; ``remove_stale`` (a fallback) deletes namespaces left by a run whose process no longer exists.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), ``ip`` and ``tc``; ``probe`` says whether they work here.

Shape legend (docs/architecture.md): G node groups (= nodes).

Out of scope: emulating the GPUs' intra-node links (NVLink: local traffic runs at loopback speed),
packet loss, jitter, anything on more than one machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moetrace import lifetime
from moetrace.errors import ConfigError, MoetraceError

if TYPE_CHECKING:  # numpy loads when the counters are read, so `moetrace --help` stays light
    import numpy as np

__all__ = [
    "DEFAULT_LINK",
    "EmulatedNodes",
    "Link",
    "NODE_IF",
    "NetEmuError",
    "NO_NETNS_ENV",
    "WIRE_BYTES_PER_PAYLOAD_BYTE",
    "emulated_nodes",
    "enter_netns",
    "parse_link",
    "probe",
    "remove_stale",
]

#: the default link of an emulated node: scaled down so that a CPU's loopback (a few GB/s) stays
#: clearly faster than the inter-node link, as NVLink is faster than a node's network share
DEFAULT_LINK = "1Gbit,50us"
#: the name of each node's link inside its namespace (gloo binds it: GLOO_SOCKET_IFNAME)
NODE_IF = "mt0"
#: bytes an emulated link carries per byte of TCP payload: each 1448-byte segment (MTU 1500 less the
#: IP and TCP headers, timestamps on) is a 1514-byte frame, and the reverse direction's data is
#: acknowledged by one 66-byte frame per two segments (delayed ACKs) on this direction
WIRE_BYTES_PER_PAYLOAD_BYTE = (1514 + 66 / 2) / 1448
#: set to 1 to never create namespaces (every link stays loopback)
NO_NETNS_ENV = "MOETRACE_NO_NETNS"
_SUBNET = "10.77.0"  # /24, exists only inside a run's own namespaces
_PREFIX = "moetrace-"
_CLONE_NEWNET = 0x40000000
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


class NetEmuError(MoetraceError):
    "Creating, using or removing the emulated nodes' namespaces failed (the message names the command)."


@dataclass(frozen=True)
class Link:
    """One emulated node's network link."""

    rate_bit: int  # bits per second the link carries in each direction (full duplex)
    latency_s: float  # seconds added to every packet leaving a node (one way; needs netem)
    spec: str  # as given, e.g. "1Gbit,50us"

    @property
    def tc_rate(self) -> str:
        return f"{self.rate_bit}bit"

    @property
    def tc_delay(self) -> str:
        return f"{round(self.latency_s * 1e6)}us"


#: a number and its unit in ``--link``: ASCII digits (``\d`` alone matches ``٣``), at most 15 before the point
_NUMBER_UNIT = r"(\d{1,15}(?:\.\d{1,15})?)\s*([a-zA-Z]+)"


def parse_link(spec: str) -> Link:
    """``RATE[,LATENCY]`` with RATE in bit/kbit/mbit/gbit/tbit (per second) and LATENCY in s/ms/us/ns,
    e.g. ``1Gbit,50us`` or ``200Mbit`` (no added latency)."""
    parts = [p.strip() for p in spec.split(",")]
    m = re.fullmatch(_NUMBER_UNIT, parts[0], re.ASCII) if parts[0] else None
    unit = m.group(2).lower() if m else ""
    if len(parts) > 2 or m is None or unit not in _RATE_UNITS:
        raise ConfigError(
            f"--link {spec!r} is not RATE[,LATENCY] (e.g. 1Gbit,50us; rate units: "
            f"{', '.join(_RATE_UNITS)}; latency units: {', '.join(_TIME_UNITS)})"
        )
    rate = round(float(m.group(1)) * _RATE_UNITS[unit])
    if rate < 8000:
        raise ConfigError(f"--link {spec!r}: the rate must be at least 8kbit")
    latency = 0.0
    if len(parts) == 2:
        t = re.fullmatch(_NUMBER_UNIT, parts[1], re.ASCII)
        if t is None or t.group(2).lower() not in _TIME_UNITS:
            raise ConfigError(
                f"--link {spec!r}: latency {parts[1]!r} is not a number with a unit "
                f"({', '.join(_TIME_UNITS)}), e.g. 50us"
            )
        latency = float(t.group(1)) * _TIME_UNITS[t.group(2).lower()]
    return Link(rate_bit=rate, latency_s=latency, spec=spec)


def _tool(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None
    )


def _run(*cmd: str) -> str:
    """Run one ``ip``/``tc`` command; its stderr's first line in a ``NetEmuError`` on failure."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        why = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[0]
        raise NetEmuError(
            f"`{' '.join(os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd))}` failed: {why}"
        )
    return p.stdout


def probe() -> tuple[bool, str]:
    """(True, "") when namespaces can be made here; else (False, why): ``MOETRACE_NO_NETNS`` set, not
    root, ``ip``/``tc`` missing, or ``ip netns add`` refused (e.g. in an unprivileged container)."""
    if os.environ.get(NO_NETNS_ENV, "") not in ("", "0"):
        return False, f"{NO_NETNS_ENV} is set"
    if os.geteuid() != 0:
        return False, "not root (network namespaces need CAP_NET_ADMIN)"
    ip = _tool("ip")
    if ip is None:
        return False, "`ip` (iproute2) is not installed"
    if _tool("tc") is None:
        return False, "`tc` (iproute2) is not installed"
    name = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        _run(ip, "netns", "add", name)
    except NetEmuError as exc:
        return False, str(exc)
    _run(ip, "netns", "del", name)
    return True, ""


def remove_stale() -> list[str]:
    """Delete the namespaces ``moetrace-<pid>-...`` of runs whose process ``pid`` no longer exists
    (left behind by a SIGKILL); returns their names."""
    ip = _tool("ip")
    if ip is None:
        return []
    gone = []
    for line in _run(ip, "netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{_PREFIX}(\d+)-[0-9a-f]+-(?:n\d+|hub|probe)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _run(ip, "netns", "del", name)
            gone.append(name)
    return gone


@dataclass(frozen=True)
class EmulatedNodes:
    """The namespaces of one run's emulated nodes (valid inside ``emulated_nodes``)."""

    namespaces: tuple[str, ...]  # [G] node namespace names (as `ip netns list` shows them)
    hub: str  # the namespace holding the bridge every node's link plugs into
    addrs: tuple[str, ...]  # [G] IPv4 address of each node's link
    link: Link  # what each node's link is shaped to
    node_qdisc: str  # "netem" (rate and latency) or "tbf" (rate only) on each node's egress
    notes: tuple[str, ...] = field(default=())  # what is not emulated as asked (print them)
    ifname: str = NODE_IF  # each node's link inside its namespace

    @property
    def num_nodes(self) -> int:
        return len(self.namespaces)

    def rank_env(self) -> dict[str, str]:
        """Environment of every rank: gloo on the node link, rendezvous at node 0."""
        return {"GLOO_SOCKET_IFNAME": self.ifname, "MASTER_ADDR": self.addrs[0]}

    @staticmethod
    def spawn_env() -> dict[str, str]:
        """Environment the rank processes must be *started* with (read when torch loads): c10d's C++
        log at ERROR unless the user set ``TORCH_CPP_LOG_LEVEL``. Inside a namespace it would warn
        once per connection that it cannot resolve the peer's hostname, which is expected there
        (no DNS)."""
        return {"TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}

    def link_bytes(self) -> np.ndarray:
        """Bytes the shaping qdiscs have sent, int64 [G, 2]: column 0 out of node g, column 1 into it
        (inter-node traffic only: local traffic never reaches them)."""
        import numpy as np

        out = np.zeros((self.num_nodes, 2), dtype=np.int64)
        tc = _tool("tc")
        if tc is None:  # emulated_nodes found it; gone since
            raise NetEmuError("reading the link counters needs `tc` (iproute2)")
        for g, ns in enumerate(self.namespaces):
            for col, (where, dev) in enumerate(((ns, self.ifname), (self.hub, f"v{g}"))):
                text = _run(tc, "-n", where, "-s", "qdisc", "show", "dev", dev)
                m = re.search(r"Sent (\d+) bytes", text)
                out[g, col] = int(m.group(1)) if m else 0
        return out


def _shape(tc: str, ns: str, dev: str, link: Link, *, netem: bool) -> None:
    if netem:
        _run(
            tc,
            "-n",
            ns,
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "netem",
            "delay",
            link.tc_delay,
            "rate",
            link.tc_rate,
            "limit",
            "100000",
        )
        return
    rate_Bps = link.rate_bit / 8
    burst = max(16 * 1024, int(rate_Bps / 1000))  # about 1 ms of traffic: fine-grained shaping, still >= a few MTUs
    _run(
        tc,
        "-n",
        ns,
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        link.tc_rate,
        "burst",
        str(burst),
        "latency",
        "1s",
    )


@contextlib.contextmanager
def emulated_nodes(num_nodes: int, link: Link) -> Iterator[EmulatedNodes]:
    """Create ``num_nodes`` emulated nodes (see the module docstring); delete them on leaving.

    Raises ``NetEmuError`` naming the failing command (after removing whatever was created).
    """
    if not 1 <= num_nodes <= 250:
        raise ConfigError(f"emulated nodes: {num_nodes} nodes; 1..250 are supported")
    ip, tc = _tool("ip"), _tool("tc")
    if ip is None or tc is None:
        raise NetEmuError("emulated nodes need `ip` and `tc` (iproute2)")
    run_id = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    hub = f"{run_id}-hub"
    names = tuple(f"{run_id}-n{i}" for i in range(num_nodes))
    made: list[str] = []
    on_main = threading.current_thread() is threading.main_thread()
    if on_main:  # SIGTERM unwinds through the cleanup below (signal handlers can only be set on the main thread)

        def _term(signum, frame):
            raise SystemExit(128 + signum)

        restore = signal.signal(signal.SIGTERM, _term)
    # deletes them if this process dies without reaching the `finally` below (SIGKILL)
    supervisor = lifetime.guard(commands=[(ip, "netns", "del", ns) for ns in (*names, hub)])
    supervisor.__enter__()
    try:
        _run(ip, "netns", "add", hub)
        made.append(hub)
        _run(ip, "-n", hub, "link", "add", "br0", "type", "bridge")
        _run(ip, "-n", hub, "link", "set", "br0", "up")
        notes: list[str] = []
        netem = link.latency_s > 0
        for i, ns in enumerate(names):
            _run(ip, "netns", "add", ns)
            made.append(ns)
            _run(ip, "-n", ns, "link", "set", "lo", "up")
            _run(ip, "-n", hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", NODE_IF, "netns", ns)
            _run(ip, "-n", hub, "link", "set", f"v{i}", "master", "br0", "up")
            _run(ip, "-n", ns, "link", "set", NODE_IF, "addrgenmode", "none")  # no IPv6 link-local for gloo to pick
            _run(ip, "-n", ns, "addr", "add", f"{_SUBNET}.{i + 1}/24", "dev", NODE_IF)
            _run(ip, "-n", ns, "link", "set", NODE_IF, "up")
            if netem:
                try:
                    _shape(tc, ns, NODE_IF, link, netem=True)
                except NetEmuError as exc:
                    netem = False
                    notes.append(
                        f"latency {link.tc_delay} is not emulated: the netem qdisc is unavailable here "
                        f"({str(exc).split(': ', 1)[-1].removeprefix('Error: ').rstrip('.')}); "
                        "links are rate-limited only (tbf)"
                    )
            if not netem:
                _shape(tc, ns, NODE_IF, link, netem=False)
            _shape(tc, hub, f"v{i}", link, netem=False)
        yield EmulatedNodes(
            namespaces=names,
            hub=hub,
            addrs=tuple(f"{_SUBNET}.{i + 1}" for i in range(num_nodes)),
            link=link,
            node_qdisc="netem" if netem else "tbf",
            notes=tuple(notes),
        )
    finally:
        failed = []
        for ns in reversed(made):  # nodes first, then the hub (its veth ends and the bridge go with it)
            try:
                _run(ip, "netns", "del", ns)
            except NetEmuError as exc:
                failed.append(f"{ns} ({exc})")
        if on_main:
            signal.signal(signal.SIGTERM, restore if restore is not None else signal.SIG_DFL)
        supervisor.__exit__(None, None, None)
        if failed:
            raise NetEmuError(
                f"could not remove namespace(s) {', '.join(failed)}; remove them with `ip netns del NAME`"
            )


def enter_netns(name: str) -> None:
    """Move the calling thread (call it in a fresh process before it opens any socket; threads it
    starts later inherit it) into network namespace ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise NetEmuError(f"cannot enter network namespace {name}: {os.strerror(e)}")
    finally:
        os.close(fd)
