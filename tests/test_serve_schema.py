"""``gpulock.serve.schema``: the bounded parse and the validator the handlers use, as a table."""

from __future__ import annotations

from typing import Any

import pytest

from gpulock.serve import schema

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
def test_bodies_that_fit(body: dict[str, Any], shape: schema.Schema) -> None:
    schema.validate(body, shape)


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
    body: dict[str, Any], shape: schema.Schema, param: str, needle: str
) -> None:
    with pytest.raises(schema.Invalid) as e:
        schema.validate(body, shape)
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
    with pytest.raises(schema.Invalid) as e:
        schema.loads(data)
    assert needle in e.value.message


def test_a_non_object_body_is_refused() -> None:
    with pytest.raises(schema.Invalid, match="JSON object"):
        schema.validate([1, 2], schema.OPENAI_CHAT)
