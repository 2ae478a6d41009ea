"""NCCL for the all-to-all replay: which backend runs for how many GPUs (and what it says), and the
1-rank NCCL smoke check on a GPU (skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ConfigError
from moetrace.placement import replay as ar
from moetrace.placement.compare import CompareConfig, load_trace_data
from moetrace.placement.deployment import parse_deployment


def test_auto_uses_nccl_only_with_a_gpu_per_rank():
    assert ar.choose_backend("auto", world_size=4, torchrun=False, num_gpus=4) == ("nccl", "")
    assert ar.choose_backend("auto", world_size=4, torchrun=False, num_gpus=0) == ("gloo", "")  # no GPU: nothing to say
    assert ar.choose_backend("auto", world_size=16, torchrun=True, num_gpus=1) == (
        "nccl",
        "",
    )  # torchrun: one per process
    backend, note = ar.choose_backend("auto", world_size=4, torchrun=False, num_gpus=1)
    assert backend == "gloo"
    assert note == (
        "note: 4 ranks but 1 GPU(s) here (NCCL needs one per rank): using gloo on CPU; --smoke runs a 1-rank "
        "NCCL all_to_all on cuda:0 (a GPU check, not the 4-rank replay)"
    )


def test_nccl_with_too_few_gpus_is_refused_with_what_to_do():
    with pytest.raises(
        ConfigError,
        match=r"--backend nccl needs one GPU per rank: 4 ranks, 1 GPU\(s\) visible here.*"
        r"--backend gloo.*--smoke runs a 1-rank NCCL all_to_all on cuda:0",
    ):
        ar.choose_backend("nccl", world_size=4, torchrun=False, num_gpus=1)
    with pytest.raises(ConfigError) as exc:
        ar.choose_backend("nccl", world_size=4, torchrun=False, num_gpus=0)
    assert "--smoke" not in str(exc.value)  # no GPU at all: the smoke check is no way out
    assert ar.choose_backend("nccl", world_size=2, torchrun=False, num_gpus=2) == ("nccl", "")


def test_smoke_needs_one_gpu_and_no_torchrun():
    assert ar.choose_backend("auto", world_size=4, torchrun=False, num_gpus=1, smoke=True) == ("nccl", "")
    with pytest.raises(ConfigError, match="^--smoke needs a CUDA GPU and none is visible here"):
        ar.choose_backend("auto", world_size=4, torchrun=False, num_gpus=0, smoke=True)
    for kw in (dict(backend="auto", torchrun=True), dict(backend="gloo", torchrun=False)):
        with pytest.raises(ConfigError, match="--smoke is a 1-rank NCCL check in this process"):
            ar.choose_backend(world_size=4, num_gpus=1, smoke=True, **kw)


def test_cli_smoke_without_gpu_and_out_rules(replay_trace, tmp_path):
    base = [
        "a2a",
        str(replay_trace),
        "--config",
        "DP2TP2EP4",
        "--gpus-per-node",
        "2",
        "--batches",
        "1",
        "--redundancy",
        "4",
    ]
    r = CliRunner().invoke(app, [*base, "--smoke", "-o", str(tmp_path / "x")])
    assert r.exit_code == 2 and "--smoke prints its check and writes no results; drop -o" in r.output
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 2 and "-o/--out RESULTS is required (except with --smoke)" in r.output
    if not torch.cuda.is_available():
        r = CliRunner().invoke(app, [*base, "--smoke"])
        assert r.exit_code == 2 and "--smoke needs a CUDA GPU and none is visible here" in r.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the NCCL smoke check runs on cuda:0)")
def test_smoke_runs_nccl_all_to_all_on_one_gpu(replay_trace):
    cfg = CompareConfig(
        deployment=parse_deployment("DP2TP2EP4", num_gpus_per_node=2),
        strategies=("linear", "data"),
        num_batches=2,
        num_batch_requests=8,
        num_redundant=4,
    )
    plan = ar.build_plan(
        load_trace_data(replay_trace, test_fraction=cfg.test_fraction, seed=0), cfg=cfg, hidden_size=64, backend="nccl"
    )
    rows = ar.run_smoke(plan)
    B, L = plan.sim_inter_VBL.shape[1:]
    assert [r.strategy for r in rows] == ["linear", "data"]
    for v, r in enumerate(rows):
        assert r.collectives == B * L and r.seconds_median > 0
        total_BL = plan.sim_intra_VBL[v] + plan.sim_inter_VBL[v]
        assert r.bytes_per_collective_median == np.median(
            total_BL
        )  # the simulator's dispatch bytes (checked per collective)
    assert "NCCL smoke check on 1 GPU" in ar.format_smoke(plan, rows)


def test_smoke_table_reads_typed_rows(replay_trace):
    """The smoke check's table is built from its typed rows (no GPU needed to print one)."""
    cfg = CompareConfig(
        deployment=parse_deployment("DP2TP2EP4", num_gpus_per_node=2), strategies=("linear",), num_batches=2
    )
    plan = ar.build_plan(
        load_trace_data(replay_trace, test_fraction=cfg.test_fraction, seed=0), cfg=cfg, hidden_size=64
    )
    row = ar.SmokeRow(
        strategy="linear",
        collectives=4,
        bytes_per_collective_median=2048.0,
        seconds_median=1.5e-5,
        gbytes_per_second_median=0.14,
        device="NVIDIA H200",
    )
    text = ar.format_smoke(plan, [row])
    assert text.splitlines()[0].startswith("NCCL smoke check on 1 GPU (NVIDIA H200): each DP2TP2EP4")
    assert text.splitlines()[-1].split() == ["linear", "4", "2.0", "KiB", "1.50e-05", "0.14"]
    with pytest.raises(AttributeError):
        row.collectives = 5  # type: ignore[misc]
