"""A router gpu-tier call that waits in line warms its GGUF (gpulock.lock.prefetch), with real
llama.cpp on the tiny model and a real process holding the simulated GPU."""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import DEFAULT_WAIT_S, World, wait_until

from gpulock import router
from gpulock.core import pagecache
from gpulock.router.tiny_model import ensure_tiny_llama

pytest.importorskip("llama_cpp")


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return ensure_tiny_llama(tmp_path)


@pytest.fixture(autouse=True)
def unload_models() -> Iterator[None]:
    yield
    from gpulock.router.backends import llama_cpp

    for b in list(llama_cpp._cache.values()):
        b.unload()
    llama_cpp._cache.clear()


def call_behind_a_holder(world: World, m: router.Model, holder_name: str, *, warms: bool) -> None:
    """``m.complete`` in a thread while ``holder_name`` holds the GPU; the holder lets go once
    the call has queued (and, when ``warms``, has warmed its file)."""
    holder = world.hold(holder_name)
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(m.complete("hi", max_tokens=2)))
    waits, warmed = len(world.events("wait")), len(world.events("prefetch"))
    t.start()
    wait_until(lambda: len(world.events("wait")) > waits, DEFAULT_WAIT_S, "the call to queue")
    if warms:
        wait_until(
            lambda: len(world.events("prefetch")) > warmed, DEFAULT_WAIT_S, "a prefetch event"
        )
    holder.release()
    t.join(60)
    assert out and not t.is_alive()


def test_a_gpu_call_waiting_in_line_warms_its_gguf_once(world: World, tiny: Path) -> None:
    # The holders are exclusive: they must not clear the model this test keeps loaded.
    world.config.write_text(
        "simulate: 24GiB\nexclusive_clears_residents: false\n"
        "router:\n  hold_estimate: 100ms\nroutes:\n"
        + textwrap.indent(
            textwrap.dedent(
                f"""\
                t:
                  - tier: gpu
                    backend: llama_cpp
                    model: {tiny}
                    n_ctx: 128
                """
            ),
            "  ",
        )
    )
    pagecache.drop_from_cache(tiny)
    m = router.get_model("t", deadline=120)
    assert m.tier == "gpu"
    call_behind_a_holder(world, m, "holder1", warms=True)
    (e,) = world.events("prefetch")
    assert e["path"] == str(tiny) and e["outcome"] in ("done", "skipped")
    assert e["name"].endswith(":t")  # the call's label: agent:task
    # Loaded now (persistent): the next wait in line has nothing to warm.
    call_behind_a_holder(world, m, "holder2", warms=False)
    assert len(world.events("prefetch")) == 1
