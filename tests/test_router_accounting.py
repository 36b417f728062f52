"""``gpulock.router.accounting``: the one path every model call is admitted and counted by.

No model and no server: candidates from a real route table, the real ledger in a test's state
folder, threads and processes racing for a rate limit's last request.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest
from procs import World

from gpulock.core.settings import Settings
from gpulock.router import accounting, ledger
from gpulock.router.books import Books
from gpulock.router.choose import Choice, Host, Verdict, choose, cid
from gpulock.router.routes import Candidate, Table, load_table

KEY_ENV = "GPULOCK_TEST_ACCOUNTING_KEY"


def table(world: World, extra: str, router_section: str = "") -> Table:
    world.config.write_text(
        router_section
        + "routes:\n  t:\n"
        + "    - {backend: openai, name: remote, model: m, base_url: 'http://127.0.0.1:9/v1',"
        + f" api_key_env: {KEY_ENV}, price: 1.0{extra}}}\n"
        + "    - {tier: cpu, backend: llama_cpp, model: /nonexistent.gguf, name: local}\n"
    )
    return load_table(world.settings().config)


@pytest.fixture(autouse=True)
def key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-unused")


def cloud(t: Table) -> Candidate:
    return t.tasks["t"][0]


def test_admit_counts_the_request_and_refuses_past_the_rate_limit(world: World) -> None:
    t = table(world, ", rate_limit: 2")
    s, c = world.settings(), cloud(t)
    verdicts = [accounting.admit(s, t.settings, "t", c) for _ in range(3)]
    assert [v.ok for v in verdicts] == [True, True, False]
    assert verdicts[2].limit == "rate"
    assert verdicts[2].reason == "rate limit: 2 requests in the last minute (of 2)"
    assert in_window(s, c) == 2  # the refused one is not counted


def test_the_rate_window_is_kept_by_second_so_the_ledger_does_not_grow(world: World) -> None:
    # A request's time stamp each: 2,000 requests a minute grew the file (read and written
    # whole at each) to tens of kilobytes.  Counts by second keep it at one entry a second.
    t = table(world, ", rate_limit: 100000")
    s, c = world.settings(), cloud(t)
    start = time.time() - 30
    for i in range(2000):  # over the last 30 seconds
        assert accounting.admit(s, t.settings, "t", c, now_wall=start + i * 30 / 2000).ok
    assert ledger.path(s).stat().st_size < 2000
    assert ledger.read(s, now_wall=start + 30).requests_last_min(start + 30)[cid(c)] == 2000


def test_threads_racing_for_the_last_requests_get_exactly_the_limit(world: World) -> None:
    t = table(world, ", rate_limit: 3")
    s, c = world.settings(), cloud(t)
    results: list[bool] = []
    go = threading.Barrier(8)

    def one() -> None:
        go.wait()
        results.append(accounting.admit(s, t.settings, "t", c).ok)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert sorted(results) == [False] * 5 + [True] * 3


def test_processes_share_the_rate_limit(world: World) -> None:
    t = table(world, ", rate_limit: 2")
    code = (
        "import gpulock.router.accounting as a, gpulock.router.select as sel\n"
        "s, t = sel.context()\n"
        "print(a.admit(s, t.settings, 't', t.tasks['t'][0]).ok)\n"
    )
    outs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        for _ in range(3)
    ]
    assert [o.stdout.strip() for o in outs] == ["True", "True", "False"], outs[-1].stderr
    assert not accounting.admit(world.settings(), t.settings, "t", cloud(t)).ok


def test_a_spent_budget_is_refused_and_record_spends_it(world: World) -> None:
    t = table(world, ", daily_budget: 0.02, rate_limit: 100")
    s, c = world.settings(), cloud(t)
    assert accounting.admit(s, t.settings, "t", c).ok
    cost = accounting.record(
        s, c, task="t", agent="a", tokens_in=15, tokens_out=5, latency_s=0.1, via="test"
    )
    assert cost == pytest.approx(0.02)
    v = accounting.admit(s, t.settings, "t", c)
    assert (v.ok, v.limit) == (False, "budget")
    assert v.reason == "daily budget spent: $0.0200 of $0.02 today"
    led = ledger.read(s)
    assert led.spend_usd[cid(c)] == pytest.approx(0.02)
    assert led.requests_last_min(time.time())[cid(c)] == 1  # by admit, not again by record
    (e,) = world.events("call")
    assert (e["task"], e["agent"], e["tier"], e["model"], e["ok"], e["via"]) == (
        "t",
        "a",
        "cloud",
        "remote",
        True,
        "test",
    )
    assert (e["tokens_in"], e["tokens_out"], e["cost_usd"]) == (15, 5, pytest.approx(0.02))


def test_without_a_rate_limit_no_request_is_kept(world: World) -> None:
    # Nothing reads the window of an endpoint without a rate limit; keeping a time stamp a
    # request there made the ledger (read and written whole each call) grow with the traffic.
    t = table(world, ", daily_budget: 5")
    s, c = world.settings(), cloud(t)
    for _ in range(3):
        assert accounting.admit(s, t.settings, "t", c).ok
        accounting.record(s, c, task="t", agent="a", tokens_in=1, tokens_out=1, latency_s=0.0)
    led = ledger.read(s)
    assert cid(c) not in led.requests
    assert led.usage["task"]["t"]["calls"] == 3


def test_the_routers_budget_is_a_budget_limit(world: World) -> None:
    t = table(world, "", "router: {daily_budget: 0.01}\n")
    s, c = world.settings(), cloud(t)
    accounting.record(s, c, task="t", agent="a", tokens_in=10, tokens_out=0, latency_s=0.0)
    v = accounting.admit(s, t.settings, "t", c)
    assert (v.ok, v.limit) == (False, "budget")
    assert "(router.daily_budget)" in v.reason


def test_local_candidates_are_admitted_without_the_ledger(world: World) -> None:
    t = table(world, ", rate_limit: 1")
    s = world.settings()
    local = t.tasks["t"][1]
    assert all(accounting.admit(s, t.settings, "t", local).ok for _ in range(3))
    assert not ledger.path(s).exists()


def in_window(s: Settings, c: Candidate) -> int:
    """Requests of ``c`` the ledger counts in the last minute."""
    return ledger.read(s).requests_last_min(time.time()).get(cid(c), 0)


def none_left(t: Table, v_cloud_reason: str, limit: str | None) -> Choice:
    c, local = t.tasks["t"]
    verdicts = (Verdict(c, False, v_cloud_reason, limit=limit), Verdict(local, False, "no file"))
    return Choice("t", None, verdicts, "normal")


def test_refusal_says_budget_or_rate_and_when_to_retry(world: World) -> None:
    t = table(world, ", rate_limit: 2")
    s, c = world.settings(), cloud(t)
    now = time.time()
    with ledger.change(s, now_wall=now) as led:
        led.take_requests(cid(c), now - 50)
        led.take_requests(cid(c), now - 20)
    r = accounting.refusal(s, none_left(t, "rate limit: ...", "rate"), now_wall=now)
    assert r is not None and r.kind == "rate"
    # The request 50 s ago leaves the window first: at the end of the 61st second from the
    # start of the second it began in (a request is kept by whole second, never for less than
    # a minute).
    assert r.retry_after_s == pytest.approx((now - 50) // 1 + 61 - now, abs=1e-3)
    assert 10.0 < r.retry_after_s <= 11.0
    assert r.message.startswith("no model available for 't': remote: rate limit")
    r = accounting.refusal(s, none_left(t, "daily budget spent", "budget"), now_wall=now)
    assert r is not None and (r.kind, r.retry_after_s) == ("budget", None)
    assert accounting.refusal(s, none_left(t, "cooling down", None), now_wall=now) is None
    # An admit refusal on this call stands for the choice's "failed on this call" verdict.
    refused = {cid(c): choose("t", [c], _host_over_rate(c, now)).verdicts[0]}
    r = accounting.refusal(s, none_left(t, "failed on this call already", None), refused)
    assert r is not None and r.kind == "rate"


def _host_over_rate(c: Candidate, now: float) -> Host:
    return Host(env=frozenset({KEY_ENV}), requests_last_min={cid(c): 5}, now_wall=now)


def record_burst(rec: Books, c: Candidate, n: int) -> None:
    for _ in range(n):
        rec.record(c, task="t", agent="a", tokens_in=1, tokens_out=1, latency_s=0.0, via="serve")


def calls_in_ledger(world: World) -> int:
    usage = ledger.read(world.settings()).usage
    return int(usage.get("task", {}).get("t", {}).get("calls", 0))


def test_serves_books_gather_a_burst_into_one_ledger_write_and_lose_none(world: World) -> None:
    t = table(world, "")
    s, c = world.settings(), cloud(t)

    async def burst() -> tuple[int, int]:
        # A window far longer than the burst takes, even on a loaded machine: only the
        # loop's timer writes them, in one locked change.
        books = Books(s, t.settings, every_s=1.0)
        record_burst(books, c, 50)
        written_at_once = calls_in_ledger(world)
        seen = books.view().usage["task"]["t"]["calls"]  # this process counts them at once
        deadline = time.monotonic() + 30
        while calls_in_ledger(world) < 50 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the loop's timer writes them
        assert books.writes == 2
        return written_at_once, int(seen)

    assert asyncio.run(burst()) == (1, 50)  # the first at once, the other 49 in one change
    assert calls_in_ledger(world) == 50
    assert len(world.events("call")) == 50  # every call event


def test_serves_books_flush_what_waits_and_spend_a_budget_at_once(world: World) -> None:
    t = table(world, "")
    s, c = world.settings(), cloud(t)
    books = Books(s, t.settings, every_s=3600)

    async def burst() -> int:
        record_burst(books, c, 5)
        return calls_in_ledger(world)

    assert asyncio.run(burst()) == 1  # the first at once; the rest wait on the timer (an hour)
    books.flush()  # as serve does when it stops
    assert calls_in_ledger(world) == 5
    record_burst(books, c, 1)  # outside an event loop: nothing to wait on, written at once
    assert calls_in_ledger(world) == 6
    t = table(world, ", daily_budget: 5")
    books = Books(s, t.settings, every_s=3600)
    budgeted = cloud(t)

    async def spend() -> int:
        record_burst(books, budgeted, 3)  # a budget is judged from the file: no waiting
        return calls_in_ledger(world)

    assert asyncio.run(spend()) == 9


def test_serves_books_see_what_other_processes_write(world: World) -> None:
    """A cooldown an agent writes to the file shows in serve's view once the view looks again
    (``look_s``); the calls serve has not written yet stay counted in it meanwhile."""
    t = table(world, "")
    s, c = world.settings(), cloud(t)
    now = [0.0]
    books = Books(s, t.settings, every_s=3600, look_s=1.0, clock=lambda: now[0])

    async def run() -> None:
        record_burst(books, c, 1)  # the first, written at once
        record_burst(books, c, 1)  # the second waits
        assert books.view().cooldown_until() == {}
        ledger.record_failure(s, cid(c), reason="HTTP 429", base_s=60, max_s=600)
        assert books.view().cooldown_until() == {}  # not looked at again yet
        now[0] += 1.0
        view = books.view()
        assert cid(c) in view.cooldown_until()
        assert view.usage["task"]["t"]["calls"] == 2  # its own, one not yet written, both there
        assert calls_in_ledger(world) == 1
        books.flush()

    asyncio.run(run())
    assert calls_in_ledger(world) == 2


def test_peek_reads_the_ledger_again_only_when_it_changed(world: World) -> None:
    t = table(world, "")
    s, c = world.settings(), cloud(t)
    accounting.record(s, c, task="t", agent="a", tokens_in=1, tokens_out=1, latency_s=0.0)
    first = ledger.peek(s)
    assert ledger.peek(s) is first  # unchanged: the parsed ledger is reused
    accounting.record(s, c, task="t", agent="a", tokens_in=1, tokens_out=1, latency_s=0.0)
    again = ledger.peek(s)
    assert again is not first and again.usage["task"]["t"]["calls"] == 2
    tomorrow = time.time() + 86400
    assert ledger.peek(s, now_wall=tomorrow).usage == {}  # a new day: yesterday's is dropped
