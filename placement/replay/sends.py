"""Per-GPU send matrices of expert-parallel dispatch and combine, from the simulator's own routing.

For every (batch, MoE layer) ``send_matrices`` counts the token copies each EP rank sends to each
other EP rank in dispatch: ``sends_BLWW[b, l, src, dst]``. It uses ``simulate.layer_copies``, the
routing of ``simulate_volume`` (replica policy), and the copies of its copy model
(``step_model.COPY_MODELS``: per expert, per GPU, or per node with the RDMA copy landing on the
sender's peer GPU and NVLink forwarding it there; nothing moves to the token's own GPU; the replay
sends both hops in one collective), so the matrix summed by link class times ``bytes_per_token``
is the simulator's ``dispatch_intra_bytes`` / ``dispatch_inter_bytes`` exactly; ``check_against_simulator``
asserts that. Combine sends the same copies back: its matrix is the transpose
(``sends_BLWW[b, l, dst, src]`` rows leave the expert side).

These matrices are the split sizes a real ``all_to_all_single`` needs (the replay runs them, ``rank``):
row ``src`` is rank ``src``'s ``input_split_sizes`` in dispatch, column ``dst`` its
``output_split_sizes``.

Shape legend (docs/architecture.md): T tokens, L MoE layers, K top-k slots, B batches, W EP ranks
(GPUs), V strategies.

Out of scope: choosing batches and placements (``compare``, ``plan``), running collectives and timing them
(``rank``), the volume metrics beyond bytes (``simulate``).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from moetrace.errors import MoetraceError
from moetrace.placement.simulate import layer_copies
from moetrace.placement.step_model import copy_model

__all__ = ["PHASES", "A2AMismatchError", "Phase", "check_against_simulator", "rank_link_bytes", "send_matrices"]

Phase = Literal["dispatch", "combine"]
#: the two collectives of a MoE layer, in order (the phase axis of the replay's records)
PHASES: tuple[Phase, Phase] = ("dispatch", "combine")


class A2AMismatchError(MoetraceError):
    "Measured all-to-all bytes differ from the simulator's prediction (or the send matrices from the simulator)."


def send_matrices(topk_ids_TLK: np.ndarray, **routing: Any) -> np.ndarray:
    """Token copies sent in dispatch, int64 [B, L, W, W] (``[b, l, src, dst]``; the diagonal is 0).

    ``topk_ids_TLK``: int [T, L, K] logical expert ids (-1 ignored); ``routing``: the keyword arguments
    of ``simulate.layer_copies`` (those of ``simulate_volume`` but ``bytes_per_token``): ``placement``,
    ``batch_T`` (int [T], batch of each token, 0..B-1), ``src_rank_T`` (int [T], EP rank it leaves
    from), ``num_batches`` B, ``num_ranks`` W, ``ranks_per_node``, ``dedup``, ``policy``.
    """
    B, W = routing["num_batches"], routing["num_ranks"]
    L = np.shape(topk_ids_TLK)[1]
    batch_T = np.asarray(routing["batch_T"], dtype=np.int64)
    src_rank_T = np.asarray(routing["src_rank_T"], dtype=np.int64)
    model = copy_model(routing.get("dedup", "rank"))
    out = np.zeros((B, L, W, W), dtype=np.int64)
    for l, c in enumerate(layer_copies(topk_ids_TLK, **routing)):
        keys = model.copy_keys(
            rank_TK=c.rank_TK,
            valid_TK=c.valid_TK,
            src_TK=src_rank_T[:, None],
            base_TK=batch_T[:, None] * W,
            num_ranks=W,
            ranks_per_node=routing["ranks_per_node"],
            sorted_rank_TK=None,
            slot_TK=c.slot_TK,
        )
        out[:, l] = np.bincount(keys, minlength=B * W * W).reshape(B, W, W)
    return out


def rank_link_bytes(
    sends_BLWW: np.ndarray, *, phase: Phase, ranks_per_node: int, bytes_per_token: int
) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each rank sends in ``phase``, split by link class: ``(intra_BLW, inter_BLW)``, int64 [B, L, W].

    Dispatch: rank ``w`` sends row ``w`` of ``sends_BLWW``; combine: column ``w`` (the copies come back).
    A link is inter-node when the two ranks' nodes (``rank // ranks_per_node``) differ.
    """
    s = np.asarray(sends_BLWW, dtype=np.int64)
    if phase == "combine":
        s = np.swapaxes(s, -1, -2)
    elif phase != "dispatch":
        raise ValueError(f"unknown phase {phase!r}")
    W = s.shape[-1]
    node_W = np.arange(W) // ranks_per_node
    inter_WW = node_W[:, None] != node_W[None, :]
    inter = (s * inter_WW).sum(-1) * bytes_per_token
    intra = (s * ~inter_WW).sum(-1) * bytes_per_token
    return intra, inter


def check_against_simulator(
    sends_BLWW: np.ndarray, sim: dict[str, np.ndarray], *, ranks_per_node: int, bytes_per_token: int, label: str = ""
) -> None:
    """Raise ``A2AMismatchError`` naming the first (batch, layer, phase, link class) where the matrices'
    bytes differ from ``simulate_volume``'s metrics ``sim`` (float64 [B, L] each); exact equality."""
    for phase in ("dispatch", "combine"):
        intra_BLW, inter_BLW = rank_link_bytes(
            sends_BLWW, phase=phase, ranks_per_node=ranks_per_node, bytes_per_token=bytes_per_token
        )
        for cls, got in (("intra", intra_BLW.sum(-1)), ("inter", inter_BLW.sum(-1))):
            want = sim[f"{phase}_{cls}_bytes"]
            bad = np.argwhere(got != want)
            if len(bad):
                b, l = (int(x) for x in bad[0])
                raise A2AMismatchError(
                    f"{label + ': ' if label else ''}send matrix gives {int(got[b, l])} {phase} {cls}-node bytes at batch {b}, "
                    f"layer {l}; the simulator {want[b, l]:.0f} ({len(bad)} (batch, layer) differ)"
                )
