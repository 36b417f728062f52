"""OpenAI's Responses API (``POST /v1/responses``), stateless: requests to ``Ask``, answers to a
``response`` object and its stream of events.

Follows the OpenAI API reference for Responses as the official ``openai`` Python client
(2.x-3.x) and the OpenAI Agents SDK (0.24) speak it, without the server-side state: nothing is
stored, so ``previous_response_id``, ``conversation`` and ``item_reference`` inputs are refused
(400) and each request carries its whole conversation in ``input``, as Ollama's and vLLM's
Responses endpoints ask.  ``input`` is text or a list of items: messages (roles ``user``,
``assistant``, ``system``, ``developer``; text parts), ``function_call`` and
``function_call_output`` (a tool loop); reasoning items are skipped.  ``tools`` are function
tools; ``text.format`` a JSON schema (a structured answer).  A stream is ``event: TYPE`` /
``data: {...}`` pairs with a ``sequence_number``: ``response.created``, ``response.in_progress``,
the output items with their ``response.output_text.delta`` (or
``response.function_call_arguments.delta``) events, and ``response.completed`` (or
``response.incomplete`` when the answer ran into ``max_output_tokens``) last.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from gpulock.serve import api_openai
from gpulock.serve.engines import Answer, Ask, Usage
from gpulock.serve.errors import ApiError, bad_request

STATELESS = (
    "gpulock serve's Responses API is stateless: it stores no response, so "
    "'{what}' cannot be used; send the whole conversation in 'input' (earlier output items "
    "included)"
)
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_SKIPPED = ("reasoning",)  # a model's reasoning from an earlier turn: not a model's input here


def ask(body: dict[str, Any]) -> Ask:
    """The request as an ``Ask`` (400 in the API's shape for what cannot be served)."""
    for what in ("previous_response_id", "conversation"):
        if body.get(what) is not None:
            raise bad_request(STATELESS.format(what=what), what)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: a task or model name (GET /v1/models)", "model")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    messages += _messages(body.get("input"))
    if not messages:
        raise bad_request("'input' is required: text or a non-empty list of items", "input")
    params: dict[str, Any] = {}
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise bad_request(
                "'max_output_tokens' must be a whole number >= 1", "max_output_tokens"
            )
        params["max_tokens"] = limit
    for k in ("temperature", "top_p"):
        v = body.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise bad_request(f"'{k}' must be a number", k)
            params[k] = float(v)
    fmt = _format(body.get("text"))
    if fmt is not None:
        params["response_format"] = fmt
    tools, choice = api_openai.function_tools(
        _tools(body.get("tools")), _choice(body.get("tool_choice"))
    )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", "stream")
    return Ask(
        "chat", model, messages=messages, stream=stream, params=params, tools=tools,
        tool_choice=choice,
    )  # fmt: skip


def _messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request("'input' is required: text or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            raise bad_request("each input item must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise bad_request(
                    "a message item's 'role' must be user, assistant, system or developer", "input"
                )
            out.append({"role": role, "content": _content(item.get("content"))})
        elif kind == "function_call":
            call = _call(item)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request("a function_call_output item needs its 'call_id'", "input")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _output(item)})
        elif kind in _SKIPPED:
            continue
        elif kind == "item_reference":
            raise bad_request(STATELESS.format(what="item_reference"), "input")
        else:
            raise bad_request(
                f"input items of type {kind!r} are not supported: messages, function_call and "
                "function_call_output are",
                "input",
            )
    return out


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("a message's 'content' must be text or a list of text parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise bad_request(
                f"content parts of type {kind!r} are not supported: gpulock serve's models "
                "take text (input_text, output_text)",
                "input",
            )
        text = part.get("text", part.get("refusal", ""))
        texts.append(text if isinstance(text, str) else "")
    return "".join(texts)


def _call(item: dict[str, Any]) -> dict[str, Any]:
    name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, str):
        raise bad_request(
            "a function_call item needs 'call_id', 'name' and 'arguments' (JSON text)", "input"
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _output(item: dict[str, Any]) -> str:
    out = item.get("output", "")
    if isinstance(out, str):
        return out
    if isinstance(out, list):
        return _content(out)
    return json.dumps(out)


def _tools(tools: Any) -> Any:
    """Responses' function tools (``{"type": "function", "name", "parameters"}``) in the chat
    completions' shape; other kinds (web search, files, computer use, MCP) are the OpenAI
    platform's own and are refused."""
    if not isinstance(tools, list):
        return tools  # None, or wrong: function_tools says so
    out = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(
                f"tools of type {kind!r} are not supported: gpulock serve passes function tools",
                "tools",
            )
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(
        '\'text.format\' must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "name": ..., "schema": {...}}',
        "text",
    )


# --- answers -----------------------------------------------------------------------------------


def _usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.tokens_in,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": u.tokens_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.tokens_in + u.tokens_out,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": status,  # in_progress (its start in a stream), completed or incomplete
        "role": "assistant",
        "content": content if status != "in_progress" else [],
    }


