"""The cluster's Redis, for real: hosts publish and disappear, and Redis lost in every way
(stopped, frozen, restarted empty, a wrong password) breaks nothing and hangs nothing.

A real ``redis-server`` on 127.0.0.1 (a free port, no persistence) per test; "hosts" are
``Store``/``Heartbeat`` objects with their own state folders.  The back-off's clock is
injected, so a test moves past it without sleeping.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from procs import wait_until
from redis_server import HANG_BOUND_S, RedisServer

from gpulock import status
from gpulock.cluster import report
from gpulock.cluster.config import ClusterConfig
from gpulock.cluster.heartbeat import Heartbeat
from gpulock.cluster.report import GpuLine, HostReport
from gpulock.cluster.store import Store, Unavailable
from gpulock.core import events
from gpulock.core.config import parse_config
from gpulock.core.settings import Settings
from gpulock.core.settings import load as load_settings

PASSWORD = "correct-horse-battery"  # noqa: S105 (the test server's, made up)
PW_ENV = "PW"  # the name of the variable holding the password


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cc(url: str, host: str, **kw: object) -> ClusterConfig:
    return ClusterConfig(redis_url=url, host=host, **kw)  # type: ignore[arg-type]


def host_report(name: str, now: float, heartbeat_s: float = 2.0) -> HostReport:
    return HostReport(
        host=name,
        gateway=f"http://{name}:11435",
        at_wall=now,
        heartbeat_s=heartbeat_s,
        gpus=(GpuLine(0, 24 << 30, 20 << 30, 0, 0, 0.0, 4.0),),
    )


def settings(folder: Path) -> Settings:
    return load_settings(parse_config("simulate: 24GiB\n", "test.yaml"), folder)


def names(store: Store) -> list[str]:
    return [r["host"] for r in store.hosts()]


def test_hosts_publish_and_a_silent_host_disappears(redis: RedisServer) -> None:
    a = Store(cc(redis.url, "a", heartbeat_s=60.0))
    b = Store(cc(redis.url, "b", heartbeat_s=0.2))  # expires 0.6 s after its last word
    a.publish(host_report("a", time.time()).as_dict())
    b.publish(host_report("b", time.time()).as_dict())
    seen = a.hosts()
    assert [r["host"] for r in seen] == ["a", "b"]
    parsed = report.parse(seen[1])
    assert parsed is not None and parsed.gateway == "http://b:11435"
    wait_until(lambda: names(a) == ["a"], 15.0, "b to expire after 3 silent heartbeats")
    a.withdraw()  # a clean shutdown leaves at once
    assert names(b) == []


def test_a_prefix_keeps_two_clusters_apart_in_one_redis(redis: RedisServer) -> None:
    lab = Store(cc(redis.url, "a", prefix="lab:"))
    home = Store(cc(redis.url, "a", prefix="home:"))
    lab.publish(host_report("a", time.time()).as_dict())
    assert names(lab) == ["a"] and names(home) == []


def test_redis_down_answers_at_once_and_backs_off(tmp_path: Path) -> None:
    gone = RedisServer(tmp_path / "r").start()
    url = gone.url
    gone.stop()
    clock = Clock()
    s = Store(cc(url, "a"), clock=clock)
    with pytest.raises(Unavailable) as e:
        s.hosts()
    assert s.problem is not None and url in s.problem and not s.up
    assert "redis unavailable" in str(e.value)
    gone.start(same_port=True)  # back, but the back-off has not passed: no new try yet
    try:
        with pytest.raises(Unavailable):
            s.hosts()
        clock.now += 1.5  # past the first back-off
        assert s.hosts() == [] and s.up
    finally:
        gone.stop()


def test_a_frozen_redis_is_treated_as_down(redis: RedisServer) -> None:
    s = Store(cc(redis.url, "a"))
    s.publish(host_report("a", time.time()).as_dict())
    redis.freeze()  # SIGSTOP: the kernel still accepts connections, nothing answers
    try:
        started = time.monotonic()
        with pytest.raises(Unavailable) as e:
            s.hosts()
        assert time.monotonic() - started < HANG_BOUND_S
        assert "no answer within 0.5s" in str(e.value)
    finally:
        redis.thaw()


def test_a_wrong_password_is_named_never_shown(tmp_path: Path) -> None:
    r = RedisServer(tmp_path / "r", password=PASSWORD).start()
    try:
        wrong = Store(cc(r.url, "a", password_env=PW_ENV), environ={"PW": "not-the-password"})
        with pytest.raises(Unavailable) as e:
            wrong.hosts()
        assert "wrong password (from $PW)" in str(e.value)
        assert "not-the-password" not in str(e.value) and PASSWORD not in str(e.value)
        missing = Store(cc(r.url, "a"))
        with pytest.raises(Unavailable) as e:
            missing.hosts()
        assert "cluster.password_env is not set" in str(e.value)
        right = Store(cc(r.url, "a", password_env=PW_ENV), environ={"PW": PASSWORD})
        right.publish(host_report("a", time.time()).as_dict())
        assert names(right) == ["a"]
    finally:
        r.stop()


def gauges(s: Settings) -> dict[str, float]:
    """The cluster's gauges in this host's metrics exposition."""
    from metrics_helpers import parse

    from gpulock.metrics.collector import exposition

    samples = parse(exposition(s).decode())
    return {name: v for (name, _labels), v in samples.items() if name.startswith("gpulock_cluster")}


def kinds(s: Settings) -> list[str]:
    return [e["event"] for e in events.read(s.state_dir) if e["event"].startswith("cluster-")]


def test_the_heartbeat_through_redis_lost_and_restarted_empty(
    redis: RedisServer, tmp_path: Path
) -> None:
    sa, sb = settings(tmp_path / "a"), settings(tmp_path / "b")
    clock = Clock()
    ca, cb = cc(redis.url, "a", heartbeat_s=1.0), cc(redis.url, "b", heartbeat_s=1.0)
    ha = Heartbeat(sa, ca, lambda now: host_report("a", now, 1.0), store=Store(ca, clock=clock))
    hb = Heartbeat(sb, cb, lambda now: host_report("b", now, 1.0), store=Store(cb))
    hb.tick()
    ha.tick()
    assert [r.host for r in ha.fleet.reports] == ["a", "b"] and ha.fleet.redis_ok
    assert status.render(status.snapshot(sa)).splitlines()[0] == "cluster: 2 hosts, redis ok"
    assert status.snapshot(sa)["cluster"] == {
        "host": "a", "hosts": 2, "redis": "ok", "problem": None
    }  # fmt: skip
    assert gauges(sa) == {"gpulock_cluster_hosts": 2.0, "gpulock_cluster_redis_up": 1.0}

    redis.stop()  # Redis lost: the host works alone, says so, and routes locally
    ha.tick()
    assert not ha.fleet.redis_ok and ha.fleet.reports == ()
    assert kinds(sa) == ["cluster-degraded"]
    assert gauges(sa) == {"gpulock_cluster_hosts": 2.0, "gpulock_cluster_redis_up": 0.0}
    line = status.render(status.snapshot(sa)).splitlines()[0]
    assert line.startswith("cluster: 2 hosts last seen, redis down (") and "local only" in line

    redis.start(same_port=True)  # back, empty (no persistence): the hosts fill it again
    clock.now += 60.0
    hb.tick()
    ha.tick()
    assert [r.host for r in ha.fleet.reports] == ["a", "b"]
    assert kinds(sa) == ["cluster-degraded", "cluster-restored"]
    assert status.render(status.snapshot(sa)).splitlines()[0] == "cluster: 2 hosts, redis ok"


def test_no_status_line_without_a_live_heartbeat(redis: RedisServer, tmp_path: Path) -> None:
    s = settings(tmp_path / "a")
    assert status.snapshot(s)["cluster"] is None
    c = cc(redis.url, "a", heartbeat_s=1.0)
    Heartbeat(s, c, lambda now: host_report("a", now)).tick(now_wall=time.time() - 10.0)
    assert status.snapshot(s)["cluster"] is None  # written 10 s ago: 3 heartbeats have passed
    assert gauges(s) == {}  # no cluster seen: absent, never 0


def test_a_unix_socket_url(tmp_path: Path) -> None:
    from redis_server import need_redis

    exe = need_redis()
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen(
        [exe, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(sock.exists, 20.0, "redis-server's socket")
        clock = Clock()
        s = Store(cc(f"unix://{sock}", "a"), clock=clock)
        wait_until(lambda: _publishes(s, clock), 20.0, "a publish through the socket")
        assert names(s) == ["a"]
    finally:
        proc.kill()
        proc.wait()


def _publishes(s: Store, clock: Clock) -> bool:
    try:
        s.publish(host_report("a", time.time()).as_dict())
    except Unavailable:
        clock.now += 60.0  # past the back-off: the socket may not have accepted yet
        return False
    return True
