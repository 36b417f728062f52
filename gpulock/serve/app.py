"""The HTTP side of ``gpulock serve``: the Starlette app, its routes, and the guard every
endpoint runs in (the endpoints: ``gpulock.serve.gateway``; the ASGI guards before them:
``gpulock.serve.asgi``).

Every request passes the key check (when ``api_keys_env`` is set); every refusal is rendered in
the shape of the API it came in by (``/api/...``: Ollama's, ``/v1/messages``: Anthropic's,
everything else: OpenAI's), never as a traceback; every generation request is counted in a
``gateway-request`` event; the write-behind holds its events until no request is in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from gpulock.core.errors import GpulockError
from gpulock.core.settings import Settings
from gpulock.serve.asgi import KeyCheck, Streamed, error_response
from gpulock.serve.dispatch import Dispatcher
from gpulock.serve.errors import ApiError
from gpulock.serve.gateway import Gateway
from gpulock.serve.writebehind import WriteBehind

log = logging.getLogger("gpulock.serve")


def build_app(
    settings: Settings,
    dispatcher: Dispatcher,
    *,
    keys: tuple[str, ...],
    max_body: int,
    read_timeout: float = 30.0,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
) -> ASGIApp:
    g = Gateway(settings, dispatcher, max_body, read_timeout)
    wb = WriteBehind(settings, on_idle=dispatcher.idle)
    routes = _routes(g, _guarding(g, wb))

    async def not_found(request: Request, exc: Exception) -> Response:
        code = getattr(exc, "status_code", 404)
        msg = "no such endpoint" if code == 404 else "method not allowed"
        return error_response(ApiError(code, f"{msg}: {request.url.path}"), request.url.path)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        wb.start()
        try:
            yield
            if on_shutdown is not None:
                await on_shutdown()
        finally:
            wb.close()

    app = Starlette(
        routes=routes,
        exception_handlers={404: not_found, 405: not_found},
        lifespan=lifespan,
    )
    return KeyCheck(app, keys)


def _guarding(g: Gateway, wb: WriteBehind) -> Callable[..., Any]:
    """The wrapper every endpoint runs in: a refusal in the API's shape, never a traceback; the
    request in flight for the write-behind until its response (or its stream) ends."""

    def guarded(fn: Callable[[Request], Awaitable[Response]], *, measured: bool = False) -> Any:
        """``measured``: a generation endpoint, counted in a ``gateway-request`` event."""

        async def endpoint(request: Request) -> Response:
            started = time.monotonic()
            wb.begin()
            try:
                response = await fn(request)
            except ApiError as e:
                response = error_response(e, request.url.path)
            except GpulockError as e:  # gpulock's own refusals say what is wrong, in words
                err = ApiError(503, str(e), type="server_error", code="unavailable")
                response = error_response(err, request.url.path)
            except Exception as e:  # never a traceback to the client; the log says what
                log.exception("internal error on %s", request.url.path)
                msg = f"internal error ({type(e).__name__}); see the gpulock serve log"
                response = error_response(ApiError(500, msg, type="server_error"), request.url.path)
            except BaseException:  # cancelled (the server stopping): no longer in flight
                wb.end()
                raise
            if measured:
                g.measured(request, response, time.monotonic() - started)
            if isinstance(response, Streamed):
                response.on_close = wb.end  # in flight until its end
            else:
                wb.end()  # the last one in flight: its events are written before it is sent
            return response

        return endpoint

    return guarded


def _routes(g: Gateway, guarded: Callable[..., Any]) -> list[Route]:
    """Every route of the app, each endpoint in ``guarded``."""
    routes = [
        Route("/v1/chat/completions", guarded(g.openai_chat, measured=True), methods=["POST"]),
        Route("/v1/completions", guarded(g.openai_completions, measured=True), methods=["POST"]),
        Route("/v1/embeddings", guarded(g.openai_embeddings, measured=True), methods=["POST"]),
        Route("/v1/responses", guarded(g.openai_responses, measured=True), methods=["POST"]),
        Route("/v1/messages", guarded(g.anthropic_messages, measured=True), methods=["POST"]),
        Route("/v1/models", guarded(g.openai_models), methods=["GET"]),
        Route("/api/chat", guarded(g.ollama_chat, measured=True), methods=["POST"]),
        Route("/api/generate", guarded(g.ollama_generate, measured=True), methods=["POST"]),
        Route("/api/embed", guarded(g.ollama_embed, measured=True), methods=["POST"]),
        Route("/api/embeddings", guarded(g.ollama_embeddings, measured=True), methods=["POST"]),
        Route("/api/show", guarded(g.ollama_show), methods=["POST"]),
        Route("/api/tags", guarded(g.ollama_tags), methods=["GET", "HEAD"]),
        Route("/api/ps", guarded(g.ollama_ps), methods=["GET"]),
        Route("/api/version", guarded(g.ollama_version), methods=["GET"]),
        Route("/", guarded(g.root), methods=["GET", "HEAD"]),
        Route("/health", guarded(g.health), methods=["GET"]),
        Route("/gpulock/status", guarded(g.gpulock_status), methods=["GET"]),
        Route("/gpulock/cluster", guarded(g.gpulock_cluster), methods=["GET"]),
        Route("/metrics", guarded(g.metrics), methods=["GET"]),
        Route("/openapi.json", guarded(g.openapi), methods=["GET"]),
    ]
    for what in ("pull", "push", "create", "copy", "delete"):
        method = "DELETE" if what == "delete" else "POST"  # as Ollama's API has them
        routes.append(Route(f"/api/{what}", guarded(g.ollama_refused), methods=[method]))
    routes.append(Route("/api/blobs/{digest}", guarded(g.ollama_refused), methods=["POST"]))
    return routes
