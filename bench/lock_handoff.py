#!/usr/bin/env python3
"""Side-by-side benchmark of gpulock, py-filelock and raw ``fcntl.flock``, with real processes.

Every lock holder and waiter is its own process, forked from a ``multiprocessing`` forkserver
that has preloaded the three lock libraries (so 500 waiters start in milliseconds each and stay
light).  Each child reads one-byte commands from its own pipe and reports timestamps
(``time.monotonic_ns()``: CLOCK_MONOTONIC is system-wide on Linux, so stamps taken in different
processes compare) through one shared report pipe.  The parent orchestrates; it is asleep in
``poll()`` during every measured interval.

Measurements (see bench/README.md for the columns):

(a) handoff latency: from just before the holder calls release() to just after the next
    holder's acquire() returns; one waiter, and a queue of 16.
(b) FIFO inversions between arrival order and grant order, including a newcomer that calls
    acquire() right when each holder releases.
(c) regrabs: share of grants that go back to the process that just released while others wait.
(d) CPU burnt by 20 idle waiters over 3 s, as % of one core.
(e) handoff latency at queue lengths 10, 100, 500.
(f) gpulock: overshoot of acquire(timeout=0.2) behind a holder.
(g) grant latency after the holder is SIGKILLed (gpulock is the target; the others for reference).
(h) gpulock: cost of ``status.snapshot()`` with 100 queued tickets, and of ``gpulock status``.

Run ``python bench/lock_handoff.py`` (full, a few minutes on 2 cores) or ``--quick``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import multiprocessing
import os
import platform
import random
import resource
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

KINDS = ("gpulock", "filelock", "flock")
LABELS = {"gpulock": "gpulock", "filelock": "py-filelock", "flock": "flock"}

GPULOCK_SETTLE_S = 0.001  # after the waiter's ticket file appears
OTHER_SETTLE_S = 0.005  # after the waiter said "about to block" (flock, py-filelock)
FIFO_SETTLE_S = 0.010  # the same, in the FIFO test, where a late block would be an inversion
FIFO_HOLD_S = 0.020  # hold time in the FIFO test: newcomers arrive at least this far apart
NEWCOMER_MARGIN_S = 0.010  # a newcomer counts as queued this long after it called acquire()
REGRAB_HOLD_S = 0.003
REGRAB_MARGIN_S = 0.005  # "others wait": they called acquire() at least this long before
WAIT_LIMIT_S = 60.0  # no single step of a measurement may take longer: a hang is an error
FILELOCK_CAP_FROM = 200  # py-filelock's queue runs this long or longer get fewer rounds
BATCH = 25  # children started, then waited for, at a time

# The child processes -----------------------------------------------------------------------
#
# Commands, one byte each, read from the child's command pipe:
#   a  acquire (report W just before, G just after)        r  release (report R, stamped before)
#   c  cycle: acquire, hold, ring the newcomer trigger, release
#   x  ring the newcomer trigger, then release              n  wait for the trigger, then cycle
#   l  loop: `loops` cycles without trigger, then report D   t  gpulock timeouts (report T/E)
#   v  write where gpulock is imported from (report V)
#   q  (or EOF) exit


def _now() -> int:
    return time.monotonic_ns()


class _GpulockAdapter:
    def __init__(self, target: str, name: str) -> None:
        import gpulock

        self._gpulock = gpulock
        self._target = target
        self._name = name
        self._lease: Any = None

    def acquire(self) -> None:
        self._lease = self._gpulock.acquire(gpu=0, name=self._name, state_dir=self._target)

    def release(self) -> None:
        lease, self._lease = self._lease, None
        lease.release()


class _FileLockAdapter:
    def __init__(self, target: str, name: str) -> None:
        import filelock

        self._lock = filelock.FileLock(target)  # default poll_interval

    def acquire(self) -> None:
        self._lock.acquire()

    def release(self) -> None:
        self._lock.release()


class _FlockAdapter:
    def __init__(self, target: str, name: str) -> None:
        self._fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)

    def acquire(self) -> None:
        import fcntl

        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def release(self) -> None:
        import fcntl

        fcntl.flock(self._fd, fcntl.LOCK_UN)


ADAPTERS = {"gpulock": _GpulockAdapter, "filelock": _FileLockAdapter, "flock": _FlockAdapter}


def arg_path(target: str) -> str:
    return target if os.path.isdir(target) else os.path.dirname(target)


def _exit_with_parent(cmd_fd: int) -> None:
    """Exit when the bench process is gone (its end of our command pipe hangs up)."""

    def watch() -> None:
        p = select.poll()
        p.register(cmd_fd, 0)  # POLLHUP is always reported
        while True:
            for _fd, ev in p.poll():
                if ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def child_main(
    kind: str,
    target: str,
    idx: int,
    cmd: Any,
    rep: Any,
    trig_r: Any,
    trig_w: Any,
    hold_s: float,
    loops: int,
    arg: float,
) -> None:
    """One lock user.  Runs in a process forked from the forkserver."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench cleans up; no 500 tracebacks
    cfd, rfd = cmd.fileno(), rep.fileno()
    tr = trig_r.fileno() if trig_r is not None else -1
    tw = trig_w.fileno() if trig_w is not None else -1
    _exit_with_parent(cfd)
    lock = ADAPTERS[kind](target, f"bench-{idx}")

    def say(code: bytes, t: int) -> None:
        try:
            os.write(rfd, b"%s %d %d\n" % (code, idx, t))
        except OSError:  # the bench is gone
            os._exit(0)

    def acquire() -> None:
        say(b"W", _now())
        lock.acquire()
        say(b"G", _now())

    def release(trigger: bool) -> None:
        if trigger and tw >= 0:
            os.write(tw, b"x")  # a newcomer calls acquire() right now
        t = _now()
        lock.release()
        say(b"R", t)

    def cycle(trigger: bool) -> None:
        acquire()
        if hold_s:
            time.sleep(hold_s)
        release(trigger)

    while True:
        c = os.read(cfd, 1)
        if c in (b"", b"q"):
            return
        if c == b"a":
            acquire()
        elif c == b"r":
            release(False)
        elif c == b"x":
            release(True)
        elif c == b"c":
            cycle(True)
        elif c == b"n":
            say(b"N", _now())
            os.read(tr, 1)
            cycle(True)
        elif c == b"l":
            for _ in range(loops):
                cycle(False)
            say(b"D", _now())
        elif c == b"v":
            import gpulock

            with open(os.path.join(arg_path(target), "which"), "w") as f:
                f.write(os.path.dirname(os.path.abspath(gpulock.__file__)))
            say(b"V", 0)
        elif c == b"t":
            import gpulock

            for _ in range(loops):
                t0 = _now()
                try:
                    lease = gpulock.acquire(
                        gpu=0, timeout=arg, name=f"bench-{idx}", state_dir=target
                    )
                except gpulock.LockTimeout:
                    say(b"T", _now() - t0)
                else:
                    lease.release()
                    say(b"E", _now() - t0)


