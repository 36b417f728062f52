"""The host axis of the accounting, for real: ``by_host`` in ``gpulock status``'s ``usage``.

Host ``b`` is a ``gpulock serve`` (its own state folder, a simulated GPU, the tiny llama.cpp
model, one real ``redis-server``); host ``a`` runs agents (real processes calling
``router.get_model``) and no server.  One agent's call is sent to ``b`` (warm there, cold on
``a``), another runs on ``a`` (its config makes a peer too far away); ``a``'s ledger counts
each under the host that ran it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from procs import wait_until
from redis_server import RedisServer, need_redis
from router_servers import free_port, kill_group
from serve_server import GatewayProc, Reply, clean_env

from gpulock.core.config import load_config
from gpulock.core.settings import load as load_settings
from gpulock.core.units import calendar_day
from gpulock.router import ledger
from gpulock.router.tiny_model import ensure_tiny_llama

WAIT_S = 60.0

AGENT = """\
import json, sys
from gpulock import router
m = router.get_model("chat", agent=sys.argv[1])
text = m.chat([{"role": "user", "content": "hi"}], max_tokens=4)
print(json.dumps({"host": m.host, "tier": m.tier}))
"""


def config_text(redis: RedisServer, tiny: Path, name: str, extra: str) -> str:
    return textwrap.dedent(
        f"""\
        simulate: 24GiB
        cluster:
          redis: {redis.url}
          host: {name}
          heartbeat: 500ms
        """
    ) + extra + textwrap.dedent(
        f"""\
        routes:
          chat:
            - {{tier: gpu, backend: llama_cpp, model: {tiny}, n_ctx: 256, max_tokens: 4,
               name: tiny-gpu}}
        """
    )  # fmt: skip


def start_b(root: Path, redis: RedisServer, tiny: Path) -> GatewayProc:
    folder = root / "b"
    folder.mkdir()
    port = free_port()
    config = folder / "gpulock.yaml"
    config.write_text(config_text(redis, tiny, "b", f"  gateway: http://127.0.0.1:{port}\n"))
    env = {"GPULOCK_CONFIG": str(config), "GPULOCK_STATE_DIR": str(folder / "state")}
    return GatewayProc(log=folder / "serve.log", env=env, port=port, isolated=True).start()


def b_warm(b: GatewayProc) -> bool:
    """b's report, as b's heartbeat last read it: tiny-gpu warm and its line empty."""
    seen = b.request("GET", "/gpulock/cluster").json()
    row = next((x for x in seen["hosts"] if x["name"] == "b"), None)
    return row is not None and "tiny-gpu" in row["warm"] and not row["in_flight"]


def agent(env: dict[str, str], name: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", AGENT, name],
        env={**clean_env(), **env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    got: dict[str, Any] = json.loads(out.stdout)
    return got


def test_status_counts_each_call_under_the_host_that_ran_it(tmp_path: Path) -> None:
    need_redis()
    tiny = ensure_tiny_llama(tmp_path)
    redis = RedisServer(tmp_path / "redis").start()
    b: GatewayProc | None = None
    try:
        b = start_b(tmp_path, redis, tiny)
        warmed: Reply = b.request(
            "POST",
            "/v1/chat/completions",
            {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            {"X-Gpulock-Agent": "warm-up", "X-Gpulock-From": "test"},
        )
        assert warmed.status == 200, warmed.body
        wait_until(lambda: b_warm(b), WAIT_S, "b's report: tiny-gpu warm")

        folder = tmp_path / "a"
        folder.mkdir()
        state = str(folder / "state")
        # Two configs of one host a (one state folder, one ledger): with no remote penalty the
        # warm peer starts sooner than a cold load here; with a 10-minute one, here wins.
        near, far = folder / "near.yaml", folder / "far.yaml"
        near.write_text(config_text(redis, tiny, "a", "  remote_penalty: 0s\n"))
        far.write_text(config_text(redis, tiny, "a", "  remote_penalty: 10m\n"))
        a_near = {"GPULOCK_CONFIG": str(near), "GPULOCK_STATE_DIR": state}
        a_far = {"GPULOCK_CONFIG": str(far), "GPULOCK_STATE_DIR": state}

        assert agent(a_near, "agent-sent") == {"host": "b", "tier": "gpu"}
        assert agent(a_far, "agent-here") == {"host": "a", "tier": "gpu"}

        status = subprocess.run(
            [sys.executable, "-m", "gpulock", "status", "--json"],
            env={**clean_env(), **a_near},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        usage = json.loads(status.stdout)["usage"]
        assert sorted(usage["by_host"]) == ["a", "b"], usage
        assert usage["by_host"]["a"]["calls"] == usage["by_host"]["b"]["calls"] == 1
        assert usage["by_host"]["b"]["tokens_out"] > 0
        assert usage["by_agent"]["agent-sent"]["calls"] == 1
        text = subprocess.run(
            [sys.executable, "-m", "gpulock", "status"],
            env={**clean_env(), **a_near},
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "  by host: a 1 call, b 1 call" in text.splitlines(), text
    finally:
        if b is not None and b.proc is not None:
            kill_group(b.proc)
        redis.stop()


def test_a_ledger_without_the_host_axis_still_loads_and_gains_it(tmp_path: Path) -> None:
    config = tmp_path / "gpulock.yaml"
    config.write_text("cluster: {redis: 'redis://127.0.0.1:1/0', host: a}\n")
    settings = load_settings(load_config(str(config)), str(tmp_path / "state"))
    old = ledger.Ledger(calendar_day(1e9, utc=True))  # written by a gpulock before by_host
    old.usage = {"agent": {"x": {"calls": 2.0, "tokens_in": 1.0, "tokens_out": 1.0,
                                 "cost_usd": 0.0}}}  # fmt: skip
    folder = tmp_path / "state" / "router"
    folder.mkdir(parents=True)
    (folder / "ledger.json").write_text(json.dumps(old.to_json()))
    ledger.record_call(settings, "k", cost_usd=0.0, agent="x", tier="gpu", host="b", now_wall=1e9)
    led = ledger.read(settings, now_wall=1e9)
    assert led.usage["agent"]["x"]["calls"] == 3  # the old counts kept
    assert led.usage["host"] == {
        "b": {"calls": 1.0, "tokens_in": 0.0, "tokens_out": 0.0, "cost_usd": 0.0}
    }
    # A call without a host (outside a cluster) adds no host row.
    ledger.record_call(settings, "k", cost_usd=0.0, agent="x", tier="gpu", now_wall=1e9)
    assert list(ledger.read(settings, now_wall=1e9).usage["host"]) == ["b"]
