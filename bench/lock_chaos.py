#!/usr/bin/env python3
"""Chaos for the lock: 50 processes contend for one GPU while some are SIGKILLed or stopped.

About 50 contender processes loop ``gpulock.acquire`` (exclusive, a random timeout of 3-10 s)
/ hold 0-2 ms / release on GPU 0 of a fresh state folder (a simulated 24 GiB GPU).  The bench
process is the killer: every ~23 grants it SIGKILLs the holder or a random waiter (and starts
a new contender in its place), every ~400 grants it SIGSTOPs one for 0.2-1 s and SIGCONTs it.
Then it audits the contenders' records of their holds, the state folder's event log
(``events.jsonl``) and its own record of the signals it sent:

* overlaps: a grant while another contender still held the (exclusive) GPU.  A contender
  records ``G`` after ``acquire`` returned and ``R`` before it calls ``release``; a hold ends
  at ``R`` or at the SIGKILL of its process: each lies inside the real hold, so an overlap is
  a real one;
* order violations: a grant while a ticket with a smaller number was waiting (it had written
  its ``wait`` event and had not been granted, timed out, cleaned up or killed);
* wedges: a stretch of at least 2 s without a grant that no SIGSTOP overlaps (50 live
  contenders are always waiting);
* exit waits on live processes: ``exit-wait`` events whose dead pid the bench had not killed;
* the handoff: a contender's ``R`` to the next ``G`` while someone waited (no stop or kill
  in between, no wedge around it), p50 and p99; and a holder's SIGKILL to the next grant.

Contenders are forked from a "zygote" process per copy of gpulock, which imported it once,
so a replacement starts in milliseconds.  ``--base REV`` exports gpulock at a git revision
and runs it side by side with this checkout, alternating, round by round (``--rounds``).

With ``--gpus 4 --mix`` (issue 28) the host has four simulated GPUs and each acquire is, at
random, pinned to one GPU (half of them), ``gpu="any"`` (a third) or two GPUs at once
(``gpus=2``, the rest); the audit is per GPU (an overlap is two holds of one GPU at once; an
order violation, a grant of a GPU while an earlier ticket whose set has that GPU waited), and
it also counts

* stuck waits (deadlocks): a wait that outlived the longest timeout (10 s) by 2 s while its
  process ran: no acquire can be stuck longer than its timeout without a deadlock;
* what is left behind: once every contender is gone, one last ``acquire`` of every GPU at once
  cleans what the dead left in each line, is granted, and releases; then no ticket and no FIFO
  may remain in any GPU's folder.

Run ``python bench/lock_chaos.py`` (10,000 grants, a minute or two on 2 cores) or
``--grants 2000``; ``--base 2cf5bdb --rounds 3`` compares with the code before issue 30;
``--gpus 4 --mix`` runs the mix.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WEDGE_S = 2.0  # no grant for this long, nothing stopped: the line is wedged
STOP_MARGIN_S = 0.1  # a stop's shadow: the stopped process takes a moment to resume
TIMEOUT_S = (3.0, 10.0)  # each acquire's timeout, uniform
HOLD_S = (0.0, 0.002)  # each hold, uniform
KILL_EVERY = 23  # grants between SIGKILLs (issue 30's run: 431 in 10,117 grants)
STOP_EVERY = 400  # grants between SIGSTOPs (issue 30's run: 24)
STOP_S = (0.2, 1.0)
STALL_LIMIT_S = 60.0  # no grant at all for this long: the run is abandoned
ENV_AUDIT = "GPULOCK_CHAOS_AUDIT"  # where contenders record their holds
ENV_GPUS = "GPULOCK_CHAOS_GPUS"  # the simulated host's GPUs
ENV_MIX = "GPULOCK_CHAOS_MIX"  # "1": pinned, any and two-GPU acquires at random
MIX = (("pinned", 0.5), ("any", 0.35), ("two", 0.15))  # each acquire's kind, and its share
STUCK_S = TIMEOUT_S[1] + WEDGE_S  # a wait this long (its process running) is stuck


def log(msg: str) -> None:
    if not _QUIET:
        print(msg, file=sys.stderr, flush=True)


_QUIET = False

# --- the zygote and its contenders (run with --zygote) ----------------------------------------


def zygote(code: str) -> int:
    """Import gpulock once, then fork a contender per "spawn IDX SEED" line on stdin."""
    import gpulock

    where = Path(gpulock.__file__).resolve().parent
    if code and where != (Path(code) / "gpulock").resolve():
        print(f"error gpulock imported from {where}, not from {code}", flush=True)
        return 1
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # contenders are reaped by the kernel
    print(f"ready {where}", flush=True)
    for line in sys.stdin:
        cmd, idx, seed = line.split()
        if cmd != "spawn":
            continue
        pid = os.fork()
        if pid == 0:
            try:
                devnull = os.open(os.devnull, os.O_RDWR)
                os.dup2(devnull, 0)
                os.dup2(devnull, 1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                contend(gpulock, int(idx), int(seed))
            finally:
                os._exit(0)
        print(f"{idx} {pid}", flush=True)
    return 0


def contend(gpulock: Any, idx: int, seed: int) -> None:
    """Acquire, hold, release, for ever.  ``G`` is recorded after ``acquire`` returned and ``R``
    before ``release`` is called, one ``write`` each on an ``O_APPEND`` descriptor: a recorded
    hold lies inside the real one, so recorded holds that overlap prove a real overlap."""
    rng = random.Random(seed)
    audit = os.open(os.environ[ENV_AUDIT], os.O_WRONLY | os.O_APPEND)
    pid = os.getpid()
    n_gpus = int(os.environ.get(ENV_GPUS, "1"))
    mix = os.environ.get(ENV_MIX) == "1"
    while True:
        ask: dict[str, Any] = {"gpu": 0}
        if mix:
            kind = rng.choices([k for k, _ in MIX], [w for _, w in MIX])[0]
            if kind == "pinned":
                ask = {"gpu": rng.randrange(n_gpus)}
            elif kind == "any":
                ask = {"gpu": "any"}
            else:
                ask = {"gpu": "any", "gpus": 2}
        try:
            lease = gpulock.acquire(timeout=rng.uniform(*TIMEOUT_S), name=f"c{idx}", **ask)
        except gpulock.LockTimeout:
            continue
        except Exception as e:  # reported, and the contender goes on: the audit will tell
            print(f"c{idx}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            time.sleep(0.1)
            continue
        if mix:
            where = ",".join(map(str, lease.gpus)).encode()
            os.write(audit, b"G %d %d %d %s\n" % (lease.ticket, pid, time.time_ns(), where))
        else:
            os.write(audit, b"G %d %d %d\n" % (lease.ticket, pid, time.time_ns()))
        time.sleep(rng.uniform(*HOLD_S))
        os.write(audit, b"R %d %d %d\n" % (lease.ticket, pid, time.time_ns()))
        lease.release()


# --- one run: contenders, the killer, the event log --------------------------------------------


@dataclass
class Signalled:
    """What the bench did, for the audit: kills, stops (with their end)."""

    kills: list[tuple[float, int]] = field(default_factory=list)  # (wall, pid)
    stops: list[tuple[float, float, int]] = field(default_factory=list)  # (from, to, pid)


class Zygote:
    def __init__(self, code: Path, root: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--zygote", str(code)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=root,
            env=env,
            start_new_session=True,
            text=True,
        )
        first = self._line(30.0)
        if not first.startswith("ready "):
            raise SystemExit(f"the contenders' zygote failed: {first}")
        self.where = first.split(" ", 1)[1]
        self.n = 0

    def _line(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline().strip() if r else ""
        if not line:
            raise SystemExit("the contenders' zygote did not answer")
        return line

    def spawn(self, rng: random.Random) -> int:
        assert self.proc.stdin is not None
        self.n += 1
        self.proc.stdin.write(f"spawn {self.n} {rng.randrange(1 << 30)}\n")
        self.proc.stdin.flush()
        _idx, pid = self._line(30.0).split()
        return int(pid)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)  # every contender is in its group
        self.proc.wait()


class Tail:
    """The event log, read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0
        self.buf = b""
        self.events: list[dict[str, Any]] = []
        self.grants = 0

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        self.pos += len(chunk)
        *lines, self.buf = (self.buf + chunk).split(b"\n")
        for raw in lines:
            try:
                e = json.loads(raw)
            except ValueError:
                continue
            self.events.append(e)
            self.grants += e.get("event") == "acquire"