# The parent's side ---------------------------------------------------------------------------


class BenchError(Exception):
    """A measurement could not complete (a child hung or died)."""


@dataclass(frozen=True, slots=True)
class Ev:
    code: str
    idx: int
    t: int


_CTX: Any = None
_GROUPS: set[Group] = set()
_QUIET = False


def log(msg: str) -> None:
    if not _QUIET:
        print(msg, file=sys.stderr, flush=True)


def ctx() -> Any:
    global _CTX
    if _CTX is None:
        c = multiprocessing.get_context("forkserver")
        # What the children import, once, in the forkserver.  (Python 3.11's forkserver does
        # not preload "__main__": each child re-imports this file, so its imports are listed.)
        c.set_forkserver_preload(
            [
                "__main__",
                *("argparse", "json", "platform", "random", "statistics", "subprocess"),
                *("tempfile", "fcntl", "gpulock", "gpulock.lock.lease", "filelock"),
            ]
        )
        _CTX = c
    return _CTX


class Group:
    """The children of one measurement: their command pipes and one shared report pipe."""

    def __init__(
        self,
        kind: str,
        folder: Path,
        *,
        hold_s: float = 0.0,
        loops: int = 0,
        arg: float = 0.0,
        trigger: bool = False,
    ) -> None:
        self.kind = kind
        self.folder = folder
        folder.mkdir(mode=0o700, parents=True)
        self.target = str(folder) if kind == "gpulock" else str(folder / "lock")
        self.gpu_dir = folder / "gpu0"
        self.hold_s, self.loops, self.arg = hold_s, loops, arg
        c = ctx()
        self._rep_r, self._rep_w = c.Pipe(duplex=False)
        os.set_blocking(self._rep_r.fileno(), False)
        self._trig_r, self._trig_w = c.Pipe(duplex=False) if trigger else (None, None)
        self.procs: list[Any] = []
        self._cmds: list[Any] = []
        self.events: list[Ev] = []
        self._buf = b""
        _GROUPS.add(self)

    # -- processes --
    def spawn(self, n: int) -> range:
        c = ctx()
        first = len(self.procs)
        for i in range(first, first + n):
            cmd_r, cmd_w = c.Pipe(duplex=False)
            p = c.Process(
                target=child_main,
                args=(
                    self.kind,
                    self.target,
                    i,
                    cmd_r,
                    self._rep_w,
                    self._trig_r,
                    self._trig_w,
                    self.hold_s,
                    self.loops,
                    self.arg,
                ),
                name=f"bench-{self.kind}-{i}",
                daemon=True,
            )
            p.start()
            cmd_r.close()
            self.procs.append(p)
            self._cmds.append(cmd_w)
        return range(first, first + n)

    def send(self, idx: int, cmd: bytes) -> None:
        try:
            os.write(self._cmds[idx].fileno(), cmd)
        except OSError as e:
            raise BenchError(f"{self.kind}: child {idx} is gone ({e})") from None

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(Exception):
                if p.is_alive():
                    p.kill()
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.join(5)
                p.close()
        for conn in (*self._cmds, self._rep_r, self._rep_w, self._trig_r, self._trig_w):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        self.procs, self._cmds = [], []
        _GROUPS.discard(self)

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reports --
    def pump(self, timeout_s: float) -> None:
        fd = self._rep_r.fileno()
        r, _, _ = select.select([fd], [], [], max(0.0, timeout_s))
        if not r:
            return
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._buf += chunk
            if len(chunk) < 65536:
                break
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            code, idx, t = line.split()
            self.events.append(Ev(code.decode(), int(idx), int(t)))

    def wait(self, pred: Callable[[], Any], what: str, limit_s: float = WAIT_LIMIT_S) -> Any:
        deadline = time.monotonic() + limit_s
        while True:
            got = pred()
            if got:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"{self.kind}: timed out after {limit_s:g} s waiting for {what}")
            self.pump(min(left, 1.0))

    def find(self, code: str, idx: int | None = None, since: int = 0) -> list[Ev]:
        return [e for e in self.events[since:] if e.code == code and (idx is None or e.idx == idx)]

    def wait_for(
        self,
        code: str,
        idx: int | None = None,
        since: int = 0,
        count: int = 1,
        limit_s: float = WAIT_LIMIT_S,
    ) -> list[Ev]:
        who = "any child" if idx is None else f"child {idx}"
        evs: list[Ev] = self.wait(
            lambda: (f := self.find(code, idx, since)) and len(f) >= count and f,
            f"{count} x {code!r} from {who}",
            limit_s,
        )
        return evs

    def wait_each(self, code: str, ids: Iterable[int], since: int = 0) -> dict[int, Ev]:
        want = set(ids)

        def got() -> dict[int, Ev] | None:
            seen: dict[int, Ev] = {}
            for e in self.events[since:]:
                if e.code == code and e.idx in want and e.idx not in seen:
                    seen[e.idx] = e
            return seen if len(seen) == len(want) else None

        result: dict[int, Ev] = self.wait(got, f"{code!r} from {len(want)} children")
        return result

    def mark(self) -> int:
        return len(self.events)

    # -- "visibly waiting" --
    def tickets(self) -> int:
        try:
            return sum(1 for n in os.listdir(self.gpu_dir) if n.endswith(".ticket"))
        except FileNotFoundError:
            return 0

    def settle(self, tickets: int | None = None, other_s: float = OTHER_SETTLE_S) -> None:
        """Return once the waiters just commanded are (very probably) blocked.

        gpulock: their ticket files exist (the queue order is then fixed), plus 1 ms to reach
        poll().  flock / py-filelock: nothing is visible from outside, so the child's "about to
        block" report (already received) plus a settle time.
        """
        if self.kind == "gpulock":
            if tickets is not None:
                deadline = time.monotonic() + WAIT_LIMIT_S
                while self.tickets() < tickets:
                    if time.monotonic() > deadline:
                        raise BenchError(f"gpulock: {tickets} tickets never appeared")
                    time.sleep(0.0002)
            time.sleep(GPULOCK_SETTLE_S)
        else:
            time.sleep(other_s)

    def jitter(self, poll_s: float) -> None:
        """py-filelock only: release at a random phase of the waiters' polling."""
        if self.kind == "filelock":
            time.sleep(random.uniform(0.0, poll_s))

    def pids(self, ids: Iterable[int]) -> list[int]:
        return [self.procs[i].pid for i in ids]


