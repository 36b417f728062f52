"""After a holder dies: hand its GPU on only once its processes have really gone.

A holder that releases removes its ticket before it closes its claim, so a successor that
finds no ticket knows the GPU was given back on purpose (``QueueDir.look`` looks at the claim
first, the ticket after, so a release is never read as a death).  A holder that dies leaves
its ticket behind, and the kernel closes the claim FIFO before the dying process has finished
exiting (its other descriptors, the GPU driver's among them, close later): on a real GPU the
dead holder's memory is still allocated when its FIFO reports the death, and a successor
granted at once can OOM.

So a waiter that would be granted past a dead holder first waits, within ``exit_wait`` (config,
default 10 s), until

* the dead holder's processes (its owner and, under ``gpulock run``, its command: pid + start
  time, so a reused pid is never waited for) have exited: a ``pidfd`` per process, polled by
  the waiter together with its claims, becomes readable at the exit (no polling loop); and
* on a real GPU, NVML no longer lists them.  NVML has no notification, so this one is
  re-checked with a backoff (``NVML_FIRST_S`` doubling to ``NVML_MAX_S``), only while a
  dead holder's pids are still listed.

Only a process that is really exiting is waited for (``in_exit``): the kernel shows it a zombie
(``Z``), dead (``X``), inside its exit (``PF_EXITING``), killed by a signal (``PF_SIGNALED``) or
with SIGKILL pending.  A process that is running (a command that closed the claim it
inherited and runs on, or any live process a ticket names) is not: it would keep its memory
for as long as it likes, and waiting ``exit_wait`` for it stalls the whole line for nothing.
Seen at the first look or at any later one, such a process is dropped from the wait at once,
with an ``exit-wait-alive`` event naming it, its state and the live tickets it holds in any
line.

``decide`` and ``in_exit`` are the pure rules; ``ExitWatch`` the waiter's I/O around them.  The
waiter writes an ``exit-wait`` event when it starts waiting, ``exit-wait-alive`` when a process
is not (or no longer) waited for because it runs, and ``exit-wait-timeout`` when it gives up.
"""

from __future__ import annotations

import math
import os
import select
import signal
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from gpulock.core import identity
from gpulock.lock.ticket import Ticket

NVML_FIRST_S = 0.05  # the driver frees a dead context's memory within milliseconds...
NVML_MAX_S = 1.0  # ...but a loaded machine may take longer: back off to once a second
PF_EXITING = 0x4  # the task's flags (include/linux/sched.h): inside do_exit...
PF_SIGNALED = 0x400  # ...or killed by a signal (set before a core dump and the exit)
SIGKILL_MASK = 1 << (signal.SIGKILL - 1)  # a SIGKILL pending: not yet taken, but it will be


class Poller(Protocol):
    """What a waiter sleeps on: ``select.poll``, or an event loop's (``gpulock.lock.aiolock``)."""

    def register(self, fd: int, eventmask: int = ..., /) -> None: ...

    def unregister(self, fd: int, /) -> None: ...


