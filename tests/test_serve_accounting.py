"""``gpulock serve``'s calls go through the router's one accounting path
(``gpulock.router.accounting``).

A real ``gpulock serve`` in a child process; its cloud candidates are ``FaultServer``s on
127.0.0.1 answering canned OpenAI completions (11 tokens in, 3 out: $0.014 a call at
``price: 1.0``); a local ``tiny-cpu`` candidate is the tiny llama.cpp model.  Clients are the
official ``openai`` and ``ollama`` ones.  What is proved: a cloud candidate's ``daily_budget`` and
``rate_limit`` hold for serve's requests as for ``router.get_model``'s; a refused request is a
429 in the API's shape (OpenAI ``insufficient_quota`` / ``rate_limit_exceeded``, Ollama
``{"error": ...}``), or falls back to the next candidate exactly where ``get_model`` does; and
serve's calls reach ``gpulock status``'s usage, ``gpulock route --explain``, the report's cost
and the metrics (``gpulock_router_cost_usd_total``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ollama
import openai
import pytest
from metrics_helpers import parse, promtool_check, value
from procs import wait_until
from router_servers import OK_TOKENS_IN, OK_TOKENS_OUT, FaultServer
from serve_server import GatewayProc

from gpulock import router
from gpulock.core import events
from gpulock.core.settings import load
from gpulock.router import ledger
from gpulock.router.tiny_model import ensure_tiny_llama

KEY_ENV = "GPULOCK_TEST_ACCOUNTING_KEY"
SECRET = "sk-accounting-3b1f0c9e7d2a4e68"  # noqa: S105
CALL_USD = (OK_TOKENS_IN + OK_TOKENS_OUT) * 1.0 / 1000  # price: 1.0 per 1k tokens, both ways
MSG = [{"role": "user", "content": "hello"}]
SHARED_BUDGET = 1.00  # 71 calls of $0.014; 30 reservations of $0.033
SHARED_RATE = 24


@dataclass
class Setup:
    gateway: GatewayProc
    upstream: FaultServer
    stalling: FaultServer
    env: dict[str, str]
    config: Path
    state: Path

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpulock", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **self.env},
        )


def cloud(name: str, base_url: str, model: str, extra: str) -> str:
    return (
        f"- {{tier: cloud, backend: openai, name: {name}, model: {model}, base_url: '{base_url}',"
        f" api_key_env: {KEY_ENV}, price: 1.0, max_tokens: 8{extra}}}"
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("serve-accounting")
    tiny = ensure_tiny_llama(root)
    upstream = FaultServer(mode="ok").start()
    stalling = FaultServer(mode="stall", hang_s=60.0).start()
    u = upstream.base_url
    local = f"- {{tier: cpu, backend: llama_cpp, model: {tiny}, n_ctx: 256, max_tokens: 4}}"
    config = root / "gpulock.yaml"
    config.write_text(
        textwrap.dedent(
            """\
            routes:
              budgeted:
                {budgeted}
              plain:
                {plain}
              burst:
                {burst}
              crowd:
                {crowd}
              stalled:
                {stalled}
              limited:
                {limited}
              ollama-limited:
                {ollama_limited}
              spills:
                {spills}
                {local}
              shared:
                {shared}
              shared-rate:
                {shared_rate}
            """
        ).format(
            budgeted=cloud("paid", u, "m-budget", ", daily_budget: 0.10"),
            plain=cloud("plain", u, "m-plain", ""),
            burst=cloud("burst", u, "m-burst", ", rate_limit: 2"),
            crowd=cloud("crowded", u, "m-crowd", ", daily_budget: 0.10"),
            stalled=cloud("stalled", stalling.base_url, "m-stall", ", daily_budget: 0.10"),
            limited=cloud("capped", u, "m-rate", ", rate_limit: 2"),
            ollama_limited=cloud("capped-ollama", u, "m-rate-ollama", ", rate_limit: 2"),
            spills=cloud("small-budget", u, "m-spill", ", daily_budget: 0.04"),
            local=local,
            shared=cloud("shared", u, "m-shared", f", daily_budget: {SHARED_BUDGET}"),
            shared_rate=cloud("shared-rate", u, "m-shared-rate", f", rate_limit: {SHARED_RATE}"),
        )
    )
    state = root / "state"
    env = {
        "GPULOCK_CONFIG": str(config),
        "GPULOCK_STATE_DIR": str(state),
        KEY_ENV: SECRET,
        "NO_PROXY": "127.0.0.1,localhost",
    }
    g = GatewayProc(root / "serve.log", env=env)
    try:
        yield Setup(g.start(), upstream, stalling, env, config, state)
    finally:
        g.stop()
        upstream.stop()
        stalling.stop()


def oa(g: GatewayProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{g.url}/v1", api_key="unused", max_retries=0)


def hits(f: FaultServer, model: str) -> int:
    return sum(1 for h in f.hits if h.body.get("model") == model)


def gateway_count(g: GatewayProc, outcome: str) -> float:
    r = g.request("GET", "/metrics")
    assert r.status == 200
    return sum(
        v
        for (name, labels), v in parse(r.body.decode()).items()
        if name == "gpulock_gateway_request_duration_seconds_count"
        and ("outcome", outcome) in labels
    )


def calls(g: GatewayProc, model: str, n: int) -> tuple[int, list[openai.RateLimitError]]:
    """``n`` chat calls one after another: how many were served, and the 429s of the rest."""
    c = oa(g)
    served, refused = 0, []
    for _ in range(n):
        try:
            c.chat.completions.create(model=model, messages=MSG)  # type: ignore[arg-type]
            served += 1
        except openai.RateLimitError as e:
            refused.append(e)
    return served, refused


def at_once(g: GatewayProc, model: str, n: int) -> list[int]:
    """``n`` chat calls in flight together: each one's status (200, or 429 when refused)."""

    async def together() -> list[int]:
        c = openai.AsyncOpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0)

        async def one() -> int:
            try:
                await c.chat.completions.create(model=model, messages=MSG)  # type: ignore[arg-type]
            except openai.RateLimitError:
                return 429
            return 200

        try:
            return list(await asyncio.gather(*(one() for _ in range(n))))
        finally:
            await c.close()

    return asyncio.run(together())


