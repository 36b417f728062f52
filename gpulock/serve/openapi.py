"""``GET /openapi.json``: the OpenAPI 3.1 document of what ``gpulock serve`` implements.

Request bodies are ``gpulock.serve.schema``'s dictionaries, the very ones the handlers validate
with; responses and errors are described here next to the code that renders them
(``gpulock.serve.api_openai``, ``gpulock.serve.api_ollama``, ``gpulock.serve.errors``).
``tests/test_serve_openapi.py`` checks that every route of the app is in the document and runs
Schemathesis against a live server.
"""

from __future__ import annotations

import copy
from typing import Any

from gpulock.serve import schema
from gpulock.serve.openapi_responses import (
    ANTHROPIC_ERROR,
    ANTHROPIC_HEADERS,
    ANTHROPIC_MESSAGE,
    ERROR_STATUSES,
    GATEWAY_HEADERS,
    OLLAMA_ANSWER,
    OLLAMA_ERROR,
    OLLAMA_MODELS,
    OLLAMA_SHOW,
    OPENAI_COMPLETION,
    OPENAI_EMBEDDINGS,
    OPENAI_ERROR,
    OPENAI_MODELS,
    REQUEST_HEADERS,
    RESPONSE,
    Schema,
)


def _json(s: Schema, description: str = "OK", headers: dict[str, Any] | None = None) -> Any:
    out: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": s}},
    }
    if headers:
        out["headers"] = headers
    return out


def _errors(ollama: bool | str, codes: tuple[str, ...]) -> dict[str, Any]:
    """``ollama``: True for Ollama's error shape, "anthropic" for Anthropic's, else OpenAI's."""
    name = "AnthropicError" if ollama == "anthropic" else "OllamaError" if ollama else "OpenAIError"
    ref = {"$ref": "#/components/schemas/" + name}
    return {c[:3]: _json(ref, ERROR_STATUSES[c]) for c in codes}


_GEN_CODES = ("400", "401", "404", "408", "413", "429", "431", "502", "503", "504")
_GET_CODES = ("401",)


def _body(s: Schema, models: list[str]) -> dict[str, Any]:
    s = copy.deepcopy(s)
    model = s.get("properties", {}).get("model")
    if model is not None and models:
        model["examples"] = models[:5]
    return {"required": True, "content": {"application/json": {"schema": s}}}


def _gen(
    summary: str,
    req: Schema,
    ok: Schema,
    *,
    ollama: bool | str,
    models: list[str],
    stream: str | None = None,
    parameters: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    ok_resp = _json(ok, "the answer (or, with stream: true, its stream)", GATEWAY_HEADERS)
    if stream is not None:
        ok_resp["content"][stream] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "parameters": REQUEST_HEADERS + (parameters or []),
            "requestBody": _body(req, models),
            "responses": {"200": ok_resp, **_errors(ollama, _GEN_CODES)},
        }
    }


def _get(summary: str, ok: dict[str, Any], *, ollama: bool = False) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(ollama, _GET_CODES)}}}


