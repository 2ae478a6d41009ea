"""The Ray Serve plug-in on a real local Ray Serve (CPU): four stand-in replicas, one per DP rank of a
placement made by `moetrace place`, each reporting its rank through ``record_replica_metadata``;
requests carry their prompt's routed experts, and each must land on the rank the library router
picks for the same arrivals.

Ray runs in a child process (``ray.init`` of a local instance under a temporary directory; it stops
its own processes at ``ray.shutdown``), so nothing of Ray stays in the test process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.serving import ExpertRouter
from moetrace.serving.replay import held_out_requests

pytestmark = [
    pytest.mark.slow,  # a Ray instance and four replicas: ~30 s on two cores
    # looked up, not imported: importing Ray Serve costs every fast-tier collection ~2 s
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray Serve is not installed (the test extra)"),
]

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

CHILD = r"""
import json, sys, time
import numpy as np
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

placement, requests_file, out_file, tmp = sys.argv[1:5]
reqs = json.load(open(requests_file))
ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
try:
    @serve.deployment(
        num_replicas=4,
        ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(
            request_router_class="moetrace.serving.ray_serve.ExpertRequestRouter",
            request_router_kwargs={"placement": placement, "fallback": "least_loaded"},
        ),
    )
    class StandInRank:
        def __init__(self):
            self.rank = serve.get_replica_context().rank.rank

        def record_replica_metadata(self):
            return {"dp_rank": self.rank}

        async def __call__(self, request: dict):
            return self.rank

    handle = serve.run(StandInRank.bind(), name="moe", route_prefix=None)
    served = []
    for ids in reqs:
        served.append(handle.remote({"routed_experts": ids, "prompt": "..."}).result(timeout_s=60))
        time.sleep(0.05)  # the completion callback releases the request before the next arrives
    json.dump(served, open(out_file, "w"))
finally:
    serve.shutdown()
    ray.shutdown()
"""


@pytest.fixture(scope="module")
def placement(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("serving_ray")
    trace, p = d / "syn", d / "joint.json"
    r = runner.invoke(
        app,
        ["synth", "--model", "olmoe-1b-7b-tiny", "--datasets", "gsm8k,mbpp,xsum", "--requests", "60", "-o", str(trace)],
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        app,
        [
            "place",
            str(trace),
            "--config",
            "DP4TP1EP4",
            "--gpus-per-node",
            "1",
            "--strategy",
            "joint",
            "-q",
            "-o",
            str(p),
        ],
    )
    assert r.exit_code == 0, r.output
    return trace, p


def test_ray_serve_routes_each_request_to_the_library_routers_rank(placement, tmp_path):
    trace, p = placement
    router = ExpertRouter.from_placement(p)
    assert router.kind == "price" and router.num_ranks == 4
    ids = held_out_requests(router, trace).prefill_ids[:10]
    requests = [x.tolist() for x in ids] + [None]  # the last one without routing: the fallback serves it
    # what the library decides for the same arrivals, each finished before the next
    expected = []
    for x in [*ids, None]:
        d = router.route(x)
        expected.append(d.rank)
        router.release(d.rank)
    (tmp_path / "req.json").write_text(json.dumps(requests))
    ray_tmp = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray 2.60 writes an auth token to ~/.ray/auth_token; a token left there makes the next local
        # cluster (tests/test_ray_cluster.py) refuse its drivers. Ray's home is the temporary folder.
        "HOME": ray_tmp,
    }
    try:
        res = subprocess.run(
            [sys.executable, "-c", CHILD, str(p), str(tmp_path / "req.json"), str(tmp_path / "out.json"), ray_tmp],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=ROOT,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    served = json.loads((tmp_path / "out.json").read_text())
    assert served[:-1] == expected[:-1]
    assert len(set(np.asarray(expected[:-1]).tolist())) > 1  # the placement spreads them: not a constant
    assert served[-1] in range(4)