def tick_seconds(pids: Iterable[int]) -> float:
    """CPU time (utime + stime) from ``/proc/<pid>/stat``, in clock ticks (10 ms resolution)."""
    hz = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # fields 14 and 15 overall
        except (OSError, ValueError, IndexError):
            return math.nan
    return total / hz


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU time the processes have used (user + system), in ns precision (schedstat)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            return math.nan
    return total


def cleanup_all() -> None:
    for g in list(_GROUPS):
        g.close()


# Statistics ------------------------------------------------------------------------------------


def pct(sorted_vals: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_vals:
        return math.nan
    k = max(1, math.ceil(q / 100 * len(sorted_vals)))
    return sorted_vals[k - 1]


def summarize(ms: list[float]) -> dict[str, Any]:
    s = sorted(ms)
    return {
        "n": len(s),
        "p50": statistics.median(s) if s else math.nan,
        "p99": pct(s, 99),
        "mean": statistics.fmean(s) if s else math.nan,
        "max": s[-1] if s else math.nan,
        "samples_ms": [round(v, 4) for v in ms],
    }


# Measurements ------------------------------------------------------------------------------------


class Bench:
    def __init__(self, root: Path, quick: bool, poll_s: float) -> None:
        self.root = root
        self.quick = quick
        self.poll_s = poll_s
        self._n = 0

    def folder(self, what: str, kind: str) -> Path:
        self._n += 1
        return self.root / f"{self._n:03d}-{what}-{kind}"

    # (a), (e): a relay; the releaser re-queues only after the grant, so every release has
    # exactly `n` waiters and no regrab can happen.
    def handoff(self, kind: str, n: int, rounds: int) -> dict[str, Any]:
        with Group(kind, self.folder(f"handoff{n}", kind)) as g:
            g.spawn(1)
            g.send(0, b"a")
            g.wait_for("G", 0)
            for start in range(1, n + 1, BATCH):
                mark = g.mark()
                ids = g.spawn(min(BATCH, n + 1 - start))
                for i in ids:
                    g.send(i, b"a")
                g.wait_each("W", ids, since=mark)
                g.settle(tickets=ids[-1] + 1)
            holder = 0
            lat: list[float] = []
            overlaps = 0
            t_start = time.monotonic()
            cpu0 = cpu_seconds(g.pids(range(n + 1)))
            for _ in range(rounds):
                g.jitter(self.poll_s)
                mark = g.mark()
                g.send(holder, b"r")
                rel = g.wait_for("R", holder, since=mark)[0]
                grant = g.wait_for("G", None, since=mark)[0]
                if grant.t < rel.t:
                    overlaps += 1
                lat.append((grant.t - rel.t) / 1e6)
                g.send(holder, b"a")
                g.wait_for("W", holder, since=mark)
                g.settle(tickets=n + 1)
                extra = g.find("G", None, since=mark)
                if len(extra) > 1:
                    overlaps += len(extra) - 1
                holder = grant.idx
            span = time.monotonic() - t_start
            cpu = cpu_seconds(g.pids(range(n + 1))) - cpu0
            out = summarize(lat)
            out.update(
                queue=n,
                rounds=rounds,
                overlaps=overlaps,
                seconds=round(span, 2),
                cpu_s=round(cpu, 4),
                cpu_pct_core=100.0 * cpu / span,
                cpu_ms_per_handoff=1e3 * cpu / rounds if rounds else math.nan,
            )
            return out

    # (b) FIFO: k waiters queued one after another, then at each of the first k handoffs a
    # newcomer calls acquire() right when the holder releases.
    def fifo(self, kind: str, trials: int, k: int) -> dict[str, Any]:
        queued_inv = newcomer_inv = jumpers = pairs_checked = 0
        newcomers_total = 0
        for trial in range(trials):
            with Group(
                kind, self.folder(f"fifo{trial}", kind), hold_s=FIFO_HOLD_S, trigger=True
            ) as g:
                g.spawn(1 + 2 * k)
                g.send(0, b"a")
                g.wait_for("G", 0)
                visible: dict[int, int] = {}
                for i in range(1, k + 1):
                    mark = g.mark()
                    g.send(i, b"c")
                    g.wait_for("W", i, since=mark)
                    g.settle(tickets=i + 1, other_s=FIFO_SETTLE_S)
                    visible[i] = _now()
                newcomers = range(k + 1, 2 * k + 1)
                for j in newcomers:
                    g.send(j, b"n")
                g.wait_each("N", newcomers)
                time.sleep(0.005)  # they are blocked reading the trigger pipe
                g.send(0, b"x")
                grants = g.wait_each("G", range(1, 2 * k + 1))
                arrive = {e.idx: e.t for e in g.find("W") if e.idx > 0}
                for j in newcomers:
                    visible[j] = arrive[j] + int(NEWCOMER_MARGIN_S * 1e9)
                newcomers_total += k
                jumped: set[int] = set()
                for a in range(1, 2 * k + 1):
                    for b in range(1, 2 * k + 1):
                        if a == b or not visible[a] < arrive[b]:
                            continue  # b did not arrive after a was visibly waiting
                        pairs_checked += 1
                        if grants[b].t < grants[a].t:  # b overtook a
                            if b > k:
                                newcomer_inv += 1
                                jumped.add(b)
                            else:
                                queued_inv += 1
                jumpers += len(jumped)
        return {
            "trials": trials,
            "queued": k,
            "newcomers": newcomers_total,
            "pairs_checked": pairs_checked,
            "queued_inversions": queued_inv,
            "newcomer_inversions": newcomer_inv,
            "newcomers_jumped": jumpers,
            "inversions": queued_inv + newcomer_inv,
        }

    # (c) regrabs: n processes each loop acquire / hold 1 ms / release / re-acquire.
    def regrab(self, kind: str, n: int, loops: int) -> dict[str, Any]:
        with Group(kind, self.folder("regrab", kind), hold_s=REGRAB_HOLD_S, loops=loops) as g:
            ids = g.spawn(n)
            for i in ids:
                g.send(i, b"l")
            g.wait_each("D", ids)
            per: dict[int, list[Ev]] = {i: [] for i in ids}
            for e in g.events:
                per[e.idx].append(e)
            waits: list[tuple[int, int, int]] = []  # (idx, W, G)
            grants: list[tuple[int, int, int]] = []  # (G, idx, R)
            for i, evs in per.items():
                w = None
                g_t = None
                for e in evs:
                    if e.code == "W":
                        w = e.t
                    elif e.code == "G":
                        g_t = e.t
                        assert w is not None
                        waits.append((i, w, e.t))
                    elif e.code == "R":
                        assert g_t is not None
                        grants.append((g_t, i, e.t))
            grants.sort()
            eligible = regrabs = overlaps = 0
            margin = int(REGRAB_MARGIN_S * 1e9)
            for (_g0, r, t_rel), (g1, nxt, _r1) in itertools.pairwise(grants):
                if g1 < t_rel:
                    overlaps += 1
                # Someone else was waiting, and had been for a while: a process that only just
                # called acquire() may not be queued yet (gpulock: no ticket yet).
                if any(q != r and w + margin < t_rel < gt for q, w, gt in waits):
                    eligible += 1
                    regrabs += nxt == r
            return {
                "processes": n,
                "grants": len(grants),
                "eligible": eligible,
                "regrabs": regrabs,
                "share_pct": 100.0 * regrabs / eligible if eligible else math.nan,
                "overlaps": overlaps,
            }

    # (d) idle waiters' CPU while a holder holds.
    def idle_cpu(self, kind: str, n: int, window_s: float) -> dict[str, Any]:
        with Group(kind, self.folder("idle", kind)) as g:
            g.spawn(1)
            g.send(0, b"a")
            g.wait_for("G", 0)
            mark = g.mark()
            ids = g.spawn(n)
            for i in ids:
                g.send(i, b"a")
            g.wait_each("W", ids, since=mark)
            g.settle(tickets=n + 1)
            time.sleep(0.3)
            pids = list(g.pids(ids))

            def cpu() -> tuple[float, float]:
                return tick_seconds(pids), cpu_seconds(pids)

            c0, s0 = cpu()
            t0 = time.monotonic()
            time.sleep(window_s)
            c1, s1 = cpu()
            t1 = time.monotonic()
            if g.find("G", None, since=mark):
                raise BenchError(f"{kind}: a waiter was granted while the holder held")
            span = t1 - t0
            return {
                "waiters": n,
                "window_s": round(span, 3),
                "cpu_s": round(c1 - c0, 4),
                "pct_core": 100.0 * (c1 - c0) / span,
                "schedstat_cpu_s": round(s1 - s0, 6),
                "schedstat_pct_core": 100.0 * (s1 - s0) / span,
            }

    # (f) gpulock: acquire(timeout=0.2) behind a holder.
    def timeouts(self, tries: int, timeout_s: float) -> dict[str, Any]:
        with Group("gpulock", self.folder("timeout", "gpulock"), loops=tries, arg=timeout_s) as g:
            g.spawn(2)
            g.send(0, b"a")
            g.wait_for("G", 0)
            g.send(1, b"t")
            evs = g.wait(
                lambda: (f := [e for e in g.events if e.code in "TE"]) and len(f) >= tries and f,
                f"{tries} timeouts",
                limit_s=WAIT_LIMIT_S + tries * timeout_s,
            )
            if any(e.code == "E" for e in evs):
                raise BenchError("gpulock: acquire(timeout=...) was granted behind a holder")
            over = [e.t / 1e6 - timeout_s * 1e3 for e in evs]
            out = summarize(over)
            out["timeout_s"] = timeout_s
            out["min"] = min(over)
            return out

    # (g) the holder is SIGKILLed; how soon is the waiter granted?
    def sigkill(self, kind: str, tries: int) -> dict[str, Any]:
        with Group(kind, self.folder("sigkill", kind)) as g:
            g.spawn(1)
            g.send(0, b"a")
            g.wait_for("G", 0)
            lat: list[float] = []
            for i in range(1, tries + 1):
                mark = g.mark()
                g.spawn(1)
                g.send(i, b"a")
                g.wait_for("W", i, since=mark)
                g.settle(tickets=2)
                g.jitter(self.poll_s)
                t_kill = _now()
                os.kill(g.procs[i - 1].pid, signal.SIGKILL)
                grant = g.wait_for("G", i, since=mark)[0]
                lat.append((grant.t - t_kill) / 1e6)
                g.procs[i - 1].join(5)
            return summarize(lat)

    # (h) gpulock status with 100 tickets.
    def status(self, tickets: int, calls: int, cli_runs: int) -> dict[str, Any]:
        from gpulock import status as st
        from gpulock.core.settings import load

        with Group("gpulock", self.folder("status", "gpulock")) as g:
            g.spawn(1)
            g.send(0, b"a")
            g.wait_for("G", 0)
            for start in range(1, tickets, BATCH):
                mark = g.mark()
                ids = g.spawn(min(BATCH, tickets - start))
                for i in ids:
                    g.send(i, b"a")
                g.wait_each("W", ids, since=mark)
                g.settle(tickets=ids[-1] + 1)
            settings = load(state_dir=g.folder)
            times: list[float] = []
            snap: dict[str, Any] = {}
            for _ in range(calls + 1):
                t0 = time.perf_counter_ns()
                snap = st.snapshot(settings)
                times.append((time.perf_counter_ns() - t0) / 1e6)
            cold, warm = times[0], times[1:]
            q = snap["gpus"][0]
            seen = len(q["holders"]) + len(q["waiters"])
            if seen != tickets:
                raise BenchError(f"gpulock status saw {seen} tickets, not {tickets}")
            t0 = time.perf_counter_ns()
            st.render(snap)
            render_ms = (time.perf_counter_ns() - t0) / 1e6
            exe = Path(sys.executable).with_name("gpulock")
            cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gpulock.cli"]
            env = {**os.environ, "GPULOCK_STATE_DIR": str(g.folder)}
            cli: list[float] = []
            for _ in range(cli_runs):
                t0 = time.perf_counter_ns()
                res = subprocess.run(
                    [*cmd, "status"], env=env, capture_output=True, check=False, timeout=60
                )
                cli.append((time.perf_counter_ns() - t0) / 1e6)
                if res.returncode != 0:
                    raise BenchError(f"gpulock status failed: {res.stderr.decode()[-300:]}")
            out = summarize(warm)
            out.update(
                tickets=tickets,
                cold_ms=cold,
                render_ms=render_ms,
                cli=summarize(cli),
            )
            return out


def start_children(root: Path, mine: Path) -> None:
    """Start the forkserver; check that the children run the gpulock this process imported.

    The forkserver puts its working folder first on sys.path (and ignores ours), so it is
    started from the empty temp folder: a ./gpulock in our working folder must not win.
    """
    cwd = os.getcwd()
    os.chdir(root)
    try:
        with Group("flock", root / "000-which") as g:
            g.spawn(1)
            g.send(0, b"v")
            g.wait_for("V", 0)
            theirs = (g.folder / "which").read_text()
    finally:
        os.chdir(cwd)
    if Path(theirs) != mine.absolute():
        raise SystemExit(f"the children import gpulock from {theirs}, this process from {mine}")


# Running everything -------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    rounds: int
    fifo_trials: int
    fifo_k: int
    regrab_procs: int
    regrab_loops: int
    idle_waiters: int
    idle_s: float
    queues: tuple[int, ...]
    queue_rounds: int
    filelock_queue_rounds: int
    timeout_tries: int
    kill_tries: int
    status_calls: int
    cli_runs: int


FULL = Plan(200, 5, 8, 4, 50, 20, 3.0, (10, 100, 500), 100, 20, 20, 20, 20, 5)
QUICK = Plan(60, 2, 8, 4, 20, 20, 1.5, (10, 100), 40, 15, 8, 8, 10, 3)


def run_all(
    bench: Bench, plan: Plan, kinds: Sequence[str], measure: str = "abcdefgh"
) -> dict[str, Any]:
    res: dict[str, Any] = {}

    def attempt(key: str, label: str, fn: Callable[[], dict[str, Any]]) -> None:
        log(f"  {label} ...")
        t0 = time.monotonic()
        try:
            res[key] = fn()
        except BenchError as e:
            log(f"    error: {e}")
            res[key] = {"error": str(e)}
        finally:
            cleanup_all()
        res[key]["elapsed_s"] = round(time.monotonic() - t0, 2)

    for kind in kinds:
        log(f"{LABELS[kind]}:")
        steps: list[tuple[str, str, Callable[[], dict[str, Any]]]] = [
            ("handoff1", "(a) handoff, 1 waiter", partial(bench.handoff, kind, 1, plan.rounds)),
            (
                "handoff16",
                "(a) handoff, queue of 16",
                partial(bench.handoff, kind, 16, plan.rounds),
            ),
            (
                "fifo",
                "(b) FIFO + newcomers",
                partial(bench.fifo, kind, plan.fifo_trials, plan.fifo_k),
            ),
            (
                "regrab",
                "(c) regrabs",
                partial(bench.regrab, kind, plan.regrab_procs, plan.regrab_loops),
            ),
            (
                "idle",
                "(d) idle waiters' CPU",
                partial(bench.idle_cpu, kind, plan.idle_waiters, plan.idle_s),
            ),
        ]
        for n in plan.queues:
            capped = kind == "filelock" and n >= FILELOCK_CAP_FROM
            rounds = plan.filelock_queue_rounds if capped else plan.queue_rounds
            steps.append(
                (
                    f"queue{n}",
                    f"(e) handoff, queue of {n} ({rounds} rounds)",
                    partial(bench.handoff, kind, n, rounds),
                )
            )
        steps.append(
            ("sigkill", "(g) grant after SIGKILL", partial(bench.sigkill, kind, plan.kill_tries))
        )
        if kind == "gpulock":
            steps.append(
                (
                    "timeout",
                    "(f) timeout overshoot",
                    partial(bench.timeouts, plan.timeout_tries, 0.2),
                )
            )
            steps.append(
                (
                    "status",
                    "(h) status with 100 tickets",
                    partial(bench.status, 100, plan.status_calls, plan.cli_runs),
                )
            )
        for key, label, fn in steps:
            if label[1] in measure:
                attempt(f"{key}.{kind}", label, fn)
    return res


# Report ------------------------------------------------------------------------------------------


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.{digits}f}"
    return str(v)


