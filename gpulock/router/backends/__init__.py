"""Backends: one way each to run a candidate (llama.cpp in this process, an OpenAI-compatible API).

A backend answers ``complete``/``chat`` with a ``Result``, or raises ``BackendError`` whose
``kind`` tells the router whether falling back and cooling down make sense.  Heavy imports
(llama_cpp, openai) happen inside the backend modules, when a candidate of theirs is first used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# What went wrong, for the fallback and the cooldown: every kind falls back to the next candidate.
# "request": this request cannot be served by this candidate (a prompt longer than its context);
# the next candidate may serve it, and the next request may fit: no cooldown.
KINDS = (
    "load",
    "oom",
    "rate-limit",
    "server",
    "timeout",
    "connection",
    "client",
    "busy",
    "request",
)


@dataclass(frozen=True, slots=True)
class Result:
    text: str
    tokens_in: int
    tokens_out: int
    raw: Any = None  # the backend's own response, for callers who need more


class BackendError(Exception):
    """A candidate failed; the router falls back to the next and cools this one down."""

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        status: int | None = None,
        retry_after_s: float | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.retry_after_s = retry_after_s
        # Safe to log: set only by local backends (llama.cpp's own words), never from an HTTP
        # body, which may echo a request's credentials.
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild,
            (self.kind, str(self), self.status, self.retry_after_s, self.detail),
        )

    @property
    def short(self) -> str:
        """What may go into events and ``.why``: the kind and status, never a response body."""
        return f"{self.kind}" + (f" (HTTP {self.status})" if self.status else "")


def _rebuild(
    kind: str, message: str, status: int | None, retry: float | None, detail: str | None
) -> BackendError:
    return BackendError(kind, message, status=status, retry_after_s=retry, detail=detail)
