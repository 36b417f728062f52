"""Any OpenAI-compatible endpoint (OpenAI, OpenRouter, vLLM, Ollama, llama.cpp's server): the
cloud tier, through the official ``openai`` client.

The API key is read from the environment variable the route names, at the moment the client is
made, and handed to the client only: it is never part of a message, an event or ``.why``.  The
client's own retries are off (``max_retries=0``): the router decides what a failure means (fall
back, cool down), and a cron agent must not sit in a hidden retry loop past its deadline.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from gpulock.core.errors import GpulockError
from gpulock.core.extras import install_hint
from gpulock.router.backends import BackendError, Result
from gpulock.router.routes import Candidate


def _openai() -> Any:
    try:
        import openai
    except ImportError as e:
        raise GpulockError(
            f"the openai client is not installed ({e})", hint=install_hint("cloud")
        ) from None
    return openai


def _retry_after(e: Any) -> float | None:
    response = getattr(e, "response", None)
    headers = getattr(response, "headers", None)
    if not headers:
        return None
    value = headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: rare enough to use the configured cooldown instead


def translate(e: BaseException) -> BackendError:
    """The openai client's exceptions as BackendError kinds; messages carry no response body."""
    openai = _openai()
    if not isinstance(e, openai.OpenAIError):
        raise e  # our own mistake (a bad keyword, say) is a bug to see, not a reason to fall back
    if isinstance(e, openai.APITimeoutError):
        return BackendError("timeout", "the request timed out")
    if isinstance(e, openai.APIConnectionError):
        return BackendError("connection", "could not connect")
    if isinstance(e, openai.RateLimitError):
        return BackendError(
            "rate-limit", "rate limited (HTTP 429)", status=429, retry_after_s=_retry_after(e)
        )
    if isinstance(e, openai.APIStatusError):
        status = int(e.status_code)
        kind = "server" if status >= 500 else "client"
        return BackendError(kind, f"HTTP {status}", status=status, retry_after_s=_retry_after(e))
    return BackendError("client", f"{type(e).__name__}")


class OpenAIBackend:
    def __init__(self, c: Candidate) -> None:
        self.candidate = c
        self._client: Any = None

    @property
    def loaded(self) -> bool:
        return False

    def _get(self) -> Any:
        if self._client is None:
            c = self.candidate
            key = os.environ.get(c.api_key_env or "")
            if not key:
                raise BackendError(
                    "client", f"environment variable {c.api_key_env} is not set ({c.key})"
                )
            self._client = _openai().OpenAI(
                base_url=c.base_url, api_key=key, timeout=c.timeout_s, max_retries=0
            )
        return self._client

    def complete(self, prompt: str, *, wait_s: float | None, label: str, **kw: Any) -> Result:
        client = self._get()
        try:
            r = client.completions.create(model=self.candidate.model, prompt=prompt, **kw)
        except Exception as e:
            raise translate(e) from None
        return _result(r, r.choices[0].text if r.choices else "")

    def chat(
        self, messages: list[dict[str, Any]], *, wait_s: float | None, label: str, **kw: Any
    ) -> Result:
        client = self._get()
        try:
            r = client.chat.completions.create(model=self.candidate.model, messages=messages, **kw)
        except Exception as e:
            raise translate(e) from None
        text = (r.choices[0].message.content or "") if r.choices else ""
        return _result(r, text)

    def stream(
        self,
        kind: str,
        payload: Any,
        *,
        wait_s: float | None,
        label: str,
        usage: dict[str, int],
        **kw: Any,
    ) -> Iterator[str]:
        client = self._get()
        model = self.candidate.model
        # Without it OpenAI sends no usage when streaming: the prompt's tokens (and their cost,
        # against the budget) would go uncounted.  Servers that do not know it ignore it.
        kw.setdefault("stream_options", {"include_usage": True})
        try:
            if kind == "chat":
                chunks = client.chat.completions.create(
                    model=model, messages=payload, stream=True, **kw
                )
            else:
                chunks = client.completions.create(model=model, prompt=payload, stream=True, **kw)
            n = 0
            for chunk in chunks:
                u = getattr(chunk, "usage", None)
                if u is not None:
                    usage["tokens_in"] = int(u.prompt_tokens or 0)
                    usage["tokens_out"] = int(u.completion_tokens or 0)
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                piece = getattr(choice, "text", None)
                if piece is None:
                    delta = getattr(choice, "delta", None)
                    piece = getattr(delta, "content", None)
                if piece:
                    n += 1
                    yield piece
            usage.setdefault("tokens_out", n)
        except BackendError:
            raise
        except Exception as e:
            raise translate(e) from None

    def unload(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            client.close()


def _result(r: Any, text: str) -> Result:
    u = getattr(r, "usage", None)
    tokens_in = int(getattr(u, "prompt_tokens", 0) or 0)
    tokens_out = int(getattr(u, "completion_tokens", 0) or 0)
    return Result(text, tokens_in, tokens_out, r)
