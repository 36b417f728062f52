"""Two hosts as one pool, for real: ``gpulock serve`` processes with their own state folders,
simulated GPUs and ports, one real ``redis-server``, the tiny llama.cpp model.

Host ``a`` beats every 0.5 s; host ``b`` every 5 s, so that a frozen or killed ``b`` stays in
``a``'s view long enough for ``a`` to try it (what the peer-failure cases are about).  The
cases run in order on one pair of hosts (each start loads a model: the machine is small).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from procs import wait_until
from redis_server import RedisServer, need_redis
from router_servers import free_port, kill_group
from serve_server import GatewayProc, Reply, clean_env

from gpulock.router.tiny_model import ensure_tiny_llama

WAIT_S = 30.0


@dataclass
class Host(GatewayProc):
    """A gateway whose port is chosen before its config is written (the config names it)."""

    name: str = ""
    folder: Path = Path()
    key: str = ""  # this gateway's API key (serve.api_keys_env), sent on every request
    isolated: bool = True

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        **kw: Any,
    ) -> Reply:
        auth = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        return super().request(method, path, body, {**auth, **(headers or {})}, **kw)

    def stop(self) -> None:
        """Stopped even when a test left it frozen (SIGSTOP)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        super().stop()

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The host's event log (``kind``: only those events)."""
        path = self.folder / "state" / "events.jsonl"
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return []
        out = [json.loads(line) for line in lines if line.strip()]
        return [e for e in out if kind is None or e.get("event") == kind]

    def gpulock(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpulock", *args],
            capture_output=True,
            text=True,
            env={**clean_env(), **self.env},
            timeout=60,
        )

    def chat(self, agent: str, **headers: str) -> Reply:
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        return self.request(
            "POST", "/v1/chat/completions", body, {"X-Gpulock-Agent": agent, **headers}
        )


def make_host(
    root: Path, name: str, redis: RedisServer, tiny: Path, heartbeat: str, *, key: str = ""
) -> Host:
    folder = root / name
    folder.mkdir()
    port = free_port()
    config = folder / "gpulock.yaml"
    keys = "serve: {api_keys_env: SERVE_KEYS}\n" if key else ""
    peer_key = "  api_key_env: PEER_KEY\n" if key else ""
    config.write_text(
        keys
        + textwrap.dedent(
            f"""\
            simulate: 24GiB
            cluster:
              redis: {redis.url}
              host: {name}
              gateway: http://127.0.0.1:{port}
              heartbeat: {heartbeat}
              remote_penalty: 500ms
              peer_timeout: 10s
            """
        )
        + peer_key
        + textwrap.dedent(
            f"""\
            routes:
              chat:
                - {{tier: gpu, backend: llama_cpp, model: {tiny}, n_ctx: 256, max_tokens: 4,
                   name: tiny-gpu}}
            """
        )
    )
    env = {"GPULOCK_CONFIG": str(config), "GPULOCK_STATE_DIR": str(folder / "state")}
    if key:  # every gateway takes the cluster's key; each host presents it to its peers
        env.update(SERVE_KEYS=key, PEER_KEY=key)
    return Host(log=folder / "serve.log", env=env, port=port, name=name, folder=folder, key=key)


@dataclass
class Pool:
    redis: RedisServer
    a: Host
    b: Host


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    need_redis()
    root = tmp_path_factory.mktemp("cluster")
    tiny = ensure_tiny_llama(root)
    redis = RedisServer(root / "redis").start()
    a = make_host(root, "a", redis, tiny, "500ms")
    b = make_host(root, "b", redis, tiny, "5s")
    try:
        b.start()
        a.start()
        yield Pool(redis, a, b)
    finally:
        for h in (a, b):
            h.stop()
        redis.stop()


def fleet(h: Host) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "gpulock.cluster", "--json"],
        capture_output=True,
        text=True,
        env={**clean_env(), **h.env},
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    obj: dict[str, Any] = json.loads(r.stdout)
    return obj


