"""The one step model: what one MoE layer's dispatch, expert computation and combine take on the
busiest GPU, from the layer's per-GPU traffic (docs/placement.md, "The step model").

Everything that prices a step calls this module: ``simulate_volume`` (``compare``, ``place``'s
tables), ``advise`` (on tokens and on counts), ``step_search`` (``joint``'s local search, in
expectation) and the ``a2a`` replay's prediction. A new cost term is one change here.

How a token's copies travel is a **copy model** (one class each, for bytes and time alike):

- ``PerExpert`` (``expert``): one copy per (token, routed expert), DeepEP's low-latency kernels;
- ``PerRank`` (``rank``): one copy per distinct destination GPU (NVLink all-to-alls such as
  TensorRT-LLM's);
- ``PerNode`` (``node``): one RDMA copy per remote node, landing on the GPU with the sender's local
  index there (DeepEP's RDMA peer), forwarded over NVLink to that node's other destination GPUs
  (DeepEP's normal kernels); the forwarding is intra-node traffic of the receiving node.

A copy to the token's own GPU moves nothing. What a copy carries and what moving it costs is a
**kernel** (``Kernel``): a copy model, and per phase (dispatch, combine) the value type on the wire
(``ValueType``: FP8 with one float32 scale per 128 values for DeepEP's dispatch, BF16 for every
combine), the link classes (bandwidth and per-message latency per GPU) and a fixed cost per
collective. Per (batch, layer), GPU ``w`` and link class ``c`` (``intra``: NVLink; ``inter``: RDMA):

- ``t_c[w] = max(send_c[w], recv_c[w]) * bytes_per_copy / bandwidth_c
  + max(peers_send_c[w], peers_recv_c[w]) * latency_c`` (links are full duplex);
- ``dispatch = fixed + max_w max_c t_c[w]`` (the two classes run at once; the slowest GPU ends it);
- combine moves the same copies back (send and receive swapped) with the combine phase's values
  and links, plus its own reduction: every GPU reads each copy returned to it once
  (``returned[w] * combine_bytes / reduce_bytes_per_s``) to sum a token's weighted expert outputs;
- ``expert = max_w (routed[w] + shared[w])`` (``cost.ExpertCompute``: memory-bound reads of the
  activated experts' weights or compute-bound (token, expert) pairs, whichever is longer; shared
  experts over the tokens a GPU holds);
- ``moe = dispatch + expert + combine`` (each phase ends in a synchronisation).

Shape legend (docs/architecture.md): T tokens, K top-k slots, B batches, W EP ranks (GPUs).

Out of scope: attention and dense layers; overlap of communication with computation (two-batch
overlap); congestion inside the network fabric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from moetrace.errors import ConfigError
from moetrace.placement.cost import ExpertCompute, Link, Links

__all__ = [
    "DedupUnit",
    "ValueType",
    "FP8_E4M3_BLOCK128",
    "BF16",
    "VALUE_TYPES",
    "GpuTraffic",
    "CopyModel",
    "PerExpert",
    "PerRank",
    "PerNode",
    "COPY_MODELS",
    "copy_model",
    "Phase",
    "Kernel",
    "LayerSeconds",
    "phase_seconds_BW",
    "search_links",
    "copy_pair_bytes",
    "layer_seconds",
]

DedupUnit = Literal["rank", "expert", "node"]


# ------------------------------------------------------------------------------ what a copy carries
@dataclass(frozen=True, kw_only=True)
class ValueType:
    """How one hidden vector travels: values, plus scales per block of values for quantised types."""

    name: str  # "fp8", "bf16"
    bytes_per_value: float  # bytes of one hidden value
    scale_bytes: float = 0.0  # bytes of one block's scale (0: no scales)
    block: int = 0  # values sharing one scale (0: no scales)

    def bytes_per_token(self, hidden_size: int) -> float:
        """Bytes of one copy of a ``hidden_size`` vector, scales included."""
        scales = math.ceil(hidden_size / self.block) * self.scale_bytes if self.block else 0.0
        return hidden_size * self.bytes_per_value + scales

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "bytes_per_value": self.bytes_per_value,
            "scale_bytes": self.scale_bytes,
            "block": self.block,
        }


#: DeepEP's FP8 dispatch: e4m3 values, one float32 scale per 128 channels (deep_ep/buffer.py
#: ``low_latency_dispatch(use_fp8=True)``; SGLang and vLLM call it with FP8 on by default)
FP8_E4M3_BLOCK128 = ValueType(name="fp8", bytes_per_value=1.0, scale_bytes=4.0, block=128)
#: BF16: every combine (DeepEP's low-latency and normal combine take bf16 inputs) and unquantised dispatch
BF16 = ValueType(name="bf16", bytes_per_value=2.0)
VALUE_TYPES = {"fp8": FP8_E4M3_BLOCK128, "bf16": BF16}


# ------------------------------------------------------------------------------ per-GPU traffic
class GpuTraffic(NamedTuple):
    """One layer's dispatch traffic per (batch, GPU), in copies; every array float64 [B, W].
    Combine is the same traffic in reverse (``reversed()``)."""

    send_intra: np.ndarray
    recv_intra: np.ndarray
    send_inter: np.ndarray
    recv_inter: np.ndarray
    peers_send_intra: np.ndarray  # distinct GPUs sent to over NVLink
    peers_recv_intra: np.ndarray
    peers_send_inter: np.ndarray
    peers_recv_inter: np.ndarray

    def reversed(self) -> GpuTraffic:
        """The same copies in the other direction (combine)."""
        return GpuTraffic(
            self.recv_intra,
            self.send_intra,
            self.recv_inter,
            self.send_inter,
            self.peers_recv_intra,
            self.peers_send_intra,
            self.peers_recv_inter,
            self.peers_send_inter,
        )

    def intra_copies_B(self) -> np.ndarray:
        """Copies over NVLink per batch, float64 [B]."""
        return self.send_intra.sum(axis=1)

    def inter_copies_B(self) -> np.ndarray:
        """Copies over the network per batch, float64 [B]."""
        return self.send_inter.sum(axis=1)


#: largest B * W * W for which the (batch, source, destination) counts are one dense bincount
_DENSE_PAIRS = 1 << 24


def _traffic_of_copies(key: np.ndarray, B: int, W: int, g: int) -> GpuTraffic:
    """Per (batch, GPU) copies sent and received and distinct peers, split by link class, from the
    copy keys ``(b * W + src) * W + dst`` (int64): a copy is intra-node when ``src`` and ``dst`` share
    a node of ``g`` GPUs."""
    if B * W * W <= _DENSE_PAIRS:  # one count of (batch, src, dst); the node's diagonal blocks are intra-node
        M = np.bincount(key, minlength=B * W * W).reshape(B, W, W)
        out = []
        for x in (M, M > 0):  # copies, then peers
            diag = np.diagonal(x.reshape(B, W // g, g, W // g, g), axis1=1, axis2=3)  # [B, g src, g dst, nodes]
            send_in = diag.sum(2, dtype=np.float64).transpose(0, 2, 1).reshape(B, W)
            recv_in = diag.sum(1, dtype=np.float64).transpose(0, 2, 1).reshape(B, W)
            out.append((send_in, recv_in, x.sum(2, dtype=np.float64) - send_in, x.sum(1, dtype=np.float64) - recv_in))
    else:  # too many (batch, src, dst) cells to hold: the distinct pairs only
        pair, n = np.unique(key, return_counts=True)
        bs, d = np.divmod(pair, W)
        b, s = np.divmod(bs, W)
        bd = b * W + d
        intra = s // g == d // g

        def per_gpu(w: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            def count(idx: np.ndarray, m: np.ndarray) -> np.ndarray:
                wm = None if w is None else w[m]
                return np.bincount(idx[m], weights=wm, minlength=B * W).reshape(B, W).astype(np.float64)

            return count(bs, intra), count(bd, intra), count(bs, ~intra), count(bd, ~intra)

        out = [per_gpu(n), per_gpu(None)]  # copies, then peers
    (si, ri, se, re_), (psi, pri, pse, pre) = out
    return GpuTraffic(si, ri, se, re_, psi, pri, pse, pre)


# ------------------------------------------------------------------------------ copy models
@dataclass(frozen=True)
class CopyModel:
    """How a token's copies travel. Subclasses set ``name`` and ``copy_keys``; one instance each."""

    name: DedupUnit = field(init=False)
    kernels: str = field(init=False)  # the kernels that send this way (docs)

    def traffic(
        self,
        *,
        rank_TK: np.ndarray,
        valid_TK: np.ndarray,
        batch_T: np.ndarray,
        src_rank_T: np.ndarray,
        num_batches: int,
        num_ranks: int,
        ranks_per_node: int,
        sorted_rank_TK: np.ndarray | None = None,
        slot_TK: np.ndarray | None = None,
    ) -> GpuTraffic:
        """Per (batch, GPU) copies sent and received and peers per link class, one layer's dispatch.

        ``rank_TK``: int64 [T, K] GPU serving each (token, routed expert) (the replica the routing
        chose); ``valid_TK``: bool [T, K] the id was recorded; ``batch_T``, ``src_rank_T``: int64 [T].
        ``sorted_rank_TK`` (optional, to save a sort): ``rank_TK`` sorted along K with every invalid
        entry replaced by a value >= W; ``slot_TK`` (optional): the physical slot of each entry, so
        that a slot named twice in one token's row is one copy.
        """
        W = num_ranks
        src = np.asarray(src_rank_T, dtype=np.int64)[:, None]
        base = np.asarray(batch_T, dtype=np.int64)[:, None] * W
        keys = self.copy_keys(
            rank_TK=np.asarray(rank_TK, dtype=np.int64),
            valid_TK=np.asarray(valid_TK, dtype=bool),
            src_TK=src,
            base_TK=base,
            num_ranks=W,
            ranks_per_node=ranks_per_node,
            sorted_rank_TK=sorted_rank_TK,
            slot_TK=slot_TK,
        )
        return _traffic_of_copies(keys, num_batches, W, ranks_per_node)

    def copy_keys(
        self,
        *,
        rank_TK: np.ndarray,
        valid_TK: np.ndarray,
        src_TK: np.ndarray,
        base_TK: np.ndarray,
        num_ranks: int,
        ranks_per_node: int,
        sorted_rank_TK: np.ndarray | None,
        slot_TK: np.ndarray | None = None,
    ) -> np.ndarray:
        """Every point-to-point copy of the layer as ``(batch * W + src) * W + dst``, int64 [n]."""
        raise NotImplementedError


