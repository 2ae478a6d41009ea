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

Out of scope: routing weights, token text; a mix that changes over the run (one mix for all ids);
measuring the statistics (``synth_stats``).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from importlib import resources
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

from moetrace.atomic import atomic_path
from moetrace.errors import CollectionError, ConfigError, OutputExistsError
from moetrace.lifetime import die_with_parent
from moetrace.sizes import check_memory
from moetrace.tracer.trace.schema import NO_EXPERT, ModelInfo

TRUTH_FILE = "truth.npz"
PAPER_DATASETS = ("gsm8k", "math", "mbpp", "humaneval", "lmsys-chat", "xsum", "tldr")
#: dataset -> domain; datasets of one domain share the domain component of their profiles
DEFAULT_DOMAINS = {
    "gsm8k": "math",
    "math": "math",
    "mbpp": "code",
    "humaneval": "code",
    "lmsys-chat": "chat",
    "xsum": "summarization",
    "tldr": "summarization",
}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
#: ``planted``: the knobs' structure; ``none``: the control (see :func:`plant_truth`)
Structure = Literal["planted", "none"]
STRUCTURES: tuple[str, ...] = ("planted", "none")
#: how far a mix's shares may sum from 1 (they are then divided by their sum)
MIX_TOLERANCE = 1e-6


# ====================================================================== configuration


@dataclass(frozen=True, kw_only=True)
class LengthDist:
    """Log-normal token-length distribution of one dataset (medians in tokens)."""

    prompt_median: float  # median prompt length, tokens
    prompt_sigma: float  # standard deviation of log(prompt length)
    output_median: float  # median generated tokens
    output_sigma: float  # standard deviation of log(output length)
    max_prompt: int = 8192  # prompts are clipped to 1..max_prompt
    max_output: int = 4096  # outputs are clipped to 2..max_output (the last one carries -1 ids)


#: rough shapes of the paper's datasets (prompt of the raw record plus a chat template; outputs of an
#: instruction-tuned model at temperature 0); not measured, override per dataset with ``lengths``
DEFAULT_LENGTHS: dict[str, LengthDist] = {
    "gsm8k": LengthDist(prompt_median=110, prompt_sigma=0.3, output_median=220, output_sigma=0.4),
    "math": LengthDist(prompt_median=90, prompt_sigma=0.5, output_median=450, output_sigma=0.6),
    "mbpp": LengthDist(prompt_median=90, prompt_sigma=0.3, output_median=180, output_sigma=0.5),
    "humaneval": LengthDist(prompt_median=160, prompt_sigma=0.4, output_median=200, output_sigma=0.5),
    "lmsys-chat": LengthDist(prompt_median=60, prompt_sigma=1.1, output_median=260, output_sigma=0.8),
    "xsum": LengthDist(prompt_median=520, prompt_sigma=0.5, output_median=45, output_sigma=0.3),
    "tldr": LengthDist(prompt_median=330, prompt_sigma=0.4, output_median=50, output_sigma=0.4),
}
#: used for dataset names not in DEFAULT_LENGTHS
GENERIC_LENGTH = LengthDist(prompt_median=200, prompt_sigma=0.6, output_median=200, output_sigma=0.6)