def test_a_daily_budget_holds_for_serve_and_the_refusal_is_openais_429(setup: Setup) -> None:
    served, refused = calls(setup.gateway, "budgeted", 6)
    # Each call first reserves its most cost: its prompt (9 bytes of role and text, a token
    # each at most, + 8 for the message's template + 8 for the reply's start: 25 tokens) and
    # max_tokens: 8 of output, $0.033 at price 1.0; it then costs $0.014.  The sixth call
    # starts at $0.070 spent: $0.070 + $0.033 > $0.10, so it is refused before it runs, as
    # router.get_model's would be, and no call can take the spend past the budget.
    assert served == 5 and len(refused) == 1
    assert hits(setup.upstream, "m-budget") == 5
    for e in refused:
        assert e.status_code == 429
        assert (e.type, e.code) == ("insufficient_quota", "insufficient_quota")
        assert "daily budget: $0.0700 spent on this host today + up to $0.0330" in e.message
        assert "> $0.10" in e.message
        assert e.response.headers["x-should-retry"] == "false"  # no use retrying until tomorrow
        assert e.response.headers["x-gpulock-refused"] == "budget"
        assert SECRET not in e.message
    # The gateway's request histogram says why, not "queue-full".
    assert gateway_count(setup.gateway, "over-budget") == 1
    settings = load(str(setup.config), str(setup.state))
    assert ledger.read(settings).spend_usd[f"openai:{setup.upstream.base_url}:m-budget"] == (
        pytest.approx(5 * CALL_USD)
    )


