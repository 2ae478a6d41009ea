"""Replay placements through real ``torch.distributed.all_to_all_single`` collectives (``moetrace a2a``).

One process per EP rank. The modules, in the order a replay runs them:

- ``sends``: the per-(batch, layer) send matrices from the simulator's own routing (pure);
- ``plan``: ``build_plan`` draws the same held-out global batches as ``compare`` (same seed), places
  each strategy (or reads placement files) and checks every send matrix exactly against
  ``simulate_volume``; the ``A2APlan`` every rank holds;
- ``capacity`` and ``backend``: whether this machine can run the local ranks, gloo or nccl;
- ``rank``: one rank's dispatch and combine collectives, timed, their bytes recorded, probes before
  every batch; its result a ``RankRecord``, gathered on rank 0;
- ``launch``: the ranks started under torchrun or as local processes (loopback, or emulated nodes:
  ``netemu``), ``Network`` (``network``) saying how the links were realized;
- ``smoke``: the 1-rank NCCL check on one GPU;
- ``predict``: the step model's seconds on emulated nodes, its links as the run realised them;
- ``results``: measured bytes against the plan's, the summary, ``collectives.parquet`` and ``a2a.json``
  (the typed ``placement.a2a_manifest.A2AManifest``, written through its ``to_json``);
- ``run``: the library call, ``replay(plan)`` -> ``ReplayRun`` (check, summary, write).

    plan = build_plan(load_trace_data(trace, test_fraction=0.2, seed=0), cfg=cfg, backend="gloo")
    run = replay(plan, emulate=False)
    run.write("a2a-out"); print(run.summary()); run.check()

Deployments with ``TPd > 1`` are replayed at EP-rank granularity, as the simulator counts them: one
process per EP rank (its ``d`` tensor-parallel GPUs are one process).

Shape legend (docs/architecture.md): B batches, L MoE layers, W EP ranks (GPUs), V strategies,
G node groups (= nodes).

Out of scope: the tensor-parallel traffic inside an EP rank (``TPd``); NVLink-speed intra-node links
(local traffic runs at loopback speed); the expert computation itself.
"""

from __future__ import annotations

from moetrace.placement.replay.backend import Backend, choose_backend
from moetrace.placement.replay.capacity import check_local_capacity, local_capacity_problem, machine_capacity
from moetrace.placement.replay.launch import A2ARunError, launch_local, run_a2a
from moetrace.placement.replay.network import Network
from moetrace.placement.replay.plan import (
    DTYPE_BYTES,
    A2APlan,
    build_plan,
    placed_from_file,
    placed_from_files,
    plan_bytes_per_rank,
)
from moetrace.placement.replay.predict import (
    ReplayCost,
    predicted_seconds_VBL,
    replay_cost,
    replay_kernel,
    replay_traffic,
)
from moetrace.placement.replay.rank import PROBE_INTRA_BYTES, PROBE_REPEATS, RankRecord, run_rank
from moetrace.placement.replay.results import (
    a2a_manifest,
    first_mismatch,
    format_summary,
    raise_on_mismatch,
    result_table,
    summary_rows,
    write_a2a_results,
)
from moetrace.placement.replay.run import ReplayRun, replay
from moetrace.placement.replay.sends import A2AMismatchError
from moetrace.placement.replay.smoke import SmokeRow, format_smoke, run_smoke

__all__ = [
    "DTYPE_BYTES",
    "PROBE_INTRA_BYTES",
    "PROBE_REPEATS",
    "A2AMismatchError",
    "A2APlan",
    "A2ARunError",
    "Backend",
    "Network",
    "RankRecord",
    "ReplayCost",
    "ReplayRun",
    "SmokeRow",
    "a2a_manifest",
    "build_plan",
    "check_local_capacity",
    "choose_backend",
    "first_mismatch",
    "format_smoke",
    "format_summary",
    "launch_local",
    "local_capacity_problem",
    "machine_capacity",
    "placed_from_file",
    "placed_from_files",
    "plan_bytes_per_rank",
    "predicted_seconds_VBL",
    "raise_on_mismatch",
    "replay",
    "replay_cost",
    "replay_kernel",
    "replay_traffic",
    "result_table",
    "run_a2a",
    "run_rank",
    "run_smoke",
    "summary_rows",
    "write_a2a_results",
]
