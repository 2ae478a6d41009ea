"""The replay's per-rank record is a type (``replay.rank.RankRecord``), never a dict: it survives the
paths it takes between processes (``gather_object``'s pickle on the ranks, ``launch_local``'s pickle
file to the parent), ``run_rank`` builds it with the bytes of the plan, and the readers (``results``,
``predict``) read it by attribute.

Shape legend (docs/architecture.md): B batches, L MoE layers, W EP ranks (GPUs), V strategies,
N probe repeats.
"""

from __future__ import annotations

import dataclasses
import pickle
import socket

import numpy as np
import pytest
from factories import PLANTED

from moetrace.placement import replay as ar
from moetrace.placement.a2a_manifest import A2AConfig
from moetrace.placement.replay.rank import RankRecord

HIDDEN = 16  # values per row: 32 bytes in bfloat16


def _plan(sends_VBLWW: np.ndarray, *, ranks_per_node: int) -> ar.A2APlan:
    """A hand-made plan of the send matrices int64 [V, B, L, W, W] (no trace, no placement)."""
    V, B, L, W, _ = sends_VBLWW.shape
    bpt = HIDDEN * ar.DTYPE_BYTES["bfloat16"]
    node = np.arange(W) // ranks_per_node
    inter_WW = node[:, None] != node[None, :]
    config = A2AConfig(
        deployment=f"DP{W}TP1EP{W}",
        gpus_per_node=ranks_per_node,
        num_ep=W,
        num_nodes=W // ranks_per_node,
        ranks_per_node=ranks_per_node,
        num_batches=B,
        batch_requests=1,
        dedup="expert",
        replica_policy="same_node",
        seed=0,
        test_fraction=0.2,
        trace="trace",
        model=PLANTED,
    )
    return ar.A2APlan(
        strategies=tuple(f"s{v}" for v in range(V)),
        sends_VBLWW=sends_VBLWW,
        sim_intra_VBL=(sends_VBLWW * ~inter_WW * bpt).sum(axis=(-1, -2)).astype(np.float64),
        sim_inter_VBL=(sends_VBLWW * inter_WW * bpt).sum(axis=(-1, -2)).astype(np.float64),
        ranks_per_node=ranks_per_node,
        hidden_size=HIDDEN,
        dtype="bfloat16",
        backend="gloo",
        config=config,
        model_layers=tuple(range(L)),
    )


def _record(rank: int = 0, *, V: int = 2, B: int = 3, L: int = 2, W: int = 4) -> RankRecord:
    rng = np.random.default_rng(rank)
    sent = rng.integers(0, 1000, (V, B, L, 2, W)).astype(np.int64)
    return RankRecord(
        rank=rank,
        sent_VBL2W=sent,
        recv_VBL2W=sent[..., ::-1].copy(),
        seconds_VBL2=rng.random((V, B, L, 2)),
        probe_empty_seconds_BN=rng.random((B, ar.PROBE_REPEATS)),
        probe_intra_seconds_BN=np.full((B, ar.PROBE_REPEATS), np.nan),
        probe_intra_bytes=ar.PROBE_INTRA_BYTES,
        payload_errors=("rank 0 s0 batch 0 layer 0 dispatch: a received row does not carry ...",),
        device="cpu",
        host="h",
    )


def _assert_same(a: RankRecord, b: RankRecord) -> None:
    """Field for field: arrays equal with their dtype and shape (NaN equal to NaN), the rest equal."""
    assert type(a) is type(b) is RankRecord
    for f in dataclasses.fields(RankRecord):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape, f.name
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        else:
            assert type(x) is type(y) and x == y, f.name


def test_rank_record_is_frozen_and_keyword_only():
    rec = _record()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.rank = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        RankRecord(0, rec.sent_VBL2W)  # type: ignore[misc]
    assert not isinstance(rec, dict)


