"""The prefill–decode proxy (moetrace.serving.proxy) against stand-in engine servers on loopback.

The stand-ins (moetrace/serving/standin.py) are real HTTP servers speaking vLLM 0.33's and SGLang
0.5.23's OpenAI-compatible formats (the fields moetrace/serving/engines.py cites) and replaying the
routed experts of a set of requests; the proxy's decode ranks are checked against the library
router's and the placement's own offline routing for the same arrivals, then ranks are killed
mid-stream and prefills send malformed replies. Each test runs its servers and client on one event
loop; the whole file takes a few seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from factories import TINY_MOE as MODEL
from typer.testing import CliRunner

from moetrace.cli import app
from moetrace.placement.deployment import parse_deployment
from moetrace.placement.exports import PlacementFile, load_placement, save_placement
from moetrace.placement.maps import placement_from_phy2log
from moetrace.placement.routers import PriceRouter
from moetrace.serving import ExpertRouter
from moetrace.serving.engines import SglangWire, VllmWire, moe_layers_of
from moetrace.serving.http11 import Upstream
from moetrace.serving.proxy import Proxy, ProxyConfig
from moetrace.serving.standin import StandinEngine

L, E, K = 3, 16, 2


def make_placement(path: Path, *, cap: float | None) -> Path:
    """DP8TP1EP8 on nodes of 2 GPUs: 4 nodes, 8 DP ranks; node g holds 4 experts per layer."""
    dep = parse_deployment("DP8TP1EP8", num_gpus_per_node=2)
    rng = np.random.default_rng(0)
    phy2log = np.stack([rng.permutation(E) for _ in range(L)])
    router = PriceRouter(num_groups=4, node_prices_G=(0.0, 0.01, -0.01, 0.02), max_node_load=cap)
    pf = PlacementFile(
        model=MODEL,
        deployment=dep,
        strategy="joint",
        placement=placement_from_phy2log(phy2log, num_experts=E),
        router=router,
        source={"trace": "synthetic (tests/test_proxy.py)", "seed": 0, "test_fraction": 0.5},
    )
    save_placement(pf, path)
    return path


def requests(pf: PlacementFile, n: int, seed: int = 1) -> dict[str, np.ndarray]:
    """``n`` prompts' routed experts [T, L, K], each drawn mostly from one node's experts."""
    rng = np.random.default_rng(seed)
    phy = pf.placement.phy2log
    out = {}
    for i in range(n):
        g, T = int(rng.integers(4)), int(rng.integers(3, 12))
        home = phy[:, g * 4 : (g + 1) * 4]
        ids = np.where(
            rng.random((T, L, K)) < 0.8,
            home[np.arange(L)[None, :, None], rng.integers(0, 4, (T, L, K))],
            rng.integers(0, E, (T, L, K)),
        )
        out[f"request {i}"] = ids.astype(np.int64)
    return out


@pytest.fixture(scope="module")
def placements(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("proxy")
    return {"cap": make_placement(d / "cap.json", cap=1.1), "nocap": make_placement(d / "nocap.json", cap=None)}


def config(
    placement: Path, engine: str, prefill: list[StandinEngine], decode: list[StandinEngine], **kw
) -> ProxyConfig:
    return ProxyConfig(
        placement=str(placement),
        engine=engine,
        prefill=tuple(s.url for s in prefill),
        decode=tuple(s.url for s in decode),
        port=0,
        bootstrap_port=8998 if engine == "sglang" else None,
        **{"health_interval_s": 0.05, **kw},
    )


async def post(port: int, path: str, body: dict[str, Any] | bytes) -> tuple[int, bytes]:
    up = Upstream(f"http://127.0.0.1:{port}")
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        resp = await up.request("POST", path, data, {"Content-Type": "application/json"})
        return resp.status, await resp.read()
    finally:
        up.close()


async def get(port: int, path: str) -> tuple[int, bytes]:
    up = Upstream(f"http://127.0.0.1:{port}")
    try:
        resp = await up.request("GET", path)
        return resp.status, await resp.read()
    finally:
        up.close()


async def shutdown(proxy: Proxy, *standins: StandinEngine) -> None:
    await proxy.close()
    await asyncio.sleep(0.01)  # the stand-ins see the proxy's connections close
    for s in standins:
        await s.kill()
    await asyncio.sleep(0)


def text_of(status: int, data: bytes, *, stream: bool, chat: bool) -> str:
    """The answer's text (a stream's chunks joined); raises on an error event."""
    assert status == 200, data
    if not stream:
        c = json.loads(data)["choices"][0]
        return c["message"]["content"] if chat else c["text"]
    out = []
    for line in data.decode().split("\n\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            raise RuntimeError(ev["error"]["message"])
        c = ev["choices"][0]
        out.append(c["delta"]["content"] if chat else c["text"])
    return "".join(out)


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_decisions_equal_the_library_and_offline_routing(placements, engine):
    """Arrivals one after another, all kept in flight: the proxy's ranks are the library router's for
    the same sequence (cap binding), and without a cap its nodes are the placement's offline routing."""

    async def scenario(placement: Path) -> tuple[list[int], dict[str, np.ndarray], str]:
        pf = load_placement(placement)
        reqs = requests(pf, 40)
        gate = asyncio.Event()
        pre = await StandinEngine(engine, "prefill", MODEL, reqs).start()
        dec = await StandinEngine(engine, "decode", MODEL, dp_size=8, gate=gate).start()
        proxy = Proxy(config(placement, engine, [pre], [dec]))
        await proxy.start()
        chat = engine == "sglang"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        tasks = []
        for i, prompt in enumerate(reqs):
            body = {"model": "m", "max_tokens": 4, "stream": i % 2 == 0}
            body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
            tasks.append(asyncio.create_task(post(proxy.port, path, body)))
            while len(dec.served) <= i:  # the decision is made and the decode has begun: the next arrives
                assert not tasks[-1].done(), tasks[-1].result()
                await asyncio.sleep(0.001)
        gate.set()
        answers = await asyncio.gather(*tasks)
        for i, (status, data) in enumerate(answers):
            assert text_of(status, data, stream=i % 2 == 0, chat=chat) == "t0 t1 t2 t3 "
        _, m = await get(proxy.port, "/metrics")
        await shutdown(proxy, pre, dec)
        for r in dec.served:  # each engine's own mechanism carried the decision
            if engine == "vllm":
                assert r["kv_transfer_params"]["do_remote_prefill"] is True
            else:
                assert isinstance(r["bootstrap_room"], int)
        return [r["rank"] for r in dec.served], reqs, m.decode()

    for name in ("cap", "nocap"):
        ranks, reqs, m = asyncio.run(scenario(placements[name]))
        lib = ExpertRouter.from_placement(placements[name])
        expected = [lib.route(ids).rank for ids in reqs.values()]
        assert ranks == expected
        assert metric(m, "moetrace_proxy_decisions_total") == len(reqs)
        assert metric(m, "moetrace_proxy_fallbacks_total") == 0
        assert metric(m, "moetrace_proxy_decision_seconds_count") == len(reqs)
        if name == "nocap":
            counts = np.stack([lib.counts(ids) for ids in reqs.values()])
            offline = lib.nodes_of_window(counts)  # the placement's own router on all of them (compare's)
            np.testing.assert_array_equal(lib.rank_node_A[ranks], offline)
        else:
            assert lib.router.max_node_load is not None
            nodes = np.bincount(lib.rank_node_A[ranks], minlength=4)
            assert nodes.max() <= 11  # node_capacity(40, 4, 1.1): the cap held at every arrival