def get(res: dict[str, Any], key: str, field: str) -> Any:
    r = res.get(key)
    if r is None:
        return None
    if "error" in r:
        return "error"
    cur: Any = r
    for part in field.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return cur


def num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not math.isnan(float(v)) else None


@dataclass
class Target:
    text: str
    ok: bool | None  # None: could not be judged (an error, or not measured)
    short: str


def judge(res: dict[str, Any], plan: Plan) -> list[Target]:
    out: list[Target] = []

    def g(key: str, field: str, kind: str = "gpulock") -> float | None:
        return num(get(res, f"{key}.{kind}", field))

    def check(text: str, short: str, pred: Callable[..., bool], *vals: float | None) -> None:
        ok = None if any(v is None for v in vals) else bool(pred(*vals))
        out.append(Target(text, ok, short))

    p50, p99 = g("handoff1", "p50"), g("handoff1", "p99")
    check("1-waiter handoff p50 <= 2 ms", "handoff p50", lambda a: a <= 2.0, p50)
    check(
        "1-waiter handoff >= 10x shorter than py-filelock (p50)",
        "10x py-filelock",
        lambda a, f: f >= 10 * a,
        p50,
        g("handoff1", "p50", "filelock"),
    )
    check("1-waiter handoff p99 <= 10 ms", "handoff p99", lambda a: a <= 10.0, p99)
    check(
        "queue-of-16 handoff within 3x of raw flock (p50)",
        "queue-16 vs flock",
        lambda a, k: a <= 3 * k,
        g("handoff16", "p50"),
        g("handoff16", "p50", "flock"),
    )
    check(
        "0 FIFO inversions (newcomers at the handoff included)",
        "inversions",
        lambda a: a == 0,
        g("fifo", "inversions"),
    )
    check("regrabs <= 5 %", "regrabs", lambda a: a <= 5.0, g("regrab", "share_pct"))
    idle = [v for v in (g("idle", "pct_core"), g("idle", "schedstat_pct_core")) if v is not None]
    check(
        "20 idle waiters ~ 0 CPU (<= 0.5 % of one core, /proc stat ticks and schedstat)",
        "idle CPU",
        lambda a: a <= 0.5,
        max(idle) if idle else None,
    )
    check("timeout overshoot <= 10 ms (max)", "timeout", lambda a: a <= 10.0, g("timeout", "max"))
    check(
        "grant within 10 ms of SIGKILL (max)", "SIGKILL", lambda a: a <= 10.0, g("sigkill", "max")
    )
    small, big = plan.queues[0], plan.queues[-1]
    check(
        f"latency flat from queue {small} to {big} (p50 <= 2x + 0.5 ms)",
        f"flat to {big}",
        lambda a, b: b <= 2 * a + 0.5,
        g(f"queue{small}", "p50"),
        g(f"queue{big}", "p50"),
    )
    check(
        "status with 100 tickets <= 50 ms of its own work (p50)",
        "status",
        lambda a: a <= 50.0,
        g("status", "p50"),
    )
    return out


