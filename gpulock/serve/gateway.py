"""The endpoints of ``gpulock serve`` (``Gateway``): each reads its request, asks the one
dispatch (``gpulock.serve.dispatch``) and renders the answer in the shape of the API it came in by
(the app that routes to them: ``gpulock.serve.app``; the GET endpoints that say what it holds:
``gpulock.serve.listings``).

Every request has its body read up to ``max_body`` (413 past it) and its JSON checked (400)
against its endpoint's shape (``gpulock.serve.schema``).  Every chat, whichever API it came in by
(chat completions, Responses, Messages), is one ``Ask`` through the one dispatch
(``Gateway._face``).  While a request waits for its place (the line), the client's disconnect is
watched: a client that hangs up leaves the line at once.  While an answer streams, the same watch
stops the stream and frees the place at once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gpulock.core.settings import Settings
from gpulock.core.units import parse_duration
from gpulock.router.backends import BackendError
from gpulock.serve import api_anthropic, api_ollama, api_openai, api_responses, schema, validator
from gpulock.serve.asgi import Streamed, read_body, unless_hung_up
from gpulock.serve.dispatch import Dispatcher
from gpulock.serve.engines import Answer, Ask, Usage
from gpulock.serve.errors import ApiError, bad_request
from gpulock.serve.line import QueueFull
from gpulock.serve.listings import Listings
from gpulock.serve.opened import Opened

log = logging.getLogger("gpulock.serve")
AGENT_MAX = 64


class Gateway(Listings):
    """The endpoints, around one Dispatcher."""

    def __init__(
        self, settings: Settings, dispatcher: Dispatcher, max_body: int, read_timeout: float
    ) -> None:
        self.settings = settings
        self.d = dispatcher
        self.max_body = max_body
        self.read_timeout = read_timeout

    # --- request parts -----------------------------------------------------------------------

    async def body(self, request: Request, shape: validator.Schema) -> dict[str, Any]:
        """The request's JSON body, read within ``max_body`` and ``read_timeout``, its nesting
        bounded, and checked against its endpoint's ``shape`` (``gpulock.serve.schema``)."""
        data = await read_body(request, self.max_body, self.read_timeout)
        try:
            obj = validator.loads(data)
            validator.validate(obj, shape)
        except validator.Invalid as e:
            raise bad_request(e.message, e.param) from None
        assert isinstance(obj, dict)
        return obj

    @staticmethod
    def agent(request: Request) -> str:
        name = request.headers.get("x-gpulock-agent", "").strip()
        if not name:
            return "gpulock-serve"
        if len(name) > AGENT_MAX or not name.isprintable():
            raise bad_request(f"X-Gpulock-Agent: printable text of at most {AGENT_MAX} characters")
        return name

    @staticmethod
    def deadline(request: Request) -> float | None:
        text = request.headers.get("x-gpulock-deadline")
        if text is None:
            return None
        try:
            s = parse_duration(text.strip(), key="X-Gpulock-Deadline")
        except ValueError as e:
            raise bad_request(str(e)) from None
        if s < 0:
            raise bad_request("X-Gpulock-Deadline must be >= 0")
        return s

    # --- the generation endpoints ------------------------------------------------------------

    async def openai_chat(self, request: Request) -> Response:
        return await self._openai(request, api_openai.chat_ask, schema.OPENAI_CHAT)

    async def openai_completions(self, request: Request) -> Response:
        return await self._openai(request, api_openai.completion_ask, schema.OPENAI_COMPLETION)

    async def openai_embeddings(self, request: Request) -> Response:
        return await self._openai(request, api_openai.embed_ask, schema.OPENAI_EMBEDDINGS)

    async def openai_responses(self, request: Request) -> Response:
        body = await self.body(request, schema.RESPONSES)
        ask = api_responses.ask(body)
        return await self._face(
            request,
            ask,
            lambda a: api_responses.answer(ask, body, a),
            lambda pieces, usage, calls: api_responses.sse(ask, body, pieces, usage, calls),
            api_responses.stream_error,
        )

    async def anthropic_messages(self, request: Request) -> Response:
        body = await self.body(request, schema.ANTHROPIC_MESSAGES)
        ask = api_anthropic.ask(body)
        return await self._face(
            request,
            ask,
            lambda a: api_anthropic.answer(ask, a),
            lambda pieces, usage, calls: api_anthropic.sse(ask, pieces, usage, calls),
            api_anthropic.stream_error,
        )

    async def _face(
        self,
        request: Request,
        ask: Ask,
        whole: Callable[[Answer], dict[str, Any]],
        events: Callable[
            [AsyncIterator[str], Usage, tuple[dict[str, Any], ...]], AsyncIterator[bytes]
        ],
        error: Callable[[ApiError], bytes],
        media: str = "text/event-stream",
    ) -> Response:
        """A chat of any API through the one dispatch: ``whole`` renders an answer in the API's
        shape, ``events`` its stream (the pieces, the usage, any tool calls), ``error`` a
        stream's error event.  A request with tools is answered whole even when it asks for a
        stream (tool calls arrive whole): its stream then carries the answer in one go."""
        ask = api_openai.without_unused_tools(ask)
        agent = self.agent(request)
        at_once = ask.stream and bool(ask.tools)
        opened = await self._open(request, replace(ask, stream=False) if at_once else ask, agent)
        headers = opened.meta.headers()
        a = opened.answer
        if a is not None:
            self.d.account(opened, agent, a.usage.tokens_in, a.usage.tokens_out)
            if not ask.stream:
                return JSONResponse(whole(a), headers=headers)
            chunks = events(_once(a.text), a.usage, a.tool_calls)
        else:
            chunks = self._guard(events(opened.rest(), opened.usage, ()), opened, agent, error)
        return Streamed(chunks, media, {**headers, "Cache-Control": "no-cache"})

    async def _openai(
        self, request: Request, parse: Callable[[dict[str, Any]], Ask], shape: validator.Schema
    ) -> Response:
        body = await self.body(request, shape)
        ask = parse(body)
        if ask.kind == "chat":
            with_usage = api_openai.include_usage(body)
            return await self._face(
                request,
                ask,
                lambda a: api_openai.answer(ask, ask.model, a),
                lambda p, u, calls: api_openai.sse(ask, ask.model, p, u, with_usage, calls),
                api_openai.stream_error,
            )
        agent = self.agent(request)
        opened = await self._open(request, ask, agent)
        headers = opened.meta.headers()
        if ask.kind == "embed":
            self.d.account(opened, agent, opened.tokens_in, 0)
            obj = api_openai.embeddings(ask, ask.model, opened.vectors, opened.tokens_in)
            return JSONResponse(obj, headers=headers)
        if not ask.stream:
            assert opened.answer is not None
            u = opened.answer.usage
            self.d.account(opened, agent, u.tokens_in, u.tokens_out)
            return JSONResponse(api_openai.answer(ask, ask.model, opened.answer), headers=headers)
        with_usage = api_openai.include_usage(body)
        events = api_openai.sse(ask, ask.model, opened.rest(), opened.usage, with_usage)
        return Streamed(
            self._guard(events, opened, agent, api_openai.stream_error),
            "text/event-stream",
            {**headers, "Cache-Control": "no-cache"},
        )

    async def ollama_chat(self, request: Request) -> Response:
        ask = api_ollama.chat_ask(await self.body(request, schema.OLLAMA_CHAT))
        started = time.monotonic()
        return await self._face(
            request,
            ask,
            lambda a: api_ollama.answer(ask, ask.model, a, started),
            lambda p, u, calls: api_ollama.ndjson(ask, ask.model, p, u, started, calls),
            lambda e: json.dumps(e.ollama()).encode() + b"\n",
            "application/x-ndjson",
        )

    async def ollama_generate(self, request: Request) -> Response:
        body = await self.body(request, schema.OLLAMA_GENERATE)
        ask = api_ollama.generate_ask(body)
        self.agent(request)  # checked here too: a load takes no place in the line
        if not ask.prompt:
            self.d.resolve(ask.model)  # 404 for an unknown model, as Ollama answers
            return JSONResponse(api_ollama.loaded(ask.model))
        return await self._ollama(request, api_ollama.generate_ask, body)

    async def ollama_embed(self, request: Request) -> Response:
        return await self._ollama(
            request, api_ollama.embed_ask, await self.body(request, schema.OLLAMA_EMBED)
        )

    async def ollama_embeddings(self, request: Request) -> Response:
        """The older ``/api/embeddings``: one ``prompt``, one ``embedding`` back."""
        started = time.monotonic()
        body = await self.body(request, schema.OLLAMA_EMBEDDINGS)
        ask = api_ollama.embed_ask({"model": body["model"], "input": [body.get("prompt", "")]})
        agent = self.agent(request)
        opened = await self._open(request, ask, agent)
        self.d.account(opened, agent, opened.tokens_in, 0)
        obj = api_ollama.embeddings(ask.model, opened.vectors, opened.tokens_in, started)
        return JSONResponse({"embedding": obj["embeddings"][0]}, headers=opened.meta.headers())

    async def ollama_show(self, request: Request) -> Response:
        """``/api/show``: a model's details and context length (Open WebUI, Continue and the
        ``ollama`` client ask it before a chat)."""
        body = await self.body(request, schema.OLLAMA_SHOW)
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("model is required")
        _, cands = self.d.resolve(name)  # 404 in Ollama's shape for an unknown name
        return JSONResponse(api_ollama.show(name, cands[0].n_ctx, cands[0].tier))

    async def ollama_refused(self, request: Request) -> Response:
        """The model-file endpoints of Ollama (pull, push, create, copy, delete, blobs): the
        models are gpulock's routes, not files this server manages."""
        what = request.url.path.removeprefix("/api/").split("/")[0]
        raise ApiError(
            404,  # not 501: a model this server cannot fetch is, to the client, not here
            f"gpulock serve does not {what} models: its models are the tasks and candidates of "
            "the routes: config (GET /api/tags lists them)",
            code="not_implemented",
        )

    async def _ollama(
        self,
        request: Request,
        parse: Callable[[dict[str, Any]], Ask],
        body: dict[str, Any],
    ) -> Response:
        started = time.monotonic()
        ask = parse(body)
        agent = self.agent(request)
        opened = await self._open(request, ask, agent)
        headers = opened.meta.headers()
        if ask.kind == "embed":
            self.d.account(opened, agent, opened.tokens_in, 0)
            obj = api_ollama.embeddings(ask.model, opened.vectors, opened.tokens_in, started)
            return JSONResponse(obj, headers=headers)
        if not ask.stream:
            assert opened.answer is not None
            u = opened.answer.usage
            self.d.account(opened, agent, u.tokens_in, u.tokens_out)
            obj = api_ollama.answer(ask, ask.model, opened.answer, started)
            return JSONResponse(obj, headers=headers)
        lines = api_ollama.ndjson(ask, ask.model, opened.rest(), opened.usage, started)
        return Streamed(
            self._guard(lines, opened, agent, lambda e: json.dumps(e.ollama()).encode() + b"\n"),
            "application/x-ndjson",
            headers,
        )

    async def _open(self, request: Request, ask: Ask, agent: str) -> Opened:
        deadline = self.deadline(request)
        try:
            # A request a peer forwarded (cluster) runs here: no second hop.
            local_only = "x-gpulock-from" in request.headers
            opened = await unless_hung_up(
                request,
                self.d.open(ask, agent=agent, deadline_s=deadline, local_only=local_only),
            )
            request.state.meta = opened.meta  # for the gateway-request event
            return opened
        except QueueFull as e:
            raise ApiError(
                429,
                f"too many requests waiting: {e}",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None

    async def _guard(
        self,
        chunks: AsyncIterator[bytes],
        opened: Opened,
        agent: str,
        render: Callable[[ApiError], bytes],
    ) -> AsyncIterator[bytes]:
        """A stream that fails midway ends with an error event in the API's shape."""
        try:
            async for b in chunks:
                yield b
            self.d.account(opened, agent, opened.usage.tokens_in, opened.usage.tokens_out)
        except ApiError as e:
            yield render(e)
        except BackendError as e:
            log.info("stream of %s broke off: %s", opened.meta.model, e.short)
            self.d.broke(opened, agent, e)
            msg = f"{opened.meta.model}: the answer broke off mid-stream ({e.short})"
            yield render(ApiError(502, msg, type="server_error", code="upstream_broke_off"))
        except Exception as e:
            log.warning("stream of %s broke off: %s", opened.meta.model, type(e).__name__)
            self.d.broke(opened, agent, BackendError("server", type(e).__name__))
            msg = f"{opened.meta.model}: the answer broke off mid-stream ({type(e).__name__})"
            yield render(ApiError(502, msg, type="server_error", code="upstream_broke_off"))
        finally:
            self.d.hung_up(opened, agent)  # nothing when counted above
            await opened.close()

    def measured(self, request: Request, response: Response, duration_s: float) -> None:
        """One ``gateway-request`` event: what the metrics' request histogram counts.  For a
        stream, the time to its first piece (the response's start).  Labels stay bounded: a
        name that resolved to nothing is not one of them."""
        meta = getattr(request.state, "meta", None)
        self.settings.emit(
            "gateway-request",
            task=meta.task if meta is not None else "",
            tier=meta.tier if meta is not None else "",
            model=meta.model if meta is not None else "",
            outcome=_outcome(response.status_code, response.headers.get("x-gpulock-refused")),
            status=response.status_code,
            duration_s=round(duration_s, 6),
        )


async def _once(text: str) -> AsyncIterator[str]:
    """A whole answer's text as a stream of one piece (none when it is empty)."""
    if text:
        yield text


def _outcome(status_code: int, refused: str | None = None) -> str:
    """A request's outcome, as a bounded label (``refused``: the accounting's limit, if any)."""
    if status_code < 400:
        return "ok"
    if refused in ("budget", "rate"):
        return "over-budget" if refused == "budget" else "rate-limited"
    return {429: "queue-full", 499: "hung-up", 504: "deadline"}.get(
        status_code, "refused" if status_code < 500 else "error"
    )
