"""What a request can be refused with: one error, rendered in each API's own shape.

OpenAI's: ``{"error": {"message", "type", "param", "code"}}``; Ollama's: ``{"error": "..."}``;
Anthropic's (``/v1/messages``): ``{"type": "error", "error": {"type", "message"}}``, its type
named by the status as Anthropic's API names it.
Messages name what was wrong and, for an unknown model, the known ones; they never carry a
traceback, a key or an upstream response body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpulock.core.errors import known_hint


@dataclass(frozen=True, slots=True)
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def openai(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def ollama(self) -> dict[str, object]:
        return {"error": self.message}

    def anthropic(self) -> dict[str, Any]:
        other = "api_error" if self.status >= 500 else "invalid_request_error"
        kind = ANTHROPIC_TYPES.get(self.status, other)
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body(self, path: str) -> dict[str, object]:
        """In the shape of the API ``path`` came in by: ``/api/...``: Ollama's,
        ``/v1/messages``: Anthropic's, else OpenAI's."""
        if path.startswith("/api/"):
            return self.ollama()
        if path == "/v1/messages" or path.startswith("/v1/messages/"):
            return self.anthropic()
        return self.openai()


# Anthropic's error types by HTTP status (its API reference, "Errors").
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, code="invalid_request", param=param)


def unknown_model(model: str, known: list[str]) -> ApiError:
    listed = (
        known_hint(model, known, "known models")
        if known
        else "known models: none (add a routes: section to the config)"
    )
    return ApiError(
        404,
        f"model {model!r} not found; {listed}",
        code="model_not_found",
        param="model",
    )
