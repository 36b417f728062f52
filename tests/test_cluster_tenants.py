"""Tenant gpu candidates placed across hosts, for real: two ``gpulock serve`` hosts with their
own state folders, simulated GPUs and ports, one real ``redis-server``, and on each host its own
Ollama stand-in (tests/standins/ollama.py: Ollama cannot run here) holding the route's gpu
candidate ``qwen-gpu``.

A request sent to a peer runs there through the peer's own tenant: the peer's stand-in gets the
call, in the peer's line under the agent's name.  ``warm`` for a tenant's model means "its
tenant holds it now" on both sides: in the report a host publishes, and in its own estimate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from procs import wait_until
from redis_server import RedisServer, need_redis
from router_servers import free_port, kill_group
from serve_server import clean_env
from standins.ollama import Ollama
from test_cluster_serve import Host, fleet, hold_gpu

from gpulock.cluster.config import ClusterConfig
from gpulock.cluster.place import TRANSIT_S
from gpulock.cluster.store import Store

GiB = 1024**3
MODEL = "qwen2.5:7b"
WAIT_S = 30.0


def tenant_host(root: Path, name: str, redis: RedisServer, body: str) -> Host:
    """A host of the cluster on a simulated 24 GiB GPU; ``body``: its ``tenants:`` and
    ``routes:`` (YAML, indented as it likes)."""
    folder = root / name
    folder.mkdir()
    port = free_port()
    config = folder / "gpulock.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            simulate: 24GiB
            cluster:
              redis: {redis.url}
              host: {name}
              gateway: http://127.0.0.1:{port}
              heartbeat: 1s
              remote_penalty: 500ms
              peer_timeout: 10s
            """
        )
        + textwrap.dedent(body)
    )
    env = {"GPULOCK_CONFIG": str(config), "GPULOCK_STATE_DIR": str(folder / "state")}
    return Host(log=folder / "serve.log", env=env, port=port, name=name, folder=folder)


def make_host(root: Path, name: str, redis: RedisServer, ollama: Ollama) -> Host:
    return tenant_host(
        root,
        name,
        redis,
        f"""\
        tenants:
          - {{name: ollama, kind: ollama, url: '{ollama.url}'}}
        routes:
          chat:
            - {{tenant: ollama, model: '{MODEL}', vram: 5GiB, policy: persistent,
               max_tokens: 4, name: qwen-gpu}}
        """,
    )


@dataclass
class Pool:
    redis: RedisServer
    a: Host
    b: Host
    oa: Ollama  # a's tenant
    ob: Ollama  # b's tenant


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    need_redis()
    root = tmp_path_factory.mktemp("cluster-tenants")
    oa = Ollama({MODEL: 5 * GiB}).start()
    ob = Ollama({MODEL: 5 * GiB}).start()
    assert isinstance(oa, Ollama) and isinstance(ob, Ollama)
    redis = RedisServer(root / "redis").start()
    a = make_host(root, "a", redis, oa)
    b = make_host(root, "b", redis, ob)
    try:
        b.start()
        a.start()
        wait_until(lambda: _names(a) == ["a", "b"], WAIT_S, "both hosts in Redis")
        yield Pool(redis, a, b, oa, ob)
    finally:
        for h in (a, b):
            h.stop()
        redis.stop()
        oa.stop()
        ob.stop()


def _names(h: Host) -> list[str]:
    return [x["name"] for x in h.request("GET", "/gpulock/cluster").json()["hosts"]]


def chats(s: Ollama) -> int:
    """Generations the stand-in served (a load without a prompt is not one)."""
    with s.lock:
        return sum(
            1
            for method, path, body in s.hits
            if method == "POST"
            and path in ("/api/chat", "/api/generate")
            and isinstance(body, dict)
            and (body.get("messages") or body.get("prompt"))
        )


