"""A dead holder's successor is granted only once the dead holder's processes have gone, and
only a process really on its way out is waited for.

The rules are table tests; the waiting is driven by real processes that really die (SIGKILL)
or linger in their exit (``procs.IN_EXIT_PY``: a main thread gone, a last thread alive, as a
GPU process is while its driver tears down), with NVML's listing the one stand-in (a probe
function: there is no GPU here; a ``gpu``-marked test checks the real listing where there is
one).
"""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import Cli, pid_alive, wait_until
from procs import DROP_CLAIMS_PY, IN_EXIT_PY, World, in_exit

from gpulock.core import identity
from gpulock.lock import census, exitwait
from gpulock.lock.exitwait import PF_EXITING, PF_SIGNALED, SIGKILL_MASK, ProcState
from gpulock.lock.ticket import Ticket

# --- the rule ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("running", "listed", "waited", "state"),
    [
        ({41}, None, 0.0, "wait"),  # still exiting
        ({41}, None, 10.0, "give-up"),  # ...for the whole exit_wait
        (set(), {41}, 0.5, "wait"),  # exited, but the driver still lists it
        (set(), {41}, 12.0, "give-up"),
        (set(), set(), 0.5, "gone"),  # exited and no longer listed
        (set(), None, 0.5, "gone"),  # exited; no NVML to ask (simulated GPU, no driver)
        (set(), None, 99.0, "gone"),  # gone is gone, however long it took
    ],
)
def test_decide(running: set[int], listed: set[int] | None, waited: float, state: str) -> None:
    v = exitwait.decide(running, listed, waited, 10.0)
    assert v.state == state, v


@pytest.mark.parametrize(
    ("state", "flags", "pending", "exiting"),
    [
        ("R", 0x400000, 0, False),  # running
        ("S", 0x400000, 0, False),  # asleep (in a read, a poll...): alive all the same
        ("T", 0x400000, 0, False),  # stopped: alive, and will go on when continued
        ("D", 0x400000, 1 << 14, False),  # in the kernel, SIGTERM pending: it may catch it
        ("D", 0x400000 | PF_EXITING, 0, True),  # inside its exit (a driver's teardown)
        ("R", 0x400000 | PF_SIGNALED, 0, True),  # killed by a signal, dumping core
        ("S", 0x400000, SIGKILL_MASK, True),  # SIGKILLed, not yet scheduled to die
        ("Z", 0x40800C, 0, True),  # a zombie (its leader; threads may still run)
        ("X", 0, 0, True),  # dead
    ],
)
def test_in_exit(state: str, flags: int, pending: int, exiting: bool) -> None:
    assert exitwait.in_exit(ProcState(state, flags, pending)) is exiting


def test_proc_state_reads_this_process_and_refuses_a_reused_pid() -> None:
    me = exitwait.proc_state(os.getpid(), identity.start_ticks(os.getpid()))
    assert me is not None and me.state == "R" and not exitwait.in_exit(me)
    assert exitwait.proc_state(os.getpid(), (identity.start_ticks(os.getpid()) or 0) + 1) is None


# --- the watch, with real processes and a stand-in NVML listing --------------------------------


