"""``place`` starts from what ``compare`` read and placed, inside ``sharing_placements`` (what the demo opens).

A strategy compare placed is written as compare placed it; another is placed from the counts (and
request clusters) compare read. Either way the file is byte for byte the one ``place`` writes on its
own; a different trace or setting, or no sharing block (``moetrace place`` on its own), and place
reads the trace itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from browser.fixtures import make_trace
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.cli.place import sharing_placements

DEPLOY = ["--config", "DP4TP1EP4", "--gpus-per-node", "2"]
PLACED = "not computed again"  # compare's placement, written as it is
READ = "read above, not read again"  # compare's counts (and clusters), placed from


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return make_trace(tmp_path_factory.mktemp("reuse") / "trace", datasets=("chat", "code", "math"), num_requests=60)


def _run(*args: str) -> str:
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def _place(trace: Path, out: Path, *extra: str) -> str:
    return _run("place", str(trace), *DEPLOY, *extra, "-o", str(out))


#: (strategy, what place reuses when compare ran linear,eplb,joint): placed, or counts (and clusters)
CASES = [("ours", READ), ("data", READ), ("joint", PLACED), ("eplb", PLACED), ("eplb_global", READ)]


def test_place_after_compare_writes_what_place_alone_writes(trace, tmp_path):
    alone = {s: _place(trace, tmp_path / f"alone-{s}.json", "--strategy", s) for s, _ in CASES}
    assert not any(PLACED in o or READ in o for o in alone.values())
    with sharing_placements():
        _run("compare", str(trace), *DEPLOY, "--strategies", "linear,eplb,joint", "-q", "-o", str(tmp_path / "c"))
        shared = {s: _place(trace, tmp_path / f"shared-{s}.json", "--strategy", s) for s, _ in CASES}
        f32 = _place(trace, tmp_path / "shared-f32.json", "--strategy", "eplb", "--eplb-sum", "float32")
        seed1 = _place(trace, tmp_path / "seed1.json", "--seed", "1")  # another setting: read again
    for s, reused in CASES:
        assert reused in shared[s] and (PLACED not in shared[s] if reused == READ else True), (s, shared[s])
        assert (tmp_path / f"shared-{s}.json").read_bytes() == (tmp_path / f"alone-{s}.json").read_bytes(), s
        # the summary line is the same either way (the reuse adds one line under it)
        assert alone[s].splitlines()[0].replace("alone", "X") == shared[s].splitlines()[0].replace("shared", "X")
    assert READ in f32 and PLACED not in f32  # compare sums EPLB in float64: placed again, in float32
    _place(trace, tmp_path / "alone-f32.json", "--strategy", "eplb", "--eplb-sum", "float32")
    assert (tmp_path / "shared-f32.json").read_bytes() == (tmp_path / "alone-f32.json").read_bytes()
    assert PLACED not in seed1 and READ not in seed1


def test_without_a_sharing_block_place_reads_the_trace(trace, tmp_path):
    _run("compare", str(trace), *DEPLOY, "--strategies", "linear,eplb", "-q", "-o", str(tmp_path / "c"))
    out = _place(trace, tmp_path / "p.json", "--strategy", "eplb")
    assert PLACED not in out and READ not in out


def test_a_changed_trace_is_read_again(tmp_path):
    t = make_trace(tmp_path / "t", num_requests=40)
    with sharing_placements():
        _run("compare", str(t), *DEPLOY, "--strategies", "linear,eplb", "-q", "-o", str(tmp_path / "c"))
        make_trace(t, num_requests=40, seed=1)  # rewritten in place: what compare kept is stale
        out = _place(t, tmp_path / "p.json", "--strategy", "eplb")
    assert PLACED not in out and READ not in out