GpuPids = Callable[[int], "frozenset[int] | None"]  # gpu -> pids NVML lists; None: unknown
# (pid, start ticks) -> the live tickets that process holds, as (gpu, seq), in every line
TicketsOf = Callable[[int, "int | None"], "list[tuple[int, int]]"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a dead holder's successor may be granted now."""

    state: str  # "gone" (go on) | "wait" | "give-up" (waited exit_wait; go on, with an event)
    reason: str


def decide(
    running: Collection[int],
    listed: Collection[int] | None,
    waited_s: float,
    limit_s: float,
) -> Verdict:
    """The rule: wait while a dead holder's process still runs or NVML still lists it.

    ``running``: its processes that have not exited; ``listed``: those of its pids NVML still
    lists on the GPU (None: no NVML, nothing to check); ``waited_s`` since the death was seen.
    """
    if running:
        why = "process(es) " + ", ".join(map(str, sorted(running))) + " still exiting"
    elif listed:
        why = "NVML still lists pid(s) " + ", ".join(map(str, sorted(listed)))
    else:
        return Verdict("gone", "the dead holder's processes have exited")
    if waited_s >= limit_s:
        return Verdict("give-up", f"{why} after {waited_s:.1f} s (exit_wait {limit_s:g} s)")
    return Verdict("wait", why)


@dataclass(frozen=True, slots=True)
class ProcState:
    """One process as the kernel shows it (``/proc/<pid>/stat`` and ``/proc/<pid>/status``)."""

    state: str  # one letter: R running, S sleeping, D disk sleep, T stopped, Z zombie, X dead
    flags: int  # the task's PF_* flags
    pending: int  # the signals pending for it and for its thread group, as a mask


def in_exit(p: ProcState) -> bool:
    """The rule: is this process on its way out (then its successor waits), or running?"""
    return (
        p.state in ("Z", "X")
        or bool(p.flags & (PF_EXITING | PF_SIGNALED))
        or bool(p.pending & SIGKILL_MASK)
    )


def proc_state(pid: int, ticks: int | None) -> ProcState | None:
    """How the kernel shows ``pid`` now; None if it is gone, or its pid now names another
    process (``ticks``: the recorded start time)."""
    fields = identity.stat_fields(pid)
    if fields is None:
        return None
    try:
        state, flags, started = fields[0].decode(), int(fields[6]), int(fields[19])
    except (ValueError, IndexError, UnicodeDecodeError):
        return None
    if started != ticks:
        return None
    pending = 0
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith((b"SigPnd:", b"ShdPnd:")):
                    pending |= int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass  # no word on pending signals: the state and flags still say
    return ProcState(state, flags, pending)


def processes(t: Ticket) -> dict[int, int | None]:
    """The processes that held the GPU for ``t``: pid -> start ticks (None: not checkable)."""
    out: dict[int, int | None] = {t.pid: t.start_ticks}
    if t.child_pid is not None:
        out[t.child_pid] = t.child_start_ticks
    return out


def open_pidfd(pid: int, ticks: int | None, pidns: str | None, uid: int) -> int | None:
    """A pidfd of ``pid`` if it still is the recorded process; None if it is gone (or unknown).

    The start time and owner are checked after the pidfd is open, so the process verified is
    the one watched: a pid reused since is not waited for, nor (a ticket being only a file) a
    process of another user that a crafted ticket names.
    """
    if ticks is None or pidns is None or pidns != identity.pid_namespace():
        return None  # another namespace (or no /proc): nothing here can tell
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # ProcessLookupError: gone already
        return None
    if identity.start_ticks(pid) != ticks or real_uid(pid) != uid:
        os.close(fd)
        return None
    return fd


def real_uid(pid: int) -> int | None:
    """The real uid of ``pid`` (``/proc/<pid>/status``), None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def exited(fd: int) -> bool:
    """A pidfd is readable once its process has exited."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


@dataclass(slots=True)
class _Dead:
    """One dead holder being waited out."""

    ticket: Ticket
    since: float  # monotonic: when its death was seen
    pidfds: dict[int, int] = field(default_factory=dict)  # pid -> pidfd, while running
    listed: frozenset[int] | None = None  # its pids NVML listed at the last look
    nvml_next: float = 0.0  # monotonic: when to ask NVML again
    nvml_every: float = NVML_FIRST_S
    running: set[int] = field(default_factory=set)  # its pids seen running: not waited for
    announced: bool = False
    done: bool = False


class ExitWatch:
    """The dead holders one waiter waits out, their pidfds registered on the waiter's poller."""

    def __init__(
        self,
        poller: Poller,
        limit_s: float,
        gpu_pids: GpuPids,
        emit: Callable[..., None],
        *,
        clock: Callable[[], float] = time.monotonic,
        state: Callable[[int, int | None], ProcState | None] = proc_state,
        tickets_of: TicketsOf | None = None,
    ) -> None:
        self.poller = poller
        self.limit_s = limit_s
        self.gpu_pids = gpu_pids
        self.emit = emit
        self.clock = clock
        self.state = state
        self.tickets_of = tickets_of
        self.dead: dict[int, _Dead] = {}  # seq -> its state
        self.fds: dict[int, tuple[int, int]] = {}  # pidfd -> (seq, pid)

    def blocks(self, t: Ticket) -> bool:
        """Must the grant wait for this dead holder?  First call opens its pidfds."""
        if self.limit_s <= 0:
            return False
        now = self.clock()
        d = self.dead.get(t.seq)
        if d is None:
            d = self.dead[t.seq] = _Dead(t, now)
            for pid, ticks in processes(t).items():
                fd = open_pidfd(pid, ticks, t.pidns, t.uid)
                if fd is not None:  # registered, then recorded (see gpulock.lock.watches)
                    self.poller.register(fd, select.POLLIN)
                    self.fds[fd] = (t.seq, pid)
                    d.pidfds[pid] = fd
        if d.done:
            return False
        for fd in [fd for fd in d.pidfds.values() if exited(fd)]:
            self.on_ready(fd)
        fields = {"dead_ticket": t.seq, "dead_pid": t.pid, "dead_child_pid": t.child_pid}
        self._drop_running(d, now, fields)
        if not d.pidfds and now >= d.nvml_next:  # exited: does the driver agree yet?
            gone = frozenset(processes(t)) - d.running
            d.listed = None
            for g in t.held_gpus or (t.gpu,):  # a multi-GPU holder: on every GPU it held
                on_gpu = self.gpu_pids(g)
                if on_gpu is not None:
                    d.listed = (d.listed or frozenset()) | (on_gpu & gone)
            d.nvml_next = now + d.nvml_every
            d.nvml_every = min(d.nvml_every * 2, NVML_MAX_S)
        listed = d.listed if not d.pidfds else None
        v = decide(set(d.pidfds), listed, now - d.since, self.limit_s)
        if v.state == "wait":
            if not d.announced:
                d.announced = True
                self.emit("exit-wait", **fields, reason=v.reason, exit_wait_s=self.limit_s)
            return True
        if v.state == "give-up":
            self.emit("exit-wait-timeout", **fields, reason=v.reason, waited_s=now - d.since)
        self._finish(d)
        return False

    def _drop_running(self, d: _Dead, now: float, fields: dict[str, int | None]) -> None:
        """Stop waiting for the processes of ``d`` that are not exiting, with an event."""
        ticks = processes(d.ticket)
        running: dict[int, ProcState] = {}
        for pid, fd in list(d.pidfds.items()):
            seen = self.state(pid, ticks.get(pid))
            if seen is None:  # gone since the pidfd was polled (or its pid reused)
                self.on_ready(fd)
            elif not in_exit(seen):
                running[pid] = seen
                self.on_ready(fd)  # not waited for: it may run for as long as it likes
        if not running:
            return
        d.running.update(running)
        alive: list[dict[str, object]] = []
        whys: list[str] = []
        for pid, seen in sorted(running.items()):
            held = self.tickets_of(pid, ticks.get(pid)) if self.tickets_of is not None else []
            alive.append({"pid": pid, "state": seen.state, "tickets": held})
            why = f"pid {pid} is running (state {seen.state}), not exiting"
            if held:
                why += "; it holds " + ", ".join(f"ticket {q} on gpu{g}" for g, q in held)
            whys.append(why)
        self.emit(
            "exit-wait-alive",
            **fields,
            alive=alive,
            reason="; ".join(whys) + ": not waited for",
            waited_s=round(now - d.since, 6),
        )

    def on_ready(self, fd: int) -> bool:
        """A readable descriptor: if it is one of our pidfds, its process exited."""
        owner = self.fds.pop(fd, None)
        if owner is None:
            return False
        seq, pid = owner
        self.dead[seq].pidfds.pop(pid, None)  # forgotten, then let go (see gpulock.lock.watches)
        self.poller.unregister(fd)
        os.close(fd)
        return True

    def wake_at(self) -> float:
        """When the waiter must look again without a kernel wake-up (monotonic; inf: never)."""
        wake = math.inf
        for d in self.dead.values():
            if d.done:
                continue
            wake = min(wake, d.since + self.limit_s)
            if not d.pidfds and d.listed:
                wake = min(wake, d.nvml_next)
        return wake

    def _finish(self, d: _Dead) -> None:
        for fd in list(d.pidfds.values()):
            self.on_ready(fd)
        d.done = True

    def close(self) -> None:
        for d in self.dead.values():
            self._finish(d)
