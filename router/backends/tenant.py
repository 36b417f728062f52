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
request's duration, marked as a call to ``TENANT/MODEL`` so that making room for it never
evicts the very model it calls.  The use is recorded (``gpulock.tenants.usage.touch``), so the
watchdog knows the model's last use.  Streaming yields the whole answer as one piece.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from gpulock.eviction import TENANT_CALL
from gpulock.settings import Settings
from router.backends import BackendError, Result
from router.routes import Candidate


class TenantBackend:
    """Calls to one tenant model (see the module doc)."""

    def __init__(
        self, c: Candidate, settings: Settings, *, gpu: int | None, need: int | None
    ) -> None:
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
        r = self._call(kind, payload, wait_s, label, kw)
        usage["tokens_in"], usage["tokens_out"] = r.tokens_in, r.tokens_out
        yield r.text

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
        from gpulock.errors import LockTimeout
        from gpulock.tenants.http import TenantError

        if self.spec.kind == "command":
            try:
                self.adapter.load(self.candidate.model)  # starts it on the first call
            except TenantError as e:
                raise BackendError("load", f"tenant {self.spec.name}: {e}") from None
            yield
            return
        from gpulock.lock import acquire

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
        with lease:
            if self.spec.kind == "vllm":
                with contextlib.suppress(TenantError):
                    self.adapter.load(self.candidate.model)  # wake a sleeping vLLM
            yield

    def _request(self, kind: str, payload: Any, wait_s: float | None, kw: dict[str, Any]) -> Result:
        from gpulock.tenants.http import TenantError, TenantHttpError, TenantUnreachable

        c = self.candidate
        timeout = c.timeout_s if wait_s is None else max(wait_s, 1.0)
        try:
            if self.spec.kind == "ollama":
                return self._ollama(kind, payload, timeout, kw)
            return self._openai(kind, payload, timeout, kw)
        except TenantHttpError as e:
            status = e.status
            what = "server" if status is None or status >= 500 else "client"
            raise BackendError(what, f"tenant {self.spec.name}: {e}", status=status) from None
        except TenantUnreachable as e:
            what = "timeout" if "no answer" in str(e) else "connection"
            raise BackendError(what, f"tenant {self.spec.name}: {e}") from None
        except TenantError as e:
            raise BackendError("server", f"tenant {self.spec.name}: {e}") from None

    def _ollama(self, kind: str, payload: Any, timeout: float, kw: dict[str, Any]) -> Result:
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
        if kind == "chat":
            body["messages"] = payload
            r = self.adapter.client.post("/api/chat", body, timeout_s=timeout)
            msg = r.get("message") if isinstance(r, dict) else None
            text = msg.get("content") if isinstance(msg, dict) else None
        else:
            body["prompt"] = payload
            r = self.adapter.client.post("/api/generate", body, timeout_s=timeout)
            text = r.get("response") if isinstance(r, dict) else None
        if not isinstance(text, str):
            raise BackendError("server", f"tenant {self.spec.name}: answer without text")
        return Result(text, _int(r, "prompt_eval_count"), _int(r, "eval_count"), r)

    def _openai(self, kind: str, payload: Any, timeout: float, kw: dict[str, Any]) -> Result:
        body: dict[str, Any] = {"model": self.candidate.model, **kw, "stream": False}
        if kind == "chat":
            body["messages"] = payload
            r = self.adapter.client.post("/v1/chat/completions", body, timeout_s=timeout)
        else:
            body["prompt"] = payload
            r = self.adapter.client.post("/v1/completions", body, timeout_s=timeout)
        try:
            choice = r["choices"][0]
            text = choice["message"]["content"] if kind == "chat" else choice["text"]
        except (KeyError, IndexError, TypeError):
            raise BackendError("server", f"tenant {self.spec.name}: answer without text") from None
        use = r.get("usage") if isinstance(r.get("usage"), dict) else {}
        return Result(str(text), _int(use, "prompt_tokens"), _int(use, "completion_tokens"), r)


def _int(d: Any, key: str) -> int:
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, int) else 0
