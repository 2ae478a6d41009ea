"""How ``launch_local`` starts ranks: forked from a fork server that has imported torch once, each rank
with the environment of the call (not the server's, from when it started). Kept in a module of few
imports: every rank process imports it to find ``_probe``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from moetrace.placement import replay as ar
from moetrace.placement.replay import launch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


def _probe(rank: int, world_size: int, names: tuple[str, ...]) -> dict | None:
    """What each rank sees: the variables ``names``, its parent, what its parent has loaded."""
    parent = os.getppid()
    maps = Path(f"/proc/{parent}/maps").read_text()
    seen = {
        "env": {n: os.environ.get(n) for n in names},
        "parent": parent,
        "parent_has_torch": "libtorch" in maps,
        "torch_loaded": "torch" in sys.modules,
        "rank": os.environ["RANK"],
    }
    return {"ranks": world_size, **seen} if rank == 0 else None


def test_ranks_fork_from_a_server_holding_torch_and_see_the_callers_environment(monkeypatch):
    """The ranks' parent is the fork server (not this process), it has torch loaded and so have the ranks
    before they import anything; a variable set after the server started reaches them, one removed
    since does not, and the rendezvous variables are each rank's own."""
    assert launch.rank_start_method() == "forkserver"  # starts the server (once per process)
    monkeypatch.setenv("MOETRACE_TEST_SET_LATER", "yes")
    monkeypatch.delenv("HOME", raising=False)  # set when the server started (every test runner sets it)
    seen = ar.launch_local(2, _probe, ("MOETRACE_TEST_SET_LATER", "HOME"))
    assert seen["ranks"] == 2 and seen["rank"] == "0"
    assert seen["env"] == {"MOETRACE_TEST_SET_LATER": "yes", "HOME": None}
    assert seen["parent"] != os.getpid() and seen["parent_has_torch"] and seen["torch_loaded"]


def test_spawned_ranks_see_the_callers_environment_too(monkeypatch):
    """``start_method="spawn"`` (NCCL's): a fresh interpreter per rank, this process its parent."""
    monkeypatch.setenv("MOETRACE_TEST_SET_LATER", "spawned")
    seen = ar.launch_local(2, _probe, ("MOETRACE_TEST_SET_LATER",), start_method="spawn")
    assert seen["env"] == {"MOETRACE_TEST_SET_LATER": "spawned"} and seen["parent"] == os.getpid()