@dataclass(frozen=True, kw_only=True)
class SynthKnobs:
    """The generative model's knobs (see the module docstring for how each enters)."""

    zipf_exponent: float = (
        1.0  # skew of a planted profile: weight of the rank-r expert ∝ (r + zipf_offset)**-skew (0 = uniform)
    )
    zipf_offset: float = (
        0.0  # Zipf-Mandelbrot offset q of the rank (0: plain Zipf); q > 0 flattens the head, keeps the tail
    )
    dataset_skew: Mapping[str, float] = field(
        default_factory=dict
    )  # per-dataset multiplier of zipf_exponent (absent: 1)
    layer_skew_spread: float = 0.25  # sd of the log-normal per (dataset, layer) multiplier of the skew
    shared_weight: float = 0.3  # share of the log-profile common to all datasets (de facto shared hot experts)
    domain_weight: float = 0.4  # share common to the datasets of one domain (the rest is per dataset)
    domains: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_DOMAINS))  # dataset -> domain (absent: own)
    request_spread: float = 0.2  # share of a request's draws from its own favourite experts (0: tight clusters)
    num_request_experts: int = 0  # favourite experts per request and layer (0: 2 * top_k)
    pd_mix: float = 0.6  # decode profile = pd_mix * prefill profile + (1 - pd_mix) * decode-specific profile
    layer_affinity: float = 0.3  # share of draws at layer l+1 that follow the planted map from the layer-l experts
    lengths: Mapping[str, LengthDist] = field(default_factory=dict)  # per-dataset overrides of DEFAULT_LENGTHS

    def __post_init__(self) -> None:
        for name in ("request_spread", "pd_mix", "layer_affinity", "shared_weight", "domain_weight"):
            v = getattr(self, name)
            if not (0.0 <= v <= 1.0):
                raise ConfigError(f"knob `{name}` = {v} must be in [0, 1]")
        if self.shared_weight + self.domain_weight > 1.0 + 1e-9:
            raise ConfigError(
                f"knobs `shared_weight` + `domain_weight` = {self.shared_weight + self.domain_weight} must be <= 1 "
                "(the remainder is the per-dataset share)"
            )
        if self.zipf_exponent < 0 or self.layer_skew_spread < 0 or self.zipf_offset < 0:
            raise ConfigError("knobs `zipf_exponent`, `zipf_offset` and `layer_skew_spread` must be >= 0")
        if any(v < 0 for v in self.dataset_skew.values()):
            raise ConfigError(f"knob `dataset_skew` multipliers must be >= 0, got {dict(self.dataset_skew)}")
        if self.num_request_experts < 0:
            raise ConfigError("knob `num_request_experts` must be >= 0 (0 means 2 * top_k)")
        lengths = {k: v if isinstance(v, LengthDist) else _length_from(k, v) for k, v in self.lengths.items()}
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "dataset_skew", {k: float(v) for k, v in self.dataset_skew.items()})
        object.__setattr__(self, "domains", dict(self.domains))

    def length_of(self, dataset: str) -> LengthDist:
        return self.lengths.get(dataset) or DEFAULT_LENGTHS.get(dataset) or GENERIC_LENGTH

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, base: SynthKnobs | None = None) -> SynthKnobs:
        """Knobs from a JSON-like dict; keys absent from ``d`` keep ``base``'s values (default knobs if None)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown synth knob(s) {unknown}; knobs are: {sorted(names)}")
        merged = {**(base or cls()).to_dict(), **dict(d)}
        try:
            return cls(**merged)
        except TypeError as exc:
            raise ConfigError(f"bad synth knobs: {exc}") from exc


def _length_from(dataset: str, v: object) -> LengthDist:
    if not isinstance(v, Mapping):
        raise ConfigError(f"knob `lengths.{dataset}` must be an object with prompt_median, prompt_sigma, ...")
    try:
        return LengthDist(**v)
    except TypeError as exc:
        raise ConfigError(f"knob `lengths.{dataset}`: {exc}") from exc


#: memory one synthetic request keeps for the whole run (ids, dataset index, the writer's sets), bytes
SYNTH_BYTES_PER_REQUEST = 256


@dataclass(frozen=True, kw_only=True)
class SynthPlan:
    """What to generate: everything that, with the model, determines the trace byte for byte."""

    datasets: tuple[str, ...]  # dataset names (the order of the mix, the truth arrays and the profile draws)
    num_requests: int  # requests to generate (ids 0..num_requests-1)
    seed: int  # root seed of every random draw
    knobs: SynthKnobs  # the generative model's parameters
    calibration: str | None = None  # name of the calibration preset the knobs started from (provenance)
    num_chunk_requests: int = 64  # requests per generation chunk (part of the seed derivation)
    structure: Structure = "planted"  # "none": a control with no dataset, domain, request or layer structure
    # share of the requests per dataset, in `datasets` order, each > 0, summing to 1 within MIX_TOLERANCE
    # (stored divided by the sum); None: equal shares, round robin (request_id % D)
    mix: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.datasets:
            raise ConfigError("synth needs at least one dataset name (e.g. --datasets gsm8k,math)")
        bad = [d for d in self.datasets if not _NAME_RE.match(d)]
        if bad:
            raise ConfigError(f"dataset names may use letters, digits, '_', '.', '-'; got {bad}")
        if len(set(self.datasets)) != len(self.datasets):
            raise ConfigError(f"dataset names repeat: {list(self.datasets)}")
        if self.num_requests < 1:
            raise ConfigError(f"--requests must be >= 1, got {self.num_requests}")
        if self.num_chunk_requests < 1:
            raise ConfigError("num_chunk_requests must be >= 1")
        if self.seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {self.seed}")
        if self.structure not in STRUCTURES:
            raise ConfigError(f"--structure must be one of {', '.join(STRUCTURES)}; got {self.structure!r}")
        object.__setattr__(self, "datasets", tuple(self.datasets))
        if self.mix is not None:
            object.__setattr__(self, "mix", _checked_mix(self.datasets, self.mix))

    def shares(self) -> tuple[float, ...]:
        """Each dataset's share of the requests, in ``datasets`` order (``1/D`` each without a mix)."""
        return self.mix if self.mix is not None else (1.0 / len(self.datasets),) * len(self.datasets)

    def requests_per_dataset(self) -> tuple[int, ...]:
        """Requests each dataset gets, in ``datasets`` order: ``num_requests * share`` rounded up or down
        (:func:`dataset_assignment`)."""
        return tuple(int(n) for n in np.bincount(dataset_assignment(self), minlength=len(self.datasets)))

    def collection(self, model: ModelInfo) -> dict[str, Any]:
        """The manifest ``collection`` section: every generator parameter (the planted truth's recipe)."""
        k = self.knobs
        return {
            "generator": "moetrace.synth",
            "datasets": list(self.datasets),
            "num_requests": self.num_requests,
            "seed": self.seed,
            "calibration": self.calibration,
            "num_chunk_requests": self.num_chunk_requests,
            # "round_robin": request i is dataset i % D; "mix": every prefix of the ids within one request of
            # the shares (dataset_assignment)
            "dataset_assignment": "round_robin" if self.mix is None else "mix",
            "mix": dict(zip(self.datasets, self.shares())),
            "requests_per_dataset": dict(zip(self.datasets, self.requests_per_dataset())),
            "structure": self.structure,
            # experts per token limited to the first topk_group of n_group groups (None: no limit)
            "group_limit": (
                {"n_group": model.n_group, "topk_group": model.topk_group} if model.group_limited else None
            ),
            "num_request_experts": _num_fav(k, model),
            "knobs": k.to_dict(),
            "lengths": {d: dataclasses.asdict(k.length_of(d)) for d in self.datasets},
            "domains": {d: k.domains.get(d, d) for d in self.datasets},
            "truth": TRUTH_FILE,
        }