def _distinct_ranks(rank_TK: np.ndarray, valid_TK: np.ndarray, W: int, sorted_rank_TK: np.ndarray | None):
    """Sorted destination ranks of each token (invalid entries >= W) and the mask of first entries."""
    dst = np.sort(np.where(valid_TK, rank_TK, W), axis=1) if sorted_rank_TK is None else sorted_rank_TK
    keep = dst < W
    keep[:, 1:] &= dst[:, 1:] != dst[:, :-1]
    return dst, keep


@dataclass(frozen=True)
class PerExpert(CopyModel):
    name: DedupUnit = field(default="expert", init=False)
    kernels: str = field(default="DeepEP low-latency (decode)", init=False)

    def copy_keys(self, *, rank_TK, valid_TK, src_TK, base_TK, num_ranks, ranks_per_node, sorted_rank_TK, slot_TK=None):
        keep = valid_TK & (rank_TK != src_TK)
        if slot_TK is not None:  # a slot named twice in a row is one copy (rows with a repeat only)
            s_TK = np.where(valid_TK, slot_TK, -1)
            srt = np.sort(s_TK, axis=1)
            rep = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(axis=1)
            if rep.any():
                r = np.flatnonzero(rep)
                sub = s_TK[r]
                later = np.zeros(sub.shape, dtype=bool)  # an entry whose slot an earlier entry of its row has
                for k in range(1, sub.shape[1]):
                    later[:, k] = (sub[:, :k] == sub[:, k : k + 1]).any(axis=1) & (sub[:, k] >= 0)
                keep[r] &= ~later
        return ((base_TK + src_TK) * num_ranks + rank_TK)[keep]


