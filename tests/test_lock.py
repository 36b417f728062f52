"""The lock with real processes: FIFO order, mutual exclusion, crashes, timeouts, hung holders.

Every "other process" here is a real one (tests/procs.py), driven through its stdin; the test
process itself takes part only where noted (try-once probes, crafted tickets).  Waits poll a
condition with a deadline; no test sleeps and hopes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from procs import Child, World, alive, intervals, overlapping, wait_until

import gpulock
from gpulock.core import identity
from gpulock.lock.ticket import Ticket, encode, fifo_name, file_name

GIB = 1024**3
HANDOFF_WAIT_S = 60.0  # "eventually": only a kernel wake-up can hand over in the tests below
NO_SAFETY_RECHECK = "3600"  # the waiters' timed safety re-check, pushed past every deadline


@pytest.fixture
def no_safety_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters started after this (they inherit the environment) re-check only after an hour.

    A handoff within a test's deadline is then a kernel wake-up (a claim's POLLERR, a
    doorbell), never the timed guard: the tests assert that it happens, not how fast.
    """
    monkeypatch.setenv("GPULOCK_SAFETY_RECHECK_S", NO_SAFETY_RECHECK)


def grant_order(world: World) -> list[str]:
    return [r.name for r in world.records() if r.kind == "grant"]


def holding_now(world: World) -> set[str]:
    """Names with a grant record and no release record yet."""
    held: set[str] = set()
    for r in world.records():
        if r.kind == "grant":
            held.add(r.name)
        elif r.kind == "release":
            held.discard(r.name)
    return held


def files_of(world: World, seq: int, gpu: int = 0) -> list[str]:
    d = world.gpu_dir(gpu)
    return [n for n in (file_name(seq), fifo_name(seq)) if os.path.lexists(d / n)]


def assert_exclusive(world: World, killed: dict[str, int] | None = None) -> None:
    pairs = overlapping(intervals(world.records(), killed))
    assert not pairs, f"two holders at once: {pairs}\n{world.describe()}"


def release_in_turn(world: World, children: list[Child]) -> None:
    """Let each child hold in turn: wait for its grant, check it holds alone, release it."""
    for child in children:
        world.wait_record("grant", child.name)
        assert holding_now(world) == {child.name}, world.describe()
        child.release()
    for child in children:
        assert child.wait_exit() == 0, child.stderr()


def craft_ticket(world: World, seq: int, pid: int, **fields: object) -> Ticket:
    """A ticket file written by hand into gpu0/, owned by nobody unless a test says so."""
    me = identity.current()
    values: dict[str, Any] = {
        "seq": seq,
        "gpu": 0,
        "pid": pid,
        "uid": me.uid,
        "user": me.user,
        "host": socket.gethostname(),
        "name": "crafted",
        "created_wall": time.time(),
        "start_ticks": identity.start_ticks(pid),
        "boot_id": me.boot_id,
        "pidns": me.pidns,
        "granted_wall": time.time(),
    }
    t = Ticket(**{**values, **fields})
    (world.gpu_dir() / file_name(seq)).write_bytes(encode(t))
    return t


def make_queue_dir(world: World) -> Path:
    """Create the state folder and gpu0/ the way gpulock does (private modes, checked)."""
    return world.settings().gpu_dir(0)


# --- 1. FIFO order and mutual exclusion --------------------------------------------------------


@pytest.mark.slow
def test_sixteen_processes_are_served_one_at_a_time_in_arrival_order(world: World) -> None:
    first = world.hold("p00")
    waiters = [world.enqueue(f"p{i:02d}") for i in range(1, 17)]
    everyone = [first, *waiters]
    seqs = [c.seq or 0 for c in everyone]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "arrival order is ticket order"

    release_in_turn(world, everyone)

    assert grant_order(world) == [c.name for c in everyone]
    grants = {r.name: r.ticket for r in world.records() if r.kind == "grant"}
    assert [grants[c.name] for c in everyone] == seqs
    assert_exclusive(world)
    assert world.tickets() == {}
    assert not [n for n in os.listdir(world.gpu_dir()) if n.endswith((".ticket", ".fifo"))]


def test_processes_arriving_at_once_get_distinct_numbers_and_are_served_in_that_order(
    world: World,
) -> None:
    racers = [world.spawn(f"r{i}", gate=True) for i in range(8)]
    for r in racers:  # all started and imported; now they race for numbers
        r.send("queue")
    for r in racers:
        r.seq = world.wait_ticket(r)
    assert len({r.seq for r in racers}) == len(racers), "two processes took the same number"
    in_line = sorted(racers, key=lambda r: r.seq or 0)
    release_in_turn(world, in_line)
    assert grant_order(world) == [r.name for r in in_line]
    assert_exclusive(world)