def _call_item(call: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if arguments is None else arguments,
        "status": "completed" if arguments is None else "in_progress",
    }


class Rendering:
    """One response's ids, its echo of the request, and its output as it grows."""

    def __init__(self, ask: Ask, body: dict[str, Any]) -> None:
        self.ask = ask
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.body = body
        self.output: list[dict[str, Any]] = []

    def response(self, status: str, usage: Usage | None = None) -> dict[str, Any]:
        b = self.body
        text = b.get("text") if isinstance(b.get("text"), dict) else {"format": {"type": "text"}}
        metadata = b.get("metadata")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "model": self.ask.model,
            "output": list(self.output),
            "parallel_tool_calls": b.get("parallel_tool_calls", True) is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,  # stateless: nothing is kept
            "temperature": b.get("temperature"),
            "text": text,
            "tool_choice": b.get("tool_choice") or "auto",
            "tools": b.get("tools") or [],
            "top_p": b.get("top_p"),
            "truncation": "disabled",
            "usage": _usage(usage) if usage is not None else None,
            "user": None,
            "metadata": metadata if isinstance(metadata, dict) else {},
        }


def _status(a_finish: str, calls: tuple[dict[str, Any], ...]) -> str:
    return "incomplete" if a_finish == "length" and not calls else "completed"


def answer(ask: Ask, body: dict[str, Any], a: Answer) -> dict[str, Any]:
    r = Rendering(ask, body)
    status = _status(a.usage.finish_reason, a.tool_calls)
    if a.text or not a.tool_calls:
        r.output.append(_message_item(f"msg_{uuid.uuid4().hex}", a.text, status))
    r.output += [_call_item(c) for c in a.tool_calls]
    return r.response(status, a.usage)


def _event(seq: list[int], kind: str, obj: dict[str, Any]) -> bytes:
    obj = {"type": kind, "sequence_number": seq[0], **obj}
    seq[0] += 1
    return _frame(kind, obj)


def _frame(kind: str, obj: dict[str, Any]) -> bytes:
    """One server-sent event named ``kind``."""
    data = json.dumps(obj, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def sse(
    ask: Ask,
    body: dict[str, Any],
    pieces: AsyncIterator[str],
    usage: Usage,
    tool_calls: tuple[dict[str, Any], ...] = (),
) -> AsyncIterator[bytes]:
    """The response's events, ``response.completed`` (or ``response.incomplete``) last;
    ``tool_calls`` (an answer made whole) follow the message, each whole."""
    r = Rendering(ask, body)
    seq = [0]
    yield _event(seq, "response.created", {"response": r.response("in_progress")})
    yield _event(seq, "response.in_progress", {"response": r.response("in_progress")})
    msg_id = f"msg_{uuid.uuid4().hex}"
    text: list[str] = []
    opened = False

    where = {"item_id": msg_id, "output_index": 0, "content_index": 0}

    def opening() -> tuple[bytes, bytes]:
        """The message and its text part, both still empty: before the first piece."""
        item = _message_item(msg_id, "", "in_progress")
        added = _event(seq, "response.output_item.added", {"output_index": 0, "item": item})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return added, _event(seq, "response.content_part.added", {**where, "part": part})

    async for piece in pieces:
        if not opened:
            opened = True
            for event in opening():
                yield event
        text.append(piece)
        yield _event(seq, "response.output_text.delta", {**where, "delta": piece, "logprobs": []})
    if opened or not tool_calls:
        whole = "".join(text)
        if not opened:  # nothing was said: the message is there all the same, empty
            for event in opening():
                yield event
        yield _event(seq, "response.output_text.done", {**where, "text": whole, "logprobs": []})
        part = {"type": "output_text", "text": whole, "annotations": [], "logprobs": []}
        yield _event(seq, "response.content_part.done", {**where, "part": part})
        item = _message_item(msg_id, whole, _status(usage.finish_reason, tool_calls))
        r.output.append(item)
        yield _event(seq, "response.output_item.done", {"output_index": 0, "item": item})
    for call in tool_calls:
        i = len(r.output)
        started = _call_item(call, arguments="")
        yield _event(seq, "response.output_item.added", {"output_index": i, "item": started})
        args = call["function"]["arguments"]
        at = {"item_id": started["id"], "output_index": i}
        yield _event(seq, "response.function_call_arguments.delta", {**at, "delta": args})
        yield _event(
            seq,
            "response.function_call_arguments.done",
            {**at, "name": call["function"]["name"], "arguments": args},
        )
        item = {**started, "arguments": args, "status": "completed"}
        r.output.append(item)
        yield _event(seq, "response.output_item.done", {"output_index": i, "item": item})
    status = _status(usage.finish_reason, tool_calls)
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield _event(seq, kind, {"response": r.response(status, usage)})


def stream_error(e: ApiError) -> bytes:
    """An ``error`` event: what the client raises when a stream breaks off midway."""
    return _frame(
        "error", {"type": "error", "code": e.code, "message": e.message, "param": e.param}
    )
