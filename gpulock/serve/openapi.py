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

Schema = dict[str, Any]

OPENAI_ERROR: Schema = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}
ANTHROPIC_ERROR: Schema = {
    "type": "object",
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            "required": ["type", "message"],
        },
    },
    "required": ["type", "error"],
}
OLLAMA_ERROR: Schema = {
    "type": "object",
    "properties": {"error": {"type": "string"}},
    "required": ["error"],
}
_USAGE: Schema = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
    },
    "required": ["prompt_tokens", "total_tokens"],
}
_CHOICES: Schema = {"type": "array", "items": {"type": "object"}}
OPENAI_COMPLETION: Schema = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "object": {"enum": ["chat.completion", "text_completion"]},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": _CHOICES,
        "usage": _USAGE,
    },
    "required": ["id", "object", "created", "model", "choices"],
}
RESPONSE: Schema = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "response"},
        "created_at": {"type": "integer"},
        "status": {"enum": ["completed", "incomplete"]},
        "model": {"type": "string"},
        "output": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"type": {"enum": ["message", "function_call"]}},
                "required": ["type"],
            },
        },
        "usage": {
            "type": "object",
            "properties": {
                "input_tokens": {"type": "integer"},
                "output_tokens": {"type": "integer"},
                "total_tokens": {"type": "integer"},
            },
            "required": ["input_tokens", "output_tokens", "total_tokens"],
        },
    },
    "required": ["id", "object", "created_at", "status", "model", "output"],
}
ANTHROPIC_MESSAGE: Schema = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "model": {"type": "string"},
        "content": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"type": {"enum": ["text", "tool_use"]}},
                "required": ["type"],
            },
        },
        "stop_reason": {"enum": ["end_turn", "max_tokens", "tool_use"]},
        "usage": {
            "type": "object",
            "properties": {
                "input_tokens": {"type": "integer"},
                "output_tokens": {"type": "integer"},
            },
            "required": ["input_tokens", "output_tokens"],
        },
    },
    "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
}
OPENAI_EMBEDDINGS: Schema = {
    "type": "object",
    "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": {"type": "object"}},
        "model": {"type": "string"},
        "usage": _USAGE,
    },
    "required": ["object", "data", "model"],
}
OPENAI_MODELS: Schema = {
    "type": "object",
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "string"}, "object": {"const": "model"}},
                "required": ["id", "object"],
            },
        },
    },
    "required": ["object", "data"],
}
_OLLAMA_ANSWER: Schema = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "created_at": {"type": "string"},
        "done": {"type": "boolean"},
    },
    "required": ["model", "done"],
}
_OLLAMA_MODELS: Schema = {
    "type": "object",
    "properties": {"models": {"type": "array", "items": {"type": "object"}}},
    "required": ["models"],
}
OLLAMA_SHOW: Schema = {
    "type": "object",
    "properties": {
        "details": {"type": "object"},
        "model_info": {"type": "object"},
        "capabilities": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["details", "model_info"],
}

GATEWAY_HEADERS: dict[str, Any] = {
    "X-Gpulock-Tier": {
        "description": "the tier that answered: gpu, cpu or cloud",
        "schema": {"type": "string"},
    },
    "X-Gpulock-Model": {
        "description": "the candidate that answered (its name in routes:)",
        "schema": {"type": "string"},
    },
    "X-Gpulock-Waited-Ms": {
        "description": "milliseconds the request waited for its place",
        "schema": {"type": "string"},
    },
}
REQUEST_HEADERS: list[dict[str, Any]] = [
    {
        "name": "X-Gpulock-Agent",
        "in": "header",
        "required": False,
        "description": "the caller's name in the GPU's queue (printable, at most 64 characters)",
        "schema": {"type": "string", "maxLength": 64},
    },
    {
        "name": "X-Gpulock-Deadline",
        "in": "header",
        "required": False,
        "description": "answer within this duration (30s, 2m) or fall back; else 504",
        "schema": {"type": "string"},
    },
]
ANTHROPIC_HEADERS: list[dict[str, Any]] = [
    {
        "name": "anthropic-version",
        "in": "header",
        "required": False,
        "description": "accepted (the official client sends 2023-06-01); the API followed is "
        "that version's",
        "schema": {"type": "string"},
    },
    {
        "name": "x-api-key",
        "in": "header",
        "required": False,
        "description": "one of serve's keys (serve.api_keys_env), as Anthropic's clients send "
        "it; Authorization: Bearer works too",
        "schema": {"type": "string"},
    },
]
ERROR_STATUSES: dict[str, str] = {
    "400": "the body does not fit the endpoint (names the key); malformed JSON or HTTP",
    "401": "missing or wrong API key (serve.api_keys_env set)",
    "404": "no such model (lists the known ones)",
    "408": "the request's headers or body took longer than serve.read_timeout",
    "413": "the body is over serve.max_body",
    "429": "serve.max_queue requests wait already (Retry-After), or a budget or rate limit",
    "431": "the request's headers are over serve.max_header",
    "404m": "an Ollama model-file endpoint (pull, push, create, copy, delete): gpulock serve "
    "does not manage model files; its models are the routes: config",
    "502": "the model's server broke off",
    "503": "no model of the route can answer now (Retry-After)",
    "504": "no model of the route can answer within X-Gpulock-Deadline",
}


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
    any_obj = _json({"type": "object"})
    text = {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}
    paths: dict[str, Any] = {
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
        "/api/chat": _gen(
            "Ollama chat",
            schema.OLLAMA_CHAT,
            _OLLAMA_ANSWER,
            ollama=True,
            models=m,
            stream="application/x-ndjson",
        ),
        "/api/generate": _gen(
            "Ollama generate (an empty prompt only loads)",
            schema.OLLAMA_GENERATE,
            _OLLAMA_ANSWER,
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
        "/api/tags": _get("the models, as Ollama lists them", _json(_OLLAMA_MODELS), ollama=True),
        "/api/ps": _get("the models loaded now", _json(_OLLAMA_MODELS), ollama=True),
        "/api/version": _get(
            "the Ollama API version followed",
            _json({"type": "object", "required": ["version"]}),
            ollama=True,
        ),
        "/": _get("Ollama's greeting", text),
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
        "/metrics": _get("the Prometheus exposition", text),
        "/openapi.json": _get("this document", any_obj),
    }
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
