"""``gpulock.acquire_async``: the same FIFO as ``acquire`` and ``gpulock run``, on an event loop.

Real processes throughout: async children (``aio_child.py``), ``gpulock run`` jobs and
``procs.py`` holders share one queue folder; grants follow arrival order across all of them,
and a cancelled async waiter leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import DEFAULT_WAIT_S, IN_EXIT_PY, Child, World, in_exit, wait_until

import gpulock

AIO_CHILD = str(Path(__file__).resolve().parent / "aio_child.py")


def aio(world: World, name: str, **opts: object) -> Child:
    """An async waiter, returned once its ticket is in the queue (arrival order is known)."""
    opts = {"name": name, "audit": str(world.audit), "config": str(world.config), **opts}
    child = Child(world, name, [sys.executable, AIO_CHILD, json.dumps(opts)])
    world.children.append(child)
    child.seq = world.wait_ticket(child)
    return child


def run_job(world: World, name: str) -> Child:
    """A ``gpulock run`` job whose command writes grant/release records to the audit file."""
    argv = [sys.executable, "-m", "gpulock", "run", "--name", name, "--"]
    argv += [sys.executable, AIO_CHILD, "--job", str(world.audit), name]
    child = Child(world, name, argv)
    world.children.append(child)
    child.seq = world.wait_ticket(child)
    return child


def test_async_waiters_and_run_jobs_are_granted_in_arrival_order(world: World) -> None:
    first = world.hold("first")
    line = [
        aio(world, "a1"),
        run_job(world, "r1"),
        aio(world, "a2"),
        run_job(world, "r2"),
        aio(world, "a3"),
    ]
    first.release()
    for child in line:
        world.wait_record("grant", child.name)
        child.send("release")
        assert child.wait_exit() == 0
    grants = [r.name for r in world.records() if r.kind == "grant"]
    assert grants == ["first", "a1", "r1", "a2", "r2", "a3"]
    # The waiting async children kept their loops running (the ticker wrote while they waited).
    assert any(r.kind == "tick" and r.name == "a3" for r in world.records())
    assert world.tickets() == {}


def test_cancelled_async_waiter_leaves_the_queue_and_its_successor_goes_on(world: World) -> None:
    holder = world.hold("holder")

    async def scenario() -> tuple[int, list[str]]:
        task = asyncio.ensure_future(gpulock.acquire_async(name="cancelled", timeout=60))
        mine = await asyncio.to_thread(
            wait_until,
            lambda: next((s for s, t in world.tickets().items() if t.name == "cancelled"), None),
            DEFAULT_WAIT_S,
            "the async waiter's ticket",
        )
        behind = await asyncio.to_thread(world.queued, "behind")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        left = sorted(
            p.name for p in world.gpu_dir().iterdir() if p.name.startswith(f"{mine:012d}")
        )
        assert behind.seq is not None
        return mine, left

    mine, left = asyncio.run(scenario())
    assert left == []  # ticket and FIFO both gone, at once
    assert mine not in world.tickets()
    holder.release()
    world.wait_record("grant", "behind")


def test_async_timeout_raises_lock_timeout_and_leaves(world: World) -> None:
    holder = world.hold("holder")

    async def scenario() -> None:
        with pytest.raises(gpulock.LockTimeout) as e:
            async with gpulock.acquire_async(name="impatient", timeout=0.3):
                raise AssertionError("granted while another holds the GPU")
        assert e.value.holder_name == "holder"

    asyncio.run(scenario())
    assert [t.name for t in world.tickets().values()] == ["holder"]
    holder.release()


def test_tasks_of_one_loop_queue_in_order_and_share_by_need(world: World) -> None:
    world.config.write_text("simulate: [24GiB]\n")
    order: list[str] = []

    async def scenario() -> None:
        async def one(name: str, need: str | None, hold: asyncio.Event) -> None:
            async with gpulock.acquire_async(name=name, need=need, timeout=30):
                order.append(name)
                await hold.wait()

        gates = {n: asyncio.Event() for n in ("x", "s1", "s2")}
        tx = asyncio.create_task(one("x", None, gates["x"]))
        while order != ["x"]:
            await asyncio.sleep(0.01)
        t1 = asyncio.create_task(one("s1", "4GiB", gates["s1"]))
        await asyncio.to_thread(
            wait_until, lambda: len(world.tickets()) == 2, DEFAULT_WAIT_S, "s1's ticket"
        )
        t2 = asyncio.create_task(one("s2", "4GiB", gates["s2"]))
        await asyncio.to_thread(
            wait_until, lambda: len(world.tickets()) == 3, DEFAULT_WAIT_S, "s2's ticket"
        )
        assert order == ["x"]
        gates["x"].set()
        await tx
        # Both share the GPU by VRAM: each is granted while the other still holds.
        async with asyncio.timeout(DEFAULT_WAIT_S):
            while len(order) < 3:
                await asyncio.sleep(0.01)
        gates["s1"].set()
        gates["s2"].set()
        await asyncio.gather(t1, t2)

    asyncio.run(scenario())
    assert order == ["x", "s1", "s2"]
    assert world.tickets() == {}


def test_async_waiter_behind_a_dead_holder_is_granted_only_after_its_command_exits(
    world: World,
) -> None:
    """``acquire_async`` shares the blocking waiter's exit wait (``gpulock.lock.exitwait``): the
    dead holder's command, still exiting, keeps the GPU until it has exited."""
    world.config.write_text("exit_wait: 1h\n")  # never runs out within the test
    script = world.root / "in_exit.py"
    script.write_text(IN_EXIT_PY)  # lets go of its claim, then lingers in its exit
    ready = world.root / "holder.ready"
    argv = [sys.executable, "-m", "gpulock", "run", "--config", str(world.config)]
    argv += ["--name", "holder", "--", sys.executable, str(script), str(ready)]
    holder = subprocess.Popen(argv, stdin=subprocess.PIPE, start_new_session=True)
    child_pid = 0
    try:
        wait_until(ready.exists, DEFAULT_WAIT_S, "the holder's command to run")
        child_pid = wait_until(
            lambda: next((t.child_pid for t in world.tickets().values() if t.child_pid), None),
            DEFAULT_WAIT_S,
            "the holder's child_pid",
        )
        waiter = aio(world, "async")
        wait_until(lambda: world.events("wait", ticket=waiter.seq), DEFAULT_WAIT_S, "its wait")
        wait_until(lambda: in_exit(child_pid), DEFAULT_WAIT_S, "its command inside its exit")
        os.kill(holder.pid, signal.SIGKILL)  # gpulock run alone: its command is still exiting
        assert holder.wait(30) == -signal.SIGKILL
        (waiting,) = wait_until(
            lambda: world.events("exit-wait", ticket=waiter.seq),
            DEFAULT_WAIT_S,
            "the async waiter's exit-wait event",
        )
        assert waiting["dead_child_pid"] == child_pid, waiting
        assert os.path.exists(f"/proc/{child_pid}")
        assert world.find_record("grant", "async") is None, world.describe()

        ended_ns = time.monotonic_ns()
        os.kill(child_pid, signal.SIGKILL)
        grant = world.wait_record("grant", "async", timeout_s=60)
        assert grant.ns >= ended_ns, world.describe()
        assert not world.events("exit-wait-timeout"), world.describe()
        waiter.send("release")
        assert waiter.wait_exit() == 0
        assert world.tickets() == {}
    finally:
        if child_pid:
            with contextlib.suppress(ProcessLookupError):  # its leader is a zombie already
                os.kill(child_pid, signal.SIGKILL)
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait(30)


