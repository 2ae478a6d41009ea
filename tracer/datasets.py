"""Prompt sources for ``collect``: bundled prompt sets, the core paper's hub datasets, local files.

A *source* is one of

- a bundled set (``math-word``, ``math-competition``, ``code``, ``chat``, ``summarize``; ``bundled``
  means all five), shipped in ``data/prompts/*.jsonl``;
- a hub dataset name (``gsm8k``, ``math``, ``mbpp``, ``humaneval``, ``lmsys-chat``, ``xsum``,
  ``tldr``), loaded through the ``datasets`` library with that dataset's hub id, config, split,
  prompt field and wrapping (:data:`HUB`);
- a local ``.jsonl``/``.json``/``.parquet`` file. ``NAME=PATH`` (or a file whose stem is a hub
  dataset name, e.g. ``xsum.parquet``) reads a local copy of hub dataset ``NAME`` with exactly the
  hub path's field extraction and wrapping; any other file takes its prompt from ``prompt_field``
  or the one known prompt-like column it has.

Every source becomes a list of prompt texts through the same extraction code
(:func:`extract_prompts`), so the hub path and local copies behave identically.

Sampling. Each source is shuffled by a generator seeded with ``(seed, crc32(source label))``, so a
source's sample does not depend on which other sources are listed. Sources are then interleaved
round robin (one prompt of each in turn), and request ids are 0..N-1 in that order: the first
requests of a run, or of a partial run, cover every dataset.

Out of scope: tokenizing for a particular backend beyond :func:`render_prompt_ids`, running the
model (``backends``), writing traces (``trace.writer``).
"""

from __future__ import annotations

import json
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from moetrace.errors import DatasetError

T = TypeVar("T")

BUNDLED = ("math-word", "math-competition", "code", "chat", "summarize")
BUNDLED_ALIAS = "bundled"
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")

#: column names tried, in this order, when a local file's prompt field is not given
KNOWN_PROMPT_FIELDS = (
    "prompt",
    "question",
    "problem",
    "text",
    "instruction",
    "input",
    "document",
    "conversation",
    "messages",
)


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    """One request to collect."""

    request_id: int  # stable id in the run: index in the deterministic sample (0..N-1)
    dataset: str  # name the user gave (bundled set name, hub dataset name, or file stem)
    text: str  # the prompt text (the user turn)


# ---------------------------------------------------------------------------- field extraction


def first_user_turn(conversation: object) -> str | None:
    """Content of the first ``role == "user"`` message of a list of ``{role, content}`` dicts."""
    if not isinstance(conversation, (list, tuple)):
        return None
    for msg in conversation:
        if isinstance(msg, dict) and msg.get("role") in ("user", "human") and isinstance(msg.get("content"), str):
            return msg["content"]
    return None


