"""The per-step cost model: what one MoE layer's dispatch, expert computation and combine take, in
seconds, on the busiest GPU (docs/placement.md, "Cost model", has the formulas).

Per (batch, layer) and GPU ``w`` of the expert-parallel group, for each link class ``c`` (``intra``:
GPUs of one node, NVLink; ``inter``: GPUs of different nodes, RDMA):

- ``t_c[w] = max(send_c[w], recv_c[w]) / bandwidth_c + max(peers_sent_c[w], peers_recv_c[w]) * latency_c``
  where ``send``/``recv`` are the bytes ``w`` sends and receives over class ``c`` (a link is full
  duplex: sending and receiving overlap) and ``peers`` the distinct GPUs it sends to / receives from
  (one message each). With ``inter_nic="node"`` (one network link per node, as ``moetrace a2a``'s
  emulated nodes have) the inter-node bytes and peers of all GPUs of a node add up on that link and
  every GPU of the node waits for it.
- The two classes are separate hardware and run at once: ``t[w] = max(t_intra[w], t_inter[w])``.
- The collective ends when its slowest GPU ends: ``dispatch = max_w t[w]``. Combine sends the same
  copies back (reverse direction), so under this model it takes as long as dispatch.
- Expert computation per GPU: ``max(activated_experts[w] * expert_weight_bytes / hbm_bandwidth,
  routed_pairs[w] * expert_flops_per_token / peak_flops)`` (memory-bound decode pays for every
  distinct expert a GPU activates; compute-bound prefill for every (token, expert) pair); the layer
  waits for the slowest GPU.
- ``moe = dispatch + max_w expert[w] + combine`` (each phase ends in a synchronisation).

Which copies a token sends comes from the dedup unit (``simulate``): ``expert`` (one copy per
(token, expert), DeepEP's low-latency kernels, the decode default), ``rank`` (one per destination
GPU), ``node`` (one per remote node, DeepEP's normal kernels, the prefill default): the copy to a
remote node lands on the GPU with the sender's local index there (DeepEP's RDMA peer) and is
forwarded over NVLink to the other destination GPUs of that node; that forwarding counts as
intra-node traffic of the node that receives it.

Shape legend (docs/architecture.md): T tokens, K top-k slots, B batches, W EP ranks (GPUs).

Out of scope: attention and dense layers; overlap of communication with computation (two-batch
overlap would hide part of the all-to-all); congestion inside the network fabric; kernel launch
costs; FP8 dispatch (set ``bytes_per_value``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from moetrace.errors import ConfigError

__all__ = [
    "Link",
    "Links",
    "ExpertCompute",
    "CostModel",
    "DEFAULT_LINKS",
    "H100_HBM_BYTES_PER_S",
    "H100_BF16_FLOPS",
    "parse_links",
    "expert_compute_for",
    "GpuTraffic",
    "gpu_traffic",
    "collective_seconds_BW",
    "expert_seconds_BW",
]

InterNic = Literal["gpu", "node"]


@dataclass(frozen=True, kw_only=True)
class Link:
    """One link class, per GPU and direction."""

    bytes_per_s: float  # sustained bandwidth, bytes per second
    latency_s: float  # fixed cost of one message (one peer of one collective), seconds

    def __post_init__(self) -> None:
        if not (self.bytes_per_s > 0 and np.isfinite(self.bytes_per_s)):
            raise ConfigError(f"link bandwidth must be a positive number, got {self.bytes_per_s}")
        if not (self.latency_s >= 0 and np.isfinite(self.latency_s)):
            raise ConfigError(f"link latency must be >= 0, got {self.latency_s}")


@dataclass(frozen=True, kw_only=True)
class Links:
    """The two link classes of an expert-parallel deployment."""

    intra: Link  # between GPUs of one node (NVLink)
    inter: Link  # between GPUs of different nodes (RDMA), per GPU (inter_nic "gpu") or per node
    inter_nic: InterNic = "gpu"  # "gpu": every GPU has its own network link; "node": one link per node, shared

    def to_json(self) -> dict[str, object]:
        return {
            "intra_bytes_per_s": self.intra.bytes_per_s,
            "intra_latency_s": self.intra.latency_s,
            "inter_bytes_per_s": self.inter.bytes_per_s,
            "inter_latency_s": self.inter.latency_s,
            "inter_nic": self.inter_nic,
        }


#: DeepEP's normal kernels on H800 measure about 155 GB/s over NVLink inside a node and 43-58 GB/s
#: per GPU over RDMA between nodes (DeepEP README, "Normal kernels with NVLink and RDMA forwarding");
#: 0.4 us per RDMA message fits its low-latency table (dispatch of 128 tokens, top-8: 155 us at EP32,
#: 192 us at EP128, i.e. 37 us for 96 more peers); the NVLink message cost is an assumption (docs/placement.md).
DEFAULT_LINKS = Links(intra=Link(bytes_per_s=155e9, latency_s=0.2e-6), inter=Link(bytes_per_s=50e9, latency_s=0.4e-6))
#: H100 SXM: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16 (NVIDIA H100 datasheet)
H100_HBM_BYTES_PER_S = 3.35e12
H100_BF16_FLOPS = 989e12


@dataclass(frozen=True, kw_only=True)
class ExpertCompute:
    """What one routed expert costs on one GPU (a gated MLP: three hidden x ffn matrices)."""

    hidden_size: int  # model dimension of the full-size model
    ffn_size: int  # the expert's intermediate size (moe_intermediate_size)
    weight_bytes_per_value: float = 2.0  # bytes per weight (bf16 = 2, fp8 = 1)
    hbm_bytes_per_s: float = H100_HBM_BYTES_PER_S  # memory bandwidth per GPU
    peak_flops: float = H100_BF16_FLOPS  # dense matrix throughput per GPU, FLOP/s

    @property
    def weight_bytes(self) -> float:
        """Bytes of one expert's weights (gate, up and down projections)."""
        return 3.0 * self.hidden_size * self.ffn_size * self.weight_bytes_per_value

    @property
    def flops_per_token(self) -> float:
        """FLOPs of one token through one expert (2 per multiply-add, three matrices)."""
        return 6.0 * self.hidden_size * self.ffn_size

    def to_json(self) -> dict[str, object]:
        return {
            "hidden_size": self.hidden_size,
            "ffn_size": self.ffn_size,
            "weight_bytes_per_value": self.weight_bytes_per_value,
            "hbm_bytes_per_s": self.hbm_bytes_per_s,
            "peak_flops": self.peak_flops,
        }


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Links and expert computation: everything the per-step time needs besides the traffic."""

    links: Links = DEFAULT_LINKS  # link classes
    expert: ExpertCompute | None = None  # None: the model's expert size is unknown (no expert term)

    def to_json(self) -> dict[str, object]:
        return {"links": self.links.to_json(), "expert": None if self.expert is None else self.expert.to_json()}


_RATE_UNITS = {  # to bytes per second
    "gb/s": 1e9,
    "gbps": 1e9 / 8,  # the networking convention: gigabits
    "gbit": 1e9 / 8,
    "mb/s": 1e6,
    "mbit": 1e6 / 8,
    "tb/s": 1e12,
    "gb": 1e9,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def _rate(text: str) -> float:
    m = re.fullmatch(_NUM + r"\s*([A-Za-z/]*)", text.strip())
    unit = (m.group(2) or "GB/s").lower() if m else ""
    if not m or unit not in _RATE_UNITS:
        raise ConfigError(
            f"--link: bandwidth {text!r} is not a rate; write e.g. 155GB/s, 400Gbit or 50 (GB/s); units: "
            + ", ".join(_RATE_UNITS)
        )
    return float(m.group(1)) * _RATE_UNITS[unit]


def _time(text: str) -> float:
    m = re.fullmatch(_NUM + r"\s*([A-Za-z]*)", text.strip())
    unit = (m.group(2) or "us").lower() if m else ""
    if not m or unit not in _TIME_UNITS:
        raise ConfigError(f"--link: latency {text!r} is not a time; write e.g. 2us, 0.5ms or 3 (us)")
    return float(m.group(1)) * _TIME_UNITS[unit]


def parse_links(spec: str | None, *, base: Links = DEFAULT_LINKS) -> Links:
    """``intra=BW[,LAT],inter=BW[,LAT]`` (either class may be left out: it keeps ``base``'s) to ``Links``.

    BW: a number with a unit (``155GB/s``, ``400Gbit``; a bare number is GB/s); LAT: a time
    (``2us``, ``0.5ms``; a bare number is microseconds).
    """
    if spec is None or not spec.strip():
        return base
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for part in spec.split(","):
        part = part.strip()
        if "=" in part:
            key, _, value = part.partition("=")
            key = key.strip().lower()
            if key not in ("intra", "inter"):
                raise ConfigError(f"--link: unknown link class {key!r}; write intra=BW[,LAT],inter=BW[,LAT]")
            if key in found:
                raise ConfigError(f"--link: {key} given twice")
            current = found[key] = [value]
        elif current is None or len(current) >= 2:
            raise ConfigError(f"--link: cannot read {part!r} in {spec!r}; write intra=BW[,LAT],inter=BW[,LAT]")
        else:
            current.append(part)
    links = {"intra": base.intra, "inter": base.inter}
    for key, vals in found.items():
        old = links[key]
        links[key] = Link(bytes_per_s=_rate(vals[0]), latency_s=_time(vals[1]) if len(vals) > 1 else old.latency_s)
    return Links(intra=links["intra"], inter=links["inter"], inter_nic=base.inter_nic)


#: bytes per expert weight of the released checkpoints that are not BF16: DeepSeek-V3 ships FP8,
#: gpt-oss MXFP4 (4-bit values with one 8-bit scale per 32)
_WEIGHT_BYTES = {"deepseek-v3": 1.0, "gpt-oss-120b": 4.25 / 8}


def expert_compute_for(model_name: str, *, hidden_size: int | None = None) -> ExpertCompute | None:
    """The full-size expert of a preset (``-tiny`` presets: the full model they mirror), or None for a
    model that is not a preset (its expert size is not recorded in traces). The ffn size is the
    config's ``moe_intermediate_size``, else its ``intermediate_size``; weights are BF16 but where the
    release is not (``_WEIGHT_BYTES``)."""
    from moetrace.tracer.presets import TINY_SUFFIX, list_presets

    base = model_name[: -len(TINY_SUFFIX)] if model_name.endswith(TINY_SUFFIX) else model_name
    preset = next((p for p in list_presets() if base in (p.name, p.hub_id)), None)
    if preset is None:
        return None
    ffn = preset.config.get("moe_intermediate_size") or preset.config.get("intermediate_size")
    if not ffn:
        return None
    return ExpertCompute(
        hidden_size=hidden_size or preset.hidden_size,
        ffn_size=int(ffn),
        weight_bytes_per_value=_WEIGHT_BYTES.get(preset.name, 2.0),
    )


class GpuTraffic(NamedTuple):
    """One layer's dispatch traffic per (batch, GPU), in token copies; every array float64 [B, W].
    Combine is the same traffic in reverse (send and receive swapped)."""

    send_intra: np.ndarray
    recv_intra: np.ndarray
    send_inter: np.ndarray
    recv_inter: np.ndarray
    peers_send_intra: np.ndarray  # distinct GPUs sent to over NVLink
    peers_recv_intra: np.ndarray
    peers_send_inter: np.ndarray
    peers_recv_inter: np.ndarray


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


def gpu_traffic(
    *,
    rank_TK: np.ndarray,
    valid_TK: np.ndarray,
    batch_T: np.ndarray,
    src_rank_T: np.ndarray,
    num_batches: int,
    num_ranks: int,
    ranks_per_node: int,
    dedup: Literal["rank", "expert", "node"],
    sorted_rank_TK: np.ndarray | None = None,
) -> GpuTraffic:
    """Per (batch, GPU) copies sent and received and peers per link class, for one layer's dispatch.

    ``rank_TK``: int64 [T, K] GPU serving each (token, routed expert) (the replica the routing
    chose); ``valid_TK``: bool [T, K] the id was recorded; ``batch_T``, ``src_rank_T``: int64 [T].
    ``sorted_rank_TK`` (optional, to save a sort): ``rank_TK`` sorted along K with every invalid
    entry replaced by a value >= W. A copy to the token's own GPU moves nothing. ``node``: see the
    module docstring (landing GPU, NVLink forwarding).
    """
    B, W, g = num_batches, num_ranks, ranks_per_node
    src = np.asarray(src_rank_T, dtype=np.int64)[:, None]
    base = np.asarray(batch_T, dtype=np.int64)[:, None] * W
    if dedup == "expert":
        dst = np.asarray(rank_TK, dtype=np.int64)
        keep = np.asarray(valid_TK, dtype=bool) & (dst != src)
    else:  # one entry per distinct (token, GPU): runs of equal ranks in the sorted row
        dst = np.sort(np.where(valid_TK, rank_TK, W), axis=1) if sorted_rank_TK is None else sorted_rank_TK
        keep = dst < W
        keep[:, 1:] &= dst[:, 1:] != dst[:, :-1]
        keep &= dst != src
    pair_key = (base + src) * W + dst
    if dedup != "node":
        return _traffic_of_copies(pair_key[keep], B, W, g)
    # per remote node one RDMA copy to the sender's peer GPU there, then NVLink forwards
    node = dst // g
    remote = keep & (node != src // g)
    land = node * g + src % g
    first = remote.copy()  # the first distinct GPU of each remote node in the (sorted) row
    first[:, 1:] &= node[:, 1:] != node[:, :-1]
    fwd = remote & (land != dst)
    key = np.concatenate([pair_key[keep & ~remote], ((base + src) * W + land)[first], ((base + land) * W + dst)[fwd]])
    return _traffic_of_copies(key, B, W, g)


def _per_node(x_BW: np.ndarray, g: int) -> np.ndarray:
    """Each GPU's value replaced by the sum over its node's GPUs, [B, W]."""
    B, W = x_BW.shape
    return np.repeat(x_BW.reshape(B, W // g, g).sum(2), g, axis=1)


def collective_seconds_BW(
    traffic: GpuTraffic, *, links: Links, bytes_per_copy: float, ranks_per_node: int
) -> np.ndarray:
    """Seconds each GPU spends in one layer's dispatch (= its combine), float64 [B, W]:
    ``max`` over link classes of ``max(send, recv) * bytes_per_copy / bandwidth + max(peers) * latency``."""
    intra = (
        np.maximum(traffic.send_intra, traffic.recv_intra) * bytes_per_copy / links.intra.bytes_per_s
        + np.maximum(traffic.peers_send_intra, traffic.peers_recv_intra) * links.intra.latency_s
    )
    send, recv = traffic.send_inter, traffic.recv_inter
    ps, pr = traffic.peers_send_inter, traffic.peers_recv_inter
    if links.inter_nic == "node":
        send, recv, ps, pr = (_per_node(x, ranks_per_node) for x in (send, recv, ps, pr))
    inter = (
        np.maximum(send, recv) * bytes_per_copy / links.inter.bytes_per_s + np.maximum(ps, pr) * links.inter.latency_s
    )
    return np.maximum(intra, inter)


def expert_seconds_BW(pairs_BW: np.ndarray, active_BW: np.ndarray, *, expert: ExpertCompute) -> np.ndarray:
    """Seconds each GPU spends in one layer's experts, float64 [B, W]: the larger of reading the
    weights of its ``active_BW`` activated experts and computing its ``pairs_BW`` (token, expert) pairs."""
    memory = active_BW * (expert.weight_bytes / expert.hbm_bytes_per_s)
    compute = pairs_BW * (expert.flops_per_token / expert.peak_flops)
    return np.maximum(memory, compute)
