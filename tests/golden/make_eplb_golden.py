"""Regenerate ``eplb_deepseek.json``: DeepSeek's own ``eplb.py`` run on a fixed set of cases.

The figures in the JSON file are DeepSeek's outputs; their code is not part of this repository.
Fetch deepseek-ai/EPLB yourself and point this script at its ``eplb.py`` (it needs torch):

    git clone https://github.com/deepseek-ai/EPLB /tmp/EPLB
    .venv/bin/python tests/golden/make_eplb_golden.py --eplb-path /tmp/EPLB/eplb.py \\
        --eplb-commit "$(git -C /tmp/EPLB rev-parse HEAD)"

Cases: the README's worked example, then seeded random ones over layers 1-4, experts 16-256,
0 to 2x(GPUs) redundant slots, 1-8 nodes, 1-64 GPUs, both policies (hierarchical when the
groups divide over the nodes, global otherwise), and five kinds of load: ``ties`` (integers 0-3),
``counts`` (integer token counts, heavy-tailed), ``gamma`` (continuous float32), ``zeros`` and
``spread`` (integers times 10^-30..10^30). Loads are float32 values written in their shortest
round-tripping decimal form; ``log2phy`` is stored without its -1 padding (expert ``e`` of layer
``l`` lists its ``logcnt[l][e]`` slots in replica-rank order).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

OUT = Path(__file__).with_name("eplb_deepseek.json")
NUM_RANDOM = 160  # seeded random cases after the README's example
KINDS = ("ties", "counts", "gamma", "gamma", "zeros", "spread")  # gamma twice: continuous loads are the common case
README_LOAD = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]


def _load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("deepseek_eplb", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """float32 [L, E] load of one kind (see the module docstring)."""
    if kind == "ties":
        w = rng.integers(0, 4, size=shape).astype(np.float64)
    elif kind == "counts":
        w = np.floor(rng.pareto(1.2, size=shape) * 200)
    elif kind == "gamma":
        w = rng.gamma(0.5, size=shape) * 1000
    elif kind == "zeros":
        w = np.zeros(shape)
    else:
        w = rng.integers(0, 3, size=shape) * 10.0 ** rng.integers(-30, 30, size=shape)
    return w.astype(np.float32)


def _random_case(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    L = int(rng.integers(1, 5))
    E = int(rng.choice([16, 16, 24, 32, 32, 48, 64, 64, 96, 128, 160, 256]))
    nodes = int(rng.choice([1, 2, 4, 8]))
    gpus = nodes * int(rng.choice([1, 2, 4, 8]))
    redundant = int(rng.integers(0, 2 * gpus + 1))
    P = -(-(E + redundant) // gpus) * gpus
    # hierarchical: groups a multiple of nodes dividing E; global: groups not a multiple of nodes
    hier = [g for g in range(nodes, E + 1, nodes) if E % g == 0 and g <= 32]
    glob = [g for g in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if E % g == 0 and g % nodes]
    if glob and rng.random() < 0.4:
        groups = int(rng.choice(glob))
    else:
        groups = int(rng.choice(hier))
    kind = str(rng.choice(KINDS))
    return {
        "name": f"seed{seed}",
        "seed": seed,
        "kind": kind,
        "num_replicas": P,
        "num_groups": groups,
        "num_nodes": nodes,
        "num_gpus": gpus,
        "load": _load(kind, (L, E), rng),
    }


def _cases() -> list[dict[str, Any]]:
    readme = {
        "name": "readme",
        "seed": None,
        "kind": "readme",
        "num_replicas": 16,
        "num_groups": 4,
        "num_nodes": 2,
        "num_gpus": 8,
        "load": np.asarray(README_LOAD, dtype=np.float32),
    }
    return [readme] + [_random_case(seed) for seed in range(NUM_RANDOM)]


def _json_load(load_LE: np.ndarray) -> list[list[float | int]]:
    """Shortest decimals that read back as the same float32 values (ints where integral)."""
    rows: list[list[float | int]] = []
    for row in load_LE:
        out: list[float | int] = []
        for x in row:
            v: float | int = int(x) if float(x).is_integer() and abs(x) < 2**24 else float(str(x))
            if np.float32(v) != x:
                raise SystemExit(f"{x!r} does not round-trip through JSON")
            out.append(v)
        rows.append(out)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--eplb-path", type=Path, required=True, help="DeepSeek's eplb.py (from github.com/deepseek-ai/EPLB)"
    )
    ap.add_argument("--eplb-commit", default="", help="the EPLB commit it came from, recorded in the file")
    ap.add_argument("-o", "--out", type=Path, default=OUT)
    args = ap.parse_args()
    import torch

    eplb = _load_module(args.eplb_path)
    lines = []
    for c in _cases():
        load = c.pop("load")
        phy2log, log2phy, logcnt = eplb.rebalance_experts(
            torch.from_numpy(load), c["num_replicas"], c["num_groups"], c["num_nodes"], c["num_gpus"]
        )
        ragged = [
            [[int(p) for p in l2p[:n]] for l2p, n in zip(l2p_EM, cnt_E)]
            for l2p_EM, cnt_E in zip(log2phy.tolist(), logcnt.tolist())
        ]
        c.update(load=_json_load(load), phy2log=phy2log.tolist(), log2phy=ragged, logcnt=logcnt.tolist())
        lines.append(json.dumps(c, separators=(",", ":")))
    head = {
        "source": "github.com/deepseek-ai/EPLB eplb.py, rebalance_experts",
        "commit": args.eplb_commit,
        "torch": torch.__version__,
        "generator": "tests/golden/make_eplb_golden.py",
        "log2phy": "ragged: each expert's slots in replica-rank order, without -1 padding",
    }
    text = '{"about":' + json.dumps(head, separators=(",", ":")) + ',\n"cases":[\n' + ",\n".join(lines) + "\n]}\n"
    args.out.write_text(text)
    print(f"{len(lines)} cases -> {args.out} ({len(text) / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
