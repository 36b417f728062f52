"""The cloud tier for real: the official openai client against real local HTTP servers.

The "cloud" is llama.cpp's own OpenAI-compatible server on the tiny model (started once for
the module, with an API key it checks), and ``FaultServer`` answers 429, 500, a hang or a
canned success, as each test sets it.  What is proved: complete, chat and streaming through
the API with their tokens and cost counted; fallback along the list on each failure; the
cooldown written to the ledger, honoured by the next ``get_model`` of another process,
doubled for failures in a row and cleared by a success; budgets and rate limits; and that the
API key never reaches an event, the ledger, the CLI's output or an exception's text.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
from procs import World, wait_until
from router_servers import OK_TOKENS_IN, OK_TOKENS_OUT, FaultServer, LlamaServer, free_port

from gpulock import router
from gpulock.core.settings import Settings
from gpulock.router import ledger

pytest.importorskip("openai")
pytest.importorskip("llama_cpp.server.app")

KEY_ENV = "GPULOCK_TEST_API_KEY"
# Recognisable keys: the leak test greps for them everywhere.
SECRET = "sk-test-7f3c9a51d2e84b60b1f4c0de5eed9a11"  # noqa: S105
OTHER_ENV = "GPULOCK_TEST_WRONG_KEY"
OTHER_SECRET = "sk-wrong-0b9e2f6a73d14c58a9e0c7b3d2f1e4aa"  # noqa: S105
PRICE_IN, PRICE_OUT = 0.5, 2.0  # USD per 1000 tokens: large, so that the sums are visible


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    from gpulock.router.tiny_model import ensure_tiny_llama

    folder = tmp_path_factory.mktemp("cloud")
    server = LlamaServer(ensure_tiny_llama(folder), folder / "server.log", api_key=SECRET)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fault() -> Iterator[FaultServer]:
    f = FaultServer().start()
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture(autouse=True)
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)
    monkeypatch.setenv(OTHER_ENV, OTHER_SECRET)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


def configure(world: World, routes: str, router_section: str = "") -> Settings:
    text = "routes:\n" + textwrap.indent(textwrap.dedent(routes).strip("\n") + "\n", "  ")
    if router_section:
        text = "router:\n" + textwrap.indent(textwrap.dedent(router_section), "  ") + text
    world.config.write_text(text)
    return world.settings()


def cloud(
    name: str, base_url: str, *, key_env: str = KEY_ENV, extra: str = "", model: str = "tiny"
) -> str:
    return (
        f"- {{backend: openai, name: {name}, model: {model}, base_url: '{base_url}', "
        f"api_key_env: {key_env}, price: {{input: {PRICE_IN}, output: {PRICE_OUT}}}{extra}}}\n"
    )


def cost(tokens_in: int, tokens_out: int) -> float:
    return (tokens_in * PRICE_IN + tokens_out * PRICE_OUT) / 1000


def cooldown_of(s: Settings, base_url: str) -> dict[str, Any] | None:
    cools = ledger.read(s).cooldowns
    return next((c for k, c in cools.items() if base_url in k), None)


def gpulock(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command, in another process, with this test's environment."""
    return subprocess.run(
        [sys.executable, "-m", "gpulock", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- the happy path: complete, chat, stream, and what they cost -----------------------------------


def test_complete_chat_and_stream_are_counted_and_priced(
    world: World, llama_server: LlamaServer
) -> None:
    s = configure(
        world,
        "t:\n" + cloud("remote", llama_server.base_url, extra=", rate_limit: 100"),
        "daily_budget: 5\n",
    )
    m = router.get_model("t", agent="digest-bot")
    assert (m.tier, m.name, m.candidate.policy) == ("cloud", "remote", "api-fallback")
    assert m.why == "t: cloud remote (routes.t[0]): cloud, $0.0000 spent today"
    text = m.complete("hello", max_tokens=5)
    assert 0 < len(text) <= 5
    reply = m.chat([{"role": "user", "content": "hi"}], max_tokens=4)
    assert 0 < len(reply) <= 4
    pieces = list(m.complete("hello", max_tokens=3, stream=True))
    chat_pieces = list(m.chat([{"role": "user", "content": "hi"}], max_tokens=3, stream=True))
    assert len(pieces) == 3 and len(chat_pieces) == 3

    calls = world.events("call", task="t")
    assert [(c["tier"], c["model"], c["ok"]) for c in calls] == [("cloud", "remote", True)] * 4
    # the server's usage: "hello" is <s> + "▁" + 5 bytes; the chat prompt the template's text
    assert [(c["tokens_in"], c["tokens_out"]) for c in calls[:2]] == [(7, 5), (21, 4)]
    # llama.cpp's server sends no usage when streaming: the pieces are counted
    assert [c["tokens_out"] for c in calls[2:]] == [3, 3]
    total = 0.0
    for c in calls:
        assert c["cost_usd"] == pytest.approx(cost(c["tokens_in"], c["tokens_out"]))
        total += c["cost_usd"]
    led = ledger.read(s)
    (spent,) = led.spend_usd.values()
    assert spent == pytest.approx(total)
    (requests,) = led.requests_last_min(time.time()).values()
    assert requests == 4  # what the rate limit counts
    assert led.usage["agent"]["digest-bot"]["calls"] == 4
    assert led.usage["tier"]["cloud"]["cost_usd"] == pytest.approx(total)

    out = gpulock("status", "--json")
    assert out.returncode == 0, out.stderr
    usage = json.loads(out.stdout)["usage"]
    assert usage["cloud_spend_usd"] == pytest.approx(total, abs=1e-6)
    assert usage["daily_budget_usd"] == 5.0
    assert usage["by_tier"]["cloud"]["calls"] == 4
    assert usage["by_task"]["t"]["tokens_out"] == 5 + 4 + 3 + 3
    assert usage["by_agent"]["digest-bot"]["tokens_in"] == sum(c["tokens_in"] for c in calls)
    assert router.get_model("t").why.endswith(f"cloud, ${total:.4f} spent today")


def test_streaming_asks_for_usage_and_counts_the_prompt(world: World, fault: FaultServer) -> None:
    # OpenAI sends usage in a stream only when asked (stream_options.include_usage)
    fault.mode = "ok"
    configure(world, "t:\n" + cloud("remote", fault.base_url))
    m = router.get_model("t")
    assert "".join(m.complete("hello", stream=True)) == "fine"
    assert "".join(m.chat([{"role": "user", "content": "hi"}], stream=True)) == "fine"
    assert [h.body.get("stream_options") for h in fault.hits] == [{"include_usage": True}] * 2
    calls = world.events("call")
    assert [(c["tokens_in"], c["tokens_out"]) for c in calls] == [(OK_TOKENS_IN, OK_TOKENS_OUT)] * 2
    assert calls[0]["cost_usd"] == pytest.approx(cost(OK_TOKENS_IN, OK_TOKENS_OUT))


# --- failures: fallback and cooldowns -------------------------------------------------------------


def test_429_falls_back_and_the_retry_after_cools_it_down_for_other_processes(
    world: World, llama_server: LlamaServer, fault: FaultServer
) -> None:
    fault.mode, fault.retry_after = "429", "7"
    s = configure(
        world, "t:\n" + cloud("flaky", fault.base_url) + cloud("steady", llama_server.base_url)
    )
    m = router.get_model("t")
    assert m.name == "flaky"
    before = time.time()
    text = m.complete("hello", max_tokens=3)
    assert text and m.name == "steady"
    assert m.fallbacks == ["flaky: rate-limit (HTTP 429)"]
    assert "fell back from: flaky: rate-limit (HTTP 429)" in m.why
    assert fault.count("/completions") == 1  # the client's own retries are off
    cool = cooldown_of(s, fault.base_url)
    assert cool is not None
    assert (cool["reason"], cool["failures"]) == ("rate-limit (HTTP 429)", 1)
    assert 6.0 <= cool["until_wall"] - before <= 9.0  # the server's Retry-After, not 60 s
    failed, ok = world.events("call")
    assert (failed["ok"], failed["error"], failed["cooldown_s"]) == (
        False,
        "rate-limit (HTTP 429)",
        7.0,
    )
    assert (ok["ok"], ok["model"]) == (True, "steady")
    (fb,) = world.events("fallback")
    assert (fb["from_model"], fb["to_model"]) == ("flaky", "steady")

    # another process's get_model (here the CLI's, which makes the same choice) skips it
    out = gpulock("route", "t", "--json")
    assert out.returncode == 0, out.stderr
    choice = json.loads(out.stdout)
    assert choice["chosen"]["name"] == "steady"
    flaky = choice["candidates"][0]
    assert flaky["ok"] is False
    assert flaky["reason"].startswith("cooling down after errors for ")
    assert flaky["reason"].endswith("more (last: rate-limit (HTTP 429))")
    # and so does the next handle here: no request reaches the faulty server
    again = router.get_model("t")
    assert again.name == "steady"
    again.complete("x", max_tokens=2)
    assert fault.count() == 1


def test_failures_in_a_row_double_the_cooldown_and_a_success_clears_it(
    world: World, llama_server: LlamaServer, fault: FaultServer
) -> None:
    fault.mode = "500"
    s = configure(
        world,
        "t:\n" + cloud("flaky", fault.base_url) + cloud("steady", llama_server.base_url),
        "cooldown: 300ms\n",
    )

    def flaky_fits() -> bool:
        c = router.explain("t").chosen
        return c is not None and c.candidate.name == "flaky"

    lengths = []
    for n in (1, 2, 3):
        wait_until(flaky_fits, 10, "the cooldown to end")
        m = router.get_model("t")
        assert m.complete("x", max_tokens=2) and m.name == "steady"
        failed = world.events("call", ok=False)[-1]
        assert failed["error"] == "server (HTTP 500)"
        lengths.append(failed["cooldown_s"])
        cool = cooldown_of(s, fault.base_url)
        assert cool is not None and cool["failures"] == n
    assert lengths == [0.3, 0.6, 1.2]

    wait_until(flaky_fits, 10, "the cooldown to end")
    fault.mode = "ok"
    m = router.get_model("t")
    assert m.complete("x") == "fine" and m.name == "flaky"
    assert cooldown_of(s, fault.base_url) is None  # a success ends the failures in a row

    fault.mode = "500"
    router.get_model("t").complete("x", max_tokens=2)
    assert world.events("call", ok=False)[-1]["cooldown_s"] == 0.3  # counting from one again


def test_a_handle_whose_call_found_nothing_tries_again_after_the_cooldown(
    world: World, fault: FaultServer
) -> None:
    fault.mode = "500"
    s = configure(world, "t:\n" + cloud("only", fault.base_url), "cooldown: 300ms\n")
    m = router.get_model("t")
    with pytest.raises(router.NoModelAvailable, match="failed on this call already"):
        m.complete("x")
    with pytest.raises(router.NoModelAvailable, match="cooling down after errors"):
        m.complete("x")  # the same handle, judged again: the cooldown, not a stale failure
    assert fault.count() == 1
    cool = cooldown_of(s, fault.base_url)
    assert cool is not None
    wait_until(lambda: time.time() > cool["until_wall"], 10, "the cooldown to end")
    fault.mode = "ok"
    assert m.complete("x") == "fine" and m.name == "only"


def test_a_hang_past_the_timeout_falls_back(
    world: World, llama_server: LlamaServer, fault: FaultServer
) -> None:
    fault.mode = "hang"
    s = configure(
        world,
        "t:\n"
        + cloud("stuck", fault.base_url, extra=", timeout: 500ms")
        + cloud("steady", llama_server.base_url),
    )
    fault.hang_s = 3600.0  # the upstream never answers within the test: only the timeout can
    m = router.get_model("t")
    done: list[str] = []
    call = threading.Thread(target=lambda: done.append(m.complete("hello", max_tokens=2)))
    call.daemon = True
    call.start()
    call.join(60)  # "eventually": it falls back at all, however loaded the machine
    assert done and done[0], "the call never fell back from the hanging upstream"
    failed = world.events("call", ok=False)[0]
    assert failed["error"] == "timeout"
    assert 0.4 <= failed["latency_s"] < 10
    cool = cooldown_of(s, fault.base_url)
    assert cool is not None and cool["reason"] == "timeout"


def test_a_refused_connection_and_a_5xx_stream_fall_back(
    world: World, llama_server: LlamaServer, fault: FaultServer
) -> None:
    fault.mode = "500"
    closed = f"http://127.0.0.1:{free_port()}/v1"  # nobody listens there
    configure(
        world,
        "t:\n"
        + cloud("nowhere", closed)
        + cloud("flaky", fault.base_url)
        + cloud("steady", llama_server.base_url),
    )
    m = router.get_model("t")
    pieces = list(m.chat([{"role": "user", "content": "hi"}], max_tokens=3, stream=True))
    assert len(pieces) == 3 and m.name == "steady"
    assert m.fallbacks == ["nowhere: connection", "flaky: server (HTTP 500)"]
    assert [f["to_model"] for f in world.events("fallback")] == ["flaky", "steady"]


def test_a_request_the_server_refuses_falls_back_without_cooling_the_endpoint_down(
    world: World, llama_server: LlamaServer, fault: FaultServer
) -> None:
    # HTTP 400 blames this request (its keywords), not the endpoint: the next agent's request
    # may be fine, so nobody is kept off it; a 500 does cool it down.
    s = configure(
        world, "t:\n" + cloud("picky", fault.base_url) + cloud("steady", llama_server.base_url)
    )
    fault.mode = "400"
    m = router.get_model("t")
    assert m.complete("hi", max_tokens=2) and m.name == "steady"
    assert m.fallbacks == ["picky: client (HTTP 400)"]
    assert ledger.read(s).cooldowns == {}
    assert router.get_model("t").name == "picky"  # still first in line
    fault.mode = "500"
    router.get_model("t").complete("hi", max_tokens=2)
    assert [c["reason"] for c in ledger.read(s).cooldowns.values()] == ["server (HTTP 500)"]


def test_a_stream_that_breaks_off_is_not_completed_by_another_model(
    world: World, llama_server: LlamaServer, fault: FaultServer
) -> None:
    fault.mode = "break"  # the first piece, then the connection drops
    s = configure(
        world, "t:\n" + cloud("flaky", fault.base_url) + cloud("steady", llama_server.base_url)
    )
    got = []
    with pytest.raises(router.NoModelAvailable) as info:
        for piece in router.get_model("t").complete("hello", stream=True):
            got.append(piece)
    assert got == ["fi"]
    assert str(info.value).splitlines()[0] == (
        "the answer for task 't' broke off mid-stream (connection)"
    )
    (failed,) = world.events("call")
    assert (failed["ok"], failed["model"], failed["error"]) == (False, "flaky", "connection")
    assert world.events("fallback") == []  # half an answer: no other model takes over
    cool = cooldown_of(s, fault.base_url)
    assert cool is not None and cool["reason"] == "connection"


def test_a_wrong_key_is_a_client_error_and_falls_back(
    world: World, llama_server: LlamaServer
) -> None:
    configure(
        world,
        "t:\n"
        + cloud("wrong-key", llama_server.base_url, key_env=OTHER_ENV)
        + cloud("right-key", llama_server.base_url, model="tiny-2"),
    )
    m = router.get_model("t")
    assert m.complete("x", max_tokens=2) and m.name == "right-key"
    assert m.fallbacks == ["wrong-key: client (HTTP 401)"]


# --- budgets, rate limits, keys -------------------------------------------------------------------


def test_a_spent_daily_budget_moves_to_the_next_candidate(
    world: World, llama_server: LlamaServer, fault: FaultServer
) -> None:
    fault.mode = "ok"
    configure(
        world,
        "t:\n"
        + cloud("capped", fault.base_url, extra=", daily_budget: 0.011, max_tokens: 3")
        + cloud("steady", llama_server.base_url),
    )
    # Reserved: "x" as 9 tokens (a byte, and a template's 8) + 3 out, $0.0105; billed: the
    # server's template makes it 11 in + 3 out, $0.0115.
    assert router.get_model("t").complete("x") == "fine"
    m = router.get_model("t")
    assert m.name == "steady"
    assert "rejected: cloud capped (routes.t[0]): daily budget spent: $0.0115 of $0.011 today" in (
        m.why
    )


def test_a_handle_kept_between_calls_stops_at_the_budget(
    world: World, llama_server: LlamaServer, fault: FaultServer
) -> None:
    # An agent that asks once and calls all day must not spend past the budget with that handle.
    fault.mode = "ok"
    configure(
        world,
        "t:\n"
        + cloud("capped", fault.base_url, extra=", daily_budget: 0.011, max_tokens: 3")
        + cloud("steady", llama_server.base_url),
    )
    m = router.get_model("t")
    assert m.complete("x") == "fine" and m.name == "capped"  # $0.0115: the budget is spent
    text = m.complete("x", max_tokens=2)
    assert m.name == "steady" and isinstance(text, str)
    assert fault.count("/completions") == 1  # the capped endpoint was not called again
    assert m.fallbacks == ["capped: daily budget spent: $0.0115 of $0.011 today"]
    assert "rejected: cloud capped (routes.t[0]): daily budget spent" in m.why
    (fb,) = world.events("fallback")
    assert (fb["from_model"], fb["to_model"]) == ("capped", "steady")
    assert cooldown_of(world.settings(), fault.base_url) is None  # not the endpoint's fault


def test_the_routers_daily_budget_covers_every_cloud_candidate(
    world: World, fault: FaultServer
) -> None:
    fault.mode = "ok"
    configure(
        world,
        "t:\n"
        + cloud("a", fault.base_url, extra=", max_tokens: 3")
        + cloud("b", fault.base_url, model="other", extra=", max_tokens: 3"),
        "daily_budget: 0.011\n",  # holds the call's reservation ($0.0105), not its cost
    )
    assert router.get_model("t").complete("x") == "fine"
    with pytest.raises(router.NoModelAvailable) as info:
        router.get_model("t")
    reasons = [why for _key, _name, _tier, why in info.value.reasons]
    assert reasons == ["cloud budget spent: $0.0115 of $0.011 today (router.daily_budget)"] * 2


def test_a_rate_limit_counts_requests_across_processes(world: World, fault: FaultServer) -> None:
    fault.mode = "ok"
    configure(world, "t:\n" + cloud("limited", fault.base_url, extra=", rate_limit: 2"))
    code = "from gpulock import router; print(router.get_model('t').complete('x'))"
    for _ in range(2):  # two other processes use it...
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        assert out.stdout.strip() == "fine", out.stderr
    with pytest.raises(router.NoModelAvailable) as info:  # ...so this one may not
        router.get_model("t")
    assert "rate limit: 2 requests in the last minute (of 2)" in str(info.value)


def test_a_missing_key_variable_is_rejected_naming_its_key(
    world: World, llama_server: LlamaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV)
    configure(world, "t:\n" + cloud("remote", llama_server.base_url))
    with pytest.raises(router.NoModelAvailable) as info:
        router.get_model("t")
    assert info.value.reasons == [
        (
            "routes.t[0]",
            "remote",
            "cloud",
            f"environment variable {KEY_ENV} is not set (routes.t[0].api_key_env)",
        )
    ]
    monkeypatch.setenv(KEY_ENV, "")  # set but empty counts as missing
    with pytest.raises(router.NoModelAvailable):
        router.get_model("t")


# --- the key never leaks --------------------------------------------------------------------------


def test_the_api_key_never_reaches_events_ledger_output_or_errors(
    world: World, llama_server: LlamaServer, fault: FaultServer
) -> None:
    fault.mode = "500"  # its error bodies echo the Authorization header back
    closed = f"http://127.0.0.1:{free_port()}/v1"
    s = configure(
        world,
        "t:\n"
        + cloud("flaky", fault.base_url)
        + cloud("wrong", llama_server.base_url, key_env=OTHER_ENV)
        + cloud("steady", llama_server.base_url, model="tiny-2"),
        "daily_budget: 100\n",
    )
    texts: list[str] = []
    m = router.get_model("t")
    texts.append(m.complete("hello", max_tokens=2))
    texts.append("".join(m.chat([{"role": "user", "content": "hi"}], max_tokens=2, stream=True)))
    texts.append(m.why)
    # every candidate fails: the error and its whole printed traceback (cooldowns of 1 ms,
    # so that each round tries them all again)
    fault.mode = "429"
    configure(
        world,
        "t:\n"
        + cloud("flaky2", fault.base_url)
        + cloud("stuck", closed)
        + cloud("wrong2", llama_server.base_url, key_env=OTHER_ENV),
        "cooldown: 1ms\n",
    )
    for stream in (False, True):
        with pytest.raises(router.NoModelAvailable) as info:
            m2 = router.get_model("t")
            if stream:
                list(m2.complete("x", stream=True))
            else:
                m2.complete("x")
        e = info.value
        assert len(e.reasons) == 3
        texts += [str(e), repr(e), e.hint or "", "".join(traceback.format_exception(e))]
    for args in (("route", "t", "--explain"), ("route", "t", "--json"), ("status", "--json")):
        out = gpulock(*args)
        texts += [out.stdout, out.stderr]
    texts.append(gpulock("status").stdout)
    texts.append((world.state / "events.jsonl").read_text())
    texts.append(ledger.path(s).read_text())

    # the keys did travel, to the servers only
    assert any(h.authorization == f"Bearer {SECRET}" for h in fault.hits)
    assert world.events("call", ok=True, model="steady")
    assert any("client (HTTP 401)" in t for t in texts)  # the wrong key was refused
    for secret in (SECRET, OTHER_SECRET):
        leaks = [t for t in texts if secret in t or secret[3:] in t]
        assert leaks == [], f"{secret} leaked into: {leaks[0][:500]}"