def _checked_mix(datasets: tuple[str, ...], mix: tuple[float, ...]) -> tuple[float, ...]:
    """``mix`` as floats divided by their sum, after checking one share > 0 per dataset summing to ~1."""
    shares = tuple(float(w) for w in mix)
    if len(shares) != len(datasets):
        raise ConfigError(
            f"the mix has {len(shares)} share(s) for {len(datasets)} dataset(s); give one per dataset, "
            "in the order of the datasets"
        )
    bad = [f"{d}={w:g}" for d, w in zip(datasets, shares) if not (math.isfinite(w) and w > 0)]
    if bad:
        raise ConfigError(
            f"mix shares must be numbers > 0, got {', '.join(bad)}; "
            "to leave a dataset out, drop it from the datasets (and the mix) instead"
        )
    total = math.fsum(shares)
    if abs(total - 1.0) > MIX_TOLERANCE:
        raise ConfigError(
            f"mix shares sum to {total:.9g}, not 1; give fractions of the requests that add up to 1 "
            "(e.g. gsm8k=0.6,mbpp=0.2,humaneval=0.1,xsum=0.1)"
        )
    return tuple(w / total for w in shares)


def parse_mix(text: str, *, datasets: tuple[str, ...] | None = None) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """``(datasets, shares)`` of a ``--mix`` text ``NAME=SHARE,...`` (e.g. ``gsm8k=0.6,mbpp=0.4``).

    The datasets come in the text's order, or in the order of ``datasets`` (the ``--datasets`` list)
    when given, which must then name the same datasets. Shares are checked by :class:`SynthPlan`.
    """
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise ConfigError("--mix is empty; give NAME=SHARE pairs, e.g. --mix gsm8k=0.6,mbpp=0.4")
    mix: dict[str, float] = {}
    for e in entries:
        name, eq, value = (x.strip() for x in e.partition("="))
        if not eq or not name:
            raise ConfigError(f"--mix entry {e!r} is not NAME=SHARE (e.g. gsm8k=0.6)")
        if name in mix:
            raise ConfigError(f"--mix names {name} twice; give each dataset once")
        try:
            mix[name] = float(value)
        except ValueError:
            raise ConfigError(f"--mix {name}={value}: the share is not a number (e.g. {name}=0.25)") from None
    if datasets is None:
        return tuple(mix), tuple(mix.values())
    problems: list[str] = []
    if missing := [d for d in datasets if d not in mix]:
        problems.append(f"--datasets names {', '.join(missing)}, --mix does not")
    if extra := [d for d in mix if d not in datasets]:
        problems.append(f"--mix names {', '.join(extra)}, --datasets does not")
    if problems:
        raise ConfigError(
            f"{'; '.join(problems)}: --mix names the datasets itself, so drop --datasets or list the same names"
        )
    return datasets, tuple(mix[d] for d in datasets)


