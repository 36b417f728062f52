"""The request shape of OpenAI's Responses API (``/v1/responses``), as JSON Schema: input items,
function tools and structured answers, stateless (no ``previous_response_id``).
"""

from __future__ import annotations

from typing import Final

from gpulock.serve.schema_openai import OPENAI_GEN
from gpulock.serve.schema_parts import opt
from gpulock.serve.validator import Schema

_TEXT_PART: Final[Schema] = {
    "type": "object",
    "properties": {
        "type": {"type": "string"},  # the handler names the kinds it takes (text ones)
        "text": {"type": "string"},
    },
    "required": ["type"],
}
_RESPONSES_ITEM: Final[Schema] = {
    "type": "object",
    "properties": {
        # Any type: the handler names the kinds it takes (and why item_reference is not one).
        "type": {"type": "string"},
        "role": {"enum": ["user", "assistant", "system", "developer"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
        "call_id": {"type": "string"},
        "name": {"type": "string"},
        "arguments": {"type": "string"},
        "output": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
    },
    "x-message": 'each input item must be a message ({"role", "content"}), a '
    "function_call or a function_call_output",
}
RESPONSES: Final[Schema] = {
    "type": "object",
    "properties": {
        "model": OPENAI_GEN["model"],
        "input": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": _RESPONSES_ITEM, "minItems": 1},
            ],
            "x-message": "'input' is required: text or a non-empty list of items",
        },
        "instructions": opt({"type": "string", "x-message": "'instructions' must be text"}),
        "stream": OPENAI_GEN["stream"],
        "max_output_tokens": opt(
            {
                "type": "integer",
                "minimum": 1,
                "x-message": "'max_output_tokens' must be a whole number >= 1",
            }
        ),
        "temperature": OPENAI_GEN["temperature"],
        "top_p": OPENAI_GEN["top_p"],
        "tools": opt(
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "type": {"enum": ["function"]},
                        "name": {"type": "string", "minLength": 1},
                        "description": opt({"type": "string"}),
                        "parameters": opt({"type": "object"}),
                    },
                    "required": ["type", "name"],
                },
                "x-message": "'tools' must be a list of function tools: "
                '{"type": "function", "name": ..., "parameters": {...}}',
            }
        ),
        "tool_choice": {
            "anyOf": [
                {"enum": ["auto", "none", "required"]},
                {
                    "type": "object",
                    "properties": {"type": {"enum": ["function"]}, "name": {"type": "string"}},
                    "required": ["type", "name"],
                },
                {"type": "null"},
            ],
            "x-message": '\'tool_choice\' must be "auto", "none", "required" or '
            '{"type": "function", "name": ...}',
        },
        "text": opt(
            {
                "type": "object",
                "properties": {
                    "format": {
                        "type": "object",
                        "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
                        "required": ["type"],
                    }
                },
                "x-message": '\'text.format\' must be {"type": "text"}, '
                '{"type": "json_object"} or {"type": "json_schema", "schema": {...}}',
            }
        ),
        "previous_response_id": {
            "type": "null",
            "x-message": "gpulock serve's Responses API is stateless: 'previous_response_id' "
            "cannot be used; send the whole conversation in 'input'",
        },
        "store": opt({"type": "boolean", "x-message": "'store' must be true or false"}),
        "parallel_tool_calls": opt(
            {"type": "boolean", "x-message": "'parallel_tool_calls' must be true or false"}
        ),
        "metadata": opt({"type": "object", "x-message": "'metadata' must be an object"}),
    },
    "required": ["model", "input"],
}
