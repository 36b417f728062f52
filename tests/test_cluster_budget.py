"""Cloud budgets and cooldowns across hosts, for real: three hosts (own state folders and
ledgers, one Redis) whose agents (real processes calling ``router.get_model``) hit one budget
at once, and a 429 met by one host that cools the endpoint for another.

The cloud is one OpenAI-shaped server (``FaultServer``): every call costs exactly $1.50 (3
completion tokens at $500 per 1000; ``max_tokens: 3`` bounds it to that), so a $15.00
``router.daily_budget`` holds exactly ten calls, whoever makes them.
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

from gpulock.cluster import ratelimit, spend
from gpulock.cluster.config import ClusterConfig
from gpulock.cluster.heartbeat import Heartbeat
from gpulock.cluster.report import HostReport
from gpulock.cluster.store import Store
from gpulock.core.config import load_config
from gpulock.core.settings import Settings
from gpulock.core.settings import load as load_settings
from gpulock.router import ledger

HOSTS = ("a", "b", "c")
AGENTS_PER_HOST = 4
CALLS_PER_AGENT = 3
BUDGET = 15.0
CALL_USD = 1.5

AGENT = """\
import sys
from gpulock import router
ok = 0
try:
    m = router.get_model("t", agent=sys.argv[1])
    for _ in range(int(sys.argv[2])):
        try:
            m.complete("x")
            ok += 1
        except router.NoModelAvailable:
            pass
except router.NoModelAvailable:
    pass