def dataset_assignment(plan: SynthPlan) -> np.ndarray:
    """int64 ``[R]``: the dataset index (into ``plan.datasets``) of each request id.

    No mix: ``request_id % D``. With a mix: Tijdeman's chairman assignment ("The chairman assignment
    problem", Discrete Mathematics 32, 1980), which keeps every prefix of the ids at the mix: among
    the first ``n`` ids, dataset ``d`` has ``n * share[d]`` requests within ``1 - 1/(2D - 2)`` (< 1).
    Id ``n - 1`` goes, among the datasets that can take one more request within that bound, to the
    one that would fall behind it first (ties to the earlier dataset); equal shares give round robin.
    A pure function of the shares and ``R`` (no random draw): O(R log D), about 1 s per million ids.
    """
    R, D = plan.num_requests, len(plan.datasets)
    if plan.mix is None or D == 1:
        return np.arange(R, dtype=np.int64) % D
    share = plan.mix
    bound = 1.0 - 1.0 / (2 * D - 2)
    count = [0] * D
    # dataset d may take its next request at id n - 1 once n >= (count + 1 - bound) / share ("release"),
    # and must take it by n <= (count + bound) / share + 1 ("deadline"): earliest deadline first
    waiting = [((1.0 - bound) / share[d], d) for d in range(D)]  # (release, dataset), heap
    heapq.heapify(waiting)
    ready: list[tuple[float, int]] = []  # (deadline, dataset), heap
    out: list[int] = []
    for n in range(1, R + 1):
        # the theorem keeps `ready` non-empty; a release a rounding error late is taken all the same
        while waiting and (waiting[0][0] <= n + 1e-9 or not ready):
            d = heapq.heappop(waiting)[1]
            heapq.heappush(ready, ((count[d] + bound) / share[d], d))
        d = heapq.heappop(ready)[1]
        out.append(d)
        count[d] += 1
        heapq.heappush(waiting, ((count[d] + 1.0 - bound) / share[d], d))
    return np.array(out, dtype=np.int64)


def _num_fav(knobs: SynthKnobs, model: ModelInfo) -> int:
    n = knobs.num_request_experts or 2 * model.top_k
    return min(max(n, model.top_k), model.num_experts)


# ====================================================================== calibration presets


def list_calibrations() -> list[str]:
    d = resources.files("moetrace.data").joinpath("synth")
    return sorted(f.name[:-5] for f in d.iterdir() if f.name.endswith(".json"))


def default_calibration(model_name: str) -> str:
    """The calibration preset for a model preset name (``-tiny`` shares its base model's), else ``generic``."""
    base = model_name[:-5] if model_name.endswith("-tiny") else model_name
    return base if base in list_calibrations() else "generic"


def load_calibration(name: str) -> SynthKnobs:
    """Knobs of the calibration preset ``data/synth/<name>.json``."""
    names = list_calibrations()
    if name not in names:
        raise ConfigError(f"unknown synth calibration {name!r}; presets: {', '.join(names)}")
    d = json.loads((resources.files("moetrace.data") / "synth" / f"{name}.json").read_text())
    return SynthKnobs.from_dict(d["knobs"])


# ====================================================================== the planted truth


class PlantedTruth(NamedTuple):
    """The planted structure (``truth.npz`` in the trace directory).

    prefill_DLE, decode_DLE: float64 per-expert routing probability of a draw from the dataset
    profile (rows sum to 1); decode_specific_DLE: the stage-specific part of decode_DLE; skew_DL:
    the Zipf exponent of each (dataset, layer); affinity_map_LE: int16, expert at layer l+1 that an
    expert e at layer l leads to (row L-1 unused).
    """

    prefill_DLE: np.ndarray
    decode_DLE: np.ndarray
    decode_specific_DLE: np.ndarray
    skew_DL: np.ndarray
    affinity_map_LE: np.ndarray


def plant_truth(model: ModelInfo, plan: SynthPlan) -> PlantedTruth:
    """Draw the planted profiles and affinity maps from ``SeedSequence(seed, spawn_key=(0,))``.

    With ``plan.structure == "none"`` every dataset gets one and the same profile per stage: the
    profile a single dataset with skew multiplier 1 would get (shared, domain and dataset components
    drawn once), so the load imbalance of a dataset is kept but nothing distinguishes datasets; the
    decode profile keeps its ``pd_mix`` relation to the prefill one, and ``skew_DL`` rows are equal.
    """
    k = plan.knobs
    D, L, E = len(plan.datasets), model.num_moe_layers, model.num_experts
    rng = np.random.default_rng(np.random.SeedSequence(plan.seed, spawn_key=(0,)))
    zipf_E = -np.log(np.arange(1, E + 1, dtype=np.float64) + k.zipf_offset)

    def scores(n: int) -> np.ndarray:  # [n, L, E] Zipf scores over independent random permutations
        return zipf_E[rng.permuted(np.broadcast_to(np.arange(E), (n * L, E)), axis=1)].reshape(n, L, E)

    w_sh, w_dom = k.shared_weight, k.domain_weight
    w_ds = 1.0 - w_sh - w_dom
    if plan.structure == "none":  # one "dataset" and one "domain", broadcast to every dataset
        dom_names, dom_idx, ds_idx = ["all"], np.zeros(D, np.int64), np.zeros(D, np.int64)
        mult_D = np.ones(1)
    else:
        domains = [k.domains.get(d, d) for d in plan.datasets]
        dom_names = sorted(set(domains))
        dom_idx = np.array([dom_names.index(x) for x in domains])
        ds_idx = np.arange(D)
        mult_D = np.array([k.dataset_skew.get(d, 1.0) for d in plan.datasets])
    skew_DL = k.zipf_exponent * mult_D[:, None] * np.exp(k.layer_skew_spread * rng.standard_normal((mult_D.size, L)))
    skew_DL = skew_DL[ds_idx]
    profiles = []
    for _stage in range(2):  # 0: prefill, 1: decode-specific (independent draws)
        logit_DLE = w_sh * scores(1) + w_dom * scores(len(dom_names))[dom_idx] + w_ds * scores(ds_idx.max() + 1)[ds_idx]
        logit_DLE = skew_DL[:, :, None] * logit_DLE
        logit_DLE -= logit_DLE.max(axis=2, keepdims=True)
        p = np.exp(logit_DLE)
        profiles.append(p / p.sum(axis=2, keepdims=True))
    prefill_DLE, specific_DLE = profiles
    decode_DLE = k.pd_mix * prefill_DLE + (1.0 - k.pd_mix) * specific_DLE
    affinity_map_LE = rng.permuted(np.broadcast_to(np.arange(E), (L, E)), axis=1).astype(np.int16)
    return PlantedTruth(prefill_DLE, decode_DLE, specific_DLE, skew_DL, affinity_map_LE)


