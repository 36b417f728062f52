"""A GPU's free memory is one figure: what ``gpulock status`` shows, the cluster publishes and
the router reads (the lock's claims count: an exclusive holder's GPU is not free)."""

from __future__ import annotations

from procs import World

from gpulock import status
from gpulock.router import probe
from gpulock.router.routes import load_table


def test_a_gpu_held_exclusively_is_not_free_for_status_router_or_cluster(world: World) -> None:
    world.config.write_text(
        "simulate: 24GiB\nroutes:\n  t:\n"
        "    - {tier: gpu, backend: llama_cpp, model: /nonexistent.gguf, vram: 2GiB}\n"
    )
    s = world.settings()
    table = load_table(s.config)
    cands = list(table.tasks["t"])

    def figures() -> tuple[int | None, int | None, int | None]:
        shown = status.snapshot(s)["gpus"][0]["free_bytes"]
        g = probe.host(s, cands, table.settings).gpus[0]
        return shown, g.shown_free_bytes, g.free_bytes

    shown, routed, _ = figures()
    assert shown == routed == 24 << 30  # idle: all of it
    holder = world.hold("holder")  # exclusive: no need given
    shown, routed, fits = figures()
    assert shown == routed == fits == 0, (shown, routed, fits)
    assert probe.host(s, cands, table.settings).gpus[0].claimed_bytes == 24 << 30
    holder.release()
