"""Ray-sharded collection on a real two-node Ray cluster (CPU, HF backend, tiny model).

The cluster is two ``ray start`` processes on this machine: a head node with the custom resource
``node_a`` and a worker node with ``node_b``, 1 CPU each (a shard task takes 1 CPU, so two shards
run one per node), a small object store, and Ray's files under the test's temporary directory.
The driver is ``moetrace collect --ray-shards 2`` in a child process, connected through
``RAY_ADDRESS``. Which node ran a shard is read from its worker process: Ray titles it
``ray::moetrace-shard-S-of-N`` and it is a child of its node's raylet, whose command line lists the
node's resources.

The cluster is stopped in a finalizer, also when a test fails: every process whose command line
names this cluster's temporary directory (GCS, raylets, monitors), and their children (workers,
agents), by id. Not ``ray stop``: it stops every Ray process of the user on the machine, another
session's cluster included.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from moetrace.tracer.sharding import shard_task_name
from moetrace.tracer.trace.layout import REQUESTS_DIR
from moetrace.tracer.trace.reader import open_trace
from moetrace.tracer.trace.validate import find_problems

ROOT = Path(__file__).resolve().parents[1]
#: one run's prompts: 16 requests, 8 per shard, one commit per request (batch 1)
ARGS = [
    "--model",
    "olmoe-1b-7b-tiny",
    "--backend",
    "hf",
    "--dataset",
    "math-word,chat",
    "--per-dataset",
    "8",
    "--batch-size",
    "1",
    "--max-new-tokens",
    "8",
]
NUM_REQUESTS = 16
NODES = ("node_a", "node_b")


# --------------------------------------------------------------------------------- the cluster
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:  # the process ended while we looked
        return []


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited process its parent has not reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _cluster_processes(temp_dir: str) -> list[int]:
    """Every process of the cluster whose files are under ``temp_dir``, and their descendants."""
    pids = _pids()
    me, mine = os.getpid(), set()  # this process and its ancestors are never the cluster's
    while me > 1 and me not in mine:
        mine.add(me)
        me = _parent(me)
    ours = {p for p in pids if p not in mine and _alive(p) and any(temp_dir in arg for arg in _cmdline(p))}
    children: dict[int, list[int]] = {}
    for p in pids:
        children.setdefault(_parent(p), []).append(p)
    todo, found = list(ours), set(ours)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return sorted(found)


def _stop_cluster(temp_dir: str) -> None:
    """SIGTERM the cluster's processes (found before any is signalled, so workers are still the
    raylets' children), SIGKILL what is left after 10 s, and wait until every one has exited."""
    for _ in range(3):  # again, for a worker a raylet started while it was being stopped
        pids = _cluster_processes(temp_dir)
        if not pids:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for p in pids:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + wait
            while time.time() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.1)
            pids = [p for p in pids if _alive(p)]
            if not pids:
                break


def _shard_workers() -> dict[int, tuple[int, str]]:
    """Running shard tasks of a 2-shard run: shard -> (worker pid, the node resource of its raylet)."""
    out: dict[int, tuple[int, str]] = {}
    for p in _pids():
        cmd = _cmdline(p)
        for s in range(2):
            if cmd and cmd[0].startswith(f"ray::{shard_task_name(s, 2)}"):
                raylet = " ".join(_cmdline(_parent(p)))
                node = next((n for n in NODES if f"{n},1" in raylet), "?")
                out[s] = (p, node)
    return out


