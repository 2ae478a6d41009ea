"""Prompt loading: bundled sets, the hub datasets' real field layouts (as local files), sampling."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moetrace.errors import DatasetError
from moetrace.tracer import datasets as D
from moetrace.tracer.datasets import BUNDLED, HUB, PromptRecord, load_prompts, render_prompt_ids


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- rows in each hub dataset's real layout (field names and nesting as on the hub) -------------
GSM8K = [
    {
        "question": f"Q{i}: Ann has {i} apples and buys 3 more. How many now?",
        "answer": f"{i} + 3 = {i + 3}\n#### {i + 3}",
    }
    for i in range(6)
]
MATH = [
    {
        "problem": f"Compute {i}^2.",
        "solution": f"${i * i}$",
        "answer": str(i * i),
        "subject": "Algebra",
        "level": 1,
        "unique_id": f"test/algebra/{i}.json",
    }
    for i in range(5)
]
MBPP = [
    {
        "task_id": 11 + i,
        "text": f"Write a function to add {i}.",
        "code": f"def f(x): return x + {i}",
        "test_list": [f"assert f(1) == {1 + i}", f"assert f(2) == {2 + i}"],
        "test_setup_code": "",
        "challenge_test_list": [],
    }
    for i in range(4)
]
HUMANEVAL = [
    {
        "task_id": f"HumanEval/{i}",
        "prompt": f'def f{i}(x):\n    """Return x times {i}."""\n',
        "canonical_solution": f"    return x * {i}\n",
        "test": "def check(c): pass",
        "entry_point": f"f{i}",
    }
    for i in range(4)
]
LMSYS = [
    {
        "conversation_id": "a1",
        "model": "vicuna-13b",
        "turn": 2,
        "language": "English",
        "redacted": False,
        "openai_moderation": [],
        "conversation": [
            {"content": "How do tides work?", "role": "user"},
            {"content": "The moon...", "role": "assistant"},
            {"content": "And spring tides?", "role": "user"},
        ],
    },
    {
        "conversation_id": "a2",
        "model": "koala-13b",
        "turn": 1,
        "language": "German",
        "redacted": False,
        "openai_moderation": [],
        "conversation": [{"content": "Wie spät ist es?", "role": "user"}, {"content": "...", "role": "assistant"}],
    },
    {
        "conversation_id": "a3",
        "model": "alpaca-13b",
        "turn": 1,
        "language": "English",
        "redacted": False,
        "openai_moderation": [],
        "conversation": [
            {"content": "Write a haiku about rain.", "role": "user"},
            {"content": "...", "role": "assistant"},
        ],
    },
]
XSUM = [
    {"document": f"Article {i}. Something happened in town {i}.", "summary": f"Town {i} news.", "id": str(3000 + i)}
    for i in range(5)
]
TLDR = [
    {"prompt": f"SUBREDDIT: r/advice\nTITLE: t{i}\nPOST: my story {i}\nTL;DR:", "completion": f" short {i}"}
    for i in range(5)
]


def test_bundled_sets_are_five_domains_of_30_to_40_prompts():
    records = load_prompts(["bundled"])
    per = Counter(r.dataset for r in records)
    assert set(per) == set(BUNDLED)
    assert all(30 <= n <= 40 for n in per.values()), per
    assert len({r.text for r in records}) == len(records), "a prompt appears twice"
    assert [r.request_id for r in records] == list(range(len(records)))
    summ = [r.text for r in records if r.dataset == "summarize"]
    assert all("summar" in t.lower() or "main point" in t.lower() for t in summ)


def test_sampling_is_deterministic_and_per_source_independent():
    a = load_prompts(["math-word", "code"], per_dataset=5, seed=3)
    assert a == load_prompts(["math-word", "code"], per_dataset=5, seed=3)
    assert a != load_prompts(["math-word", "code"], per_dataset=5, seed=4)
    # a source's sample does not change when other sources are added
    alone = [r.text for r in load_prompts(["code"], per_dataset=5, seed=3)]
    mixed = [r.text for r in load_prompts(["chat", "code", "math-word"], per_dataset=5, seed=3) if r.dataset == "code"]
    assert alone == mixed


def test_datasets_interleave_so_a_prefix_covers_all():
    recs = load_prompts(["chat", "code", "summarize"], per_dataset=4, seed=0)
    assert [r.dataset for r in recs[:6]] == ["chat", "code", "summarize"] * 2
    assert Counter(r.dataset for r in recs) == {"chat": 4, "code": 4, "summarize": 4}


def test_num_requests_split_evenly_and_small_source_leftover_spread(tmp_path):
    recs = load_prompts(["bundled"], num_requests=13, seed=0)
    assert sorted(Counter(r.dataset for r in recs).values()) == [2, 2, 3, 3, 3]
    small = write_jsonl(tmp_path / "tiny.jsonl", [{"prompt": "one"}, {"prompt": "two"}])
    recs = load_prompts(["chat", str(small)], num_requests=10, seed=0)
    assert Counter(r.dataset for r in recs) == {"tiny": 2, "chat": 8}
    # the two tiny prompts still come early: interleaving starts with both datasets
    assert {r.dataset for r in recs[:2]} == {"chat", "tiny"}


def test_per_dataset_beyond_a_small_source_warns_and_takes_all(tmp_path):
    small = write_jsonl(tmp_path / "tiny.jsonl", [{"prompt": "one"}, {"prompt": "two"}])
    with pytest.warns(UserWarning, match="tiny has 2"):
        recs = load_prompts([str(small), "chat"], per_dataset=5)
    assert Counter(r.dataset for r in recs) == {"tiny": 2, "chat": 5}


@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=6), total=st.integers(1, 200))
def test_fill_invariants(sizes, total):
    want = D._fill(sizes, total)
    assert sum(want) == min(total, sum(sizes))
    assert all(0 <= w <= n for w, n in zip(want, sizes))
    uncapped = [w for w, n in zip(want, sizes) if w < n]
    if uncapped:  # sources that could give more are within one of the largest share
        assert max(want) - min(uncapped) <= 1


@given(groups=st.lists(st.lists(st.integers(), max_size=5), max_size=5))
def test_interleave_keeps_every_item_and_each_group_order(groups):
    tagged = [[(g, x) for x in grp] for g, grp in enumerate(groups)]
    out = D.interleave(tagged)
    assert sorted(out) == sorted(x for grp in tagged for x in grp)
    for g, grp in enumerate(tagged):
        assert [x for x in out if x[0] == g] == grp


# ---- hub layouts read from local copies: the same extraction code as the hub path -------------
@pytest.mark.parametrize(
    "name, rows, expected_first",
    [
        ("gsm8k", GSM8K, GSM8K[0]["question"]),
        ("math", MATH, "Compute 0^2."),
        (
            "mbpp",
            MBPP,
            "Write a function to add 0.\nYour code should pass these tests:\n\nassert f(1) == 1\nassert f(2) == 2",
        ),
        ("humaneval", HUMANEVAL, HUMANEVAL[0]["prompt"]),
        ("lmsys-chat", LMSYS, "How do tides work?"),
        ("xsum", XSUM, "Summarize the following article in one sentence.\n\nArticle 0. Something happened in town 0."),
        ("tldr", TLDR, TLDR[0]["prompt"]),
    ],
)
def test_local_copy_of_hub_dataset_uses_its_field_and_wrapping(tmp_path, name, rows, expected_first):
    path = write_jsonl(tmp_path / "copy.jsonl", rows)
    label, texts = D.resolve_source(f"{name}={path}", prompt_field=None)
    assert label == name
    assert texts[0] == expected_first
    # the hub extraction on the same rows (what the hub path runs) gives the same prompts
    assert texts == D.extract_prompts(rows, spec=HUB[name], field=None, where="hub")


def test_lmsys_keeps_english_first_user_turns_and_parquet_nesting(tmp_path):
    path = tmp_path / "lmsys-chat.parquet"
    pq.write_table(pa.Table.from_pylist(LMSYS), path)
    recs = load_prompts([str(path)])
    assert {r.text for r in recs} == {"How do tides work?", "Write a haiku about rain."}
    assert {r.dataset for r in recs} == {"lmsys-chat"}


def test_stem_named_like_a_hub_dataset_reads_as_that_dataset(tmp_path):
    path = write_jsonl(tmp_path / "xsum.jsonl", XSUM)
    recs = load_prompts([str(path)], per_dataset=2)
    assert all(r.dataset == "xsum" and r.text.startswith("Summarize the following article") for r in recs)


def test_prompt_field_overrides_on_local_file(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    recs = load_prompts([str(path)], prompt_field="answer")
    assert all("####" in r.text for r in recs)


def test_generic_file_json_array_auto_field(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps([{"id": 1, "question": "a?"}, {"id": 2, "question": "b?"}]))
    recs = load_prompts([str(path)], seed=0)
    assert sorted(r.text for r in recs) == ["a?", "b?"] and {r.dataset for r in recs} == {"mine"}


def test_generic_file_errors_name_the_problem(tmp_path):
    amb = write_jsonl(tmp_path / "amb.jsonl", [{"prompt": "x", "question": "y"}])
    with pytest.raises(DatasetError, match=r"several fields.*--prompt-field"):
        load_prompts([str(amb)])
    none = write_jsonl(tmp_path / "none.jsonl", [{"foo": "x", "bar": "y"}])
    with pytest.raises(DatasetError, match=r"no prompt field.*\['foo', 'bar'\]"):
        load_prompts([str(none)])
    with pytest.raises(DatasetError, match=r"no field 'body'.*\['foo', 'bar'\]"):
        load_prompts([str(none)], prompt_field="body")
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": ""}, {"prompt": None}])
    with pytest.raises(DatasetError, match=r"field 'prompt' is empty"):
        load_prompts([str(empty)])
    bad_copy = write_jsonl(tmp_path / "c.jsonl", [{"text": "x"}])
    with pytest.raises(DatasetError, match=r"local copy of 'gsm8k' needs field 'question'"):
        load_prompts([f"gsm8k={bad_copy}"])
    with pytest.raises(DatasetError, match="no such file"):
        load_prompts([str(tmp_path / "missing.jsonl")])
    (tmp_path / "zero.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match=r"zero.jsonl: no records \(the file is empty\)"):
        load_prompts([str(tmp_path / "zero.jsonl")])


def test_unknown_name_lists_valid_names():
    with pytest.raises(DatasetError, match=r"unknown dataset 'gsm9k'.*math-word.*bundled.*gsm8k.*tldr"):
        load_prompts(["gsm9k"])
    with pytest.raises(DatasetError, match="listed twice"):
        load_prompts(["code", "bundled"])
    with pytest.raises(DatasetError, match="not both"):
        load_prompts(["code"], per_dataset=1, num_requests=2)


def test_hub_unreachable_says_so_and_shows_the_local_file_way(monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetError) as exc:
        load_prompts(["gsm8k"], per_dataset=2)
    msg = str(exc.value)
    assert "openai/gsm8k" in msg and "hub" in msg
    assert "--dataset path/to/gsm8k.jsonl --prompt-field question" in msg


def test_hub_path_goes_through_datasets_with_the_right_id_config_split(tmp_path, monkeypatch):
    """The hub path with the real ``datasets`` library, the download swapped for a local json file."""
    import datasets

    path = write_jsonl(tmp_path / "x.jsonl", XSUM)
    real = datasets.load_dataset
    calls = []

    def from_local(hub_id, config=None, *, split):
        calls.append((hub_id, config, split))
        return real("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "cache"))

    monkeypatch.setattr(datasets, "load_dataset", from_local)
    recs = load_prompts(["xsum"], per_dataset=3, seed=1)
    assert calls == [("EdinburghNLP/xsum", None, "test")]
    assert len(recs) == 3 and all(r.text.startswith("Summarize the following article") for r in recs)


# ---- tokenizing ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tok():
    from moetrace.tracer.backends.hf import tiny_tokenizer

    return tiny_tokenizer()


def test_render_plain_encoding_without_chat_template(tiny_tok):
    rec = PromptRecord(request_id=0, dataset="chat", text="hello there")
    assert not getattr(tiny_tok, "chat_template", None)
    assert render_prompt_ids(rec, tiny_tok) == tiny_tok("hello there")["input_ids"]


def test_render_applies_chat_template_when_present_and_asked(tiny_tok):
    import copy

    tok = copy.deepcopy(tiny_tok)
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    rec = PromptRecord(request_id=0, dataset="chat", text="hi")
    ids = render_prompt_ids(rec, tok)
    assert tok.decode(ids) == "<|user|>hi\n<|assistant|>"
    assert render_prompt_ids(rec, tok, chat_template=False) == tok("hi")["input_ids"]
