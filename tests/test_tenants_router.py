"""The router calls tenant models: ``{tier: gpu, tenant: NAME, model: ...}`` candidates.

Ollama (stand-in): through its native API with keep_alive (0 for cold-start, the route's value
for persistent), under a ticket whose need is the model's size, warm when Ollama holds the
model.  ``kind: command`` (a real ``python -m llama_cpp.server``): the first call starts it.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from router_servers import free_port
from standins.ollama import Ollama
from tenant_helpers import write_config

from gpulock import router
from gpulock.core import settings as settings_mod
from gpulock.core.config import load_config
from gpulock.core.errors import ConfigError
from gpulock.lock.queuedir import QueueDir
from gpulock.residents import registry
from gpulock.router.routes import load_table
from gpulock.tenants import survey

GiB = 1024**3


def routes(ollama_url: str, **candidate: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    tenants = [{"name": "ollama", "kind": "ollama", "url": ollama_url}]
    task = {"summarize": [{"tier": "gpu", "tenant": "ollama", "model": "qwen2.5:7b", **candidate}]}
    return tenants, task


def test_a_tenant_candidate_must_name_a_configured_tenant(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path, [{"name": "ollama", "kind": "ollama", "url": "http://127.0.0.1:1"}],
        routes={"t": [{"tenant": "olama", "model": "m"}]},
    )  # fmt: skip
    with pytest.raises(ConfigError) as e:
        load_table(load_config(str(cfg)))
    assert e.value.key == "routes.t[0].tenant"
    assert e.value.hint is not None and "ollama" in e.value.hint


def test_persistent_call_passes_the_routes_keep_alive_and_is_warm_when_held(
    tmp_path: Path,
) -> None:
    s = Ollama({"qwen2.5:7b": 5 * GiB})
    s.start()
    try:
        tenants, task = routes(s.url, keep_alive="10m")
        cfg = write_config(tmp_path, tenants, routes=task)
        state = str(tmp_path / "state")
        m = router.get_model("summarize", config=str(cfg), state_dir=state)
        assert (m.tier, m.name) == ("gpu", "qwen2.5:7b")
        seen: list[Any] = []
        s.hold.clear()
        t = threading.Thread(target=lambda: seen.append(m.complete("hello", max_tokens=8)))
        t.start()
        settings = settings_mod.load(str(cfg), state)
        deadline = time.monotonic() + 30
        while not s.loaded.get("qwen2.5:7b", {}).get("inflight"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (holder,) = QueueDir(settings, 0, create=False).holders()
        assert holder.need_bytes is None  # first call: size unknown until Ollama holds it
        assert list(holder.command) == ["gpulock-tenant-call", "ollama/qwen2.5:7b"]
        s.hold.set()
        t.join(30)
        assert seen == ["hi"]
        (_, _, body) = next(h for h in s.hits if h[1] == "/api/generate")
        assert body["keep_alive"] == "600s" and body["options"]["num_predict"] == 8
        # Ollama holds it now: the next choice is warm, with the model's size as its need
        again = router.get_model("summarize", config=str(cfg), state_dir=state)
        assert again.choice.chosen is not None and again.choice.chosen.warm
        assert again.choice.chosen.need_bytes == 5 * GiB
        again.complete("again")
        rec = registry.to_records(settings, survey.survey(settings), track=False)
        assert rec[0].idle_known  # the routed calls are recorded as uses
    finally:
        s.stop()


def test_cold_start_call_passes_keep_alive_zero(tmp_path: Path) -> None:
    s = Ollama({"qwen2.5:7b": 5 * GiB})
    s.start()
    try:
        tenants, task = routes(s.url, policy="cold-start", vram="6GiB")
        cfg = write_config(tmp_path, tenants, routes=task)
        m = router.get_model("summarize", config=str(cfg), state_dir=str(tmp_path / "state"))
        assert m.chat([{"role": "user", "content": "hi"}]) == "hi"
        bodies = [b for _m, p, b in s.hits if p in ("/api/chat", "/api/generate")]
        assert bodies and all(b["keep_alive"] == 0 for b in bodies)
    finally:
        s.stop()


@pytest.mark.slow
def test_a_command_tenant_is_started_by_the_first_call(tmp_path: Path) -> None:
    from gpulock.router.tiny_model import ensure_tiny_llama

    model = ensure_tiny_llama(tmp_path / "models")
    port = free_port()
    tenants = [
        {
            "name": "tiny", "kind": "command",
            "command": [sys.executable, "-m", "llama_cpp.server", "--model", str(model),
                        "--n_ctx", "256", "--n_gpu_layers", "0", "--host", "127.0.0.1",
                        "--port", str(port)],
            "url": f"http://127.0.0.1:{port}", "health": "/v1/models", "need": "1GiB",
            "models": ["tiny"], "ready_timeout": "90s",
        }
    ]  # fmt: skip
    cfg = write_config(tmp_path, tenants, routes={"t": [{"tenant": "tiny", "model": "tiny"}]})
    state = str(tmp_path / "state")
    settings = settings_mod.load(str(cfg), state)
    adapter = survey.adapter_for(settings.config.tenants[0], settings)
    try:
        assert survey.survey(settings)[0].models == ()
        m = router.get_model("t", config=str(cfg), state_dir=state)
        text = m.complete("Once upon a time", max_tokens=4)
        assert isinstance(text, str)
        pieces = list(m.complete("Once upon a time", max_tokens=4, stream=True))
        assert pieces and all(isinstance(p, str) for p in pieces)  # OpenAI's server-sent events
        (li,) = survey.survey(settings)
        assert [x.state for x in li.models] == ["loaded"]
    finally:
        adapter.unload("tiny")


def test_a_stream_comes_in_pieces_under_one_ticket(tmp_path: Path) -> None:
    s = Ollama({"qwen2.5:7b": 5 * GiB})
    s.start()
    try:
        tenants, task = routes(s.url, vram="6GiB")
        cfg = write_config(tmp_path, tenants, routes=task)
        state = str(tmp_path / "state")
        m = router.get_model("summarize", config=str(cfg), state_dir=state)
        pieces = list(m.chat([{"role": "user", "content": "hi"}], stream=True))
        assert pieces == ["h", "i"]
        (_, _, body) = next(h for h in s.hits if h[1] == "/api/chat")
        assert body["stream"] is True
        settings = settings_mod.load(str(cfg), state)
        assert QueueDir(settings, 0, create=False).holders() == []  # given back at the end
        from gpulock.core import events

        (call,) = [e for e in events.read(settings.state_dir) if e["event"] == "call"]
        assert (call["tokens_in"], call["tokens_out"]) == (3, 2)
        assert call["tenant"] == "ollama"  # the server pre-warming asks to load it ahead
    finally:
        s.stop()
