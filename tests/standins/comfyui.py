"""ComfyUI stand-in, following the API of ComfyUI v0.3.60 (``server.py``).

* ``GET /system_stats`` -> ``{"system": {...}, "devices": [{"name", "type", "index",
  "vram_total", "vram_free", "torch_vram_total", "torch_vram_free"}]}``.
* ``GET /queue`` -> ``{"queue_running": [...], "queue_pending": [...]}``.
* ``POST /free {"unload_models": true, "free_memory": true}`` answers 200 at once -- the
  pitfall: the prompt worker frees only between jobs, so memory comes back later, and not
  while a job runs.
"""

from __future__ import annotations

from typing import Any

from standins.base import StandIn


class ComfyUI(StandIn):
    def __init__(self, total: int, held: int, free_delay_s: float = 0.2) -> None:
        super().__init__()
        self.total = total
        self.held = held
        self.running: list[Any] = []
        self.free_pending = False
        self.free_delay_s = free_delay_s

    def _worker_frees(self) -> None:
        with self.lock:
            if self.free_pending and not self.running:
                self.held = 0
                self.free_pending = False

    def finish_jobs(self) -> None:
        with self.lock:
            self.running.clear()
        self.later(self.free_delay_s, self._worker_frees)

    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        if method == "GET" and path == "/system_stats":
            with self.lock:
                dev = {
                    "name": "cuda:0 stand-in", "type": "cuda", "index": 0,
                    "vram_total": self.total, "vram_free": self.total - self.held,
                    "torch_vram_total": self.held, "torch_vram_free": 0,
                }  # fmt: skip
            return 200, {"system": {"os": "posix", "comfyui_version": "0.3.60"}, "devices": [dev]}
        if method == "GET" and path == "/queue":
            with self.lock:
                return 200, {"queue_running": list(self.running), "queue_pending": []}
        if method == "POST" and path == "/free":
            with self.lock:
                if isinstance(body, dict) and (
                    body.get("unload_models") or body.get("free_memory")
                ):
                    self.free_pending = True
            self.later(self.free_delay_s, self._worker_frees)
            return 200, ""
        return 404, "404: Not Found"
