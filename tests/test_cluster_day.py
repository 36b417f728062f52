"""In a cluster the budget day is the UTC day, on the host's own ledger too.

The cluster keeps its spend in Redis by UTC day, and refills Redis from each host's ledger: a
ledger kept by the local calendar day would disagree with it for hours every day on a host far
from UTC (from 16:00 to midnight in Los Angeles).  Real agent processes run with a ``TZ=`` that
puts their local day apart from the UTC day, and make a real cloud call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from redis_server import RedisServer
from router_servers import FaultServer

from gpulock.cluster import spend
from gpulock.cluster.config import ClusterConfig
from gpulock.cluster.store import Store

AGENT = """\
from gpulock import router
m = router.get_model("t", agent="tz-agent")
m.complete("x")
print(m.name)
"""


def tz_apart() -> tuple[str, int]:
    """A POSIX ``TZ`` whose calendar day is not the UTC day now (at least 2 hours from either
    midnight), and its offset east of UTC in seconds."""
    if time.gmtime().tm_hour < 12:
        return "XXX+14", -14 * 3600  # 14 hours behind UTC: still yesterday
    return "XXX-14", 14 * 3600  # 14 hours ahead: already tomorrow


def utc_day() -> str:
    return time.strftime("%Y-%m-%d", time.gmtime())


def local_day(offset_s: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(time.time() + offset_s))


def host_env(folder: Path, cloud_url: str, tz: str, cluster: str | None) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "gpulock.yaml"
    section = f"cluster: {{redis: '{cluster}', host: a, heartbeat: 1s}}\n" if cluster else ""
    config.write_text(
        section
        + textwrap.dedent(
            f"""\
            router: {{daily_budget: 15.00}}
            routes:
              t:
                - {{backend: openai, name: paid, model: tiny, base_url: '{cloud_url}',
                   api_key_env: CLOUD_KEY, max_tokens: 3, price: {{input: 0, output: 500}}}}
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env.update(
        GPULOCK_CONFIG=str(config),
        GPULOCK_STATE_DIR=str(folder / "state"),
        CLOUD_KEY="k",
        TZ=tz,
    )
    return env


def run(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def ledger_file(env: dict[str, str]) -> dict[str, object]:
    data: dict[str, object] = json.loads(
        (Path(env["GPULOCK_STATE_DIR"]) / "router" / "ledger.json").read_text()
    )
    return data


def test_a_cluster_hosts_ledger_counts_the_utc_day_like_redis(
    tmp_path: Path, redis: RedisServer, ok_cloud: FaultServer
) -> None:
    tz, offset = tz_apart()
    days = {utc_day()}
    assert local_day(offset) not in days
    env = host_env(tmp_path / "a", ok_cloud.base_url, tz, redis.url)
    out = run(env, sys.executable, "-c", AGENT)
    assert out.returncode == 0 and out.stdout.strip() == "paid", out.stderr
    days.add(utc_day())  # (a test that straddles midnight UTC may see either day)
    led = ledger_file(env)
    assert led["day"] in days, (led["day"], days, tz)  # not the agent's local day
    assert list(led["spend_usd"].values()) == [1.5], led  # type: ignore[attr-defined]
    # Redis counts the same day, and the same spend: the refill from this ledger agrees.
    store = Store(ClusterConfig(redis_url=redis.url, host="reader"))
    assert spend.spent(store) == led["spend_usd"]

    status = run(env, sys.executable, "-m", "gpulock", "status", "--json")
    assert status.returncode == 0, status.stderr
    usage = json.loads(status.stdout)["usage"]
    assert usage["day"] == led["day"] and usage["cloud_spend_usd"] == 1.5, usage
    assert usage["by_agent"]["tz-agent"]["calls"] == 1
    text = run(env, sys.executable, "-m", "gpulock", "status").stdout
    assert "model calls today (UTC): cloud 1; cloud spend $1.5000 of $15.00" in text, text
    explain = run(env, sys.executable, "-m", "gpulock", "route", "t", "--explain")
    assert explain.returncode == 0, explain.stderr
    assert "$1.5000 spent today" in explain.stdout, explain.stdout


def test_a_host_alone_keeps_its_local_day(tmp_path: Path, ok_cloud: FaultServer) -> None:
    tz, offset = tz_apart()
    days = {local_day(offset)}
    env = host_env(tmp_path / "alone", ok_cloud.base_url, tz, None)
    out = run(env, sys.executable, "-c", AGENT)
    assert out.returncode == 0 and out.stdout.strip() == "paid", out.stderr
    days.add(local_day(offset))
    led = ledger_file(env)
    assert led["day"] in days and led["day"] != utc_day(), (led["day"], days, tz)
    status = run(env, sys.executable, "-m", "gpulock", "status", "--json")
    usage = json.loads(status.stdout)["usage"]
    assert usage["day"] == led["day"] and usage["cloud_spend_usd"] == 1.5, usage
    assert "by_host" not in usage
