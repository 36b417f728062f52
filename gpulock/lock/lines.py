"""A waiting ticket's lines: one per GPU it may take, what is ahead of it in each, and the rule
over all of them.

A ticket pinned to one GPU has one ``Line`` and the one-GPU rule (``gpulock.lock.queue.decide``),
exactly as before sets.  A ticket for a set of GPUs stands in the line of each and takes
``count`` of them at once (``queue.decide_set``); when more are ready than it takes, it is
placed where the job is warm, else where most memory is free (``free_memory``).  The waiter
(``gpulock.lock.waiter``) scans the lines (``gpulock.lock.ahead``) and sleeps; what they say is
decided here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpulock.core import devices
from gpulock.core.config import Config
from gpulock.lock import queue
from gpulock.lock.queuedir import QueueDir, Spot, TicketFile
from gpulock.lock.ticket import Ticket

# Where a set ticket's job is warm (GPU -> why) and each ready GPU's free memory, by GPUs ready.
Placing = Callable[[Sequence[int]], tuple[dict[int, str], dict[int, int | None]]]


@dataclass(slots=True, eq=False)
class Line:
    """One GPU's line as a waiting ticket sees it: its copy there, what is ahead of it."""

    spot: Spot
    budget: int | None  # the GPU's memory less the reserve; None: unknown (or exclusive)
    ahead_seqs: list[int] | None = None  # listed once per wait (see gpulock.lock.ahead.scan_ahead)
    ahead: list[TicketFile] = field(default_factory=list)  # live ones, from the last scan
    exit_blockers: list[int] = field(default_factory=list)  # dead holders still exiting

    @property
    def qdir(self) -> QueueDir:
        return self.spot.qdir

    @property
    def me(self) -> Ticket:
        return self.spot.ticket

    @property
    def gpu(self) -> int:
        return self.spot.qdir.gpu


def decide_lines(
    me: Ticket, lines: Sequence[Line], placing: Placing
) -> tuple[tuple[int, ...], set[tuple[int, int]], str]:
    """The rule over a ticket's lines: (GPUs to take now, (gpu, seq) to watch, why).

    ``placing(ready)`` is asked only when a set ticket has a real choice among the GPUs ready.
    """
    if not me.spans:  # one GPU: the one-GPU rule, exactly as it always was
        line = lines[0]
        d = queue.decide(me, [tf.ticket for tf in line.ahead], line.budget)
        if d.grant and line.exit_blockers:
            why = f"holder {line.exit_blockers[0]} died: waiting for its processes to exit"
            return (), set(), why
        return ((line.gpu,) if d.grant else ()), {(line.gpu, s) for s in d.watch}, d.reason
    ahead = {line.gpu: [tf.ticket for tf in line.ahead] for line in lines}
    budgets = {line.gpu: line.budget for line in lines}
    blocked = {
        line.gpu: f"holder {line.exit_blockers[0]} died: waiting for its processes to exit"
        for line in lines
        if line.exit_blockers
    }
    sd = queue.decide_set(me, ahead, budgets, blocked=blocked)
    if sd.grant and len(sd.ready) > me.count:  # a real choice: where is it warm?
        warm, free = placing(sd.ready)
        sd = queue.decide_set(me, ahead, budgets, blocked=blocked, warm=warm, free=free)
    return sd.grant, set(sd.watch), sd.reason


def free_memory(
    lines: Sequence[Line], ready: Sequence[int], config: Config
) -> dict[int, int | None]:
    """Each ready GPU's free memory: the device's (NVML), else its budget less its holders'
    needs (0 behind an exclusive holder; None when the budget is unknown)."""
    free: dict[int, int | None] = {}
    for line in lines:
        if line.gpu not in ready:
            continue
        claimed = [tf.ticket.need_bytes for tf in line.ahead if tf.ticket.holding]
        if line.budget is None:
            free[line.gpu] = None
        elif any(n is None for n in claimed):
            free[line.gpu] = 0
        else:
            free[line.gpu] = line.budget - sum(n or 0 for n in claimed)
    report = devices.probe(config) if free else None
    if report is not None and report.source == "nvml":
        for g in free:
            dev = report.get(g)
            if dev is not None and dev.free_bytes is not None:
                free[g] = dev.free_bytes
    return free


def nearest_line(lines: Sequence[Line]) -> Line:
    """The line where a ticket stands nearest the front (for warming its files)."""
    live = [line for line in lines if line.spot.fd is not None]
    return min(live, key=lambda line: sum(1 for tf in line.ahead if not tf.ticket.holding))


def count_ahead(me: Ticket, lines: Sequence[Line]) -> int:
    """Tickets ahead of ``me`` in any of its lines (each counted once)."""
    seqs = {s for line in lines for s in line.qdir.seqs() if s < me.seq}
    return len(seqs)