@dataclass(frozen=True)
class PerRank(CopyModel):
    name: DedupUnit = field(default="rank", init=False)
    kernels: str = field(default="NVLink all-to-all, one copy per GPU (TensorRT-LLM)", init=False)

    def copy_keys(self, *, rank_TK, valid_TK, src_TK, base_TK, num_ranks, ranks_per_node, sorted_rank_TK, slot_TK=None):
        dst, keep = _distinct_ranks(rank_TK, valid_TK, num_ranks, sorted_rank_TK)
        keep &= dst != src_TK
        return ((base_TK + src_TK) * num_ranks + dst)[keep]


@dataclass(frozen=True)
class PerNode(CopyModel):
    name: DedupUnit = field(default="node", init=False)
    kernels: str = field(default="DeepEP normal, NVLink forwarding (prefill)", init=False)

    def copy_keys(self, *, rank_TK, valid_TK, src_TK, base_TK, num_ranks, ranks_per_node, sorted_rank_TK, slot_TK=None):
        W, g = num_ranks, ranks_per_node
        dst, keep = _distinct_ranks(rank_TK, valid_TK, W, sorted_rank_TK)
        keep &= dst != src_TK
        node = dst // g
        remote = keep & (node != src_TK // g)
        land = node * g + src_TK % g  # the sender's RDMA peer on the remote node
        first = remote.copy()  # the first distinct GPU of each remote node in the (sorted) row
        first[:, 1:] &= node[:, 1:] != node[:, :-1]
        fwd = remote & (land != dst)
        return np.concatenate(
            [
                ((base_TK + src_TK) * W + dst)[keep & ~remote],
                ((base_TK + src_TK) * W + land)[first],
                ((base_TK + land) * W + dst)[fwd],
            ]
        )


COPY_MODELS: dict[str, CopyModel] = {m.name: m for m in (PerExpert(), PerRank(), PerNode())}


def copy_model(name: str) -> CopyModel:
    """The copy model of a ``--dedup`` name."""
    if name not in COPY_MODELS:
        raise ConfigError(f"unknown copy model {name!r}; choose one of {', '.join(COPY_MODELS)}")
    return COPY_MODELS[name]


# ------------------------------------------------------------------------------ kernels
@dataclass(frozen=True, kw_only=True)
class Phase:
    """One phase of a kernel (dispatch or combine): what a copy carries and what moving it costs."""

    value: ValueType  # what one copy carries on the wire
    links: Links  # the link classes this phase sees (bandwidth and per-message latency per GPU)
    fixed_s: float = 0.0  # fixed cost of one collective (launch, barrier, notify), seconds

    def to_json(self) -> dict[str, object]:
        return {"value": self.value.to_json(), "links": self.links.to_json(), "fixed_s": self.fixed_s}


@dataclass(frozen=True, kw_only=True)
class Kernel:
    """An all-to-all kernel's step-time parameters (one per copy model of a hardware preset)."""

    name: str  # "deepep-ll", "deepep-normal", "nvlink-a2a"
    copies: DedupUnit  # how a token's copies travel (``COPY_MODELS``)
    dispatch: Phase  # tokens to their experts
    combine: Phase  # expert outputs back, with the weighted reduction
    reduce_bytes_per_s: float = 3.35e12  # combine's reduction reads each returned copy at this rate (HBM)
    source: str = ""  # where the parameters come from (a measured table and the fit, or an assumption)

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "copies": self.copies,
            "dispatch": self.dispatch.to_json(),
            "combine": self.combine.to_json(),
            "reduce_bytes_per_s": self.reduce_bytes_per_s,
            "source": self.source,
        }


