"""Every line of a state folder at once: which GPUs have a queue folder, who holds a GPU now,
where a process has tickets, and the copies a dead set ticket left in its other lines.

Each reads the folders one by one through ``gpulock.lock.queuedir.QueueDir``: for views (status,
the arbiter), repair and rare events, never for a waiter's hot path.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpulock.core import claim
from gpulock.core.settings import Settings
from gpulock.lock import exitwait
from gpulock.lock.queuedir import QueueDir
from gpulock.lock.ticket import Ticket, TicketFormatError, event_fields

# How long a caller waits for a killed owner's other claims to close (it is closing its
# descriptors one by one): microseconds on an idle machine, longer when its exit is preempted.
EXITING_S = 0.5


def queue_gpus(settings: Settings) -> list[int]:
    """GPUs that have a queue folder in this state folder."""
    try:
        names = os.listdir(settings.state_dir)
    except OSError:
        return []
    return sorted(
        int(n[3:])
        for n in names
        if n.startswith("gpu")
        and n[3:].isascii()
        and n[3:].isdigit()
        and _is_folder(settings.state_dir / n)
    )


def _is_folder(path: Path) -> bool:
    """A real folder (a file or symlink named like a queue is garbage, never a queue)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def holder_pids(settings: Settings) -> set[int]:
    """Pids that hold a GPU now: the owner and the command (``gpulock run``) of live holders."""
    pids: set[int] = set()
    for gpu in queue_gpus(settings):
        for t in QueueDir(settings, gpu, create=False).holders():
            pids.add(t.pid)
            if t.child_pid is not None:
                pids.add(t.child_pid)
    return pids


def remove_dead_copies(settings: Settings, t: Ticket) -> list[int]:
    """Remove the copies of ticket ``t`` (one for a set of GPUs) in the other folders of its
    set that no process holds any more; the GPUs cleaned.

    For a caller that found ``t``'s owner dead and may remove it (its owner or root): the other
    copies died with it (one owner holds every copy's claim), and a line nobody waits in would
    keep them until the next ticket there.  A copy that someone holds is left alone.
    """
    cleaned = []
    for g in t.gpu_set:
        if g == t.gpu:
            continue
        q = QueueDir(settings, g, create=False)
        try:
            tf = q.read(t.seq)
        except TicketFormatError:
            continue
        if tf is None or (tf.ticket.pid, tf.ticket.created_wall) != (t.pid, t.created_wall):
            continue
        if not _released(q, t) or not q.remove(t.seq):
            continue
        cleaned.append(g)
        settings.emit(
            "cleanup",
            **event_fields(tf.ticket),
            holding=tf.ticket.holding,
            reason="owner gone: no process holds its FIFO open (a copy of a set ticket)",
            by_pid=os.getpid(),
        )
    return cleaned


def _released(q: QueueDir, t: Ticket) -> bool:
    """Has every process let go of ``t``'s claim in ``q``'s line?

    A killed owner's descriptors close one by one on its way out, so the claim the caller saw
    gone may be the first of its copies' claims to go: while the owner is in its exit, wait a
    moment (kernel-woken) for the others.  A claim held by a running process is left alone.
    """
    try:
        fd = q.watch(t.seq)
    except TicketFormatError:
        return False  # not a FIFO: garbage, left to break --stale
    if fd is None:
        return True
    try:
        p = exitwait.proc_state(t.pid, t.start_ticks)
        return p is not None and exitwait.in_exit(p) and claim.wait_released(fd, EXITING_S)
    finally:
        os.close(fd)


def tickets_of(settings: Settings, pid: int, ticks: int | None) -> list[tuple[int, int]]:
    """The live tickets (its claim held) of process ``pid`` started at ``ticks``, in every
    line: (gpu, seq).  Reads every ticket: for evidence in rare events, not for a hot path."""
    out = []
    for gpu in queue_gpus(settings):
        q = QueueDir(settings, gpu, create=False)
        for seq, tf, _why in q.scan():
            t = None if tf is None else tf.ticket
            if t is not None and t.pid == pid and t.start_ticks == ticks and q.alive(seq):
                out.append((gpu, seq))
    return out
