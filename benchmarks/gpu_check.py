"""Every GPU check of the vLLM backend and the NCCL replay, in one prepared run with a deadline.

What it runs (the steps that use the GPU one at a time, so no engine's memory profiling sees
another's allocations; the CPU steps beside them):

- CPU, in the background: ``make-checkpoint`` of qwen3-30b-a3b, deepseek-v3 and mixtral-8x7b (the
  fallback layout) and a small ``synth`` trace for the replay;
- GPU, in turn: ``tests/test_vllm_engine.py``; ``a2a --smoke`` on ``cuda:0``; ``collect --backend
  vllm`` on two checkpoints, each trace then ``validate``d; HF vs vLLM routing agreement
  (``gpu_agreement.py``); the capture's cost (``gpu_capture_overhead.py``, eager, then CUDA graphs).

A step that would start after ``--deadline`` seconds is skipped and reported as such; each step has
its own timeout. ``OUT/gpu_check.json`` holds every step's command, exit code, seconds and the tail
of its log; ``OUT/logs.txt`` the logs; the agreement and overhead reports sit beside them.

Usage on the GPU machine (vLLM importable, the checkout as working directory)::

    PYTHONPATH=$PWD python benchmarks/gpu_check.py --out $OUT --work /tmp/gpu --deadline 430
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Runner:
    def __init__(self, out: Path, work: Path, deadline: float) -> None:
        self.out, self.work, self.deadline = out, work, deadline
        self.t0 = time.monotonic()
        self.steps: list[dict] = []
        self.lock = threading.Lock()
        (work / "logs").mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def run(self, name: str, cmd: list[str], *, timeout: float) -> bool:
        """Run ``cmd`` (logged to work/logs/NAME.log); False when it failed, timed out or was skipped."""
        left = self.deadline - self.elapsed()
        rec: dict = {"step": name, "cmd": " ".join(cmd), "start_s": round(self.elapsed(), 1)}
        if left < 20:
            rec.update(rc=None, skipped=f"deadline: {left:.0f} s left")
            self._record(rec)
            return False
        log = self.work / "logs" / f"{name}.log"
        t = time.monotonic()
        with open(log, "w") as f:
            rc: int | str
            try:
                rc = subprocess.run(
                    cmd, stdout=f, stderr=subprocess.STDOUT, timeout=min(timeout, left), cwd=ROOT
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        rec.update(rc=rc, seconds=round(time.monotonic() - t, 1), tail=log.read_text(errors="replace")[-2500:])
        self._record(rec)
        print(f"[{self.elapsed():6.1f}s] {name}: rc={rc} ({rec['seconds']} s)", flush=True)
        return rc == 0

    def _record(self, rec: dict) -> None:
        with self.lock:
            self.steps.append(rec)
            (self.out / "gpu_check.json").write_text(json.dumps({"steps": self.steps}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--deadline", type=float, default=430.0, help="seconds after which no step starts")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    r = Runner(a.out, a.work, a.deadline)
    py = sys.executable
    mt = [py, "-m", "moetrace"]
    ck, tr = a.work / "ck", a.work / "tr"

    cpu_done: dict[str, threading.Event] = {k: threading.Event() for k in ("qwen", "dsv3", "mixtral", "synth")}
    cpu_ok: dict[str, bool] = {}

    def cpu_lane() -> None:
        jobs = [
            (
                "synth",
                [*mt, "synth", "--model", "deepseek-v3", "-n", "200", "--seed", "0", "-q", "-o", str(tr / "synth")],
            ),
            ("qwen", [*mt, "make-checkpoint", "qwen3-30b-a3b", "-o", str(ck / "qwen")]),
            ("dsv3", [*mt, "make-checkpoint", "deepseek-v3", "-o", str(ck / "dsv3")]),
            ("mixtral", [*mt, "make-checkpoint", "mixtral-8x7b", "-o", str(ck / "mixtral")]),
        ]
        for key, cmd in jobs:
            cpu_ok[key] = r.run(f"prep-{key}", cmd, timeout=240)
            cpu_done[key].set()

    threading.Thread(target=cpu_lane, daemon=True).start()

    def wait(key: str) -> bool:
        cpu_done[key].wait(timeout=max(a.deadline - r.elapsed(), 1))
        return cpu_ok.get(key, False)

    # 1. the engine test, as CI would run it on a GPU machine (nothing set by hand for moetrace)
    r.run(
        "test-vllm-engine",
        [py, "-m", "pytest", "tests/test_vllm_engine.py", "-q", "-rs", "-p", "no:cacheprovider"],
        timeout=240,
    )
    # 4. the NCCL path one GPU allows
    if wait("synth"):
        r.run(
            "a2a-smoke",
            [
                *mt,
                "a2a",
                str(tr / "synth"),
                "--config",
                "DP2TP2EP4",
                "--gpus-per-node",
                "2",
                "--strategies",
                "linear,eplb,data",
                "--hidden-size",
                "7168",
                "--smoke",
                "-q",
            ],
            timeout=120,
        )
    # 1. collect from two make-checkpoint layouts (deepseek-v3's MLA with its real head dims; mixtral if it fails)
    collected: list[str] = []
    for key in ("qwen", "dsv3", "mixtral"):
        if len(collected) == 2 or not wait(key):
            continue
        out = tr / f"{key}-vllm"
        ok = r.run(
            f"collect-{key}",
            [
                *mt,
                "collect",
                "--backend",
                "vllm",
                "--model",
                str(ck / key),
                "--dataset",
                "bundled",
                "--per-dataset",
                "6",
                "--max-new-tokens",
                "32",
                "--no-chat-template",
                "--enforce-eager",
                "--gpu-memory-utilization",
                "0.3",
                "--max-model-len",
                "2048",
                "-q",
                "-o",
                str(out),
            ],
            timeout=180,
        )
        if ok and r.run(f"validate-{key}", [*mt, "validate", str(out)], timeout=60):
            r.run(f"info-{key}", [*mt, "info", str(out)], timeout=60)
            collected.append(key)
    # 2. HF vs vLLM agreement, 3. capture overhead: (step, script, checkpoint, extra arguments)
    second = "dsv3" if "dsv3" in collected else "mixtral" if "mixtral" in collected else None
    plan = [
        ("agreement-qwen", "gpu_agreement.py", "qwen", []),
        ("overhead-eager", "gpu_capture_overhead.py", "qwen", ["--mode", "eager"]),
        *([(f"agreement-{second}", "gpu_agreement.py", second, [])] if second else []),
        ("overhead-graphs", "gpu_capture_overhead.py", "qwen", ["--mode", "graphs"]),
    ]
    for name, script, key, extra in plan:
        if cpu_ok.get(key):
            cmd = [py, str(ROOT / "benchmarks" / script), str(ck / key), *extra, "--out", str(a.out / f"{name}.json")]
            r.run(name, cmd, timeout=180)

    with open(a.out / "logs.txt", "w") as f:
        for log in sorted((a.work / "logs").glob("*.log")):
            text = log.read_text(errors="replace")
            f.write(f"===== {log.name} ({len(text)} chars; last 20000)\n{text[-20000:]}\n")
    print(f"done in {r.elapsed():.0f} s")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