def save_truth(path: str | os.PathLike, truth: PlantedTruth, datasets: tuple[str, ...]) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:  # a file object: savez adds no ".npz" suffix
        np.savez_compressed(f, datasets=np.array(datasets), **truth._asdict())


def load_truth(trace_dir: str | os.PathLike) -> tuple[PlantedTruth, tuple[str, ...]]:
    """The planted truth of a synthetic trace and its dataset order."""
    with np.load(Path(trace_dir) / TRUTH_FILE) as z:
        return PlantedTruth(*(z[f] for f in PlantedTruth._fields)), tuple(str(x) for x in z["datasets"])


def alias_tables(p_NE: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker alias tables (Vose's construction) of N distributions over E outcomes.

    Returns ``threshold_NE`` float64 in [0, 1] (keep column c when a uniform draw is below it) and
    ``alias_NE`` int16 (the outcome taken otherwise; a column with threshold 1 is its own alias).
    Drawing a column uniformly and applying the test samples ``p`` exactly.
    """
    N, E = p_NE.shape
    scaled_NE = p_NE / p_NE.sum(axis=1, keepdims=True) * E
    thr_NE = np.ones((N, E))
    alias_NE = np.tile(np.arange(E, dtype=np.int16), (N, 1))
    for n in range(N):
        sc = scaled_NE[n].tolist()
        thr, alias = thr_NE[n], alias_NE[n]
        small = [e for e in range(E) if sc[e] < 1.0]
        large = [e for e in range(E) if sc[e] >= 1.0]
        while small and large:
            s_, l_ = small.pop(), large[-1]
            thr[s_] = sc[s_]
            alias[s_] = l_
            sc[l_] -= 1.0 - sc[s_]
            if sc[l_] < 1.0:
                small.append(large.pop())
        # leftovers are 1 up to rounding: keep them (threshold 1, own alias)
    return thr_NE, alias_NE


def _packed_alias(p_NE: np.ndarray) -> tuple[np.ndarray, int]:
    """Alias tables packed one uint32 per column: threshold in the top 32-b bits, alias in the low b bits.

    E is padded to 2**b columns of probability 0, so a column is the top b bits of a 32-bit draw and
    the threshold test uses the other 32-b bits (exact up to 2**-(32-b) per column).
    """
    N, E = p_NE.shape
    b = max(1, (E - 1).bit_length())
    if b > 15:
        raise ConfigError(f"synth supports up to 32768 experts, got {E}")
    padded = np.zeros((N, 1 << b))
    padded[:, :E] = p_NE
    thr, alias = alias_tables(padded)
    q = np.minimum(np.floor(thr * 2.0 ** (32 - b)), 2.0 ** (32 - b) - 1).astype(np.uint32)
    q[thr >= 1.0] = np.uint32(2 ** (32 - b) - 1)  # alias is itself: the test outcome does not matter
    return ((q << np.uint32(b)) | alias.astype(np.uint32)).reshape(-1), b


class Chunk(NamedTuple):
    """One generated chunk: R requests and their T tokens (``topk_ids_TX`` int16 ``[T, L*K]``)."""

    request_id_R: np.ndarray
    dataset_R: np.ndarray  # int index into plan.datasets
    prompt_tokens_R: np.ndarray
    output_tokens_R: np.ndarray
    topk_ids_TX: np.ndarray


@dataclass(frozen=True)
class _Sampler:
    """Everything a worker needs (picklable; built once per run)."""

    model: ModelInfo
    plan: SynthPlan
    p_NE: np.ndarray  # float64 profiles, N = (dataset*2 + stage)*L + layer (for the exact finish)
    packed: np.ndarray  # uint32 packed alias tables, flat: column c of table n at n * 2**bits + c
    bits: int  # log2 of the padded column count
    affinity_map_LE: np.ndarray  # int16
    dataset_R: np.ndarray  # int64 [num_requests]: dataset index of every request id (dataset_assignment)


def _make_sampler(model: ModelInfo, plan: SynthPlan, truth: PlantedTruth) -> _Sampler:
    p_NE = np.stack([truth.prefill_DLE, truth.decode_DLE], axis=1).reshape(-1, model.num_experts)
    packed, bits = _packed_alias(p_NE)
    return _Sampler(model, plan, p_NE, packed, bits, truth.affinity_map_LE, dataset_assignment(plan))


def _chunk_ids(plan: SynthPlan, c: int) -> np.ndarray:
    lo = c * plan.num_chunk_requests
    return np.arange(lo, min(lo + plan.num_chunk_requests, plan.num_requests), dtype=np.int64)


def _lengths(rng: np.random.Generator, plan: SynthPlan, dataset_R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    R = dataset_R.shape[0]
    prompt = np.empty(R, np.int32)
    output = np.empty(R, np.int32)
    z_R2 = rng.standard_normal((R, 2))
    for d, name in enumerate(plan.datasets):
        sel = dataset_R == d
        ld = plan.knobs.length_of(name)
        prompt[sel] = np.clip(np.rint(ld.prompt_median * np.exp(ld.prompt_sigma * z_R2[sel, 0])), 1, ld.max_prompt)
        output[sel] = np.clip(np.rint(ld.output_median * np.exp(ld.output_sigma * z_R2[sel, 1])), 2, ld.max_output)
    return prompt, output


def generate_chunk(s: _Sampler, c: int) -> Chunk:
    """Generate chunk ``c`` (request ids ``c*num_chunk_requests ...``); a pure function of (sampler, c)."""
    model, plan, k = s.model, s.plan, s.plan.knobs
    L, K, E = model.num_moe_layers, model.top_k, model.num_experts
    num_fav = _num_fav(k, model)
    rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence(plan.seed, spawn_key=(1, c))))
    rid_R = _chunk_ids(plan, c)
    R = rid_R.shape[0]
    ds_R = s.dataset_R[rid_R]
    prompt_R, output_R = _lengths(rng, plan, ds_R)
    len_R = prompt_R.astype(np.int64) + output_R
    T = int(len_R.sum())
    starts_R = np.concatenate([[0], np.cumsum(len_R)[:-1]])
    req_T = np.repeat(np.arange(R), len_R)
    decode_T = (np.arange(T) - np.repeat(starts_R, len_R)) >= np.repeat(prompt_R, len_R)
    cols = 1 << s.bits  # columns of one alias table
    tab_T = ((ds_R[req_T] * 2 + decode_T) * L) * cols  # + l*cols: offset of the token's alias table at layer l
    # each request's favourite experts per layer: int16 [R, L, num_fav], flattened
    planted = plan.structure == "planted"
    favs: np.ndarray
    if planted:
        favs = np.argpartition(rng.random((R, L, E), dtype=np.float32), num_fav - 1, axis=2)[:, :, :num_fav]
        favs = favs.astype(np.int16).reshape(-1)
    else:  # the control: no per-request favourites, no layer affinity
        favs = np.zeros(R * L * num_fav, np.int16)
    fav_T = req_T * (L * num_fav)  # + l*num_fav: offset of the token's favourites at layer l
    topk_ids_LKT = np.empty((L, K, T), np.int16)
    for l in range(L):
        a = k.layer_affinity if l > 0 and planted else 0.0
        fv = (1.0 - a) * k.request_spread if planted else 0.0
        mix = _Mix(
            tab_T=tab_T + l * cols,
            fav_T=fav_T + l * num_fav,
            fav=favs,
            num_fav=num_fav,
            follow_KT=s.affinity_map_LE[l - 1][topk_ids_LKT[l - 1]] if l > 0 else None,
            cut_aff=np.uint16(min(round(a * 2**16), 2**16 - 1)) if a < 1 else np.uint32(2**16),
            cut_fav=np.uint16(min(round((a + fv) * 2**16), 2**16 - 1)) if a + fv < 1 else np.uint32(2**16),
            w=(a, fv, 1.0 - a - fv),
        )
        _sample_topk(rng, s, mix, topk_ids_LKT[l], K=K, E=E)
    topk_ids_TLK = np.ascontiguousarray(topk_ids_LKT.transpose(2, 0, 1))
    topk_ids_TLK[starts_R + len_R - 1] = NO_EXPERT  # final generated token: never forwarded through the model
    return Chunk(rid_R, ds_R, prompt_R, output_R, topk_ids_TLK.reshape(T, L * K))


@dataclass
class _Mix:
    """The per-token candidate mixture at one layer."""

    tab_T: np.ndarray  # alias-table offset per token
    fav_T: np.ndarray  # favourites offset per token
    fav: np.ndarray  # int16 favourite experts, flat [R*L*num_fav]
    num_fav: int  # favourite experts per (request, layer)
    follow_KT: np.ndarray | None  # [K, T] int16: the planted followers of the token's layer l-1 experts
    cut_aff: np.integer  # 16-bit selector below -> follow
    cut_fav: np.integer  # 16-bit selector below (and >= cut_aff) -> favourite
    w: tuple[float, float, float]  # (follow, favourite, profile) weights


def _draw(
    rng: np.random.Generator, s: _Sampler, mix: _Mix, rows: np.ndarray | None, num_draws: int, K: int
) -> np.ndarray:
    """``[num_draws, n]`` int16 i.i.d. candidates from each token's mixture (rows: the n token indices, None = all).

    Per candidate, 32 random bits ``h`` pick the outcome inside a component: the alias column (top
    ``bits``) and its keep/alias test (the other bits), or a favourite/followed slot (top 16 bits,
    exact when num_fav and K divide 2**16); 16 more bits pick the component (weights in steps of 2**-16).
    """
    tab = mix.tab_T if rows is None else mix.tab_T[rows]
    n = tab.shape[0]
    mixed = mix.w[0] > 0 or mix.w[1] > 0
    m = num_draws * n
    size = m + (m + 1) // 2 if mixed else m
    u = rng.bit_generator.random_raw((size + 1) // 2).view(np.uint32)
    h = u[:m].reshape(num_draws, n)
    b = s.bits
    col = h >> np.uint32(32 - b)
    entry = s.packed[tab + col]
    keep = (h & np.uint32((1 << (32 - b)) - 1)) < (entry >> np.uint32(b))
    out = np.where(keep, col, entry & np.uint32((1 << b) - 1)).astype(np.int16)
    if not mixed:
        return out
    sel = u[m:].view(np.uint16)[:m].reshape(num_draws, n)
    h16 = h >> np.uint32(16)
    if mix.w[1] > 0:
        fi = (h16 * np.uint32(mix.num_fav)) >> np.uint32(16)
        fi = (mix.fav_T if rows is None else mix.fav_T[rows]) + fi
        np.copyto(out, mix.fav[fi], where=sel < mix.cut_fav)
    if mix.w[0] > 0:
        assert mix.follow_KT is not None  # the follow weight is 0 at layer 0, the one layer without followers
        follow = mix.follow_KT if rows is None else mix.follow_KT[:, rows]
        slot = (h16 * np.uint32(K)) >> np.uint32(16)
        fi = slot.astype(np.intp) * n + np.arange(n)
        np.copyto(out, follow.reshape(-1)[fi], where=sel < mix.cut_aff)
    return out


@dataclass
class _GroupLimit:
    """A group-limited router's state for the tokens being sampled (DeepSeek-V3's ``n_group``/``topk_group``)."""

    size: int  # experts per router group (num_experts / n_group); expert e is in group e // size
    limit: int  # groups one token may use (topk_group)
    mask_T: np.ndarray  # uint8/16/64 (by n_group), bit g set: the token already chose an expert of group g
    num_T: np.ndarray  # int8 groups the token uses so far

    def take(self, rows: np.ndarray) -> _GroupLimit:
        return _GroupLimit(self.size, self.limit, self.mask_T[rows], self.num_T[rows])

    def put(self, rows: np.ndarray, sub: _GroupLimit) -> None:
        self.mask_T[rows], self.num_T[rows] = sub.mask_T, sub.num_T

    def bits(self, c: np.ndarray) -> np.ndarray:
        """The group bit of every candidate in ``c`` (any shape), in ``mask_T``'s dtype."""
        one = self.mask_T.dtype.type(1)
        return np.left_shift(one, (c // self.size).astype(self.mask_T.dtype))

    def admit(self, c: np.ndarray, new: np.ndarray, bit: np.ndarray | None = None) -> None:
        """Clear ``new`` where candidate ``c`` would open a group past the limit; record the groups of
        the candidates that stay new (``bit``: ``bits(c)`` when already computed)."""
        bit = self.bits(c) if bit is None else bit
        seen = (self.mask_T & bit) != 0
        new &= seen | (self.num_T < self.limit)
        self.num_T += new & ~seen
        self.mask_T |= np.where(new, bit, self.mask_T.dtype.type(0))


def _accept(
    ch_KT: np.ndarray,
    nn_T: np.ndarray,
    candidates: np.ndarray,
    K: int,
    *,
    filled: int,
    groups: _GroupLimit | None = None,
) -> None:
    """Append each token's candidates (``[draws, T]``), in order, that are not yet chosen (and, under a
    group limit, whose group is among the token's first ``limit`` groups), until it holds K.

    ``ch_KT`` the chosen experts (-1 = empty slot), ``nn_T`` how many each token holds; ``filled``:
    an upper bound of ``nn_T`` on entry (slots at or above it are known to be empty).
    """
    bits = groups.bits(candidates) if groups is not None else None
    for i, c in enumerate(candidates):
        new = nn_T < K
        upto = min(filled, K)
        for slot in range(upto):
            new &= ch_KT[slot] != c
        if groups is not None:
            assert bits is not None  # computed whenever groups is set
            groups.admit(c, new, bits[i])
        for slot in range(min(upto + 1, K)):
            np.copyto(ch_KT[slot], c, where=new & (nn_T == slot))
        nn_T += new
        filled += 1


def _group_limit(model: ModelInfo, T: int) -> _GroupLimit | None:
    """The group limit of ``model``'s router for T tokens, or None when it routes without one."""
    if not model.group_limited:
        return None
    n_group, topk_group = model.n_group, model.topk_group
    assert n_group is not None and topk_group is not None  # group_limited implies both are set
    size = model.num_experts // n_group
    if n_group > 64 or topk_group * size < model.top_k:
        raise ConfigError(
            f"model {model.name!r}: n_group={n_group}, topk_group={topk_group} cannot hold "
            f"top_k={model.top_k} experts (or more than 64 groups); fix the model's router fields"
        )
    mask_dtype = np.uint8 if n_group <= 8 else np.uint16 if n_group <= 16 else np.uint64
    return _GroupLimit(size, topk_group, np.zeros(T, mask_dtype), np.zeros(T, np.int8))


def _sample_topk(rng: np.random.Generator, s: _Sampler, mix: _Mix, ch: np.ndarray, *, K: int, E: int) -> None:
    """Fill ``ch`` ``[K, T]`` int16 with K distinct experts per token, sampled without replacement
    (within the token's first ``topk_group`` groups when the model's router is group-limited)."""
    T = ch.shape[1]
    ch.fill(-1)
    nn = np.ones(T, np.int8)
    groups = _group_limit(s.model, T)
    cand = _draw(rng, s, mix, None, K + 2 if K > 1 else 1, K)
    ch[0] = cand[0]
    if groups is not None:
        groups.admit(cand[0], np.ones(T, dtype=bool))
    _accept(ch, nn, cand[1:], K, filled=1, groups=groups)
    rows = np.flatnonzero(nn < K)
    for _round in range(3):
        if rows.size == 0:
            return
        sub_ch, sub_nn = ch[:, rows], nn[rows]
        sub_g = groups.take(rows) if groups is not None else None
        # under a group limit most rows lack one or two experts: smaller rounds waste fewer draws
        _accept(sub_ch, sub_nn, _draw(rng, s, mix, rows, 2 * K if groups is None else K, K), K, filled=K, groups=sub_g)
        ch[:, rows], nn[rows] = sub_ch, sub_nn
        if groups is not None and sub_g is not None:  # sub_g is set exactly when groups is
            groups.put(rows, sub_g)
        rows = rows[sub_nn < K]
    if rows.size:
        _finish_exact(rng, s, mix, rows, ch, nn, K, E, groups=groups.take(rows) if groups is not None else None)


def _finish_exact(
    rng: np.random.Generator,
    s: _Sampler,
    mix: _Mix,
    rows: np.ndarray,
    ch: np.ndarray,
    nn: np.ndarray,
    K: int,
    E: int,
    *,
    groups: _GroupLimit | None = None,
) -> None:
    """Complete the remaining slots of ``rows`` by Gumbel-top-k over the dense mixture minus chosen
    experts (``groups``: the rows' group-limit state; experts of groups past the limit are skipped)."""
    n = rows.size
    w_aff, w_fav, w_tab = mix.w
    q = w_tab * s.p_NE[mix.tab_T[rows] >> s.bits]
    ar = np.arange(n)
    if w_fav > 0:
        fav = mix.fav[mix.fav_T[rows][:, None] + np.arange(mix.num_fav)]
        np.add.at(q, (np.repeat(ar, mix.num_fav), fav.reshape(-1)), w_fav / mix.num_fav)
    if w_aff > 0:
        assert mix.follow_KT is not None  # the follow weight is 0 at layer 0, the one layer without followers
        fol = mix.follow_KT[:, rows].T
        np.add.at(q, (np.repeat(ar, K), fol.reshape(-1)), w_aff / K)
    sub = ch[:, rows]
    for slot in range(K):
        have = sub[slot] >= 0
        q[ar[have], sub[slot][have]] = 0.0
    with np.errstate(divide="ignore"):
        key = np.log(q) - np.log(-np.log(rng.random((n, E))))
    order = np.argsort(-key, axis=1, kind="stable")
    sub_nn = nn[rows].astype(np.int64)
    for j in range(K if groups is None else E):  # chosen experts (key -inf) sort last
        need = sub_nn < K
        if not need.any():
            break
        if groups is not None:  # skip experts of groups past the limit (and chosen ones)
            need &= np.isfinite(key[ar, order[:, j]])
            groups.admit(order[:, j], need)
        sub[sub_nn[need], ar[need]] = order[need, j]
        sub_nn += need
    ch[:, rows] = sub
    nn[rows] = sub_nn


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
            try:
                done = pending.pop(0).result()
            except BrokenProcessPool as exc:
                raise CollectionError(
                    "a synth worker process ended abruptly (killed by a signal: the out-of-memory killer, kill -9)"
                ) from exc
            nxt = next(it, None)
            if nxt is not None:
                pending.append(ex.submit(_worker_chunk, nxt))
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