@pytest.fixture
def exiting(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real process inside its exit that stays there until its stdin closes."""
    script, ready = tmp_path / "in_exit.py", tmp_path / "in_exit.ready"
    script.write_text(IN_EXIT_PY)
    proc = subprocess.Popen([sys.executable, str(script), str(ready)], stdin=subprocess.PIPE)
    try:
        wait_until(lambda: ready.exists() and in_exit(proc.pid), "a process lingering in exit")
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def running() -> Iterator[subprocess.Popen[bytes]]:
    """A real live process (it blocks reading its stdin)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def ticket_of(pid: int) -> Ticket:
    return Ticket(
        seq=7,
        gpu=0,
        pid=pid,
        uid=os.getuid(),
        user="me",
        host="here",
        name="dead",
        created_wall=time.time(),
        start_ticks=identity.start_ticks(pid),
        pidns=identity.pid_namespace(),
        granted_wall=time.time(),
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_watch_waits_for_the_process_then_for_nvml_then_lets_go(
    exiting: subprocess.Popen[bytes],
) -> None:
    proc = exiting
    events: list[tuple[str, dict[str, Any]]] = []
    listed = {proc.pid}
    clock = Clock()
    poller = select.poll()
    w = exitwait.ExitWatch(
        poller, 10.0, lambda gpu: frozenset(listed), lambda k, **f: events.append((k, f)),
        clock=clock,
    )  # fmt: skip
    t = ticket_of(proc.pid)
    try:
        assert w.blocks(t)
        assert [k for k, _ in events] == ["exit-wait"]
        assert events[0][1]["dead_pid"] == proc.pid
        assert poller.poll(0) == []  # still exiting: its pidfd is not readable
        assert w.blocks(t)  # looked at again: still waited for
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
        ready = poller.poll(10_000)  # the kernel says it exited
        assert ready and w.on_ready(ready[0][0])
        assert w.blocks(t)  # exited, but NVML still lists it
        assert w.wake_at() == pytest.approx(clock.now + exitwait.NVML_FIRST_S)
        listed.clear()
        clock.now += 1.0
        assert not w.blocks(t)
        assert [k for k, _ in events] == ["exit-wait"]  # announced once, no give-up
    finally:
        w.close()


def test_watch_gives_up_after_exit_wait_with_an_event(exiting: subprocess.Popen[bytes]) -> None:
    proc = exiting
    events: list[str] = []
    clock = Clock()
    w = exitwait.ExitWatch(
        select.poll(), 2.0, lambda gpu: None, lambda k, **f: events.append(k), clock=clock
    )
    try:
        t = ticket_of(proc.pid)
        assert w.blocks(t)
        assert w.wake_at() == clock.now + 2.0
        clock.now += 2.0
        assert not w.blocks(t)
        assert events == ["exit-wait", "exit-wait-timeout"]
    finally:
        w.close()


def test_a_reused_pid_is_not_waited_for(exiting: subprocess.Popen[bytes]) -> None:
    t = ticket_of(exiting.pid)
    other = dataclasses.replace(t, start_ticks=(t.start_ticks or 0) + 1)
    w = exitwait.ExitWatch(select.poll(), 10.0, lambda gpu: None, lambda k, **f: None)
    assert not w.blocks(other)  # this pid is exiting, but it is not the recorded process
    assert w.blocks(dataclasses.replace(t, seq=8))  # ...while the recorded one is waited for
    w.close()


def test_a_ticket_naming_another_users_process_is_not_waited_for() -> None:
    t = dataclasses.replace(ticket_of(1), uid=os.getuid() + 4242)  # pid 1: init, running
    w = exitwait.ExitWatch(select.poll(), 10.0, lambda gpu: None, lambda k, **f: None)
    assert not w.blocks(t)
    w.close()


def test_a_running_process_is_not_waited_for_and_an_event_says_so(
    running: subprocess.Popen[bytes],
) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    poller = select.poll()
    w = exitwait.ExitWatch(
        poller, 10.0, lambda gpu: frozenset({running.pid}), lambda k, **f: events.append((k, f)),
        tickets_of=lambda pid, ticks: [(1, 575)] if pid == running.pid else [],
    )  # fmt: skip
    t = ticket_of(running.pid)
    try:
        assert not w.blocks(t)  # alive (even listed by NVML): its successor goes on at once
        [(kind, fields)] = events
        assert kind == "exit-wait-alive", events
        assert fields["dead_ticket"] == t.seq and fields["dead_pid"] == running.pid
        [seen] = fields["alive"]
        assert (seen["pid"], seen["tickets"]) == (running.pid, [(1, 575)]), fields
        assert seen["state"] in "RS", fields  # starting up, or asleep in its read
        assert "ticket 575 on gpu1" in fields["reason"] and fields["waited_s"] == 0
        assert w.wake_at() == float("inf")
        assert not w.blocks(t)  # and it stays let go: no second event
        assert len(events) == 1
        assert running.poll() is None
    finally:
        w.close()


def test_a_wait_ends_the_moment_its_process_is_seen_running(
    running: subprocess.Popen[bytes],
) -> None:
    """However a wait began (the kernel's word is injected here: a real process does not come
    back from its exit), a look that finds the process running ends it with the event."""
    events: list[tuple[str, dict[str, Any]]] = []
    clock = Clock()
    word = [ProcState("D", PF_EXITING, 0)]
    w = exitwait.ExitWatch(
        select.poll(), 10.0, lambda gpu: None, lambda k, **f: events.append((k, f)),
        clock=clock, state=lambda pid, ticks: word[0],
    )  # fmt: skip
    t = ticket_of(running.pid)
    try:
        assert w.blocks(t)
        word[0] = ProcState("S", 0, 0)
        clock.now += 0.5
        assert not w.blocks(t)
        assert [k for k, _ in events] == ["exit-wait", "exit-wait-alive"]
        assert events[1][1]["waited_s"] == 0.5
    finally:
        w.close()


def test_the_event_names_the_live_tickets_the_process_holds_in_any_line(world: World) -> None:
    holder = world.hold("holder")  # alive, holding ticket 1 on gpu0
    assert holder.seq is not None
    events: list[tuple[str, dict[str, Any]]] = []
    settings = world.settings()
    w = exitwait.ExitWatch(
        select.poll(), 10.0, lambda gpu: None, lambda k, **f: events.append((k, f)),
        tickets_of=lambda pid, ticks: census.tickets_of(settings, pid, ticks),
    )  # fmt: skip
    stale = dataclasses.replace(ticket_of(holder.pid), seq=holder.seq + 100)
    try:
        assert not w.blocks(stale)  # a ticket of its that looks dead: it is not waited for
        [(kind, fields)] = events
        assert kind == "exit-wait-alive"
        assert fields["alive"][0]["tickets"] == [(0, holder.seq)], fields
        assert f"it holds ticket {holder.seq} on gpu0" in fields["reason"], fields
    finally:
        w.close()
        holder.release()
        assert holder.wait_exit() == 0


# --- the lock, end to end ------------------------------------------------------------------------

# A command that lets go of the claim it inherited from `gpulock run` (as a program that closes
# the descriptors it does not know does), says it runs, and lives on until its stdin closes: so
# when `gpulock run` is SIGKILLed the claim reports the death while the command still runs.
DROP_CLAIM_PY = (
    DROP_CLAIMS_PY
    + """\
import sys
open(sys.argv[1], "w").close()
sys.stdin.read()
"""
)


def test_successor_of_a_dead_holder_starts_only_after_its_command_exits(cli: Cli) -> None:
    script = cli.script("in_exit.py", IN_EXIT_PY)
    ready = cli.root / "holder.ready"
    holder = cli.start_run("holder", cmd=[sys.executable, str(script), str(ready)])
    cli.wait_ready(holder, ready)
    child_pid = wait_until(
        lambda: (cli.entry("holder") or {}).get("child_pid"), "the holder's child_pid"
    )
    wait_until(lambda: in_exit(child_pid), "its command inside its exit")
    successor = cli.start_run("successor", "--timeout", "60", cmd=["true"])
    cli.wait_event("wait", name="successor")
    os.kill(holder.pid, signal.SIGKILL)  # gpulock run alone: its command is still exiting
    assert holder.wait() == -signal.SIGKILL
    waiting = cli.wait_event("exit-wait", name="successor")
    assert waiting["dead_child_pid"] == child_pid, waiting
    # (the SIGKILLed owner may be named too: it may still have been in its exit at the look)
    assert str(child_pid) in waiting["reason"] and "still exiting" in waiting["reason"], waiting
    assert not cli.events("acquire", name="successor"), cli.describe()

    ended_wall = time.time()
    os.kill(child_pid, signal.SIGKILL)
    assert successor.wait() == 0, successor.output()
    granted = cli.events("acquire", name="successor")
    assert len(granted) == 1 and granted[0]["ts"] >= ended_wall, cli.describe()
    assert not cli.events("exit-wait-timeout"), cli.describe()
    assert not cli.events("exit-wait-alive"), cli.describe()
    assert not [f for f in cli.queue_files() if f.endswith(".ticket")], cli.describe()


def test_a_dead_holders_command_that_runs_on_is_not_waited_for(cli: Cli) -> None:
    script = cli.script("drop_claim.py", DROP_CLAIM_PY)
    ready = cli.root / "holder.ready"
    holder = cli.start_run("holder", cmd=[sys.executable, str(script), str(ready)])
    cli.wait_ready(holder, ready)
    child_pid = wait_until(
        lambda: (cli.entry("holder") or {}).get("child_pid"), "the holder's child_pid"
    )
    successor = cli.start_run("successor", "--timeout", "60", cmd=["true"])
    cli.wait_event("wait", name="successor")
    os.kill(holder.pid, signal.SIGKILL)  # gpulock run alone: its command runs on
    assert holder.wait() == -signal.SIGKILL
    assert successor.wait() == 0, successor.output()
    assert pid_alive(child_pid)  # granted while the dead holder's command still runs...
    [alive] = cli.events("exit-wait-alive", name="successor")
    assert [a["pid"] for a in alive["alive"]] == [child_pid], alive  # ...and the log says why
    assert alive["dead_child_pid"] == child_pid, alive
    # The SIGKILLed owner itself may have been waited for a moment (it was in its exit at the
    # look), its running command never.
    waits = cli.events("exit-wait", name="successor")
    assert not [w for w in waits if str(child_pid) in w["reason"]], cli.describe()


def test_exit_wait_zero_grants_past_a_dead_holder_at_once(cli: Cli) -> None:
    cfg = cli.root / "gpulock.yaml"
    cfg.write_text("exit_wait: 0\n")
    script = cli.script("drop_claim.py", DROP_CLAIM_PY)
    ready = cli.root / "holder.ready"
    holder = cli.start_run("holder", cmd=[sys.executable, str(script), str(ready)])
    cli.wait_ready(holder, ready)
    child_pid = wait_until(
        lambda: (cli.entry("holder") or {}).get("child_pid"), "the holder's child_pid"
    )
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    r = cli.run("run", "--config", str(cfg), "--timeout", "30", "--name", "next", "--", "true")
    assert r.code == 0, r.describe()
    assert pid_alive(child_pid)  # granted while the dead holder's command still ran
    assert not cli.events("exit-wait"), cli.describe()


def test_exit_wait_that_runs_out_grants_with_an_event(cli: Cli) -> None:
    cfg = cli.root / "gpulock.yaml"
    cfg.write_text("exit_wait: 1s\n")
    script = cli.script("in_exit.py", IN_EXIT_PY)  # in its exit until the test ends
    ready = cli.root / "holder.ready"
    holder = cli.start_run("holder", cmd=[sys.executable, str(script), str(ready)])
    cli.wait_ready(holder, ready)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    r = cli.run("run", "--config", str(cfg), "--timeout", "60", "--name", "next", "--", "true")
    assert r.code == 0, r.describe()
    gave_up = cli.events("exit-wait-timeout", name="next")
    assert len(gave_up) == 1 and "still exiting" in gave_up[0]["reason"], cli.describe()


def test_gpulock_run_of_the_whole_group_sigkilled_hands_on_after_both_exit(cli: Cli) -> None:
    holder = cli.hold("holder")
    child_pid = wait_until(
        lambda: (cli.entry("holder") or {}).get("child_pid"), "the holder's child_pid"
    )
    successor = cli.start_run("successor", "--timeout", "60", cmd=["true"])
    cli.wait_event("wait", name="successor")
    os.killpg(holder.pid, signal.SIGKILL)
    assert successor.wait() == 0, successor.output()
    assert not pid_alive(child_pid) and not pid_alive(holder.pid)
    assert not cli.events("exit-wait-timeout"), cli.describe()


def test_gpu_pids_is_unknown_on_a_simulated_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpulock.core import devices

    monkeypatch.setenv("GPULOCK_SIMULATE", "24GiB")
    assert devices.gpu_pids(0) is None  # nothing to ask: the waiter waits for pidfds only
