"""LocalAI (API of v3.5, ``docs/.../system-info`` and ``backend-monitor``).

* Listing: ``GET /system`` -> ``{"backends": [...], "loaded_models": [{"id", "backend",
  "process": {"pid", ...}, "size_vram"}]}`` (``process`` and ``size_vram`` are optional).
* Unload: ``POST /backend/shutdown {"model": M}`` stops that model's backend process.
* Load: ``POST /backend/load {"model": M}``.
* In use: ``GET /backend/monitor?model=M`` -> ``{"state": 1}`` while its backend is busy
  (0 uninitialized, 2 ready, -1 error); unknown when the monitor does not answer.
"""

from __future__ import annotations

import urllib.parse

from gpulock.tenants.base import Adapter, Seen, TenantModel
from gpulock.tenants.http import TenantError, items, obj, sub

BUSY = 1  # /backend/monitor's state while the backend serves a request


class LocalAIAdapter(Adapter):
    kind = "localai"

    def list(self) -> Seen:
        body = obj(self.client.get("/system"), "GET /system")
        models = []
        for m in items(body.get("loaded_models") or [], "GET /system loaded_models"):
            name = m.get("id")
            if not isinstance(name, str):
                continue
            vram = m.get("size_vram")
            proc = sub(m, "process")
            pid = proc.get("pid")
            models.append(
                TenantModel(
                    name=name,
                    state="loaded",
                    size_bytes=vram if isinstance(vram, int) and vram >= 0 else None,
                    pid=pid if isinstance(pid, int) and pid > 0 else None,
                    in_use=self._busy(name),
                )
            )
        return Seen(actual_kind="localai", models=tuple(models))

    def _busy(self, model: str) -> bool | None:
        path = "/backend/monitor?" + urllib.parse.urlencode({"model": model})
        try:
            state = obj(self.client.get(path), "GET /backend/monitor").get("state")
        except TenantError:
            return None
        return state == BUSY if isinstance(state, int) else None

    def unload(self, model: str, *, force: bool = False, timeout_s: float = 10.0) -> str:
        self.client.request(
            "POST", "/backend/shutdown", {"model": model}, timeout_s=timeout_s, expect_json=False
        )
        return "backend shut down"

    def load(
        self, model: str, *, timeout_s: float = 120.0, keep_alive_s: float | None = None
    ) -> None:
        self.client.request(
            "POST", "/backend/load", {"model": model}, timeout_s=timeout_s, expect_json=False
        )
