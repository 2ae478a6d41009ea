"""``moetrace advise``: should this deployment enable EPLB, with which policy and how many redundant
experts, and what does a data-based placement add, answered per stage in the engines' own terms.

For each recorded stage (prefill, decode, and both together) and each option (the placement served
now, ``--current``, or linear, vLLM's default; the strategies of ``options``: by default
round robin, DeepSeek's EPLB under its hierarchical and its global policy with R redundant slots for
every R of ``metrics.redundancy_sweep``, and ours, ``joint``, where per-request routing
allows; any registered strategy by name) advise measures, per MoE layer and step, then
summarised:

- balancedness as vLLM logs it, the busiest rank's (token, expert) pairs, activated experts per GPU,
  distinct destination ranks per token (``metrics``), with the replicas an engine's dispatch
  picks (``eplb_replicas``: vLLM's hash, SGLang's local-first map, or moetrace's same-node model);
- inter-node bytes, predicted all-to-all and MoE-layer seconds per step from the cost model
  (``step_model`` with ``cost.CostModel`` on a trace's simulated steps; the cost model's formulas on
  expected traffic for a load profile), with the step-to-step spread;
- migration from the placement served now (``metrics.migration``) and the memory the
  redundant slots take per GPU.

Then one verdict per stage in plain words (``verdicts``), with the rearrangement's stall in
steps and whether the engine's schedule pays for it (``rearrange``). Steps hold
``decode_tokens_per_gpu`` / ``prefill_tokens_per_gpu`` tokens per GPU (defaults 4 and 128).

Inputs: a trace (requests split into placement and held-out ones as ``compare`` splits them, so
``moetrace place --strategy eplb`` reproduces the decode EPLB placement advised; the held-out
requests' steps are drawn by ``compare.held_out_batches`` / ``prefill_batches``) or a load profile
(windows of expert counts in time order: the first half fits, the rest is evaluated; one window,
such as one engine statistics file, is fitted and evaluated in-sample, with no drift estimate, and
the output says so; no tokens, so no send-ranks-per-token and the per-(token, expert) copy model only).

The modules, in the order a run uses them:

- ``config``: ``AdviseConfig``, the deployment, steps and strategies of one run;
- ``types``: the records passed between the parts (``AdviseInputs``, ``Option``, ``StepMetrics``,
  ``Advice``);
- ``inputs``: a trace or a profile read into ``AdviseInputs``; ``current``: ``--current``'s placement;
- ``options``: which strategies are evaluated; ``fit``: the options fitted per stage;
- ``evaluate``: one option on one stage's steps, with the measures of ``metrics``;
- ``rows``: the summary and per-layer rows (the summary typed as ``advise_option_row.OptionRow``);
- ``drift``: the stages' correlation, the drift as ``advise_manifest.DriftEstimate``;
- ``verdicts``: the verdicts in words, with the stall of ``rearrange``;
- ``run``: ``advise_arrays`` (six named steps) and the entry points ``advise_trace``,
  ``advise_profile_counts`` / ``advise_profile`` and ``advise_input``;
- ``files``: ``advice.json`` (the typed ``advise_manifest.AdviceManifest``, written through its
  ``to_json``), the tables, the placements and the printed text; ``read_advice`` reads it back.

    cfg = AdviseConfig(deployment=parse_deployment("DP8TP8EP64"))
    advice = advise_input("traces/dsv3", cfg)
    write_advice(advice, "advice", deployment=cfg.deployment); print(format_advice(advice, out="advice"))

``advise_manifest`` and ``advise_option_row`` (the typed ``advice.json`` and ``options.parquet`` row)
live beside the package, so that reading an advice imports no advise run.

Shape legend (docs/architecture.md): N windows, B steps, R requests, L MoE layers, E logical
experts, P physical slots, W EP ranks, G nodes, T tokens, K top-k slots, S stages.

Out of scope: the placers (``eplb``, ``baselines``, ``joint``), the volume and cost models
(``simulate``, ``cost``), engine files (``exports``); time-varying rebalancing schedules beyond the
stall's cost: every option is a static placement.
"""

from __future__ import annotations

from moetrace.placement.advise.config import DECODE_TOKENS_PER_GPU, PREFILL_TOKENS_PER_GPU, AdviseConfig
from moetrace.placement.advise.evaluate import evaluate_counts, evaluate_tokens
from moetrace.placement.advise.files import commands, format_advice, read_advice, write_advice
from moetrace.placement.advise.run import (
    advise_arrays,
    advise_input,
    advise_profile,
    advise_profile_counts,
    advise_trace,
    is_profile,
)
from moetrace.placement.advise.types import (
    STAGES,
    Advice,
    AdviseInputs,
    Option,
    StageInput,
    StepMetrics,
    StepTokens,
)
from moetrace.placement.advise_option_row import OptionRow

__all__ = [
    "DECODE_TOKENS_PER_GPU",
    "PREFILL_TOKENS_PER_GPU",
    "STAGES",
    "Advice",
    "AdviseConfig",
    "AdviseInputs",
    "Option",
    "OptionRow",
    "StageInput",
    "StepMetrics",
    "StepTokens",
    "advise_arrays",
    "advise_input",
    "advise_profile",
    "advise_profile_counts",
    "advise_trace",
    "commands",
    "evaluate_counts",
    "evaluate_tokens",
    "format_advice",
    "is_profile",
    "read_advice",
    "write_advice",
]
