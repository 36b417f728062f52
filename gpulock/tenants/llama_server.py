"""llama.cpp's ``llama-server`` (API of llama.cpp b7000+, ``tools/server/README.md``).

* Kind: ``GET /props`` has ``"role": "router"`` in router mode (``llama-server --models-dir``
  without ``-m``); a single-model server has no ``role`` and cannot unload: it is listed, and
  configured as ``kind: command`` to be evicted (by stopping it).
* Listing: ``GET /models`` -> ``{"data": [{"id", "status": {"value": loaded | loading |
  unloaded | sleeping | downloading, "args": [...]}, ...}]}``; a running model's entry also
  carries what its child's ``/v1/models`` says, ``meta.size`` (weights) among it.  The size
  here is ``meta.size`` plus a KV-cache estimate from the GGUF header when the file is known.
* In use: ``GET /slots?model=M&autoload=false`` -> ``[{"is_processing", "id_task", ...}]``.
  The task ids are the usage fingerprint (a new task since the last look is a use).
* Unload: ``POST /models/unload {"model": M}`` answers ``{"success": true}`` before the child
  exits: the caller polls ``/models`` until the model is ``unloaded``.  A generating model is
  killed by the router after its stop timeout and its request fails: never asked unless forced.
* Load: ``POST /models/load {"model": M}``; a load ahead (pre-warm) then asks one token of
  ``POST /v1/chat/completions`` (``warm_up``): the child maps its file, and only a request
  reads it; the chat leaves the template's opening tokens in the slot's prompt cache.
* The router runs one child per model, on its own port (``--port`` in ``status.args``): that
  port names the child's pid (``gpulock.tenants.procs``) for NVML's per-process figure.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from typing import Any

from gpulock.tenants.base import Adapter, Seen, TenantModel
from gpulock.tenants.http import TenantError, TenantHttpError, items, obj, sub

RUNNING = {"loaded": "loaded", "loading": "loading", "sleeping": "sleeping"}


def arg_value(args: Sequence[Any], *names: str) -> str | None:
    """The value after the first of ``names`` in an argv (``--port 8081`` or ``--port=8081``)."""
    for i, a in enumerate(args):
        if not isinstance(a, str):
            continue
        for n in names:
            if a == n and i + 1 < len(args) and isinstance(args[i + 1], str):
                return str(args[i + 1])
            if a.startswith(n + "="):
                return a[len(n) + 1 :]
    return None


def kv_estimate(path: str | None, n_ctx: int | None) -> int | None:
    """KV cache bytes for ``n_ctx`` tokens from the GGUF header; None when not knowable."""
    if not path or not n_ctx:
        return None
    try:
        from gpulock.core.gguf import KV_BYTES, GGUFError, read_info
    except ImportError:  # gpulock without the router package: the server's figure alone
        return None
    try:
        info = read_info(path)
    except (GGUFError, OSError):
        return None
    if not (info.block_count and info.embedding_length and info.head_count):
        return None
    kv_heads = info.head_count_kv or info.head_count
    per_token = info.embedding_length * kv_heads // info.head_count
    return 2 * info.block_count * n_ctx * per_token * KV_BYTES


class LlamaServerAdapter(Adapter):
    kind = "llama-server"

    def role(self) -> str | None:
        props = obj(self.client.get("/props"), "GET /props")
        role = props.get("role")
        return role if isinstance(role, str) else None

    def list(self) -> Seen:
        props = obj(self.client.get("/props"), "GET /props")
        if props.get("role") != "router":
            name = props.get("model_alias") or props.get("model_path") or self.spec.name
            model = TenantModel(name=str(name), state="loaded", detail="single-model mode")
            return Seen(
                actual_kind="llama-server (single-model)",
                models=(model,),
                notes=("single-model mode cannot unload: configure it as kind: command",),
            )
        body = obj(self.client.get("/models"), "GET /models")
        models = []
        for m in items(body.get("data", []), "GET /models data"):
            name = m.get("id")
            status = sub(m, "status")
            state = RUNNING.get(str(status.get("value")))
            if not isinstance(name, str) or state is None:
                continue
            raw_args = status.get("args")
            args: list[Any] = raw_args if isinstance(raw_args, list) else []
            models.append(self._model(name, state, m, args))
        return Seen(actual_kind="llama-server (router)", models=tuple(models))

    def _model(self, name: str, state: str, m: dict[str, Any], args: Sequence[Any]) -> TenantModel:
        meta = sub(m, "meta")
        weights = meta.get("size")
        size = weights if isinstance(weights, int) and weights > 0 else None
        in_use: bool | None = None
        fingerprint = None
        n_ctx = None
        if state == "loaded":
            try:
                slots = items(self.client.get(self._slots_path(name)), "GET /slots")
                in_use = any(s.get("is_processing") is True for s in slots)
                fingerprint = ",".join(str(s.get("id_task")) for s in slots)
                n_ctx = sum(int(s["n_ctx"]) for s in slots if isinstance(s.get("n_ctx"), int))
            except TenantError:
                pass  # slots off (--no-slots) or the child is busy starting: in use unknown
        if not n_ctx and isinstance(meta.get("n_ctx"), int):
            n_ctx = meta["n_ctx"]  # the child's context, when its slots could not be read
        path = m.get("path") if isinstance(m.get("path"), str) else None
        path = path or arg_value(args, "-m", "--model")
        if size is not None:
            kv = kv_estimate(path, n_ctx)
            size += kv or 0
        port = arg_value(args, "--port")
        return TenantModel(
            name=name,
            state=state,
            size_bytes=size,
            in_use=in_use,
            fingerprint=fingerprint,
            detail=f"child port {port}" if port else None,
            path=path,
        )

    def _slots_path(self, name: str) -> str:
        return "/slots?" + urllib.parse.urlencode({"model": name, "autoload": "false"})

    def child_port(self, model: TenantModel) -> int | None:
        if model.detail and model.detail.startswith("child port "):
            try:
                return int(model.detail.rsplit(" ", 1)[1])
            except ValueError:
                return None
        return None

    def unload(self, model: str, *, force: bool = False, timeout_s: float = 10.0) -> str:
        if self.role() != "router":
            raise TenantHttpError(
                "a single-model llama-server cannot unload; configure it as kind: command"
            )
        reply = self.client.post("/models/unload", {"model": model}, timeout_s=timeout_s)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise TenantHttpError(f"POST /models/unload: refused: {reply}")
        return "unload accepted (the child exits after)"

    def load(
        self, model: str, *, timeout_s: float = 120.0, keep_alive_s: float | None = None
    ) -> None:
        self.client.post("/models/load", {"model": model}, timeout_s=timeout_s)

    def warm_up(self, model: str, *, timeout_s: float = 120.0) -> None:
        # A child maps its GGUF (llama.cpp's default): the load reads little, and the first
        # request faults every weight in, about as long again as a warm request on a 3 GiB
        # model (bench/prewarm.py).  One token of a one-word chat does that ahead of time, and
        # leaves the chat template's opening in the slot's prompt cache, as a job that ran
        # before would have (a chat's first tokens are the template's, whatever the prompt).
        body = {"model": model, "messages": [{"role": "user", "content": "warm"}], "max_tokens": 1}
        self.client.post("/v1/chat/completions", body, timeout_s=timeout_s)