def hosts_seen(h: Host) -> list[str]:
    return [x["name"] for x in fleet(h)["hosts"]]


def test_each_host_publishes_and_sees_the_fleet(pool: Pool) -> None:
    wait_until(lambda: hosts_seen(pool.a) == ["a", "b"], WAIT_S, "both hosts in Redis")
    obj = fleet(pool.b)
    assert obj["host"] == "b" and obj["redis"] == "ok"
    row = next(x for x in obj["hosts"] if x["name"] == "a")
    assert row["gateway"] == pool.a.url and row["level"] == "normal"
    assert row["candidates"] == ["tiny-gpu"]
    assert row["gpus"][0]["total_bytes"] == 24 << 30 and row["gpus"][0]["holding"] == 0
    served = pool.a.request("GET", "/gpulock/cluster").json()
    assert [x["name"] for x in served["hosts"]] == ["a", "b"]
    assert served["spend"]["total_usd"] == 0 and served["spend"]["daily_budget_usd"] is None
    health = pool.a.request("GET", "/health").json()
    assert health["cluster"] == {"host": "a", "hosts": 2, "redis": "ok", "problem": None}
    st = pool.a.gpulock("status")
    assert st.returncode == 0 and "cluster: 2 hosts, redis ok" in st.stdout.splitlines(), st.stdout
    text = subprocess.run(
        [sys.executable, "-m", "gpulock.cluster"],
        capture_output=True,
        text=True,
        env={**clean_env(), **pool.a.env},
        timeout=60,
    ).stdout
    assert text.splitlines()[0] == "cluster: 2 hosts, redis ok"
    assert "a (this host)" in text and "gpu0: 24.0 GiB" in text, text


def test_a_busy_local_gpu_sends_work_to_an_idle_peer(pool: Pool) -> None:
    a, b = pool.a, pool.b
    blocker = hold_gpu(a, "blocker")
    try:
        busy = lambda: next(  # noqa: E731
            x for x in fleet(b)["hosts"] if x["name"] == "a"
        )["gpus"][0]["holding"]
        wait_until(busy, WAIT_S, "a's report to show its GPU held")
        # Held exclusively: free 0 B in the fleet, as gpulock status says on a itself.
        row = next(x for x in fleet(b)["hosts"] if x["name"] == "a")["gpus"][0]
        shown = json.loads(a.gpulock("status", "--json").stdout)["gpus"][0]["free_bytes"]
        assert row["free_bytes"] == shown == 0, (row, shown)
        assert row["claimed_bytes"] == row["total_bytes"]
        r = a.chat("agent-busy")
        assert r.status == 200, r.body
        assert r.headers["x-gpulock-host"] == "b"
        # It waited in b's line under the agent's name, and b's status shows it ran there.
        grants = [e for e in b.events("acquire") if e.get("name") == "agent-busy"]
        assert grants, b.events("acquire")
        # Call events are written behind the answer (serve batches them): wait for them.
        calls = wait_until(
            lambda: [e for e in b.events("call") if e.get("agent") == "agent-busy"],
            WAIT_S,
            "b's call event",
        )
        assert calls[0]["host"] == "b"
        on_a = wait_until(
            lambda: [e["host"] for e in a.events("call") if e.get("agent") == "agent-busy"],
            WAIT_S,
            "a's call event",
        )
        assert on_a == ["b"]
        st = json.loads(b.gpulock("status", "--json").stdout)
        assert any("tiny" in json.dumps(rec) for rec in st["residents"]), st["residents"]
        # Both ledgers count it under the host that ran it (serve's gathered ledger writes).
        wait_until(
            lambda: "b" in by_host(a) and "b" in by_host(b), WAIT_S, "the call under b in usage"
        )
        assert "a" not in by_host(b)
    finally:
        kill_group(blocker)


def by_host(h: Host) -> dict[str, Any]:
    usage = json.loads(h.gpulock("status", "--json").stdout)["usage"] or {}
    rows: dict[str, Any] = usage.get("by_host") or {}
    return rows


