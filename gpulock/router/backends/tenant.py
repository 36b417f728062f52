"""A route candidate served by a tenant: ``{tier: gpu, tenant: ollama, model: "qwen2.5:7b"}``.

The call goes through the tenant's own API (``gpulock.tenants``), not through this process:

* Ollama: its native API (``POST /api/generate``, ``/api/chat``), because only there does
  ``keep_alive`` count: a ``cold-start`` candidate passes ``keep_alive: 0`` (unloaded after the
  call), a ``persistent`` one the route's ``keep_alive`` (or Ollama's default when unset).
* every other kind: its OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``;
  a ``cold-start`` candidate asks the tenant to unload the model after the call.  A sleeping
  vLLM is woken first.
* ``kind: command``: the first call starts the server (``gpulock.tenants.command``), which then
  holds its own GPU ticket with its ``need``: the call takes no second one.

Every other call holds a gpulock ticket on the tenant's GPU with ``need`` = the model's size
(what the tenant reports, or the candidate's ``vram:``; unknown means the whole GPU) for the
request's duration (a stream's: until its last piece), marked as a call to ``TENANT/MODEL`` so
that making room for it never evicts the very model it calls.  The use is recorded
(``gpulock.tenants.usage.touch``), so the watchdog knows the model's last use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from gpulock.core.settings import Settings
from gpulock.residents.eviction import TENANT_CALL
from gpulock.router.backends import BackendError, Result
from gpulock.router.routes import Candidate


class TenantBackend:
    """Calls to one tenant model (see the module doc)."""

    def __init__(
        self,
        c: Candidate,
        settings: Settings,
        *,
        gpu: int | None,
        need: int | None,
        held: bool = False,
    ) -> None:
        """``held``: the caller already holds the GPU ticket for each call (``gpulock serve``'s
        line), so the calls take none of their own."""
        from gpulock.tenants.survey import adapter_for, find_spec

        assert c.tenant is not None
        self.candidate = c
        self.settings = settings
        self.spec = find_spec(settings, c.tenant)
        self.gpu = self.spec.gpu if gpu is None else gpu
        self.need = need
        self.rid = f"{c.tenant}/{c.model}"
        self.adapter = adapter_for(self.spec, settings, timeout_s=5.0)
        self.calls = 0
        self.held = held

    @property
    def loaded(self) -> bool:
        return False  # nothing is loaded in this process: the tenant holds it (or not)

    def unload(self) -> None:
        """Nothing of this process to free; the tenant keeps the model by its own policy."""

    # --- the calls ---------------------------------------------------------------------------

    def complete(self, prompt: str, *, wait_s: float | None, label: str, **kw: Any) -> Result:
        return self._call("text", prompt, wait_s, label, kw)

    def chat(
        self, messages: list[dict[str, Any]], *, wait_s: float | None, label: str, **kw: Any
    ) -> Result:
        return self._call("chat", messages, wait_s, label, kw)

    def stream(
        self,
        kind: str,
        payload: Any,
        *,
        wait_s: float | None,
        label: str,
        usage: dict[str, int],
        **kw: Any,
    ) -> Iterator[str]:
        """The answer's pieces as the tenant sends them (Ollama's NDJSON, OpenAI's events),
        holding the GPU ticket until the last one or until the caller stops reading."""
        from gpulock.tenants import usage as usage_mod
        from gpulock.tenants.http import TenantError

        with self._session(wait_s, label):
            try:
                yield from self._pieces(kind, payload, wait_s, kw, usage)
            except TenantError as e:
                raise self._translate(e) from None
            self.calls += 1
            usage_mod.touch(self.settings, self.rid)

    def _pieces(
        self, kind: str, payload: Any, wait_s: float | None, kw: dict[str, Any],
        usage: dict[str, int],
    ) -> Iterator[str]:  # fmt: skip
        c = self.candidate
        timeout = c.timeout_s if wait_s is None else max(wait_s, 1.0)
        if self.spec.kind == "ollama":
            path, body = self._ollama_body(kind, payload, kw)
            body["stream"] = True
            for line in self.adapter.client.lines(path, body, timeout_s=timeout):
                if not line.strip():
                    continue
                obj = _json_line(line)
                piece = (
                    (obj.get("message") or {}).get("content")
                    if kind == "chat"
                    else obj.get("response")
                )
                if piece:
                    yield str(piece)
                if obj.get("done"):
                    usage["tokens_in"] = _int(obj, "prompt_eval_count")
                    usage["tokens_out"] = _int(obj, "eval_count")
            return
        path, body = self._openai_body(kind, payload, kw)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        for line in self.adapter.client.lines(path, body, timeout_s=timeout):
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = _json_line(data)
            if isinstance(obj.get("usage"), dict):
                usage["tokens_in"] = _int(obj["usage"], "prompt_tokens")
                usage["tokens_out"] = _int(obj["usage"], "completion_tokens")
            for ch in obj.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") if kind == "chat" else ch.get("text")
                if piece:
                    yield str(piece)

    def _call(
        self, kind: str, payload: Any, wait_s: float | None, label: str, kw: dict[str, Any]
    ) -> Result:
        from gpulock.tenants import usage

        with self._session(wait_s, label):
            result = self._request(kind, payload, wait_s, kw)
            self.calls += 1
            usage.touch(self.settings, self.rid)
            if self.candidate.policy == "cold-start" and self.spec.kind != "ollama":
                with contextlib.suppress(Exception):  # best effort: the governor also watches
                    self.adapter.unload(self.candidate.model)
        return result

    @contextlib.contextmanager
    def _session(self, wait_s: float | None, label: str) -> Iterator[None]:
        from gpulock.core.errors import LockTimeout
        from gpulock.tenants.http import TenantError

        if self.spec.kind == "command":
            try:
                self.adapter.load(self.candidate.model)  # starts it on the first call
            except TenantError as e:
                raise BackendError("load", f"tenant {self.spec.name}: {e}") from None
            yield
            return
        if self.held:
            with self._awake():
                yield
            return
        from gpulock import acquire

        try:
            lease = acquire(
                self.gpu,
                need=self.need,
                timeout=wait_s,
                name=label,
                config=self.settings.config,
                state_dir=self.settings.state_dir,
                command=[TENANT_CALL, self.rid],
            )
        except LockTimeout as e:
            raise BackendError("busy", str(e)) from None
        with lease, self._awake():
            yield

    @contextlib.contextmanager
    def _awake(self) -> Iterator[None]:
        from gpulock.tenants.http import TenantError

        if self.spec.kind == "vllm":
            with contextlib.suppress(TenantError):
                self.adapter.load(self.candidate.model)  # wake a sleeping vLLM
        yield

    def _request(self, kind: str, payload: Any, wait_s: float | None, kw: dict[str, Any]) -> Result:
        from gpulock.tenants.http import TenantError

        c = self.candidate
        timeout = c.timeout_s if wait_s is None else max(wait_s, 1.0)
        try:
            if self.spec.kind == "ollama":
                return self._ollama(kind, payload, timeout, kw)
            return self._openai(kind, payload, timeout, kw)
        except TenantError as e:
            raise self._translate(e) from None

    def _translate(self, e: Exception) -> BackendError:
        from gpulock.tenants.http import TenantHttpError, TenantUnreachable

        if isinstance(e, TenantHttpError):
            status = e.status
            what = "server" if status is None or status >= 500 else "client"
            return BackendError(what, f"tenant {self.spec.name}: {e}", status=status)
        if isinstance(e, TenantUnreachable):
            what = "timeout" if "no answer" in str(e) else "connection"
            return BackendError(what, f"tenant {self.spec.name}: {e}")
        return BackendError("server", f"tenant {self.spec.name}: {e}")

    def _ollama_body(
        self, kind: str, payload: Any, kw: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        c = self.candidate
        body: dict[str, Any] = {"model": c.model, "stream": False}
        if c.policy == "cold-start":
            body["keep_alive"] = 0
        elif c.keep_alive_s is not None:
            body["keep_alive"] = f"{int(c.keep_alive_s)}s"
        options = {k: v for k, v in kw.items() if k in ("temperature", "top_p", "seed", "stop")}
        if "max_tokens" in kw:
            options["num_predict"] = kw["max_tokens"]
        if options:
            body["options"] = options
        fmt = kw.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"):
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            body["format"] = schema if isinstance(schema, dict) else "json"  # Ollama's own
        if kind == "chat":
            if kw.get("tools"):
                body["tools"] = kw["tools"]  # Ollama has no tool_choice: it decides
            return "/api/chat", {**body, "messages": [_ollama_message(m) for m in payload]}
        return "/api/generate", {**body, "prompt": payload}

    def tool_calls(self, raw: Any) -> tuple[dict[str, Any], ...]:
        """The tool calls in a tenant's whole answer (``raw``), in the chat completions' shape."""
        from gpulock.router.tools import tool_calls_of

        if not isinstance(raw, dict):
            return ()
        if self.spec.kind == "ollama":
            return tool_calls_of(raw.get("message"))
        choices = raw.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        return tool_calls_of(first.get("message") if isinstance(first, dict) else None)

    def _ollama(self, kind: str, payload: Any, timeout: float, kw: dict[str, Any]) -> Result:
        path, body = self._ollama_body(kind, payload, kw)
        r = self.adapter.client.post(path, body, timeout_s=timeout)
        if kind == "chat":
            msg = r.get("message") if isinstance(r, dict) else None
            text = msg.get("content") if isinstance(msg, dict) else None
        else:
            text = r.get("response") if isinstance(r, dict) else None
        if not isinstance(text, str):
            raise BackendError("server", f"tenant {self.spec.name}: answer without text")
        return Result(text, _int(r, "prompt_eval_count"), _int(r, "eval_count"), r)

    def _openai_body(
        self, kind: str, payload: Any, kw: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.candidate.model, **kw, "stream": False}
        if kind == "chat":
            return "/v1/chat/completions", {**body, "messages": payload}
        return "/v1/completions", {**body, "prompt": payload}

    def _openai(self, kind: str, payload: Any, timeout: float, kw: dict[str, Any]) -> Result:
        path, body = self._openai_body(kind, payload, kw)
        r = self.adapter.client.post(path, body, timeout_s=timeout)
        try:
            choice = r["choices"][0]
            text = choice["message"]["content"] if kind == "chat" else choice["text"]
        except (KeyError, IndexError, TypeError):
            raise BackendError("server", f"tenant {self.spec.name}: answer without text") from None
        use = r.get("usage") if isinstance(r.get("usage"), dict) else {}
        text = "" if text is None else text  # a call of tools only: no content
        return Result(str(text), _int(use, "prompt_tokens"), _int(use, "completion_tokens"), r)


def _ollama_message(m: dict[str, Any]) -> dict[str, Any]:
    """A chat message as Ollama's ``/api/chat`` takes it: a tool call's arguments as an object
    (the chat completions' API sends them as JSON text)."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    import json

    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                fn["arguments"] = {}
        out.append({"function": fn})
    return {**m, "tool_calls": out}


def _json_line(text: str) -> dict[str, Any]:
    """One streamed JSON object; a TenantHttpError for anything else (garbage mid-stream)."""
    import json

    from gpulock.tenants.http import TenantHttpError

    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        raise TenantHttpError(f"streamed answer is not JSON: {text[:80]!r}") from None
    if not isinstance(obj, dict):
        raise TenantHttpError("streamed answer is not a JSON object")
    return obj


def _int(d: Any, key: str) -> int:
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, int) else 0
