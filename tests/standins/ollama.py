"""Ollama stand-in, following the API of Ollama v0.12 (``docs/api.md``).

* ``GET /api/ps`` -> ``{"models": [{"name", "model", "size", "size_vram", "digest",
  "details", "expires_at", "context_length"}]}``; ``expires_at`` in RFC 3339 with
  nanoseconds and the local offset, as Ollama writes it.
* ``POST /api/generate {"model": M}`` (no prompt) loads M, for ``keep_alive`` seconds when
  that is a number above 0 (else 5m; duration strings are not followed here); with
  ``"keep_alive": 0`` it answers at once ``{"done": true, "done_reason": "unload"}`` -- the
  pitfall: the model leaves memory only when its in-flight requests end (then
  ``unload_delay_s`` later), and until then ``/api/ps`` keeps listing it with ``expires_at`` in
  the past.
* ``POST /api/generate {"model": M, "prompt": P}`` (or ``/api/chat`` with ``messages``) loads
  M, generates (in flight until the test sets ``hold``), and moves ``expires_at`` to now +
  keep_alive (default 5m); with ``"keep_alive": 0`` it unloads M after answering.  Unless the
  request says ``"stream": false`` the answer is streamed: one JSON object per line, the last
  with ``"done": true`` and the token counts.
* ``POST /api/chat`` with ``tools`` (and ``"stream": false``): the model calls the first tool,
  as Ollama answers a call: ``message.content`` empty, ``message.tool_calls`` =
  ``[{"function": {"name": N, "arguments": {...}}}]`` (arguments an object, no id).
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

from standins.base import NdJson, StandIn

DEFAULT_KEEP_ALIVE_S = 300.0


def rfc3339(t: float) -> str:
    """As Ollama writes times: nanoseconds and the server's local offset (here -07:00, as in
    its API docs, so a reader that drops the offset is seven hours off)."""
    tz = timezone(timedelta(hours=-7))
    dt = datetime.fromtimestamp(t, tz)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{int((t % 1) * 1e9):09d}-07:00"


class Ollama(StandIn):
    def __init__(self, catalog: dict[str, int], unload_delay_s: float = 0.2) -> None:
        super().__init__()
        self.catalog = catalog  # name -> size in VRAM
        self.loaded: dict[str, dict[str, Any]] = {}
        self.unload_delay_s = unload_delay_s

    def load(self, name: str, keep_alive_s: float = DEFAULT_KEEP_ALIVE_S) -> None:
        with self.lock:
            m = self.loaded.setdefault(name, {"inflight": 0, "unloading": False})
            m["expires"] = time.time() + keep_alive_s
            m["unloading"] = False

    def _unload(self, name: str) -> None:
        with self.lock:
            m = self.loaded.get(name)
            if m is not None:
                m["unloading"] = True
                m["expires"] = time.time() - 0.001
        self.later(self.unload_delay_s, lambda: self._maybe_free(name))

    def _maybe_free(self, name: str) -> None:
        with self.lock:
            m = self.loaded.get(name)
            if m is not None and m["unloading"] and m["inflight"] == 0:
                del self.loaded[name]

    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        if method == "GET" and path == "/api/ps":
            with self.lock:
                models = [
                    {
                        "name": n, "model": n, "size": self.catalog[n],
                        "size_vram": self.catalog[n], "digest": "0" * 64,
                        "details": {"format": "gguf"}, "expires_at": rfc3339(m["expires"]),
                        "context_length": 4096,
                    }
                    for n, m in self.loaded.items()
                ]  # fmt: skip
            return 200, {"models": models}
        if method == "POST" and path in ("/api/generate", "/api/chat") and isinstance(body, dict):
            name = body.get("model")
            if name not in self.catalog:
                return 404, {"error": f"model '{name}' not found"}
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            work = body.get("prompt") if path == "/api/generate" else body.get("messages")
            if body.get("keep_alive") == 0 and not work:
                self._unload(name)
                return 200, {"model": name, "created_at": now, "response": "", "done": True,
                             "done_reason": "unload"}  # fmt: skip
            ka = body.get("keep_alive")
            keep = float(ka) if isinstance(ka, int | float) and ka > 0 else DEFAULT_KEEP_ALIVE_S
            self.load(name, keep)
            if not work:
                return 200, {"model": name, "created_at": now, "response": "", "done": True,
                             "done_reason": "load"}  # fmt: skip
            with self.lock:
                self.loaded[name]["inflight"] += 1
            try:
                self.generating()
            finally:
                with self.lock:
                    self.loaded[name]["inflight"] -= 1
                    if not self.loaded[name]["unloading"]:
                        self.loaded[name]["expires"] = time.time() + DEFAULT_KEEP_ALIVE_S
                if body.get("keep_alive") == 0:
                    self._unload(name)  # a call with keep_alive 0: unloaded once it answered
                self.later(self.unload_delay_s, lambda: self._maybe_free(name))
            answer = {"model": name, "created_at": now, "done": True, "done_reason": "stop",
                      "prompt_eval_count": 3, "eval_count": 2}  # fmt: skip
            if body.get("stream", True):  # Ollama streams unless told not to
                chat = path == "/api/chat"

                def piece(text: str) -> dict[str, Any]:
                    if chat:
                        return {"message": {"role": "assistant", "content": text}}
                    return {"response": text}

                parts = [
                    {"model": name, "created_at": now, "done": False, **piece(p)} for p in "hi"
                ]
                return 200, NdJson([*parts, {**answer, **piece("")}])
            tools = body.get("tools")
            if path == "/api/chat" and isinstance(tools, list) and tools:
                fn = tools[0].get("function") or {}
                call = {"function": {"name": fn.get("name"), "arguments": {"city": "Oslo"}}}
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                return 200, {**answer, "message": message}
            if path == "/api/chat":
                return 200, {**answer, "message": {"role": "assistant", "content": "hi"}}
            return 200, {**answer, "response": "hi"}
        return 404, "404 page not found"
