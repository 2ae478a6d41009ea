"""Synthetic traces with planted, known structure (``moetrace synth``).

The generative model, per MoE layer ``l`` (all randomness derived from one seed):

1. *Planted profiles.* For each stage-role ``s`` (0: prefill, 1: decode-specific), every layer draws
   Zipf score vectors ``z = -log(rank + zipf_offset)`` over a random permutation of the experts: one shared by all
   datasets, one per domain, one per dataset. A dataset's log-profile is
   ``skew_DL * (w_shared*z_shared + w_domain*z_domain + w_dataset*z_dataset)`` (weights sum to 1, so a
   single component gives weights exactly proportional to ``(rank + zipf_offset)**-skew``). ``prefill_DLE`` is its
   softmax. The decode profile is ``pd_mix * prefill + (1 - pd_mix) * decode_specific``.
2. *Per request.* Each request draws ``num_request_experts`` favourite experts per layer (uniformly,
   without replacement).
3. *Per token and layer.* A candidate expert is drawn from the mixture
   ``a * follow + (1-a) * ((1-v) * profile[dataset, stage, l] + v * uniform(favourites[request, l]))``
   where ``follow`` picks one of the token's experts at layer ``l-1`` uniformly and maps it through the
   planted ``affinity_map`` (a fixed permutation per layer pair), ``a = layer_affinity`` (0 at the first
   MoE layer) and ``v = request_spread``. The top-k set is sampled *without replacement* by sequential
   rejection: candidates are drawn i.i.d. from that mixture and the first ``K`` distinct ones are kept,
   in draw order. This is exactly the Plackett-Luce law that Gumbel-top-k on the log-mixture samples,
   at ``O(K)`` draws instead of ``O(E)``; rows that stay short after a few rounds finish with an exact
   Gumbel-top-k over the dense mixture with the chosen experts removed.
   *Group-limited routers* (the model's ``n_group``/``topk_group``, DeepSeek-V3: 8/4): experts are in
   ``n_group`` groups of consecutive ids and a candidate is kept only if its group is among the first
   ``topk_group`` groups the token's kept candidates opened, so every token uses at most
   ``topk_group`` groups. This is the same Plackett-Luce order scanned under the limit: the groups a
   token uses are those of its highest-ranked experts (DeepSeek-V3 ranks groups by their two best
   scores; here by the best one).
4. *Lengths.* Prompt and output lengths are log-normal per dataset, clipped. The final generated token
   of a request carries ``-1`` ids, like a collected trace (it is never forwarded through the model).

*Control.* ``SynthPlan.structure == "none"`` gives every dataset the same profiles and drops the
per-request favourites and the layer affinity, keeping the skew (:func:`plant_truth`).

*Datasets of requests.* Without a mix, requests are assigned to datasets round robin
(``request_id % D``). With ``SynthPlan.mix`` (one share per dataset) every prefix of the ids holds
the mix: among the first ``n`` ids dataset ``d`` has ``n * share[d]`` requests within less than one
(Tijdeman's chairman assignment, :func:`dataset_assignment`): the whole run and a run cut short
are at the mix within one request, any stretch of ids (a chunk) within two. Equal shares give round
robin again. The assignment uses no random draw.

Requests are generated in chunks of ``chunk_requests`` ids; chunk ``c`` uses
``SeedSequence(seed, spawn_key=(1, c))`` and the planted truth ``SeedSequence(seed, spawn_key=(0,))``;
the dataset of every request is computed once for the run, so the output is byte-identical whatever
the number of worker processes. Chunks are written in request-id order through
:class:`~moetrace.tracer.trace.writer.TraceWriter`.

Shape legend: R requests, T tokens, L MoE layers, K top-k, E experts, D datasets, S stages (prefill,
decode), N alias tables (= D*S*L), X = L*K (legend: docs/architecture.md).

This module runs the generation (``synthesize``: chunks from worker processes, ``iter_chunks``, written
in request-id order; ``generate_in_memory``: the same chunks, unwritten). Its parts live beside it and the
names other modules import are re-exported here: the knobs, the plan, the dataset of each request id and
the calibration presets (``synth_plan``), the planted truth and the sampler that draws each chunk
(``synth_sample``).

Out of scope: routing weights, token text; a mix that changes over the run (one mix for all ids);
measuring the statistics (``synth_stats``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Literal

import numpy as np

from moetrace.errors import CollectionError, ConfigError, OutputExistsError
from moetrace.lifetime import die_with_parent
from moetrace.sizes import check_memory
from moetrace.tracer.synth_plan import (
    DEFAULT_DOMAINS,
    DEFAULT_LENGTHS,
    GENERIC_LENGTH,
    MIX_TOLERANCE,
    PAPER_DATASETS,
    STRUCTURES,
    SYNTH_BYTES_PER_REQUEST,
    TRUTH_FILE,
    LengthDist,
    Structure,
    SynthKnobs,
    SynthPlan,
    dataset_assignment,
    default_calibration,
    list_calibrations,
    load_calibration,
    parse_mix,
)
from moetrace.tracer.synth_sample import (
    Chunk,
    PlantedTruth,
    _make_sampler,
    _Sampler,
    alias_tables,
    generate_chunk,
    load_truth,
    plant_truth,
    save_truth,
)
from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
    # the knobs, the plan, the datasets of the ids, the calibration presets (synth_plan)
    "TRUTH_FILE",
    "PAPER_DATASETS",
    "DEFAULT_DOMAINS",
    "Structure",
    "STRUCTURES",
    "MIX_TOLERANCE",
    "LengthDist",
    "DEFAULT_LENGTHS",
    "GENERIC_LENGTH",
    "SynthKnobs",
    "SYNTH_BYTES_PER_REQUEST",
    "SynthPlan",
    "parse_mix",
    "dataset_assignment",
    "list_calibrations",
    "default_calibration",
    "load_calibration",
    # the planted truth and the sampler (synth_sample)
    "PlantedTruth",
    "plant_truth",
    "save_truth",
    "load_truth",
    "alias_tables",
    "Chunk",
    "generate_chunk",
    # the run (this module)
    "SynthSummary",
    "iter_chunks",
    "synthesize",
    "generate_in_memory",
]


# ====================================================================== streaming the whole trace


@dataclass(frozen=True)
class SynthSummary:
    """What a run wrote."""

    path: Path
    num_requests: int
    num_tokens: int
    num_ids: int  # expert ids written (tokens * L * K, including -1 rows)
    seconds: float
    bytes_on_disk: int
    calibration: str | None


_WORKER: _Sampler | None = None


def _init_worker(sampler: _Sampler) -> None:
    global _WORKER
    die_with_parent()  # never outlives a killed `synth`
    _WORKER = sampler


def _worker_chunk(c: int) -> Chunk:
    assert _WORKER is not None
    return generate_chunk(_WORKER, c)


def iter_chunks(sampler: _Sampler, chunks: list[int], *, workers: int) -> Iterator[Chunk]:
    """Generated chunks in the order of ``chunks``; ``workers`` > 1 uses a process pool, 2*workers in flight.

    A worker that dies (a signal: the out-of-memory killer, ``kill -9``) raises ``CollectionError`` at once:
    the pool breaks and no chunk of it is waited for."""
    if workers <= 1:
        for c in chunks:
            yield generate_chunk(sampler, c)
        return
    # fork where the platform has it: workers only run numpy on the sampler they inherit, and it
    # needs no `if __name__ == "__main__"` guard in user scripts; spawn elsewhere
    method = "fork" if "fork" in get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(
        workers, mp_context=get_context(method), initializer=_init_worker, initargs=(sampler,)
    ) as ex:
        pending: list[Future] = []
        it = iter(chunks)
        for c in it:
            pending.append(ex.submit(_worker_chunk, c))
            if len(pending) >= 2 * workers:
                break
        while pending:
            try:  # a dead worker breaks the pool: the next result or the next submit says so
                done = pending.pop(0).result()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append(ex.submit(_worker_chunk, nxt))
            except BrokenProcessPool as exc:
                raise CollectionError(
                    "a synth worker process ended abruptly (killed by a signal: the out-of-memory killer, kill -9)"
                ) from exc
            yield done


def synthesize(
    out: str | os.PathLike,
    *,
    model: ModelInfo,
    plan: SynthPlan,
    workers: int = 1,
    on_existing: Literal["refuse", "overwrite"] = "refuse",
    progress: Callable[[int, int], None] | None = None,
) -> SynthSummary:
    """Generate the trace of ``plan`` for ``model`` into the directory ``out`` (streaming, bounded memory).

    There is no resume: a run is deterministic, so an interrupted one is simply run again with
    ``on_existing="overwrite"``.

    ``progress(requests_done, tokens_done)`` is called after each written chunk. ``workers``
    processes generate chunks; the main process writes them in request-id order. The manifest's
    ``collection`` holds every parameter, ``truth.npz`` the planted profiles and affinity maps.
    """
    import time

    from moetrace.tracer.trace.writer import TraceWriter

    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if on_existing == "refuse" and (Path(out) / "manifest.json").exists():
        raise OutputExistsError(f"{out} already holds a trace; pass --overwrite to replace it, or choose another -o")
    # what lives for the whole run per request: its dataset index, its id in the writer's sets of done ids
    check_memory(
        plan.num_requests * SYNTH_BYTES_PER_REQUEST,
        what=f"synth of {plan.num_requests:,} requests",
        knob="lower --requests (or write several traces)",
    )
    t0 = time.perf_counter()
    collection = plan.collection(model)
    truth = plant_truth(model, plan)
    sampler = _make_sampler(model, plan, truth)
    X = model.ids_per_token
    with TraceWriter(
        out,
        model=model,
        backend={
            "name": "synthetic",
            "generator": "moetrace.synth",
            "version": 1,
            "versions": {"numpy": np.__version__},
        },
        collection=collection,
        on_existing=on_existing,
        part_prefix="synth",
        row_group_tokens=max(4096, (16 << 20) // (2 * X)),  # ~16 MiB of ids per row group (bounds writer memory)
        part_tokens=max(65536, (512 << 20) // (2 * X)),  # ~512 MiB of raw ids per part
    ) as w:
        save_truth(Path(out) / TRUTH_FILE, truth, plan.datasets)
        names = np.array(plan.datasets, dtype=object)
        n_req, n_tok = 0, 0
        n_chunks = -(-plan.num_requests // plan.num_chunk_requests)
        try:
            for ch in iter_chunks(sampler, list(range(n_chunks)), workers=workers):
                w.add_requests(
                    request_id_R=ch.request_id_R,
                    dataset_R=names[ch.dataset_R].tolist(),
                    prompt_tokens_R=ch.prompt_tokens_R,
                    output_tokens_R=ch.output_tokens_R,
                    topk_ids_TX=ch.topk_ids_TX,
                )
                n_req += ch.request_id_R.shape[0]
                n_tok += ch.topk_ids_TX.shape[0]
                if progress is not None:
                    progress(n_req, n_tok)
        except CollectionError as exc:  # the writer then closes the trace as incomplete (complete: false)
            raise CollectionError(
                f"{exc}; {out} is left an incomplete trace ({n_req:,} of {plan.num_requests:,} requests generated; "
                "its manifest says `complete: false`, so no reader takes it for a whole trace): run the same command "
                "again with --overwrite (synth is deterministic: the same trace)"
            ) from exc
        stats = w.close()
    return SynthSummary(
        path=Path(out),
        num_requests=stats.num_requests,
        num_tokens=stats.num_tokens,
        num_ids=n_tok * X,
        seconds=time.perf_counter() - t0,
        bytes_on_disk=stats.bytes_on_disk,
        calibration=plan.calibration,
    )


def generate_in_memory(model: ModelInfo, plan: SynthPlan, *, workers: int = 1) -> Iterator[Chunk]:
    """The chunks :func:`synthesize` would write, without writing (for calibration and tests)."""
    sampler = _make_sampler(model, plan, plant_truth(model, plan))
    n_chunks = -(-plan.num_requests // plan.num_chunk_requests)
    yield from iter_chunks(sampler, list(range(n_chunks)), workers=workers)
