"""Where a served request's answer is made when its candidate is an OpenAI-compatible server
(the cloud tier, or a local one like llama.cpp's ``llama-server``): the one ``Ask`` as a chat
completions, completions or embeddings call over HTTP, its answer or its SSE stream read back,
and every failure raised as the router's ``BackendError`` so that it falls back along the route
as ``router.get_model`` does (``gpulock.serve.engines`` makes answers in this process).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Any

from gpulock.router.backends import BackendError
from gpulock.router.routes import Candidate
from gpulock.router.tools import tool_calls_of
from gpulock.serve.engines import Answer, Ask, Usage, _flat, _passed_kw


class RemoteEngine:
    """An OpenAI-compatible server (the cloud tier, or a local one like llama.cpp's), through
    serve's one upstream client (``gpulock.serve.upstream``: kept-alive connections, httptools'
    C parser: the gateway's own cost per request stays low)."""

    def __init__(self, c: Candidate, client: Any) -> None:
        self.candidate = c
        self.client = client

    def _headers(self) -> dict[str, str]:
        c = self.candidate
        key = os.environ.get(c.api_key_env or "")
        if not key:
            raise BackendError("client", f"environment variable {c.api_key_env} is not set")
        return {"Authorization": f"Bearer {key}"}

    def _url(self, path: str) -> str:
        return (self.candidate.base_url or "").rstrip("/") + path

    def _body(self, ask: Ask) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.candidate.model}
        body.update(_passed_kw(ask))
        if ask.kind == "chat":
            body["messages"] = ask.messages
        else:
            body["prompt"] = ask.prompt
        return body

    async def _open(self, path: str, body: dict[str, Any]) -> Any:
        """The upstream's answer to ``body``, its head in (``upstream.Response``)."""
        from gpulock.serve.upstream import UpstreamError

        try:
            data = json.dumps(body, separators=(",", ":")).encode()
            return await self.client.post(self._url(path), data, self._headers(), self._timeout())
        except UpstreamError as e:
            raise _backend_error(e, "could not connect") from None

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        from gpulock.serve.upstream import UpstreamError

        async with await self._open(path, body) as r:
            try:
                data = await r.read()
            except UpstreamError as e:
                raise _backend_error(e, "the connection failed") from None
            _check(r.status, r.headers)
        try:
            return json.loads(data)
        except ValueError:
            raise BackendError("server", "the server's answer is not JSON") from None

    def _timeout(self) -> Any:
        from gpulock.serve.upstream import Timeouts

        return Timeouts(total_s=self.candidate.timeout_s, connect_s=10.0)

    async def answer(self, ask: Ask) -> Answer:
        path = "/chat/completions" if ask.kind == "chat" else "/completions"
        out = await self._post(path, self._body(ask))
        try:
            choice = out["choices"][0]
            text = choice["message"].get("content") if ask.kind == "chat" else choice["text"]
            u = out.get("usage") or {}
            usage = Usage(
                int(u.get("prompt_tokens") or 0),
                int(u.get("completion_tokens") or 0),
                choice.get("finish_reason") or "stop",
            )
            calls = tool_calls_of(choice.get("message")) if ask.kind == "chat" else ()
        except (KeyError, IndexError, TypeError, AttributeError):
            raise BackendError("server", "the server's answer is not an OpenAI response") from None
        return Answer(text or "", usage, calls)

    async def stream(self, ask: Ask, usage: Usage) -> AsyncIterator[str]:
        from gpulock.serve.upstream import UpstreamError

        path = "/chat/completions" if ask.kind == "chat" else "/completions"
        body = {**self._body(ask), "stream": True, "stream_options": {"include_usage": True}}
        async with await self._open(path, body) as r:
            try:
                if r.status >= 400:
                    await r.read()
                    _check(r.status, r.headers)
                n = 0
                finished = False  # [DONE] or a finish_reason seen: else the stream was cut
                async for raw in r.lines():  # one line at a time
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        finished = True
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        raise BackendError("server", "a stream chunk is not JSON") from None
                    u = chunk.get("usage")
                    if u:
                        usage.tokens_in = int(u.get("prompt_tokens") or 0)
                        usage.tokens_out = int(u.get("completion_tokens") or 0)
                    for choice in chunk.get("choices") or []:
                        if choice.get("finish_reason"):
                            usage.finish_reason = choice["finish_reason"]
                            finished = True
                        piece = choice.get("text")
                        if piece is None:
                            piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            n += 1
                            yield piece
                if not finished:
                    raise BackendError("connection", "the stream was cut off before [DONE]")
                if not usage.tokens_out:
                    usage.tokens_out = n
            except UpstreamError as e:
                raise _backend_error(e, "the connection failed") from None

    async def embed(self, inputs: list[str]) -> tuple[list[list[float]], int]:
        body = {"model": self.candidate.model, "input": inputs, "encoding_format": "float"}
        out = await self._post("/embeddings", body)
        try:
            data = sorted(out["data"], key=lambda d: d.get("index", 0))
            vectors = [_flat(d["embedding"]) for d in data]
            tokens = int((out.get("usage") or {}).get("prompt_tokens") or 0)
        except (KeyError, TypeError, AttributeError):
            raise BackendError("server", "the server's answer is not an OpenAI response") from None
        return vectors, tokens


def _backend_error(e: Any, connection: str) -> BackendError:
    """An ``upstream.UpstreamError`` as the BackendError kind the router falls back on."""
    if e.kind == "timeout":
        return BackendError("timeout", "the request timed out")
    if e.kind == "protocol":
        return BackendError("server", f"the server's answer is not HTTP: {e}")
    return BackendError("connection", connection)


def _check(status: int, headers: Any) -> None:
    """An HTTP error as the BackendError kind the router falls back on (never the body)."""
    if status < 400:
        return
    retry = None
    try:
        retry = float(headers.get("retry-after")) if headers.get("retry-after") else None
    except ValueError:
        pass
    if status == 429:
        raise BackendError("rate-limit", "rate limited (HTTP 429)", status=429, retry_after_s=retry)
    kind = "server" if status >= 500 else "client"
    raise BackendError(kind, f"HTTP {status}", status=status, retry_after_s=retry)
