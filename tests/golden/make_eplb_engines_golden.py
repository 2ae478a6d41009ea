"""Regenerate ``eplb_engines.json``: the EPLB of SGLang, vLLM and DeepSeek's reference on the same loads.

The figures in the JSON file are the engines' outputs; their code is not part of this repository. Take
the files from the released packages and DeepSeek's repository yourself (they need torch and numpy):

    pip download --no-deps sglang==0.5.23 vllm==0.33.0 -d /tmp/whl
    unzip -o /tmp/whl/sglang-0.5.23-*.whl 'sglang/srt/eplb/eplb_algorithms/deepseek.py' -d /tmp/sgl
    unzip -o /tmp/whl/vllm-0.33.0-*.whl 'vllm/distributed/eplb/policy/*' -d /tmp/vllm
    git clone https://github.com/deepseek-ai/EPLB /tmp/EPLB
    .venv/bin/python tests/golden/make_eplb_engines_golden.py \\
        --sglang /tmp/sgl/sglang/srt/eplb/eplb_algorithms/deepseek.py \\
        --vllm /tmp/vllm/vllm/distributed/eplb/policy/default.py \\
        --deepseek /tmp/EPLB/eplb.py --deepseek-commit "$(git -C /tmp/EPLB rev-parse HEAD)"

SGLang: ``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, enable_hierarchical)``
with ``enable_hierarchical = num_groups % num_nodes == 0`` (``compute_algorithm("auto", ...)`` in
``sglang/srt/eplb/eplb_algorithms/__init__.py``). vLLM: ``DefaultEplbPolicy.rebalance_experts(weight,
num_replicas, num_groups, num_nodes, num_ranks)`` (its policy package is loaded without its
``__init__``, which imports vLLM's config). DeepSeek: ``eplb.rebalance_experts``.

Loads: tie-free continuous ones (every row's values distinct), float32 ``gamma(20) * 1e6`` (about 2e7
tokens an expert, spread as a decode profile's), DeepSeek-V3's shapes (256 experts in 8 groups, 32
redundant slots at EP32 and 64 at EP64, hierarchical and global policies) and one of 128 experts with
no groups. EPLB computes each layer alone, so each case keeps, of 300 seeded random layers, those where
the float32 reference differs from the engines (at most ``KEEP_DIFFERENT``) and the first
``KEEP_SAME`` others: the file stays small and still holds the layers that tell the summations apart.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

OUT = Path(__file__).with_name("eplb_engines.json")
CANDIDATE_LAYERS = 300
KEEP_DIFFERENT = 6
KEEP_SAME = 4
#: (name, experts, groups, nodes, GPUs, slots)
CONFIGS = [
    ("dsv3-ep32-4nodes-hierarchical", 256, 8, 4, 32, 288),
    ("dsv3-ep64-8nodes-hierarchical", 256, 8, 8, 64, 320),
    ("dsv3-ep48-3nodes-global", 256, 8, 3, 48, 288),
    ("dsv3-ep32-1node", 256, 8, 1, 32, 288),
    ("e128-ep16-2nodes-global", 128, 1, 2, 16, 144),
]


def _load_file(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_vllm_policy(default_py: Path) -> Any:
    """vLLM's ``DefaultEplbPolicy`` from its ``default.py``, its sibling ``abstract.py`` found beside it."""
    pkg = types.ModuleType("_vllm_eplb_policy")
    pkg.__path__ = [str(default_py.parent)]
    sys.modules[pkg.__name__] = pkg
    return importlib.import_module(f"{pkg.__name__}.{default_py.stem}").DefaultEplbPolicy


def loads(rng: np.random.Generator, num_layers: int, num_experts: int) -> np.ndarray:
    """float32 [L, E] tie-free loads (see the module docstring)."""
    out = np.empty((num_layers, num_experts), dtype=np.float32)
    for layer in range(num_layers):
        while True:
            row = (rng.gamma(20.0, size=num_experts) * 1e6).astype(np.float32)
            if len(np.unique(row)) == num_experts:
                break
        out[layer] = row
    return out


def _json_row(row: np.ndarray) -> list[float]:
    vals = [float(str(x)) for x in row]  # shortest decimals that read back as the same float32
    if not np.array_equal(np.asarray(vals, dtype=np.float32), row):
        raise SystemExit("a load does not round-trip through JSON")
    return vals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang", type=Path, required=True, help="sglang/srt/eplb/eplb_algorithms/deepseek.py")
    ap.add_argument("--sglang-version", default="0.5.23")
    ap.add_argument("--vllm", type=Path, required=True, help="vllm/distributed/eplb/policy/default.py")
    ap.add_argument("--vllm-version", default="0.33.0")
    ap.add_argument("--deepseek", type=Path, required=True, help="eplb.py of github.com/deepseek-ai/EPLB")
    ap.add_argument("--deepseek-commit", default="")
    ap.add_argument("-o", "--out", type=Path, default=OUT)
    args = ap.parse_args()
    import torch

    sglang = _load_file("sglang_eplb", args.sglang)
    vllm = _load_vllm_policy(args.vllm)
    deepseek = _load_file("deepseek_eplb", args.deepseek)
    lines = []
    for seed, (name, E, G, N, W, P) in enumerate(CONFIGS):
        load = loads(np.random.default_rng(seed), CANDIDATE_LAYERS, E)
        t = torch.from_numpy(load)
        sg = sglang.rebalance_experts(t, P, G, N, W, enable_hierarchical=G % N == 0)[0].numpy()
        vl = vllm.rebalance_experts(t, P, G, N, W).numpy()
        ds = deepseek.rebalance_experts(t, P, G, N, W)[0].numpy()
        differ = (ds != sg).any(1) | (ds != vl).any(1)
        keep = np.sort(np.concatenate([np.flatnonzero(differ)[:KEEP_DIFFERENT], np.flatnonzero(~differ)[:KEEP_SAME]]))
        case = {
            "name": name,
            "seed": seed,
            "num_replicas": P,
            "num_groups": G,
            "num_nodes": N,
            "num_gpus": W,
            "candidate_layers": CANDIDATE_LAYERS,
            "candidates_where_deepseek_differs": int(differ.sum()),
            "candidates_where_sglang_and_vllm_differ": int((sg != vl).any(1).sum()),
            "layers": keep.tolist(),
            "load": [_json_row(load[i]) for i in keep],
            "sglang_phy2log": sg[keep].tolist(),
            "vllm_phy2log": vl[keep].tolist(),
            "deepseek_phy2log": ds[keep].tolist(),
        }
        print(
            f"{name}: DeepSeek's float32 differs from the engines in {case['candidates_where_deepseek_differs']} of "
            f"{CANDIDATE_LAYERS} layers; SGLang and vLLM differ in {case['candidates_where_sglang_and_vllm_differ']}"
        )
        lines.append(json.dumps(case, separators=(",", ":")))
    head = {
        "sglang": f"sglang {args.sglang_version} (PyPI) sglang/srt/eplb/eplb_algorithms/deepseek.py, rebalance_experts",
        "vllm": f"vllm {args.vllm_version} (PyPI) vllm/distributed/eplb/policy/default.py, DefaultEplbPolicy",
        "deepseek": "github.com/deepseek-ai/EPLB eplb.py, rebalance_experts",
        "deepseek_commit": args.deepseek_commit,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "generator": "tests/golden/make_eplb_engines_golden.py",
    }
    text = '{"about":' + json.dumps(head, separators=(",", ":")) + ',\n"cases":[\n' + ",\n".join(lines) + "\n]}\n"
    args.out.write_text(text)
    print(f"{len(lines)} cases -> {args.out} ({len(text) / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