def test_a_warm_peer_wins_over_a_cold_local_load_and_ties_stay_local(pool: Pool) -> None:
    a = pool.a

    wait_until(lambda: b_idle_and_warm(a), WAIT_S, "b's report: tiny-gpu warm, its line empty")
    wait_until(lambda: _idle(a), WAIT_S, "a's GPU free")
    r = a.chat("agent-warm")
    assert r.status == 200, r.body
    assert r.headers["x-gpulock-host"] == "b"  # b: 0 s + 0.5 s penalty < a: ~1 s load
    # A request a peer forwarded runs where it lands: this warms a's own model.
    r = a.chat("agent-local", **{"X-Gpulock-From": "test"})
    assert r.status == 200 and r.headers["x-gpulock-host"] == "a", r.body
    r = a.chat("agent-tie")
    assert r.status == 200 and r.headers["x-gpulock-host"] == "a"  # warm here: 0 s < 0.5 s


def b_idle_and_warm(a: Host) -> bool:
    """As a's heartbeat last read it: b's line empty and tiny-gpu warm there."""
    seen = a.request("GET", "/gpulock/cluster").json()
    row = next((x for x in seen["hosts"] if x["name"] == "b"), None)
    return (
        row is not None
        and "tiny-gpu" in row["warm"]
        and not row["in_flight"]
        and not any(g["holding"] or g["waiting"] for g in row["gpus"])
    )


def a_sees_b_cooling(a: Host) -> bool:
    seen = a.request("GET", "/gpulock/cluster").json()
    return any(x["name"] == "b" and x["cooling"] for x in seen["hosts"])


def uncool_b(pool: Pool) -> None:
    from gpulock.cluster import cooldowns
    from gpulock.cluster.config import ClusterConfig
    from gpulock.cluster.store import Store

    store = Store(ClusterConfig(redis_url=pool.redis.url, host="test"))
    store.call(lambda r: r.hdel(cooldowns.key("gpulock:"), cooldowns.peer("b")))


def _idle(h: Host) -> bool:
    st = json.loads(h.gpulock("status", "--json").stdout)
    live = ("holding", "waiting", "hung")
    return not [e for g in st["gpus"] for e in g["holders"] + g["waiters"] if e["state"] in live]


AGENT = """\
import json, sys
from gpulock import router
m = router.get_model("chat", agent=sys.argv[1])
text = m.chat([{"role": "user", "content": "hi"}], max_tokens=4)
print(json.dumps({"host": m.host, "tier": m.tier, "text": text}))
"""


