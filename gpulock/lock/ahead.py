"""Looking along one line: the live tickets ahead of a waiting one, the dead cleaned on the way.

A waiter (``gpulock.lock.waiter``) looks along each of its lines whenever something changed.  It
lists the tickets ahead of it once per wait: nobody is ever inserted ahead of a ticket, so later
looks only drop the ones that left (O(1) per handoff instead of O(queue length)).  It stops at
the nearest live waiter ahead, the only one that can change its answer.  A ticket whose owner is
gone (no process holds its FIFO open) is removed, with its copies in the other lines of its set,
unless it held the GPU and its processes are still exiting (``gpulock.lock.exitwait``): then it
blocks the line until they are gone.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from gpulock.core import identity
from gpulock.core.settings import Settings
from gpulock.lock.census import remove_dead_copies
from gpulock.lock.lines import Line
from gpulock.lock.queuedir import QueueDir, TicketFile
from gpulock.lock.ticket import Ticket, TicketFormatError, event_fields


def scan_ahead(
    settings: Settings, seq_mine: int, line: Line, exiting: Callable[[Ticket], bool]
) -> tuple[list[TicketFile], dict[int, int]]:
    """Live tickets ahead of ticket ``seq_mine`` in one line, nearest waiter only if one is
    ahead; with a watch fd for each (seq -> write end, the caller's to close).  ``exiting``:
    whether a dead holder's processes still block the line (``ExitWatch.blocks``).  Fills in
    ``line.ahead_seqs`` (once) and ``line.exit_blockers``."""
    live: list[TicketFile] = []
    fds: dict[int, int] = {}
    qdir = line.qdir
    if line.ahead_seqs is None:
        line.ahead_seqs = [s for s in qdir.seqs() if s < seq_mine]  # listed once per wait
    gone: set[int] = set()
    line.exit_blockers = []
    for seq in reversed(line.ahead_seqs):
        try:
            seen = qdir.look(seq)
        except TicketFormatError:
            continue  # garbage is skipped: it never holds the GPU
        if seen is None:
            gone.add(seq)
            continue
        tf, fd = seen
        if fd is None:
            if tf.ticket.holding and exiting(tf.ticket):
                line.exit_blockers.append(seq)  # cleaned once its processes are gone
                continue
            clean_dead(settings, qdir, tf)
            gone.add(seq)
            continue
        live.append(tf)
        fds[seq] = fd
        if not tf.ticket.holding and len(live) == 1:
            break  # a waiter ahead: it is all that can change my answer
    live.reverse()
    if gone:
        line.ahead_seqs = [s for s in line.ahead_seqs if s not in gone]
    return live, fds


def clean_dead(settings: Settings, qdir: QueueDir, tf: TicketFile) -> None:
    """Remove a ticket whose owner is gone (and its copies in its set's other lines), if this
    user may; another user's is left where it is (and skipped all the same)."""
    t = tf.ticket
    if not identity.may_signal(t.uid):
        return  # not ours to remove; it is skipped all the same
    if qdir.remove(t.seq):
        settings.emit(
            "cleanup",
            **event_fields(t),
            holding=t.holding,
            reason="owner gone: no process holds its FIFO open",
            by_pid=os.getpid(),
        )
    if t.spans:  # its copies in the other lines of its set died with it
        remove_dead_copies(settings, t)
