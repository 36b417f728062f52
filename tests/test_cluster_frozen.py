"""A frozen peer through every door: serve, ``get_model`` in an agent process, ``gpulock route``.

Two real ``gpulock serve`` hosts on one real ``redis-server``; host ``b`` is frozen by SIGSTOP
while its last report is still fresh in Redis (it beats every 20 s, so it stays in ``a``'s view
for a minute), and ``a``'s GPU is held, so every door of ``a`` sends its GPU work to ``b``.
Each door must give ``b`` up after ``cluster.peer_timeout`` past the expected start (2 s
here), never wait out the candidate's ``timeout`` (120 s), move on along the route (the CPU
candidate), and mark ``b`` failing for every other caller of ``a`` until ``b`` beats again:
the router's own cooldown (1 s here) ends long before that.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import wait_until
from redis_server import RedisServer, need_redis
from router_servers import free_port, kill_group
from serve_server import clean_env
from test_cluster_serve import Host, fleet, hold_gpu

from gpulock.router.tiny_model import ensure_tiny_llama

WAIT_S = 60.0
TIMEOUT_S = 120  # the gpu candidate's own timeout: what the old code waited on a frozen peer
AGENT = """\
import json, sys, time
from gpulock import router
start = time.monotonic()
m = router.get_model("chat", agent=sys.argv[1], deadline=20)
chosen = m.host
text = m.chat([{"role": "user", "content": "hi"}], max_tokens=4)
print(json.dumps({"chosen": chosen, "host": m.host, "tier": m.tier,
                  "took_s": time.monotonic() - start}))
"""


def make_host(root: Path, name: str, redis: RedisServer, tiny: Path, heartbeat: str) -> Host:
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
              heartbeat: {heartbeat}
              remote_penalty: 500ms
              peer_timeout: 2s
            router:
              cooldown: 1s
            routes:
              chat:
                - {{tier: gpu, backend: llama_cpp, model: {tiny}, n_ctx: 256, max_tokens: 4,
                   name: tiny-gpu, timeout: {TIMEOUT_S}s}}
                - {{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 256, max_tokens: 4,
                   name: tiny-cpu}}
            """
        )
    )
    env = {"GPULOCK_CONFIG": str(config), "GPULOCK_STATE_DIR": str(folder / "state")}
    return Host(log=folder / "serve.log", env=env, port=port, name=name, folder=folder)


class Pool:
    def __init__(self, redis: RedisServer, a: Host, b: Host) -> None:
        self.redis, self.a, self.b = redis, a, b


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    need_redis()
    root = tmp_path_factory.mktemp("frozen")
    tiny = ensure_tiny_llama(root)
    redis = RedisServer(root / "redis").start()
    a = make_host(root, "a", redis, tiny, "500ms")
    b = make_host(root, "b", redis, tiny, "20s")
    try:
        b.start()
        a.start()
        yield Pool(redis, a, b)
    finally:
        for h in (a, b):
            h.stop()
        redis.stop()


def run_agent(a: Host, name: str) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, "-c", AGENT, name],
        env={**clean_env(), **a.env},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S + 60,  # past it the old code is caught hanging, not this test
    )
    assert p.returncode == 0, p.stderr
    out: dict[str, Any] = json.loads(p.stdout)
    return out


def route_host(a: Host) -> str:
    r = a.gpulock("route", "chat", "--deadline", "20s", "--json")
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["host"])


def b_beat_at(a: Host) -> float:
    seen = a.request("GET", "/gpulock/cluster").json()
    row = next(x for x in seen["hosts"] if x["name"] == "b")
    return float(seen["generated_wall"]) - float(row["heartbeat_age_s"])


def forget_failures(pool: Pool) -> None:
    """Start the next door afresh: no mark on a, no cooldown in Redis."""
    (pool.a.folder / "state" / "cluster-failing.json").unlink(missing_ok=True)
    uncool(pool.redis)


def uncool(redis: RedisServer) -> None:
    from gpulock.cluster import cooldowns
    from gpulock.cluster.config import ClusterConfig
    from gpulock.cluster.store import Store

    store = Store(ClusterConfig(redis_url=redis.url, host="test"))
    store.call(lambda r: r.hdel(cooldowns.key("gpulock:"), cooldowns.peer("b")))
    store.close()


def b_cooling(a: Host) -> bool:
    seen = a.request("GET", "/gpulock/cluster").json()
    return any(x["name"] == "b" and x["cooling"] for x in seen["hosts"])


def peer_calls(a: Host, agent: str) -> list[dict[str, Any]]:
    return [e for e in a.events("call") if e.get("agent") == agent and e.get("host") == "b"]


def test_every_door_gives_a_frozen_peer_up_and_moves_on(pool: Pool) -> None:
    a, b = pool.a, pool.b
    assert b.proc is not None
    wait_until(lambda: [x["name"] for x in fleet(a)["hosts"]] == ["a", "b"], WAIT_S, "a and b")
    blocker = hold_gpu(a, "blocker")
    try:
        wait_until(
            lambda: next(x for x in fleet(a)["hosts"] if x["name"] == "a")["gpus"][0]["holding"],
            WAIT_S,
            "a's report to show its GPU held",
        )
        assert route_host(a) == "b"  # a's GPU is held: its GPU work goes to b
        beat = b_beat_at(a)
        os.killpg(b.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            # serve: the request waits no longer than peer_timeout past b's expected start,
            # then runs here, on the CPU candidate (a's GPU line is past the deadline).
            r = a.chat("via-serve", **{"X-Gpulock-Deadline": "20s"})
            assert r.status == 200, r.body
            assert r.headers["x-gpulock-host"] == "a" and r.headers["x-gpulock-tier"] == "cpu"
            falls = [e for e in a.events("fallback") if e.get("agent") == "via-serve"]
            assert falls and falls[0]["host"] == "b", falls
            assert route_host(a) == "a"  # b is failing for every caller of a now

            # get_model in an agent process, afresh: it gives b up by itself (not after the
            # candidate's 120 s timeout) and falls back to the CPU candidate.
            forget_failures(pool)
            wait_until(lambda: route_host(a) == "b", WAIT_S, "b offered again")
            got = run_agent(a, "agent-1")
            assert got["chosen"] == "b" and got["host"] == "a" and got["tier"] == "cpu", got
            failed = peer_calls(a, "agent-1")
            assert failed and not failed[0]["ok"] and failed[0]["error"] == "timeout", failed
            assert failed[0]["latency_s"] < TIMEOUT_S / 2, failed

            # The router's cooldown (1 s) is long over; b is still frozen, its report unmoved:
            # the next agent and `gpulock route` skip it, without waiting on it again.
            wait_until(lambda: not b_cooling(a), WAIT_S, "the 1 s cooldown of b to end")
            got = run_agent(a, "agent-2")
            assert got["chosen"] == "a" and got["tier"] == "cpu", got
            assert not peer_calls(a, "agent-2")
            assert route_host(a) == "a"
            assert b_beat_at(a) == pytest.approx(beat, abs=0.01)  # still b's report of before
        finally:
            os.killpg(b.proc.pid, signal.SIGCONT)
        # b beats again: the mark ends with it, and b takes a's GPU work once more.
        wait_until(lambda: b_beat_at(a) > beat + 1, WAIT_S, "b's next heartbeat")
        uncool(pool.redis)  # (failures in a row doubled the cooldown in Redis)
        wait_until(lambda: route_host(a) == "b", WAIT_S, "b chosen again once it beat")
    finally:
        kill_group(blocker)
