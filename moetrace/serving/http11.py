"""Minimal HTTP/1.1 over asyncio streams, standard library only: what the proxy needs and no more.

Server side: ``read_request`` parses one request (``Content-Length`` or chunked body; keep-alive),
``write_response`` answers with a whole body, ``ChunkedWriter`` streams one (``Transfer-Encoding:
chunked``, as the engines' FastAPI servers stream Server-Sent Events). Client side: ``Upstream``, one
engine server's base URL with a pool of kept-alive connections; ``Upstream.request`` returns a
``Response`` whose body is read whole (``read``) or chunk by chunk (``iter_body``). A connection goes
back to the pool only after its body was read to the end and the server did not ask to close it.

Limits (bytes): a request or response head 64 KiB, a request body ``max_body``. Times are seconds.
``within(awaitable, seconds)`` bounds a wait: ``asyncio.timeout`` where it exists (Python ≥ 3.11: a
timer, no extra task per wait as ``asyncio.wait_for`` makes before 3.12).

Out of scope: TLS (run the proxy next to the engines, or behind a TLS terminator), HTTP/2,
``Expect: 100-continue``, pipelining.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")

__all__ = [
    "ChunkedWriter",
    "HttpError",
    "Request",
    "Response",
    "Upstream",
    "read_request",
    "within",
    "write_response",
]

MAX_HEAD = 64 * 1024
REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


if sys.version_info >= (3, 11):

    async def within(aw: Awaitable[T], seconds: float) -> T:
        """``await aw``, or ``TimeoutError`` after ``seconds``."""
        async with asyncio.timeout(seconds):
            return await aw

else:

    async def within(aw: Awaitable[T], seconds: float) -> T:
        """``await aw``, or ``TimeoutError`` after ``seconds``."""
        return await asyncio.wait_for(aw, seconds)


class HttpError(Exception):
    """A peer spoke something that is not HTTP/1.1 as read here (the message says what)."""


@dataclass
class Request:
    method: str
    path: str  # without the query string
    headers: dict[str, str]  # lower-cased names
    body: bytes
    keep_alive: bool


async def _read_head(reader: asyncio.StreamReader) -> list[str] | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None  # the peer closed between requests
        raise HttpError("connection closed inside a message head") from None
    except asyncio.LimitOverrunError:
        raise HttpError(f"message head over {MAX_HEAD} bytes") from None
    if len(raw) > MAX_HEAD:
        raise HttpError(f"message head over {MAX_HEAD} bytes")
    return raw.decode("latin-1").split("\r\n")[:-2]


def _headers(lines: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpError(f"malformed header line {line[:80]!r}")
        out[name.strip().lower()] = value.strip()
    return out


async def _read_chunked(reader: asyncio.StreamReader, limit: int) -> AsyncIterator[bytes]:
    total = 0
    while True:
        size_line = await reader.readline()
        if not size_line.endswith(b"\n"):
            raise HttpError("connection closed inside a chunked body")
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise HttpError(f"malformed chunk size {size_line[:40]!r}") from None
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return
        total += size
        if total > limit:
            raise HttpError(f"body over {limit} bytes")
        try:
            data = await reader.readexactly(size)
            await reader.readexactly(2)
        except asyncio.IncompleteReadError:
            raise HttpError("connection closed inside a chunk") from None
        yield data


async def read_request(reader: asyncio.StreamReader, *, max_body: int) -> Request | None:
    """One request from a client connection; None when the client closed it between requests."""
    lines = await _read_head(reader)
    if lines is None:
        return None
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(f"malformed request line {lines[0][:80]!r}")
    method, target, version = parts
    headers = _headers(lines[1:])
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b"".join([c async for c in _read_chunked(reader, max_body)])
    else:
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            raise HttpError(f"malformed Content-Length {headers['content-length']!r}") from None
        if length > max_body:
            raise HttpError(f"body over {max_body} bytes")
        try:
            body = await reader.readexactly(length) if length else b""
        except asyncio.IncompleteReadError:
            raise HttpError("connection closed inside a request body") from None
    conn = headers.get("connection", "").lower()
    keep = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
    return Request(method=method, path=target.split("?", 1)[0], headers=headers, body=body, keep_alive=keep)


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def write_response(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    *,
    content_type: str = "application/json",
    keep_alive: bool = True,
    extra: dict[str, str] | None = None,
) -> None:
    """A whole response."""
    headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
    headers.update(extra or {})
    if not keep_alive:
        headers["Connection"] = "close"
    writer.write(_head(status, headers) + body)
    await writer.drain()


class ChunkedWriter:
    """A streamed response (``Transfer-Encoding: chunked``): ``start``, ``write`` each piece, ``end``."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.started = False
        self.bytes_sent = 0

    async def start(self, status: int, content_type: str, *, keep_alive: bool = True) -> None:
        headers = {"Content-Type": content_type, "Transfer-Encoding": "chunked", "Cache-Control": "no-cache"}
        if not keep_alive:
            headers["Connection"] = "close"
        self.writer.write(_head(status, headers))
        self.started = True
        await self.writer.drain()

    async def write(self, data: bytes) -> None:
        if data:
            self.writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.bytes_sent += len(data)
            await self.writer.drain()

    async def end(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()


@dataclass
class Response:
    """An upstream response; read its body with ``read`` or ``iter_body`` (once)."""

    status: int
    headers: dict[str, str]
    _reader: asyncio.StreamReader = field(repr=False)
    _writer: asyncio.StreamWriter | None = field(repr=False)  # None once given back or dropped
    _upstream: Upstream = field(repr=False)
    _reusable: bool = field(repr=False, default=True)
    _done: bool = field(repr=False, default=False)

    async def iter_body(self, *, limit: int = 1 << 30) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (a chunked body: one per chunk)."""
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                async for c in _read_chunked(self._reader, limit):
                    yield c
            elif "content-length" in self.headers:
                left = int(self.headers["content-length"])
                if left > limit:
                    raise HttpError(f"body over {limit} bytes")
                while left > 0:
                    data = await self._reader.read(min(left, 1 << 16))
                    if not data:
                        raise HttpError("connection closed inside a response body")
                    left -= len(data)
                    yield data
            else:  # until the server closes
                self._reusable = False
                while data := await self._reader.read(1 << 16):
                    yield data
            self._done = True
        finally:
            self.close()

    async def read(self, *, limit: int = 1 << 30) -> bytes:
        """The whole body (a ``Content-Length`` one in one read, without joining pieces)."""
        length = self.headers.get("content-length")
        if length is None or self.headers.get("transfer-encoding", "").lower() == "chunked":
            return b"".join([c async for c in self.iter_body(limit=limit)])
        try:
            n = int(length)
            if n > limit:
                raise HttpError(f"body over {limit} bytes")
            try:
                data = await self._reader.readexactly(n) if n > 0 else b""
            except asyncio.IncompleteReadError:
                raise HttpError("connection closed inside a response body") from None
            self._done = True
            return data
        finally:
            self.close()

    def close(self) -> None:
        """Give the connection back (body read to the end) or drop it (anything else). Idempotent."""
        if self._writer is None:
            return
        w, self._writer = self._writer, None
        if self._done and self._reusable:
            self._upstream._release(self._reader, w)
        else:
            w.close()


class Upstream:
    """One engine server (``http://host:port``) with kept-alive connections."""

    def __init__(self, base_url: str, *, max_idle: int = 512) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"engine URL must be http://HOST:PORT, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.host = u.hostname
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._max_idle = max_idle

    def _release(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._idle) < self._max_idle and not writer.is_closing():
            self._idle.append((reader, writer))
        else:
            writer.close()

    def close(self) -> None:
        for _, w in self._idle:
            w.close()
        self._idle.clear()

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> Response:
        """Send one request and read the response head (the caller bounds the time with a timeout).
        A kept-alive connection that the server closed meanwhile is retried once on a new one
        (nothing was processed on it)."""
        head = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        head.append(f"Content-Length: {len(body)}")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        while True:
            reused = bool(self._idle)
            if reused:
                reader, writer = self._idle.pop()
            else:
                reader, writer = await asyncio.open_connection(self.host, self.port, limit=MAX_HEAD)
            try:
                writer.write(data)
                await writer.drain()
                lines = await _read_head(reader)
                if lines is None:
                    raise ConnectionResetError("the server closed the connection without answering")
            except (ConnectionError, HttpError):
                writer.close()
                if reused:
                    continue
                raise
            except BaseException:
                writer.close()
                raise
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                writer.close()
                raise HttpError(f"malformed status line {lines[0][:80]!r}")
            hdrs = _headers(lines[1:])
            reusable = hdrs.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
            return Response(int(parts[1]), hdrs, reader, writer, self, _reusable=reusable)
