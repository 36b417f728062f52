"""LocalAI stand-in, following the API of LocalAI v3.5 (``/system``, ``/backend/*``).

* ``GET /system`` -> ``{"backends": [...], "loaded_models": [{"id", "backend",
  "process": {"pid", "rss_bytes", ...}, "size_vram"}]}``.
* ``POST /backend/shutdown {"model": M}`` stops M's backend (gone from ``loaded_models``).
* ``POST /backend/load {"model": M}`` loads it.
* ``GET /backend/monitor?model=M`` -> ``{"state": 1 busy | 2 ready, "memory": {...}}``; a
  model not loaded is a 500 (its gRPC client is gone).
"""

from __future__ import annotations

import os
from typing import Any

from standins.base import StandIn


class LocalAI(StandIn):
    def __init__(self, catalog: dict[str, int]) -> None:
        super().__init__()
        self.catalog = catalog
        self.loaded: set[str] = set()
        self.busy: set[str] = set()

    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        if method == "GET" and path == "/system":
            with self.lock:
                models = [
                    {"id": m, "backend": "llama-cpp", "size_vram": self.catalog[m],
                     "process": {"pid": os.getpid(), "rss_bytes": 1 << 20}}
                    for m in sorted(self.loaded)
                ]  # fmt: skip
            return 200, {"backends": ["llama-cpp"], "loaded_models": models}
        if method == "GET" and path == "/backend/monitor":
            m = query.get("model", "")
            if m not in self.loaded:
                return 500, {"error": {"code": 500, "message": f"backend {m} not loaded"}}
            return 200, {"state": 1 if m in self.busy else 2,
                         "memory": {"total": self.catalog[m], "breakdown": {}}}  # fmt: skip
        name = body.get("model") if isinstance(body, dict) else None
        if method == "POST" and path == "/backend/shutdown":
            with self.lock:
                self.loaded.discard(str(name))
            return 200, {"message": "ok"}
        if method == "POST" and path == "/backend/load":
            if name not in self.catalog:
                return 404, {"error": {"message": "model not found"}}
            with self.lock:
                self.loaded.add(str(name))
            return 200, {"message": "ok"}
        return 404, {"error": {"code": 404, "message": "Not Found"}}
