"""A dead holder's successor is granted only once the dead holder's processes have gone.

The rule is a table test; the waiting is driven by real processes that really die (SIGKILL),
with NVML's listing the one stand-in (a probe function: there is no GPU here; a ``gpu``-marked
test checks the real listing where there is one).
"""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from cli_helpers import Cli, pid_alive, wait_until

from gpulock.core import identity
from gpulock.lock import exitwait
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


# --- the watch, with real processes and a stand-in NVML listing --------------------------------


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


def test_watch_waits_for_the_process_then_for_nvml_then_lets_go() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
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
        assert poller.poll(0) == []  # the process runs: its pidfd is not readable
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
        proc.kill()
        proc.wait()


def test_watch_gives_up_after_exit_wait_with_an_event() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
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
        proc.kill()
        proc.wait()


def test_a_reused_pid_is_not_waited_for() -> None:
    t = ticket_of(os.getpid())
    other = dataclasses.replace(t, start_ticks=(t.start_ticks or 0) + 1)
    w = exitwait.ExitWatch(select.poll(), 10.0, lambda gpu: None, lambda k, **f: None)
    assert not w.blocks(other)  # this pid runs, but it is not the recorded process
    assert w.blocks(dataclasses.replace(t, seq=8))  # ...while the recorded one is waited for
    w.close()


def test_a_ticket_naming_another_users_process_is_not_waited_for() -> None:
    t = dataclasses.replace(ticket_of(1), uid=os.getuid() + 4242)  # pid 1: init, running
    w = exitwait.ExitWatch(select.poll(), 10.0, lambda gpu: None, lambda k, **f: None)
    assert not w.blocks(t)
    w.close()


# --- the lock, end to end ------------------------------------------------------------------------

# A command that lets go of the claim it inherited from `gpulock run` (as a program that closes
# the descriptors it does not know does), says it runs, and lives on until its stdin closes: so
# when `gpulock run` is SIGKILLed the claim reports the death while the command still runs.
DROP_CLAIM_PY = """\
import os, sys
for name in os.listdir("/proc/self/fd"):
    try:
        if os.readlink(f"/proc/self/fd/{name}").endswith(".fifo"):
            os.close(int(name))
    except OSError:
        pass
open(sys.argv[1], "w").close()
sys.stdin.read()
"""


def test_successor_of_a_dead_holder_starts_only_after_its_command_exits(cli: Cli) -> None:
    script = cli.script("drop_claim.py", DROP_CLAIM_PY)
    ready = cli.root / "holder.ready"
    holder = cli.start_run("holder", cmd=[sys.executable, str(script), str(ready)])
    cli.wait_ready(holder, ready)
    child_pid = wait_until(
        lambda: (cli.entry("holder") or {}).get("child_pid"), "the holder's child_pid"
    )
    successor = cli.start_run("successor", "--timeout", "60", cmd=["true"])
    cli.wait_event("wait", name="successor")
    os.kill(holder.pid, signal.SIGKILL)  # gpulock run alone: its command lives on
    assert holder.wait() == -signal.SIGKILL
    waiting = cli.wait_event("exit-wait", name="successor")
    assert waiting["dead_child_pid"] == child_pid, waiting
    assert pid_alive(child_pid)
    assert not cli.events("acquire", name="successor"), cli.describe()

    ended_wall = time.time()
    os.kill(child_pid, signal.SIGKILL)
    assert successor.wait() == 0, successor.output()
    granted = cli.events("acquire", name="successor")
    assert len(granted) == 1 and granted[0]["ts"] >= ended_wall, cli.describe()
    assert not cli.events("exit-wait-timeout"), cli.describe()
    assert not [f for f in cli.queue_files() if f.endswith(".ticket")], cli.describe()


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
    script = cli.script("drop_claim.py", DROP_CLAIM_PY)
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
