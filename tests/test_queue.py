"""Table tests of the queue's pure rules (gpulock.lock.queue): no files, no processes, no clock."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from gpulock.lock.queue import Decision, decide, heartbeat_wall, is_hung, lease_expiry_wall
from gpulock.lock.ticket import Ticket

GIB = 1024**3
BUDGET = 22 * GIB  # a 24 GiB GPU less a 2 GiB reserve


def t(
    seq: int,
    need_gib: float | None = None,
    *,
    holding: bool = False,
    lease: float | None = None,
    granted: float | None = None,
) -> Ticket:
    """Ticket ``seq``: exclusive unless ``need_gib``; ``holding`` grants it at wall time 100."""
    return Ticket(
        seq=seq,
        gpu=0,
        pid=1000 + seq,
        uid=1000,
        user="agent",
        host="box",
        name=f"job{seq}",
        created_wall=50.0,
        need_bytes=None if need_gib is None else int(need_gib * GIB),
        lease_s=lease,
        granted_wall=granted if granted is not None else (100.0 if holding else None),
    )


def H(seq: int, need_gib: float | None = None) -> Ticket:  # upper case: reads like a table
    return t(seq, need_gib, holding=True)


def W(seq: int, need_gib: float | None = None) -> Ticket:
    return t(seq, need_gib)


# (me, tickets ahead in queue order, budget) -> (grant, watched tickets)
DECIDE_TABLE = [
    pytest.param(t(1), [], BUDGET, True, (), id="exclusive, queue empty"),
    pytest.param(t(1, 6), [], BUDGET, True, (), id="sharer, queue empty"),
    pytest.param(t(1, 6), [], None, True, (), id="sharer, queue empty, size unknown"),
    pytest.param(t(1, 22), [], BUDGET, True, (), id="need == budget, queue empty"),
    pytest.param(t(5), [H(2)], BUDGET, False, (2,), id="exclusive behind exclusive holder"),
    pytest.param(t(5), [H(2, 6), H(3, 6)], BUDGET, False, (2, 3), id="exclusive behind sharers"),
    pytest.param(t(5, 6), [H(2)], BUDGET, False, (2,), id="sharer behind exclusive holder"),
    pytest.param(t(5, 6), [H(2, 6)], BUDGET, True, (), id="sharer fits beside a sharer"),
    pytest.param(t(5, 6), [H(2, 6), H(3, 6)], BUDGET, True, (), id="third sharer fits"),
    pytest.param(t(5, 10), [H(2, 6), H(3, 6)], BUDGET, True, (), id="fits exactly: 22 of 22"),
    pytest.param(t(5, 16), [H(2, 6), H(3, 6)], BUDGET, False, (2, 3), id="16 does not fit"),
    pytest.param(t(5, 16), [H(3, 6)], BUDGET, True, (), id="16 fits once one 6 left"),
    pytest.param(
        replace(t(5, 10), need_bytes=10 * GIB + 1),
        [H(2, 6), H(3, 6)],
        BUDGET,
        False,
        (2, 3),
        id="one byte too many",
    ),
    pytest.param(t(5, 6), [H(2, 6)], None, False, (2,), id="size unknown: no sharing"),
    pytest.param(t(5, 6), [W(4, 16)], BUDGET, False, (4,), id="no overtaking a waiter"),
    pytest.param(
        t(5, 6), [H(2, 6), H(3, 6), W(4, 16)], BUDGET, False, (4,), id="6 fits but 16 waits first"
    ),
    pytest.param(t(5), [W(3), W(4)], BUDGET, False, (4,), id="watches the nearest waiter only"),
    pytest.param(t(9, 1), [H(2, 6), W(7), W(8, 1)], BUDGET, False, (8,), id="nearest of many"),
    pytest.param(t(5), [W(4, 6)], BUDGET, False, (4,), id="exclusive behind a waiting sharer"),
]


@pytest.mark.parametrize(("me", "ahead", "budget", "grant", "watch"), DECIDE_TABLE)
def test_decide(
    me: Ticket, ahead: list[Ticket], budget: int | None, grant: bool, watch: tuple[int, ...]
) -> None:
    d = decide(me, ahead, budget)
    assert (d.grant, d.watch) == (grant, watch), d.reason
    assert d.reason  # every decision says why, for `gpulock status` and the event log


def test_a_memory_reason_is_in_units_not_raw_bytes() -> None:
    d = decide(t(5, 16), [H(2, 12)], BUDGET)
    assert (d.grant, d.reason) == (False, "needs 16.0 GiB, 10.0 GiB left")
    d = decide(t(5, 6), [H(2, 12)], BUDGET)
    assert (d.grant, d.reason) == (True, "shares the GPU: 18.0 GiB of 22.0 GiB")


def test_decide_reasons_name_the_cause() -> None:
    assert "first" in decide(t(1), [], BUDGET).reason
    assert "4" in decide(t(5), [W(4)], BUDGET).reason
    assert "2" in decide(t(5, 6), [H(2)], BUDGET).reason
    assert "unknown" in decide(t(5, 6), [H(2, 6)], None).reason


def test_decide_does_not_mutate_its_arguments() -> None:
    ahead = [H(2, 6), W(3, 16)]
    copy = list(ahead)
    decide(t(4, 6), ahead, BUDGET)
    assert ahead == copy


# Every queue of up to three tickets ahead, drawn from these, against these newcomers.
_AHEAD_KINDS = [H(0), H(0, 6), H(0, 16), W(0), W(0, 6)]
_ME_KINDS = [t(9), t(9, 6), t(9, 10), t(9, 22)]


def _queues() -> list[list[Ticket]]:
    out: list[list[Ticket]] = []
    for n in range(4):
        for combo in itertools.product(_AHEAD_KINDS, repeat=n):
            # Renumber in queue order; a holder never sits behind a waiter (grants are FIFO).
            tickets = [replace(k, seq=i + 1) for i, k in enumerate(combo)]
            first_wait = next((i for i, k in enumerate(tickets) if not k.holding), len(tickets))
            if all(not k.holding for k in tickets[first_wait:]):
                out.append(tickets)
    return out


@pytest.mark.parametrize("budget", [BUDGET, None])
def test_decide_invariants_over_every_small_queue(budget: int | None) -> None:
    """The rules, checked on every queue of up to three tickets ahead (exhaustive, small)."""
    checked = 0
    for ahead in _queues():
        for me in _ME_KINDS:
            d: Decision = decide(me, ahead, budget)
            seqs = {x.seq for x in ahead}
            waiting = [x for x in ahead if not x.holding]
            if d.grant:
                assert d.watch == ()
                assert not waiting, "granted past a waiter: FIFO broken"
                if me.exclusive or any(x.exclusive for x in ahead):
                    assert not ahead, "exclusive access shared"
                elif ahead:
                    assert budget is not None
                    assert sum(x.need_bytes or 0 for x in ahead) + (me.need_bytes or 0) <= budget
            else:
                assert ahead, "refused with nobody ahead"
                assert d.watch, "refused but watches nothing: it would never wake"
                assert set(d.watch) <= seqs
                if waiting:
                    assert d.watch == (waiting[-1].seq,)  # only the nearest waiter: no herd
                else:
                    assert d.watch == tuple(x.seq for x in ahead)  # any holder may make room
            checked += 1
    assert checked == 360  # 90 queues x 4 newcomers


# --- leases and hung holders ------------------------------------------------------------------

# (ticket, mtime of its file, now) -> hung?
HUNG_TABLE = [
    pytest.param(t(1, holding=True), 100.0, 1e9, False, id="no lease: never hung"),
    pytest.param(t(1, lease=10), 100.0, 1e9, False, id="a waiter is never hung"),
    pytest.param(t(1, lease=10, holding=True), 100.0, 105.0, False, id="within its lease"),
    pytest.param(t(1, lease=10, holding=True), 100.0, 110.0, False, id="exactly at expiry"),
    pytest.param(t(1, lease=10, holding=True), 100.0, 110.001, True, id="just past expiry"),
    pytest.param(t(1, lease=10, holding=True), 108.0, 115.0, False, id="heartbeat renews"),
    pytest.param(t(1, lease=10, holding=True), 108.0, 118.5, True, id="past the renewed lease"),
    pytest.param(t(1, lease=10, holding=True), 50.0, 109.0, False, id="old mtime: grant counts"),
    pytest.param(t(1, lease=10, holding=True), 50.0, 111.0, True, id="old mtime, past grant"),
    pytest.param(t(1, lease=0.5, holding=True), 100.0, 100.6, True, id="short lease"),
]


@pytest.mark.parametrize(("ticket", "mtime", "now", "hung"), HUNG_TABLE)
def test_is_hung(ticket: Ticket, mtime: float, now: float, hung: bool) -> None:
    assert is_hung(ticket, mtime, now) is hung


def test_heartbeat_is_the_later_of_grant_and_mtime() -> None:
    holder = t(1, holding=True)
    assert heartbeat_wall(holder, 90.0) == 100.0
    assert heartbeat_wall(holder, 120.0) == 120.0
    assert heartbeat_wall(t(1), 90.0) == 90.0  # a waiter: only its file's time


def test_lease_expiry() -> None:
    assert lease_expiry_wall(t(1, lease=10, holding=True), 100.0) == 110.0
    assert lease_expiry_wall(t(1, lease=10, holding=True), 104.5) == 114.5
    assert lease_expiry_wall(t(1, holding=True), 100.0) is None
    assert lease_expiry_wall(t(1, lease=10), 100.0) is None
