"""Proof, before any signal, that a process really holds the claim it is signalled for.

Tickets and resident records are files in the state folder, and in a group-shared folder any
member can write one: a pid and start time copied from ``/proc`` into such a file prove
nothing.  What a writer cannot forge is the kernel's word:

* the claim itself: the process holds the **read end** of the claim's FIFO (``gpulock.core.claim``)
  among its open files, seen in ``/proc/<pid>/fd`` (same device and inode as the FIFO at the
  claim's path, opened for reading: a watcher's write end does not count);
* the process runs as the uid the record claims (``/proc/<pid>/status``), which the reader
  already matched against the owner of the record's file;
* or, for the command of ``gpulock run`` that closed its inherited descriptor, descent from a
  process proven by the first two.

Every signal gpulock sends on behalf of a file (``gpulock break``, a waiter's ``on_hung:
kill``, the governor's force-evict) goes through ``send``: the target is pinned with a pidfd
first and proven after, so a pid reused in between is never hit.  Anything unproven is not
signalled; the caller reports it.
"""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

from gpulock.core import identity

__all__ = ["holds_claim", "proven", "runs_as", "send"]


def _fifo_key(fifo: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(fifo)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISFIFO(st.st_mode) else None


def _holds(pid: int, fifo: Path, key: tuple[int, int]) -> bool:
    folder = f"/proc/{pid}/fd"
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    suffix = "/" + fifo.name
    for name in names:
        link = f"{folder}/{name}"
        try:
            # The name first (readlink never touches the target's filesystem, so a stuck
            # network mount held by the process cannot hang us), then the inode.
            if not os.readlink(link).endswith(suffix):
                continue
            # The link's own mode mirrors how the file was opened: r for a read end.
            if not os.lstat(link).st_mode & stat.S_IRUSR:
                continue
            st = os.stat(link)
        except OSError:
            continue
        if stat.S_ISFIFO(st.st_mode) and (st.st_dev, st.st_ino) == key:
            return True
    return False


def holds_claim(pid: int, fifo: Path) -> bool:
    """Does ``pid`` hold the read end of the claim FIFO at ``fifo`` open right now?"""
    key = _fifo_key(fifo)
    return key is not None and _holds(pid, fifo, key)


def runs_as(pid: int, uid: int) -> bool:
    """Is ``pid``'s effective uid ``uid``?  (False when it cannot be read.)"""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    fields = line.split()
                    return len(fields) > 2 and fields[2] == str(uid).encode()
    except OSError:
        return False
    return False


def proven(pid: int, ticks: int | None, uid: int, fifo: Path) -> bool:
    """``pid`` is the recorded process (start time), runs as ``uid`` and holds the claim."""
    return (
        ticks is not None
        and identity.start_ticks(pid) == ticks
        and runs_as(pid, uid)
        and holds_claim(pid, fifo)
    )


def send(
    pid: int,
    ticks: int | None,
    uid: int,
    pidns: str | None,
    fifo: Path,
    sig: int,
    *,
    via: tuple[int, int | None] | None = None,
) -> bool:
    """Send ``sig`` to ``pid`` only on proof that it holds the claim at ``fifo``; True if sent.

    ``ticks`` is the recorded start time and ``uid`` the recorded (file-proven) owner.  With
    ``via=(owner_pid, owner_ticks)`` a target that does not hold the claim itself (a command
    that closed its inherited descriptor) is proven by descending from that owner, which must
    itself be proven.  Fails closed on any doubt.
    """
    if ticks is None or pidns is None or pidns != identity.pid_namespace():
        return False
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, OverflowError, ValueError):  # gone, or no pid at all (a garbage record)
        return False
    try:
        if not proven(pid, ticks, uid, fifo):
            if via is None or identity.start_ticks(pid) != ticks or not runs_as(pid, uid):
                return False
            owner, owner_ticks = via
            if owner not in identity.ancestors(pid) or not proven(owner, owner_ticks, uid, fifo):
                return False
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except ProcessLookupError:
            return False
        return True
    finally:
        os.close(pidfd)
