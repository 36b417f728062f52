"""A test knob: stop a process at a named step of the lock's protocol until a test says go.

Two processes race in the lock: a holder's release (unlink its ticket, unlink its FIFO, close
its claim) against a successor's look at that ticket (two looks: its claim and its ticket
file).  Which interleaving happens is the kernel scheduler's choice, and the rare ones are the
dangerous ones; a test cannot wait for luck.  ``GPULOCK_TEST_PAUSE=<folder>:<step>,<step>...``
(read once at import; a test and debugging knob like ``GPULOCK_SAFETY_RECHECK_S``, not a
setting) makes this process stop once at each step named, so a test drives each process step
by step and forces every interleaving in turn:

* on reaching ``step`` it makes the FIFO ``<folder>/<step>.go``, then the file
  ``<folder>/<step>`` ("reached": the steps before it are done), and blocks opening the FIFO;
* the test opens that FIFO's write end and closes it: the process goes on with the step.

The steps (``STEPS``): ``release-ticket``, ``release-fifo``, ``release-close`` (before each of
``Lease.release``'s three acts) and ``release-done`` (after them); ``look-first``,
``look-second`` (before each of ``QueueDir.look``'s two looks) and ``look-done`` (after them);
``unwatch`` (in a waiter's letting go of its watches on the tickets ahead, between one
watch's two acts: where a signal's exception must not leave a watch half let go).
Unset, ``pause`` costs one comparison.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "GPULOCK_TEST_PAUSE"
STEPS = frozenset(
    {
        "release-ticket",
        "release-fifo",
        "release-close",
        "release-done",
        "look-first",
        "look-second",
        "look-done",
        "unwatch",
    }
)


def parse(raw: str) -> tuple[Path, set[str]] | None:
    """``<folder>:<step>,<step>...`` -> (folder, steps); None when unset or malformed."""
    folder, sep, names = raw.rpartition(":")
    steps = {s for s in names.split(",") if s in STEPS}
    if not sep or not folder or not steps:
        return None
    return Path(folder), steps


_plan = parse(os.environ.get(ENV, ""))


def pause(step: str) -> None:
    """Stop here, once, if ``GPULOCK_TEST_PAUSE`` names ``step`` (see the module docstring)."""
    if _plan is None or step not in _plan[1]:
        return
    folder, steps = _plan
    steps.discard(step)
    go = folder / f"{step}.go"
    os.mkfifo(go, 0o600)
    (folder / step).touch()
    fd = os.open(go, os.O_RDONLY)  # blocks until the test opens the write end
    try:
        while os.read(fd, 64):  # ...and returns once it has closed it again
            pass
    finally:
        os.close(fd)