def test_a_rank_killed_mid_stream_loses_and_duplicates_nothing(placements):
    """Eight decode servers, one per rank; rank 0's dies while requests are in flight on it. Requests
    that had not begun streaming go to another rank and complete; streams already begun end with an
    error event; later requests never reach the dead rank; every request gets exactly one answer."""

    async def scenario():
        pf = load_placement(placements["nocap"])
        reqs = requests(pf, 48, seed=3)
        gate = asyncio.Event()
        pre = await StandinEngine("vllm", "prefill", MODEL, reqs).start()
        decs = [await StandinEngine("vllm", "decode", MODEL, gate=gate).start() for _ in range(8)]
        proxy = Proxy(config(placements["nocap"], "vllm", [pre], decs, rank_cooldown_s=60.0))
        await proxy.start()
        prompts = list(reqs)
        first = [
            asyncio.create_task(post(proxy.port, "/v1/completions", {"prompt": p, "stream": i % 3 == 0}))
            for i, p in enumerate(prompts[:32])
        ]
        while sum(len(d.served) for d in decs) < 32:
            await asyncio.sleep(0.001)
        on_dead = [r["prompt"] for r in decs[0].served]
        assert on_dead, "no request went to rank 0 before the kill"
        await decs[0].kill()
        gate.set()
        answers = dict(zip(prompts[:32], await asyncio.gather(*first)))
        later = await asyncio.gather(*(post(proxy.port, "/v1/completions", {"prompt": p}) for p in prompts[32:]))
        answers.update(zip(prompts[32:], later))
        _, m = await get(proxy.port, "/metrics")
        stats = proxy.router.stats()
        await shutdown(proxy, pre, *decs)
        return prompts, answers, on_dead, decs, m.decode(), stats

    prompts, answers, on_dead, decs, m, stats = asyncio.run(scenario())
    assert set(answers) == set(prompts)  # none lost
    broken = 0
    for i, p in enumerate(prompts):
        stream = i < 32 and i % 3 == 0
        status, data = answers[p]
        if stream and p in on_dead:
            with pytest.raises(RuntimeError, match="broke off"):  # begun on the dead rank: an error event, once
                text_of(status, data, stream=True, chat=False)
            broken += 1
        else:
            assert text_of(status, data, stream=stream, chat=False) == "t0 t1 t2 t3 "
    finished = [r["prompt"] for d in decs for r in d.served if r["finished"]]
    assert len(finished) == len(set(finished)) == len(prompts) - broken  # no answer produced twice
    moved = [p for p in on_dead if p not in [prompts[i] for i in range(0, 32, 3)]]
    assert moved and all(p in finished for p in moved)  # the non-streamed ones on rank 0 fell back
    assert not any(r["prompt"] in prompts[32:] for r in decs[0].served)  # nothing new to the dead rank
    assert stats["fallbacks"].get("rank down", 0) == len(moved)
    assert stats["inflight_per_rank"] == [0] * 8  # every count released once
    assert metric(m, "moetrace_proxy_streams_broken_total") == broken
    assert 'moetrace_proxy_rank_up{rank="0"} 0' in m


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_malformed_engine_replies_give_a_clear_error_or_a_counted_fallback(placements, engine):
    async def scenario():
        pf = load_placement(placements["cap"])
        reqs = requests(pf, 4)
        pre = await StandinEngine(engine, "prefill", MODEL, reqs).start()
        dec = await StandinEngine(engine, "decode", MODEL, dp_size=8).start()
        proxy = Proxy(config(placements["cap"], engine, [pre], [dec]))
        await proxy.start()
        out = {}
        for bad in ("!noroute", "!b64", "!shape", "!ids", "!500", "!json", "!close"):
            out[bad] = await post(proxy.port, "/v1/completions", {"prompt": f"{bad} request 0", "max_tokens": 4})
        out["not json"] = await post(proxy.port, "/v1/completions", b"{nope")
        out["good"] = await post(proxy.port, "/v1/completions", {"prompt": "request 1"})
        strict = Proxy(dataclasses.replace(proxy.config, fallback="error"))
        await strict.start()
        out["strict !ids"] = await post(strict.port, "/v1/completions", {"prompt": "!ids request 0"})
        stats = proxy.router.stats()
        await strict.close()
        await shutdown(proxy, pre, dec)
        return out, stats

    out, stats = asyncio.run(scenario())
    for bad in ("!noroute", "!b64", "!shape", "!ids", "good"):  # served, by the fallback where routing was bad
        assert text_of(*out[bad], stream=False, chat=False) == "t0 t1 t2 t3 "
    assert stats["fallbacks"] == {"no routing": 1, "malformed": 3}
    for bad, says in (("!500", "HTTP 500"), ("!json", "not JSON"), ("!close", "connection")):
        status, data = out[bad]
        assert status == 502 and says in json.loads(data)["error"]["message"], (bad, data)
    assert out["not json"][0] == 400 and "malformed request body" in out["not json"][1].decode()
    assert out["strict !ids"][0] == 502 and "expert ids" in json.loads(out["strict !ids"][1])["error"]["message"]
    assert stats["inflight_per_rank"] == [0] * 8


