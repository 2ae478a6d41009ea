"""What ``moetrace synth`` generates, fixed before any random draw: the generative model's knobs
(``SynthKnobs``, with the per-dataset ``LengthDist``), the run (``SynthPlan``, and the manifest's
``collection`` section it writes), the dataset of every request id (``parse_mix`` reads ``--mix``,
``dataset_assignment`` assigns: round robin, or Tijdeman's chairman assignment under a mix) and the
calibration presets (``data/synth/<name>.json``: ``list_calibrations``, ``default_calibration``,
``load_calibration``). How each knob enters the model: :mod:`moetrace.tracer.synth`'s docstring.

Shape legend: R requests, D datasets (legend: docs/architecture.md).

Out of scope: every random draw, the planted truth and the chunks (``synth_sample``); worker processes and
writing the trace (``synth``); measuring the statistics (``synth_stats``).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

import numpy as np

from moetrace.errors import ConfigError
from moetrace.tracer.trace.schema import ModelInfo

__all__ = [
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
]

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
#: ``planted``: the knobs' structure; ``none``: the control (see :func:`~moetrace.tracer.synth_sample.plant_truth`)
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
    """The generative model's knobs (see :mod:`moetrace.tracer.synth`'s docstring for how each enters)."""

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
