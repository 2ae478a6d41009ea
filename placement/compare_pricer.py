"""How ``ours`` prices its candidates on its validation split (``validation_pricer``): the validation
requests' own tokens simulated as ``compare`` simulates the held-out ones, under the run's copy and
step models (``compare_steps.Stepper``).

Shape legend (docs/architecture.md): R requests, L MoE layers, E logical experts, V validation rows.

Out of scope: choosing among the candidates (``ours``); compare's own held-out steps (``compare``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from moetrace.placement.compare_config import CompareConfig
from moetrace.placement.compare_data import TraceData, with_held_out_tokens
from moetrace.placement.compare_steps import (
    Stepper,
    held_out_batches,
    prefill_batches,
    seconds_median,
    simulation_workers,
)
from moetrace.placement.maps import Placement

__all__ = ["VALIDATION_BATCHES", "validation_pricer"]


#: decode steps ``ours`` prices each candidate on over its validation split (at most compare's own)
VALIDATION_BATCHES = 200


def validation_pricer(data: TraceData, cfg: CompareConfig) -> Callable[..., dict[str, dict[str, float]]] | None:
    """How ``ours`` prices its candidates on its validation split (``ours.choose_ours``'s ``price``): the
    validation requests' own tokens (one more pass over the trace) simulated as compare simulates the
    held-out ones, under the run's copy models and step model (``Stepper``: MoE-layer time, expert
    computation included), in decode (``VALIDATION_BATCHES`` steps) and prefill. None for a load
    profile (no requests to read).

    ``price(val_rows, {name: (placement, node of each validation row or None: spread evenly)})`` returns
    per candidate ``score`` (the time to serve the validation requests over linear's: decode steps
    ``decode tokens / batch_requests`` times the median decode step plus prefill steps ``prompt tokens /
    (prefill_tokens_per_node * G)`` times the median prefill step, in the verdict's measure), and the
    the same in all-to-all time (``a2a_score``), and the decode and prefill medians of both measures over
    linear's (``decode_moe``, ``decode_a2a``, ``prefill_moe``, ``prefill_a2a``; NaN where not simulated)."""
    if data.tokens_from is not None:
        return None
    from moetrace.placement.baselines import linear

    def price(
        val_rows: np.ndarray, candidates: dict[str, tuple[Placement, np.ndarray | None]]
    ) -> dict[str, dict[str, float]]:
        R, G = len(data.is_test_R), cfg.deployment.num_groups
        is_val = np.zeros(R, dtype=bool)
        is_val[val_rows] = True
        vdata = with_held_out_tokens(
            replace(
                data,
                is_test_R=is_val,
                test_topk_ids_TLK=None,
                test_req_T=None,
                test_prefill_ids_TLK=None,
                test_prefill_req_T=None,
            )
        )
        vcfg = replace(cfg, num_batches=min(cfg.num_batches, VALIDATION_BATCHES), oracle=False)
        stepper = Stepper.of(data.model, vcfg)
        m = data.model
        P = cfg.deployment.check_slots(num_experts=m.num_experts, num_redundant=cfg.num_redundant)
        lin = linear(
            num_layers=m.num_moe_layers, num_experts=m.num_experts, num_slots=P, num_ranks=cfg.deployment.num_ep
        )
        assert vdata.test_topk_ids_TLK is not None and vdata.test_req_T is not None

        def medians_of(item: tuple[str, tuple[Placement, np.ndarray | None]]) -> dict[str, float]:
            """One candidate's decode and prefill medians over the validation steps."""
            placement, group_V = item[1]
            assert vdata.test_topk_ids_TLK is not None
            group_R = None
            if group_V is not None:
                group_R = np.zeros(R, dtype=np.int64)
                group_R[val_rows] = group_V
            rows, batch, src, _ = held_out_batches(vdata, vcfg, group_R)
            dm = stepper.volume(
                vdata.test_topk_ids_TLK, placement, (rows, batch, src), steps=vcfg.num_batches, dedup=cfg.dedup
            )
            med = {f"decode_{w}": seconds_median(dm, w) for w in ("moe", "a2a")}
            drawn = prefill_batches(vdata, vcfg, group_R)
            if drawn is not None and vdata.test_prefill_ids_TLK is not None:
                pm = stepper.volume(
                    vdata.test_prefill_ids_TLK,
                    placement,
                    drawn,
                    steps=vcfg.num_prefill_batches,
                    dedup=cfg.prefill_dedup,
                )
                med |= {f"prefill_{w}": seconds_median(pm, w) for w in ("moe", "a2a")}
            else:
                med |= {"prefill_moe": float("nan"), "prefill_a2a": float("nan")}
            return med

        # the candidates side by side (the simulation kernel releases the GIL); each is computed whole on
        # one thread, so the medians do not depend on the number of threads
        items = list({"linear": (lin, None), **candidates}.items())
        with ThreadPoolExecutor(max_workers=simulation_workers(len(items))) as pool:
            medians = {name: med for (name, _), med in zip(items, pool.map(medians_of, items))}
        w = stepper.measure
        decode_steps = len(vdata.test_req_T) / vcfg.batch_requests
        prompt_tokens = 0.0
        if data.route_first_decode == 0 and "prefill" in data.stages and np.isfinite(medians["linear"][f"prefill_{w}"]):
            prompt_tokens = float(data.prefill_RLE[val_rows, 0, :].sum(dtype=np.float64)) / max(m.top_k, 1)
        prefill_steps = prompt_tokens / max(cfg.prefill_tokens_per_node * G, 1)

        def served(med: dict[str, float], w: str = w) -> float:
            pre = med[f"prefill_{w}"] if prefill_steps > 0 else 0.0
            return decode_steps * med[f"decode_{w}"] + prefill_steps * pre

        ref = medians["linear"]
        out = {}
        for name in candidates:
            med = medians[name]
            out[name] = {
                "score": served(med) / served(ref),
                "a2a_score": served(med, "a2a") / served(ref, "a2a"),
                **{k: (v / ref[k] if ref[k] > 0 else float("nan")) for k, v in med.items()},
            }
        return out

    return price
