"""serve's client to the servers behind it (OpenAI-compatible upstreams, cluster peers): HTTP/1.1
on asyncio's transports, parsed by httptools (uvicorn's parser, already in the ``serve`` extra),
over kept-alive connections, one pool per origin.

aiohttp's client cost the gateway 110 us of CPU a request at 64 clients, a quarter of all it
spent (``bench/serve.py``; its cookie jar, tracing hooks, URL objects and header multidicts
are per request whatever is switched off); this one costs 37 us for the same request.  It does
only what serve asks of an upstream:

* a ``POST`` of a JSON body (``Content-Length``), its answer read whole (``Response.read``) or
  line by line as it comes (``Response.lines``: server-sent events), by ``Content-Length``,
  chunked, or to the connection's close;
* ``https`` with the system's certificate authorities (``ssl.create_default_context``; the
  ``SSL_CERT_FILE`` variable names another bundle), ``http``;
* timeouts (``Timeouts``): to connect, of silence (the most time between two reads, the
  response's head included: a frozen peer), and in all;
* a connection goes back to its pool when its answer was read to the end and the server keeps
  it alive; an answer left half-read (a client that hung up, a timeout) closes it.  An idle
  connection is used again for ``keepalive_s`` (30 s, as aiohttp's was).

No redirects (an OpenAI-compatible API answers where it is asked), no compression (none is
asked for), no proxies and no cookies (aiohttp's session used none either).  Errors are
``UpstreamError`` with a ``kind``: ``"connection"``, ``"timeout"`` or ``"protocol"``.  One
connection and the answer being read on it (httptools' callbacks): ``gpulock.serve.upstream_conn``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gpulock.serve.upstream_conn import Conn, Origin, UpstreamError

__all__ = ["Client", "Response", "Timeouts", "UpstreamError"]  # UpstreamError: upstream_conn's

USER_AGENT = b"gpulock-serve"


@dataclass(frozen=True, slots=True)
class Timeouts:
    total_s: float | None = None  # the whole request, its answer's last byte included
    connect_s: float | None = 10.0
    read_s: float | None = None  # silence: the most time between two reads


async def _wait(fut: asyncio.Future[None], until: float | None) -> None:
    """``fut``, or a TimeoutError at loop time ``until`` (a timer, not a task)."""
    if until is None:
        await fut
        return
    loop = asyncio.get_running_loop()

    def expire() -> None:
        if not fut.done():
            fut.set_exception(TimeoutError())

    timer = loop.call_at(until, expire)
    try:
        await fut
    finally:
        timer.cancel()


class Response:
    """An answer's head, and its body to read (whole, or by line)."""

    def __init__(self, client: Client, conn: Conn, t: Timeouts, end: float | None) -> None:
        self._client = client
        self._conn: Conn | None = conn
        self._timeouts = t
        self._end = end  # loop time the whole request must be done by (None: no limit)
        self.status = conn.status
        self.headers: Mapping[str, str] = conn.headers

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        async for data in self._data():
            parts.append(data)
        return b"".join(parts)

    async def lines(self) -> AsyncIterator[bytes]:
        """The body line by line (``\\n`` kept), as it comes."""
        rest = b""
        async for data in self._data():
            if rest:
                data = rest + data
            *whole, rest = data.split(b"\n")
            for line in whole:
                yield line + b"\n"
        if rest:
            yield rest

    async def _data(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            return
        loop = asyncio.get_running_loop()
        try:
            while True:
                if conn.chunks:
                    yield conn.take()
                    continue
                if conn.complete:
                    break
                if conn.error is not None:
                    raise conn.error
                conn.waiter = loop.create_future()
                until = _deadline(loop.time(), self._timeouts.read_s, self._end)
                try:
                    await _wait(conn.waiter, until)
                except TimeoutError:
                    raise UpstreamError("timeout", "the answer stopped coming") from None
                finally:
                    conn.waiter = None
        except BaseException:
            self.close()
            raise
        self.close()

    def close(self) -> None:
        """Done with it: the connection back to its pool (read to the end, kept alive by the
        server), else closed."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.complete and conn.error is None and conn.keep_alive:
            self._client._release(conn)
        else:
            conn.close()


def _deadline(now: float, within_s: float | None, end: float | None) -> float | None:
    until = None if within_s is None else now + within_s
    if end is not None and (until is None or end < until):
        return end
    return until


class Client:
    """Kept-alive connections to every origin asked, and the requests made on them."""

    def __init__(self, *, keepalive_s: float = 30.0) -> None:
        self.keepalive_s = keepalive_s
        self._idle: dict[Origin, list[Conn]] = {}
        self._origins: dict[str, tuple[Origin, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    def _origin(self, url: str) -> tuple[Origin, bytes]:
        """The origin of ``url`` and its path (parsed once per URL)."""
        got = self._origins.get(url)
        if got is not None:
            return got
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise UpstreamError("protocol", f"not an http(s) URL: {url!r}")
        port = u.port or (443 if u.scheme == "https" else 80)
        default = port == (443 if u.scheme == "https" else 80)
        host = u.hostname if ":" not in u.hostname else f"[{u.hostname}]"
        header = host if default else f"{host}:{port}"
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        got = (Origin(u.scheme, u.hostname, port, header.encode("idna")), path.encode())
        if len(self._origins) < 1024:
            self._origins[url] = got
        return got

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeouts: Timeouts
    ) -> Response:
        """Send ``body`` (JSON) to ``url``; the answer once its head is in."""
        origin, path = self._origin(url)
        loop = asyncio.get_running_loop()
        now = loop.time()
        end = None if timeouts.total_s is None else now + timeouts.total_s
        head = _head(path, origin, headers, len(body))
        conn = await self._conn(origin, timeouts, end)
        conn.head = loop.create_future()
        try:
            assert conn.transport is not None
            conn.transport.write(head + body)
            until = _deadline(loop.time(), timeouts.read_s, end)
            try:
                await _wait(conn.head, until)
            except TimeoutError:
                raise UpstreamError("timeout", "no answer in time") from None
            if conn.error is not None:
                raise conn.error
        except BaseException:
            conn.close()
            raise
        conn.head = None
        return Response(self, conn, timeouts, end)

    async def _conn(self, origin: Origin, t: Timeouts, end: float | None) -> Conn:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now, self.keepalive_s):
                conn.reset()
                return conn
            conn.close()
        if self._closed:
            raise UpstreamError("connection", "the client is closed")
        loop = asyncio.get_running_loop()
        tls: Any = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        limit = _deadline(loop.time(), t.connect_s, end)
        timeout = None if limit is None else max(0.0, limit - loop.time())
        try:
            _transport, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: Conn(origin),
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls is not None else None,
                ),
                timeout,
            )
        except TimeoutError:
            raise UpstreamError("timeout", "could not connect in time") from None
        except ssl.SSLError as e:
            raise UpstreamError("connection", f"TLS: {e.reason or e}") from None
        except OSError as e:
            raise UpstreamError("connection", f"could not connect ({e.strerror or e})") from None
        return conn

    def _release(self, conn: Conn) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.origin, []).append(conn)

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()


def _head(path: bytes, origin: Origin, headers: Mapping[str, str], length: int) -> bytes:
    lines = [
        b"POST " + path + b" HTTP/1.1",
        b"Host: " + origin.host_header,
        b"User-Agent: " + USER_AGENT,
        b"Accept: */*",
        b"Content-Type: application/json",
        b"Content-Length: " + str(length).encode(),
    ]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            # A key variable holding a line break must not add headers of its own.
            raise UpstreamError("protocol", f"header {name!r}: a line break or colon in it")
        lines.append(f"{name}: {value}".encode("latin-1", "replace"))
    return b"\r\n".join(lines) + b"\r\n\r\n"
