"""A waiter's descriptors in its poll set, let go of in an order that survives a signal.

A waiter sleeps on its own claims' read ends (``mine``: a byte in one is a doorbell) and on the
write ends of the FIFOs it depends on (``watched``: ``POLLERR`` when that owner releases, leaves
or dies).  A signal's handler may raise (``gpulock run``'s SIGTERM, an agent's stop, Ctrl-C)
between any two bytecodes, and the waiter's clean-up then runs in a ``finally``.  So every
descriptor is registered with the poller before it is recorded here, and forgotten here before
it is unregistered and closed: an exception between two of those acts leaves at worst one
descriptor open until exit, never one that the clean-up unregisters or closes a second time
(``KeyError: 5``; a number closed twice may be someone else's by then).  The exit watch's
pidfds (``gpulock.lock.exitwait``) and the signal wake-up pipe (``Waiter.wait``) keep the same
order.
"""

from __future__ import annotations

import os
import select

from gpulock.lock.exitwait import Poller
from gpulock.lock.queuedir import pause


class Watches:
    """The descriptors one waiter sleeps on, each registered with ``poller`` while recorded."""

    __slots__ = ("mine", "poller", "watched")

    def __init__(self, poller: Poller) -> None:
        self.poller = poller
        self.mine: set[int] = set()  # my claims' read ends: a byte in one is a doorbell
        self.watched: dict[tuple[int, int], int] = {}  # (gpu, seq) -> a write end of its FIFO

    def add_mine(self, fd: int) -> None:
        """Sleep on one of my claims (its doorbell); the claim itself is the caller's."""
        self.poller.register(fd, select.POLLIN)
        self.mine.add(fd)

    def drop_mine(self, fd: int) -> None:
        """Stop sleeping on one of my claims; it stays open (its owner closes it)."""
        self.mine.discard(fd)
        self.poller.unregister(fd)

    def watch(self, key: tuple[int, int], fd: int) -> None:
        """Sleep on ``fd``, a write end this waiter owns from now on (closed when let go)."""
        self.poller.register(fd, 0)  # POLLERR/POLLHUP are always reported
        self.watched[key] = fd

    def rewatch(self, want: set[tuple[int, int]], fds: dict[tuple[int, int], int]) -> None:
        """Watch exactly the ``fds`` whose key is in ``want``; close the rest (all were mine)."""
        self.unwatch_all()
        for key, fd in fds.items():
            if key in want:
                self.watch(key, fd)
            else:
                os.close(fd)

    def unwatch_all(self) -> None:
        """Let go of every watch: forgotten, unregistered, closed, in that order."""
        while self.watched:
            _key, fd = self.watched.popitem()
            self.poller.unregister(fd)
            pause("unwatch")  # (test hook: gpulock.lock.steps)
            os.close(fd)

    def close(self) -> None:
        """Let go of every watch and stop sleeping on my claims (which stay open)."""
        self.unwatch_all()
        while self.mine:
            self.poller.unregister(self.mine.pop())
