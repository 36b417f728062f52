"""The request shapes of ``gpulock serve``'s endpoints, as JSON Schema, and the one validator
every request body passes before a handler reads it.

The same dictionaries are the request bodies of ``GET /openapi.json`` (``gpulock.serve.openapi``),
so the published document and what the handlers accept cannot drift apart.  The validator knows
the small part of JSON Schema used here (``type``, ``properties``, ``required``, ``items``,
``anyOf``, ``enum``, ``minimum``, ``maximum``, ``minItems``, ``minLength``); a property may
carry ``x-message``, the sentence a client reads when that property is wrong.  Unknown
properties are allowed: the official clients send more than gpulock uses.

Bodies are parsed with ``gpulock.core.safejson``: nesting past ``MAX_DEPTH`` (the deepest
legitimate request, a tool's JSON Schema, is a dozen levels) is refused before ``json.loads``
can recurse, as the state folder's readers do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from gpulock.core import safejson

MAX_DEPTH: Final = 64

Schema = dict[str, Any]

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


# --- the validator -----------------------------------------------------------------------------


class Invalid(ValueError):
    """A body that does not fit its endpoint: ``message`` for the client, ``param`` the
    top-level key at fault (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None = None, *, explained: bool = False):
        super().__init__(message)
        self.message = message
        self.param = param
        self.explained = explained  # the message is a schema's own x-message


def loads(data: bytes) -> Any:
    """A request body as JSON: depth bounded first, then parsed; ``Invalid`` if it is not."""
    try:
        return safejson.loads(data, max_depth=MAX_DEPTH)
    except safejson.TooDeep:
        raise Invalid(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise Invalid("the request body is not valid UTF-8") from None
    except (ValueError, RecursionError):
        raise Invalid("the request body is not valid JSON") from None


def validate(obj: Any, schema: Schema) -> None:
    """Raise ``Invalid`` naming the first part of ``obj`` that does not fit ``schema``.

    A body that fits is accepted by the schema compiled once into closures (``_compiled``:
    no exceptions, no paths built, every lookup done at compile time): it was a tenth of the
    gateway's CPU.  One that does not is walked again by ``_check``, which says where."""
    if not isinstance(obj, dict):
        raise Invalid("the request body must be a JSON object")
    fast = _COMPILED.get(id(schema))
    if fast is None or fast[0] is not schema:
        fast = _COMPILED[id(schema)] = (schema, _compile(schema)[0])
    if not fast[1](obj):
        _check(obj, schema, "", None)


_TYPES: Final = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _check(v: Any, s: Schema, path: str, param: str | None) -> None:
    if isinstance(v, dict) and s.get("type") == "object":
        for k in s.get("required", ()):
            if k not in v:
                sub = s.get("properties", {}).get(k, {})
                said = sub.get("x-message")
                raise Invalid(said or f"'{k}' is required", param or k, explained=bool(said))
    if not _fits(v, s):
        typed = [a for a in s.get("anyOf", ()) if "type" in a and _TYPES[a["type"]](v)]
        if len(typed) == 1:  # the one alternative of this type may say more precisely
            try:
                _check(v, typed[0], path, param)
            except Invalid as inner:
                if inner.explained:
                    raise
        if "x-message" in s:
            raise Invalid(s["x-message"], param, explained=True)
        raise Invalid(f"'{path or 'body'}' does not fit: {_say(s)}", param)
    for k, sub in s.get("properties", {}).items():
        if isinstance(v, dict) and k in v:
            _check(v[k], sub, f"{path}.{k}" if path else k, param or k)
    items = s.get("items")
    if items is not None and isinstance(v, list):
        for i, x in enumerate(v):
            _check(x, items, f"{path}[{i}]", param)
    for alt in s.get("anyOf", ()):
        if _fits(v, alt):
            _check(v, alt, path, param)
            break


def _fits(v: Any, s: Schema) -> bool:
    """``v`` fits ``s`` at this level (and its ``anyOf``, deeply); properties are checked by
    ``_check`` so that the message names the deepest part at fault."""
    t = s.get("type")
    if t is not None and not _TYPES[t](v):
        return False
    if "enum" in s and v not in s["enum"]:
        return False
    if isinstance(v, int | float) and not isinstance(v, bool):
        if "minimum" in s and v < s["minimum"]:
            return False
        if "maximum" in s and v > s["maximum"]:
            return False
    if isinstance(v, list | str):
        least: int = s.get("minItems", 0) if isinstance(v, list) else s.get("minLength", 0)
        if len(v) < least:
            return False
        if "maxItems" in s and len(v) > s["maxItems"]:
            return False
    if "anyOf" in s:
        return any(_deep_fits(v, alt) for alt in s["anyOf"])
    return True


def _deep_fits(v: Any, s: Schema) -> bool:
    try:
        _check(v, s, "", None)
    except Invalid:
        return False
    return True


def _say(s: Schema) -> str:
    if "anyOf" in s:
        return " or ".join(_say(a) for a in s["anyOf"])
    return str(s.get("type", "a value"))


# --- the same rules, compiled: a yes/no answer that ``_check`` would give by not raising ---------

Test = Callable[[Any], bool]
_COMPILED: dict[int, tuple[Schema, Test]] = {}


def _compile(s: Schema) -> tuple[Test, Test]:
    """(ok, fits) for ``s``: ``ok(v)`` is ``_check(v, s)`` not raising; ``fits(v)`` is
    ``_fits(v, s)``.  Rule for rule the same walk, so they cannot disagree."""
    t = s.get("type")
    type_ok = _TYPES[t] if t is not None else None
    if type_ok is not None and all(k == "type" or k[:2] == "x-" for k in s):
        return type_ok, type_ok  # a bare type (most leaves): its test is the whole rule
    required = tuple(s.get("required", ())) if t == "object" else ()
    enum: Any = s.get("enum")
    has_enum = "enum" in s
    lo: Any = s.get("minimum")
    hi: Any = s.get("maximum")
    has_lo, has_hi = "minimum" in s, "maximum" in s
    min_items: int = s.get("minItems", 0)
    min_len: int = s.get("minLength", 0)
    max_items: Any = s.get("maxItems")
    has_max_items = "maxItems" in s
    alts = [_compile(a) for a in s.get("anyOf", ())]
    has_alts = "anyOf" in s
    props = [(k, _compile(sub)[0]) for k, sub in s.get("properties", {}).items()]
    items = _compile(s["items"])[0] if s.get("items") is not None else None

    def fits(v: Any) -> bool:
        if type_ok is not None and not type_ok(v):
            return False
        if has_enum and v not in enum:
            return False
        if isinstance(v, int | float) and not isinstance(v, bool):
            if has_lo and v < lo:
                return False
            if has_hi and v > hi:
                return False
        if isinstance(v, list | str):
            least = min_items if isinstance(v, list) else min_len
            if len(v) < least or (has_max_items and len(v) > max_items):
                return False
        if has_alts:
            return any(ok_alt(v) for ok_alt, _ in alts)
        return True

    def ok(v: Any) -> bool:
        if required and isinstance(v, dict):
            for k in required:
                if k not in v:
                    return False
        if not fits(v):
            return False
        if props and isinstance(v, dict):
            for k, ok_sub in props:
                if k in v and not ok_sub(v[k]):
                    return False
        if items is not None and isinstance(v, list):
            for x in v:
                if not items(x):
                    return False
        for ok_alt, fits_alt in alts:
            if fits_alt(v):
                return ok_alt(v)
        return True

    return ok, fits