def row(seen_by: Host, name: str) -> dict[str, Any] | None:
    seen = seen_by.request("GET", "/gpulock/cluster").json()
    return next((x for x in seen["hosts"] if x["name"] == name), None)


def idle(r: dict[str, Any] | None) -> bool:
    return (
        r is not None
        and not r["in_flight"]
        and not any(g["holding"] or g["waiting"] for g in r["gpus"])
    )


def route(h: Host, *args: str) -> dict[str, Any]:
    r = h.gpulock("route", "chat", "--json", *args)
    assert r.returncode == 0, r.stderr
    obj: dict[str, Any] = json.loads(r.stdout)
    return obj


AGENT = """\
import json, sys
from gpulock import router
m = router.get_model("chat", agent=sys.argv[1])
text = m.chat([{"role": "user", "content": "hi"}], max_tokens=4)
print(json.dumps({"host": m.host, "tier": m.tier, "text": text}))
"""


def test_each_host_publishes_its_tenant_candidate(pool: Pool) -> None:
    obj = fleet(pool.b)
    r = next(x for x in obj["hosts"] if x["name"] == "a")
    assert r["candidates"] == ["qwen-gpu"] and r["warm"] == []


def test_a_busy_local_line_sends_a_tenant_request_to_the_idle_peer(pool: Pool) -> None:
    a, b = pool.a, pool.b
    blocker = hold_gpu(a, "blocker")
    try:
        wait_until(lambda: (row(a, "a") or {"gpus": [{"holding": 0}]})["gpus"][0]["holding"],
                   WAIT_S, "a's report to show its GPU held")  # fmt: skip
        wait_until(lambda: idle(row(a, "b")), WAIT_S, "b idle, as a sees it")
        before_a, before_b = chats(pool.oa), chats(pool.ob)
        r = a.chat("agent-busy")
        assert r.status == 200, r.body
        assert r.headers["x-gpulock-host"] == "b"
        assert r.json()["choices"][0]["message"]["content"] == "hi"
        # It ran through b's own tenant, in b's line under the agent's name.
        assert chats(pool.ob) == before_b + 1 and chats(pool.oa) == before_a
        assert [e for e in b.events("acquire") if e.get("name") == "agent-busy"]
        # Call events are written behind the answer (serve batches them): wait for them.
        calls = wait_until(
            lambda: [e for e in b.events("call") if e.get("agent") == "agent-busy"],
            WAIT_S,
            "b's call event",
        )
        assert calls[0]["host"] == "b" and calls[0]["model"] == "qwen-gpu", calls
        on_a = wait_until(
            lambda: [e["host"] for e in a.events("call") if e.get("agent") == "agent-busy"],
            WAIT_S,
            "a's call event",
        )
        assert on_a == ["b"]
        st = json.loads(b.gpulock("status", "--json").stdout)
        held = json.dumps(st["residents"])
        assert f"ollama/{MODEL}" in held, st["residents"]  # b's tenant holds it now
        # get_model / gpulock route on a: the same placement, and the agent's call runs on b.
        explained = a.gpulock("route", "chat", "--explain").stdout
        assert "on b: starts in" in explained and "here: ~" in explained, explained
        assert route(a)["host"] == "b"
        agent = subprocess.run(
            [sys.executable, "-c", AGENT, "agent-model"],
            env={**clean_env(), **a.env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert agent.returncode == 0, agent.stderr
        got = json.loads(agent.stdout)
        assert got == {"host": "b", "tier": "gpu", "text": "hi"}, got
        assert chats(pool.ob) == before_b + 2 and chats(pool.oa) == before_a
        assert [e for e in b.events("acquire") if e.get("name") == "agent-model"]
    finally:
        kill_group(blocker)


def test_a_warm_peer_wins_over_a_cold_local_load_and_a_warm_host_keeps_it(pool: Pool) -> None:
    a, b = pool.a, pool.b
    with pool.oa.lock:
        pool.oa.loaded.clear()  # a's Ollama holds nothing: a load (~5 s for 5 GiB) here
    pool.ob.load(MODEL)  # b's holds the model: warm there
    wait_until(
        lambda: idle(row(a, "b")) and "qwen-gpu" in (row(a, "b") or {}).get("warm", []),
        WAIT_S,
        "b idle with qwen-gpu warm, as a sees it",
    )
    wait_until(lambda: idle(row(a, "a")), WAIT_S, "a idle")
    assert route(a)["host"] == "b"  # b: 0 s + 0.5 s penalty < a: ~5 s load
    before_a, before_b = chats(pool.oa), chats(pool.ob)
    r = a.chat("agent-warm")
    assert r.status == 200 and r.headers["x-gpulock-host"] == "b", r.body
    assert chats(pool.ob) == before_b + 1 and chats(pool.oa) == before_a
    # A request a peer forwarded runs where it lands: a's tenant now holds the model.
    r = a.chat("agent-local", **{"X-Gpulock-From": "test"})
    assert r.status == 200 and r.headers["x-gpulock-host"] == "a", r.body
    assert chats(pool.oa) == before_a + 1
    # Warm here (a's tenant holds it): 0 s beats b's 0.5 s penalty, in serve and in route.
    wait_until(lambda: idle(row(a, "a")) and idle(row(a, "b")), WAIT_S, "both idle")
    assert route(a)["host"] == "a"
    r = a.chat("agent-tie")
    assert r.status == 200 and r.headers["x-gpulock-host"] == "a", r.body
    assert chats(pool.oa) == before_a + 2 and chats(pool.ob) == before_b + 1
    # What a publishes agrees with what a estimates: its tenant's model is warm.
    wait_until(
        lambda: next(x for x in fleet(b)["hosts"] if x["name"] == "a")["warm"] == ["qwen-gpu"],
        WAIT_S,
        "a's report to say qwen-gpu is warm",
    )


def test_requests_waiting_for_tickets_of_their_own_count_once(pool: Pool) -> None:
    """Requests that wait in the GPU's queue for a ticket of their own show there already: the
    report counts each once (counted twice, a busy host looked twice as busy as it was and kept
    half its share of a skewed load)."""
    a = pool.a
    blocker = hold_gpu(a, "blocker-count")
    out: list[Any] = []
    threads = [
        threading.Thread(
            target=lambda i=i: out.append(a.chat(f"agent-queued-{i}", **{"X-Gpulock-From": "t"}))
        )
        for i in range(2)
    ]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: _waits(a) >= 2, WAIT_S, "two requests waiting on a's GPU")

        def published() -> tuple[int, int] | None:
            r = next(x for x in fleet(a)["hosts"] if x["name"] == "a")
            g = r["gpus"][0]
            return (g["holding"], g["waiting"]) if r["in_flight"] == 2 else None

        assert wait_until(published, WAIT_S, "a's report with its two requests") == (1, 2)
    finally:
        kill_group(blocker)
        for t in threads:
            t.join(WAIT_S)
    assert [r.status for r in out] == [200, 200] and all(
        r.headers["x-gpulock-host"] == "a" for r in out
    )


def _waits(h: Host) -> int:
    st = json.loads(h.gpulock("status", "--json").stdout)
    return sum(1 for g in st["gpus"] for e in g["waiters"] if e["state"] == "waiting")


def test_the_line_counts_every_request_in_it_and_keeps_its_pace(tmp_path: Path) -> None:
    """What serve's cluster estimate stands on: every request of this server in a GPU's line
    counts, one running under its ticket and one waiting under that shared ticket alike (the
    GPU's queue shows one ticket, and tickets that share memory read as no wait), and the
    time one more request adds is known once requests have ended."""
    from gpulock.core.config import parse_config
    from gpulock.core.settings import load as load_settings
    from gpulock.serve.line import Line

    settings = load_settings(parse_config("simulate: 24GiB\n", "test.yaml"), tmp_path)
    line = Line(settings, max_queue=8)
    seen: list[int] = []

    async def one(inside: asyncio.Event, go: asyncio.Event) -> None:
        async with line.slot("m|0", gpu=0, need=1 << 30, parallel=1, name="t", timeout_s=30):
            inside.set()
            await go.wait()

    async def main() -> None:
        first_in, second_in, go = asyncio.Event(), asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(one(first_in, go))
        await first_in.wait()
        second = asyncio.create_task(one(second_in, go))

        async def second_waits() -> None:  # under the first's ticket
            while line.waiting < 1:
                await asyncio.sleep(0.005)

        await asyncio.wait_for(second_waits(), 30)
        seen.append(line.busy(0))
        assert line.request_s(0) is None  # none ended yet
        go.set()
        await asyncio.wait_for(asyncio.gather(first, second), 30)
        seen.append(line.busy(0))

    asyncio.run(main())
    assert seen == [2, 0]
    assert line.request_s(0) is not None


# A ``kind: command`` tenant's server: the vLLM stand-in on the port its config names.
COMMAND_SERVER = """\
import sys
sys.path.insert(0, sys.argv[1])
import standins.base as base

class OnPort(base.ThreadingHTTPServer):
    def __init__(self, _addr, handler):
        super().__init__(("127.0.0.1", int(sys.argv[2])), handler)

base.ThreadingHTTPServer = OnPort
from standins.vllm import Vllm

Vllm("m").start().thread.join()
"""


def command_host(root: Path, name: str, redis: RedisServer) -> Host:
    server_port = free_port()
    argv = [sys.executable, "-c", COMMAND_SERVER, str(Path(__file__).parent), str(server_port)]
    return tenant_host(
        root,
        name,
        redis,
        f"""\
        tenants:
          - name: cmd
            kind: command
            command: {json.dumps(argv)}
            url: http://127.0.0.1:{server_port}
            health: /v1/models
            need: 1GiB
            models: [m]
            ready_timeout: 60s
        routes:
          complete:
            - {{tenant: cmd, model: m, max_tokens: 4, name: cmd-gpu}}
        """,
    )


def tenant_state(h: Host) -> list[str]:
    r = h.gpulock("tenants", "--json")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    rows = obj["tenants"] if isinstance(obj, dict) else obj
    return [m["state"] for t in rows for m in t.get("models", [])]


def test_a_command_tenant_moves_to_the_peer_which_starts_its_own_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``kind: command``: the peer's serve calls its own server, starting it on the first call
    (the load); this host's server is never started."""
    need_redis()
    root = tmp_path_factory.mktemp("cluster-command")
    redis = RedisServer(root / "redis").start()
    a, b = command_host(root, "ca", redis), command_host(root, "cb", redis)
    blocker = None
    try:
        b.start()
        a.start()
        wait_until(lambda: _names(a) == ["ca", "cb"], WAIT_S, "both hosts in Redis")
        assert tenant_state(b) == [] and tenant_state(a) == []  # neither server runs
        blocker = hold_gpu(a, "blocker")
        wait_until(lambda: (row(a, "ca") or {"gpus": [{"holding": 0}]})["gpus"][0]["holding"],
                   WAIT_S, "ca's report to show its GPU held")  # fmt: skip
        assert route_of(a, "complete") == "cb"
        body = {"model": "complete", "prompt": "once", "max_tokens": 4}
        r = a.request("POST", "/v1/completions", body, {"X-Gpulock-Agent": "agent-cmd"})
        assert r.status == 200, r.body
        assert r.headers["x-gpulock-host"] == "cb"
        assert r.json()["choices"][0]["text"] == "hi"
        done = time.time()
        assert tenant_state(b) == ["loaded"]  # b started its own server for the call
        assert tenant_state(a) == []  # a's was never started
        calls = wait_until(
            lambda: [e for e in b.events("call") if e.get("agent") == "agent-cmd"],
            WAIT_S,
            "b's call event",
        )
        assert calls[0]["host"] == "cb" and calls[0]["model"] == "cmd-gpu", calls
        # b's server holds its own ticket now; b's report says the candidate's calls wait for
        # none of it (they take no ticket), and that it is warm: b takes the next call too.
        store = Store(ClusterConfig(redis_url=redis.url, host="test"))

        def cb_serving() -> dict[str, Any] | None:
            rep = next((x for x in store.hosts() if x["host"] == "cb"), None)
            ok = rep is not None and rep["gpus"][0]["holding"] and "cmd-gpu" in rep["warm"]
            return rep if ok else None

        rep = wait_until(cb_serving, WAIT_S, "cb's report: its server holding, cmd-gpu warm")
        assert [c["waits"] for c in rep["candidates"]] == [[0.0]], rep["candidates"]

        def a_sees_it_done() -> bool:  # a report of cb made after the call reached its line
            r = row(a, "cb")
            made = None if r is None else time.time() - r["heartbeat_age_s"]
            return made is not None and "cmd-gpu" in r["warm"] and made > done + TRANSIT_S

        wait_until(a_sees_it_done, WAIT_S, "a's view of cb: a report made after the call")
        r = a.request("POST", "/v1/completions", body, {"X-Gpulock-Agent": "agent-cmd-2"})
        assert r.status == 200 and r.headers["x-gpulock-host"] == "cb", r.body
        wait_until(
            lambda: [e for e in b.events("call") if e.get("agent") == "agent-cmd-2"],
            WAIT_S,
            "b's call event of the second call",
        )
        store.close()
    finally:
        kill_group(blocker)
        for h in (a, b):
            h.stop()
            stop_command_server(h)
        redis.stop()


def stop_command_server(h: Host) -> None:
    from gpulock.core import settings as settings_mod
    from gpulock.tenants import survey

    settings = settings_mod.load(str(h.folder / "gpulock.yaml"), h.folder / "state")
    with contextlib.suppress(Exception):  # (not started: nothing to stop)
        survey.adapter_for(settings.config.tenants[0], settings).unload("m")


def route_of(h: Host, task: str) -> str:
    r = h.gpulock("route", task, "--json")
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["host"])