def test_requests_at_once_never_spend_past_a_budget(setup: Setup) -> None:
    # Eight requests in flight at once against $0.10: a check of what was spent before each
    # call lets all eight through ($0.112); reserving each call's most cost ($0.033) lets at
    # least two through and never a call that could pass the budget.
    codes = at_once(setup.gateway, "crowd", 8)
    served = codes.count(200)
    assert served >= 2 and codes.count(429) == 8 - served
    assert hits(setup.upstream, "m-crowd") == served
    settings = load(str(setup.config), str(setup.state))
    spent = ledger.read(settings).spend_usd[f"openai:{setup.upstream.base_url}:m-crowd"]
    assert spent == pytest.approx(served * CALL_USD)  # every reservation settled or given back
    assert spent <= 0.10


def test_a_rate_limit_holds_for_serve_and_the_refusal_is_openais_429(setup: Setup) -> None:
    served, refused = calls(setup.gateway, "limited", 5)
    assert served == 2 and len(refused) == 3
    assert hits(setup.upstream, "m-rate") == 2
    for e in refused:
        assert (e.type, e.code) == ("rate_limit_exceeded", "rate_limit_exceeded")
        assert "rate limit: 2 requests in the last minute (of 2)" in e.message
        retry = float(e.response.headers["retry-after"])
        # Requests are kept by whole second, and a second counts until the 61st after it
        # began (never less than a minute for a request at its very end): up to 61 s.
        assert 0 < retry <= 61
        assert e.response.headers["x-gpulock-refused"] == "rate"
    assert gateway_count(setup.gateway, "rate-limited") >= 3


def test_a_burst_of_requests_at_once_gets_no_more_than_the_rate_limit(setup: Setup) -> None:
    # Judged and counted in one locked change: six requests in flight at once cannot all read
    # "0 requests in the last minute" before any is counted.
    codes = at_once(setup.gateway, "burst", 6)
    assert sorted(codes) == [200, 200, 429, 429, 429, 429]
    assert hits(setup.upstream, "m-burst") == 2


def test_a_stream_the_client_leaves_settles_its_reservation_at_what_it_got(
    setup: Setup,
) -> None:
    # The upstream sends a first piece and then nothing: the client reads it and hangs up.
    # The call's reservation ($0.033) must not stay counted as spent all day: it is settled at
    # what the client got (a token a piece relayed, the upstream's usage never came), as
    # router.get_model counts a stream its caller stopped reading.
    c = oa(setup.gateway)
    stream = c.chat.completions.create(model="stalled", messages=MSG, stream=True)  # type: ignore[arg-type]
    got = ""
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            got += ch.choices[0].delta.content
            break
    stream.close()
    assert got == "fi"
    settings = load(str(setup.config), str(setup.state))

    def counted() -> dict[str, object] | None:
        for e in events.read(setup.state):
            if e.get("event") == "call" and e.get("model") == "stalled" and e.get("client_gone"):
                return e
        return None

    e = wait_until(counted, 30.0, "the hung-up stream's call event")
    assert e["ok"] is True and e["tokens_out"] >= 1
    key = f"openai:{setup.stalling.base_url}:m-stall"
    spent = ledger.read(settings).spend_usd.get(key, 0.0)
    assert spent == pytest.approx(e["cost_usd"])  # settled: no reservation left over
    assert 0 < spent < 0.033


def test_a_streamed_answer_is_counted_with_the_upstreams_usage(setup: Setup) -> None:
    c = oa(setup.gateway)
    before = hits(setup.upstream, "m-plain")
    stream = c.chat.completions.create(model="plain", messages=MSG, stream=True)  # type: ignore[arg-type]
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == "fine"
    assert hits(setup.upstream, "m-plain") == before + 1

    def counted() -> dict[str, float] | None:  # the stream's end is counted after its last byte
        row = ledger.read(settings).usage.get("task", {}).get("plain")
        return row if row is not None and row["calls"] == before + 1 else None

    settings = load(str(setup.config), str(setup.state))
    wait_until(counted, 30.0, "the streamed call in the ledger")
    out = setup.cli("status", "--json")
    row = json.loads(out.stdout)["usage"]["by_task"]["plain"]
    assert row["calls"] == before + 1
    assert row["tokens_in"] == OK_TOKENS_IN * (before + 1)
    assert row["cost_usd"] == pytest.approx(CALL_USD * (before + 1))