def copy_pair_bytes(kernel: Kernel, *, hidden_size: int) -> float:
    """Bytes of one dispatch copy plus one combine copy of a token (what ``search_links``' times are per)."""
    return kernel.dispatch.value.bytes_per_token(hidden_size) + kernel.combine.value.bytes_per_token(hidden_size)


def search_links(kernel: Kernel, *, hidden_size: int) -> Links:
    """One set of links whose time per byte of a ``(dispatch + combine)`` copy pair is the kernel's,
    link class by class: what ``step_search`` (an expectation over one step, no fixed or per-message
    terms) charges. ``bytes_per_s_c = (d + c) / (d / bw_dispatch_c + c / bw_combine_c)`` with ``d``,
    ``c`` the bytes of one dispatch and one combine copy."""
    d = kernel.dispatch.value.bytes_per_token(hidden_size)
    c = kernel.combine.value.bytes_per_token(hidden_size)
    dl, cl = kernel.dispatch.links, kernel.combine.links

    def rate(bd: float, bc: float) -> float:
        return (d + c) / (d / bd + c / bc)

    return Links(
        intra=Link(bytes_per_s=rate(dl.intra.bytes_per_s, cl.intra.bytes_per_s), latency_s=0.0),
        inter=Link(bytes_per_s=rate(dl.inter.bytes_per_s, cl.inter.bytes_per_s), latency_s=0.0),
        inter_nic=dl.inter_nic,
    )


