"""OpenAI's API shapes: requests to ``Ask``, answers to JSON and server-sent events.

Follows the OpenAI API reference for ``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings`` and ``/v1/models`` as the official ``openai`` Python client (1.x-3.x) speaks
it: a stream is ``data: {chunk}`` events ending with ``data: [DONE]``, a usage chunk (with no
choices) comes last only when ``stream_options.include_usage`` asks for it, and embeddings come
as base64 (little-endian float32) when ``encoding_format`` is ``base64``, which the client asks
for by default.
"""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from gpulock.serve.engines import Answer, Ask, Usage
from gpulock.serve.errors import ApiError, bad_request


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: a task or model name (GET /v1/models)", "model")
    return model


def _text(content: Any) -> str:
    """A message's content: text, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    raise bad_request("a message's 'content' must be text or a list of parts", "messages")


def _params(body: dict[str, Any]) -> dict[str, Any]:
    p: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise bad_request("'max_tokens' must be a whole number >= 1", "max_tokens")
        p["max_tokens"] = max_tokens
    for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        v = body.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise bad_request(f"'{k}' must be a number", k)
            p[k] = float(v)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("'stop' must be text or a list of texts", "stop")
        p["stop"] = stop
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise bad_request("'seed' must be a whole number", "seed")
        p["seed"] = seed
    return p


def _stream(body: dict[str, Any]) -> bool:
    s = body.get("stream", False)
    if not isinstance(s, bool):
        raise bad_request("'stream' must be true or false", "stream")
    return s


def chat_ask(body: dict[str, Any]) -> Ask:
    model = _model(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' is required: a non-empty list of messages", "messages")
    messages = []
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request("each message needs a 'role' and a 'content'", "messages")
        msg: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"))}
        calls = m.get("tool_calls")
        if calls:  # the assistant's earlier calls, in a tool loop
            msg["tool_calls"] = _message_calls(calls)
        if m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad_request(
                    "a 'tool' message needs the 'tool_call_id' it answers", "messages"
                )
            msg["tool_call_id"] = call_id
        messages.append(msg)
    params = _params(body)
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        params["response_format"] = fmt
    tools, choice = function_tools(body.get("tools"), body.get("tool_choice"))
    return Ask(
        "chat",
        model,
        messages=messages,
        stream=_stream(body),
        params=params,
        tools=tools,
        tool_choice=choice,
    )


def _message_calls(calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request("an assistant message's 'tool_calls' must be a list", "messages")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("each tool call needs a 'function' with a 'name'", "messages")
        args = fn.get("arguments")
        out.append(
            {
                "id": str(c.get("id") or ""),
                "type": "function",
                "function": {
                    "name": fn["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args or {}),
                },
            }
        )
    return out


def function_tools(tools: Any, choice: Any) -> tuple[tuple[dict[str, Any], ...], Any]:
    """``tools`` and ``tool_choice`` as the chat completions' API has them, checked: function
    tools only, and a named choice among them.  ``tool_choice: "none"`` sends no tools at all
    (the model is to call none), so any candidate may answer."""
    if tools is None or tools == []:
        return (), None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools", "tools")
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(
                'each tool must be {"type": "function", "function": {"name": ...}}: gpulock '
                "serve passes function tools only",
                "tools",
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request("each function tool needs a 'name'", "tools")
        out.append({"type": "function", "function": fn})
    return tuple(out), checked_choice(out, choice)


def checked_choice(tools: list[dict[str, Any]], choice: Any) -> Any:
    """A ``tool_choice`` of the chat completions' API; 400 for a function not in ``tools``."""
    if choice is None or choice in ("auto", "required"):
        return choice
    if choice == "none":
        return "none"
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
    known = [t["function"]["name"] for t in tools]
    if not isinstance(name, str):
        raise bad_request(
            '\'tool_choice\' must be "auto", "none", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in known:
        raise bad_request(
            f"tool_choice names {name!r}, which is not one of the tools: {', '.join(known)}",
            "tool_choice",
        )
    return {"type": "function", "function": {"name": name}}


def without_unused_tools(ask: Ask) -> Ask:
    """``tool_choice: "none"``: the tools are not sent (no candidate need call them)."""
    if ask.tool_choice == "none":
        return replace(ask, tools=(), tool_choice=None)
    return ask


def completion_ask(body: dict[str, Any]) -> Ask:
    model = _model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("'prompt' is required: text (one prompt per request)", "prompt")
    return Ask("text", model, prompt=prompt, stream=_stream(body), params=_params(body))


def embed_ask(body: dict[str, Any]) -> Ask:
    model = _model(body)
    inp = body.get("input")
    if isinstance(inp, str):
        inp = [inp]
    if not isinstance(inp, list) or not inp or not all(isinstance(s, str) for s in inp):
        raise bad_request("'input' is required: text or a non-empty list of texts", "input")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    return Ask("embed", model, inputs=inp, params={"encoding_format": fmt})


def include_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


def _usage(u: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": u.tokens_in,
        "completion_tokens": u.tokens_out,
        "total_tokens": u.tokens_in + u.tokens_out,
    }


def answer(ask: Ask, model: str, a: Answer) -> dict[str, Any]:
    now = int(time.time())
    if ask.kind == "chat":
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": now,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": _message(a),
                    "logprobs": None,
                    "finish_reason": "tool_calls" if a.tool_calls else a.usage.finish_reason,
                }
            ],
            "usage": _usage(a.usage),
        }
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": now,
        "model": model,
        "choices": [
            {"index": 0, "text": a.text, "logprobs": None, "finish_reason": a.usage.finish_reason}
        ],
        "usage": _usage(a.usage),
    }


def _message(a: Answer) -> dict[str, Any]:
    if not a.tool_calls:
        return {"role": "assistant", "content": a.text}
    return {"role": "assistant", "content": a.text or None, "tool_calls": list(a.tool_calls)}


def embeddings(ask: Ask, model: str, vectors: list[list[float]], tokens: int) -> dict[str, Any]:
    b64 = ask.params.get("encoding_format") == "base64"
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": _b64(v) if b64 else v,
        }
        for i, v in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _b64(v: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def sse(
    ask: Ask,
    model: str,
    pieces: AsyncIterator[str],
    usage: Usage,
    with_usage: bool,
    tool_calls: tuple[dict[str, Any], ...] = (),
) -> AsyncIterator[bytes]:
    """The stream as server-sent events, ``data: [DONE]`` last; ``tool_calls`` (an answer
    made whole) follow the text, each whole in one chunk."""
    chat = ask.kind == "chat"
    base = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(piece: str | None, finish: str | None, role: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if piece is not None:
                delta["content"] = piece
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": piece or ""}
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        return _event({**base, "choices": [choice]})

    if chat:
        yield chunk("", None, role=True)
    async for piece in pieces:
        yield chunk(piece, None)
    for i, call in enumerate(tool_calls):
        delta = {"tool_calls": [{"index": i, **call}]}
        yield _event({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    yield chunk(None if chat else "", "tool_calls" if tool_calls else usage.finish_reason)
    if with_usage:
        yield _event({**base, "choices": [], "usage": _usage(usage)})
    yield b"data: [DONE]\n\n"


def stream_error(e: ApiError) -> bytes:
    return _event(e.openai())


def models(names: list[str]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": 0, "owned_by": "gpulock"} for n in names],
    }