# --- 2. a holder killed ------------------------------------------------------------------------


def test_sigkilled_holder_passes_the_gpu_on_by_a_kernel_wake_up(
    world: World, no_safety_recheck: None
) -> None:
    holder = world.hold("holder")
    chain = [world.queued(f"w{i}") for i in range(3)]
    killed: dict[str, int] = {}  # when each holder died: its interval ends there
    for victim, heir in zip([holder, *chain], chain, strict=False):
        killed[victim.name] = time.monotonic_ns()
        victim.killpg(signal.SIGKILL)
        world.wait_record("grant", heir.name, timeout_s=HANDOFF_WAIT_S)
        assert victim.wait_exit() == -signal.SIGKILL
        assert victim.seq is not None
        assert files_of(world, victim.seq) == [], "the dead holder's ticket was not cleaned"
        cleanups = world.events("cleanup", ticket=victim.seq)
        assert [e["by_pid"] for e in cleanups] == [heir.pid]
    last = chain[-1]
    last.release()
    assert last.wait_exit() == 0
    assert grant_order(world) == ["holder", "w0", "w1", "w2"]
    assert_exclusive(world, killed)


# --- 3. a waiter killed in the middle of the queue ---------------------------------------------


def test_sigkilled_waiter_leaves_the_queue_and_the_rest_run_in_order(world: World) -> None:
    holder = world.hold("holder")
    w = [world.queued(f"w{i}") for i in range(4)]
    victim = w[1]
    assert victim.seq is not None

    victim.killpg(signal.SIGKILL)
    assert victim.wait_exit() == -signal.SIGKILL
    # The one behind it watched it: it wakes, removes the dead ticket and watches w0 instead.
    wait_until(lambda: not files_of(world, victim.seq or 0), 5, "the dead waiter's ticket removed")
    assert [e["by_pid"] for e in world.events("cleanup", ticket=victim.seq)] == [w[2].pid]

    release_in_turn(world, [holder, w[0], w[2], w[3]])
    assert grant_order(world) == ["holder", "w0", "w2", "w3"]
    assert world.find_record("grant", "w1") is None
    assert_exclusive(world)


# --- 4. timeouts -------------------------------------------------------------------------------


def test_timeout_behind_a_holder_leaves_cleanly_and_the_queue_relinks(
    world: World, no_safety_recheck: None
) -> None:
    holder = world.hold("holder")
    # Started ahead, queued on a word: all three are in line well within the quitter's 3 s
    # (0.3 s was not always enough on a loaded machine: the others then queued after it left).
    quitter = world.spawn("quitter", timeout=3, gate=True, linger=True)
    behind = [world.spawn(f"b{i}", gate=True) for i in range(2)]
    for child in (quitter, *behind):
        child.send("queue")
        child.seq = world.wait_ticket(child)
    queued_all_ns = time.monotonic_ns()

    rec = world.wait_record("timeout", "quitter", timeout_s=30)
    assert rec.ns > queued_all_ns, "the others queued too late to be behind the quitter"
    assert rec.extra["gpu"] == 0
    assert rec.extra["waited_s"] >= 3
    assert rec.extra["holder_pid"] == holder.pid
    assert rec.extra["holder_name"] == "holder"
    # The quitter still runs (it lingers): its files were removed by itself, not by a sweeper.
    assert quitter.proc.poll() is None
    assert quitter.seq is not None
    assert files_of(world, quitter.seq) == []
    assert world.events("cleanup", ticket=quitter.seq) == []
    [event] = world.events("timeout", ticket=quitter.seq)
    assert event["holder_pid"] == holder.pid

    holder.release()
    released = world.wait_record("release", "holder")
    grant = world.wait_record("grant", "b0", timeout_s=HANDOFF_WAIT_S)
    # b0 watched the quitter; had it not re-linked to the holder it would only notice on its
    # safety re-check, an hour away here.
    assert grant.ns > released.ns
    release_in_turn(world, behind)
    assert grant_order(world) == ["holder", "b0", "b1"]
    assert_exclusive(world)
    quitter.send("leave")
    assert quitter.wait_exit() == 3