@pytest.fixture(scope="module")
def ray_env(tmp_path_factory) -> Iterator[dict[str, str]]:
    """A running two-node cluster; yields the environment a driver connects to it with."""
    temp_dir = str(tmp_path_factory.mktemp("ray"))
    if len(temp_dir) > 60:  # Ray's socket paths below it must stay under AF_UNIX's 107 bytes
        temp_dir = tempfile.mkdtemp(prefix="mt-ray-")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "RAY_USAGE_STATS_ENABLED": "0",
        "OMP_NUM_THREADS": "1",
        "HOME": temp_dir,  # Ray's auth token (~/.ray/auth_token) of this cluster, not one a user left behind
    }
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = [
        "--num-cpus=1",
        "--num-gpus=0",
        "--object-store-memory=100000000",
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts", "start"]
    try:
        for extra in (
            ["--head", f"--port={port}", "--include-dashboard=false", '--resources={"node_a": 1}'],
            [f"--address={address}", '--resources={"node_b": 1}'],
        ):
            started = subprocess.run(
                [*ray_cli, *extra, *common], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
            )
            assert started.returncode == 0, started.stdout + started.stderr
        yield {**env, "RAY_ADDRESS": address}
    finally:
        _stop_cluster(temp_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same run collected here, unsharded, without Ray."""
    out = tmp_path_factory.mktemp("reference") / "t"
    done = subprocess.run(
        [sys.executable, "-m", "moetrace", "collect", *ARGS, "-q", "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _rows(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(request id, position, ids sorted within each (token, layer)) of every row, by request and position."""
    arr = open_trace(path).token_arrays()
    order = np.lexsort((arr.position_T, arr.request_id_T))
    return arr.request_id_T[order], arr.position_T[order], np.sort(arr.topk_ids_TLK[order], -1)


def _assert_same_rows(path: Path, reference: Path) -> None:
    assert find_problems(path) == []
    for got, want in zip(_rows(path), _rows(reference)):
        np.testing.assert_array_equal(got, want)


def _start_driver(env: dict[str, str], out: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "moetrace", "collect", *ARGS, "--ray-shards", "2", "-q", "-o", str(out)]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _watch(
    driver: subprocess.Popen[str], *, until: Callable[[dict[int, tuple[int, str]]], bool], timeout: float = 300.0
) -> tuple[dict[int, tuple[int, str]], set[str]]:
    """Poll the shard workers every 20 ms until ``until(running)`` holds or the driver ends.

    Returns the last (pid, node) seen per shard and every node a shard worker was seen on."""
    last: dict[int, tuple[int, str]] = {}
    nodes: set[str] = set()
    deadline = time.time() + timeout
    while time.time() < deadline and driver.poll() is None:
        running = _shard_workers()
        last.update(running)
        nodes.update(node for _, node in running.values() if node != "?")  # "?": the worker exited as we looked
        if until(running):
            break
        time.sleep(0.02)
    return last, nodes


def _committed_requests(out: Path, shard: int) -> int:
    """Requests in the committed parts of one shard."""
    return sum(pq.read_metadata(f).num_rows for f in (out / REQUESTS_DIR).glob(f"shard{shard:03d}-*.parquet"))


# ------------------------------------------------------------------------------------- tests
def test_shards_run_as_ray_tasks_on_both_nodes_and_merge_to_the_unsharded_rows(ray_env, reference, tmp_path):
    out = tmp_path / "sharded"
    driver = _start_driver(ray_env, out)
    _, nodes = _watch(driver, until=lambda running: False)  # to the driver's end
    output, _ = driver.communicate(timeout=300)
    assert driver.returncode == 0, output
    assert nodes == set(NODES), f"shard workers seen on {nodes}"
    assert "in 2 shards (merged)" in output and f"{NUM_REQUESTS} new requests" in output, output
    manifest = open_trace(out).manifest
    assert manifest["complete"] and [s["shard"] for s in manifest["shards"]] == [0, 1]
    _assert_same_rows(out, reference)


def test_a_killed_shard_worker_is_retried_by_ray_and_resumes_from_its_committed_parts(ray_env, reference, tmp_path):
    out = tmp_path / "killed"
    driver = _start_driver(ray_env, out)
    first, _ = _watch(driver, until=lambda running: 0 in running and _committed_requests(out, 0) >= 1)
    assert 0 in first and driver.poll() is None, "shard 0 should be running with a committed part"
    os.kill(first[0][0], signal.SIGKILL)
    committed = _committed_requests(out, 0)
    assert 1 <= committed < NUM_REQUESTS // 2, "the kill should land mid-shard"

    again, _ = _watch(driver, until=lambda running: 0 in running and running[0][0] != first[0][0])
    assert again[0][0] != first[0][0], "Ray should run shard 0 again, in a new worker process"
    output, _ = driver.communicate(timeout=300)
    assert driver.returncode == 0, output
    # the retry resumed: it collected exactly the requests shard 0 had not committed
    assert f" {NUM_REQUESTS - committed} new requests" in output, (committed, output)
    _assert_same_rows(out, reference)
