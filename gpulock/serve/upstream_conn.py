"""One connection of serve's client to an upstream (``gpulock.serve.upstream``), and the answer
being read on it: an asyncio ``Protocol`` whose bytes feed httptools' parser, whose callbacks
fill in the answer's status, headers and body as they come.

The reader (``upstream.Response``) waits on two futures, ``head`` (the answer's head is in) and
``waiter`` (more body, its end, or an error); a body held unread past ``HIGH_WATER`` bytes pauses
the socket until the reader takes it.  An answer without a length ends where its connection
does; any other close before the end is an ``UpstreamError`` of kind ``"connection"``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

import httptools

HIGH_WATER = 1 << 20  # bytes of an answer held unread before the socket is paused


class UpstreamError(Exception):
    """A request that got no (whole) answer: ``kind`` is "connection", "timeout" or
    "protocol" (not HTTP/1.1 as spoken here)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int
    host_header: bytes


class Conn(asyncio.Protocol):
    """One connection, and the answer being read on it (httptools' callbacks)."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.reset()

    def reset(self) -> None:
        """Ready for the next answer on this connection (a kept-alive one, used again)."""
        self.status = 0
        self.headed = False  # the answer's head is in
        self.headers: dict[str, str] = {}
        self.head: asyncio.Future[None] | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.waiter: asyncio.Future[None] | None = None
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self.paused = False

    def usable(self, now: float, keepalive_s: float) -> bool:
        t = self.transport
        return t is not None and not t.is_closing() and now - self.idle_since < keepalive_s

    # --- asyncio ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError("protocol", f"not an HTTP/1.1 answer ({e})"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.complete:
            return
        if self.headed and self._to_close():
            self.complete = True  # an answer that ends where its connection does
            self._wake()
            return
        self._fail(UpstreamError("connection", "the connection was closed before the answer"))

    # --- httptools ---

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headed = True
        self._wake_head()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and self.transport is not None and not self.paused:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def on_message_complete(self) -> None:
        # Asked here: once this callback returns, the parser has moved on to the next message.
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True
        self._wake_head()
        self._wake()

    # --- the reader's side ---

    def _to_close(self) -> bool:
        """An answer without a length: its body ends with the connection."""
        return (
            "content-length" not in self.headers
            and "chunked" not in self.headers.get("transfer-encoding", "").lower()
        )

    def _fail(self, e: UpstreamError) -> None:
        if self.error is None:
            self.error = e
        self._wake_head()
        self._wake()

    def _wake_head(self) -> None:
        h = self.head
        if h is not None and not h.done():
            h.set_result(None)

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