print(ok)
"""


def host_env(root: Path, name: str, redis_url: str, cloud_url: str) -> dict[str, str]:
    folder = root / name
    folder.mkdir(exist_ok=True)
    config = folder / "gpulock.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            cluster: {{redis: '{redis_url}', host: {name}, heartbeat: 1s}}
            router: {{daily_budget: {BUDGET}}}
            routes:
              t:
                - {{backend: openai, name: paid, model: tiny, base_url: '{cloud_url}',
                   api_key_env: CLOUD_KEY, max_tokens: 3, price: {{input: 0, output: 500}}}}
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env.update(GPULOCK_CONFIG=str(config), GPULOCK_STATE_DIR=str(folder / "state"), CLOUD_KEY="k")
    return env


def host_settings(env: dict[str, str]) -> Settings:
    return load_settings(load_config(env["GPULOCK_CONFIG"]), env["GPULOCK_STATE_DIR"])


def run_agents(envs: dict[str, dict[str, str]], calls: int = CALLS_PER_AGENT) -> dict[str, int]:
    """Every host's agents at once; calls answered, by host."""
    procs = [
        (
            name,
            subprocess.Popen(
                [sys.executable, "-c", AGENT, f"{name}-agent-{i}", str(calls)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for name, env in envs.items()
        for i in range(AGENTS_PER_HOST)
    ]
    answered = dict.fromkeys(envs, 0)
    for name, p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        answered[name] += int(out.strip())
    return answered


def ledger_spend(env: dict[str, str]) -> float:
    return round(sum(ledger.read(host_settings(env)).spend_usd.values()), 6)


def shared_spend(url: str) -> float:
    store = Store(ClusterConfig(redis_url=url, host="reader"))
    return round(sum(spend.spent(store).values()), 6)


def test_three_hosts_agents_never_spend_past_one_budget(
    tmp_path: Path, redis: RedisServer, ok_cloud: FaultServer
) -> None:
    envs = {h: host_env(tmp_path, h, redis.url, ok_cloud.base_url) for h in HOSTS}
    answered = run_agents(envs)
    assert sum(answered.values()) == int(BUDGET / CALL_USD), answered  # ten calls, no more
    assert ok_cloud.count("/completions") == 10
    assert shared_spend(redis.url) == BUDGET
    for h in HOSTS:  # each host keeps its own spend in its own ledger as well
        assert ledger_spend(envs[h]) == answered[h] * CALL_USD
    shown = subprocess.run(
        [sys.executable, "-m", "gpulock.cluster", "--json"],
        env=envs["a"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    obj = json.loads(shown.stdout)["spend"]
    assert (obj["total_usd"], obj["daily_budget_usd"]) == (BUDGET, BUDGET)


def test_partitioned_hosts_spend_at_most_their_share_and_an_empty_redis_is_refilled(
    tmp_path: Path, redis: RedisServer, ok_cloud: FaultServer
) -> None:
    envs = {h: host_env(tmp_path, h, redis.url, ok_cloud.base_url) for h in HOSTS}
    # The hosts' servers have seen each other (what each host's cluster.json says).
    beats = [
        Heartbeat(
            host_settings(env),
            ClusterConfig(redis_url=redis.url, host=h, heartbeat_s=60.0),
            lambda now, h=h: HostReport(h, None, now, 60.0),
            ledger_spend=lambda env=env: ledger.read(host_settings(env)).spend_usd,
        )
        for h, env in envs.items()
    ]
    for _round in range(2):  # the second round: every host has seen all three
        for beat in beats:
            beat.tick()
    redis.stop()  # partitioned: each host may spend its share, $5.00, no more
    answered = run_agents(envs)
    assert answered == dict.fromkeys(HOSTS, 3), answered  # 3 x $1.50 <= $5.00 < 4 x $1.50
    assert sum(ledger_spend(envs[h]) for h in HOSTS) == 13.5 <= BUDGET

    redis.start(same_port=True)  # back, and empty (no persistence)
    # Until every host seen has reported today, a host keeps to its share: a has spent
    # $4.50 of its $5.00, so a $1.50 call must wait for the others' ledgers.
    assert run_agents({"a": envs["a"]}, calls=1) == {"a": 0}
    for beat in beats:  # each host's heartbeat refills Redis from its own ledger
        beat.tick()
    assert shared_spend(redis.url) == 13.5  # no budget starts again from zero
    answered = run_agents(envs, calls=1)
    assert sum(answered.values()) == 1, answered  # 13.5 + 1.5 = 15: then it is spent
    assert shared_spend(redis.url) == BUDGET


def test_the_reservation_script_refills_and_checks_in_one_step(redis: RedisServer) -> None:
    a = Store(ClusterConfig(redis_url=redis.url, host="a"))
    b = Store(ClusterConfig(redis_url=redis.url, host="b"))
    ok, model, total = spend.reserve(
        a, "cloud:x", 1.0, model_budget_usd=3.0, total_budget_usd=None,
        local_spend_usd={"cloud:x": 1.5, "cloud:y": 0.5},
    )  # fmt: skip
    assert (ok, model, total) == (True, 1.5, 2.0)  # refilled from a's ledger, then checked
    # b expects 3 hosts and sees 2 (a, b): it keeps to its share, 3.00 / 3, of its own.
    ok, model, _total = spend.reserve(
        b, "cloud:x", 1.0, model_budget_usd=3.0, total_budget_usd=None,
        local_spend_usd={}, hosts_expected=3,
    )  # fmt: skip
    assert (ok, model) == (True, 0.0)
    ok, model, _total = spend.reserve(
        b, "cloud:x", 0.5, model_budget_usd=3.0, total_budget_usd=None,
        local_spend_usd={}, hosts_expected=3,
    )  # fmt: skip
    assert (ok, model) == (False, 1.0)
    ok, model, _total = spend.reserve(
        a, "cloud:x", 1.0, model_budget_usd=3.0, total_budget_usd=None, local_spend_usd={}
    )
    assert (ok, model) == (False, 3.5)  # 2.5 (a) + 1.0 (b) + 1.0 > 3.0: refused
    spend.settle(a, "cloud:x", -0.25)  # a's call cost less than its bound
    assert spend.spent(a) == {"cloud:x": 3.25, "cloud:y": 0.5}


def test_a_block_is_reserved_ahead_in_whole_calls_never_past_a_share_of_what_is_left(
    redis: RedisServer,
) -> None:
    a = Store(ClusterConfig(redis_url=redis.url, host="a"))
    b = Store(ClusterConfig(redis_url=redis.url, host="b"))

    def block(s: Store, amount: float, ahead: float) -> tuple[bool, float, float | None]:
        ok, _model, _total, granted, left = spend.reserve_block(
            s, "cloud:x", amount, ahead_usd=ahead, share=0.125, unit_usd=amount,
            model_budget_usd=None, total_budget_usd=100.0, local_spend_usd={},
        )  # fmt: skip
        return ok, granted, left

    # $100 left: a call of $1 and 20 more wanted; an eighth of the 99 after it is 12 calls.
    assert block(a, 1.0, 20.0) == (True, 13.0, 100.0)
    assert block(b, 1.0, 5.0) == (True, 6.0, 87.0)  # 5 wanted: within 80/8
    assert block(b, 1.0, 0.5) == (True, 1.0, 81.0)  # half a call is no call: none ahead
    assert spend.spent(a) == {"cloud:x": 20.0}
    spend.settle(a, "cloud:x", -12.0)  # a gives back its block unused
    assert block(b, 70.0, 100.0) == (True, 70.0, 92.0)  # 22 left after: not a whole call's 8th
    assert block(a, 30.0, 0.0)[0] is False  # 78 + 30 > 100


def test_rate_slots_are_taken_by_second_in_blocks_and_given_back(redis: RedisServer) -> None:
    a = Store(ClusterConfig(redis_url=redis.url, host="a"))
    b = Store(ClusterConfig(redis_url=redis.url, host="b"))
    now = float(int(time.time()))
    assert ratelimit.take_block(a, "cloud:x", 80, 50, share=0.125, now_wall=now) == (True, 0, 10)
    assert ratelimit.take_block(b, "cloud:x", 80, 3, share=0.125, now_wall=now) == (True, 10, 3)
    assert ratelimit.take(b, "cloud:x", 80, now_wall=now + 30) == (True, 13)
    ratelimit.give_back(a, "cloud:x", int(now), 9)  # a used one of its ten
    assert ratelimit.take(a, "cloud:x", 80, now_wall=now + 60.5) == (True, 5)
    # The second a request began in counts until 61 s after that second's start.
    assert ratelimit.take(a, "cloud:x", 80, now_wall=now + 61) == (True, 2)
    assert ratelimit.take_block(a, "cloud:x", 3, 9, share=0.125, now_wall=now + 61) == (
        False, 3, 0,
    )  # fmt: skip


def test_a_429_on_one_host_cools_the_endpoint_on_another(
    tmp_path: Path, redis: RedisServer
) -> None:
    limited = FaultServer(mode="429", retry_after="120").start()
    steady = FaultServer(mode="ok").start()
    try:
        envs = {h: host_env(tmp_path, h, redis.url, limited.base_url) for h in ("a", "b")}
        for env in envs.values():  # a second, steady candidate after the rate-limited one
            config = Path(env["GPULOCK_CONFIG"])
            config.write_text(
                config.read_text()
                + f"    - {{backend: openai, name: steady, model: tiny, base_url: "
                f"'{steady.base_url}', api_key_env: CLOUD_KEY, max_tokens: 3}}\n"
            )
        call = (
            "from gpulock import router; m = router.get_model('t'); m.complete('x'); print(m.name)"
        )
        out = subprocess.run(
            [sys.executable, "-c", call], env=envs["a"], capture_output=True, text=True, timeout=60
        )
        assert out.stdout.strip() == "steady", out.stderr  # a met the 429 and moved on
        assert limited.count("/completions") == 1
        route = subprocess.run(
            [sys.executable, "-m", "gpulock", "route", "t", "--json"],
            env=envs["b"], capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        verdicts = json.loads(route.stdout)["candidates"]
        assert verdicts[0]["name"] == "paid" and not verdicts[0]["ok"]
        assert "cooling down" in verdicts[0]["reason"] and "(on a)" in verdicts[0]["reason"]
        out = subprocess.run(
            [sys.executable, "-c", call], env=envs["b"], capture_output=True, text=True, timeout=60
        )
        assert out.stdout.strip() == "steady", out.stderr
        assert limited.count("/completions") == 1  # b never called the cooling endpoint
    finally:
        limited.stop()
        steady.stop()


def test_a_rate_limit_window_is_shared_by_the_hosts(
    tmp_path: Path, redis: RedisServer, ok_cloud: FaultServer
) -> None:
    steady = FaultServer(mode="ok").start()
    try:
        envs = {h: host_env(tmp_path, h, redis.url, ok_cloud.base_url) for h in HOSTS}
        for env in envs.values():  # 2 requests a minute on the paid endpoint, then steady
            config = Path(env["GPULOCK_CONFIG"])
            text = config.read_text().replace("max_tokens: 3,", "max_tokens: 3, rate_limit: 2,")
            config.write_text(
                text + f"    - {{backend: openai, name: steady, model: tiny, base_url: "
                f"'{steady.base_url}', api_key_env: CLOUD_KEY, max_tokens: 3}}\n"
            )
        answered = run_agents(envs, calls=1)
        assert sum(answered.values()) == len(HOSTS) * AGENTS_PER_HOST  # every call answered...
        assert ok_cloud.count("/completions") == 2  # ...and only two by the limited endpoint
        assert steady.count("/completions") == len(HOSTS) * AGENTS_PER_HOST - 2
    finally:
        steady.stop()
