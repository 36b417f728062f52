"""A signal that reaches a process waiting in line is acted on at once, not at its next wake.

CPython runs a Python signal handler only between bytecodes of the main thread.  A SIGTERM
whose C-level handler runs just before the waiter enters ``poll()`` (or on another thread)
used to wait for the waiter's next wake: the tickets' kernel events, or its safety re-check.
Every test here sets that re-check to an hour (``GPULOCK_SAFETY_RECHECK_S``) and keeps the
holder holding, so only the signal's own wake-up can end the wait before the test's deadline:
the tests assert that the waiter leaves at all, never how fast.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from cli_helpers import GPULOCK, Cli

NO_RECHECK = "3600"  # the waiter's safety re-check: never within a test

# The main thread blocks SIGTERM, so the kernel hands it to a helper thread: its C-level
# handler runs there and the main thread, asleep in the waiter's poll(), is never
# interrupted.  That is the general form of the race (a handler still pending when poll()
# is entered), made deterministic.
WAITING_PY = """\
import signal, sys, threading
from gpulock import runner
from gpulock.core.settings import load
threading.Thread(target=threading.Event().wait, daemon=True).start()  # SIGTERM unblocked
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # in the main thread only
sys.exit(runner.run(load(None, sys.argv[1]), sys.argv[2:], name="deferred"))
"""

# The same for any program that waits in ``gpulock.acquire`` with a handler of its own.
ACQUIRE_PY = """\
import signal, sys, threading
import gpulock

class Stop(BaseException):
    pass

def stop(signum, frame):
    raise Stop

signal.signal(signal.SIGTERM, stop)
threading.Thread(target=threading.Event().wait, daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
try:
    gpulock.acquire(gpu=0, name="library")
except Stop:
    sys.exit(42)
sys.exit(1)
"""


def test_sigterm_handled_on_another_thread_ends_the_wait_in_line(cli: Cli) -> None:
    holder = cli.hold("holder")
    holder_files = cli.queue_files()
    driver = cli.script("waiting.py", WAITING_PY)
    waiter = cli.start(
        [sys.executable, str(driver), str(cli.state), "true"],
        "deferred",
        env=cli.env(GPULOCK_SAFETY_RECHECK_S=NO_RECHECK),
    )
    cli.wait_event("wait", name="deferred")
    os.kill(waiter.pid, signal.SIGTERM)
    assert waiter.wait() == 128 + signal.SIGTERM, waiter.output()
    assert holder.popen.poll() is None  # still holding: it was not the release that woke it
    assert cli.queue_files() == holder_files, cli.describe()
    assert not cli.events("acquire", name="deferred")
    holder.release()
    assert holder.wait() == 0, holder.output()


def test_a_library_waiter_with_its_own_handler_hears_the_signal(cli: Cli) -> None:
    holder = cli.hold("holder")
    holder_files = cli.queue_files()
    script = cli.script("acquire.py", ACQUIRE_PY)
    waiter = cli.start(
        [sys.executable, str(script)],
        "library",
        env=cli.env(GPULOCK_SAFETY_RECHECK_S=NO_RECHECK),
    )
    cli.wait_event("wait", name="library")
    os.kill(waiter.pid, signal.SIGTERM)
    assert waiter.wait() == 42, waiter.output()
    assert holder.popen.poll() is None
    assert cli.queue_files() == holder_files, cli.describe()
    holder.release()
    assert holder.wait() == 0, holder.output()


def test_sigterm_to_waiting_runs_under_cpu_load_always_ends_them(cli: Cli) -> None:
    """SIGTERM at swept instants after the ``wait`` event, two busy loops loading the CPU:
    every waiting ``gpulock run`` exits 143 while the holder still holds."""
    holder = cli.hold("holder")
    busy = [cli.start([sys.executable, "-c", "while True: pass"], f"busy{k}") for k in range(2)]
    failures = []
    try:
        for i in range(12):
            name = f"w{i}"
            waiter = cli.start(
                [*GPULOCK, "run", "--name", name, "--", "true"],
                name,
                env=cli.env(GPULOCK_SAFETY_RECHECK_S=NO_RECHECK),
            )
            cli.wait_event("wait", name=name)
            delay = 0.001 * (i % 6)
            if delay:
                time.sleep(delay)  # where in the window to strike, not a wait for anything
            os.kill(waiter.pid, signal.SIGTERM)
            try:
                code = waiter.wait()
            except AssertionError as e:  # still in line: the signal was never acted on
                waiter.kill_group()
                failures.append(f"try {i} ({delay * 1000:.0f} ms after its wait event): {e}")
                continue
            if code != 128 + signal.SIGTERM:
                failures.append(f"try {i}: exit {code}\n{waiter.output()}")
    finally:
        for b in busy:
            b.kill_group()
    assert holder.popen.poll() is None
    assert not failures, "\n".join(failures)
    assert not cli.events("acquire", name="w0")
    holder.release()
    assert holder.wait() == 0, holder.output()
