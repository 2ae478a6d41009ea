"""Stand-in engine servers for the proxy: real HTTP on loopback, each engine's wire format, no model.

``StandinEngine`` answers ``/v1/completions`` and ``/v1/chat/completions`` as a vLLM or SGLang prefill
or decode server would (the fields of moetrace/serving/engines.py, read from their source), with the
routed experts it is given per prompt text (a trace's, replayed). A decode stand-in records which DP
rank served each request (``served``) and streams ``tokens`` tokens as Server-Sent Events chunks
(``text_completion`` / ``chat.completion.chunk`` objects, ``data: [DONE]`` at the end) or one JSON
answer. ``kill()`` drops its listening socket and every open connection, mid-stream included (a rank
dying); prompts starting with ``!`` make a prefill misbehave (``MISBEHAVIOURS``).

Used by the tests (tests/test_proxy.py) and the benchmark (benchmarks/bench_proxy.py); also a way to
try a proxy deployment's wiring without GPUs. ``BackgroundLoop`` runs an asyncio loop in a thread.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import numpy as np

from moetrace.serving.http11 import ChunkedWriter, HttpError, read_request, write_response
from moetrace.tracer.trace.schema import ModelInfo

__all__ = ["MISBEHAVIOURS", "BackgroundLoop", "StandinEngine", "prompt_of"]

T = TypeVar("T")

#: prompt prefixes that make a prefill stand-in misbehave, and how
MISBEHAVIOURS = {
    "!json": "a 200 reply that is not JSON",
    "!500": "HTTP 500",
    "!close": "the connection closed without an answer",
    "!noroute": "routed experts null (the server was started without returning them)",
    "!b64": "routed experts that are not base64",
    "!shape": "routed experts with a layer count the model does not have",
    "!ids": "expert ids beyond the model's experts",
}


def prompt_of(body: dict[str, Any]) -> str:
    """The prompt text of a completion (``prompt``) or chat request (the last message's content)."""
    if "messages" in body:
        msgs = body.get("messages") or [{}]
        return str(msgs[-1].get("content", ""))
    p = body.get("prompt", "")
    return p if isinstance(p, str) else json.dumps(p)


class StandinEngine:
    """One stand-in server (module docstring). ``await start()``; ``url`` is its base URL."""

    def __init__(
        self,
        engine: str,
        role: str,
        model: ModelInfo,
        routing: Mapping[str, np.ndarray] | None = None,
        *,
        dp_size: int = 1,
        tokens: int = 4,
        token_delay_s: float = 0.0,
        all_layers: bool = True,
        gate: asyncio.Event | None = None,
    ) -> None:
        if engine not in ("vllm", "sglang") or role not in ("prefill", "decode"):
            raise ValueError(f"engine vllm|sglang and role prefill|decode, got {engine!r}, {role!r}")
        self.engine, self.role, self.model = engine, role, model
        self.routing = routing or {}  # prompt text -> int [T, L, K] its routed experts over the MoE layers
        self.dp_size = dp_size  # ranks this server takes in its rank header (0 .. dp_size-1)
        self.tokens = tokens  # tokens a decode answers
        self.token_delay_s = token_delay_s  # seconds between two streamed tokens
        self.all_layers = all_layers  # return every decoder layer (dense ones 0), as vLLM >= 0.31 and SGLang do
        self.gate = gate  # a decode waits on it after its first token (keeps requests in flight)
        self.served: list[dict[str, Any]] = []  # decode: one record per answer begun (rank, prompt, request id, ...)
        self.healthy = True
        self.killed = False  # after kill(): a dead process, nothing more is written or recorded as finished
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        # prefill request body -> the reply sent (a stand-in's own CPU stays off the proxy's benchmark)
        self._replies: dict[bytes, bytes] = {}

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> StandinEngine:
        self._server = await asyncio.start_server(self._client, host, port, backlog=4096)
        self.port = int(self._server.sockets[0].getsockname()[1])
        self.url = f"http://{host}:{self.port}"
        return self

    async def kill(self) -> None:
        """Die: no new connection, every open one cut (streams end mid-way)."""
        self.killed = True
        if self._server:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while (req := await read_request(reader, max_body=1 << 26)) is not None:
                if req.path == "/health":
                    await write_response(writer, 200 if self.healthy else 503, b"")
                elif req.path == "/v1/models":
                    await write_response(writer, 200, json.dumps({"object": "list", "data": [{"id": "m"}]}).encode())
                elif self.role == "prefill":
                    if (reply := self._replies.get(req.body)) is not None:
                        await write_response(writer, 200, reply)
                    elif not await self._prefill(json.loads(req.body), writer, key=req.body):
                        return
                else:
                    await self._decode(json.loads(req.body), req.headers, req.path, writer)
        except (ConnectionError, HttpError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    # ---- prefill ---------------------------------------------------------------------------------
    def _ids(self, prompt: str) -> np.ndarray:
        ids = self.routing.get(prompt)
        if ids is None:
            ids = np.zeros((3, len(self.model.moe_layers), self.model.top_k), np.int64)  # an unknown prompt
        if self.all_layers and len(self.model.moe_layers) != self.model.num_hidden_layers:
            full = np.zeros((len(ids), self.model.num_hidden_layers, ids.shape[2]), ids.dtype)
            full[:, list(self.model.moe_layers)] = ids
            ids = full
        return np.asarray(ids)

    async def _prefill(self, body: dict[str, Any], writer: asyncio.StreamWriter, *, key: bytes) -> bool:
        prompt = prompt_of(body)
        bad = prompt.split(" ", 1)[0] if prompt.startswith("!") else ""
        if bad == "!close":
            writer.transport.abort()
            return False
        if bad == "!500":
            await write_response(writer, 500, b'{"error": {"message": "stand-in failure"}}')
            return True
        if bad == "!json":
            await write_response(writer, 200, b"<html>not json</html>")
            return True
        ids = self._ids(prompt)
        if bad == "!shape":
            ids = np.concatenate([ids, ids[:, :1]], axis=1)
        if bad == "!ids":
            ids = ids + self.model.num_experts
        T = len(ids)
        usage = {"prompt_tokens": T, "completion_tokens": 1, "total_tokens": T + 1}
        chat = "messages" in body
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": "x"}
        else:
            choice["text"] = "x"
        out: dict[str, Any] = {
            "id": "cmpl-standin",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", "m"),
            "choices": [choice],
            "usage": usage,
        }
        if self.engine == "vllm":
            # vLLM 0.33: base64 of np.save(array), uint8 for <= 256 experts (routed_experts_capturer.py)
            buf = io.BytesIO()
            np.save(buf, ids.astype(np.uint8 if self.model.num_experts <= 256 else np.uint16), allow_pickle=False)
            routed = base64.b64encode(buf.getvalue()).decode()
            choice["routed_experts"] = None if bad == "!noroute" else ("@@not base64@@" if bad == "!b64" else routed)
            kv = body.get("kv_transfer_params")
            if isinstance(kv, dict) and kv.get("do_remote_decode"):
                out["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": f"standin-{self.port}",
                    "remote_block_ids": [1, 2, 3],
                    "remote_host": "127.0.0.1",
                    "remote_port": self.port,
                }
        else:
            # SGLang 0.5.23: sglext.routed_experts, base64 of int32 [prompt + output - 1, layers, top_k]
            if body.get("return_routed_experts") and bad != "!noroute":
                text = base64.b64encode(np.ascontiguousarray(ids, dtype="<i4").tobytes()).decode()
                out["sglext"] = {"routed_experts": "@@not base64@@" if bad == "!b64" else text}
        reply = json.dumps(out).encode()
        if not bad and "bootstrap_room" not in body:  # the same request body: the same reply, from the cache
            if len(self._replies) >= 4096:
                self._replies.clear()
            self._replies[key] = reply
        await write_response(writer, 200, reply)
        return True

    # ---- decode ----------------------------------------------------------------------------------
    async def _decode(
        self, body: dict[str, Any], headers: dict[str, str], path: str, writer: asyncio.StreamWriter
    ) -> None:
        raw = headers.get("x-data-parallel-rank")
        try:
            rank = int(raw) if raw is not None else None
        except ValueError:
            rank = None
        if rank is not None and not 0 <= rank < self.dp_size:  # vLLM input_processor.py refuses it so
            msg = f"data_parallel_rank {rank} is out of range [0, {self.dp_size})."
            await write_response(writer, 400, json.dumps({"error": {"message": msg}}).encode())
            return
        chat = path.endswith("/chat/completions")
        rec = {
            "rank": rank,
            "prompt": prompt_of(body),
            "request_id": headers.get("x-request-id"),
            "kv_transfer_params": body.get("kv_transfer_params"),
            "bootstrap_room": body.get("bootstrap_room"),
            "port": self.port,
            "finished": False,
        }
        self.served.append(rec)
        words = [f"t{i} " for i in range(self.tokens)]
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(self.token_delay_s * self.tokens)
            if self.killed:
                return
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(words)}
            else:
                choice["text"] = "".join(words)
            out = {"id": "cmpl-standin", "object": obj, "model": "m", "choices": [choice]}
            rec["finished"] = True
            await write_response(writer, 200, json.dumps(out).encode())
            return
        cw = ChunkedWriter(writer)
        await cw.start(200, "text/event-stream")
        for i, w in enumerate(words):
            if i == 1 and self.gate is not None:
                await self.gate.wait()
            if i and self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if self.killed:
                return
            last = i == len(words) - 1
            delta: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
            if chat:
                delta["delta"] = {"content": w}
            else:
                delta["text"] = w
            chunk = {"id": "cmpl-standin", "object": obj + ("" if not chat else ".chunk"), "choices": [delta]}
            await cw.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await cw.write(b"data: [DONE]\n\n")
        rec["finished"] = True
        await cw.end()


class BackgroundLoop:
    """An asyncio event loop in a daemon thread: ``run(coro)`` waits for a coroutine's result there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
