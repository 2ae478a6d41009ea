"""Fuzzing `validate` (manifest fields) and `import` (JSONL records): never a traceback.

Hypothesis replaces manifest fields with arbitrary JSON values (huge integers, floats, NaN and
Infinity, strings, lists, objects, null, booleans) and writes arbitrary per-token and SGLang
records; every run must end in a clean exit (0, 1 or 2) with no Python traceback. Where an
import succeeds, the trace it wrote must validate: a clean exit may never hide a broken trace.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from factories import write_small_trace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.tracer.trace.validate import find_problems

runner = CliRunner()
FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)

MANIFEST_FIELDS = [
    ("format",),
    ("version",),
    ("complete",),
    ("model",),
    ("backend",),
    ("collection",),
    ("totals",),
    ("writer",),
    ("model", "top_k"),
    ("model", "num_experts"),
    ("model", "moe_layers"),
    ("model", "num_hidden_layers"),
    ("model", "hidden_size"),
    ("model", "n_group"),
    ("model", "topk_group"),
    ("model", "name"),
    ("totals", "num_requests"),
    ("backend", "name"),
]


def _clean(r, *, codes=(0, 1, 2)) -> None:
    assert "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code in codes, (r.exit_code, r.output)


@pytest.fixture(scope="module")
def valid_trace(tmp_path_factory):
    return write_small_trace(tmp_path_factory.mktemp("fuzz") / "t", num_requests=4)


@FUZZ
@given(field=st.sampled_from(MANIFEST_FIELDS), value=json_values, drop=st.booleans())
def test_validate_never_tracebacks_on_manifest_fields(valid_trace, field, value, drop):
    original = (valid_trace / "manifest.json").read_text()
    m = json.loads(original)
    target = m
    for k in field[:-1]:
        target = target.setdefault(k, {}) if isinstance(target.get(k, {}), dict) else target
    if drop:
        target.pop(field[-1], None)
    else:
        target[field[-1]] = value
    try:
        (valid_trace / "manifest.json").write_text(json.dumps(m))
        for cmd in (["validate", str(valid_trace)], ["info", str(valid_trace)]):
            _clean(runner.invoke(app, cmd))
    finally:
        (valid_trace / "manifest.json").write_text(original)


token_records = st.fixed_dictionaries(
    {
        "request": st.one_of(
            st.integers(-3, 5), st.integers(min_value=-(10**30), max_value=10**30), st.text(max_size=3)
        ),
        "layer": st.one_of(st.integers(-1, 17), json_values),
        "position": st.one_of(st.integers(-1, 6), st.integers(min_value=0, max_value=10**12), json_values),
        "stage": st.one_of(st.sampled_from(["prefill", "decode"]), json_values),
        "experts": st.one_of(st.lists(st.integers(-2, 70), min_size=8, max_size=8), json_values),
    },
    optional={"dataset": json_values},
)
sglang_records = st.fixed_dictionaries(
    {
        "meta_info": st.one_of(
            st.fixed_dictionaries(
                {
                    "prompt_tokens": st.one_of(st.integers(-1, 5), json_values),
                    "completion_tokens": st.one_of(st.integers(-1, 5), json_values),
                    "routed_experts": st.one_of(st.text(max_size=40), json_values),
                },
                optional={"routed_experts_start_len": json_values},
            ),
            json_values,
        )
    },
    optional={"request_id": json_values, "dataset": json_values},
)


@FUZZ
@given(
    records=st.one_of(
        st.lists(token_records, min_size=1, max_size=6), st.lists(sglang_records, min_size=1, max_size=3)
    ),
    garbage=st.one_of(st.none(), st.binary(max_size=30)),
)
def test_import_never_tracebacks(records, garbage):
    d = Path(tempfile.mkdtemp(prefix="moetrace-fuzz-"))
    try:
        src = d / "in.jsonl"
        text = "".join(json.dumps(r) + "\n" for r in records).encode()
        src.write_bytes(text + (garbage or b""))
        r = runner.invoke(app, ["import", str(src), "--model", "olmoe-1b-7b-tiny", "-o", str(d / "out")])
        _clean(r, codes=(0, 2))
        if r.exit_code == 0:
            assert find_problems(d / "out") == [], "an import that succeeded wrote an invalid trace"
        else:
            assert not (d / "out" / "manifest.json").exists(), "a failed import left a trace behind"
    finally:
        shutil.rmtree(d, ignore_errors=True)
