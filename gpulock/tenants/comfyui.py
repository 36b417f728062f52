"""ComfyUI (API of v0.3.60, ``server.py``): ``/system_stats``, ``/queue``, ``/free``.

ComfyUI lists no models; what it holds is its torch memory.  It is one resident named after
the tenant, sized by ``/system_stats`` -> ``devices[i].torch_vram_total`` (what its torch
allocator reserved on that GPU; ``vram_free`` / ``vram_total`` are the whole GPU's).

* In use: ``GET /queue`` -> ``{"queue_running": [...], "queue_pending": [...]}``: anything
  there is a render that must not lose its models.
* Unload: ``POST /free {"unload_models": true, "free_memory": true}`` answers 200 at once; the
  worker frees between jobs, so the caller watches ``torch_vram_total`` fall.  Asked only when
  the queue is empty, unless forced.
* Load: nothing to call (a workflow loads what it needs).
"""

from __future__ import annotations

from gpulock.tenants.base import Adapter, Seen, TenantModel
from gpulock.tenants.http import TenantBusy, TenantHttpError, items, obj

FREED_BELOW = 64 * 1024**2  # torch keeps a little after empty_cache(): under this is "freed"


class ComfyUIAdapter(Adapter):
    kind = "comfyui"
    can_load = False

    def queue_length(self) -> int:
        q = obj(self.client.get("/queue"), "GET /queue")
        running = q.get("queue_running") or []
        pending = q.get("queue_pending") or []
        return (len(running) if isinstance(running, list) else 0) + (
            len(pending) if isinstance(pending, list) else 0
        )

    def list(self) -> Seen:
        stats = obj(self.client.get("/system_stats"), "GET /system_stats")
        devices = items(stats.get("devices", []), "GET /system_stats devices")
        dev = next((d for d in devices if d.get("index") == self.spec.gpu), None)
        if dev is None and devices:
            dev = devices[0]
        torch_total = dev.get("torch_vram_total") if dev else None
        size = torch_total if isinstance(torch_total, int) and torch_total >= 0 else None
        queued = self.queue_length()
        free = dev.get("vram_free") if dev else None
        total = dev.get("vram_total") if dev else None
        models: tuple[TenantModel, ...] = ()
        if size is None or size >= FREED_BELOW:
            models = (
                TenantModel(
                    name=self.spec.name,
                    state="loaded",
                    size_bytes=size,
                    in_use=queued > 0,
                    detail=f"{queued} job(s) queued" if queued else None,
                ),
            )
        return Seen(
            actual_kind="comfyui",
            models=models,
            free_bytes=free if isinstance(free, int) else None,
            total_bytes=total if isinstance(total, int) else None,
        )

    def unload(self, model: str, *, force: bool = False, timeout_s: float = 10.0) -> str:
        if not force and self.queue_length() > 0:
            raise TenantBusy("ComfyUI has jobs queued: /free waits for an empty queue")
        self.client.request(
            "POST", "/free", {"unload_models": True, "free_memory": True},
            timeout_s=timeout_s, expect_json=False,
        )  # fmt: skip
        return "free requested (the worker frees between jobs)"

    def load(
        self, model: str, *, timeout_s: float = 120.0, keep_alive_s: float | None = None
    ) -> None:
        raise TenantHttpError("ComfyUI loads models when a workflow runs; nothing to call")