def test_the_ollama_api_refuses_in_its_own_shape(setup: Setup) -> None:
    c = ollama.Client(host=setup.gateway.url)
    for _ in range(2):
        assert c.chat(model="ollama-limited", messages=MSG).message.content == "fine"
    with pytest.raises(ollama.ResponseError) as info:
        c.chat(model="ollama-limited", messages=MSG)
    assert info.value.status_code == 429
    assert "rate limit: 2 requests in the last minute (of 2)" in info.value.error
    raw = setup.gateway.request(
        "POST", "/api/generate", body={"model": "ollama-limited", "prompt": "x", "stream": False}
    )
    assert raw.status == 429
    body = raw.json()
    assert list(body) == ["error"] and isinstance(body["error"], str)


def test_over_budget_serve_falls_back_to_the_local_candidate_as_get_model_does(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)  # what serve has: get_model must see the same
    c = oa(setup.gateway)
    first = c.chat.completions.with_raw_response.create(model="spills", messages=MSG)  # type: ignore[arg-type]
    assert first.headers["x-gpulock-tier"] == "cloud"  # $0.033 reserved of its $0.04; $0.014 spent
    # get_model, calling now, cannot reserve another $0.033 and falls back to the local
    # candidate...
    m = router.get_model("spills", config=str(setup.config), state_dir=str(setup.state))
    try:
        m.chat(MSG, max_tokens=2)
        assert m.tier == "cpu"
        assert "small-budget: daily budget: $0.0140 spent on this host today" in m.why
    finally:
        m.close()
    # ...and so does serve, with no 429.
    for _ in range(2):
        r = c.chat.completions.with_raw_response.create(model="spills", messages=MSG)  # type: ignore[arg-type]
        assert r.headers["x-gpulock-tier"] == "cpu"
    assert hits(setup.upstream, "m-spill") == 1


def test_serves_calls_reach_status_explain_report_and_metrics(setup: Setup) -> None:
    c = oa(setup.gateway)
    c.chat.completions.create(model="plain", messages=MSG)  # type: ignore[arg-type]
    # What the earlier tests spent, whatever order they ran in: each cloud model's hits.
    models = ("m-plain", "m-budget", "m-rate", "m-rate-ollama", "m-spill", "m-burst", "m-crowd")
    paid = {m: hits(setup.upstream, m) for m in models}
    # ...and a stream a client left, counted at what it got (its own test, when it ran).
    cut = [
        e
        for e in events.read(setup.state)
        if e.get("event") == "call" and e.get("model") == "stalled" and e.get("ok")
    ]
    total = sum(paid.values()) * CALL_USD + sum(e["cost_usd"] for e in cut)

    out = setup.cli("status", "--json")
    assert out.returncode == 0, out.stderr
    usage = json.loads(out.stdout)["usage"]
    assert usage is not None, "serve's calls are missing from gpulock status"
    assert usage["cloud_spend_usd"] == pytest.approx(total, abs=1e-6)
    assert usage["by_tier"]["cloud"]["calls"] == sum(paid.values()) + len(cut)
    assert usage["by_agent"]["gpulock-serve"]["calls"] >= sum(paid.values())
    assert usage["by_task"]["plain"]["cost_usd"] == pytest.approx(paid["m-plain"] * CALL_USD)

    out = setup.cli("route", "plain", "--explain")
    assert f"cloud, ${paid['m-plain'] * CALL_USD:.4f} spent today" in out.stdout, out.stdout

    out = setup.cli("report", "--json")
    assert out.returncode == 0, out.stderr
    totals = json.loads(out.stdout)["totals"]
    assert totals["cost_usd"] == pytest.approx(total, abs=1e-6)

    r = setup.gateway.request("GET", "/metrics")
    assert r.status == 200
    text = r.body.decode()
    promtool_check(text)
    samples = parse(text)
    got = value(samples, "gpulock_router_cost_usd_total", task="plain", tier="cloud", model="plain")
    assert got == pytest.approx(paid["m-plain"] * CALL_USD)
    calls = value(
        samples,
        "gpulock_router_calls_total",
        task="plain",
        tier="cloud",
        model="plain",
        outcome="ok",
        host="",  # the cluster host that ran it: none without a cluster
    )
    assert calls == paid["m-plain"]


