"""``moetrace advise`` on SGLang statistics files (``{"logical_count": [61][256]}``): the verdicts at
EP32 and EP64, decode and prefill, with EPLB's two policies, and how they change with the step size.

The public files are SGLang's DeepSeek-V3 expert statistics attached to sgl-project/sglang#6017
(download them by hand; they are not stored here). Without one, make a synthetic file with the
project (docs/advise.md labels its figures synthetic):

    moetrace synth --model deepseek-v3 --requests 300 --seed 0 -o traces/dsv3-300
    moetrace export traces/dsv3-300 --format sglang-logical-count --stage decode -o logical_count_decode.json

Run: .venv/bin/python benchmarks/bench_advise_stats.py logical_count_decode.json [--stage decode]
     [--configs DP32TP1EP32,DP64TP1EP64] [--decode-tokens 4,128] [--replica-policy vllm]

Prints, per deployment and step size, each EPLB policy's best sweep point (balancedness, predicted
MoE-layer time over linear's) and the verdict, and the wall time of each advise call.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Literal

from moetrace.placement.advise import AdviseConfig, advise_profile
from moetrace.placement.advise.verdicts import best_eplb, pct
from moetrace.placement.deployment import parse_deployment
from moetrace.tracer.importers import import_profile
from moetrace.tracer.presets import resolve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stats", help="SGLang logical_count JSON (one statistics file)")
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--stage", default="decode", choices=["decode", "prefill"])
    ap.add_argument("--configs", default="DP32TP1EP32,DP64TP1EP64")
    ap.add_argument("--decode-tokens", default="4,128", help="decode tokens per GPU and step to try")
    ap.add_argument("--prefill-tokens", default="128", help="prefill tokens per GPU and step to try")
    ap.add_argument("--replica-policy", default="same_node", choices=["same_node", "vllm", "sglang"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prof = Path(tmp) / "stats.profile.parquet"
        info = resolve(args.model).model_info()
        stages: Literal["decode-only", "prefill-only"] = "decode-only" if args.stage == "decode" else "prefill-only"
        import_profile(Path(args.stats), out=prof, model=info, stages=stages)
        sizes = args.decode_tokens if args.stage == "decode" else args.prefill_tokens
        for config in args.configs.split(","):
            dep = parse_deployment(config)
            for n in (int(x) for x in sizes.split(",")):
                # a mixed/one-stage statistics file is advised as decode steps; prefill sizes apply to prefill files
                if args.stage == "decode":
                    cfg = AdviseConfig(deployment=dep, replica_policy=args.replica_policy, decode_tokens_per_gpu=n)
                else:
                    cfg = AdviseConfig(deployment=dep, replica_policy=args.replica_policy, prefill_tokens_per_gpu=n)
                t0 = time.perf_counter()
                adv = advise_profile(prof, cfg)
                wall = time.perf_counter() - t0
                st = adv.manifest.stages[0]
                rows = [r for r in adv.rows if r.stage == st]
                ref = next(r for r in rows if r.option == adv.manifest.reference)
                print(f"\n{config}, {args.stage} file, {n} tokens per GPU and step ({wall:.1f} s):")
                print(f"  linear: balancedness {ref.balancedness_vllm:.3f}")
                for strategy in ("eplb", "eplb_global"):
                    b = best_eplb([r for r in rows if r.strategy == strategy])
                    if b is not None:
                        print(
                            f"  {b.label:<28} balancedness {b.balancedness_vllm:.3f}, "
                            f"MoE-layer time {pct(b.vs_ref('moe'))}"
                        )
                print("  " + adv.verdicts[0])


if __name__ == "__main__":
    main()