def test_timeout_zero_succeeds_when_free(world: World) -> None:
    with gpulock.acquire(timeout=0, name="try-once") as lease:
        assert lease.held
        assert lease.gpu == 0
        [entry] = world.entries().values()
        assert (entry["name"], entry["state"], entry["pid"]) == ("try-once", "holding", os.getpid())
    assert not lease.held
    assert world.tickets() == {}


def test_timeout_zero_fails_at_once_when_busy(world: World) -> None:
    holder = world.hold("holder")
    with pytest.raises(gpulock.LockTimeout) as caught:
        gpulock.acquire(timeout=0, name="try-once")
    e = caught.value
    assert (e.gpu, e.holder_pid, e.holder_name) == (0, holder.pid, "holder")
    assert e.waited_s >= 0
    assert set(world.tickets()) == {holder.seq}  # our ticket left with us
    holder.release()
    assert holder.wait_exit() == 0


# --- 5. a reused pid ---------------------------------------------------------------------------


@pytest.mark.parametrize("fifo", ["fifo nobody opened", "no fifo"])
def test_live_pid_with_other_start_time_does_not_hold_the_gpu(
    world: World, fifo: str, no_safety_recheck: None
) -> None:
    stranger = world.sleeper()  # alive, never touched gpulock: its pid plays a reused one
    real_ticks = identity.start_ticks(stranger.pid)
    assert real_ticks is not None
    qdir = make_queue_dir(world)
    fake = craft_ticket(world, 1, stranger.pid, start_ticks=real_ticks + 4242)
    if fifo == "fifo nobody opened":
        os.mkfifo(qdir / fifo_name(1), 0o600)
    assert world.entries()[1]["state"] == "dead"  # status judges by the FIFO, not the pid

    # Granted without a timed re-check (an hour away): the crafted ticket is judged dead.
    with gpulock.acquire(timeout=HANDOFF_WAIT_S, name="rightful") as lease:
        assert lease.ticket > fake.seq
        assert files_of(world, fake.seq) == []
    [cleanup] = world.events("cleanup", ticket=fake.seq)
    assert cleanup["pid"] == stranger.pid and cleanup["by_pid"] == os.getpid()

    # Signalling by the recorded identity refuses the stranger that reuses the pid...
    pidns = identity.pid_namespace()
    assert not identity.signal_exact(stranger.pid, fake.start_ticks, pidns, signal.SIGKILL)
    assert stranger.proc.poll() is None and alive(stranger.pid)
    # ...and reaches the same pid when the start time is the real one (the check can fail).
    assert identity.signal_exact(stranger.pid, real_ticks, pidns, signal.SIGTERM)
    assert stranger.wait_exit() == -signal.SIGTERM


# --- 6. garbage in the queue folder ------------------------------------------------------------


def litter(world: World) -> dict[int, str]:
    """Fill gpu0/ with everything that is not a ticket; return the ticket-named ones."""
    qdir = make_queue_dir(world)
    (qdir / file_name(1)).write_bytes(b'{"format": "gpulock.ticket/1", "seq": ')
    (qdir / file_name(2)).write_text(json.dumps({"format": "other.tool/3", "seq": 2, "gpu": 0}))
    elsewhere = world.root / "elsewhere.ticket"
    elsewhere.write_bytes(encode(Ticket(3, 0, os.getpid(), os.getuid(), "u", "h", "x", 1.0)))
    (qdir / file_name(3)).symlink_to(elsewhere)
    (qdir / file_name(4)).mkdir()
    os.mkfifo(qdir / file_name(7))  # reading it must not block
    craft_ticket(world, 5, os.getpid())  # a holder, on paper...
    (qdir / fifo_name(5)).write_text("not a fifo")  # ...whose FIFO is a regular file
    (qdir / file_name(6)).write_bytes(  # valid, but says it is another ticket
        encode(Ticket(99, 0, os.getpid(), os.getuid(), "u", "h", "x", 1.0, granted_wall=1.0))
    )
    (qdir / fifo_name(8)).write_text("debris of a crash")  # where a later ticket will go
    for junk in (".tmp-123-abcdef", ".tmp-", "notes.txt", "7.ticket", "000000000009.ticket~"):
        (qdir / junk).write_text("junk")
    return {1: "not JSON", 2: "format", 3: "symlink", 4: "regular", 6: "99", 7: "regular"}


def test_garbage_in_the_queue_folder_is_skipped_by_the_lock(world: World) -> None:
    litter(world)
    holder = world.hold("holder")
    waiters = [world.queued(f"w{i}") for i in range(3)]
    assert all(c.seq is not None and c.seq > 7 for c in waiters)
    release_in_turn(world, [holder, *waiters])
    assert grant_order(world) == ["holder", "w0", "w1", "w2"]
    assert_exclusive(world)
    with gpulock.acquire(timeout=5, name="after") as lease:
        assert lease.held


