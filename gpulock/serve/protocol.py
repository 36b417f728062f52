"""uvicorn's HTTP protocol (httptools) with the limits a gateway in front of a GPU needs.

uvicorn bounds neither the size of a request's headers nor the time they take to arrive: a
client sending 20 KB of headers is served, and one that sends a header byte a second (or
connects and sends nothing) holds its connection for ever.  This subclass adds both:

* headers (request line included) past ``max_header`` bytes: ``431`` in the API's own error
  shape, and the connection closed;
* a request whose headers are not all in ``read_timeout`` seconds after its first byte (or
  after the connection opened): ``408``, closed.  The body's own timeout is the app's
  (``gpulock.serve.gateway``), which knows the endpoint;
* a request the parser refuses (not HTTP): ``400`` in the same shape, not uvicorn's plain text.

The hooks used (``on_message_begin``, ``on_url``, ``on_header``, ``on_headers_complete``,
``send_400_response``) are uvicorn's parser callbacks, stable since 0.11.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gpulock.serve.errors import ApiError

log = logging.getLogger("gpulock.serve")

REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class TooLarge(Exception):
    """Raised from a parser callback: the headers passed ``max_header``."""


class GuardedHttp(HttpToolsProtocol):
    """See the module doc; ``max_header`` and ``read_timeout`` are set by ``protocol()``."""

    max_header = 16 << 10
    read_timeout = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._path = b""
        self._refused: tuple[int, str] | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = False

    # --- the header timer --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._in_head = True
        self._head_timer = self.loop.call_later(self.read_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        busy = self.cycle is not None and not self.cycle.response_complete
        if busy:  # a pipelined request waits for the one before: look again later
            self._head_timer = self.loop.call_later(self.read_timeout, self._head_timed_out)
            return
        if self._head_bytes == 0 and self.cycle is None:
            self.transport.close()  # connected and said nothing: nobody to answer
            return
        t = self.read_timeout
        self._answer(408, f"the headers did not arrive within serve.read_timeout ({t:g} s)")

    # --- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._path = b""
        if not self._in_head:
            self._arm()

    def on_url(self, url: bytes) -> None:
        self._path += url
        self._grow(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The keep-alive timer now runs; the next request's first byte arms ours again.

    def _grow(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.max_header and self._refused is None:
            self._refused = (
                431,
                f"the request's headers are over {self.max_header} bytes (serve.max_header)",
            )
            raise TooLarge

    # --- refusals ----------------------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        """Called by uvicorn when the parser fails (our ``TooLarge`` included)."""
        status, text = self._refused or (400, "not a valid HTTP/1.1 request")
        self._answer(status, text)

    def _answer(self, status: int, message: str) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        path = self._path.split(b"?", 1)[0].decode("latin-1")
        body = json.dumps(ApiError(status, message).body(path)).encode()
        head = (
            f"HTTP/1.1 {status} ".encode()
            + REASONS.get(status, b"Error")
            + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\nconnection: close\r\n\r\n"
        )
        log.info("refused a request with %d: %s", status, message)
        self.transport.write(head + body)
        self.transport.close()


def protocol(*, max_header: int, read_timeout: float) -> type[GuardedHttp]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    return type(
        "GuardedHttp",
        (GuardedHttp,),
        {"max_header": max_header, "read_timeout": read_timeout},
    )
