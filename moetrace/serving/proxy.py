"""The prefill–decode proxy (``moetrace route serve``): OpenAI-compatible HTTP in front of vLLM or SGLang.

For each ``POST /v1/completions`` or ``/v1/chat/completions``:

1. **prefill**: the request goes to the least-busy live prefill server, asking for the prompt's routed
   experts (``engines.Wire.prefill_hop``: ``max_tokens=1``, not streamed; vLLM: the KV-transfer
   parameters of its P/D proxy, SGLang: ``return_routed_experts`` and a fake-transfer bootstrap host).
   A server that fails (connection, timeout, HTTP 5xx, a reply that is not JSON) is counted and the next
   one is tried; an engine's 4xx (the client's mistake) goes back to the client as it came.
2. **decision**: ``ExpertRouter.route`` on the reply's routed experts picks the decode DP rank; a reply
   without routing, or with routing that cannot be read, takes the fallback (the least-loaded live rank;
   counted by reason in ``/metrics`` and logged). The time of reading the reply and deciding is the
   ``decision_seconds`` histogram.
3. **decode**: the request goes to the decode server of that rank with the engine's rank header
   (``X-data-parallel-rank``; vLLM also gets the prefill's ``kv_transfer_params``, SGLang the PD pair
   with one bootstrap room), and the answer is streamed back as it comes (``stream: true``) or
   returned whole.

**No request lost or duplicated.** A decode rank that fails before the first byte reached the client
(connection refused or reset, no response head within ``first_byte_timeout_s``, HTTP 5xx, or for a
non-streamed request anything before the whole answer arrived) is marked down for
``rank_cooldown_s`` and the request goes to the least-loaded live rank (``ExpertRouter.reroute``,
counted as a fallback "rank down"), at most ``decode_attempts`` times. A stream that breaks after its
first byte cannot be sent again without repeating text the client already has: it ends with an error
event (``data: {"error": ...}`` then ``data: [DONE]``) and counts in ``streams_broken_total``. Every
request ends in exactly one answer or one error, and its rank's in-flight count is released once.

**Health.** Every ``health_interval_s`` each server's ``GET /health`` (vLLM and SGLang both serve it)
decides whether it is up: ``health_failures_down`` failed probes in a row take it down, one good
probe brings it back. One slow probe is not a dead server: under overload the proxy's own event loop
delays the probe's reply, and taking servers down then would turn load into errors. A failed
*request* still takes its rank out at once (the cooldown above). A decode server's ranks are live
when it is up and out of their cooldown.

Decode servers and ranks: the placement's A DP ranks are split evenly over the decode servers in the
order given (one server: all of them, a vLLM/SGLang server with internal data parallelism; A servers:
one per rank, vLLM's external load balancing). The rank header carries the rank within its server.

Times are seconds, sizes bytes. Runs on one asyncio event loop (the router's decision is synchronous,
~0.1–0.35 ms at DeepSeek-V3 shape for 32–512-token prompts, docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from moetrace.errors import ConfigError
from moetrace.serving.engines import Hop, warm_up_decoding, wire_for
from moetrace.serving.http11 import (
    MAX_HEAD,
    ChunkedWriter,
    HttpError,
    Request,
    Response,
    Upstream,
    read_request,
    within,
    write_response,
)
from moetrace.serving.metrics import ProxyMetrics
from moetrace.serving.router import Decision, ExpertRouter, Fallback, RoutingError

__all__ = ["COMPLETION_PATHS", "Proxy", "ProxyConfig", "run_proxy"]

logger = logging.getLogger("moetrace.serving.proxy")
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
UPSTREAM_ERRORS = (OSError, HttpError, asyncio.TimeoutError, asyncio.IncompleteReadError)


@dataclass(frozen=True)
class ProxyConfig:
    """Where the proxy listens, what it sits in front of, and how long it waits."""

    placement: str  # the placement file `moetrace place` wrote (its deployment's DP ranks = the decode ranks)
    engine: str  # "vllm" or "sglang": the engines' wire format (moetrace/serving/engines.py)
    prefill: tuple[str, ...]  # prefill servers, http://HOST:PORT each
    decode: tuple[str, ...]  # decode servers, http://HOST:PORT each; the DP ranks split evenly over them in order
    host: str = "127.0.0.1"  # address the proxy listens on
    port: int = 8000  # its port (0: any free one; Proxy.port says which)
    pd: bool = True  # prefill–decode disaggregation (KV moves); False: the prefill server only probes the routing
    bootstrap_port: int | None = None  # SGLang PD: the prefill servers' --disaggregation-bootstrap-port
    fallback: Fallback = "least_loaded"  # unreadable routing: the least-loaded rank, or "error" (HTTP 502)
    prefill_timeout_s: float = 60.0  # a prefill reply, whole
    first_byte_timeout_s: float = 60.0  # a decode server's response head
    idle_timeout_s: float = 120.0  # the longest wait for the next piece of a streamed answer (a whole one: its body)
    health_interval_s: float = 2.0  # between two rounds of GET /health on every server
    health_timeout_s: float = 1.0  # one GET /health
    health_failures_down: int = 3  # consecutive failed GET /health before a server counts as down
    rank_cooldown_s: float = 5.0  # a rank that failed a request takes none for this long
    decode_attempts: int = 3  # decode ranks tried per request (the first included)
    max_body_bytes: int = 32 << 20  # the largest client request body


@dataclass(frozen=True)
class _Answer:
    """What the client gets instead of a decode (an engine's 4xx as it came, or the proxy's error)."""

    status: int
    body: bytes


class _Retry(Exception):
    """A decode hop failed before any byte reached the client: the request may go elsewhere."""


class Proxy:
    """The proxy (module docstring). ``await start()``, then serve until ``await close()``."""

    def __init__(self, config: ProxyConfig, router: ExpertRouter | None = None) -> None:
        self.config = config
        self.router = router or ExpertRouter.from_placement(config.placement, fallback=config.fallback)
        if not config.prefill or not config.decode:
            raise ConfigError(
                "the proxy needs at least one prefill server (--prefill) and one decode server (--decode)"
            )
        warm_up_decoding()  # the routed experts' base64 decoder, compiled before any request needs it
        try:
            self.wire = wire_for(
                config.engine, self.router.placement_file.model, pd=config.pd, bootstrap_port=config.bootstrap_port
            )
            self.prefill = [Upstream(u) for u in config.prefill]
            self.decode = [Upstream(u) for u in config.decode]
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        A, D = self.router.num_ranks, len(self.decode)
        if A % D:
            raise ConfigError(
                f"{A} DP ranks (the placement's deployment) do not split evenly over {D} decode servers; "
                f"give 1, one per rank, or a divisor of {A}"
            )
        self.ranks_per_server = A // D
        self.metrics = ProxyMetrics()
        self.prefill_up = [True] * len(self.prefill)
        self.prefill_busy = [0] * len(self.prefill)
        self.server_up = [True] * D
        self._probe_failures = [0] * (len(self.prefill) + D)  # consecutive failed GET /health, per server
        self.down_until = np.zeros(A)  # monotonic time until which a rank that failed takes nothing
        self._turn = 0
        self._fallback_log: dict[str, tuple[float, int]] = {}
        self._server: asyncio.Server | None = None
        self._health: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- life cycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._client, self.config.host, self.config.port, limit=MAX_HEAD, backlog=4096
        )
        self._health = asyncio.create_task(self._health_loop())

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._health:
            self._health.cancel()
        if self._server:
            self._server.close()
            await self._server.wait_closed()
        for u in (*self.prefill, *self.decode):
            u.close()

    # ---- health --------------------------------------------------------------------------------
    async def _probe(self, up: Upstream) -> bool:
        try:
            resp = await within(up.request("GET", "/health"), self.config.health_timeout_s)
            await within(resp.read(limit=1 << 20), self.config.health_timeout_s)
            return resp.status == 200
        except UPSTREAM_ERRORS:
            return False

    async def check_health(self) -> None:
        """One round of ``GET /health`` on every server; updates which prefill servers and ranks take requests."""
        good = await asyncio.gather(*(self._probe(u) for u in (*self.prefill, *self.decode)))
        for i, g in enumerate(good):
            self._probe_failures[i] = 0 if g else self._probe_failures[i] + 1
        need = max(1, self.config.health_failures_down)
        ok = [
            f < need if was_up else f == 0
            for f, was_up in zip(self._probe_failures, (*self.prefill_up, *self.server_up))
        ]
        P = len(self.prefill)
        for i, up in enumerate(ok[:P]):
            if up != self.prefill_up[i]:
                logger.warning("prefill server %s is %s", self.prefill[i].base_url, "up" if up else "DOWN")
            self.prefill_up[i] = up
        for d, up in enumerate(ok[P:]):
            if up != self.server_up[d]:
                logger.warning("decode server %s is %s", self.decode[d].base_url, "up" if up else "DOWN")
            self.server_up[d] = up
        self._apply_live()

    def _apply_live(self) -> None:
        now = time.monotonic()
        live = self.router.live()
        for a in range(self.router.num_ranks):
            want = self.server_up[a // self.ranks_per_server] and now >= self.down_until[a]
            if want != live[a]:
                self.router.set_live(a, bool(want))

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # a bug here must not stop the checks; it is logged with its traceback
                logger.exception("health check failed")
            await asyncio.sleep(self.config.health_interval_s)

    def _rank_failed(self, rank: int, why: str) -> None:
        self.down_until[rank] = time.monotonic() + self.config.rank_cooldown_s
        self.router.set_live(rank, False)
        self.metrics.engine_errors[("decode", why.split(":", 1)[0])] += 1
        logger.warning("decode rank %d failed (%s); no request for %.0f s", rank, why, self.config.rank_cooldown_s)

    def _log_fallback(self, d: Decision) -> None:
        key = d.reason.split(":", 1)[0]
        last, n = self._fallback_log.get(key, (-1e9, 0))
        now = time.monotonic()
        if now - last >= 10.0:
            more = f" (and {n} more since the last report)" if n else ""
            logger.warning("fallback to rank %d: %s%s", d.rank, d.reason, more)
            self._fallback_log[key] = (now, 0)
        else:
            self._fallback_log[key] = (last, n + 1)

    # ---- the client side -----------------------------------------------------------------------
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            while True:
                try:
                    req = await read_request(reader, max_body=self.config.max_body_bytes)
                except HttpError as exc:
                    await write_response(writer, 400, _error(str(exc), "invalid_request_error"), keep_alive=False)
                    return
                if req is None:
                    return
                keep = await self._dispatch(req, writer)
                if not (keep and req.keep_alive):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; what it had in flight was released where it ran
        except Exception:  # a bug: logged with its traceback; the connection closes, the proxy goes on
            logger.exception("unexpected error while serving a client")
            if not writer.is_closing():
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        finally:
            if task is not None:
                self._tasks.discard(task)
            writer.close()

    async def _dispatch(self, req: Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection must close."""
        if req.path in COMPLETION_PATHS:
            if req.method != "POST":
                await write_response(writer, 405, _error("use POST", "invalid_request_error"))
                return True
            status = await self.complete(req, writer)
            self.metrics.requests[(req.path, status)] += 1
            return status != 499
        if req.path == "/metrics" and req.method == "GET":
            text = self.metrics.render(self.router.stats(), self.router.live().tolist())
            await write_response(writer, 200, text.encode(), content_type="text/plain; version=0.0.4")
            return True
        if req.path == "/health" and req.method == "GET":
            live = self.router.live()
            ok = bool(live.any()) and any(self.prefill_up)
            body = {"live_ranks": np.flatnonzero(live).tolist(), "prefill_up": self.prefill_up}
            await write_response(writer, 200 if ok else 503, json.dumps(body).encode())
            return True
        if req.path == "/v1/models" and req.method == "GET":
            return await self._relay_get(req.path, writer)
        await write_response(writer, 404, _error(f"no route {req.method} {req.path}", "not_found"))
        return True

    async def _relay_get(self, path: str, writer: asyncio.StreamWriter) -> bool:
        for d, up in enumerate(self.server_up):
            if not up:
                continue
            try:
                resp = await within(self.decode[d].request("GET", path), self.config.health_timeout_s * 5)
                body = await within(resp.read(limit=1 << 24), self.config.health_timeout_s * 5)
            except UPSTREAM_ERRORS:
                continue
            await write_response(writer, resp.status, body, content_type=resp.headers.get("content-type", "text/plain"))
            return True
        await write_response(writer, 503, _error("no decode server is up", "service_unavailable"))
        return True

    # ---- one completion ------------------------------------------------------------------------
    async def complete(self, req: Request, writer: asyncio.StreamWriter) -> int:
        """Serve one completion request; returns the HTTP status the client got (499: it went away)."""
        try:
            body = json.loads(req.body)
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
        except ValueError as exc:
            return await _answer(writer, 400, _error(f"malformed request body: {exc}", "invalid_request_error"))
        if not self.router.live().any():
            return await _answer(
                writer, 503, _error("no live DP rank: every decode server is down", "service_unavailable")
            )
        rid = f"moetrace-{uuid.uuid4().hex}"
        got = await self._prefill(req.path, body, rid)
        if isinstance(got, _Answer):  # the engine's 4xx, or no prefill server answered
            return await _answer(writer, got.status, got.body)
        reply, p = got
        t0 = time.perf_counter()
        try:
            pr = self.wire.read_prefill(reply)
            if pr.routed_experts is not None:
                decision = self.router.route(pr.routed_experts)
            elif pr.problem.startswith("malformed") and self.config.fallback == "error":
                raise RoutingError(pr.problem)
            else:
                decision = self.router.route_fallback(pr.problem)
        except RoutingError as exc:  # fallback="error" and unreadable routing, or no rank went live meanwhile
            self.metrics.engine_errors[("prefill", "routing")] += 1
            return await _answer(
                writer, 502, _error(f"prefill server {self.prefill[p].base_url}: {exc}", "bad_gateway")
            )
        self.metrics.decision.observe(time.perf_counter() - t0)
        if not decision.routed:
            self._log_fallback(decision)
        return await self._decode(req.path, body, rid, decision.rank, pr.carry, p, writer)

    async def _prefill(self, path: str, body: dict[str, Any], rid: str) -> tuple[Any, int] | _Answer:
        """The prefill reply (parsed JSON) and its server's index, or what to answer the client."""
        up = [i for i, ok in enumerate(self.prefill_up) if ok] or list(range(len(self.prefill)))  # none up: try all
        order = sorted(up, key=lambda i: (self.prefill_busy[i], (i - self._turn) % len(self.prefill)))
        self._turn += 1
        problems = []
        for n, p in enumerate(order):
            if n:
                self.metrics.retries["prefill"] += 1
            hop = self.wire.prefill_hop(path, body, rid)
            self.prefill_busy[p] += 1
            try:
                status, data = await within(self._send_whole(self.prefill[p], hop), self.config.prefill_timeout_s)
            except UPSTREAM_ERRORS as exc:
                kind = "timeout" if isinstance(exc, asyncio.TimeoutError) else "connection"
                self.metrics.engine_errors[("prefill", kind)] += 1
                self.prefill_up[p] = False  # until its next good GET /health
                problems.append(f"{self.prefill[p].base_url}: {kind} ({exc!r})")
                continue
            finally:
                self.prefill_busy[p] -= 1
            if 400 <= status < 500:
                return _Answer(status, data)
            if status != 200:
                self.metrics.engine_errors[("prefill", f"HTTP {status}")] += 1
                problems.append(f"{self.prefill[p].base_url}: HTTP {status} {data[:200]!r}")
                continue
            try:
                return self.wire.parse_reply(data), p
            except ValueError:
                self.metrics.engine_errors[("prefill", "not JSON")] += 1
                problems.append(f"{self.prefill[p].base_url}: a reply that is not JSON ({data[:80]!r})")
        logger.warning("no prefill server answered: %s", "; ".join(problems))
        return _Answer(502, _error("no prefill server answered: " + "; ".join(problems), "bad_gateway"))

    async def _send_whole(self, up: Upstream, hop: Hop) -> tuple[int, bytes]:
        resp = await up.request("POST", hop.path, json.dumps(hop.body).encode(), _json_headers(hop.headers))
        return resp.status, await resp.read()

    async def _decode(
        self,
        path: str,
        body: dict[str, Any],
        rid: str,
        rank: int | None,
        carry: dict[str, Any],
        p: int,
        writer: asyncio.StreamWriter,
    ) -> int:
        stream = bool(body.get("stream"))
        out = ChunkedWriter(writer)
        try:
            for attempt in range(self.config.decode_attempts):
                assert rank is not None
                d, local = divmod(rank, self.ranks_per_server)
                local = local if len(self.decode) > 1 else rank
                hops = self.wire.decode_hops(
                    path, body, rid + (f"-r{attempt}" if attempt else ""), local, carry, self.prefill[p].host
                )
                try:
                    return await self._decode_once(hops, self.decode[d], p, stream, out, writer)
                except _Retry as exc:
                    self._rank_failed(rank, str(exc))
                    if attempt + 1 == self.config.decode_attempts:
                        return await _answer(
                            writer, 502, _error(f"decode failed on {attempt + 1} ranks; last: {exc}", "bad_gateway")
                        )
                    self.metrics.retries["decode"] += 1
                    old, rank = rank, None
                    decision = self.router.reroute(old, "rank down")  # RoutingError: no live rank
                    rank = decision.rank
                    self._log_fallback(decision)
            raise AssertionError("unreachable")
        except RoutingError as exc:
            return await _answer(writer, 503, _error(f"no decode rank is live: {exc}", "service_unavailable"))
        except ConnectionError:
            return 499
        finally:
            if rank is not None:
                self.router.release(rank)

    async def _decode_once(
        self,
        hops: list[Hop],
        up: Upstream,
        p: int,
        stream: bool,
        out: ChunkedWriter,
        writer: asyncio.StreamWriter,
    ) -> int:
        *side, main = hops
        for h in side:  # SGLang: the prefill of the pair, run beside the decode
            t = asyncio.create_task(self._side_hop(self.prefill[p], h))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        cfg = self.config
        try:
            resp = await within(
                up.request("POST", main.path, json.dumps(main.body).encode(), _json_headers(main.headers)),
                cfg.first_byte_timeout_s,
            )
        except UPSTREAM_ERRORS as exc:
            raise _Retry(f"{up.base_url}: {type(exc).__name__}: {exc}") from None
        if resp.status >= 500:
            text = await _read_some(resp, cfg.idle_timeout_s)
            raise _Retry(f"{up.base_url}: HTTP {resp.status} {text[:200]!r}")
        ctype = resp.headers.get("content-type", "application/json")
        if resp.status != 200 or not stream:
            try:
                data = await within(resp.read(), cfg.idle_timeout_s)
            except UPSTREAM_ERRORS as exc:
                raise _Retry(f"{up.base_url}: the answer broke off ({type(exc).__name__}: {exc})") from None
            await write_response(writer, resp.status, data, content_type=ctype)
            return resp.status
        pieces = _pieces(resp, cfg.idle_timeout_s).__aiter__()
        try:
            while True:
                try:
                    piece = await pieces.__anext__()
                except StopAsyncIteration:
                    break
                except UPSTREAM_ERRORS as exc:
                    if not out.started:
                        raise _Retry(f"{up.base_url}: the stream broke off before its first byte ({exc!r})") from None
                    await self._broken(out, up, exc)
                    return 200
                if not out.started:
                    await out.start(200, ctype)
                await out.write(piece)  # a ConnectionError here is the client's: the caller answers 499
        finally:
            await pieces.aclose()
        if not out.started:
            await out.start(200, ctype)
        await out.end()
        return 200

    async def _broken(self, out: ChunkedWriter, up: Upstream, exc: BaseException) -> None:
        self.metrics.streams_broken += 1
        self.metrics.engine_errors[("decode", "stream broken")] += 1
        logger.warning("a stream from %s broke off after %d bytes: %r", up.base_url, out.bytes_sent, exc)
        event = {"error": {"message": f"the decode server broke off the stream ({exc!r})", "type": "bad_gateway"}}
        await out.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
        await out.end()

    async def _side_hop(self, up: Upstream, hop: Hop) -> None:
        try:
            status, data = await within(self._send_whole(up, hop), self.config.prefill_timeout_s)
            if status != 200:
                self.metrics.engine_errors[("prefill", f"HTTP {status}")] += 1
                logger.warning("the PD prefill on %s answered HTTP %d: %r", up.base_url, status, data[:200])
        except UPSTREAM_ERRORS as exc:
            self.metrics.engine_errors[("prefill", "connection")] += 1
            logger.warning("the PD prefill on %s failed: %r", up.base_url, exc)


