"""What a busy process holds ahead of its calls (``gpulock.router.allowance``), and serve's books
meeting the shared ledger with it (``gpulock.router.books``).

The sizing rules are pure and checked as tables; the books run against a real ledger file in
a test's state folder, with the wall clock injected (a second that does not pass unless the
test moves it), and read back by this process as another process would (``ledger.read``,
``accounting.admit``, ``budget.reserve``: the per-call path every agent takes).
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from procs import World

from gpulock.router import accounting, allowance, budget, ledger
from gpulock.router.allowance import Demand, Hold
from gpulock.router.books import Books
from gpulock.router.choose import Verdict, cid
from gpulock.router.routes import Candidate, Table, load_table

KEY_ENV = "GPULOCK_TEST_ALLOWANCE_KEY"
PRICE = 1.0  # USD per 1000 tokens, both ways: a call of 3 tokens in and 2 out costs $0.005


@pytest.fixture(autouse=True)
def key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-unused")


def table(world: World, extra: str, router_section: str = "") -> Table:
    world.config.write_text(
        router_section
        + "routes:\n  t:\n"
        + "    - {backend: openai, name: remote, model: m, base_url: 'http://127.0.0.1:9/v1',"
        + f" api_key_env: {KEY_ENV}, price: {PRICE}{extra}}}\n"
    )
    return load_table(world.settings().config)


# --- the sizing rules ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limit", "used", "wanted", "block"),
    [
        (1000, 0, 50, 50),  # what is wanted, well within a share of what is left
        (1000, 0, 500, 125),  # never more than an eighth of the slots left
        (1000, 990, 50, 1),  # near the end: one at a time
        (2, 0, 5, 1),
        (2, 1, 5, 1),
        (2, 2, 5, 0),  # full: none
        (60, 70, 1, 0),  # fuller than full (another process's block, a lowered limit)
    ],
)
def test_a_block_of_slots_is_what_is_wanted_never_more_than_a_share_of_what_is_left(
    limit: int, used: int, wanted: int, block: int
) -> None:
    assert allowance.slots_block(limit, used, wanted) == block


@pytest.mark.parametrize(
    ("need", "left", "wanted", "ahead"),
    [
        (1.0, 100.0, 11.0, 10.0),  # ten calls like this one, wanted and well within a share
        (1.0, 100.0, 30.0, 12.0),  # an eighth of the 99 left after this call: 12 whole calls
        (1.0, 100.0, 11.5, 10.0),  # whole calls only: half a call would serve nobody
        (1.0, 9.0, 5.0, 1.0),  # 8 left after it: one call ahead
        (1.0, 8.9, 5.0, 0.0),  # less: nothing ahead
        (1.0, None, 5.0, 4.0),  # no budget at all (a rate limit's candidate): what is wanted
        (1.0, 100.0, 1.0, 0.0),  # nothing wanted beyond this call
    ],
)
def test_budget_ahead_is_whole_calls_never_more_than_a_share_of_what_is_left(
    need: float, left: float | None, wanted: float, ahead: float
) -> None:
    assert allowance.usd_ahead(need, left, wanted) == pytest.approx(ahead)


def test_a_budget_is_tight_when_what_is_left_after_a_call_holds_no_whole_call_ahead() -> None:
    assert not allowance.tight(1.0, 9.0)
    assert allowance.tight(1.0, 8.9)
    assert not allowance.tight(1.0, None)


def test_demand_is_last_seconds_or_twice_this_seconds_once_a_block_ran_out() -> None:
    d = Demand()
    assert d.wanted(100, block_ran_out=False) == 0
    for _ in range(7):
        d.add(100, 1)
    assert d.wanted(100, block_ran_out=True) == 14  # ran out within the second: twice as many
    assert d.wanted(101, block_ran_out=False) == 7  # the next second: the last one's
    d.add(101, 1)
    assert d.wanted(103, block_ran_out=False) == 0  # a quiet second between: nothing ahead


def test_a_hold_settles_into_its_block_and_forgets_yesterdays_reservations() -> None:
    h = Hold(free_usd=1.0, day="2026-11-26", day_end_wall=1e12)
    assert h.settle("2026-11-26", 0.5, 0.2) == 0.0  # 0.3 unused: back into the block
    assert h.free_usd == pytest.approx(1.3)
    assert h.settle("2026-11-26", 0.5, 1.5) == 0.0  # 1.0 past its reservation: the block pays
    assert h.free_usd == pytest.approx(0.3)
    assert h.settle("2026-11-26", 0.5, 1.2) == pytest.approx(0.4)  # past the block: owed now
    assert h.free_usd == 0.0
    assert h.settle("2026-11-25", 0.5, 0.0) == 0.0  # yesterday's: today's ledger never had it
    h.give_back("2026-11-25", 0.5)
    assert h.free_usd == 0.0
    h.give_back("2026-11-26", 0.5)  # a call that failed: its reservation back into the block
    assert h.free_usd == pytest.approx(0.5)
    h.tight = True  # near the end: what a call did not use goes back at once
    assert h.settle("2026-11-26", 0.5, 0.2) == pytest.approx(-0.8)
    assert h.free_usd == 0.0


# --- serve's books with blocks -----------------------------------------------------------------


class Clock:
    """A wall clock that moves only when told."""

    def __init__(self) -> None:
        self.now = float(int(time.time()))

    def __call__(self) -> float:
        return self.now


def one_call(books: Books, c: Candidate, need: float | None) -> bool:
    """Admit a call of ``c`` as serve does and, when admitted, count it as answered (3 tokens
    in, 2 out: $0.005)."""
    v, r = books.admit("t", c, Verdict(c, True, "chosen"), need)
    if not v.ok:
        return False
    books.record(c, task="t", agent="serve", tokens_in=3, tokens_out=2, latency_s=0.0,
                 reservation=r, via="serve")  # fmt: skip
    return True


CALL_USD = 0.005
NEED_USD = 0.01  # each call's reservation: twice what it costs


def test_a_busy_process_meets_the_ledger_once_a_block_not_once_a_call(world: World) -> None:
    t = table(world, ", rate_limit: 100000, daily_budget: 1000")
    s, c = world.settings(), t.tasks["t"][0]
    clock = Clock()

    async def busy() -> Books:
        books = Books(s, t.settings, wall=clock)
        for _ in range(400):  # two seconds' worth, in two seconds of the wall clock
            assert one_call(books, c, NEED_USD)
        clock.now += 1
        for _ in range(400):
            assert one_call(books, c, NEED_USD)
        return books

    books = asyncio.run(busy())
    # Each block is twice the last (a burst from nothing), then a second's worth: a handful of
    # meetings for 800 calls, where each call read and wrote the whole file three times.
    assert books.meetings <= 16, books.meetings
    led = ledger.read(s, now_wall=clock.now)
    # While held, every slot and dollar of the blocks counts as taken for everyone else...
    assert led.requests_last_min(clock.now)[cid(c)] >= 800
    assert led.spend_usd[cid(c)] >= 800 * CALL_USD
    books.idle()  # ...and the line going idle gives back what was not used: the truth
    led = ledger.read(s, now_wall=clock.now)
    assert led.requests_last_min(clock.now)[cid(c)] == 800
    assert led.spend_usd[cid(c)] == pytest.approx(800 * CALL_USD)
    assert led.usage["task"]["t"]["calls"] == 800
    assert not books.holding()


def test_what_a_block_holds_is_taken_for_every_other_process(world: World) -> None:
    # $1.00; each call reserves $0.01: serve's burst holds some ahead, which an agent calling
    # now (the per-call path, its own process's) cannot spend; given back, it can.
    t = table(world, ", daily_budget: 1.00")
    s, c = world.settings(), t.tasks["t"][0]
    clock = Clock()
    books = Books(s, t.settings, wall=clock)
    for _ in range(20):
        assert one_call(books, c, NEED_USD)
    assert books.holding()
    held = ledger.read(s).spend_usd[cid(c)] - 20 * CALL_USD
    assert held > 0
    # An agent's reservation of all that is not held is granted; of a cent more, refused.
    room = 1.00 - 20 * CALL_USD - held
    assert isinstance(budget.reserve(s, t.settings, c, room + 0.01), str)
    r = budget.reserve(s, t.settings, c, room)
    assert isinstance(r, budget.Reservation)
    budget.release(s, r)
    books.idle()
    r = budget.reserve(s, t.settings, c, room + held)  # given back: all of it can be had
    assert isinstance(r, budget.Reservation)


def test_near_a_budgets_end_nothing_is_held_and_every_call_is_settled_at_once(
    world: World,
) -> None:
    # $0.05 holds five reservations of $0.01: too little to hold a whole one ahead (an eighth
    # of what is left), so serve keeps nothing, as a single call's reservation would not.
    t = table(world, ", daily_budget: 0.05")
    s, c = world.settings(), t.tasks["t"][0]
    books = Books(s, t.settings, wall=Clock())
    served = 0
    while one_call(books, c, NEED_USD):
        served += 1
        assert not books.holding()
        assert ledger.read(s).spend_usd[cid(c)] == pytest.approx(served * CALL_USD)
    # Each call started with $0.01 left at least: the last one was refused at $0.045.
    assert served == 9
    assert ledger.read(s).spend_usd[cid(c)] == pytest.approx(0.045)
    v = accounting.admit(s, t.settings, "t", c)
    assert v.ok  # not spent: the next, smaller call of another process still fits


def test_a_refused_meeting_says_what_is_spent_without_what_serve_held(world: World) -> None:
    t = table(world, ", daily_budget: 1.00")
    s, c = world.settings(), t.tasks["t"][0]
    books = Books(s, t.settings, wall=Clock())
    for _ in range(10):
        assert one_call(books, c, NEED_USD)
    assert books.holding()
    v, r = books.admit("t", c, Verdict(c, True, "chosen"), 5.0)  # far past the budget
    assert (v.ok, v.limit, r) == (False, "budget", None)
    assert v.reason.startswith("daily budget: $0.0500 spent on this host today + up to $5.0000")
    # Nothing of this size fits: what was held went back at once.
    assert ledger.read(s).spend_usd[cid(c)] == pytest.approx(10 * CALL_USD)


def test_slots_are_taken_by_second_and_the_unused_go_back(world: World) -> None:
    t = table(world, ", rate_limit: 40")
    s, c = world.settings(), t.tasks["t"][0]
    clock = Clock()
    books = Books(s, t.settings, wall=clock)
    for _ in range(4):
        assert one_call(books, c, None)
    taken = ledger.read(s).requests_last_min(clock.now)[cid(c)]
    assert 4 <= taken <= 4 + 40 // 8  # ahead: never more than an eighth of what was left
    clock.now += 1  # a slot counts in the second it was taken: the next second meets again
    assert one_call(books, c, None)
    assert ledger.read(s).requests_last_min(clock.now)[cid(c)] <= 5 + 35 // 8
    books.idle()
    assert ledger.read(s).requests_last_min(clock.now)[cid(c)] == 5


def test_a_burst_never_passes_a_rate_limit_shared_with_an_agent(world: World) -> None:
    t = table(world, ", rate_limit: 30")
    s, c = world.settings(), t.tasks["t"][0]
    clock = Clock()  # one clock for both sides: the minute's window never moves under the test
    books = Books(s, t.settings, wall=clock)
    admitted = 0
    for i in range(60):  # serve's calls and an agent's, in turn
        if i % 3 == 0:
            admitted += accounting.admit(s, t.settings, "t", c, now_wall=clock.now).ok
        else:
            admitted += one_call(books, c, None)
    books.idle()
    assert admitted == 30
    assert ledger.read(s).requests_last_min(clock.now)[cid(c)] == 30


def test_with_the_clusters_redis_unreachable_blocks_keep_to_this_hosts_share(
    world: World,
) -> None:
    from gpulock.core import clusterview

    nothing = socket.socket()
    nothing.bind(("127.0.0.1", 0))
    port = nothing.getsockname()[1]
    nothing.close()  # no Redis there: every call is refused at once
    world.config.write_text(
        f"cluster: {{redis: 'redis://127.0.0.1:{port}', host: a}}\n"
        "routes:\n  t:\n"
        "    - {backend: openai, name: remote, model: m, base_url: 'http://127.0.0.1:9/v1',"
        f" api_key_env: {KEY_ENV}, price: {PRICE}, rate_limit: 4}}\n"
        "  u:\n"
        "    - {backend: openai, name: paid, model: p, base_url: 'http://127.0.0.1:9/v1',"
        f" api_key_env: {KEY_ENV}, price: {PRICE}, daily_budget: 0.10}}\n"
    )
    t = load_table(world.settings().config)
    s = world.settings()
    # The last time this host's serve saw the cluster, it had two hosts.
    clusterview.write(s, clusterview.View("a", 2, "down", "refused", 1.0, time.time(), 1))
    rated, paid = t.tasks["t"][0], t.tasks["u"][0]
    books = Books(s, t.settings, wall=Clock())
    served = 0
    while one_call(books, rated, None):
        served += 1
    assert served == 2  # half of the 4 a minute
    v, _r = books.admit("t", rated, Verdict(rated, True, "chosen"), None)
    assert v.reason == (
        "rate limit: 2 requests in the last minute on this host "
        "(its share of 4 while the cluster's Redis is unavailable)"
    )
    served = 0
    while one_call(books, paid, NEED_USD):
        served += 1
    # Half of $0.10; each call reserves $0.01 and costs $0.005: the tenth would pass $0.05.
    assert served == 9
    assert ledger.read(s).spend_usd[cid(paid)] == pytest.approx(0.045)
