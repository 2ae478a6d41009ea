"""`compare --route-on first-decode:N` (issue #23): on a decode-only capture, grouped strategies and the
bounds run with routers that see each request's first N generated tokens, and every output says it is
a what-if that no engine can deploy."""

from __future__ import annotations

import json

import numpy as np
import pytest
from factories import PARTIAL_L as L
from factories import partial_trace
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.errors import ConfigError
from moetrace.placement.compare import load_trace_data, parse_route_on, with_held_out_tokens
from moetrace.tracer.trace.reader import open_trace

runner = CliRunner()
PROMPT, OUTPUT, N = 6, 10, 3


@pytest.fixture(scope="module")
def decode_only(tmp_path_factory):
    return partial_trace(
        tmp_path_factory.mktemp("route_on") / "t",
        recorded_layers=tuple(range(L)),
        requests_per_dataset=30,
        prompt_tokens=PROMPT,
        output_tokens=OUTPUT,
        decode_only=True,
    )


def test_parse_route_on():
    assert parse_route_on("prefill") == 0 and parse_route_on("first-decode:8") == 8
    for bad in ("first-decode:0", "first-decode:x", "decode:4", "first-decode:99999999"):
        with pytest.raises(ConfigError, match="--route-on"):
            parse_route_on(bad)


def test_router_counts_are_the_first_generated_tokens_and_the_rest_is_simulated(decode_only):
    data = with_held_out_tokens(load_trace_data(decode_only, test_fraction=0.25, seed=0, route_first_decode=N))
    tr = open_trace(decode_only)
    ta = tr.token_arrays()
    E = tr.model.num_experts
    prompt_R = tr.request_arrays.prompt_tokens_R
    first = np.zeros((len(prompt_R), L, E), dtype=np.int64)
    later = np.zeros_like(first)
    rel = ta.position_T - prompt_R[ta.row_T]
    for t in np.flatnonzero(ta.is_decode_T):
        target = first if rel[t] < N else later
        for l in range(L):
            for e in ta.topk_ids_TLK[t, l]:
                if e >= 0:
                    target[ta.row_T[t], l, e] += 1
    np.testing.assert_array_equal(data.prefill_RLE, first)  # what the routers see
    np.testing.assert_array_equal(data.decode_RLE, later)  # what is placed
    test = data.is_test_R
    assert len(data.test_req_T) == int(test.sum()) * (OUTPUT - N)  # only the later tokens are simulated


def test_compare_on_decode_only_refuses_grouped_without_route_on(decode_only, tmp_path):
    r = runner.invoke(app, ["compare", str(decode_only), "-c", "DP2TP1EP2", "--gpus-per-node", "1",
                            "--strategies", "linear,joint", "--batches", "20", "-q"])  # fmt: skip
    assert r.exit_code != 0 and "--route-on first-decode:N" in r.output and "Traceback" not in r.output


def test_compare_route_on_runs_grouped_and_bounds_and_says_what_if(decode_only, tmp_path):
    out = tmp_path / "res"
    r = runner.invoke(
        app,
        ["compare", str(decode_only), "-c", "DP2TP1EP2", "--gpus-per-node", "1", "--strategies", "linear,joint",
         "--batches", "20", "--route-on", f"first-decode:{N}", "-q", "-o", str(out)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.output.count("what-if: routes on generated tokens, not deployable") == 2  # header and caution
    assert "perfect_routing" in r.output and "oracle" in r.output  # the bounds ran
    manifest = json.loads((out / "compare.json").read_text())
    assert manifest["route_first_decode"] == N and "skipped" not in manifest


def test_compare_on_forward_passes_says_they_are_not_requests(tmp_path):
    from factories import sample_topk, tiny_model, write_trace

    rng = np.random.default_rng(0)
    R, n = 40, 12
    p_TLE = np.ones((R * n, L, 8))
    ids = sample_topk(rng, p_TLE, 2)
    t = write_trace(
        tmp_path / "t",
        model=tiny_model(num_layers=L, num_experts=8, top_k=2),
        dataset_R=["passes"] * R,
        prompt_tokens_R=np.full(R, 6),
        output_tokens_R=np.full(R, 6),
        topk_ids_TLK=ids,
        collection={"stages": ["prefill", "decode"], "request_unit": "forward pass"},
    )
    out = tmp_path / "res"
    r = runner.invoke(app, ["compare", str(t), "-c", "DP2TP1EP2", "--gpus-per-node", "1", "--strategies",
                            "linear,joint", "--batches", "10", "-q", "-o", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "the trace's requests are forward passes" in r.output and "joint cluster and route them" in r.output
    assert json.loads((out / "compare.json").read_text())["request_unit"] == "forward pass"