def test_agents_on_a_busy_host_get_models_on_the_idle_peer(pool: Pool) -> None:
    """Real agent processes on a call ``router.get_model``: a's GPU is held, so the model they
    get runs on b (``Model.host``), through b's line under each agent's name."""
    a, b = pool.a, pool.b
    blocker = hold_gpu(a, "blocker-agents")
    try:
        wait_until(lambda: _seen_holding(a, "a"), WAIT_S, "a's report to show its GPU held")
        route = a.gpulock("route", "chat", "--json")
        assert route.returncode == 0, route.stderr
        assert json.loads(route.stdout)["host"] == "b"
        # With a deadline a's own line is too long (it is rejected here), and b takes it.
        route = a.gpulock("route", "chat", "--deadline", "10s", "--json")
        assert route.returncode == 0 and json.loads(route.stdout)["host"] == "b", route.stdout
        r = a.chat("agent-deadline", **{"X-Gpulock-Deadline": "10s"})  # the same over HTTP
        assert r.status == 200 and r.headers["x-gpulock-host"] == "b", r.body
        explained = a.gpulock("route", "chat", "--explain").stdout
        assert "on b: starts in" in explained and "here: ~" in explained, explained
        agents = [
            subprocess.Popen(
                [sys.executable, "-c", AGENT, f"agent-{i}"],
                env={**clean_env(), **a.env},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(3)
        ]
        streamed = a.request(
            "POST",
            "/v1/chat/completions",
            {"model": "chat", "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 4, "stream": True},
            {"X-Gpulock-Agent": "agent-stream"},
        )  # fmt: skip
        assert streamed.status == 200 and streamed.headers["x-gpulock-host"] == "b"
        assert streamed.body.rstrip().endswith(b"data: [DONE]"), streamed.body  # relayed whole
        for i, agent in enumerate(agents):
            out, err = agent.communicate(timeout=120)
            assert agent.returncode == 0, err
            got = json.loads(out)
            assert got["host"] == "b" and got["tier"] == "gpu", got
            name = f"agent-{i}"
            calls = wait_until(
                lambda: [e for e in a.events("call") if e.get("agent") == name],  # noqa: B023
                WAIT_S,
                f"a's call event of {name}",
            )
            assert calls[0]["host"] == "b" and calls[0]["ok"], calls
            # It ran in b's line, on a GPU ticket, counted under the agent's name there.
            # (Not "an acquire under its name": requests that reach b together share one
            # ticket, named after the first of them.)
            ran = wait_until(
                lambda: [e for e in b.events("call") if e.get("agent") == name],  # noqa: B023
                WAIT_S,
                f"b's call event of {name}",
            )
            assert ran[0]["via"] == "serve" and ran[0]["ticket"] is not None, ran
    finally:
        kill_group(blocker)


def _seen_holding(h: Host, name: str) -> bool:
    row = next((x for x in fleet(h)["hosts"] if x["name"] == name), None)
    if row is None:
        return False
    return bool(row["gpus"][0]["holding"])


def hold_gpu(h: Host, name: str) -> subprocess.Popen[bytes]:
    """``gpulock run --name NAME -- sleep 600`` on ``h``'s GPU, once it holds."""
    before = len([e for e in h.events("acquire") if e.get("name") == name])
    p = subprocess.Popen(
        [sys.executable, "-m", "gpulock", "run", "--name", name, "--", "sleep", "600"],
        env={**clean_env(), **h.env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_until(
        lambda: len([e for e in h.events("acquire") if e.get("name") == name]) > before,
        WAIT_S,
        f"{name} to hold {h.name}'s GPU",
    )
    return p


def chat_while_busy(h: Host, agent: str, blocker: subprocess.Popen[bytes]) -> Reply:
    """A request to ``h`` while its GPU is held: once ``h`` has given up on the peer (a
    ``fallback`` event), the holder leaves and the request runs here."""
    out: list[Reply] = []
    t = threading.Thread(target=lambda: out.append(h.chat(agent)), daemon=True)
    t.start()
    wait_until(
        lambda: [e for e in h.events("fallback") if e.get("agent") == agent],
        WAIT_S,
        lambda: f"{h.name} to give up on the peer\n{h.output()}\n{_about(h, agent)}",
    )
    kill_group(blocker)
    t.join(WAIT_S)
    assert out, "the request did not end"
    return out[0]


def _about(h: Host, agent: str) -> str:
    """What ``h``'s event log says of ``agent``'s request, and of the line (for a failure)."""
    seen = [
        e
        for e in h.events()
        if agent in (e.get("agent"), e.get("name")) or e.get("event") in ("wait", "acquire")
    ]
    return "\n".join(json.dumps(e) for e in seen[-30:])


def test_a_frozen_then_a_killed_peer_lose_no_call(pool: Pool) -> None:
    """b is idle and warm, a's GPU is held: a sends to b, b does not answer, a runs it."""
    a, b = pool.a, pool.b
    assert b.proc is not None
    assert b.chat("agent-warm-b").status == 200  # warm, whatever ran before (b's GPU is free)
    wait_until(lambda: b_idle_and_warm(a), WAIT_S, "b idle and warm, as a sees it")
    # "blocker" held a's GPU for seconds before: the line's estimate here is seconds, not
    # the milliseconds of the requests' holds, and b (idle, warm) is clearly sooner.
    blocker = hold_gpu(a, "blocker")
    try:
        os.killpg(b.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            r = chat_while_busy(a, "agent-frozen", blocker)
        finally:
            os.killpg(b.proc.pid, signal.SIGCONT)
        assert r.status == 200, r.body
        assert r.headers["x-gpulock-host"] == "a"
        falls = [e for e in a.events("fallback") if e.get("agent") == "agent-frozen"]
        assert falls[0]["host"] == "b" and falls[0]["from_tier"] == "peer"
        # b cools down for every host: nobody sends it work until the cooldown ends.
        assert fleet(b)["hosts"][1]["cooling"] is True
        wait_until(lambda: a_sees_b_cooling(a), WAIT_S, "a to see b cooling down")
        uncool_b(pool)  # (to see the next failure: the kill)
        wait_until(lambda: not a_sees_b_cooling(a), WAIT_S, "b's cooldown gone in a's view")
        blocker = hold_gpu(a, "blocker")
        kill_group(b.proc)  # SIGKILL; its report lives on in Redis until it expires
        r = chat_while_busy(a, "agent-killed", blocker)
        assert r.status == 200 and r.headers["x-gpulock-host"] == "a", r.body
    finally:
        kill_group(blocker)


def test_redis_lost_and_back_the_host_serves_alone_meanwhile(pool: Pool) -> None:
    """Last in the module (b is gone by now): Redis stopped mid-run, then back empty."""
    a = pool.a

    def redis_state() -> str:
        return str(a.request("GET", "/health").json()["cluster"]["redis"])

    pool.redis.stop()
    wait_until(lambda: redis_state() == "down", WAIT_S, "a's /health to say redis down")
    r = a.chat("agent-alone")
    assert r.status == 200 and r.headers["x-gpulock-host"] == "a", r.body
    degraded = a.events("cluster-degraded")
    assert degraded and degraded[-1]["host"] == "a" and degraded[-1]["problem"]
    st = a.gpulock("status").stdout
    assert any(
        line.startswith("cluster: ") and "redis down" in line and "local only" in line
        for line in st.splitlines()
    ), st
    pool.redis.start(same_port=True)  # back, empty: a publishes itself again
    wait_until(lambda: redis_state() == "ok", WAIT_S, "a's /health to say redis ok")
    assert a.events("cluster-restored")
    wait_until(lambda: "a" in hosts_seen(a), WAIT_S, "a back in Redis")


PEER_KEY = "peer-key-4f1c9e"  # made up: the test gateways take it


def test_gateways_with_keys_take_the_peers_key_and_never_show_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    need_redis()
    root = tmp_path_factory.mktemp("keyed")
    tiny = ensure_tiny_llama(root)
    redis = RedisServer(root / "redis").start()
    a = make_host(root, "ka", redis, tiny, "500ms", key=PEER_KEY)
    b = make_host(root, "kb", redis, tiny, "500ms", key=PEER_KEY)
    try:
        b.start()
        a.start()
        nokey = GatewayProc.request(a, "GET", "/gpulock/cluster")  # without the key: refused
        assert nokey.status == 401
        wait_until(lambda: len(a.request("GET", "/gpulock/cluster").json()["hosts"]) == 2,
                   WAIT_S, "both keyed hosts")  # fmt: skip
        blocker = hold_gpu(a, "blocker")
        try:
            wait_until(lambda: _seen_holding(a, "ka"), WAIT_S, "ka's GPU held, in Redis")
            r = a.chat("agent-keyed")
            assert r.status == 200 and r.headers["x-gpulock-host"] == "kb", r.body
            assert [e for e in b.events("acquire") if e.get("name") == "agent-keyed"]
        finally:
            kill_group(blocker)
        for h in (a, b):  # the key is in no log and no event
            assert PEER_KEY not in h.output()
            assert PEER_KEY not in (h.folder / "state" / "events.jsonl").read_text()
    finally:
        a.stop()
        b.stop()
        redis.stop()