def test_every_rank_down_answers_503_and_health_brings_them_back(placements):
    async def scenario():
        pf = load_placement(placements["cap"])
        reqs = requests(pf, 2)
        pre = await StandinEngine("vllm", "prefill", MODEL, reqs).start()
        dec = await StandinEngine("vllm", "decode", MODEL, dp_size=8).start()
        proxy = Proxy(config(placements["cap"], "vllm", [pre], [dec]))
        await proxy.start()
        dec.healthy = False
        for _ in range(proxy.config.health_failures_down):
            await proxy.check_health()
        down = await post(proxy.port, "/v1/completions", {"prompt": "request 0"})
        health_down = await get(proxy.port, "/health")
        dec.healthy = True
        await proxy.check_health()
        up = await post(proxy.port, "/v1/completions", {"prompt": "request 0"})
        await shutdown(proxy, pre, dec)
        return down, health_down, up, proxy.router.stats()

    down, health_down, up, stats = asyncio.run(scenario())
    assert down[0] == 503 and "no live DP rank" in json.loads(down[1])["error"]["message"]
    assert health_down[0] == 503
    assert text_of(*up, stream=False, chat=False) == "t0 t1 t2 t3 "
    assert stats["inflight_per_rank"] == [0] * 8


def test_one_slow_probe_is_not_a_dead_server(placements):
    """Under overload the proxy's own loop delays GET /health: one failed probe keeps the ranks,
    ``health_failures_down`` in a row take them out, one good probe brings them back."""

    async def scenario():
        pf = load_placement(placements["cap"])
        pre = await StandinEngine("vllm", "prefill", MODEL, requests(pf, 1)).start()
        dec = await StandinEngine("vllm", "decode", MODEL, dp_size=8).start()
        proxy = Proxy(config(placements["cap"], "vllm", [pre], [dec], health_interval_s=3600.0))
        await proxy.start()
        await asyncio.sleep(0.3)  # the health loop's first round (at start) is over; the next is an hour away
        seen = []
        dec.healthy = False
        for _ in range(proxy.config.health_failures_down):
            await proxy.check_health()
            seen.append(sum(proxy.router.live()))
        dec.healthy = True
        await proxy.check_health()
        seen.append(sum(proxy.router.live()))
        await shutdown(proxy, pre, dec)
        return seen

    assert asyncio.run(scenario()) == [8, 8, 0, 8]


