"""Expected link time per GPU of a placement under a routing, and the local search that lowers the
busiest GPU's: how the joint placer charges GPU balance inside and across nodes.

The objective is the cost model's decode all-to-all (``cost``, docs/placement.md "The cost model")
taken in expectation over one step, per MoE layer. Node ``h``'s tokens send ``u[h, l, e]`` expected
(token, expert) copies per step to expert ``e`` (``usage_GLE``: per node, the sum of its requests'
decode activation shares, as the joint placer's routing leaves them); a copy goes to a replica on
the sender's own node when there is one (``same_node``, the simulator's default replica policy),
else evenly to all replicas. The node's tokens sit evenly on its ``Wn`` GPUs, so a share
``(Wn - 1) / Wn`` of the copies to its own experts crosses NVLink. Per GPU ``w`` of node ``g``:

- ``recv_inter[w]`` = copies from other nodes to the slots on ``w``;
  ``recv_intra[w]`` = ``(Wn - 1) / Wn`` x copies from node ``g`` to the slots on ``w``;
- ``send_inter[g]`` = copies from node ``g`` to slots on other nodes, ``/ Wn`` per GPU;
  ``send_intra[g]`` = ``(Wn - 1) / Wn`` x copies from node ``g`` to its own slots, ``/ Wn`` per GPU;
- ``t[w] = max(max(send_intra, recv_intra) / bw_intra, max(send_inter, recv_inter) / bw_inter)``;
  the layer waits for ``max_w t[w]``.

``improve_layout`` moves slots between GPUs to lower that layer time: from the busiest GPU it
swaps one slot with any other slot, taking the swap that lowers ``sum_w (t[w] / max t) ** 8`` most
(a smooth maximum, so ties between stragglers do not stall it), until none does. Slots of experts
with replicas move only inside their node (their copies' routing depends on where the replicas
are); single-copy experts move anywhere. The node membership a swap between nodes changes is then
the placement's: the caller re-fits its router.

Shape legend (docs/architecture.md): G node groups (= nodes), L MoE layers, E logical experts,
P physical slots, W EP ranks (GPUs).

Out of scope: per-message latency and the batch-to-batch noise of small steps (the expectation
leaves both out; ``simulate`` charges them), the prefill stage (its copies are per node), choosing
which experts get replicas (the membership LP's), expert compute time, one shared network link per
node (``Links.inter_nic == "node"``, the replay's emulation: the terms here are per-GPU links, as
every GPU of an H100-class node has its own NIC).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetrace.placement.cost import DEFAULT_LINKS, Links

__all__ = ["LinkTimes", "slot_flows_PG", "layer_link_times", "expected_step_seconds", "improve_layout"]


@dataclass(frozen=True)
class LinkTimes:
    """One layer's expected per-GPU link terms (copies per step; ``t_W`` in seconds per copy byte)."""

    t_W: np.ndarray  # float64 [W]: max of the two link classes' times
    recv_intra_W: np.ndarray  # float64 [W]
    recv_inter_W: np.ndarray  # float64 [W]
    send_intra_G: np.ndarray  # float64 [G]: per GPU of the node
    send_inter_G: np.ndarray  # float64 [G]: per GPU of the node


def slot_flows_PG(phy2log_P: np.ndarray, u_GE: np.ndarray) -> np.ndarray:
    """Expected copies per step each slot serves from each node, float64 [P, G].

    ``phy2log_P``: int [P] expert of each slot of one layer (node ``g`` holds slots
    ``[g*P/G, (g+1)*P/G)``); ``u_GE``: float [G, E] expected copies per step from node ``g`` to expert ``e``.
    Same-node-first: a node's copies to an expert it holds split over its own replicas, else over all.
    """
    phy2log_P = np.asarray(phy2log_P, dtype=np.int64)
    G, E = u_GE.shape
    P = len(phy2log_P)
    node_P = np.arange(P) // (P // G)
    cnt_GE = np.zeros((G, E))
    np.add.at(cnt_GE, (node_P, phy2log_P), 1.0)
    cnt_GP = cnt_GE[:, phy2log_P]  # [G, P]: replicas node g holds of slot p's expert
    u_GP = u_GE[:, phy2log_P]
    same_GP = node_P[None, :] == np.arange(G)[:, None]
    local = np.where(same_GP, u_GP / np.maximum(cnt_GP, 1.0), 0.0)
    remote = u_GP / cnt_GE.sum(0)[phy2log_P][None, :]
    return np.where(cnt_GP > 0, local, remote).T