def table(res: dict[str, Any], plan: Plan, targets: list[Target]) -> str:
    rows: list[tuple[str, ...]] = []

    def row(label: str, key: str, field: str, kinds: Sequence[str] = KINDS, note: str = "") -> None:
        cells = []
        for k in KINDS:
            if k not in kinds:
                cells.append("")
                continue
            v = get(res, f"{key}.{k}", field)
            cells.append(fmt(v))
        rows.append((label, *cells, note))

    def section(title: str) -> None:
        rows.append((title, "", "", "", ""))

    byshort = {x.short: x for x in targets}

    def verdict(short: str) -> str:
        x = byshort.get(short)
        if x is None:
            return ""
        return {True: "PASS", False: "FAIL", None: "n/a"}[x.ok] + f"  {x.text}"

    def ratio(label: str, key: str, num_kind: str, den_kind: str, note: str) -> None:
        a = num(get(res, f"{key}.{num_kind}", "p50"))
        b = num(get(res, f"{key}.{den_kind}", "p50"))
        cell = f"{a / b:.1f}x" if a is not None and b else "n/a"
        rows.append((label, cell, "", "", note))

    section("(a) handoff, 1 waiter, ms")
    row("    p50", "handoff1", "p50", note=verdict("handoff p50"))
    row("    p99", "handoff1", "p99", note=verdict("handoff p99"))
    row("    mean", "handoff1", "mean")
    ratio(
        "    py-filelock p50 / gpulock p50",
        "handoff1",
        "filelock",
        "gpulock",
        verdict("10x py-filelock"),
    )
    row("    rounds", "handoff1", "n")
    row("    CPU of both per handoff, ms", "handoff1", "cpu_ms_per_handoff")
    section("(a) handoff, queue of 16, ms")
    row("    p50", "handoff16", "p50")
    row("    p99", "handoff16", "p99")
    row("    mean", "handoff16", "mean")
    row("    CPU of all 17 per handoff, ms", "handoff16", "cpu_ms_per_handoff")
    ratio(
        "    gpulock p50 / flock p50",
        "handoff16",
        "gpulock",
        "flock",
        verdict("queue-16 vs flock"),
    )
    section(f"(b) FIFO, {plan.fifo_trials} x ({plan.fifo_k} queued + {plan.fifo_k} newcomers)")
    row("    inversions, all (pairs)", "fifo", "inversions", note=verdict("inversions"))
    row("    inversions among queued (pairs)", "fifo", "queued_inversions")
    row("    newcomers that jumped the queue", "fifo", "newcomers_jumped")
    row("    newcomers at a handoff", "fifo", "newcomers")
    section(f"(c) regrabs, {plan.regrab_procs} procs x {plan.regrab_loops} loops")
    row("    regrabs, % of contended grants", "regrab", "share_pct", note=verdict("regrabs"))
    row("    contended grants", "regrab", "eligible")
    section(f"(d) {plan.idle_waiters} idle waiters, {plan.idle_s:g} s")
    row("    CPU, % of one core", "idle", "pct_core", note=verdict("idle CPU"))
    row("    CPU, % (schedstat, ns)", "idle", "schedstat_pct_core")
    for n in plan.queues:
        section(f"(e) handoff, queue of {n}, ms")
        note = verdict(f"flat to {plan.queues[-1]}") if n == plan.queues[-1] else ""
        row("    p50", f"queue{n}", "p50", note=note)
        row("    p99", f"queue{n}", "p99")
        row("    mean", f"queue{n}", "mean")
        row("    rounds", f"queue{n}", "n")
        row("    CPU of all N+1 per handoff, ms", f"queue{n}", "cpu_ms_per_handoff")
    section("(f) acquire(timeout=0.2) overshoot, ms")
    row("    p50", "timeout", "p50", kinds=("gpulock",))
    row("    max", "timeout", "max", kinds=("gpulock",), note=verdict("timeout"))
    section("(g) grant after holder's SIGKILL, ms")
    row("    p50", "sigkill", "p50")
    row("    max", "sigkill", "max", note=verdict("SIGKILL"))
    section("(h) status, 100 tickets, ms")
    row("    snapshot() p50", "status", "p50", kinds=("gpulock",), note=verdict("status"))
    row("    snapshot() first call", "status", "cold_ms", kinds=("gpulock",))
    row("    render()", "status", "render_ms", kinds=("gpulock",))
    row("    `gpulock status` wall p50", "status", "cli.p50", kinds=("gpulock",))
    section("sanity: mutual-exclusion overlaps")
    for key in ("handoff1", "handoff16", *(f"queue{n}" for n in plan.queues)):
        row(f"    {key}", key, "overlaps")
    row("    regrab", "regrab", "overlaps")

    header = ("measurement", *(LABELS[k] for k in KINDS), "gpulock target")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(4)]
    lines = []

    def line(r: tuple[str, ...]) -> str:
        cells = [r[0].ljust(widths[0])] + [r[i].rjust(widths[i]) for i in range(1, 4)]
        return ("  ".join(cells) + "  " + r[4]).rstrip()

    lines.append(line(header))
    lines.append("-" * (sum(widths) + 6 + len(header[4])))
    lines.extend(line(r) for r in rows)
    return "\n".join(lines)


