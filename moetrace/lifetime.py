"""Child processes and system resources that die with the process that made them, however it dies.

Two mechanisms, both Linux (where moetrace starts processes and namespaces):

- :func:`die_with_parent`, called first thing in a child process moetrace starts (``a2a``'s ranks,
  ``collect``'s data-parallel vLLM workers, ``synth``'s workers): the kernel sends the child SIGKILL
  when its parent dies (``prctl(PR_SET_PDEATHSIG)``), even when the parent was killed by SIGKILL.
- :func:`guard`, a context manager around work that starts processes moetrace does not start itself
  (vLLM's engine and worker processes) or makes resources the kernel does not free (network
  namespaces, temporary directories): it starts a small supervisor process in its own session that
  waits on a pipe only this process holds. When the pipe closes without the word the block's end
  writes (this process died, by SIGKILL included), the supervisor kills every process it saw
  descending from this one that the block started (it records them from ``/proc`` once a second;
  a pid is killed only if its start time still matches), then runs the cleanup commands
  (``ip netns del ...``) and removes the paths. When the block ends (normally or by an exception)
  the block's own cleanup has run; the supervisor runs the commands and removals again (they find
  nothing) and kills nothing.

Elsewhere than Linux ``die_with_parent`` does nothing and ``guard`` runs no supervisor (moetrace
emulates nodes and spawns engines only on Linux); both say so in :data:`SUPPORTED`.

Out of scope: what the children do; cleaning up after a run killed before this module ran
(``netemu.remove_stale`` is that fallback).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

#: whether the kernel gives us PR_SET_PDEATHSIG and /proc (Linux)
SUPPORTED = sys.platform.startswith("linux")
_PR_SET_PDEATHSIG = 1
#: seconds between two looks at /proc for descendants
_POLL_S = 1.0
#: what the block's end writes to the supervisor (EOF without it: this process died)
_DONE = b"done"


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child process: have the kernel send ``sig`` to it when its parent dies. If the parent is
    already gone (it died before this ran), exit at once. Does nothing where not :data:`SUPPORTED`."""
    if not SUPPORTED:
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent == 1 or not _alive(parent):  # reparented already: the parent died before the prctl
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def guard(
    *, commands: Sequence[Sequence[str]] = (), paths: Sequence[str | os.PathLike] = (), kill_descendants: bool = True
) -> Iterator[None]:
    """Run the block with a supervisor that, when this process dies (SIGKILL too), kills the processes
    the block started below this one (``kill_descendants``); and, when the block ends or this process
    dies, runs ``commands`` (argv lists; failures ignored: what they remove may be gone already) and
    removes ``paths`` (directories).

    Where not :data:`SUPPORTED` the block runs without a supervisor.
    """
    if not SUPPORTED:
        yield
        return
    read_fd, write_fd = os.pipe()  # both close-on-exec: no other child inherits the write end
    me = os.getpid()
    spec = json.dumps(
        {
            "parent": me,
            "before": _descendants(me, _proc_table()) if kill_descendants else {},
            "commands": [list(c) for c in commands],
            "paths": [str(p) for p in paths],
            "kill_descendants": kill_descendants,
        }
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetrace.lifetime", spec],
        stdin=read_fd,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C or a kill of this process group leaves it to clean up
        env=env,
    )
    os.close(read_fd)
    try:
        yield
    finally:
        os.write(write_fd, _DONE)  # the block ended here: nothing to kill
        os.close(write_fd)  # the supervisor sees EOF: it cleans up what is left and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)


# ---- the supervisor (runs as `python -m moetrace.lifetime SPEC`) ------------------------------------
def _proc_table() -> dict[int, tuple[int, str]]:
    """``{pid: (parent pid, start time)}`` of every process in /proc."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def _descendants(root: int, table: dict[int, tuple[int, str]]) -> dict[int, str]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out[c] = table[c][1]
            todo.append(c)
    return out


def _supervise(spec: dict) -> None:
    seen: dict[int, str] = {}  # descendant pid -> its start time
    before = {(int(p), t) for p, t in spec["before"].items()}  # descendants the block did not start
    me = os.getpid()
    said = b""
    while True:
        if spec["kill_descendants"]:
            table = _proc_table()
            seen.update(
                {p: t for p, t in _descendants(spec["parent"], table).items() if p != me and (p, t) not in before}
            )
        ready, _, _ = select.select([sys.stdin], [], [], _POLL_S)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 4096)
            if not chunk:
                break  # EOF: the block ended or the parent died
            said += chunk
    if said == _DONE:
        seen = {}  # the block ended in its own process: whatever still runs is its business
    if seen:
        table = _proc_table()
        # another guard's supervisor (a nested block) is left to clean up after its own block
        alive = [p for p, t in seen.items() if p in table and table[p][1] == t and not _is_supervisor(p)]
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while alive and time.monotonic() < deadline:  # the commands may need them gone (a namespace in use)
            alive = [p for p in alive if _alive(p) and not _zombie(p)]
            time.sleep(0.05)
    for cmd in spec["commands"]:
        with contextlib.suppress(OSError):
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    for p in spec["paths"]:
        shutil.rmtree(p, ignore_errors=True)


def _is_supervisor(pid: int) -> bool:
    try:
        return b"moetrace.lifetime" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2 :].startswith("Z")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only EOF on stdin ends the watch
    _supervise(json.loads(sys.argv[1]))
