"""Where a served request's answer is made: llama.cpp in this process, a tenant's server, or an
OpenAI-compatible server over HTTP (``gpulock.serve.remote``).  All take one normalised ``Ask``
and give text (whole or in pieces) or embeddings, raising the router's ``BackendError`` so that a
failure falls back along the route as ``router.get_model`` does.

The in-process engine reuses the router's llama.cpp backend, with one difference: the GPU's
ticket is held by the gateway's line (``gpulock.serve.line``) for the whole request, so the
backend's own call to ``gpulock.acquire`` is left out.  llama.cpp calls block, so they run in worker
threads (one per call in progress, never one per waiting request).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gpulock.router.backends import BackendError
from gpulock.router.backends.llama_cpp import LlamaBackend, _llama_class
from gpulock.router.backends.tenant import TenantBackend
from gpulock.router.tools import tool_calls_of

PARAMS = (
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
)
# Passed on as they are to an OpenAI-compatible server (a candidate that can call tools, a
# structured answer); llama.cpp in this process takes them through ``_llama_kw``.
PASSED = ("tools", "tool_choice", "response_format")


@dataclass(frozen=True, slots=True)
class Ask:
    """One request, whichever API it came in by."""

    kind: str  # "chat", "text" or "embed"
    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str = ""
    inputs: list[str] = field(default_factory=list)
    stream: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    # Function tools, in the chat completions' shape ({"type": "function", "function": {...}}),
    # whichever API they came in by; a request with tools goes only to candidates that can call
    # them (``gpulock.router.tools``), and is answered whole (tool calls arrive whole).
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: Any = None  # "auto", "none", "required" or {"type": "function", ...}


@dataclass(slots=True)
class Usage:
    tokens_in: int = 0
    tokens_out: int = 0
    finish_reason: str = "stop"


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    usage: Usage
    # The calls the model asks for, in the chat completions' shape: {"id", "type": "function",
    # "function": {"name", "arguments" (JSON text)}}; finish_reason is then "tool_calls".
    tool_calls: tuple[dict[str, Any], ...] = ()


class _HeldLlama(LlamaBackend):
    """The router's llama.cpp backend, minus its own acquire: serve's line holds the ticket."""

    embedding = False

    @contextlib.contextmanager
    def _session(self, wait_s: float | None, label: str) -> Iterator[Any]:
        with self._call_lock:
            if self.gpu is None:
                if self._llm is None:
                    self._llm = self._load()
                yield self._llm
                return
            if self._resident is None:
                self._resident = self._register()
            with self._resident.use() as llm:
                yield llm

    def _load(self) -> Any:
        if not self.embedding:
            return super()._load()
        c = self.candidate
        if not os.path.isfile(c.model):
            raise BackendError("load", f"model file not found: {c.model} ({c.key}.model)")
        try:
            return _llama_class()(
                model_path=c.model,
                n_ctx=c.n_ctx,
                n_gpu_layers=c.n_gpu_layers,
                embedding=True,
                verbose=False,
            )
        except (RuntimeError, ValueError, OSError) as e:
            raise BackendError("load", f"{c.name}: {e}") from None


class _EmbedLlama(_HeldLlama):
    embedding = True  # llama.cpp embeds only with a context made for it: a second instance
    resident_suffix = ":embed"  # status and evict tell it from the chat one: tiny-gpu:embed


class LocalEngine:
    """A llama.cpp candidate in this process (cpu or gpu tier)."""

    def __init__(
        self, backend: _HeldLlama, embedder: _HeldLlama, tool_format: str | None = None
    ) -> None:
        self.backend = backend
        self.embedder = embedder
        # llama-cpp-python's function-calling chat handler for a request with tools (the
        # chooser's verdict: ``gpulock.router.tools``); None: this candidate calls none.
        self.tool_format = tool_format

    async def answer(self, ask: Ask) -> Answer:
        kw = _llama_kw(ask)
        # A client that hangs up stops the generation at the next token (llama.cpp asks this
        # after each one); until then the call, and so the GPU's ticket, are kept.
        stop = threading.Event()
        kw["logits_processor"] = _stopper(stop, self.backend)
        call: Callable[[], Any]
        if ask.tools:
            if self.tool_format is None:  # the chooser skips such a candidate: never here
                raise BackendError("request", f"{self.backend.candidate.name}: cannot call tools")
            call = functools.partial(
                self.backend.chat_tools,
                handler_messages(ask.messages),
                tools=list(ask.tools),
                tool_choice=handler_choice(ask.tools, ask.tool_choice),
                chat_format=self.tool_format,
                wait_s=None,
                label=ask.model,
                **kw,
            )
        else:
            call = _whole_answer(self.backend, ask, kw)
        job = asyncio.ensure_future(asyncio.to_thread(call))
        try:
            r = await asyncio.shield(job)
        except asyncio.CancelledError:
            stop.set()
            await asyncio.wait({job})
            raise
        choice = ((r.raw or {}).get("choices") or [{}])[0]
        finish = choice.get("finish_reason") or "stop"
        calls = tool_calls_of(choice.get("message"))
        return Answer(r.text, Usage(r.tokens_in, r.tokens_out, finish), calls)

    async def stream(self, ask: Ask, usage: Usage) -> AsyncIterator[str]:
        async for piece in _stream_in_thread(self.backend, ask, usage, _llama_kw(ask)):
            yield piece

    async def embed(self, inputs: list[str]) -> tuple[list[list[float]], int]:
        def run() -> tuple[list[list[float]], int]:
            with self.embedder._session(None, "embed") as llm:
                out = llm.create_embedding(inputs)
            vectors = [_flat(d["embedding"]) for d in out["data"]]
            return vectors, int((out.get("usage") or {}).get("prompt_tokens", 0))

        try:
            return await asyncio.to_thread(run)
        except (RuntimeError, ValueError, OSError) as e:
            raise BackendError("server", f"{self.embedder.candidate.name}: {e}") from None


_END = object()


def _whole_answer(backend: Any, ask: Ask, kw: dict[str, Any]) -> Callable[[], Any]:
    """The blocking call that answers ``ask`` whole (chat or completion), for a thread."""
    if ask.kind == "chat":
        return functools.partial(backend.chat, ask.messages, wait_s=None, label=ask.model, **kw)
    return functools.partial(backend.complete, ask.prompt, wait_s=None, label=ask.model, **kw)


async def _stream_in_thread(
    backend: Any, ask: Ask, usage: Usage, kw: dict[str, Any]
) -> AsyncIterator[str]:
    """A backend's blocking ``stream`` (llama.cpp in this process, or a tenant), on the loop."""
    counts: dict[str, int] = {}
    payload: Any = ask.messages if ask.kind == "chat" else ask.prompt
    gen = backend.stream(ask.kind, payload, wait_s=None, label=ask.model, usage=counts, **kw)
    # One thread for the whole stream: the backend's lock is taken and given back by the
    # thread that runs the generator's first and last steps, which must be the same one.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpulock-serve-stream")
    loop = asyncio.get_running_loop()
    done = False
    try:
        while True:
            piece = await asyncio.shield(loop.run_in_executor(pool, _next, gen))
            if piece is _END:
                done = True
                break
            yield piece
    finally:
        if not done:
            # The client left: close after the piece being made (llama.cpp is not entered
            # twice at once), in the stream's thread; the backend's finally frees the model.
            pool.submit(getattr(gen, "close", lambda: None))
        pool.shutdown(wait=False)
    usage.tokens_in = counts.get("tokens_in", 0)
    usage.tokens_out = counts.get("tokens_out", 0)
    max_tokens = ask.params.get("max_tokens")
    usage.finish_reason = "length" if max_tokens and usage.tokens_out >= max_tokens else "stop"


