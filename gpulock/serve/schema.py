"""The request shapes of ``gpulock serve``'s endpoints, as JSON Schema.

The same dictionaries are the request bodies of ``GET /openapi.json`` (``gpulock.serve.openapi``)
and what ``gpulock.serve.validator`` checks every body against before a handler reads it, so the
published document and what the handlers accept cannot drift apart.  A property may carry
``x-message``, the sentence a client reads when that property is wrong; unknown properties are
allowed: the official clients send more than gpulock uses.
"""

from __future__ import annotations

from typing import Final

from gpulock.serve.validator import Schema

_NUM: Final[Schema] = {"type": "number"}
_STOP: Final[Schema] = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}},
        {"type": "null"},
    ],
    "x-message": "'stop' must be text or a list of texts",
}


def _opt(schema: Schema) -> Schema:
    """An optional OpenAI parameter: JSON ``null`` means "not given", as the clients send it."""
    return {
        "anyOf": [schema, {"type": "null"}],
        **{k: v for k, v in schema.items() if k[:2] == "x-"},
    }


def _model(message: str) -> Schema:
    return {"type": "string", "minLength": 1, "x-message": message}


# --- OpenAI ------------------------------------------------------------------------------------

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
_OPENAI_GEN: Final[dict[str, Schema]] = {
    "model": _model("'model' is required: a task or model name (GET /v1/models)"),
    "stream": _opt({"type": "boolean", "x-message": "'stream' must be true or false"}),
    "max_tokens": _opt(
        {"type": "integer", "minimum": 1, "x-message": "'max_tokens' must be a whole number >= 1"}
    ),
    "max_completion_tokens": _opt(
        {
            "type": "integer",
            "minimum": 1,
            "x-message": "'max_completion_tokens' must be a whole number >= 1",
        }
    ),
    "temperature": _opt(
        {
            **_NUM,
            "minimum": 0,
            "maximum": 2,
            "x-message": "'temperature' must be a number from 0 to 2",
        }
    ),
    "top_p": _opt(
        {**_NUM, "minimum": 0, "maximum": 1, "x-message": "'top_p' must be a number from 0 to 1"}
    ),
    "presence_penalty": _opt(
        {
            **_NUM,
            "minimum": -2,
            "maximum": 2,
            "x-message": "'presence_penalty' must be a number from -2 to 2",
        }
    ),
    "frequency_penalty": _opt(
        {
            **_NUM,
            "minimum": -2,
            "maximum": 2,
            "x-message": "'frequency_penalty' must be a number from -2 to 2",
        }
    ),
    "stop": _STOP,
    "seed": _opt({"type": "integer", "x-message": "'seed' must be a whole number"}),
    "n": _opt(
        {
            "type": "integer",
            "minimum": 1,
            "maximum": 1,
            "x-message": "'n' must be 1: gpulock serve answers one choice per request",
        }
    ),
    "stream_options": _opt(
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
_CHAT_TOOLS: Final[Schema] = _opt(
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
        **_OPENAI_GEN,
        "tools": _CHAT_TOOLS,
        "tool_choice": _CHAT_TOOL_CHOICE,
        "response_format": _opt(
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
        **_OPENAI_GEN,
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
        "model": _OPENAI_GEN["model"],
        "input": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
            ],
            "x-message": "'input' is required: text or a non-empty list of texts",
        },
        "encoding_format": _opt(
            {
                "type": "string",
                "enum": ["float", "base64"],
                "x-message": "'encoding_format' must be 'float' or 'base64'",
            }
        ),
    },
    "required": ["model", "input"],
}

# --- OpenAI's Responses API --------------------------------------------------------------------

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
        "model": _OPENAI_GEN["model"],
        "input": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": _RESPONSES_ITEM, "minItems": 1},
            ],
            "x-message": "'input' is required: text or a non-empty list of items",
        },
        "instructions": _opt({"type": "string", "x-message": "'instructions' must be text"}),
        "stream": _OPENAI_GEN["stream"],
        "max_output_tokens": _opt(
            {
                "type": "integer",
                "minimum": 1,
                "x-message": "'max_output_tokens' must be a whole number >= 1",
            }
        ),
        "temperature": _OPENAI_GEN["temperature"],
        "top_p": _OPENAI_GEN["top_p"],
        "tools": _opt(
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "type": {"enum": ["function"]},
                        "name": {"type": "string", "minLength": 1},
                        "description": _opt({"type": "string"}),
                        "parameters": _opt({"type": "object"}),
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
        "text": _opt(
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
        "store": _opt({"type": "boolean", "x-message": "'store' must be true or false"}),
        "parallel_tool_calls": _opt(
            {"type": "boolean", "x-message": "'parallel_tool_calls' must be true or false"}
        ),
        "metadata": _opt({"type": "object", "x-message": "'metadata' must be an object"}),
    },
    "required": ["model", "input"],
}

# --- Anthropic's Messages API ------------------------------------------------------------------

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
        "model": _model("model: Field required (a task or model name: GET /v1/models)"),
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
            **_NUM,
            "minimum": 0,
            "maximum": 1,
            "x-message": "temperature: must be a number from 0 to 1",
        },
        "top_p": {
            **_NUM,
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

# --- Ollama ------------------------------------------------------------------------------------

_OLLAMA_OPTIONS: Final[Schema] = {
    "type": "object",
    "properties": {
        "num_predict": {
            "type": "integer",
            "x-message": "options.num_predict must be a whole number",
        },
        "temperature": {
            **_NUM,
            "minimum": 0,
            "x-message": "options.temperature must be a number >= 0",
        },
        "top_p": {
            **_NUM,
            "minimum": 0,
            "maximum": 1,
            "x-message": "options.top_p must be a number from 0 to 1",
        },
        "presence_penalty": {**_NUM, "x-message": "options.presence_penalty must be a number"},
        "frequency_penalty": {**_NUM, "x-message": "options.frequency_penalty must be a number"},
        "seed": {"type": "integer", "x-message": "options.seed must be a whole number"},
        "stop": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
            "x-message": "options.stop must be text or a list of texts",
        },
    },
    "x-message": "options must be an object",
}
_OLLAMA_COMMON: Final[dict[str, Schema]] = {
    "model": _model("model is required"),
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
        "tools": _CHAT_TOOLS,  # Ollama's tools are the chat completions' (it has no tool_choice)
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
        "model": _model("model is required"),
        "name": {"type": "string", "x-message": "name must be text"},  # older clients' key
        "verbose": {"type": "boolean", "x-message": "verbose must be true or false"},
    },
}
