"""The ASGI-level guards of ``gpulock serve``: the key check, errors in each API's shape, and
the watch for a client that hangs up (while its request waits, and while its answer streams).

The watch cancels the request's own task rather than racing a child task against it: measured
in ``bench/serve.py``, a child task made back-to-back requests through an aiohttp upstream
~10 ms slower.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpulock.serve.errors import ApiError

log = logging.getLogger("gpulock.serve")
T = TypeVar("T")


def error_response(e: ApiError, path: str) -> JSONResponse:
    if isinstance(e, TooLarge) and e.drain_s is not None:
        return AnswerThenDrain(e.body(path), e.status, e.headers, e.drain_s)
    return JSONResponse(e.body(path), status_code=e.status, headers=e.headers)


@dataclass(frozen=True, slots=True)
class TooLarge(ApiError):
    """A body over ``max_body``: ``drain_s`` (None: answer and close) is how long to go on
    reading what the client still sends once it has the answer (``AnswerThenDrain``)."""

    drain_s: float | None = None


class AnswerThenDrain(JSONResponse):
    """An answer sent whole at once, then the rest of the request read and dropped (up to
    ``DRAIN_MAX``, for at most ``drain_s``) before the connection closes.

    A server that closes a connection with a request body still arriving resets it, and the
    client loses the answer; one that reads the whole body first keeps a client that sent
    part of it and waits (for a ``100 Continue`` it did not ask for, say) waiting until the
    read timeout.  The answer goes out with its ``Content-Length`` while the response stays
    open (``more_body``), so the client can read it whatever it does next, and the drain
    happens behind it (a lingering close, as web servers do)."""

    def __init__(
        self, content: object, status: int, headers: dict[str, str], drain_s: float
    ) -> None:
        super().__init__(content, status_code=status, headers=headers)
        self.drain_s = drain_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        dropped = 0
        try:
            async with asyncio.timeout(self.drain_s):
                while dropped <= DRAIN_MAX:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        break
                    dropped += len(msg.get("body", b""))
                    if not msg.get("more_body"):
                        break
        except TimeoutError:
            pass
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class KeyCheck:
    """Every request needs one of the keys (compared in constant time): ``Authorization:
    Bearer KEY`` (OpenAI's and Ollama's clients), or ``x-api-key: KEY`` (Anthropic's)."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys:
            await self.app(scope, receive, send)
            return
        token = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                token = value[7:].strip()
                break
            if name == b"x-api-key":
                token = value.strip()
                break
        ok = False
        for k in self.keys:  # every key compared, in constant time each
            ok |= hmac.compare_digest(token, k)
        if ok:
            await self.app(scope, receive, send)
            return
        e = ApiError(
            401,
            "missing or wrong API key: send Authorization: Bearer KEY (or x-api-key: KEY)",
            type="invalid_request_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error_response(e, scope.get("path", ""))(scope, receive, send)


class Streamed(Response):
    """A streamed body that stops (and frees what it holds) as soon as the client hangs up."""

    def __init__(self, chunks: AsyncIterator[bytes], media_type: str, headers: dict[str, str]):
        super().__init__(None, 200, headers, media_type)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.chunks = chunks
        self.on_close: Callable[[], None] | None = None  # called once, when the stream ends

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for b in self.chunks:
                await send({"type": "http.response.body", "body": b, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        me = asyncio.current_task()
        assert me is not None
        state = {"finished": False, "hung_up": False}

        async def watch() -> None:
            await _until_hung_up(receive)
            if not state["finished"]:
                state["hung_up"] = True
                me.cancel()  # stops the stream where it is: the finally below frees its place

        watcher = asyncio.ensure_future(watch())
        try:
            await pump()
        except asyncio.CancelledError:
            if not state["hung_up"]:
                raise
            me.uncancel()
        except OSError as e:  # the connection broke while sending
            log.info("stream ended by %s", type(e).__name__)
        finally:
            state["finished"] = True
            watcher.cancel()
            try:
                close = getattr(self.chunks, "aclose", None)
                if close is not None:
                    await close()  # the answer's place is freed here, at once
            finally:
                if self.on_close is not None:
                    self.on_close()


async def _until_hung_up(receive: Receive) -> None:
    while True:
        msg: Message = await receive()
        if msg["type"] == "http.disconnect":
            return


async def unless_hung_up(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` (waiting in the line) in this task, cancelled at once if the client
    disconnects meanwhile (a watcher task cancels this one)."""
    me = asyncio.current_task()
    assert me is not None
    hung_up = False
    finished = False

    async def watch() -> None:
        nonlocal hung_up
        await _until_hung_up(request.receive)
        if not finished:  # never a stray cancel once the work is done
            hung_up = True
            me.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if hung_up:
            me.uncancel()
            raise ApiError(499, "the client closed the request") from None
        raise
    finally:
        finished = True
        watcher.cancel()


DRAIN_MAX = 64 << 20  # past max_body, read and drop up to this much more, then just close


async def read_body(request: Request, max_body: int, read_timeout: float) -> bytes:
    """The request's body: at most ``max_body`` bytes, all of it within ``read_timeout``.

    A body over ``max_body`` is answered 413 as soon as that is known: at once when its
    ``Content-Length`` says so, else when the bytes read pass it.  The answer is sent whole,
    then what the client still sends is read and dropped (``AnswerThenDrain``: up to
    ``DRAIN_MAX``, within ``read_timeout``), so the client reads the 413 whether it goes on
    sending or waits; then the connection closes (``Connection: close`` on every such answer).
    A client that asked for ``100 Continue`` has sent nothing more: answered, closed.
    """
    expects = request.headers.get("expect", "").lower() == "100-continue"
    over = TooLarge(
        413,
        f"request body over serve.max_body ({max_body} bytes)",
        code="body_too_large",
        headers={"Connection": "close"},
        drain_s=None if expects else read_timeout,
    )
    length = request.headers.get("content-length")
    declared = int(length) if length is not None and length.isdigit() else None
    if declared is not None and declared > max_body:
        raise over
    data = bytearray()
    stream = request.stream()
    try:
        async with asyncio.timeout(read_timeout):
            async for chunk in stream:
                if len(data) + len(chunk) > max_body:
                    raise over
                data += chunk
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within serve.read_timeout ({read_timeout:g} s)",
            code="timeout",
            headers={"Connection": "close"},
        ) from None
    except ClientDisconnect:
        raise ApiError(499, "the client closed the request") from None
    return bytes(data)
