"""``gpulock serve`` in front of upstreams that fail on the wire: the client gets the fallback
(a failure before the first word) or an error in its API's shape (a failure midway), the place
is freed at once, the upstream cools down (the next request does not touch it), and the next
request is served normally; never a 500, never a traceback.

Upstreams: ``raw_upstream.RawUpstream`` (bytes on a socket: a body cut short, broken SSE, an
upstream that never answers, one whose process is killed mid-stream), an Ollama stand-in tenant
whose NDJSON stream breaks (a GPU-tier candidate: its ticket must go), and
``router_servers.FaultServer`` answering well as every task's fallback.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from procs import wait_until
from raw_upstream import RawUpstream
from router_servers import FaultServer
from serve_server import GatewayProc
from serve_wire import connect, request_bytes
from standins.ollama import Ollama

GiB = 1024**3
WAIT_S = 60.0
MSG = [{"role": "user", "content": "hello"}]
HERE = Path(__file__).resolve().parent


class BrokenNdjson(Ollama):
    """An Ollama whose chat stream breaks after its first line."""

    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        if method == "POST" and path == "/api/chat" and isinstance(body, dict):
            self.load(str(body.get("model")))
            first = {"model": body.get("model"), "done": False, "message": {"content": "hi"}}
            return 200, json.dumps(first) + '\n{"model": "broken'
        return super().handle(method, path, query, body)


class World:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ok = FaultServer(mode="ok").start()
        self.raw = {m: RawUpstream(m).start() for m in ("short-body", "bad-sse", "bad-sse-late")}
        self.raw["hang"] = RawUpstream("hang").start()
        self.killed = subprocess.Popen(
            [sys.executable, str(HERE / "raw_upstream.py"), "stream-then-wait"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.killed.stdout is not None
        self.killed_port = int(self.killed.stdout.readline())
        self.ollama = BrokenNdjson({"m": 1 * GiB})
        self.ollama.start()

    def routes(self) -> dict[str, Any]:
        def cloud(name: str, url: str, **extra: Any) -> dict[str, Any]:
            c = {"tier": "cloud", "backend": "openai", "model": "m", "base_url": url}
            return {**c, "api_key_env": "UPSTREAM_KEY", "max_tokens": 8, "name": name, **extra}

        routes: dict[str, Any] = {}
        for task, url, extra in [
            ("short", self.raw["short-body"].base_url, {}),
            ("badsse", self.raw["bad-sse"].base_url, {}),
            ("late", self.raw["bad-sse-late"].base_url, {}),
            ("hang", self.raw["hang"].base_url, {"timeout": "1s"}),
            ("killed", f"http://127.0.0.1:{self.killed_port}/v1", {}),
        ]:
            routes[task] = [
                cloud(f"{task}-up", url, **extra),
                cloud(f"{task}-ok", self.ok.base_url),
            ]
        routes["tenant"] = [
            {"tenant": "ol", "model": "m", "max_tokens": 8, "name": "tenant-up"},
            cloud("tenant-ok", self.ok.base_url),
        ]
        return routes

    def stop(self) -> None:
        self.ok.stop()
        for r in self.raw.values():
            r.close()
        self.killed.kill()
        self.killed.wait()
        self.ollama.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("faults"))
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def gateway(world: World) -> Iterator[GatewayProc]:
    config = world.root / "gpulock.yaml"
    doc = {
        "simulate": "24GiB",
        "tenants": [{"name": "ol", "kind": "ollama", "url": world.ollama.url}],
        "router": {"cooldown": "60s"},
        "routes": world.routes(),
    }
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    env = {
        "GPULOCK_CONFIG": str(config),
        "GPULOCK_STATE_DIR": str(world.root / "state"),
        "UPSTREAM_KEY": "k",
    }
    g = GatewayProc(world.root / "serve.log", env=env)
    try:
        yield g.start()
    finally:
        g.stop()


def chat(g: GatewayProc, task: str, path: str = "/v1/chat/completions", **extra: Any) -> Any:
    return g.request("POST", path, {"model": task, "messages": MSG, **extra})


def settled(g: GatewayProc) -> bool:
    """Nothing running or waiting in the gateway, no ticket on the GPU."""
    health = g.request("GET", "/health").json()
    snap = g.request("GET", "/gpulock/status").json()
    busy = [t for gpu in snap["gpus"] for t in gpu.get("holders", []) + gpu.get("waiters", [])]
    return not (health["waiting"] or health["running"] or busy)


def then_cooled_and_served(g: GatewayProc, task: str, hits: Any) -> None:
    before = hits()
    r = chat(g, task, stream=False)
    assert r.status == 200 and r.headers["x-gpulock-model"] == f"{task}-ok", r.body
    assert hits() == before, f"{task}-up was called again while cooling down"
    assert wait_until(lambda: settled(g), WAIT_S, "nothing left running")
    assert "Traceback" not in g.output(), g.output()


@pytest.mark.parametrize("task", ["short", "hang", "badsse"])
def test_a_failure_before_the_first_word_falls_back(
    gateway: GatewayProc, world: World, task: str
) -> None:
    up = world.raw[{"short": "short-body", "hang": "hang", "badsse": "bad-sse"}[task]]
    stream = task == "badsse"
    r = chat(gateway, task, stream=stream)
    assert r.status == 200, r.body
    assert r.headers["x-gpulock-model"] == f"{task}-ok"
    if stream:
        assert r.body.rstrip().endswith(b"data: [DONE]")
    assert up.hits == 1
    then_cooled_and_served(gateway, task, lambda: up.hits)


def test_a_stream_that_breaks_midway_ends_with_an_error_in_each_apis_shape(
    gateway: GatewayProc, world: World
) -> None:
    up = world.raw["bad-sse-late"]
    r = chat(gateway, "late", stream=True)
    assert r.status == 200 and r.headers["x-gpulock-model"] == "late-up"
    events = [json.loads(e[6:]) for e in r.body.decode().split("\n\n") if e.startswith("data: {")]
    assert events[1]["choices"][0]["delta"]["content"] == "fi"
    err = events[-1]["error"]
    assert set(err) == {"message", "type", "param", "code"} and "late-up" in err["message"]
    assert wait_until(lambda: settled(gateway), WAIT_S, "nothing left running")
    then_cooled_and_served(gateway, "late", lambda: up.hits)


def test_an_upstream_killed_mid_stream(gateway: GatewayProc, world: World) -> None:
    body = json.dumps({"model": "killed", "messages": MSG, "stream": True}).encode()
    with connect(gateway.port) as s:
        s.sendall(request_bytes("POST", "/api/chat", body))
        got = b""
        while b'"content":"fi"' not in got:
            got += s.recv(4096)
        world.killed.send_signal(signal.SIGKILL)
        while not got.endswith(b"0\r\n\r\n"):  # the chunked body's end
            more = s.recv(4096)
            if not more:
                break
            got += more
    lines = [x for x in got.decode().split("\r\n") if x.startswith("{")]
    last = json.loads(lines[-1])
    assert list(last) == ["error"] and "killed-up" in last["error"], lines
    assert wait_until(lambda: settled(gateway), WAIT_S, "nothing left running")
    r = chat(gateway, "killed", path="/api/chat", stream=False)
    assert r.status == 200 and r.headers["x-gpulock-model"] == "killed-ok", r.body
    assert "Traceback" not in gateway.output(), gateway.output()


def test_a_tenant_whose_ndjson_breaks_releases_its_ticket_at_once(
    gateway: GatewayProc, world: World
) -> None:
    r = chat(gateway, "tenant", path="/api/chat", stream=True)
    assert r.status == 200, r.body
    lines = [json.loads(x) for x in r.body.decode().splitlines() if x.strip()]
    if r.headers["x-gpulock-model"] == "tenant-up":  # broke after its first word
        assert list(lines[-1]) == ["error"], lines
    else:  # broke before it: the fallback answered
        assert r.headers["x-gpulock-model"] == "tenant-ok" and lines[-1]["done"] is True
    assert wait_until(lambda: settled(gateway), WAIT_S, "the tenant's ticket released")
    events = (world.root / "state" / "events.jsonl").read_text().splitlines()
    kinds = [json.loads(e)["event"] for e in events]
    assert kinds.count("acquire") == kinds.count("release") >= 1
    n = len([h for h in world.ollama.hits if h[1] == "/api/chat"])
    r = chat(gateway, "tenant", path="/api/chat", stream=False)
    assert r.status == 200 and r.headers["x-gpulock-model"] == "tenant-ok", r.body
    assert len([h for h in world.ollama.hits if h[1] == "/api/chat"]) == n  # cooling down
    assert "Traceback" not in gateway.output(), gateway.output()
