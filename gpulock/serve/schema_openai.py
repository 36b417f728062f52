"""The request shapes of OpenAI's chat completions, completions and embeddings endpoints
(``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``), as JSON Schema.

``OPENAI_GEN`` holds the generation parameters the Responses API shares
(``gpulock.serve.schema_responses``); ``CHAT_TOOLS`` is the function-tool list Ollama's chat takes
too (``gpulock.serve.schema_ollama``).
"""

from __future__ import annotations

from typing import Final

from gpulock.serve.schema_parts import NUM, model_name, opt
from gpulock.serve.validator import Schema

_STOP: Final[Schema] = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}},
        {"type": "null"},
    ],
    "x-message": "'stop' must be text or a list of texts",
}


_PART: Final[Schema] = {
    "type": "object",
    "properties": {"type": {"type": "string"}, "text": {"type": "string"}},
    "required": ["type"],
}
_OPENAI_MESSAGE: Final[Schema] = {
    "type": "object",
    "properties": {
        "role": {"type": "string", "x-message": "each message needs a 'role' and a 'content'"},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": _PART},
                {"type": "null"},
            ],
            "x-message": "a message's 'content' must be text or a list of parts "
            '({"type": "text", "text": ...})',
        },
    },
    "required": ["role"],
    "x-message": "each message needs a 'role' and a 'content'",
}
OPENAI_GEN: Final[dict[str, Schema]] = {
    "model": model_name("'model' is required: a task or model name (GET /v1/models)"),
    "stream": opt({"type": "boolean", "x-message": "'stream' must be true or false"}),
    "max_tokens": opt(
        {"type": "integer", "minimum": 1, "x-message": "'max_tokens' must be a whole number >= 1"}
    ),
    "max_completion_tokens": opt(
        {
            "type": "integer",
            "minimum": 1,
            "x-message": "'max_completion_tokens' must be a whole number >= 1",
        }
    ),
    "temperature": opt(
        {
            **NUM,
            "minimum": 0,
            "maximum": 2,
            "x-message": "'temperature' must be a number from 0 to 2",
        }
    ),
    "top_p": opt(
        {**NUM, "minimum": 0, "maximum": 1, "x-message": "'top_p' must be a number from 0 to 1"}
    ),
    "presence_penalty": opt(
        {
            **NUM,
            "minimum": -2,
            "maximum": 2,
            "x-message": "'presence_penalty' must be a number from -2 to 2",
        }
    ),
    "frequency_penalty": opt(
        {
            **NUM,
            "minimum": -2,
            "maximum": 2,
            "x-message": "'frequency_penalty' must be a number from -2 to 2",
        }
    ),
    "stop": _STOP,
    "seed": opt({"type": "integer", "x-message": "'seed' must be a whole number"}),
    "n": opt(
        {
            "type": "integer",
            "minimum": 1,
            "maximum": 1,
            "x-message": "'n' must be 1: gpulock serve answers one choice per request",
        }
    ),
    "stream_options": opt(
        {
            "type": "object",
            "properties": {"include_usage": {"type": "boolean"}},
            "x-message": "'stream_options' must be an object like {\"include_usage\": true}",
        }
    ),
}

_FUNCTION: Final[Schema] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "description": {"type": "string"},
        "parameters": {"type": "object"},
    },
    "required": ["name"],
}
CHAT_TOOLS: Final[Schema] = opt(
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"type": {"enum": ["function"]}, "function": _FUNCTION},
            "required": ["type", "function"],
        },
        "x-message": "'tools' must be a list of function tools: "
        '{"type": "function", "function": {"name": ..., "parameters": {...}}}',
    }
)
_CHAT_TOOL_CHOICE: Final[Schema] = {
    "anyOf": [
        {"enum": ["auto", "none", "required"]},
        {
            "type": "object",
            "properties": {
                "type": {"enum": ["function"]},
                "function": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}},
                    "required": ["name"],
                },
            },
            "required": ["type", "function"],
        },
        {"type": "null"},
    ],
    "x-message": '\'tool_choice\' must be "auto", "none", "required" or '
    '{"type": "function", "function": {"name": ...}}',
}

OPENAI_CHAT: Final[Schema] = {
    "type": "object",
    "properties": {
        **OPENAI_GEN,
        "tools": CHAT_TOOLS,
        "tool_choice": _CHAT_TOOL_CHOICE,
        "response_format": opt(
            {
                "type": "object",
                "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
                "required": ["type"],
                "x-message": '\'response_format\' must be {"type": "text"}, '
                '{"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}',
            }
        ),
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": _OPENAI_MESSAGE,
            "x-message": "'messages' is required: a non-empty list of messages",
        },
    },
    "required": ["model", "messages"],
}
OPENAI_COMPLETION: Final[Schema] = {
    "type": "object",
    "properties": {
        **OPENAI_GEN,
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
            ],
            "x-message": "'prompt' is required: text (one prompt per request)",
        },
    },
    "required": ["model", "prompt"],
}
OPENAI_EMBEDDINGS: Final[Schema] = {
    "type": "object",
    "properties": {
        "model": OPENAI_GEN["model"],
        "input": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
            ],
            "x-message": "'input' is required: text or a non-empty list of texts",
        },
        "encoding_format": opt(
            {
                "type": "string",
                "enum": ["float", "base64"],
                "x-message": "'encoding_format' must be 'float' or 'base64'",
            }
        ),
    },
    "required": ["model", "input"],
}
