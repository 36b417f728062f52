"""What ``gpulock serve`` answers with, as its OpenAPI document (``gpulock.serve.openapi``)
describes it: each API's answer bodies and error bodies, the headers it reads and sends, and
what each error status means.

The shapes follow the code that renders them (``gpulock.serve.api_openai``,
``gpulock.serve.api_ollama``, ``gpulock.serve.api_anthropic``, ``gpulock.serve.api_responses``,
``gpulock.serve.errors``); the request bodies are ``gpulock.serve.schema``'s.
"""

from __future__ import annotations

from typing import Any

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
OLLAMA_ANSWER: Schema = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "created_at": {"type": "string"},
        "done": {"type": "boolean"},
    },
    "required": ["model", "done"],
}
OLLAMA_MODELS: Schema = {
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
