"""llama-swap (API of v160+, its README and ``proxy/proxymanager.go``).

* Listing: ``GET /running`` -> ``{"running": [{"model": ID, "state": "ready" | "starting" |
  "stopping" | ..., ...}]}``; sizes are not reported (the upstream servers are its own
  processes: NVML per process on a real GPU).
* Unload: ``POST /api/models/unload/{model}`` blocks until that upstream has stopped.
* Load: any request for the model starts it; there is no load endpoint, so ``load`` asks
  ``GET /upstream/{model}/health``, which makes llama-swap start it.
"""

from __future__ import annotations

import urllib.parse

from gpulock.tenants.base import Adapter, Seen, TenantModel
from gpulock.tenants.http import items, obj

STATES = {"ready": "loaded", "starting": "loading", "stopping": "unloading"}


class LlamaSwapAdapter(Adapter):
    kind = "llama-swap"

    def list(self) -> Seen:
        body = obj(self.client.get("/running"), "GET /running")
        models = []
        for m in items(body.get("running", []), "GET /running running"):
            name = m.get("model")
            state = STATES.get(str(m.get("state")))
            if isinstance(name, str) and state is not None:
                models.append(TenantModel(name=name, state=state))
        return Seen(actual_kind="llama-swap", models=tuple(models))

    def unload(self, model: str, *, force: bool = False, timeout_s: float = 10.0) -> str:
        path = "/api/models/unload/" + urllib.parse.quote(model, safe="")
        self.client.request("POST", path, None, timeout_s=timeout_s, expect_json=False)
        return "stopped"

    def load(
        self, model: str, *, timeout_s: float = 120.0, keep_alive_s: float | None = None
    ) -> None:
        path = f"/upstream/{urllib.parse.quote(model, safe='')}/health"
        self.client.request("GET", path, timeout_s=timeout_s, expect_json=False)
