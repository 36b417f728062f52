"""``gpulock.serve.validator`` with ``gpulock.serve.schema``'s shapes: the bounded parse and the
validator the handlers use, as a table."""

from __future__ import annotations

from typing import Any

import pytest

from gpulock.serve import schema, validator

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "shape"),
    [
        ({"model": "m", "messages": MSG}, schema.OPENAI_CHAT),
        (
            {"model": "m", "messages": MSG, "temperature": None, "stop": None, "n": 1},
            schema.OPENAI_CHAT,
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            },
            schema.OPENAI_CHAT,
        ),
        (
            {
                "model": "m",
                "messages": MSG,
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"d": [1]}}}
                ],
                "user": "u",
            },
            schema.OPENAI_CHAT,
        ),
        ({"model": "m", "prompt": ["one"]}, schema.OPENAI_COMPLETION),
        (
            {"model": "m", "input": ["a", "b"], "encoding_format": "base64"},
            schema.OPENAI_EMBEDDINGS,
        ),
        (
            {"model": "m", "messages": MSG, "options": {"num_predict": -1, "temperature": 0.2}},
            schema.OLLAMA_CHAT,
        ),
        ({"model": "m"}, schema.OLLAMA_GENERATE),
        ({"name": "m"}, schema.OLLAMA_SHOW),
        ({"model": "m", "input": "hi", "previous_response_id": None}, schema.RESPONSES),
        (
            {
                "model": "m",
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "x"}]},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c", "output": "o"},
                ],
                "tools": [{"type": "function", "name": "f", "parameters": {}}],
                "tool_choice": {"type": "function", "name": "f"},
            },
            schema.RESPONSES,
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": MSG,
                "system": [{"type": "text", "text": "s"}],
            },
            schema.ANTHROPIC_MESSAGES,
        ),
    ],
)
def test_bodies_that_fit(body: dict[str, Any], shape: validator.Schema) -> None:
    validator.validate(body, shape)


@pytest.mark.parametrize(
    ("body", "shape", "param", "needle"),
    [
        ({"messages": MSG}, schema.OPENAI_CHAT, "model", "'model' is required"),
        ({"model": "m", "messages": []}, schema.OPENAI_CHAT, "messages", "non-empty"),
        ({"model": "m", "messages": [{"content": "x"}]}, schema.OPENAI_CHAT, "messages", "'role'"),
        ({"model": "m", "messages": MSG, "top_p": 3}, schema.OPENAI_CHAT, "top_p", "0 to 1"),
        ({"model": "m", "messages": MSG, "seed": 1.5}, schema.OPENAI_CHAT, "seed", "whole"),
        ({"model": "m", "prompt": ["a", "b"]}, schema.OPENAI_COMPLETION, "prompt", "one prompt"),
        (
            {"model": "m", "messages": MSG, "options": {"stop": 3}},
            schema.OLLAMA_CHAT,
            "options",
            "stop",
        ),
        ({"model": "m", "keep_alive": []}, schema.OLLAMA_GENERATE, "keep_alive", "keep_alive"),
        (
            {"model": "m", "input": "x", "previous_response_id": "resp_1"},
            schema.RESPONSES,
            "previous_response_id",
            "stateless",
        ),
        ({"model": "m", "messages": MSG}, schema.ANTHROPIC_MESSAGES, "max_tokens", "required"),
        (
            {"model": "m", "max_tokens": 1, "messages": MSG, "temperature": 1.5},
            schema.ANTHROPIC_MESSAGES,
            "temperature",
            "0 to 1",
        ),
        (
            {"model": "m", "messages": MSG, "tools": [{"type": "web_search"}]},
            schema.OPENAI_CHAT,
            "tools",
            "function tools",
        ),
    ],
)
def test_bodies_that_do_not_fit_name_the_key(
    body: dict[str, Any], shape: validator.Schema, param: str, needle: str
) -> None:
    with pytest.raises(validator.Invalid) as e:
        validator.validate(body, shape)
    assert e.value.param == param and needle in e.value.message, e.value.message


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"[" * 10_000 + b"]" * 10_000, "nests deeper than 64"),
        (b'{"a": "\xff"}', "UTF-8"),
        (b'{"a": NaN}', "not valid JSON"),
        (b'{"a": 1e999}', "not valid JSON"),
        (b'{"a": ', "not valid JSON"),
    ],
)
def test_loads_refuses_without_recursing(data: bytes, needle: str) -> None:
    with pytest.raises(validator.Invalid) as e:
        validator.loads(data)
    assert needle in e.value.message


def test_a_non_object_body_is_refused() -> None:
    with pytest.raises(validator.Invalid, match="JSON object"):
        validator.validate([1, 2], schema.OPENAI_CHAT)


SHAPES = [
    schema.OPENAI_CHAT,
    schema.OPENAI_COMPLETION,
    schema.OPENAI_EMBEDDINGS,
    schema.OLLAMA_CHAT,
    schema.OLLAMA_GENERATE,
    schema.OLLAMA_EMBED,
    schema.OLLAMA_EMBEDDINGS,
    schema.OLLAMA_SHOW,
]


def _walk_values(s: Any, rng: Any, depth: int = 0) -> Any:
    """A value near what ``s`` describes: mostly fitting, sometimes not (a wrong type, a
    missing required key, a number out of range), so both answers are met."""
    pick = rng.random()
    if depth > 4 or pick < 0.08:
        return rng.choice([None, True, 0, -1, 1.5, 10**6, "", "x", [], {}, [1], {"a": 1}])
    if "anyOf" in s:
        return _walk_values(rng.choice(s["anyOf"]), rng, depth + 1)
    t = s.get("type")
    if "enum" in s and pick < 0.8:
        return rng.choice(s["enum"])
    if t == "object":
        out = {}
        for k, sub in s.get("properties", {}).items():
            if (k in s.get("required", ()) and rng.random() < 0.95) or rng.random() < 0.5:
                out[k] = _walk_values(sub, rng, depth + 1)
        return out
    if t == "array":
        return [_walk_values(s.get("items", {}), rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if t == "string":
        return rng.choice(["", "m", "hello"])
    if t in ("integer", "number"):
        lo, hi = s.get("minimum", -5), s.get("maximum", 5)
        return rng.choice([lo - 1, lo, hi, hi + 1, 2.5 if t == "number" else 2])
    if t == "boolean":
        return rng.random() < 0.5
    return None


def test_the_compiled_validator_answers_as_the_walk_does() -> None:
    """validate() accepts a body by the schema compiled into closures and walks it with
    _check only to say what is wrong: the two must never disagree."""
    import random

    rng = random.Random(31)
    seen = {True: 0, False: 0}
    for _ in range(4000):
        shape = rng.choice(SHAPES)
        body = _walk_values(shape, rng)
        try:
            validator._check(body, shape, "", None)
            walked = True
        except validator.Invalid:
            walked = False
        assert validator._compile(shape)[0](body) is walked, (body, shape)
        seen[walked] += 1
    assert min(seen.values()) > 400, seen  # both answers were met, many times