def test_garbage_in_the_queue_folder_is_listed_by_status_which_never_raises(
    world: World,
) -> None:
    expected = litter(world)
    holder = world.hold("holder")
    snap = world.snapshot()
    [gpu] = snap["gpus"]
    ignored = {int(i["file"].split(".")[0]): i["reason"] for i in gpu["ignored"]}
    for seq, why in expected.items():
        assert seq in ignored, f"{file_name(seq)} not listed as ignored: {ignored}"
        assert why in ignored[seq]
    assert [e["name"] for e in gpu["holders"] if e["state"] == "holding"] == ["holder"]
    assert holder.seq not in ignored
    holder.release()
    assert holder.wait_exit() == 0


def test_status_lists_unreadable_tickets_as_ignored(world: World) -> None:
    """The garbage status can already cope with (every kind but a .fifo that is no FIFO)."""
    expected = litter(world)
    os.unlink(world.gpu_dir() / fifo_name(5))  # ticket 5: a holder that died, not garbage
    before = os.listdir(world.gpu_dir())

    [gpu] = world.snapshot()["gpus"]
    ignored = {int(i["file"].split(".")[0]): i["reason"] for i in gpu["ignored"]}
    assert set(ignored) == set(expected)
    for seq, why in expected.items():
        assert why in ignored[seq]
    assert [(e["ticket"], e["state"], e["stale"]) for e in gpu["holders"]] == [(5, "dead", True)]
    assert gpu["waiters"] == []
    assert sorted(os.listdir(world.gpu_dir())) == sorted(before)  # reading changed nothing

    holder = world.hold("holder")  # it removes the dead ticket 5 on its way
    [gpu] = world.snapshot()["gpus"]
    assert [(e["ticket"], e["state"]) for e in gpu["holders"]] == [(holder.seq, "holding")]
    assert {int(i["file"].split(".")[0]) for i in gpu["ignored"]} == set(expected)
    holder.release()
    assert holder.wait_exit() == 0


def test_timeout_behind_a_waiter_with_garbage_ahead_raises_lock_timeout(world: World) -> None:
    litter(world)
    holder = world.hold("holder")
    world.queued("waiter")  # nearest ahead of us is a waiter: the holder is looked up by scan
    with pytest.raises(gpulock.LockTimeout) as caught:
        gpulock.acquire(timeout=0.3, name="impatient")
    assert (caught.value.holder_pid, caught.value.holder_name) == (holder.pid, "holder")


@pytest.mark.parametrize("where", ["a garbage ticket name", "a garbage counter"])
def test_a_huge_number_in_the_folder_does_not_break_mutual_exclusion(
    world: World, where: str
) -> None:
    qdir = make_queue_dir(world)
    if where == "a garbage ticket name":
        (qdir / "999999999999.ticket").write_text("garbage")
    else:
        (world.state / ".seq").write_text("999999999999\n")
    # (Started without `enqueue`: the test's own ticket listing cannot see such numbers either.)
    holder = world.spawn("holder")
    world.wait_record("grant", "holder")
    world.spawn("waiter")

    def waiter_decided() -> bool:
        assert world.find_record("grant", "waiter") is None, "granted while the holder holds"
        return bool(world.events("wait", name="waiter"))

    wait_until(waiter_decided, 15, "the waiter to queue behind the holder")
    holder.release()
    world.wait_record("grant", "waiter")
    assert_exclusive(world)


# --- 7. hung holders ---------------------------------------------------------------------------


def stop_holder(world: World, policy: str) -> Child:
    world.config.write_text(f"on_hung: {policy}\nhung_grace: 0.5s\n")
    holder = world.hold("holder", lease=0.5)
    os.kill(holder.pid, signal.SIGSTOP)
    wait_until(lambda: _proc_state(holder.pid) == "T", 5, "the holder to stop")
    return holder


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return data[data.rfind(b")") + 2 :].split()[0].decode()