@pytest.mark.parametrize("protocol", [pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_rank_record_round_trips_through_pickle(protocol):
    """``gather_object`` pickles each rank's record to rank 0; ``launch_local`` pickles rank 0's list
    to a file the parent loads: both are ``pickle`` of the record, or of a list of them."""
    recs = [_record(w) for w in range(4)]
    back = pickle.loads(pickle.dumps(recs, protocol=protocol))
    assert isinstance(back, list) and len(back) == 4
    for a, b in zip(recs, back, strict=True):
        _assert_same(a, b)


def test_gathered_records_are_checked_to_be_records_in_rank_order():
    from moetrace.placement.replay.rank import _gathered_record

    rec = _record(1)
    assert _gathered_record(rec, 1) is rec
    with pytest.raises(TypeError, match="gathered record 0 is RankRecord of rank 1"):
        _gathered_record(rec, 0)
    with pytest.raises(TypeError, match="gathered record 1 is dict"):
        _gathered_record(dataclasses.asdict(rec), 1)


def test_run_rank_builds_a_record_with_the_plans_bytes():
    """One rank in this process (a 1-rank gloo group: its record still goes through ``gather_object``):
    ``run_rank`` returns a list of one ``RankRecord`` holding the plan's bytes, shaped as named."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    V, B, L, W = 2, 2, 3, 1
    sends = np.arange(1, V * B * L + 1, dtype=np.int64).reshape(V, B, L, W, W)  # rows each collective sends itself
    plan = _plan(sends, ranks_per_node=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        got = ar.run_rank(0, 1, plan)
    finally:
        dist.destroy_process_group()
    assert isinstance(got, list) and len(got) == 1
    rec = got[0]
    assert isinstance(rec, RankRecord) and rec.rank == 0
    bpt = plan.bytes_per_token
    assert rec.sent_VBL2W.dtype == rec.recv_VBL2W.dtype == np.int64
    assert rec.sent_VBL2W.shape == rec.recv_VBL2W.shape == (V, B, L, 2, W)
    for phase in (0, 1):  # dispatch and combine: the same rows to itself
        np.testing.assert_array_equal(rec.sent_VBL2W[..., phase, :], sends[..., 0, :] * bpt)
        np.testing.assert_array_equal(rec.recv_VBL2W[..., phase, :], sends[..., :, 0] * bpt)
    assert rec.seconds_VBL2.shape == (V, B, L, 2) and (rec.seconds_VBL2 > 0).all()
    assert rec.probe_empty_seconds_BN.shape == rec.probe_intra_seconds_BN.shape == (B, ar.PROBE_REPEATS)
    assert (rec.probe_empty_seconds_BN > 0).all()
    assert np.isnan(rec.probe_intra_seconds_BN).all() and rec.probe_intra_bytes == 0  # one rank per node: no probe
    assert rec.payload_errors == () and rec.device == "cpu" and rec.host == socket.gethostname()
    # the readers take the records by attribute
    assert ar.first_mismatch(plan, got) is None
    assert [r.strategy for r in ar.summary_rows(plan, got)] == ["s0", "s1"]
    _assert_same(rec, pickle.loads(pickle.dumps(rec)))


def test_readers_take_records_not_dicts():
    """``results`` and ``predict`` read records by attribute: a dict (the old record) is refused, not
    silently read."""
    plan = _plan(np.zeros((1, 1, 1, 2, 2), dtype=np.int64), ranks_per_node=1)
    recs = [
        dataclasses.replace(
            _record(w, V=1, B=1, L=1, W=2),
            sent_VBL2W=np.zeros((1, 1, 1, 2, 2), dtype=np.int64),
            payload_errors=(),
        )
        for w in range(2)
    ]
    assert ar.first_mismatch(plan, recs) is None
    emulated = ar.Network(mode="emulated", link="8Mbit", qdisc="tbf")
    cost = ar.replay_cost(plan, recs, emulated)
    assert cost is not None and cost.intra_probe_bytes == ar.PROBE_INTRA_BYTES
    assert cost.fixed_seconds == pytest.approx(
        float(np.median(np.stack([r.probe_empty_seconds_BN for r in recs]).max(0)))
    )
    with pytest.raises((AttributeError, TypeError)):
        ar.first_mismatch(plan, [dataclasses.asdict(r) for r in recs])  # type: ignore[misc]


@pytest.mark.slow
def test_local_ranks_hand_back_records(tmp_path):
    """Two local gloo ranks (``run_a2a``: spawned processes, ``gather_object``, the pickle file): the
    parent gets ``RankRecord`` objects in rank order, with the plan's bytes."""
    rng = np.random.default_rng(0)
    sends = rng.integers(0, 5, (2, 2, 2, 2, 2)).astype(np.int64)
    sends[..., [0, 1], [0, 1]] = 0  # nothing to the token's own GPU
    plan = _plan(sends, ranks_per_node=2)
    records, network = ar.run_a2a(plan, emulate=False)
    assert network.mode == "loopback" and records is not None
    assert [type(r) for r in records] == [RankRecord, RankRecord] and [r.rank for r in records] == [0, 1]
    bpt = plan.bytes_per_token
    for w, r in enumerate(records):
        np.testing.assert_array_equal(r.sent_VBL2W[..., 0, :], sends[..., w, :] * bpt)  # dispatch: its row
        np.testing.assert_array_equal(r.recv_VBL2W[..., 0, :], sends[..., :, w] * bpt)
        np.testing.assert_array_equal(r.sent_VBL2W[..., 1, :], sends[..., :, w] * bpt)  # combine: back
        assert r.probe_intra_bytes > 0 and (r.probe_intra_seconds_BN > 0).all()  # two ranks on one node
        assert r.payload_errors == () and r.device == "cpu"
    assert ar.first_mismatch(plan, records) is None
    paths = ar.write_a2a_results(tmp_path / "out", plan, records, network)
    assert [p.name for p in paths] == ["collectives.parquet", "a2a.json"]
