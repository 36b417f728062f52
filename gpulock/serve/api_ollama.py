"""Ollama's API shapes: requests to ``Ask``, answers to JSON and NDJSON streams.

Follows Ollama's ``docs/api.md`` (API of Ollama 0.6 to 0.12, as the official ``ollama`` Python
client 0.4-0.6 reads it): ``stream`` defaults to true, a stream is one JSON object per line
ending with one whose ``done`` is true and which carries ``done_reason`` and the counts
(``prompt_eval_count``, ``eval_count``) and durations in nanoseconds; generation options come
in ``options`` (``num_predict`` is max_tokens); a ``generate`` with an empty prompt only loads
the model (``done_reason: "load"``); errors are ``{"error": "..."}``, also as the last line of
a stream that fails midway.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from gpulock.serve.engines import Answer, Ask, Usage
from gpulock.serve.errors import bad_request

API_VERSION = "0.6.0"  # what /api/version answers: the Ollama API this follows


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required")
    return model


def _stream(body: dict[str, Any]) -> bool:
    s = body.get("stream", True)
    if not isinstance(s, bool):
        raise bad_request("stream must be true or false")
    return s


def _params(body: dict[str, Any]) -> dict[str, Any]:
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise bad_request("options must be an object")
    p: dict[str, Any] = {}
    n = opts.get("num_predict")
    if n is not None and not isinstance(n, bool) and isinstance(n, int) and n > 0:
        p["max_tokens"] = n
    for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        v = opts.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool):
            p[k] = float(v)
    stop = opts.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        p["stop"] = stop
    seed = opts.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        p["seed"] = seed
    return p


def chat_ask(body: dict[str, Any]) -> Ask:
    """``/api/chat``: its messages (with Ollama's tool calls and tool results, made the chat
    completions' shape the dispatch speaks) and its ``tools`` (Ollama has no tool_choice)."""
    from gpulock.router.tools import tool_calls_of
    from gpulock.serve.api_openai import function_tools

    model = _model(body)
    msgs = body.get("messages")
    if msgs is None:
        msgs = []
    if not isinstance(msgs, list):
        raise bad_request("messages must be a list")
    messages: list[dict[str, Any]] = []
    asked: list[dict[str, Any]] = []  # the assistant's calls not answered yet, in order
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request("each message needs a role and a content")
        content = m.get("content", "")
        if not isinstance(content, str):
            raise bad_request("a message's content must be text")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        calls = tool_calls_of(m) if m["role"] == "assistant" else ()
        if calls:
            # Ollama's calls carry no id: give each one, unique in the conversation.
            n = len(messages)
            calls = tuple({**c, "id": f"call_{n}_{i}"} for i, c in enumerate(calls))
            msg["tool_calls"] = list(calls)
            asked = list(calls)
        if m["role"] == "tool":
            # Ollama names the tool a result answers (tool_name), or nothing: the oldest call
            # of that name not answered yet, else the oldest call not answered yet.
            name = m.get("tool_name")
            match = next((c for c in asked if c["function"]["name"] == name), None)
            match = match or (asked[0] if asked else None)
            if match is not None:
                asked.remove(match)
                msg["tool_call_id"] = match["id"]
        messages.append(msg)
    if not messages:
        raise bad_request("messages is required: a non-empty list of messages")
    tools, _ = function_tools(body.get("tools"), None)
    return Ask(
        "chat",
        model,
        messages=messages,
        stream=_stream(body),
        params=_params(body),
        tools=tools,
    )


def generate_ask(body: dict[str, Any]) -> Ask:
    model = _model(body)
    prompt = body.get("prompt", "")
    system = body.get("system")
    if not isinstance(prompt, str) or (system is not None and not isinstance(system, str)):
        raise bad_request("prompt and system must be text")
    if system and not body.get("raw"):
        prompt = f"{system}\n\n{prompt}"
    return Ask("text", model, prompt=prompt, stream=_stream(body), params=_params(body))


def embed_ask(body: dict[str, Any]) -> Ask:
    model = _model(body)
    inp = body.get("input")
    if isinstance(inp, str):
        inp = [inp]
    if not isinstance(inp, list) or not inp or not all(isinstance(s, str) for s in inp):
        raise bad_request("input is required: text or a non-empty list of texts")
    return Ask("embed", model, inputs=inp)


def _counts(u: Usage, total_ns: int) -> dict[str, Any]:
    return {
        "done_reason": u.finish_reason,
        "total_duration": total_ns,
        "load_duration": 0,
        "prompt_eval_count": u.tokens_in,
        "prompt_eval_duration": 0,
        "eval_count": u.tokens_out,
        "eval_duration": total_ns,
    }


def answer(ask: Ask, model: str, a: Answer, started: float) -> dict[str, Any]:
    total = int((time.monotonic() - started) * 1e9)
    out: dict[str, Any] = {"model": model, "created_at": now_iso()}
    if ask.kind == "chat":
        out["message"] = _message(a.text, a.tool_calls)
    else:
        out["response"] = a.text
    out["done"] = True
    out.update(_counts(a.usage, total))
    return out


def loaded(model: str) -> dict[str, Any]:
    """``/api/generate`` with an empty prompt: the model is ready (Ollama loads it)."""
    return {
        "model": model,
        "created_at": now_iso(),
        "response": "",
        "done": True,
        "done_reason": "load",
    }


def _message(text: str, calls: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """An assistant message as Ollama writes it: tool calls with their arguments as an object."""
    out: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        out["tool_calls"] = [
            {"function": {"name": c["function"]["name"], "arguments": _arguments(c)}} for c in calls
        ]
    return out


def _arguments(call: dict[str, Any]) -> Any:
    try:
        return json.loads(call["function"].get("arguments") or "{}")
    except ValueError:
        return {}


async def ndjson(
    ask: Ask,
    model: str,
    pieces: AsyncIterator[str],
    usage: Usage,
    started: float,
    calls: tuple[dict[str, Any], ...] = (),
) -> AsyncIterator[bytes]:
    """Ollama's stream: a line a piece, then the last line with the counts (and any tool
    calls: a request with tools is answered whole, its calls in that line)."""
    chat = ask.kind == "chat"

    def line(obj: dict[str, Any]) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode() + b"\n"

    async for piece in pieces:
        obj: dict[str, Any] = {"model": model, "created_at": now_iso()}
        if chat:
            obj["message"] = {"role": "assistant", "content": piece}
        else:
            obj["response"] = piece
        obj["done"] = False
        yield line(obj)
    last: dict[str, Any] = {"model": model, "created_at": now_iso()}
    if chat:
        last["message"] = _message("", calls)
    else:
        last["response"] = ""
    last["done"] = True
    last.update(_counts(usage, int((time.monotonic() - started) * 1e9)))
    yield line(last)


def embeddings(model: str, vectors: list[list[float]], tokens: int, started: float) -> Any:
    return {
        "model": model,
        "embeddings": vectors,
        "total_duration": int((time.monotonic() - started) * 1e9),
        "load_duration": 0,
        "prompt_eval_count": tokens,
    }


def _details() -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "gguf",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }


def show(model: str, n_ctx: int, tier: str) -> dict[str, Any]:
    """``/api/show``: what the ``ollama`` client, Open WebUI and Continue read before a chat;
    the context length under ``model_info["<architecture>.context_length"]``, as Ollama
    reports it."""
    return {
        "modelfile": f"# {model}: a model of gpulock serve's routes (tier {tier})\n",
        "parameters": f"num_ctx {n_ctx}",
        "template": "{{ .Prompt }}",
        "license": "",
        "details": _details(),
        "model_info": {"general.architecture": "gpulock", "gpulock.context_length": n_ctx},
        "capabilities": ["completion"],
        "modified_at": now_iso(),
    }


def tags(entries: list[tuple[str, int]]) -> dict[str, Any]:
    """``/api/tags``: (name, size in bytes) for each name, tasks first."""
    stamp = now_iso()
    return {
        "models": [
            {
                "name": name,
                "model": name,
                "modified_at": stamp,
                "size": size,
                "digest": "",
                "details": _details(),
            }
            for name, size in entries
        ]
    }


def ps(entries: list[tuple[str, int, int]]) -> dict[str, Any]:
    """``/api/ps``: (name, size, bytes in VRAM) of each loaded model."""
    return {
        "models": [
            {
                "name": name,
                "model": name,
                "size": size,
                "digest": "",
                "details": _details(),
                "expires_at": "0001-01-01T00:00:00Z",
                "size_vram": vram,
            }
            for name, size, vram in entries
        ]
    }