def tickets(gpu_dir: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        names = os.listdir(gpu_dir)
    except FileNotFoundError:
        return out
    for n in names:
        if n.endswith(".ticket"):
            with contextlib.suppress(OSError, ValueError):
                out.append(json.loads((gpu_dir / n).read_bytes()))
    return out


def run_once(
    code: Path,
    root: Path,
    grants: int,
    contenders: int,
    seed: int,
    n_gpus: int = 1,
    mix: bool = False,
) -> dict[str, Any]:
    """One run against the gpulock in ``code``; the audit's figures."""
    root.mkdir(parents=True)
    state, config, holds = root / "state", root / "gpulock.yaml", root / "holds.log"
    holds.touch()
    config.write_text("events_max_bytes: 4GiB  # one log for the whole run: the audit reads it\n")
    env = {
        **os.environ,
        "PYTHONPATH": str(code),
        "GPULOCK_STATE_DIR": str(state),
        "GPULOCK_CONFIG": str(config),
        "GPULOCK_SIMULATE": ",".join(["24GiB"] * n_gpus),
        ENV_AUDIT: str(holds),
        ENV_GPUS: str(n_gpus),
        ENV_MIX: "1" if mix else "0",
    }
    env.pop("GPULOCK_TICKET", None)
    rng = random.Random(seed)
    z = Zygote(code, root, env)
    did = Signalled()
    live: set[int] = set()
    stopped: dict[int, tuple[float, float]] = {}  # pid -> (stopped at wall, continue at mono)
    tail = Tail(state / "events.jsonl")
    start_wall = time.time()
    next_kill, next_stop = KILL_EVERY, STOP_EVERY
    last_grants, last_change = 0, time.monotonic()
    abandoned = None
    said = 0
    try:
        for _ in range(contenders):
            live.add(z.spawn(rng))
        next_check = time.monotonic() + 1.0
        while tail.grants < grants:
            time.sleep(0.005)
            tail.read()
            now = time.monotonic()
            for pid, (since, until) in list(stopped.items()):
                if now >= until:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                    did.stops.append((since, time.time(), pid))
                    del stopped[pid]
            if tail.grants >= next_kill:
                next_kill += KILL_EVERY
                victim = pick(rng, state, live, stopped, holder=rng.random() < 0.5)
                if victim is not None:
                    did.kills.append((time.time(), victim))
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(victim, signal.SIGKILL)
                    live.discard(victim)
                    live.add(z.spawn(rng))
            if tail.grants >= next_stop:
                next_stop += STOP_EVERY
                victim = pick(rng, state, live, stopped, holder=rng.random() < 0.5)
                if victim is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(victim, signal.SIGSTOP)
                    stopped[victim] = (time.time(), now + rng.uniform(*STOP_S))
            if now >= next_check:  # a contender that died by itself is replaced
                next_check = now + 1.0
                for pid in [p for p in live if not os.path.exists(f"/proc/{p}")]:
                    live.discard(pid)
                    live.add(z.spawn(rng))
            if tail.grants != last_grants:
                last_grants, last_change = tail.grants, now
            elif now - last_change > STALL_LIMIT_S:
                abandoned = f"no grant for {STALL_LIMIT_S:g} s"
                break
            if tail.grants // 1000 > said:
                said = tail.grants // 1000
                log(f"    {tail.grants} grants, {len(did.kills)} kills, {len(did.stops)} stops")
    finally:
        for pid, (since, _until) in stopped.items():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            did.stops.append((since, time.time(), pid))
        end_wall = time.time()
        z.close()
    tail.read()
    out = audit(tail.events, read_holds(holds), did, start_wall, end_wall)
    out["gpulock"] = z.where
    out["seconds"] = round(end_wall - start_wall, 1)
    out["left_behind"] = sweep(code, env, state, n_gpus)
    if abandoned:
        out["abandoned"] = abandoned
    return out


SWEEP = """\
import sys, gpulock
n = int(sys.argv[1])
lease = gpulock.acquire(gpu="any" if n > 1 else 0, gpus=n if n > 1 else None, timeout=60,
                        name="sweep")
lease.release()
"""


def sweep(code: Path, env: dict[str, str], state: Path, n_gpus: int) -> int | str:
    """Once every contender is gone: one last acquire of every GPU at once, which cleans what
    the dead left ahead of it in each line; then the files left in the GPUs' folders (0)."""
    r = subprocess.run(
        [sys.executable, "-c", SWEEP, str(n_gpus)],
        env={**env, "PYTHONPATH": str(code)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if r.returncode != 0:
        return f"the last acquire failed: {r.stderr.strip().splitlines()[-1:]}"
    return sum(
        1
        for folder in state.glob("gpu[0-9]*")
        for n in os.listdir(folder)
        if n.endswith((".ticket", ".fifo"))
    )


def read_holds(path: Path) -> list[tuple[float, str, int, int, tuple[int, ...]]]:
    """The contenders' records: (wall time, "G" or "R", ticket, pid, GPUs granted)."""
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            kind, seq, pid, ns, *where = line.split()
            gpus = tuple(int(g) for g in where[0].split(",")) if where else (0,)
            out.append((int(ns) / 1e9, kind, int(seq), int(pid), gpus))
    return out


def pick(
    rng: random.Random, state: Path, live: set[int], stopped: dict[int, Any], *, holder: bool
) -> int | None:
    """The holder (``holder``) or a random waiter among the live, unstopped contenders."""
    everyone = [t for d in sorted(state.glob("gpu[0-9]*")) for t in tickets(d)]
    ts = [t for t in everyone if t.get("pid") in live and t.get("pid") not in stopped]
    pool = [t["pid"] for t in ts if bool(t.get("granted_wall")) == holder]
    if not pool:
        pool = [t["pid"] for t in ts]
    return rng.choice(pool) if pool else None


# --- the audit: pure, over the event log and the bench's own record ----------------------------


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(values)
    if not s:
        return math.nan
    return s[max(1, math.ceil(q / 100 * len(s))) - 1]


def kind_of(e: dict[str, Any]) -> str:
    """``pinned``, ``any`` or ``two``: what a wait/acquire/timeout event's ticket asked for."""
    asked = e.get("gpus")
    if isinstance(asked, int) and asked > 1:
        return "two"
    return "any" if isinstance(asked, list) and len(asked) > 1 else "pinned"


def set_of(e: dict[str, Any]) -> frozenset[int]:
    """The GPUs a ticket may take, from its event (a pinned ticket's: its ``gpu``)."""
    for key in ("gpu_set", "gpus"):
        if isinstance(e.get(key), list):
            return frozenset(e[key])
    return frozenset({e.get("gpu", 0)})


def audit(
    events: list[dict[str, Any]],
    holds: Sequence[tuple[Any, ...]],  # (wall, "G"/"R", ticket, pid[, GPUs])
    did: Signalled,
    start_wall: float,
    end_wall: float,
) -> dict[str, Any]:
    """Count grants, overlaps, order violations, wedges, stuck waits, exit waits on live
    processes; measure handoffs.  Every time is a wall-clock stamp: the events' ``ts``, the
    contenders' hold records, the bench's own for the signals it sent.

    Holds (overlaps, handoffs) come from the contenders' records (``contend``); the line
    (waiters, order, wedges, exit waits) from the event log, whose ``release`` is stamped
    after the ticket is gone, when the successor may already hold: it cannot end a hold.  On
    several GPUs both are per GPU: an overlap is two holds sharing a GPU, an order violation
    a grant of a GPU while an earlier ticket whose set has it waited.
    """
    timeline: list[tuple[float, int, str, dict[str, Any]]] = []
    for i, e in enumerate(events):
        timeline.append((float(e["ts"]), i, str(e["event"]), e))
    n = len(timeline)
    for j, (at, what, number, who, *where) in enumerate(holds):  # where: GPUs (one: gpu0)
        gpus = where[0] if where else (0,)
        timeline.append((at, n + j, what, {"ticket": number, "pid": who, "gpus": gpus}))
    n = len(timeline)
    for j, (at, who) in enumerate(did.kills):
        timeline.append((at, n + j, "KILL", {"pid": who}))
    timeline.sort(key=lambda x: (x[0], x[1]))
    stops = [(a, b + STOP_MARGIN_S) for a, b, _pid in did.stops]

    def stopped_within(a: float, b: float, pid: int | None = None) -> bool:
        return any(
            s < b and a < e and (pid is None or p == pid)
            for (s, e), (_a, _b, p) in zip(stops, did.stops, strict=True)
        )

    holding: dict[int, tuple[int, tuple[int, ...]]] = {}  # ticket -> (pid, GPUs), per holds
    waiting: dict[int, tuple[int, frozenset[int], float]] = {}  # ticket -> (pid, set, since)
    killed: set[int] = set()
    grants = overlaps = violations = timeouts = stuck = 0
    kills = {"holder": 0, "waiter": 0, "other": 0}
    exit_waits = exit_waits_live = exit_alive = 0
    grant_times: list[float] = []
    handoffs: list[tuple[float, float]] = []  # (release, next grant)
    kill_grants: list[float] = []
    by_kind = {"pinned": 0, "any": 0, "two": 0}
    two_waits: list[float] = []
    two_timeouts = 0
    released_at: float | None = None
    killed_holder_at: float | None = None

    def resolved(seq: Any, at: float) -> None:
        nonlocal stuck
        got = waiting.pop(seq, None)
        if got is not None and at - got[2] > STUCK_S and not stopped_within(got[2], at, got[0]):
            stuck += 1

    for ts, _i, kind, e in timeline:
        seq: Any = e.get("ticket")
        if kind == "KILL":
            pid = e["pid"]
            killed.add(pid)
            role = "holder" if pid in (p for p, _g in holding.values()) else "other"
            if role == "other" and pid in (p for p, _s, _t in waiting.values()):
                role = "waiter"
            kills[role] += 1
            if role == "holder":
                killed_holder_at = ts
            released_at = None  # a handoff with a kill inside is not a plain one
            for s in [s for s, (p, _g) in holding.items() if p == pid]:
                del holding[s]
            for s in [s for s, (p, _x, _t) in waiting.items() if p == pid]:
                del waiting[s]
        elif kind == "G":
            mine = set(e["gpus"])
            if any(s != seq and mine & set(g) for s, (_p, g) in holding.items()):
                overlaps += 1
            if e["pid"] in killed:
                # Written between the bench's stamp of its SIGKILL and the kill itself (the
                # stamp comes first): a hold the kill ends at once, as nothing is written after.
                continue
            holding[seq] = (e["pid"], tuple(e["gpus"]))
            if released_at is not None and not stopped_within(released_at, ts):
                handoffs.append((released_at, ts))
            if killed_holder_at is not None:
                kill_grants.append(ts - killed_holder_at)
            released_at = killed_holder_at = None
        elif kind == "R":
            holding.pop(seq, None)
            released_at = ts if waiting else None
        elif kind == "wait":
            waiting[seq] = (e["pid"], set_of(e), ts)
        elif kind == "acquire":
            grants += 1
            grant_times.append(ts)
            by_kind[kind_of(e)] += 1
            if kind_of(e) == "two":
                two_waits.append(float(e.get("waited_s") or 0.0))
            took = set(e.get("granted") or [e.get("gpu", 0)])
            if any(s < seq and took & st for s, (_p, st, _t) in waiting.items() if s != seq):
                violations += 1
            resolved(seq, ts)
        elif kind == "timeout":
            timeouts += 1
            two_timeouts += kind_of(e) == "two"
            resolved(seq, ts)
        elif kind in ("cleanup", "leave"):
            resolved(seq, ts)
        elif kind == "exit-wait":
            exit_waits += 1
            dead = {e.get("dead_pid"), e.get("dead_child_pid")} - {None}
            if not dead & killed:
                exit_waits_live += 1
        elif kind == "exit-wait-alive":
            exit_alive += 1
    for pid, _st, since in waiting.values():  # still waiting at the end: stuck since when?
        if end_wall - since > STUCK_S and not stopped_within(since, end_wall, pid):
            stuck += 1
    wedges: list[tuple[float, float]] = []  # (from, to)
    longest = 0.0
    for a, b in zip([start_wall, *grant_times], [*grant_times, end_wall], strict=True):
        if b - a >= WEDGE_S and not stopped_within(a, b):
            wedges.append((a, b))
        if not stopped_within(a, b):
            longest = max(longest, b - a)
    # The handoffs of a line that moves: one a wedge swallowed is counted as the wedge.
    moving_at = [(a, b) for a, b in handoffs if not any(w < b and a < x for w, x in wedges)]
    moving = [b - a for a, b in moving_at]
    return {
        "grants": grants,
        "grants_pinned": by_kind["pinned"],
        "grants_any": by_kind["any"],
        "grants_two": by_kind["two"],
        "two_gpu_timeouts": two_timeouts,
        "two_gpu_wait_max_s": max(two_waits, default=math.nan),
        "kills": len(did.kills),
        "kills_holder": kills["holder"],
        "kills_waiter": kills["waiter"],
        "stops": len(did.stops),
        "timeouts": timeouts,
        "overlaps": overlaps,
        "order_violations": violations,
        "stuck_waits": stuck,
        "wedges": len(wedges),
        "wedge_list": [(round(a - start_wall, 3), round(b - a, 3)) for a, b in wedges],
        "longest_gap_s": round(longest, 3),
        "exit_waits": exit_waits,
        "exit_waits_live": exit_waits_live,
        "exit_wait_alive": exit_alive,
        "handoffs": len(moving),
        "handoff_p50_ms": pct(moving, 50) * 1e3,
        "handoff_p99_ms": pct(moving, 99) * 1e3,
        "handoff_samples": [
            (round(a - start_wall, 6), round((b - a) * 1e3, 3)) for a, b in moving_at
        ],
        "kill_grant_p50_ms": pct(kill_grants, 50) * 1e3,
        "kill_grant_max_ms": max(kill_grants, default=math.nan) * 1e3,
    }


# --- the report ---------------------------------------------------------------------------------


@dataclass
class Target:
    text: str
    ok: bool | None  # None: not judged
    short: str


ROWS = [
    ("grants", "grants"),
    ("  ...pinned / any / two-GPU", "by_kind"),
    ("two-GPU: timeouts", "two_gpu_timeouts"),
    ("two-GPU: longest wait granted, s", "two_gpu_wait_max_s"),
    ("SIGKILLs (holders / waiters)", "kills"),
    ("SIGSTOPs", "stops"),
    ("timeouts", "timeouts"),
    ("overlaps", "overlaps"),
    ("FIFO order violations", "order_violations"),
    ("wedges (>= 2 s, nothing stopped)", "wedges"),
    ("stuck waits (deadlocks)", "stuck_waits"),
    ("left behind after a last acquire", "left_behind"),
    ("longest gap without a grant, s", "longest_gap_s"),
    ("exit waits", "exit_waits"),
    ("  ...on live processes", "exit_waits_live"),
    ("exit-wait-alive events", "exit_wait_alive"),
    ("handoffs measured", "handoffs"),
    ("handoff p50, ms", "handoff_p50_ms"),
    ("handoff p99, ms", "handoff_p99_ms"),
    ("holder SIGKILL -> grant p50, ms", "kill_grant_p50_ms"),
    ("holder SIGKILL -> grant max, ms", "kill_grant_max_ms"),
    ("run time, s", "seconds"),
]


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}"
    return str(v)


def cell(r: dict[str, Any], key: str) -> str:
    if "error" in r:
        return "error"
    if key == "kills":
        return f"{r['kills']} ({r['kills_holder']}/{r['kills_waiter']})"
    if key == "by_kind":
        return f"{r['grants_pinned']} / {r['grants_any']} / {r['grants_two']}"
    return fmt(r.get(key))


def table(runs: list[dict[str, Any]]) -> str:
    header = ["measurement", *(f"{r['label']} #{r['round']}" for r in runs)]
    rows = [[label, *(cell(r, key) for r in runs)] for label, key in ROWS]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(
            [
                row[0].ljust(widths[0]),
                *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)),
            ]
        )

    return "\n".join([line(header), "-" * (sum(widths) + 2 * len(widths) - 2), *map(line, rows)])