def layer_link_times(
    flows_PG: np.ndarray, gpu_P: np.ndarray, *, num_ranks: int, num_nodes: int, links: Links = DEFAULT_LINKS
) -> LinkTimes:
    """The per-GPU terms of one layer from each slot's flows and GPU (module docstring).

    ``flows_PG``: float [P, G] (``slot_flows_PG``); ``gpu_P``: int [P] the GPU of each slot (node =
    GPU // (W / G)). Times are in seconds per byte of one copy (multiply by a copy's bytes).
    """
    W, G = num_ranks, num_nodes
    wn = W // G
    a = (wn - 1) / wn
    P = len(gpu_P)
    node_P = gpu_P // wn
    own_P = flows_PG[np.arange(P), node_P]
    ri = a * np.bincount(gpu_P, own_P, W)
    re = np.bincount(gpu_P, flows_PG.sum(1) - own_P, W)
    own_G = np.bincount(node_P, own_P, G)
    se = (flows_PG.sum(0) - own_G) / wn
    si = a * own_G / wn
    node_W = np.arange(W) // wn
    t = np.maximum(
        np.maximum(si[node_W], ri) / links.intra.bytes_per_s, np.maximum(se[node_W], re) / links.inter.bytes_per_s
    )
    return LinkTimes(t_W=t, recv_intra_W=ri, recv_inter_W=re, send_intra_G=si, send_inter_G=se)


def expected_step_seconds(
    phy2log_LP: np.ndarray, usage_GLE: np.ndarray, *, num_ranks: int, links: Links = DEFAULT_LINKS
) -> float:
    """Sum over layers of the busiest GPU's expected link time, seconds per byte of one copy.

    ``phy2log_LP``: int [L, P]; ``usage_GLE``: float [G, L, E] expected copies per step from each node.
    Slot ``p`` is on GPU ``p // (P / W)``.
    """
    L, P = phy2log_LP.shape
    G = usage_GLE.shape[0]
    gpu_P = np.arange(P) // (P // num_ranks)
    return float(
        sum(
            layer_link_times(
                slot_flows_PG(phy2log_LP[l], usage_GLE[:, l, :]), gpu_P, num_ranks=num_ranks, num_nodes=G, links=links
            ).t_W.max()
            for l in range(L)
        )
    )


def _pow(r: np.ndarray) -> np.ndarray:
    """``r ** 8``, the smooth maximum's terms (three squarings)."""
    r = r * r
    r = r * r
    return r * r