class TenantEngine:
    """A tenant's model (``gpulock.router.backends.tenant``), called under the ticket the line holds
    (or, for a ``kind: command`` tenant, under its server's own ticket)."""

    def __init__(self, backend: TenantBackend) -> None:
        self.backend = backend

    async def answer(self, ask: Ask) -> Answer:
        kw = _passed_kw(ask)  # tools and formats as the chat completions' API has them
        call = _whole_answer(self.backend, ask, kw)
        r = await asyncio.to_thread(call)
        calls = self.backend.tool_calls(r.raw) if ask.tools else ()
        return Answer(
            r.text, Usage(r.tokens_in, r.tokens_out, "tool_calls" if calls else "stop"), calls
        )

    async def stream(self, ask: Ask, usage: Usage) -> AsyncIterator[str]:
        async for piece in _stream_in_thread(self.backend, ask, usage, _passed_kw(ask)):
            yield piece

    async def embed(self, inputs: list[str]) -> tuple[list[list[float]], int]:
        c = self.backend.candidate
        raise BackendError(
            "request",
            f"{c.name}: embeddings through a tenant are not supported; name a model "
            "of routes: for embeddings",
        )


def _stopper(stop: threading.Event, backend: _HeldLlama) -> Any:
    """A logits processor (chat and text calls both take one; llama.cpp applies it before
    each token) that, once ``stop`` is set, leaves end-of-sequence the only possible token:
    the call ends at the next token, as if the model had finished.  (An exception would not
    do: llama.cpp calls it through a ctypes callback, which ignores exceptions.)"""
    from llama_cpp import LogitsProcessorList

    def check(_ids: Any, scores: Any) -> Any:
        if not stop.is_set():
            return scores
        llm = (
            backend._llm if backend._llm is not None else getattr(backend._resident, "model", None)
        )
        if llm is None:
            return scores
        eos = llm.token_eos()
        scores[:] = -float("inf")
        scores[eos] = 0.0
        return scores

    return LogitsProcessorList([check])