def judge(runs: list[dict[str, Any]], judged: str, base: str | None) -> list[Target]:
    mine = [r for r in runs if r["label"] == judged]
    ok = [r for r in mine if "error" not in r and "abandoned" not in r]

    def total(key: str) -> int | None:
        return sum(r[key] for r in ok) if ok and len(ok) == len(mine) else None

    def zero(text: str, short: str, key: str) -> Target:
        t = total(key)
        return Target(text, None if t is None else t == 0, short)

    left = [r.get("left_behind") for r in ok] if ok and len(ok) == len(mine) else None
    out = [
        zero("0 wedges", "wedges", "wedges"),
        zero("0 overlaps", "overlaps", "overlaps"),
        zero("0 FIFO order violations", "order", "order_violations"),
        zero("0 stuck waits (deadlocks)", "stuck", "stuck_waits"),
        Target(
            "nothing left behind (a last acquire of every GPU cleans every line)",
            None if left is None else all(x == 0 for x in left),
            "left behind",
        ),
        zero("0 exit waits begun on live processes", "exit waits", "exit_waits_live"),
    ]
    p99 = pooled_p99(mine)
    before = pooled_p99([r for r in runs if r["label"] == base]) if base else None
    vs = f"<= 1.25x {base}'s + 0.5 ms, all rounds together" if base else "no --base run"
    out.append(
        Target(
            f"handoff p99 unchanged ({vs})",
            None if p99 is None or before is None else p99 <= 1.25 * before + 0.5,
            "handoff p99",
        )
    )
    return out