def _per_node(x_BW: np.ndarray, g: int) -> np.ndarray:
    """Each GPU's value replaced by the sum over its node's GPUs, [B, W]."""
    B, W = x_BW.shape
    return np.repeat(x_BW.reshape(B, W // g, g).sum(2), g, axis=1)


def phase_seconds_BW(traffic: GpuTraffic, *, links: Links, bytes_per_copy: float, ranks_per_node: int) -> np.ndarray:
    """Seconds each GPU spends moving one phase's copies, float64 [B, W] (fixed cost not included):
    ``max`` over link classes of ``max(send, recv) * bytes_per_copy / bandwidth + max(peers) * latency``.
    With ``links.inter_nic == "node"`` a node's GPUs share one network link."""
    intra = (
        np.maximum(traffic.send_intra, traffic.recv_intra) * (bytes_per_copy / links.intra.bytes_per_s)
        + np.maximum(traffic.peers_send_intra, traffic.peers_recv_intra) * links.intra.latency_s
    )
    send, recv = traffic.send_inter, traffic.recv_inter
    ps, pr = traffic.peers_send_inter, traffic.peers_recv_inter
    if links.inter_nic == "node":
        send, recv, ps, pr = (_per_node(x, ranks_per_node) for x in (send, recv, ps, pr))
    inter = (
        np.maximum(send, recv) * (bytes_per_copy / links.inter.bytes_per_s) + np.maximum(ps, pr) * links.inter.latency_s
    )
    return np.maximum(intra, inter)


class LayerSeconds(NamedTuple):
    """One layer's step time per batch, seconds, float64 [B] each (the busiest GPU of each phase)."""

    dispatch: np.ndarray
    combine: np.ndarray
    expert: np.ndarray  # NaN when the model's expert size is unknown
    moe: np.ndarray  # dispatch + expert + combine (NaN with expert)

    @property
    def a2a(self) -> np.ndarray:
        """Dispatch + combine, float64 [B]."""
        return self.dispatch + self.combine


def layer_seconds(
    traffic: GpuTraffic,
    *,
    kernel: Kernel,
    hidden_size: int,
    ranks_per_node: int,
    expert: ExpertCompute | None = None,
    pairs_BW: np.ndarray | None = None,
    active_BW: np.ndarray | None = None,
    tokens_BW: np.ndarray | None = None,
) -> LayerSeconds:
    """The step model of one MoE layer (module docstring), from its dispatch ``traffic``.

    ``hidden_size``: values per copy (the full-size model's); ``expert``: the routed expert's cost
    (None: expert and moe are NaN); ``pairs_BW``: (token, expert) pairs each GPU computes;
    ``active_BW``: experts (slots) with at least one token per GPU; ``tokens_BW``: tokens each GPU
    holds (its shared experts' work; None: no shared-expert term). All float [B, W].
    """
    g = ranks_per_node
    d_bytes = kernel.dispatch.value.bytes_per_token(hidden_size)
    c_bytes = kernel.combine.value.bytes_per_token(hidden_size)
    dispatch_BW = phase_seconds_BW(traffic, links=kernel.dispatch.links, bytes_per_copy=d_bytes, ranks_per_node=g)
    back = traffic.reversed()
    combine_BW = phase_seconds_BW(back, links=kernel.combine.links, bytes_per_copy=c_bytes, ranks_per_node=g)
    returned_BW = traffic.send_intra + traffic.send_inter  # copies each GPU sent out come back to it
    combine_BW = combine_BW + returned_BW * (c_bytes / kernel.reduce_bytes_per_s)
    dispatch_B = dispatch_BW.max(axis=1) + kernel.dispatch.fixed_s
    combine_B = combine_BW.max(axis=1) + kernel.combine.fixed_s
    if expert is None or pairs_BW is None or active_BW is None:
        expert_B = np.full(dispatch_B.shape, np.nan)
    else:
        e_BW = expert.routed_seconds(np.asarray(pairs_BW, dtype=np.float64), np.asarray(active_BW, dtype=np.float64))
        if tokens_BW is not None:
            e_BW = e_BW + expert.shared_seconds(np.asarray(tokens_BW, dtype=np.float64))
        expert_B = e_BW.max(axis=1)
    return LayerSeconds(dispatch=dispatch_B, combine=combine_B, expert=expert_B, moe=dispatch_B + expert_B + combine_B)
