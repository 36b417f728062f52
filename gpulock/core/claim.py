"""A kernel-held claim: a FIFO whose read end its owner keeps open for as long as it lives.

The kernel closes the owner's descriptor when the owner exits, however it exits (SIGKILL too),
so ``open(fifo, O_WRONLY | O_NONBLOCK)`` failing with ``ENXIO`` ("no reader") is proof that no
process holds the claim any more, and a write end held by a watcher reports ``POLLERR`` the
moment the last read end closes.  Tickets (``gpulock.lock.lease``) and resident records
(``gpulock.residents.owner``) both stand on this.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import select
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path

PIPE_BYTES = 4096  # a claim carries no data but one-byte doorbells: one page is plenty
DOORBELL = b"\x01"
KILL_WAIT_S = 5.0  # after SIGKILL the kernel frees a process in well under this


class NotAClaim(ValueError):
    """Something sits at the claim's path that is not a FIFO (garbage, or a planted file)."""


def create(path: Path, mode: int) -> int:
    """Make the FIFO and hold it open read-write (non-blocking); return the owner's descriptor.

    Read-write, so that the owner is also a writer: its own poll() never sees POLLHUP when a
    prober opens and closes a write end.
    """
    try:
        os.unlink(path)  # debris of a crash between mkfifo and publishing
    except FileNotFoundError:
        pass
    os.mkfifo(path, mode)
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, mode)
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass
    except BaseException:
        os.close(fd)
        raise
    return fd


def watch(path: Path) -> int | None:
    """A write end of the claim, or None when no process holds it (or it is gone).

    The descriptor reports POLLERR once every read end has closed.  Raises NotAClaim when the
    path is something other than a FIFO.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISFIFO(st.st_mode):
        raise NotAClaim(f"{path.name} is not a FIFO")
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ENXIO, errno.ENOENT):  # ENXIO: no reader, the owner is gone
            return None
        raise


def _watch_quietly(path: Path) -> int | None:
    """``watch``, with anything that is not a FIFO counting as no holder."""
    try:
        return watch(path)
    except NotAClaim:
        return None


def held(path: Path) -> bool:
    """Does a live process hold this claim?  Anything that is not a FIFO holds nothing."""
    fd = _watch_quietly(path)
    if fd is None:
        return False
    os.close(fd)
    return True


def ring(path: Path) -> bool:
    """Write a doorbell byte for the claim's owner (it polls its read end); False if gone."""
    fd = _watch_quietly(path)
    if fd is None:
        return False
    try:
        os.write(fd, DOORBELL)
    except BlockingIOError:
        pass  # the pipe is full of doorbells already: it will wake
    except BrokenPipeError:
        return False  # its owner closed it between our open and our write: it is gone
    finally:
        os.close(fd)
    return True


def drain(fd: int) -> None:
    """Empty the owner's read end of doorbells."""
    try:
        while os.read(fd, PIPE_BYTES):
            pass
    except BlockingIOError:
        pass


def wait_released(fd: int, timeout_s: float) -> bool:
    """Wait (kernel-woken) until every read end of the watched claim has closed; False at the
    deadline.  ``fd`` is a write end from ``watch``."""
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR and POLLHUP are always reported
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if poller.poll(max(0, math.ceil(left * 1000))):
            return True
        if time.monotonic() >= deadline:
            return False


def end_owner(
    fd: int,
    send: Callable[[int], bool],
    grace_s: float,
    announce: Callable[[str], None],
) -> str:
    """End the process holding a claim: SIGTERM, up to ``grace_s`` for the claim to go, then
    SIGKILL and up to ``KILL_WAIT_S``.

    ``send(sig)`` signals the owner and says whether it still was the recorded process (see
    ``proof.send``); ``announce(name)`` runs before each signal, so the event that
    explains a kill is written before the kill.  Returns ``not-sent``, ``terminated``,
    ``killed`` or ``survived`` (another process still holds the claim, e.g. an inherited fd).
    """
    announce("SIGTERM")
    if not send(signal.SIGTERM):
        return "not-sent"
    if wait_released(fd, grace_s):
        return "terminated"
    announce("SIGKILL")
    send(signal.SIGKILL)
    return "killed" if wait_released(fd, KILL_WAIT_S) else "survived"