# --- serve and agents in their own processes, on one budget and one rate limit, at once -------

AGENT = """\
import sys
from gpulock import router
m = router.get_model(sys.argv[1], agent=sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()  # go
ok = 0
try:
    while True:
        m.chat([{"role": "user", "content": "hello"}])
        ok += 1
except router.NoModelAvailable:
    pass
print(ok)
"""


def crowd(setup: Setup, task: str, agents: int, clients: int) -> tuple[int, int]:
    """``agents`` processes calling ``get_model(task)`` and ``clients`` HTTP clients of serve,
    all starting together, each calling until refused: (calls served by serve, by agents)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", AGENT, task, f"agent-{i}"],
            env={**os.environ, **setup.env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(agents)
    ]
    served = [0] * clients
    go = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        c = oa(setup.gateway)
        go.wait()
        try:
            while True:
                c.chat.completions.create(model=task, messages=MSG)  # type: ignore[arg-type]
                served[i] += 1
        except openai.RateLimitError:
            pass

    for p in procs:  # every agent has its model (chosen now, as the limits stand) ...
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready", p.stderr
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    go.wait()  # ... when all start together
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    for t in threads:
        t.join(120)
    by_agents = 0
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        by_agents += int(out.strip().splitlines()[-1])
    return sum(served), by_agents


def test_serve_and_agents_spend_one_budget_at_once_never_past_it_and_to_its_end(
    setup: Setup,
) -> None:
    # Serve takes its reservations in blocks (several calls' worth ahead while much is left,
    # held as spent for everyone else); agents in their own processes reserve call by call.
    by_serve, by_agents = crowd(setup, "shared", agents=3, clients=6)
    assert by_serve > 0 and by_agents > 0
    assert hits(setup.upstream, "m-shared") == by_serve + by_agents
    settings = load(str(setup.config), str(setup.state))
    key = f"openai:{setup.upstream.base_url}:m-shared"
    spent = ledger.read(settings).spend_usd[key]
    # Serve is idle: nothing is held any more; what is spent is what the calls cost.
    assert spent == pytest.approx((by_serve + by_agents) * CALL_USD)
    assert spent <= SHARED_BUDGET + CALL_USD  # never past it by more than one call's cost
    # Usable to its last call: what the crowd left (refused while others' calls were under
    # way) is spent by serve alone now, until the next call's reservation cannot fit.
    more, _ = calls(setup.gateway, "shared", 30)
    spent = ledger.read(settings).spend_usd[key]
    assert spent == pytest.approx((by_serve + by_agents + more) * CALL_USD)
    assert SHARED_BUDGET - 0.033 < spent <= SHARED_BUDGET  # >= 90 %: 96.7 % at least


def test_serve_and_agents_share_one_rate_limit_at_once(setup: Setup) -> None:
    start = time.monotonic()
    by_serve, by_agents = crowd(setup, "shared-rate", agents=3, clients=6)
    # Serve takes slots in blocks (never more than an eighth of those left): the minute's
    # window still lets exactly the limit through, whoever asks.  Every caller stops at its
    # first refusal, so that is exactly the limit within one minute; a crowd slowed past a
    # minute (a loaded machine) may be let through once more per minute it spans, never more.
    minutes = 1 + int((time.monotonic() - start) // 60)
    assert SHARED_RATE <= by_serve + by_agents <= SHARED_RATE * minutes
    assert hits(setup.upstream, "m-shared-rate") == by_serve + by_agents