@pytest.mark.slow
def test_hung_holder_is_reported_not_killed_under_report(world: World) -> None:
    holder = stop_holder(world, "report")
    world.enqueue("waiter", timeout=1.5)

    rec = world.wait_record("timeout", "waiter", timeout_s=10)
    assert rec.extra["holder_pid"] == holder.pid
    [stale] = world.events("stale", ticket=holder.seq)
    assert (stale["action"], stale["policy"], stale["pid"]) == ("report", "report", holder.pid)
    assert stale["heartbeat_age_s"] >= 0.5
    assert world.events("kill") == []
    entry = world.entries()[holder.seq or 0]
    assert (entry["state"], entry["stale"]) == ("hung", True)
    assert holder.proc.poll() is None and _proc_state(holder.pid) == "T"

    os.kill(holder.pid, signal.SIGCONT)
    holder.release()
    assert holder.wait_exit() == 0
    assert world.tickets() == {}


@pytest.mark.slow
def test_hung_holder_is_terminated_then_killed_under_kill(world: World) -> None:
    holder = stop_holder(world, "kill")
    world.enqueue("waiter", timeout=15)

    world.wait_record("grant", "waiter", timeout_s=15)
    assert holder.wait_exit() == -signal.SIGKILL  # stopped: the SIGTERM stayed pending
    kills = world.events("kill", ticket=holder.seq)
    assert [k["signal"] for k in kills] == ["SIGTERM", "SIGKILL"]
    assert all(k["pid"] == holder.pid for k in kills)
    assert kills[1]["ts"] - kills[0]["ts"] >= 0.5 - 0.01  # the grace between the two
    assert kills[0]["grace_s"] == 0.5
    assert holder.seq is not None and files_of(world, holder.seq) == []
    # The holder could write no release record: the waiter's own log shows the order.
    [granted] = world.events("acquire", name="waiter")
    assert granted["ts"] >= kills[1]["ts"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["report", "kill"])
def test_holder_that_heartbeats_is_never_hung(world: World, policy: str) -> None:
    world.config.write_text(f"on_hung: {policy}\nhung_grace: 0.5s\n")
    holder = world.hold("holder", lease=0.5, heartbeat=0.05)
    world.enqueue("waiter", timeout=1.5)  # three leases long

    rec = world.wait_record("timeout", "waiter", timeout_s=10)
    assert rec.extra["holder_pid"] == holder.pid
    assert world.events("stale") == []
    assert world.events("kill") == []
    entry = world.entries()[holder.seq or 0]
    assert (entry["state"], entry["stale"]) == ("holding", False)
    assert entry["heartbeat_age_s"] < 0.5
    holder.release()
    assert holder.wait_exit() == 0


# --- 8. sharing by need ------------------------------------------------------------------------


