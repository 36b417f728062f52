"""The request shapes of Ollama's endpoints (``/api/chat``, ``/api/generate``, ``/api/embed``,
``/api/embeddings``, ``/api/show``), as JSON Schema, with Ollama's ``options`` and ``keep_alive``.
"""

from __future__ import annotations

from typing import Final

from gpulock.serve.schema_openai import CHAT_TOOLS
from gpulock.serve.schema_parts import NUM, model_name
from gpulock.serve.validator import Schema

_OLLAMA_OPTIONS: Final[Schema] = {
    "type": "object",
    "properties": {
        "num_predict": {
            "type": "integer",
            "x-message": "options.num_predict must be a whole number",
        },
        "temperature": {
            **NUM,
            "minimum": 0,
            "x-message": "options.temperature must be a number >= 0",
        },
        "top_p": {
            **NUM,
            "minimum": 0,
            "maximum": 1,
            "x-message": "options.top_p must be a number from 0 to 1",
        },
        "presence_penalty": {**NUM, "x-message": "options.presence_penalty must be a number"},
        "frequency_penalty": {**NUM, "x-message": "options.frequency_penalty must be a number"},
        "seed": {"type": "integer", "x-message": "options.seed must be a whole number"},
        "stop": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
            "x-message": "options.stop must be text or a list of texts",
        },
    },
    "x-message": "options must be an object",
}
_OLLAMA_COMMON: Final[dict[str, Schema]] = {
    "model": model_name("model is required"),
    "stream": {"type": "boolean", "x-message": "stream must be true or false"},
    "options": {
        "anyOf": [_OLLAMA_OPTIONS, {"type": "null"}],
        "x-message": "options must be an object",
    },
    "keep_alive": {
        "anyOf": [{"type": "string"}, {"type": "number"}, {"type": "null"}],
        "x-message": 'keep_alive must be a duration like "5m" or a number of seconds',
    },
}
_OLLAMA_MESSAGE: Final[Schema] = {
    "type": "object",
    "properties": {
        "role": {"type": "string", "x-message": "each message needs a role and a content"},
        "content": {"type": "string", "x-message": "a message's content must be text"},
    },
    "required": ["role"],
    "x-message": "each message needs a role and a content",
}
OLLAMA_CHAT: Final[Schema] = {
    "type": "object",
    "properties": {
        **_OLLAMA_COMMON,
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": _OLLAMA_MESSAGE,
            "x-message": "messages is required: a non-empty list of messages",
        },
        "tools": CHAT_TOOLS,  # Ollama's tools are the chat completions' (it has no tool_choice)
    },
    "required": ["model", "messages"],
}
OLLAMA_GENERATE: Final[Schema] = {
    "type": "object",
    "properties": {
        **_OLLAMA_COMMON,
        "prompt": {"type": "string", "x-message": "prompt and system must be text"},
        "system": {"type": "string", "x-message": "prompt and system must be text"},
        "raw": {"type": "boolean", "x-message": "raw must be true or false"},
    },
    "required": ["model"],
}
OLLAMA_EMBED: Final[Schema] = {
    "type": "object",
    "properties": {
        **_OLLAMA_COMMON,
        "input": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
            ],
            "x-message": "input is required: text or a non-empty list of texts",
        },
    },
    "required": ["model", "input"],
}
OLLAMA_EMBEDDINGS: Final[Schema] = {
    "type": "object",
    "properties": {
        **_OLLAMA_COMMON,
        "prompt": {"type": "string", "x-message": "prompt must be text"},
    },
    "required": ["model"],
}
OLLAMA_SHOW: Final[Schema] = {
    "type": "object",
    "properties": {
        "model": model_name("model is required"),
        "name": {"type": "string", "x-message": "name must be text"},  # older clients' key
        "verbose": {"type": "boolean", "x-message": "verbose must be true or false"},
    },
}
