"""llama-swap stand-in, following the API of llama-swap v160 (README, ``proxymanager.go``).

* ``GET /running`` -> ``{"running": [{"model": ID, "state": "ready" | "starting" |
  "stopping", "cmd", "proxy", "ttl", ...}]}``.
* ``POST /api/models/unload/{model}`` stops that upstream and answers when it has stopped.
* ``GET /upstream/{model}/...`` starts the model if needed and proxies to it.
"""

from __future__ import annotations

import time
import urllib.parse
from typing import Any

from standins.base import StandIn


class LlamaSwap(StandIn):
    def __init__(self, models: list[str], stop_s: float = 0.1) -> None:
        super().__init__()
        self.models = models
        self.running: dict[str, str] = {}
        self.stop_s = stop_s

    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        if method == "GET" and path == "/running":
            with self.lock:
                rows = [{"model": m, "state": s, "cmd": f"llama-server -m {m}.gguf",
                         "proxy": "http://127.0.0.1:5800", "ttl": 0}
                        for m, s in self.running.items()]  # fmt: skip
            return 200, {"running": rows}
        if method == "POST" and path.startswith("/api/models/unload/"):
            name = urllib.parse.unquote(path.rsplit("/", 1)[1])
            with self.lock:
                if name in self.running:
                    self.running[name] = "stopping"
            time.sleep(self.stop_s)  # blocks until the upstream has stopped
            with self.lock:
                self.running.pop(name, None)
            return 200, "OK"
        if method == "GET" and path.startswith("/upstream/"):
            name = urllib.parse.unquote(path.split("/")[2])
            if name not in self.models:
                return 404, "model not found"
            with self.lock:
                self.running[name] = "ready"
            return 200, "OK"
        if path == "/health":
            return 200, "OK"
        return 404, "404 page not found"