def test_a_cancelled_async_waiter_for_a_set_leaves_every_line(world: World) -> None:
    """Several GPUs (issue 28): an ``acquire_async(gpu="any")`` waits in each GPU's line;
    cancelled, its copies and FIFOs leave every one at once; granted, it says which GPU."""
    world.config.write_text("simulate: 24GiB,24GiB\n")
    h0 = world.hold("h0", gpu=0)
    h1 = world.hold("h1", gpu=1)

    async def cancelled() -> int:
        task = asyncio.ensure_future(gpulock.acquire_async(gpu="any", name="set", timeout=60))
        mine = await asyncio.to_thread(
            wait_until,
            lambda: next((s for s, t in world.tickets(1).items() if t.name == "set"), None),
            DEFAULT_WAIT_S,
            "the async waiter's copy in gpu1's line",
        )
        assert mine in world.tickets(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return mine

    mine = asyncio.run(cancelled())
    for g in (0, 1):
        assert not [p for p in world.gpu_dir(g).iterdir() if p.name.startswith(f"{mine:012d}")]

    async def granted() -> tuple[int, ...]:
        task = asyncio.ensure_future(gpulock.acquire_async(gpu="any", name="set2", timeout=60))
        await asyncio.to_thread(world.wait_event, "wait", name="set2")
        h1.release()
        lease = await task
        try:
            return lease.gpus
        finally:
            lease.release()

    assert asyncio.run(granted()) == (1,)
    h0.release()