def _next(gen: Iterator[str]) -> Any:
    return next(gen, _END)


def _flat(v: Any) -> list[float]:
    # Without pooling llama.cpp gives one vector per token: mean-pool them to one.
    if v and isinstance(v[0], list):
        n = len(v)
        return [sum(col) / n for col in zip(*v, strict=True)]
    return [float(x) for x in v]


def _llama_kw(ask: Ask) -> dict[str, Any]:
    kw = {k: v for k, v in ask.params.items() if k in PARAMS and v is not None}
    fmt = llama_format(ask.params.get("response_format"))
    if fmt is not None and ask.kind == "chat":
        kw["response_format"] = fmt
    return kw


def _passed_kw(ask: Ask) -> dict[str, Any]:
    """The parameters, tools and response format as the chat completions' API names them."""
    kw = {k: v for k, v in ask.params.items() if k in PARAMS + PASSED and v is not None}
    if ask.tools:
        kw["tools"] = list(ask.tools)
        if ask.tool_choice is not None:
            kw["tool_choice"] = ask.tool_choice
    return kw


def llama_format(rf: Any) -> dict[str, Any] | None:
    """The chat completions' ``response_format`` as llama-cpp-python takes it: a JSON schema
    becomes ``{"type": "json_object", "schema": ...}``, which it turns into a grammar."""
    if not isinstance(rf, dict):
        return None
    if rf.get("type") == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return {"type": "json_object", **({"schema": schema} if isinstance(schema, dict) else {})}
    if rf.get("type") == "json_object":
        return {"type": "json_object"}
    return None


def handler_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as llama-cpp-python's function-calling handlers render it: their
    templates know system, user and assistant turns only, so a tool's result is given as a
    user turn that names the call it answers."""
    names = {
        c["id"]: c["function"]["name"]
        for m in messages
        for c in (m.get("tool_calls") or ())
        if isinstance(c, dict) and isinstance(c.get("function"), dict)
    }
    out = []
    for m in messages:
        if m.get("role") == "tool":
            name = names.get(m.get("tool_call_id", ""), "the function")
            out.append({"role": "user", "content": f"{name} returned: {m.get('content') or ''}"})
        else:
            out.append(m)
    return out


def handler_choice(tools: tuple[dict[str, Any], ...], choice: Any) -> Any:
    """``tool_choice`` as the handlers take it: "auto" when not given (the API's default with
    tools), "none", or one named function; "required" names the one tool when there is one,
    and is "auto" otherwise (the handlers cannot force "any of these")."""
    if choice is None or choice == "auto":
        return "auto"
    if choice == "required":
        if len(tools) == 1:
            return {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        return "auto"
    return choice
