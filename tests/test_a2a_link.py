"""Emulated nodes are real: a shaped link slows inter-node traffic and only it (as root; skipped
otherwise). Kept in a module of few imports: every rank process imports it to find ``_ping_pong``."""

from __future__ import annotations

import time

import pytest

from moetrace.placement import netemu
from moetrace.placement import replay as ar

CAN_EMULATE, WHY_NOT = netemu.probe()


def _ping_pong(rank: int, world_size: int, nbytes: int) -> dict[int, float] | None:
    """Rank 0 sends ``nbytes`` to rank 1 (same node) and to rank 2 (other node) and back; seconds of each."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
    x = torch.ones(nbytes // 4)
    secs = {}
    for peer in (1, 2):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        elif rank == peer:
            dist.recv(x, 0)
            dist.send(x, 0)
        secs[peer] = time.perf_counter() - t0
    dist.destroy_process_group()
    return secs if rank == 0 else None


@pytest.mark.skipif(not CAN_EMULATE, reason=f"network namespaces cannot be made here: {WHY_NOT}")
def test_shaped_link_slows_inter_node_traffic_only():
    """1 MB each way at 40 Mbit/s takes >= 0.4 s between nodes; the same between two ranks of one node
    (loopback) is far faster; the shapers' counters saw the inter-node megabytes and nothing more."""
    nbytes = 1_000_000
    with netemu.emulated_nodes(2, netemu.parse_link("40Mbit")) as nodes:
        secs = ar.launch_local(4, _ping_pong, nbytes, nodes=nodes, ranks_per_node=2)
        counted = nodes.link_bytes()
    assert secs[2] >= 2 * nbytes * 8 / 40e6 * 0.9, secs  # the rate bounds the inter-node round trip
    assert secs[1] < secs[2] / 4, secs  # intra-node goes over loopback, unshaped
    assert (counted >= nbytes).all() and (counted < 1.3 * nbytes).all(), counted  # node 0 <-> node 1 only
