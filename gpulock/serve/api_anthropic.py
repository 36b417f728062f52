"""Anthropic's Messages API (``POST /v1/messages``): requests to ``Ask``, answers to a
``message`` object and its stream of events.

Follows Anthropic's API reference for Messages (``anthropic-version: 2023-06-01``) as the
official ``anthropic`` Python client (0.40-2.x) speaks it: ``max_tokens`` is required,
``system`` is text or text blocks, ``messages`` alternate ``user`` and ``assistant`` turns of
text or content blocks (``text``; ``tool_use`` and ``tool_result`` in a tool loop; images and
documents are refused), ``stop_sequences``, ``temperature`` (0 to 1), ``tools`` (``name``,
``description``, ``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``).
A stream is ``event: TYPE`` / ``data: {...}`` pairs: ``message_start``, per content block
``content_block_start``, ``content_block_delta`` (``text_delta`` or ``input_json_delta``) and
``content_block_stop``, then ``message_delta`` (``stop_reason``, ``usage``) and
``message_stop``; an ``error`` event if it breaks off.  Errors are ``{"type": "error", "error":
{"type", "message"}}`` (``gpulock.serve.errors``).  ``stop_reason`` is ``end_turn``,
``max_tokens`` or ``tool_use``: the engines do not say which stop sequence ended a text, so a
text cut by one reads ``end_turn``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from gpulock.serve import api_openai
from gpulock.serve.engines import Answer, Ask, Usage
from gpulock.serve.errors import ApiError, bad_request

PATH = "/v1/messages"


def ask(body: dict[str, Any]) -> Ask:
    """The request as an ``Ask`` (400 in Anthropic's shape for what cannot be served)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: Field required (a task or model name: GET /v1/models)", "model")
    limit = body.get("max_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise bad_request("max_tokens: Field required, a whole number >= 1", "max_tokens")
    params: dict[str, Any] = {"max_tokens": limit}
    for k in ("temperature", "top_p"):
        v = body.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise bad_request(f"{k}: must be a number", k)
            params[k] = float(v)
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("stop_sequences: must be a list of texts", "stop_sequences")
        if stop:
            params["stop"] = stop
    messages: list[dict[str, Any]] = []
    system = _system(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages: Field required, a non-empty list of turns", "messages")
    for m in msgs:
        messages += _turn(m)
    tools, choice = api_openai.function_tools(
        _tools(body.get("tools")), _choice(body.get("tool_choice"))
    )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream: must be true or false", "stream")
    return Ask(
        "chat", model, messages=messages, stream=stream, params=params, tools=tools,
        tool_choice=choice,
    )  # fmt: skip


def _system(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    if isinstance(system, list):
        return "\n".join(_block_text(b, "system") for b in system)
    raise bad_request("system: must be text or a list of text blocks", "system")


def _block_text(b: Any, where: str) -> str:
    if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
        kind = b.get("type") if isinstance(b, dict) else None
        raise bad_request(
            f"{where}: content blocks of type {kind!r} are not supported here: text blocks are "
            "(gpulock serve's models take text)",
            where,
        )
    text: str = b["text"]
    return text


def _turn(m: Any) -> list[dict[str, Any]]:
    """One turn as chat messages: its text, its tool calls (assistant), and each tool result
    (user) as a ``tool`` message of its own."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad_request("messages: each turn needs a role, user or assistant", "messages")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request("messages: a turn's content must be text or a list of blocks", "messages")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for b in content:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(b))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(b))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # a model's reasoning from an earlier turn: not a model's input here
        else:
            texts.append(_block_text(b, "messages"))
    out: list[dict[str, Any]] = list(results)
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tool_use(b: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
        raise bad_request("messages: a tool_use block needs an id and a name", "messages")
    args = json.dumps(b.get("input") if isinstance(b.get("input"), dict) else {})
    return {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}}


def _tool_result(b: dict[str, Any]) -> dict[str, Any]:
    call_id = b.get("tool_use_id")
    if not isinstance(call_id, str):
        raise bad_request("messages: a tool_result block needs its tool_use_id", "messages")
    content = b.get("content", "")
    if isinstance(content, list):
        content = "".join(_block_text(x, "messages") for x in content)
    elif not isinstance(content, str):
        content = json.dumps(content)
    if b.get("is_error") is True:
        content = f"error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tools(tools: Any) -> Any:
    """Anthropic's client tools (``name``, ``description``, ``input_schema``) in the chat
    completions' shape; server tools (web search, code execution...) are Anthropic's own."""
    if not isinstance(tools, list):
        return tools
    out = []
    for t in tools:
        if (
            not isinstance(t, dict)
            or not isinstance(t.get("name"), str)
            or (t.get("type") not in (None, "custom"))
        ):
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(
                f"tools: tools of type {kind!r} are not supported: gpulock serve passes client "
                "tools ({name, description, input_schema})",
                "tools",
            )
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    raise bad_request(
        'tool_choice: must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
        '{"type": "tool", "name": ...}',
        "tool_choice",
    )


# --- answers -----------------------------------------------------------------------------------


def _stop_reason(a_finish: str, calls: tuple[dict[str, Any], ...]) -> str:
    if calls:
        return "tool_use"
    return "max_tokens" if a_finish == "length" else "end_turn"


def _tool_block(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"] or "{}")
    except ValueError:
        args = {"arguments": fn["arguments"]}  # a model's broken JSON, kept for the caller
    return {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args}


def _message(model: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }


def answer(ask: Ask, a: Answer) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if a.text or not a.tool_calls:
        content.append({"type": "text", "text": a.text})
    content += [_tool_block(c) for c in a.tool_calls]
    return {
        **_message(ask.model, content),
        "stop_reason": _stop_reason(a.usage.finish_reason, a.tool_calls),
        "usage": {"input_tokens": a.usage.tokens_in, "output_tokens": a.usage.tokens_out},
    }


def _event(kind: str, obj: dict[str, Any]) -> bytes:
    data = json.dumps({"type": kind, **obj}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def sse(
    ask: Ask,
    pieces: AsyncIterator[str],
    usage: Usage,
    tool_calls: tuple[dict[str, Any], ...] = (),
) -> AsyncIterator[bytes]:
    """The message's events, ``message_stop`` last; ``tool_calls`` (an answer made whole)
    follow the text, each a ``tool_use`` block whose input comes in one delta."""
    yield _event("message_start", {"message": _message(ask.model, [])})
    index = 0
    opened = False
    async for piece in pieces:
        if not opened:
            opened = True
            yield _event(
                "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
            )
            yield _event("ping", {})
        yield _event(
            "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}}
        )
    if not opened and not tool_calls:  # nothing was said: an empty text block all the same
        yield _event(
            "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
        )
        opened = True
    if opened:
        yield _event("content_block_stop", {"index": 0})
        index = 1
    for call in tool_calls:
        block = {**_tool_block(call), "input": {}}
        yield _event("content_block_start", {"index": index, "content_block": block})
        delta = {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
        yield _event("content_block_delta", {"index": index, "delta": delta})
        yield _event("content_block_stop", {"index": index})
        index += 1
    stop = {"stop_reason": _stop_reason(usage.finish_reason, tool_calls), "stop_sequence": None}
    counts = {"input_tokens": usage.tokens_in, "output_tokens": usage.tokens_out}
    yield _event("message_delta", {"delta": stop, "usage": counts})
    yield _event("message_stop", {})


def stream_error(e: ApiError) -> bytes:
    """An ``error`` event: what the client raises when a stream breaks off midway."""
    return _event("error", {"error": e.anthropic()["error"]})