def _others(num_ranks: int, ranks_per_node: int) -> np.ndarray:
    """The other GPUs of each GPU's node, int64 [W, ranks_per_node - 1]."""
    w = np.arange(num_ranks)
    base = (w // ranks_per_node) * ranks_per_node
    k = np.arange(ranks_per_node - 1)[None, :]
    return base[:, None] + k + (k >= (w % ranks_per_node)[:, None])


def _best_swap(
    flows_PG: np.ndarray,
    gpu_P: np.ndarray,
    movable_P: np.ndarray,
    lt: LinkTimes,
    *,
    others_WO: np.ndarray,
    links: Links,
) -> tuple[float, int, int]:
    """The swap of one of the busiest GPU's slots with another slot that lowers the smooth maximum most:
    ``(change, slot_x, slot_y)``; ``(0.0, -1, -1)`` when none lowers it. ``others_WO``: ``_others``."""
    W, wn = len(lt.t_W), others_WO.shape[1] + 1
    a = (wn - 1) / wn
    bi, be = links.intra.bytes_per_s, links.inter.bytes_per_s
    t = lt.t_W
    m = float(t.max())
    if m <= 0:
        return 0.0, -1, -1
    tq = _pow(t / m)
    node_W = np.arange(W) // wn
    tot_P = flows_PG.sum(1)
    w1 = int(np.argmax(t))  # the straggler (the first, on a tie)
    g1 = int(node_W[w1])
    X = np.flatnonzero(gpu_P == w1)
    Y = np.flatnonzero(gpu_P != w1)
    w2 = gpu_P[Y]
    g2 = w2 // wn
    cross_Y = g2 != g1
    ok = ~cross_Y[None, :] | (movable_P[X][:, None] & movable_P[Y][None, :])  # [x, y]
    ux1, uy1 = flows_PG[X, g1][:, None], flows_PG[Y, g1][None, :]  # own flows where they would land
    ux2, uy2 = flows_PG[X[:, None], g2[None, :]], flows_PG[Y, g2][None, :]
    tx, ty = tot_P[X][:, None], tot_P[Y][None, :]
    ri1 = lt.recv_intra_W[w1] + a * (uy1 - ux1)
    re1 = lt.recv_inter_W[w1] + (ty - uy1) - (tx - ux1)
    ri2 = lt.recv_intra_W[w2][None, :] + a * (ux2 - uy2)
    re2 = lt.recv_inter_W[w2][None, :] + (tx - ux2) - (ty - uy2)
    d1 = np.where(cross_Y[None, :], uy1 - ux1, 0.0)  # node g1's own copies gained
    d2 = np.where(cross_Y[None, :], ux2 - uy2, 0.0)
    si1, se1 = lt.send_intra_G[g1] + a * d1 / wn, lt.send_inter_G[g1] - d1 / wn
    si2, se2 = lt.send_intra_G[g2][None, :] + a * d2 / wn, lt.send_inter_G[g2][None, :] - d2 / wn
    t1 = np.maximum(np.maximum(si1, ri1) / bi, np.maximum(se1, re1) / be)
    t2 = np.maximum(np.maximum(si2, ri2) / bi, np.maximum(se2, re2) / be)
    change = _pow(t1 / m) + _pow(t2 / m) - tq[w1] - tq[w2][None, :]
    worse = np.maximum(t1, t2) > m * (1 + 1e-12)  # a swap never raises the layer's maximum
    if wn > 1:  # a swap between nodes also changes the sends of both nodes' other GPUs
        o1 = others_WO[w1]
        to1 = np.maximum(
            np.maximum(si1[..., None], lt.recv_intra_W[o1]) / bi,
            np.maximum(se1[..., None], lt.recv_inter_W[o1]) / be,
        )
        change += np.where(cross_Y[None, :], _pow(to1 / m).sum(-1) - tq[o1].sum(), 0.0)
        worse |= cross_Y[None, :] & (to1.max(-1) > m * (1 + 1e-12))
        others_YO = others_WO[w2]  # [y, wn - 1]
        to2 = np.maximum(
            np.maximum(si2[..., None], lt.recv_intra_W[others_YO][None]) / bi,
            np.maximum(se2[..., None], lt.recv_inter_W[others_YO][None]) / be,
        )
        change += np.where(cross_Y[None, :], _pow(to2 / m).sum(-1) - tq[others_YO].sum(-1)[None, :], 0.0)
        worse |= cross_Y[None, :] & (to2.max(-1) > m * (1 + 1e-12))
    change = np.where(ok & ~worse, change, np.inf)
    i, j = np.unravel_index(int(np.argmin(change)), change.shape)
    if not change[i, j] < -1e-12:
        return 0.0, -1, -1
    return float(change[i, j]), int(X[i]), int(Y[j])


def improve_layout(
    phy2log_LP: np.ndarray,
    usage_GLE: np.ndarray,
    *,
    num_ranks: int,
    links: Links = DEFAULT_LINKS,
    across_nodes: bool = True,
    max_moves: int = 200,
) -> np.ndarray:
    """``phy2log_LP`` with slots swapped between GPUs to lower each layer's busiest GPU's expected link
    time (module docstring), int64 [L, P]; at most ``max_moves`` swaps per layer.

    ``usage_GLE``: float [G, L, E] expected copies per step from each node (any positive scale). Each
    GPU keeps its number of slots; every expert keeps its replicas (count unchanged); experts with
    replicas stay on their nodes, and every expert does with ``across_nodes`` False (a node membership
    that must hold, e.g. a group-limited router's groups kept whole). Never worse than its input under
    this objective (each layer's smooth maximum only falls).
    """
    out = np.array(phy2log_LP, dtype=np.int64, copy=True)
    L, P = out.shape
    G = usage_GLE.shape[0]
    per_rank = P // num_ranks
    others_WO = _others(num_ranks, num_ranks // G)  # [W, wn - 1]: the other GPUs of each GPU's node
    for l in range(L):
        phy = out[l]
        u_GE = np.asarray(usage_GLE[:, l, :], dtype=np.float64)
        copies_E = np.bincount(phy, minlength=u_GE.shape[1])
        movable_P = (copies_E[phy] == 1) & across_nodes
        gpu_P = np.arange(P) // per_rank  # slot positions stay; their experts move
        flows = slot_flows_PG(phy, u_GE)
        for _ in range(max_moves):
            lt = layer_link_times(flows, gpu_P, num_ranks=num_ranks, num_nodes=G, links=links)
            change, x, y = _best_swap(flows, gpu_P, movable_P, lt, others_WO=others_WO, links=links)
            if x < 0:
                break
            gpu_P[x], gpu_P[y] = gpu_P[y], gpu_P[x]  # a slot's flows stay: single copies' do not depend on their node
        # slot positions back in GPU order, each GPU's experts ascending
        order = np.lexsort((phy, gpu_P))
        out[l] = phy[order]
    return out