def summary(res: dict[str, Any], plan: Plan, targets: list[Target]) -> str:
    def v(key: str, field: str, kind: str = "gpulock") -> str:
        return fmt(get(res, f"{key}.{kind}", field))

    big = plan.queues[-1]
    fl, fk = "filelock", "flock"
    h1, inv, rg, idle = "handoff1", "fifo", "regrab", "idle"
    qb = f"queue{big}"
    parts = [
        f"gpulock handoff p50 {v(h1, 'p50')} ms, p99 {v(h1, 'p99')} ms "
        f"(py-filelock {v(h1, 'p50', fl)} ms, flock {v(h1, 'p50', fk)} ms)",
        f"queue-16 p50 {v('handoff16', 'p50')} ms (flock {v('handoff16', 'p50', fk)} ms)",
        f"{v(inv, 'inversions')} inversions "
        f"(py-filelock {v(inv, 'inversions', fl)}, flock {v(inv, 'inversions', fk)})",
        f"{v(rg, 'share_pct')} % regrabs "
        f"(py-filelock {v(rg, 'share_pct', fl)} %, flock {v(rg, 'share_pct', fk)} %)",
        f"idle waiters {v(idle, 'pct_core')} % CPU (py-filelock {v(idle, 'pct_core', fl)} %)",
        f"queue {big} p50 {v(qb, 'p50')} ms (flock {v(qb, 'p50', fk)} ms)",
        f"timeout overshoot max {v('timeout', 'max')} ms",
        f"SIGKILL grant max {v('sigkill', 'max')} ms",
        f"status(100) {v('status', 'p50')} ms",
    ]
    failed = [x.text for x in targets if x.ok is False]  # the target itself, not its label
    unknown = [x.text for x in targets if x.ok is None]
    if not failed and not unknown:
        verdict = "all targets met"
    else:
        verdict = ""
        if failed:
            verdict = "FAILED: " + ", ".join(failed)
        if unknown:
            verdict += ("; " if verdict else "") + "not judged: " + ", ".join(unknown)
    return "summary: " + ", ".join(parts) + "; " + verdict


