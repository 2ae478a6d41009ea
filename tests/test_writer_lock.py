"""One writer per trace: a second writer is refused naming the holder; the first one's data survives.

The holder is a real second process (the lock is an OS lock, so in-process tests would prove nothing
about crashes): it writes one committed request, says so on stdout, and waits for a line on stdin.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest
from factories import SMALL, finish_lock_holder, start_lock_holder
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import TraceBusyError
from moetrace.tracer.trace import TraceWriter, open_trace
from moetrace.tracer.trace.layout import shard_manifest_name, shard_prefix
from moetrace.tracer.trace.validate import find_problems


def _writer(path, on_existing, **kw) -> TraceWriter:
    return TraceWriter(path, model=SMALL, backend={"name": "synthetic"}, collection={}, on_existing=on_existing, **kw)


@pytest.mark.parametrize("on_existing", ["overwrite", "resume", "refuse"])
def test_second_writer_is_refused_and_the_first_keeps_its_data(tmp_path, on_existing):
    path = tmp_path / "t"
    holder = start_lock_holder(path)
    try:
        with pytest.raises(TraceBusyError, match=rf"being written by pid {holder.pid} on .*started"):
            _writer(path, on_existing)
    finally:
        finish_lock_holder(holder)
    assert find_problems(path) == []
    t = open_trace(path)
    assert t.requests().collect()["request_id"].to_list() == [100]


def test_cli_overwrite_of_a_running_collection_is_refused_cleanly(tmp_path):
    path = tmp_path / "t"
    holder = start_lock_holder(path)
    try:
        r = CliRunner().invoke(
            app, ["synth", "--model", "deepseek-v3-tiny", "--requests", "4", "-o", str(path), "--overwrite"]
        )
    finally:
        finish_lock_holder(holder)
    assert r.exit_code == 2, r.output
    assert f"pid {holder.pid}" in r.output and "Traceback" not in r.output
    assert open_trace(path).requests().collect()["request_id"].to_list() == [100]


def test_a_killed_writer_releases_the_lock_and_its_trace_resumes(tmp_path):
    path = tmp_path / "t"
    holder = start_lock_holder(path)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    with _writer(path, "resume") as w:  # not refused: the kernel dropped the dead holder's lock
        assert w.completed_request_ids == {100}
        w.add_request(
            request_id=1, dataset="a", prompt_tokens=2, topk_ids_TX=np.zeros((3, SMALL.ids_per_token), np.int16)
        )
    assert sorted(open_trace(path).requests().collect()["request_id"].to_list()) == [1, 100]
    assert find_problems(path) == []


def test_shards_share_a_trace_but_each_shard_has_one_writer(tmp_path):
    path = tmp_path / "t"
    shard0 = start_lock_holder(path, shard=0)
    try:
        shard1 = _writer(path, "resume", part_prefix=shard_prefix(1), manifest_name=shard_manifest_name(1))
        shard1.close()  # a second shard runs beside the first
        with pytest.raises(TraceBusyError, match="this shard is already being collected by pid"):
            _writer(path, "resume", part_prefix=shard_prefix(0), manifest_name=shard_manifest_name(0))
        with pytest.raises(TraceBusyError, match="running shards"):
            _writer(path, "overwrite")  # a whole-trace overwrite would delete the shards' parts
    finally:
        finish_lock_holder(shard0)
    assert any(f.name.startswith(shard_prefix(0)) for f in (path / "requests").iterdir())