def test_routed_experts_wire_formats():
    """vLLM >= 0.22 (.npy, all decoder layers), vLLM 0.21 (nested lists, MoE layers), SGLang (int32)."""
    ids = np.arange(5 * 4 * 2).reshape(5, 4, 2) % 16  # [T, all layers, K]
    np.testing.assert_array_equal(moe_layers_of(ids, MODEL), ids[:, 1:])
    np.testing.assert_array_equal(moe_layers_of(ids[:, 1:], MODEL), ids[:, 1:])
    with pytest.raises(ValueError, match="5 layers; tiny-moe has 4 decoder layers, 3 of them MoE"):
        moe_layers_of(np.zeros((2, 5, 2), int), MODEL)
    v21 = {"choices": [{"text": "x"}], "prompt_routed_experts": ids[:, 1:].tolist(), "usage": {"prompt_tokens": 5}}
    got = VllmWire(MODEL).read_prefill(v21)
    np.testing.assert_array_equal(got.routed_experts, ids[:, 1:])
    assert VllmWire(MODEL).read_prefill({"choices": []}).problem.startswith("malformed")
    import base64

    sg = {"choices": [{}], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    sg["sglext"] = {"routed_experts": base64.b64encode(ids.astype("<i4").tobytes()).decode()}  # 4 + 2 - 1 rows
    got = SglangWire(MODEL, bootstrap_port=1).read_prefill(sg)
    np.testing.assert_array_equal(got.routed_experts, ids[:4, 1:])
    hop = SglangWire(MODEL, bootstrap_port=8998).prefill_hop("/v1/completions", {"prompt": "p", "stream": True}, "r")
    assert hop.body["return_routed_experts"] and hop.body["bootstrap_host"] == "2.2.2.2" and not hop.body["stream"]
    *side, main = SglangWire(MODEL, bootstrap_port=8998).decode_hops(
        "/v1/completions", {"prompt": "p"}, "r", 3, {}, "10.0.0.1"
    )
    assert main.headers["X-Data-Parallel-Rank"] == "3" and side[0].body["bootstrap_room"] == main.body["bootstrap_room"]
    assert main.body["bootstrap_host"] == "10.0.0.1" and main.body["bootstrap_port"] == 8998


def test_cli_serve_refuses_what_cannot_work(placements):
    r = CliRunner().invoke(
        app,
        [
            "route",
            "serve",
            str(placements["cap"]),
            "--engine",
            "sglang",
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:2",
        ],
    )
    assert r.exit_code == 2 and "--bootstrap-port" in r.output
    r = CliRunner().invoke(
        app,
        ["route", "serve", str(placements["cap"]), "--prefill", "http://127.0.0.1:1"]
        + ["--decode", "http://127.0.0.1:2"] * 3,
    )
    assert r.exit_code == 2 and "do not split evenly over 3 decode servers" in r.output