def pooled_p99(runs: list[dict[str, Any]]) -> float | None:
    """The p99 of every handoff of these runs together (the runs' own p99s swing with the
    machine's other load from one run to the next); the median of their p99s without samples."""
    ok = [r for r in runs if "error" not in r]
    samples = [ms for r in ok for _at, ms in r.get("handoff_samples", ())]
    if samples:
        return pct(samples, 99)
    vals = sorted(v for r in ok if not math.isnan(v := r["handoff_p99_ms"]))
    return vals[len(vals) // 2] if vals else None


def summary(
    runs: list[dict[str, Any]], judged: str, base: str | None, targets: list[Target]
) -> str:
    def part(label: str) -> str:
        rs = [r for r in runs if r["label"] == label and "error" not in r]
        if not rs:
            return f"{label}: no run"

        def s(key: str) -> int:
            return sum(int(r[key]) for r in rs)

        samples = [ms for r in rs for _at, ms in r.get("handoff_samples", ())]
        p50 = pct(samples, 50) if samples else sorted(r["handoff_p50_ms"] for r in rs)[len(rs) // 2]
        p99 = pooled_p99(rs)
        mix = rs[0].get("gpus", 1) > 1
        kinds = (
            f" ({s('grants_pinned')} pinned, {s('grants_any')} any, {s('grants_two')} two-GPU "
            f"on {rs[0]['gpus']} GPUs)"
            if mix
            else ""
        )
        left = sum(r["left_behind"] for r in rs if isinstance(r.get("left_behind"), int))
        return (
            f"{label}: {s('grants')} grants{kinds} in {len(rs)} run(s), {s('kills')} SIGKILLs, "
            f"{s('wedges')} wedges, {s('overlaps')} overlaps, "
            f"{s('order_violations')} order violations, {s('stuck_waits')} deadlocks, "
            f"{left} left behind, "
            f"{s('exit_waits_live')} exit waits on live processes, "
            f"handoff p50 {fmt(p50)} ms p99 {fmt(p99 if p99 is not None else math.nan)} ms"
            + (" (all runs' handoffs together)" if samples and len(rs) > 1 else "")
        )

    parts = [part(judged)] + ([f"({part(base)})"] if base else [])
    failed = [t.text for t in targets if t.ok is False]
    unknown = [t.text for t in targets if t.ok is None]
    verdict = "all targets met" if not failed and not unknown else ""
    if failed:
        verdict = "FAILED: " + ", ".join(failed)
    if unknown:
        verdict += ("; " if verdict else "") + "not judged: " + ", ".join(unknown)
    return "summary: " + " ".join(parts) + "; " + verdict


# --- main ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def exported(rev: str, into: Path) -> Iterator[Path]:
    """gpulock/ as it was at ``rev`` (``git archive``), in a folder of its own."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "gpulock"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise SystemExit(f"git archive {rev}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    yield into


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grants", type=int, default=10_000, help="grants per run (10,000)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per copy of gpulock, in a row")
    ap.add_argument("--contenders", type=int, default=50)
    ap.add_argument("--base", metavar="REV", help="also run gpulock as of this git revision")
    ap.add_argument("--code", metavar="PATH", help="the checkout judged (default: this one)")
    ap.add_argument("--seed", type=int, default=30)
    ap.add_argument("--gpus", type=int, default=1, help="simulated GPUs of the host (1)")
    ap.add_argument(
        "--mix", action="store_true", help="pinned, any and two-GPU acquires (needs --gpus >= 2)"
    )
    ap.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    ap.add_argument("--tmpdir", metavar="DIR", help="where the state folders go")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--zygote", metavar="CODE", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.zygote is not None:
        return zygote(args.zygote)
    global _QUIET
    _QUIET = args.quiet
    if args.grants < 1 or args.rounds < 1 or args.contenders < 2:
        ap.error("--grants and --rounds at least 1, --contenders at least 2")
    if args.gpus < 1 or (args.mix and args.gpus < 2):
        ap.error("--gpus at least 1, and at least 2 with --mix")
    if args.mix and args.base:
        ap.error("--mix asks for sets of GPUs, which a gpulock before issue 28 cannot: no --base")

    root = Path(tempfile.mkdtemp(prefix="gpulock-chaos-", dir=args.tmpdir)).absolute()
    code = Path(args.code).resolve() if args.code else REPO
    judged = f"code {code}" if args.code else "this checkout"
    runs: list[dict[str, Any]] = []
    load0 = os.getloadavg()
    t0 = time.monotonic()

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        with contextlib.ExitStack() as stack:
            copies = []
            if args.base:
                base_code = stack.enter_context(exported(args.base, root / "base"))
                copies.append((f"base {args.base}", base_code))
            copies.append((judged, code))
            for rnd in range(1, args.rounds + 1):
                # Each copy goes first in turn: neither always meets the machine as the
                # other one left it.
                for label, path in copies if rnd % 2 else copies[::-1]:
                    log(f"{label}, round {rnd}: {args.grants} grants ...")
                    seed = args.seed * 1000 + rnd  # both copies meet the same chaos
                    folder = root / f"{label.replace(' ', '-')}-{rnd}"
                    r = run_once(
                        path, folder, args.grants, args.contenders, seed, args.gpus, args.mix
                    )
                    r.update(label=label, round=rnd, gpus=args.gpus, mix=args.mix)
                    runs.append(r)
                    shutil.rmtree(folder, ignore_errors=True)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        shutil.rmtree(root, ignore_errors=True)
    order = [label for label, _path in copies]
    runs.sort(key=lambda r: (r["round"], order.index(r["label"])))  # side by side per round
    base = f"base {args.base}" if args.base else None
    targets = judge(runs, judged, base)
    load1 = os.getloadavg()
    host = f"{args.gpus} simulated GPUs, " if args.gpus > 1 else ""
    mix = "pinned/any/two-GPU mix, " if args.mix else ""
    print(
        f"lock chaos: {args.rounds} round(s) of {args.grants} grants, {args.contenders} "
        f"contenders, {host}{mix}python {platform.python_version()}, kernel {platform.release()}, "
        f"{os.cpu_count()} CPUs, load {load0[0]:.2f} -> {load1[0]:.2f}, "
        f"{time.monotonic() - t0:.0f} s"
    )
    for label in dict.fromkeys(r["label"] for r in runs):
        where = next(r["gpulock"] for r in runs if r["label"] == label)
        print(f"{label}: gpulock from {where}")
    print()
    print(table(runs))
    for r in runs:
        if r.get("wedge_list"):
            print(f"{r['label']} #{r['round']} wedges (at s, lasting s): {r['wedge_list']}")
        if r.get("abandoned"):
            print(f"{r['label']} #{r['round']} abandoned: {r['abandoned']}")
    print()
    for t in targets:
        print({True: "PASS", False: "FAIL", None: "n/a "}[t.ok], t.text)
    print()
    line = summary(runs, judged, base, targets)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"runs": runs, "targets": [asdict(t) for t in targets], "summary": line},
                indent=1,
            )
        )
    print(line)
    return 0 if all(t.ok is not False for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
