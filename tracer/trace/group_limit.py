"""The group-limited routing check of ``validate``: no (token, layer) uses more router groups than the model allows.

A group-limited router (DeepSeek-V3: ``n_group`` = 8 groups of 32 consecutive experts, ``topk_group`` = 4) picks a
token's top-k experts from at most ``topk_group`` groups, so ids that span more are not its logical expert ids.
:class:`GroupLimit` counts such rows batch by batch, vectorized with numpy (``numba`` is optional): each id's
group bit (a direct id -> bit table, or for 8 groups of 2**s experts two shifts), OR-folded over a row's K ids,
then a popcount. The ids are worked through in chunks whose temporaries stay in cache.

Out of scope: the other row checks and their order (``checks``).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from moetrace.tracer.trace.schema import ModelInfo


class Rows(Protocol):
    """What the check reads of a batch of routing rows (``checks.RowBatch``)."""

    num_rows: int
    ids_N: np.ndarray  # the expert ids, flat [T*L*K] (int16 in a valid part)
    request_id_T: np.ndarray  # int64 [T]
    position_T: np.ndarray  # int64 [T]


#: set bits of every byte value
_POPCOUNT8 = np.array([i.bit_count() for i in range(256)], dtype=np.uint8)


#: ids the group-limited routing check works through at a time (its uint16 and uint8 temporaries stay in cache)
_GROUP_CHUNK_IDS = 1 << 18


class GroupLimit:
    """Counts (token, layer) rows whose experts span more groups than a group-limited router allows."""

    def __init__(self, model: ModelInfo) -> None:
        assert model.n_group is not None and model.topk_group is not None
        self.model = model
        self.n_group, self.topk_group = model.n_group, model.topk_group
        self.K, self.L = model.top_k, model.num_moe_layers
        self.size = model.num_experts // self.n_group  # experts per group (consecutive ids)
        self.dtype = np.uint8 if self.n_group <= 8 else np.uint64
        # the bit of its group of every int16 id read as uint16, looked up directly (-1 -> 65535 and ids of no
        # group: no bit)
        group = np.arange(1 << 16) // self.size
        self.bit_of_id = np.where(
            group < self.n_group, np.left_shift(1, np.minimum(group, 63).astype(np.uint64)), 0
        ).astype(self.dtype)
        # 8 groups of 2**s experts (DeepSeek-V3: 32): the bit is 1 << (id >> s) in uint16, cut to uint8, which
        # is the table's without a gather (groups 8..15 shift past the byte, 16 on past the word: numpy's shifts
        # by the width or more are 0)
        pow2 = self.size & (self.size - 1) == 0
        self.shift = self.size.bit_length() - 1 if pow2 and self.n_group == 8 else None
        self.num_bad = 0
        self.example: tuple[int, int, int, list[int]] | None = None  # request, position, MoE layer, ids

    @classmethod
    def of(cls, model: ModelInfo) -> GroupLimit | None:
        return cls(model) if model.group_limited and model.n_group is not None and model.n_group <= 64 else None

    def add(self, b: Rows) -> None:
        """Count the batch's (token, layer) rows that use too many groups."""
        ids = b.ids_N
        if ids.size != b.num_rows * self.L * self.K or not b.num_rows or ids.dtype != np.int16:
            return  # a shape or type problem the other checks report
        u = ids.view(np.uint16)
        step = _GROUP_CHUNK_IDS - _GROUP_CHUNK_IDS % self.K  # whole rows; the temporaries stay in cache
        chunks = [self._bad_rows(u[lo : lo + step]) + lo // self.K for lo in range(0, u.size, step)]
        bad = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
        self.num_bad += len(bad)
        if len(bad) and self.example is None:
            t, layer = divmod(int(bad[0]), self.L)
            self.example = (
                int(b.request_id_T[t]),
                int(b.position_T[t]),
                layer,
                ids.reshape(-1, self.K)[bad[0]].tolist(),
            )

    def _bad_rows(self, u: np.ndarray) -> np.ndarray:
        """Of the (token, layer) rows of ids ``u`` (uint16, whole rows of K), those using too many groups."""
        if self.shift is not None:
            g = u >> np.uint16(self.shift)
            np.left_shift(np.uint16(1), g, out=g)
            bits = g.astype(np.uint8).reshape(-1, self.K)  # [token-layer rows, K]
        else:
            bits = self.bit_of_id[u].reshape(-1, self.K)
        if self.dtype is np.uint8 and self.K == 8:  # 8 bytes of a row as one uint64: OR-fold them
            v = np.ascontiguousarray(bits).view(np.uint64).reshape(-1)
            v |= v >> np.uint64(32)
            v |= v >> np.uint64(16)
            v |= v >> np.uint64(8)
            used = v.astype(np.uint8)  # the low byte
        else:
            used = np.bitwise_or.reduce(bits, axis=1)
        count = _POPCOUNT8[used] if self.dtype is np.uint8 else _POPCOUNT8[used.view(np.uint8)].reshape(-1, 8).sum(1)
        return np.flatnonzero(count > self.topk_group)

    def problem(self) -> str:
        m = self.model
        r, pos, layer, ids = self.example or (-1, -1, -1, [])
        return (
            f"routing: {self.num_bad} (token, MoE layer) rows use experts of more than topk_group={m.topk_group} of the "
            f"router's n_group={m.n_group} groups, e.g. request {r} position {pos} MoE layer {layer}: experts {ids} "
            f"(groups {sorted({e // self.size for e in ids if e >= 0})}); {m.name}'s router never picks such a set, so "
            "these are not its logical expert ids (physical slots after an EPLB remap? another model's ids?): "
            "re-collect or re-import with logical ids, or correct n_group/topk_group in the manifest's model section "
            "if this model routes without a group limit"
        )