def document(models: list[str] | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document; ``models``: names to give as examples of ``model``."""
    m = models or []
    paths: dict[str, Any] = {
        **_v1_paths(m),
        **_ollama_paths(m),
        **_gpulock_paths(),
        **_refused_paths(),
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gpulock serve",
            "version": "1",
            "description": "OpenAI (chat completions, Responses), Anthropic (Messages) and "
            "Ollama subsets in front of gpulock's GPU line; errors in each API's shape "
            "(/api/...: Ollama's, /v1/messages: Anthropic's, the rest: OpenAI's).",
        },
        "paths": paths,
        "components": {
            "schemas": {
                "OpenAIError": OPENAI_ERROR,
                "OllamaError": OLLAMA_ERROR,
                "AnthropicError": ANTHROPIC_ERROR,
            }
        },
    }


def _v1_paths(m: list[str]) -> dict[str, Any]:
    """OpenAI's endpoints (chat completions, completions, embeddings, Responses, models) and
    Anthropic's Messages."""
    return {
        "/v1/chat/completions": _gen(
            "OpenAI chat",
            schema.OPENAI_CHAT,
            OPENAI_COMPLETION,
            ollama=False,
            models=m,
            stream="text/event-stream",
        ),
        "/v1/completions": _gen(
            "OpenAI text completion",
            schema.OPENAI_COMPLETION,
            OPENAI_COMPLETION,
            ollama=False,
            models=m,
            stream="text/event-stream",
        ),
        "/v1/embeddings": _gen(
            "OpenAI embeddings",
            schema.OPENAI_EMBEDDINGS,
            OPENAI_EMBEDDINGS,
            ollama=False,
            models=m,
        ),
        "/v1/responses": _gen(
            "OpenAI Responses, stateless (no previous_response_id): input items, function "
            "tools, structured answers (text.format)",
            schema.RESPONSES,
            RESPONSE,
            ollama=False,
            models=m,
            stream="text/event-stream",
        ),
        "/v1/messages": _gen(
            "Anthropic Messages: text and tool_use / tool_result blocks; errors in Anthropic's "
            "shape",
            schema.ANTHROPIC_MESSAGES,
            ANTHROPIC_MESSAGE,
            ollama="anthropic",
            models=m,
            stream="text/event-stream",
            parameters=ANTHROPIC_HEADERS,
        ),
        "/v1/models": _get("the tasks, candidates and tenants' models", _json(OPENAI_MODELS)),
    }


def _ollama_paths(m: list[str]) -> dict[str, Any]:
    """Ollama's endpoints, its greeting at ``/`` included."""
    return {
        "/api/chat": _gen(
            "Ollama chat",
            schema.OLLAMA_CHAT,
            OLLAMA_ANSWER,
            ollama=True,
            models=m,
            stream="application/x-ndjson",
        ),
        "/api/generate": _gen(
            "Ollama generate (an empty prompt only loads)",
            schema.OLLAMA_GENERATE,
            OLLAMA_ANSWER,
            ollama=True,
            models=m,
            stream="application/x-ndjson",
        ),
        "/api/embed": _gen(
            "Ollama embeddings",
            schema.OLLAMA_EMBED,
            {"type": "object", "required": ["embeddings"]},
            ollama=True,
            models=m,
        ),
        "/api/embeddings": _gen(
            "Ollama embeddings, the older form",
            schema.OLLAMA_EMBEDDINGS,
            {"type": "object", "required": ["embedding"]},
            ollama=True,
            models=m,
        ),
        "/api/show": {
            "post": {
                "summary": "a model's details and context length",
                "requestBody": _body(schema.OLLAMA_SHOW, m),
                "responses": {
                    "200": _json(OLLAMA_SHOW),
                    **_errors(True, ("400", "401", "404", "408", "413", "431")),
                },
            }
        },
        "/api/tags": _get("the models, as Ollama lists them", _json(OLLAMA_MODELS), ollama=True),
        "/api/ps": _get("the models loaded now", _json(OLLAMA_MODELS), ollama=True),
        "/api/version": _get(
            "the Ollama API version followed",
            _json({"type": "object", "required": ["version"]}),
            ollama=True,
        ),
        "/": _get("Ollama's greeting", _text()),
    }


def _gpulock_paths() -> dict[str, Any]:
    """gpulock's own: health, status, the cluster, the metrics and this document."""
    any_obj = _json({"type": "object"})
    return {
        "/health": _get(
            "the server is up; requests waiting and running",
            _json({"type": "object", "required": ["status", "waiting", "running"]}),
        ),
        "/gpulock/status": _get("as `gpulock status --json`", any_obj),
        "/gpulock/cluster": {
            "get": {
                "summary": "the fleet, as `gpulock cluster --json` (404 without a cluster:)",
                "responses": {
                    "200": any_obj,
                    **_errors(False, ("401",)),
                    "404": _json({"$ref": "#/components/schemas/OpenAIError"}, "not in a cluster"),
                },
            }
        },
        "/metrics": _get("the Prometheus exposition", _text()),
        "/openapi.json": _get("this document", any_obj),
    }


def _refused_paths() -> dict[str, Any]:
    """Ollama's model-file endpoints, which gpulock serve refuses (its models are routes)."""
    paths: dict[str, Any] = {}
    for what in ("pull", "push", "create", "copy", "delete"):
        paths[f"/api/{what}"] = {
            "delete" if what == "delete" else "post": {
                "summary": f"refused: gpulock serve does not {what} model files",
                "responses": _errors(True, ("401", "404m")),
            }
        }
    blob = {
        "summary": "refused: gpulock serve does not take model files",
        "parameters": [
            {"name": "digest", "in": "path", "required": True, "schema": {"type": "string"}}
        ],
        "responses": _errors(True, ("401", "404m")),
    }
    paths["/api/blobs/{digest}"] = {"post": blob}
    return paths


def _text() -> dict[str, Any]:
    return {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}