def test_serve_never_evicts_the_tenant_model_a_request_calls(tmp_path: Path) -> None:
    """A request's ticket is marked as a call to its tenant model: making room for it (the
    model takes 20 GiB of 24, the ticket needs as much) never evicts that very model, which
    the tenant would then load again for the call, at every request."""
    from serve_server import GatewayProc

    s = Ollama({"big:32b": 20 * GiB}).start()
    assert isinstance(s, Ollama)
    config = tmp_path / "gpulock.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            simulate: 24GiB
            tenants:
              - {{name: ollama, kind: ollama, url: '{s.url}'}}
            routes:
              chat:
                - {{tenant: ollama, model: 'big:32b', vram: 20GiB, max_tokens: 4, name: big}}
            """
        )
    )
    env = {"GPULOCK_CONFIG": str(config), "GPULOCK_STATE_DIR": str(tmp_path / "state")}
    g = GatewayProc(tmp_path / "serve.log", env=env).start()
    try:
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        for agent in ("first", "second", "third"):
            r = g.request("POST", "/v1/chat/completions", body, {"X-Gpulock-Agent": agent})
            assert r.status == 200, r.body
        lines = (tmp_path / "state" / "events.jsonl").read_text().splitlines()
        kinds = [json.loads(line)["event"] for line in lines if line.strip()]
        assert kinds.count("call") == 3 and "evict" not in kinds, kinds
        unloads = [h for h in s.hits if isinstance(h[2], dict) and h[2].get("keep_alive") == 0]
        assert unloads == [] and "big:32b" in s.loaded
    finally:
        g.stop()
        s.stop()
