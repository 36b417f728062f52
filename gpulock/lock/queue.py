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

Several GPUs, one line (``decide_set``): a ticket may ask for a set of GPUs (``--gpu any``,
``--gpu 0,2``) and a count of them at once (``--gpus 2``).  It waits in the line of every GPU of
its set (a copy of it in each queue folder, same number), and each line keeps the rule above
unchanged, so a ticket pinned to one GPU, and every ticket on a one-GPU machine, is decided
exactly as before.  Across the set:

* a ticket is granted ``count`` GPUs of its set at once, all or nothing, and only GPUs on which
  the one-GPU rule grants it: nothing waits ahead of it in that GPU's line, and it fits beside
  that GPU's holders.  It holds none until it is granted all of them;
* so no ticket is granted a GPU that an earlier waiting ticket could have taken at that moment
  (an earlier ticket whose set has that GPU waits ahead in its line), and a waiting multi-GPU
  ticket holds back every GPU of its set from later tickets: a stream of one-GPU jobs cannot
  starve it, and two multi-GPU tickets never deadlock (neither holds a part while it waits;
  the earliest waiting ticket waits only for holders, which leave);
* among more GPUs than it needs that could grant at once, it takes those where its model is
  already warm first, then those with the most free memory, then the lowest numbers
  (``place``);
* it watches, on every GPU that cannot grant yet, what the one-GPU rule watches there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpulock.core.units import format_gpus, format_size
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


@dataclass(frozen=True, slots=True)
class SetDecision:
    """What a ticket that may wait in several lines should do now."""

    grant: tuple[int, ...]  # the GPUs to take now (ascending), all at once; () waits
    watch: tuple[tuple[int, int], ...]  # (gpu, seq): tickets whose departure may change it
    reason: str
    ready: tuple[int, ...]  # the GPUs of its set that could grant it now (for reasons, status)


def decide_set(
    me: Ticket,
    lines: Mapping[int, Sequence[Ticket]],
    budgets: Mapping[int, int | None],
    *,
    blocked: Mapping[int, str] | None = None,
    warm: Mapping[int, str] | None = None,
    free: Mapping[int, int | None] | None = None,
) -> SetDecision:
    """May ``me`` take ``me.count`` GPUs of ``me.gpu_set`` now, and which?

    ``lines``: for each GPU of the set, the live tickets ahead of ``me`` in that GPU's line (in
    queue order); ``budgets``: each GPU's budget as ``decide`` takes it.  ``blocked``: GPUs the
    one-GPU rule would grant that must wait all the same, with why (a dead holder's processes
    still exiting).  ``warm`` (GPU -> why: the job's model is resident there) and ``free``
    (GPU -> free bytes, None unknown) choose among more GPUs than it needs (``place``).
    """
    blocked = blocked or {}
    ready: list[int] = []
    watch: list[tuple[int, int]] = []
    why: dict[int, str] = {}
    for g in me.gpu_set:
        d = decide(me, lines.get(g, ()), budgets.get(g))
        if d.grant and g in blocked:
            why[g] = blocked[g]
        elif d.grant:
            ready.append(g)
            why[g] = d.reason
        else:
            watch.extend((g, s) for s in d.watch)
            why[g] = d.reason
    if len(ready) >= me.count:
        pick, because = place(ready, me.count, warm or {}, free or {})
        first = why[pick[0]] if me.count == 1 else "all free at once"
        return SetDecision(pick, (), f"{format_gpus(pick)}: {first}{because}", tuple(ready))
    need = f"needs {me.count} GPUs at once, " if me.count > 1 else ""
    have = f"{len(ready)} ready ({format_gpus(ready)}); " if ready and me.count > 1 else ""
    rest = "; ".join(f"gpu{g}: {why[g]}" for g in me.gpu_set if g not in ready)
    return SetDecision((), tuple(watch), f"{need}{have}{rest}", tuple(ready))


def place(
    ready: Sequence[int],
    count: int,
    warm: Mapping[int, str],
    free: Mapping[int, int | None],
) -> tuple[tuple[int, ...], str]:
    """The ``count`` GPUs of ``ready`` to take, ascending, and why those (a reason's tail).

    Where the job's model is already warm first, then the most free memory (unknown last),
    then the lowest number: the order is total, so the same world always places alike.
    """

    def rank(g: int) -> tuple[int, int, int]:
        room = free.get(g)
        return (0 if g in warm else 1, -(room if room is not None else -1), g)

    pick = sorted(ready, key=rank)[:count]
    if len(ready) == count:
        return tuple(sorted(pick)), ""
    hot = [g for g in pick if g in warm]
    if hot:
        because = f" (warm: {warm[hot[0]]})"
    elif any(free.get(g) is not None for g in pick):
        because = f" (most free: {format_size(free.get(pick[0]))})"
    else:
        because = ""
    return tuple(sorted(pick)), because


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
