"""Budgets and rate limits across hosts for ``gpulock serve``'s HTTP agents, for real: three
``gpulock serve`` processes (own state folders and ledgers, one real ``redis-server``) whose
clients hit one budget and one rate limit at once.

``router.get_model``'s agents are held to them in test_cluster_budget.py; an agent that comes
in over HTTP must be held to the same ones.  The cloud is one OpenAI-shaped server
(``FaultServer``): a call to ``paid`` costs exactly $1.50 (3 completion tokens at $500 per
1000, and ``max_tokens: 3`` bounds it to that), so a $15.00 ``router.daily_budget`` holds ten
calls, whichever host makes them.  ``capped`` is free and allows 2 requests a minute.
"""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from procs import wait_until
from redis_server import RedisServer, need_redis
from router_servers import FaultServer, free_port
from serve_server import Reply
from test_cluster_serve import Host, hosts_seen

from gpulock.cluster import spend
from gpulock.cluster.config import ClusterConfig
from gpulock.cluster.store import Store
from gpulock.core.settings import load
from gpulock.router import ledger

HOSTS = ("a", "b", "c")
BUDGET = 15.0
CALL_USD = 1.5
WAIT_S = 30.0


@dataclass
class Trio:
    redis: RedisServer
    cloud: FaultServer
    hosts: dict[str, Host]


def budget_host(root: Path, name: str, redis: RedisServer, cloud_url: str) -> Host:
    folder = root / name
    folder.mkdir()
    port = free_port()
    config = folder / "gpulock.yaml"
    paid = (
        f"{{backend: openai, name: paid, model: paid-m, base_url: '{cloud_url}', "
        "api_key_env: CLOUD_KEY, max_tokens: 3, price: {input: 0, output: 500}}"
    )
    capped = (
        f"{{backend: openai, name: capped, model: capped-m, base_url: '{cloud_url}', "
        "api_key_env: CLOUD_KEY, max_tokens: 3, price: 0, rate_limit: 2}"
    )
    config.write_text(
        textwrap.dedent(
            f"""\
            cluster:
              redis: {redis.url}
              host: {name}
              gateway: http://127.0.0.1:{port}
              heartbeat: 500ms
            router: {{daily_budget: {BUDGET}}}
            routes:
              t:
                - {paid}
              r:
                - {capped}
            """
        )
    )
    env = {
        "GPULOCK_CONFIG": str(config),
        "GPULOCK_STATE_DIR": str(folder / "state"),
        "CLOUD_KEY": "k",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    return Host(log=folder / "serve.log", env=env, port=port, name=name, folder=folder)


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    need_redis()
    root = tmp_path_factory.mktemp("cluster-budget")
    redis = RedisServer(root / "redis").start()
    cloud = FaultServer(mode="ok").start()
    hosts = {h: budget_host(root, h, redis, cloud.base_url) for h in HOSTS}
    try:
        for h in hosts.values():
            h.start()
        for h in hosts.values():  # every host has seen all three: none keeps to a share
            wait_until(lambda h=h: hosts_seen(h) == list(HOSTS), WAIT_S, f"the fleet from {h.name}")
        yield Trio(redis, cloud, hosts)
    finally:
        for h in hosts.values():
            h.stop()
        cloud.stop()
        redis.stop()


def at_once(trio: Trio, model: str, per_host: int) -> dict[str, list[Reply]]:
    """``per_host`` chat requests to every host, all in flight together; replies by host."""
    out: dict[str, list[Reply]] = {h: [] for h in trio.hosts}
    lock = threading.Lock()
    go = threading.Barrier(per_host * len(trio.hosts))

    def one(h: Host) -> None:
        go.wait()
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        r = h.request("POST", "/v1/chat/completions", body, {"X-Gpulock-Agent": f"{h.name}-x"})
        with lock:
            out[h.name].append(r)

    threads = [
        threading.Thread(target=one, args=(h,))
        for h in trio.hosts.values()
        for _ in range(per_host)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_three_gateways_clients_never_spend_past_one_budget(trio: Trio) -> None:
    replies = at_once(trio, "t", 5)  # 15 requests of $1.50 against $15.00
    ok = {h: sum(1 for r in rs if r.status == 200) for h, rs in replies.items()}
    refused = [r for rs in replies.values() for r in rs if r.status != 200]
    assert sum(ok.values()) == int(BUDGET / CALL_USD), ok  # ten calls, no more
    assert trio.cloud.count("/chat/completions") == 10
    for r in refused:
        assert r.status == 429
        assert r.json()["error"]["code"] == "insufficient_quota"
        assert r.headers["x-gpulock-refused"] == "budget"
    store = Store(ClusterConfig(redis_url=trio.redis.url, host="reader"))
    assert round(sum(spend.spent(store).values()), 6) == BUDGET  # settled: no reservation left
    for name, h in trio.hosts.items():  # each host's own ledger keeps its own spend
        led = ledger.read(load(h.env["GPULOCK_CONFIG"], h.env["GPULOCK_STATE_DIR"]))
        assert round(sum(led.spend_usd.values()), 6) == ok[name] * CALL_USD


def test_three_gateways_share_one_rate_limit_window(trio: Trio) -> None:
    before = sum(1 for hit in trio.cloud.hits if hit.body.get("model") == "capped-m")
    replies = at_once(trio, "r", 2)  # six requests against 2 a minute
    codes = sorted(r.status for rs in replies.values() for r in rs)
    assert codes == [200, 200, 429, 429, 429, 429]
    assert sum(1 for hit in trio.cloud.hits if hit.body.get("model") == "capped-m") == before + 2
    for r in (r for rs in replies.values() for r in rs if r.status == 429):
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert r.headers["x-gpulock-refused"] == "rate"
        assert 1 <= int(r.headers["retry-after"]) <= 61  # kept by whole second: up to 61