def _as_text(value: object) -> str | None:
    """A prompt-field value as text: strings as they are, conversations as their first user turn."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return first_user_turn(value)
    return None


def _xsum(row: dict[str, Any]) -> str | None:
    doc = row.get("document")
    if not isinstance(doc, str) or not doc.strip():
        return None
    return f"Summarize the following article in one sentence.\n\n{doc.strip()}"


def _mbpp(row: dict[str, Any]) -> str | None:
    text = row.get("text")
    if not isinstance(text, str) or not text.strip():
        return None
    tests = row.get("test_list")
    if isinstance(tests, (list, tuple)) and tests:  # MBPP's usual prompt: the task plus its tests
        return text.strip() + "\nYour code should pass these tests:\n\n" + "\n".join(str(t) for t in tests)
    return text.strip()


def _field(name: str) -> Callable[[dict[str, Any]], str | None]:
    def get(row: dict[str, Any]) -> str | None:
        return _as_text(row.get(name))

    return get


@dataclass(frozen=True, kw_only=True)
class HubDataset:
    """Where a core-paper dataset lives on the Hugging Face hub and how a row becomes a prompt."""

    name: str  # the name users pass to --dataset
    hub_id: str  # hub repository
    config: str | None  # hub config (subset), None for the default
    split: str  # split sampled from
    field: str  # the column the prompt comes from (for error messages and docs)
    to_prompt: Callable[[dict[str, Any]], str | None]  # row -> prompt text (None: unusable row)
    row_filter: Callable[[dict[str, Any]], bool] | None = None  # rows kept (None: all)
    note: str = ""  # one line for the docs: wrapping, gating


def _english(row: dict[str, Any]) -> bool:
    return row.get("language", "English") == "English"


HUB: dict[str, HubDataset] = {
    d.name: d
    for d in (
        HubDataset(
            name="gsm8k",
            hub_id="openai/gsm8k",
            config="main",
            split="test",
            field="question",
            to_prompt=_field("question"),
            note="grade-school math word problems",
        ),
        HubDataset(
            name="math",
            hub_id="HuggingFaceH4/MATH-500",
            config=None,
            split="test",
            field="problem",
            to_prompt=_field("problem"),
            note="500-problem subset of MATH (competition math)",
        ),
        HubDataset(
            name="mbpp",
            hub_id="google-research-datasets/mbpp",
            config="full",
            split="test",
            field="text",
            to_prompt=_mbpp,
            note="task text followed by its assert tests",
        ),
        HubDataset(
            name="humaneval",
            hub_id="openai/openai_humaneval",
            config=None,
            split="test",
            field="prompt",
            to_prompt=_field("prompt"),
            note="function signature and docstring",
        ),
        HubDataset(
            name="lmsys-chat",
            hub_id="lmsys/lmsys-chat-1m",
            config=None,
            split="train",
            field="conversation",
            to_prompt=_field("conversation"),
            row_filter=_english,
            note="gated: accept the terms on the hub and log in; first user turn of English conversations",
        ),
        HubDataset(
            name="xsum",
            hub_id="EdinburghNLP/xsum",
            config=None,
            split="test",
            field="document",
            to_prompt=_xsum,
            note="article wrapped in a one-sentence summarization instruction",
        ),
        HubDataset(
            name="tldr",
            hub_id="trl-lib/tldr",
            config=None,
            split="test",
            field="prompt",
            to_prompt=_field("prompt"),
            note="Reddit post ending in 'TL;DR:'",
        ),
    )
}


def extract_prompts(
    rows: Iterable[dict[str, Any]], *, spec: HubDataset | None, field: str | None, where: str
) -> list[str]:
    """Prompt texts of ``rows`` (dicts), in row order.

    With ``spec`` the hub dataset's filter and ``to_prompt`` apply; else the column ``field``
    (strings, or a conversation's first user turn). Rows without a usable prompt (empty, missing)
    are dropped; an error names the field when no row has one.
    """
    rows = list(rows)
    if spec is not None:
        kept = [r for r in rows if spec.row_filter is None or spec.row_filter(r)]
        texts = [spec.to_prompt(r) for r in kept]
        label = spec.field
    else:
        assert field is not None
        texts = [_as_text(r.get(field)) for r in rows]
        label = field
    out = [t for t in texts if t is not None and t.strip()]
    if rows and not out:
        raise DatasetError(
            f"{where}: field {label!r} is empty or not text in all {len(rows)} rows "
            "(expected a string, or a list of {role, content} messages)"
        )
    if not rows:
        raise DatasetError(f"{where}: no rows")
    return out


# ---------------------------------------------------------------------------- reading sources


def read_rows(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows (dicts) and column names of a local ``.jsonl``, ``.json`` (array or lines) or ``.parquet`` file."""
    if not path.exists():
        raise DatasetError(f"{path}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            return table.to_pylist(), list(table.column_names)
        text = path.read_text(encoding="utf-8")
        if suffix == ".json" and text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise DatasetError(f"{path}: cannot be read as {suffix[1:]} ({exc})") from exc
    except Exception as exc:  # pyarrow errors on a corrupt parquet file
        raise DatasetError(f"{path}: cannot be read as parquet ({exc})") from exc
    if not all(isinstance(r, dict) for r in rows):
        raise DatasetError(f"{path}: every record must be a JSON object with a prompt field")
    columns: dict[str, None] = {}
    for r in rows:
        columns.update(dict.fromkeys(r))
    return rows, list(columns)


def choose_field(columns: Sequence[str], *, prompt_field: str | None, where: str) -> str:
    """The prompt column of a local file: ``prompt_field``, or the one known prompt-like column."""
    if prompt_field is not None:
        if prompt_field not in columns:
            raise DatasetError(f"{where}: no field {prompt_field!r}; its fields are {list(columns)}")
        return prompt_field
    found = [f for f in KNOWN_PROMPT_FIELDS if f in columns]
    if len(found) == 1:
        return found[0]
    if not found:
        raise DatasetError(
            f"{where}: no prompt field found among its fields {list(columns)}; name it with --prompt-field"
        )
    raise DatasetError(
        f"{where}: several fields could hold the prompt ({found}); choose one with --prompt-field "
        f"(its fields are {list(columns)})"
    )


def _hub_rows(spec: HubDataset) -> list[dict[str, Any]]:
    from moetrace._deps import require

    ds_lib = require("datasets", purpose=f"loading {spec.name!r} from the Hugging Face hub")
    try:
        ds = ds_lib.load_dataset(spec.hub_id, spec.config, split=spec.split)
    except (ConnectionError, OSError) as exc:
        raise DatasetError(
            f"cannot load {spec.name!r} ({spec.hub_id}) from the Hugging Face hub: {exc}. "
            f"If this machine cannot reach the hub, download the dataset elsewhere and pass the file: "
            f"--dataset {spec.name}=path/to/{spec.name}.jsonl (reads it exactly like the hub copy), or "
            f"--dataset path/to/{spec.name}.jsonl --prompt-field {spec.field}"
        ) from exc
    except Exception as exc:  # gated repos, missing configs: datasets raises its own classes
        gated = "gated" in str(exc).lower() or "authenticat" in str(exc).lower()
        hint = (
            " The dataset is gated: accept its terms on huggingface.co and log in (`hf auth login`)." if gated else ""
        )
        raise DatasetError(f"cannot load {spec.name!r} ({spec.hub_id}): {exc}.{hint}") from exc
    return list(ds)


def _bundled_texts(name: str) -> list[str]:
    f = resources.files("moetrace.data") / "prompts" / f"{name}.jsonl"  # one part per joinpath on 3.10
    rows = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    return extract_prompts(rows, spec=None, field="prompt", where=f"bundled set {name!r}")


def _expand(sources: Sequence[str]) -> list[str]:
    out: list[str] = []
    for s in sources:
        out.extend(BUNDLED if s == BUNDLED_ALIAS else [s])
    return out


def _valid_names() -> str:
    return ", ".join([*BUNDLED, BUNDLED_ALIAS, *HUB])


def resolve_source(source: str, *, prompt_field: str | None) -> tuple[str, list[str]]:
    """``(label, prompt texts)`` of one source, in the source's own order."""
    if source in BUNDLED:
        return source, _bundled_texts(source)
    if source in HUB:
        return source, extract_prompts(
            _hub_rows(HUB[source]), spec=HUB[source], field=None, where=f"{source} ({HUB[source].hub_id})"
        )
    name: str | None
    name, sep, path_str = source.partition("=")
    if sep:
        if name not in HUB:
            raise DatasetError(f"{source!r}: {name!r} is not a hub dataset name ({', '.join(HUB)})")
        path = Path(path_str)
    else:
        path, name = Path(source), None
        if path.suffix.lower() not in LOCAL_SUFFIXES:
            raise DatasetError(
                f"unknown dataset {source!r}: valid names are {_valid_names()}, or a local "
                f"{'/'.join(LOCAL_SUFFIXES)} file"
            )
        if path.stem in HUB:
            name = path.stem
    if path.suffix.lower() not in LOCAL_SUFFIXES:
        raise DatasetError(f"{path}: a local dataset must be a {'/'.join(LOCAL_SUFFIXES)} file")
    rows, columns = read_rows(path)
    if not rows:
        raise DatasetError(f"{path}: no records (the file is empty); give a file with one prompt per record")
    if name is not None and prompt_field is None:
        spec = HUB[name]
        if spec.field not in columns:
            raise DatasetError(f"{path}: a local copy of {name!r} needs field {spec.field!r}; its fields are {columns}")
        return name, extract_prompts(rows, spec=spec, field=None, where=str(path))
    field = choose_field(columns, prompt_field=prompt_field, where=str(path))
    return path.stem, extract_prompts(rows, spec=None, field=field, where=str(path))


# ---------------------------------------------------------------------------- sampling


def sample_order(num_items: int, *, label: str, seed: int) -> np.ndarray:
    """A permutation of ``range(num_items)`` that depends only on ``(seed, label)``."""
    rng = np.random.default_rng([seed, zlib.crc32(label.encode())])
    return rng.permutation(num_items)


def interleave(groups: Sequence[Sequence[T]]) -> list[T]:
    """Round robin over groups: first item of each, then second of each, ... (exhausted groups drop out)."""
    out: list[T] = []
    for i in range(max((len(g) for g in groups), default=0)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def load_prompts(
    sources: Sequence[str],
    *,
    per_dataset: int | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    prompt_field: str | None = None,
) -> list[PromptRecord]:
    """Deterministic sample of prompts from ``sources``, datasets interleaved, ids 0..N-1.

    ``per_dataset``: N prompts from each source; ``num_requests``: N in total, split evenly (a
    source with too few prompts gives what it has and the rest is spread over the others); neither:
    every prompt of every source. A source smaller than its share gives all it has, with a warning.
    ``prompt_field`` applies to local files.
    """
    if per_dataset is not None and num_requests is not None:
        raise DatasetError("give either per_dataset (--per-dataset) or num_requests (--num-requests), not both")
    for arg, v in (("per_dataset", per_dataset), ("num_requests", num_requests)):
        if v is not None and v < 1:
            raise DatasetError(f"{arg} (--{arg.replace('_', '-')}) must be at least 1, got {v}")
    names = _expand(sources)
    if not names:
        raise DatasetError(f"no dataset given; valid names are {_valid_names()}, or a local file")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DatasetError(f"dataset(s) listed twice: {dup}")

    loaded = [resolve_source(s, prompt_field=prompt_field) for s in names]
    labels = [lab for lab, _ in loaded]
    if len(set(labels)) != len(labels):
        raise DatasetError(f"two sources have the same name {labels}; rename a file so every dataset has its own name")
    sizes = [len(texts) for _, texts in loaded]
    if per_dataset is not None:
        want = [per_dataset] * len(loaded)
    elif num_requests is not None:
        want = _fill(sizes, num_requests)
    else:
        want = sizes
    short = [f"{lab} has {n}" for lab, n, w in zip(labels, sizes, want) if n < w]
    if short:
        warnings.warn(f"fewer prompts than asked: {', '.join(short)}; taking all of those", stacklevel=2)
    if num_requests is not None and sum(want) < num_requests:
        warnings.warn(f"only {sum(want)} prompts in {labels}, fewer than the {num_requests} asked", stacklevel=2)

    groups = []
    for (label, texts), w in zip(loaded, want):
        order = sample_order(len(texts), label=label, seed=seed)[: min(w, len(texts))]
        groups.append([(label, texts[i]) for i in order])
    return [PromptRecord(request_id=i, dataset=lab, text=t) for i, (lab, t) in enumerate(interleave(groups))]


def _fill(sizes: Sequence[int], total: int) -> list[int]:
    """Even split of ``total`` over sources, capped by their sizes; what a small source cannot give
    is spread over the others (water filling: every source gets ``min(size, h)`` for the largest
    level ``h`` that fits, the remainder goes one each to the earliest sources above ``h``)."""
    lo, hi = 0, max(sizes, default=0)
    while lo < hi:  # largest h with sum(min(size, h)) <= total
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in sizes) <= total:
            lo = mid
        else:
            hi = mid - 1
    want = [min(n, lo) for n in sizes]
    remaining = total - sum(want)
    for i, n in enumerate(sizes):
        if remaining > 0 and n > lo:
            want[i] += 1
            remaining -= 1
    return want


# ---------------------------------------------------------------------------- tokenizing


def render_prompt_ids(record: PromptRecord, tokenizer: Any, *, chat_template: bool = True) -> list[int]:
    """Token ids of a prompt: the tokenizer's chat template (one user turn, generation prompt
    appended) when it has one and ``chat_template`` is true, else plain encoding with the
    tokenizer's special tokens."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": record.text}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(record.text)["input_ids"] if callable(tokenizer) else tokenizer.encode(record.text)
    ids = [int(i) for i in ids]
    if not ids:
        raise DatasetError(f"request {record.request_id} ({record.dataset}): the prompt encodes to no tokens")
    return ids