def fs_type(path: Path) -> str:
    """The filesystem type of ``path`` (from /proc/self/mounts), e.g. ext4 or tmpfs."""
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def notes(plan: Plan, poll_s: float, fs: str) -> str:
    poll = f"{poll_s * 1e3:g} ms"
    capped = [n for n in plan.queues if n >= FILELOCK_CAP_FROM]
    cap = (
        f"    Its queue-{'/'.join(map(str, capped))} run is capped at"
        f" {plan.filelock_queue_rounds} rounds (500 pollers on 2 cores)."
        if capped
        else None
    )
    lines = [
        "notes:",
        "  (a)(e) handoff = next holder's acquire() returned - holder about to call release(),",
        "    CLOCK_MONOTONIC in both processes.  The releaser queues again only after the grant,",
        "    so every release has exactly N waiters behind it and none can be a regrab.",
        f"  py-filelock polls every {poll} (its default); each of its releases comes a random",
        f"    0-{poll} after the waiters blocked, so its polling phase is uniform.",
        cap,
        "  'visibly waiting': gpulock = its ticket file exists"
        f" (+{GPULOCK_SETTLE_S * 1e3:g} ms); flock and py-filelock show",
        "    nothing outside, so: the child reported 'about to block' through a pipe, then a",
        f"    settle time ({FIFO_SETTLE_S * 1e3:g} ms in (b), {OTHER_SETTLE_S * 1e3:g} ms"
        " elsewhere).",
        "  (b) a newcomer calls acquire() right as each holder releases (woken by the holder",
        "    just before release()); inversion = granted before someone who was visibly",
        "    waiting when it called acquire().",
        f"  (c) {plan.regrab_procs} processes loop acquire / hold {REGRAB_HOLD_S * 1e3:g} ms /"
        " release / acquire again; a grant is",
        "    contended when another process had called acquire()"
        f" >= {REGRAB_MARGIN_S * 1e3:g} ms before the release.",
        f"  State folders and lock files: a fresh temp folder per measurement, on {fs}.",
    ]
    return "\n".join(x for x in lines if x is not None)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, queues of 10 and 100 only")
    ap.add_argument("--json", metavar="FILE", help="write the raw figures to FILE")
    ap.add_argument(
        "--only", choices=KINDS, action="append", help="measure only this lock (repeatable)"
    )
    ap.add_argument(
        "--queues",
        metavar="N,N,...",
        help="queue lengths for (e) (default: 10,100,500; --quick: 10,100)",
    )
    ap.add_argument(
        "--measure",
        metavar="LETTERS",
        default="abcdefgh",
        help="run only these measurements, e.g. 'ae' (default: abcdefgh, all)",
    )
    ap.add_argument(
        "--tmpdir",
        metavar="DIR",
        help="where the temp state folders / lock files go (default: $TMPDIR or /tmp); "
        "its filesystem matters, e.g. /dev/shm (tmpfs) vs an ext4 home",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    global _QUIET
    _QUIET = args.quiet

    import filelock

    import gpulock

    poll_default = filelock_default_poll()
    plan = QUICK if args.quick else FULL
    if not args.measure or set(args.measure) - set("abcdefgh"):
        ap.error("--measure takes letters from abcdefgh")
    if args.queues:
        try:
            queues = tuple(int(x) for x in args.queues.split(",") if x.strip())
        except ValueError:
            ap.error("--queues takes numbers separated by commas, e.g. 10,100,500")
        if not queues or min(queues) < 1:
            ap.error("--queues needs at least one queue length >= 1")
        plan = dataclasses.replace(plan, queues=queues)
    kinds = tuple(args.only) if args.only else KINDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * max(plan.queues) + 512
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # the same cleanup as Ctrl-C

    signal.signal(signal.SIGTERM, on_term)

    root = Path(tempfile.mkdtemp(prefix="gpulock-bench-", dir=args.tmpdir)).absolute()
    load0 = os.getloadavg()
    t0 = time.monotonic()
    log(
        f"gpulock {gpulock.__version__}, filelock {filelock.__version__} (default poll_interval "
        f"{poll_default * 1000:g} ms), {os.cpu_count()} CPUs, load {load0[0]:.2f}, "
        f"{'quick' if args.quick else 'full'} run in {root}; gpulock from "
        f"{Path(gpulock.__file__).parent}"
    )
    try:
        start_children(root, Path(gpulock.__file__).parent)
        res = run_all(Bench(root, args.quick, poll_default), plan, kinds, args.measure)
    except KeyboardInterrupt:
        log("interrupted: stopping every child")
        return 130
    finally:
        cleanup_all()
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.monotonic() - t0
    load1 = os.getloadavg()
    targets = judge(res, plan)
    meta = {
        "mode": "quick" if args.quick else "full",
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "loadavg_start": load0,
        "loadavg_end": load1,
        "elapsed_s": round(elapsed, 1),
        "gpulock": gpulock.__version__,
        "gpulock_path": str(Path(gpulock.__file__).parent),
        "filelock": filelock.__version__,
        "filelock_default_poll_interval_s": poll_default,
        "start_method": "forkserver",
        "tmp_fs": fs_type(root),
        "plan": dataclasses.asdict(plan),
    }
    print(
        f"lock handoff benchmark ({meta['mode']}): python {meta['python']}, kernel "
        f"{meta['kernel']}, {meta['cpus']} CPUs, load {load0[0]:.2f} -> {load1[0]:.2f}, "
        f"{elapsed:.0f} s"
    )
    print(f"gpulock {gpulock.__version__} imported from {meta['gpulock_path']}")
    print(
        f"py-filelock {filelock.__version__}: FileLock default poll_interval "
        f"{poll_default * 1000:g} ms; flock: blocking LOCK_EX on one file"
    )
    print()
    print(table(res, plan, targets))
    print()
    print(notes(plan, poll_default, meta["tmp_fs"]))
    print()
    line = summary(res, plan, targets)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "meta": meta,
                    "results": res,
                    "targets": [dataclasses.asdict(x) for x in targets],
                    "summary": line,
                },
                indent=1,
            )
        )
    print(line)
    return 0


def filelock_default_poll() -> float:
    """py-filelock's current default poll interval, read from its signature."""
    import inspect

    import filelock

    p = inspect.signature(filelock.FileLock.__init__).parameters.get("poll_interval")
    if p is None or not isinstance(p.default, int | float):
        return math.nan
    return float(p.default)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
