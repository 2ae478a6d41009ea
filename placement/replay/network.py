"""How a replay's links between nodes were realized (``Network``, written to ``a2a.json``).

Out of scope: making them (``launch``, ``netemu``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Network", "links_line"]


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


def links_line(network: Network | None) -> str:
    """The summary's line saying what the links were (None: a torchrun job's)."""
    if network is None or network.mode == "torchrun":
        return "links: as the torchrun job's hosts and devices have them"
    if network.mode == "loopback":
        return "links: all local to this machine (inter-node time not emulated)"
    return f"links: a network namespace per node, inter-node links shaped to {network.link} ({network.qdisc})"
