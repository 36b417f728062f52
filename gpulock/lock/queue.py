"""The queue's rules, as pure functions: who may hold the GPU, whom a waiter watches, who is hung.

Everything here takes the world as arguments (live tickets, budgets, the time) and returns data
with a reason, so the rules are table-tested without processes or a GPU.  ``gpulock.lock.lease``
does the I/O around them.

The rules:

* Order is the ticket sequence number, fixed at arrival.  Nobody is ever inserted ahead of a
  ticket, so the set of tickets ahead of a waiter only shrinks.
* A ticket is granted only when every live ticket ahead of it already holds (FIFO: the head of
  the queue is never overtaken), and then:

  - an exclusive ticket (no ``need``) only when nothing is ahead of it;
  - a ticket with a ``need`` when no holder is exclusive and the needs of all holders plus its
    own fit the budget (the GPU's memory less the reserve).  Without a known budget (no device
    probe could size the GPU) sharing is impossible, so it waits like an exclusive ticket.

* A waiter watches only what can change its answer: the nearest ticket ahead while that one
  still waits (it will leave or be granted), or, at the head, every holder (any release may
  make room).  So a release wakes the head waiter only: no thundering herd.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpulock.core.units import format_size
from gpulock.lock.ticket import Ticket


@dataclass(frozen=True, slots=True)
class Decision:
    """What a waiter should do now."""

    grant: bool
    watch: tuple[int, ...]  # sequence numbers whose departure (or grant) may change the answer
    reason: str


def decide(me: Ticket, ahead: Sequence[Ticket], budget_bytes: int | None) -> Decision:
    """May ``me`` hold the GPU, given the live tickets ``ahead`` of it (in queue order)?"""
    if not ahead:
        return Decision(True, (), "first in line")
    waiting = [t for t in ahead if not t.holding]
    if waiting:
        pred = waiting[-1]
        return Decision(False, (pred.seq,), f"behind waiting ticket {pred.seq}")
    holders = tuple(t.seq for t in ahead)
    if me.exclusive:
        return Decision(False, holders, "exclusive: waits for every holder to leave")
    if any(t.exclusive for t in ahead):
        excl = next(t for t in ahead if t.exclusive)
        return Decision(False, holders, f"ticket {excl.seq} holds the GPU exclusively")
    if budget_bytes is None:
        return Decision(False, holders, "GPU size unknown: cannot share, waits for the holders")
    assert me.need_bytes is not None
    used = sum(t.need_bytes or 0 for t in ahead)
    # In units a reader takes in at once (history, status): "needs 16.0 GiB, 9.6 GiB left".
    if used + me.need_bytes <= budget_bytes:
        shared = f"{format_size(used + me.need_bytes)} of {format_size(budget_bytes)}"
        return Decision(True, (), f"shares the GPU: {shared}")
    left = format_size(max(budget_bytes - used, 0))
    return Decision(False, holders, f"needs {format_size(me.need_bytes)}, {left} left")


def heartbeat_wall(t: Ticket, mtime_wall: float) -> float:
    """When the holder last showed life: its grant or its last heartbeat (the ticket's mtime)."""
    return max(t.granted_wall or 0.0, mtime_wall)


def lease_expiry_wall(t: Ticket, mtime_wall: float) -> float | None:
    """When a holder's lease runs out without a heartbeat; None if it has no lease."""
    if not t.holding or t.lease_s is None:
        return None
    return heartbeat_wall(t, mtime_wall) + t.lease_s


def is_hung(t: Ticket, mtime_wall: float, now_wall: float) -> bool:
    """A live holder past its lease without a heartbeat (SIGSTOP, a deadlock)."""
    expiry = lease_expiry_wall(t, mtime_wall)
    return expiry is not None and now_wall > expiry