def test_jobs_share_by_need_in_fifo_order(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULOCK_SIMULATE", "24GiB")
    world.config.write_text("reserve: 2GiB\n")  # budget 22 GiB
    a = world.hold("a6", need="6GiB")
    b = world.hold("b6", need="6GiB")
    assert holding_now(world) == {"a6", "b6"}  # both granted, neither released
    c = world.queued("c16", need="16GiB")  # 6 + 6 + 16 > 22
    d = world.queued("d6", need="6GiB")  # 6 + 6 + 6 would fit, but c16 is first
    e = world.queued("ex")  # exclusive
    assert holding_now(world) == {"a6", "b6"}, "d6 overtook the waiting c16"

    a.release()
    world.wait_record("grant", "c16")  # 6 + 16 = 22 fits
    assert holding_now(world) == {"b6", "c16"}
    b.release()
    world.wait_record("grant", "d6")  # 16 + 6 = 22
    assert holding_now(world) == {"c16", "d6"}
    c.release()
    assert c.wait_exit() == 0  # gone: "ex" has been woken by it and must keep waiting for d6
    assert holding_now(world) == {"d6"}
    assert world.entries()[e.seq or 0]["state"] == "waiting"
    d.release()
    world.wait_record("grant", "ex")
    e.release()
    for child in (a, b, c, d, e):
        assert child.wait_exit() == 0, child.stderr()

    assert grant_order(world) == ["a6", "b6", "c16", "d6", "ex"]
    ivs = intervals(world.records())
    for iv in ivs:  # at every grant, the holders then fit the budget; "ex" shares with nobody
        during = [o for o in ivs if o.start <= iv.start < o.end]
        if iv.need_bytes is None:
            assert during == [iv], f"exclusive {iv.name} shared the GPU with {during}"
        else:
            assert sum(o.need_bytes or 0 for o in during) <= 22 * GIB, during


@pytest.mark.parametrize(
    ("reserve", "budget"),
    [
        ("reserve: 2GiB\n", 22 * GIB),
        ("reserve: 10%\n", 24 * GIB * 0.9),
        ("# the default reserve, 10%\n", 21.6 * GIB),
    ],
)
def test_need_larger_than_the_budget_fails_at_once(
    world: World, monkeypatch: pytest.MonkeyPatch, reserve: str, budget: float
) -> None:
    monkeypatch.setenv("GPULOCK_SIMULATE", "24GiB")
    world.config.write_text(reserve)
    holder = world.hold("holder")  # busy: a need that could ever fit would queue, not fail
    with pytest.raises(gpulock.NeedTooLarge) as caught:
        gpulock.acquire(need=int(budget) + 2, timeout=30)  # past the budget however it rounds
    assert world.events("wait") == []  # refused before queueing, not after its 30 s
    e = caught.value
    assert (e.gpu, e.need_bytes) == (0, int(budget) + 2)
    assert abs(e.budget_bytes - budget) <= 1
    assert set(world.tickets()) == {holder.seq}  # it never queued
    with pytest.raises(gpulock.NeedTooLarge):
        gpulock.acquire(need="24GiB", timeout=30)
    holder.release()
    assert holder.wait_exit() == 0
    with gpulock.acquire(need=e.budget_bytes, timeout=5) as lease:  # the budget itself fits
        assert lease.need_bytes == e.budget_bytes


# --- 9. fork safety ----------------------------------------------------------------------------


def test_forked_child_does_not_keep_the_gpu_after_release(
    world: World, no_safety_recheck: None
) -> None:
    forker = world.hold("forker", mode="fork", linger=True)
    forked_pid = world.wait_record("forked", "forker").extra["pid"]
    waiter = world.queued("waiter")  # its safety re-check is an hour away

    forker.release()
    released = world.wait_record("release", "forker")
    grant = world.wait_record("grant", "waiter", timeout_s=HANDOFF_WAIT_S)
    assert grant.ns > released.ns  # woken by the release's doorbell, the fork's FIFO open
    assert alive(forked_pid), "the forked child should still be alive (it never exits)"
    assert forker.proc.poll() is None
    waiter.release()
    assert waiter.wait_exit() == 0


# --- 10. re-entrancy ---------------------------------------------------------------------------


def test_nested_acquire_returns_the_same_lease_and_only_the_outer_release_frees(
    world: World,
) -> None:
    nester = world.hold("nester", mode="nested")
    nested = world.wait_record("nested", "nester")
    assert nested.extra == {"same": True, "inner_ticket": nester.seq}
    assert list(world.tickets()) == [nester.seq]  # no second ticket queued behind itself
    waiter = world.queued("waiter")

    nester.send("inner release")
    assert world.wait_record("inner-released", "nester").extra["held"] is True
    # Still held: the ticket is there and a try-once probe is refused by the nester.
    assert world.entries()[nester.seq or 0]["state"] == "holding"
    with pytest.raises(gpulock.LockTimeout) as caught:
        gpulock.acquire(timeout=0, name="probe")
    assert caught.value.holder_pid == nester.pid
    assert world.find_record("grant", "waiter") is None

    nester.send("outer release")
    outer = world.wait_record("release", "nester")
    grant = world.wait_record("grant", "waiter")
    assert grant.ns > outer.ns
    waiter.release()
    assert nester.wait_exit() == 0 and waiter.wait_exit() == 0
    assert_exclusive(world)


def test_nested_acquire_in_one_process(world: World) -> None:
    with gpulock.acquire(timeout=5) as outer:
        with gpulock.acquire(timeout=5) as inner:
            assert inner is outer
            assert len(world.tickets()) == 1
        assert outer.held
        assert len(world.tickets()) == 1
    assert not outer.held
    assert world.tickets() == {}


# --- 11. the decorator -------------------------------------------------------------------------


def test_locked_decorator_holds_the_gpu_during_the_call(world: World) -> None:
    job = world.spawn("deco", mode="decorator")
    seq = world.wait_ticket(job)
    world.wait_record("enter", "deco")
    entry = world.entries()[seq]
    assert (entry["state"], entry["pid"], entry["name"]) == ("holding", job.pid, "_decorated_job")
    with pytest.raises(gpulock.LockTimeout) as caught:
        gpulock.acquire(timeout=0, name="probe")
    assert (caught.value.holder_pid, caught.value.holder_name) == (job.pid, "_decorated_job")

    job.send("return")
    assert world.wait_record("returned", "deco").extra["result"] == 7
    assert job.wait_exit() == 0
    assert world.tickets() == {}
    with gpulock.acquire(timeout=0, name="after") as lease:
        assert lease.held
