"""The request shape of Anthropic's Messages API (``/v1/messages``), as JSON Schema; its
``x-message`` sentences read as Anthropic's own errors do (``max_tokens: Field required``).
"""

from __future__ import annotations

from typing import Final

from gpulock.serve.schema_parts import NUM, model_name
from gpulock.serve.validator import Schema

_ANTHROPIC_BLOCK: Final[Schema] = {
    "type": "object",
    "properties": {
        "type": {"enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]},
        "text": {"type": "string"},
        "id": {"type": "string"},
        "name": {"type": "string"},
        "input": {"type": "object"},
        "tool_use_id": {"type": "string"},
    },
    "required": ["type"],
    "x-message": "messages: content blocks are text, tool_use or tool_result "
    "(gpulock serve's models take text)",
}
ANTHROPIC_MESSAGES: Final[Schema] = {
    "type": "object",
    "properties": {
        "model": model_name("model: Field required (a task or model name: GET /v1/models)"),
        "max_tokens": {
            "type": "integer",
            "minimum": 1,
            "x-message": "max_tokens: Field required, a whole number >= 1",
        },
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "role": {"enum": ["user", "assistant"]},
                    "content": {
                        "anyOf": [{"type": "string"}, {"type": "array", "items": _ANTHROPIC_BLOCK}]
                    },
                },
                "required": ["role", "content"],
                "x-message": "messages: each turn needs a role (user or assistant) and a content",
            },
            "x-message": "messages: Field required, a non-empty list of turns",
        },
        "system": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
                        "required": ["type", "text"],
                    },
                },
            ],
            "x-message": "system: must be text or a list of text blocks",
        },
        "stop_sequences": {
            "type": "array",
            "items": {"type": "string"},
            "x-message": "stop_sequences: must be a list of texts",
        },
        "temperature": {
            **NUM,
            "minimum": 0,
            "maximum": 1,
            "x-message": "temperature: must be a number from 0 to 1",
        },
        "top_p": {
            **NUM,
            "minimum": 0,
            "maximum": 1,
            "x-message": "top_p: must be a number from 0 to 1",
        },
        "stream": {"type": "boolean", "x-message": "stream: must be true or false"},
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "description": {"type": "string"},
                    "input_schema": {"type": "object"},
                },
                "required": ["name"],
            },
            "x-message": "tools: each tool needs a name (and an input_schema)",
        },
        "tool_choice": {
            "type": "object",
            "properties": {
                "type": {"enum": ["auto", "any", "tool", "none"]},
                "name": {"type": "string"},
            },
            "required": ["type"],
            "x-message": 'tool_choice: must be {"type": "auto"}, {"type": "any"}, '
            '{"type": "none"} or {"type": "tool", "name": ...}',
        },
        "metadata": {"type": "object", "x-message": "metadata: must be an object"},
    },
    "required": ["model", "max_tokens", "messages"],
}