async def _pieces(resp: Response, idle_s: float):
    it = resp.iter_body().__aiter__()
    try:
        while True:
            try:
                piece = await within(it.__anext__(), idle_s)
            except StopAsyncIteration:
                return
            yield piece
    finally:
        resp.close()


async def _read_some(resp: Response, idle_s: float) -> bytes:
    try:
        return await within(resp.read(limit=1 << 16), idle_s)
    except (*UPSTREAM_ERRORS, ValueError):
        return b""


def _json_headers(extra: dict[str, str]) -> dict[str, str]:
    return {"Content-Type": "application/json", **extra}


def _error(message: str, kind: str) -> bytes:
    """An error body as the engines' OpenAI servers write one."""
    return json.dumps({"error": {"message": message, "type": kind}}).encode()


async def _answer(writer: asyncio.StreamWriter, status: int, body: bytes) -> int:
    try:
        await write_response(writer, status, body)
    except ConnectionError:
        return 499
    return status


async def serve_forever(config: ProxyConfig, *, ready: Any = None) -> None:
    """Run the proxy until cancelled; ``ready(proxy)`` is called once it listens."""
    proxy = Proxy(config)
    await proxy.start()
    await proxy.check_health()
    if ready is not None:
        ready(proxy)
    try:
        await asyncio.Event().wait()
    finally:
        await proxy.close()


def run_proxy(config: ProxyConfig, *, ready: Any = None) -> None:
    """``serve_forever`` on a new event loop, until Ctrl-C."""
    try:
        asyncio.run(serve_forever(config, ready=ready))
    except KeyboardInterrupt:
        pass
