"""A release against its successor's look at the released ticket, in every interleaving.

A holder's release is three acts (unlink its ticket, unlink its FIFO, close its claim); the
successor's look at that ticket is two (``QueueDir.look``: its claim and its ticket file).
Which interleaving happens is the scheduler's choice, so each one is forced here: both real
processes stop before each of their steps (``gpulock.lock.steps``, ``GPULOCK_TEST_PAUSE``) and
the test lets one step at a time go, in the order under test.  Issue 30: a released ticket
read as a dead one began an exit wait on a live process and stalled the line for seconds.
"""

from __future__ import annotations

import errno
import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from procs import DEFAULT_WAIT_S, Child, World, alive, wait_until

from gpulock.core.claim import ring
from gpulock.lock.steps import ENV
from gpulock.lock.ticket import fifo_name

RELEASE = ("release-ticket", "release-fifo", "release-close", "release-done")
LOOK = ("look-first", "look-second", "look-done")


def interleavings() -> list[tuple[str, ...]]:
    """Every merge of the release's three acts with the look's two (10 orders)."""
    acts, looks = RELEASE[:-1], LOOK[:-1]
    out = []
    for where in itertools.combinations(range(len(acts) + len(looks)), len(looks)):
        a, b = iter(acts), iter(looks)
        out.append(tuple(next(b) if i in where else next(a) for i in range(5)))
    return out


class Gates:
    """One child's pause points: wait until it reached one, let it go on past it."""

    def __init__(self, folder: Path, steps: tuple[str, ...]) -> None:
        folder.mkdir()
        self.folder = folder
        self.steps = steps
        self.env = {ENV: f"{folder}:{','.join(steps)}"}

    def reached(self, step: str) -> None:
        wait_until(
            lambda: (self.folder / step).exists(),
            DEFAULT_WAIT_S,
            f"{self.folder.name} to reach {step}",
        )

    def go(self, step: str) -> None:
        """Let the step go, and return once it is done (the next pause point is reached)."""
        self.reached(step)

        def opened() -> bool:
            try:
                fd = os.open(self.folder / f"{step}.go", os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno == errno.ENXIO:  # not blocked in its open yet
                    return False
                raise
            os.close(fd)
            return True

        wait_until(opened, DEFAULT_WAIT_S, f"{self.folder.name} blocked at {step}")
        after = self.steps.index(step) + 1
        if after < len(self.steps):
            self.reached(self.steps[after])


def holder_and_successor(world: World, tmp_path: Path) -> tuple[Child, Child, Gates, Gates]:
    world.config.write_text("exit_wait: 1h\n")  # an exit wait, if one began, would not end here
    rel, look = Gates(tmp_path / "holder-gates", RELEASE), Gates(tmp_path / "succ-gates", LOOK)
    holder = world.hold("holder", linger=True, env=rel.env)  # alive long after its release
    successor = world.spawn("successor", env=look.env)
    successor.seq = world.wait_ticket(successor)
    look.reached("look-first")  # its first look at the queue: the holder's ticket
    return holder, successor, rel, look


@pytest.mark.parametrize("order", interleavings(), ids="/".join)
def test_a_released_ticket_is_never_taken_for_a_dead_one(
    world: World, tmp_path: Path, order: tuple[str, ...]
) -> None:
    holder, successor, rel, look = holder_and_successor(world, tmp_path)
    assert holder.seq is not None
    holder.release()  # it stops before its first act
    for step in order:
        (rel if step in RELEASE else look).go(step)
    rel.go("release-done")
    look.go("look-done")

    def outcome() -> list[dict[str, object]]:
        return [
            e
            for e in world.events()
            if e["event"] in ("exit-wait", "exit-wait-alive")
            or (e["event"] == "acquire" and e.get("ticket") == successor.seq)
        ]

    seen = wait_until(outcome, DEFAULT_WAIT_S, lambda: f"the successor's grant\n{world.describe()}")
    assert [e["event"] for e in seen] == ["acquire"], f"{seen}\n{world.describe()}"
    assert alive(holder.pid), "the holder lives on after its release"
    assert not world.events("cleanup", ticket=holder.seq), "a released ticket is not cleaned up"
    grant = world.wait_record("grant", "successor")
    assert grant.ns > world.wait_record("release", "holder").ns
    successor.release()
    assert successor.wait_exit() == 0


@pytest.mark.parametrize("before", LOOK)
def test_a_holder_killed_during_the_look_is_still_a_death(
    world: World, tmp_path: Path, before: str
) -> None:
    holder, successor, _rel, look = holder_and_successor(world, tmp_path)
    for step in LOOK[: LOOK.index(before)]:
        look.go(step)
    holder.killpg(signal.SIGKILL)
    assert holder.wait_exit() == -signal.SIGKILL
    for step in LOOK[LOOK.index(before) :]:
        look.go(step)

    world.wait_record("grant", "successor")
    cleanups = world.events("cleanup", ticket=holder.seq)
    assert [e["by_pid"] for e in cleanups] == [successor.pid], world.describe()
    assert not world.events("exit-wait-alive"), world.describe()
    successor.release()
    assert successor.wait_exit() == 0


def test_a_signal_while_a_waiter_lets_go_of_its_watches_leaves_the_line_cleanly(
    world: World, tmp_path: Path
) -> None:
    """SIGTERM to ``gpulock run`` waiting in line is exit 143 wherever it lands.

    Seen on CI: a demo agent stopped by SIGTERM while its waiter let go of the watch on the
    holder ahead (closing one descriptor, about to forget it) ended as ``KeyError: 5``, an
    error instead of a stop: the waiter's clean-up let go of that watch a second time.  Here
    the waiter stops between the two acts of letting go (``unwatch``) and the signal lands
    there.
    """
    holder = world.hold("holder")
    gates = Gates(tmp_path / "gates", ("unwatch",))
    waiter = subprocess.Popen(
        [sys.executable, "-m", "gpulock", "run", "--name", "waiter", "--", "true"],
        env={**os.environ, **gates.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        waits = wait_until(
            lambda: world.events("wait", name="waiter"), DEFAULT_WAIT_S, world.describe
        )
        # Its first look watches the holder; a doorbell makes it look again, and a new look
        # lets go of the old watches first.
        ring(world.gpu_dir() / fifo_name(waits[0]["ticket"]))
        gates.reached("unwatch")
        waiter.send_signal(signal.SIGTERM)
        _out, err = waiter.communicate(timeout=DEFAULT_WAIT_S)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
    assert waiter.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "KeyError" not in err, err
    assert [e["signal"] for e in world.events("leave", name="waiter")] == ["SIGTERM"]
    holder.release()
    assert holder.wait_exit() == 0
    world.hold("next")  # the line goes on: the waiter's ticket left with it
