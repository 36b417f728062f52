"""Append-only log files rotated by size: the one way gpulock's logs grow and roll over.

Used by the event log (``gpulock.core.events``), the agents' run logs (``gpulock.agents.logs``) and
the fleet's per-agent output logs (``gpulock.agents.fleetrun``).  A line is appended with one
``write()`` on an ``O_APPEND`` descriptor, so lines from many processes never interleave.  Past
``max_bytes`` the file is renamed to ``<name>.1`` (one old generation kept), under a short ``flock``
on a lock file beside it, so that two processes never rotate at once (the second would otherwise
rename the first one's fresh file over the old generation).

Files are opened as every state file is (``gpulock.core.statefile.open_regular``): a symlink, a
folder or a FIFO in a log's or a lock's place raises StateDirError instead of being followed or
hanging the writer; a new file gets exactly ``mode`` (0o660 in a group-shared folder).
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from gpulock.core.statefile import open_regular


def append(path: Path, data: bytes, *, mode: int, max_bytes: int, lock_name: str) -> None:
    """Append ``data`` with one write; past ``max_bytes``, rotate ``path`` to ``<path>.1``.

    Raises OSError or StateDirError: callers that must never fail catch them.
    """
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    try:
        os.write(fd, data)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size > max_bytes:
        rotate(path, max_bytes=max_bytes, mode=mode, lock_name=lock_name)


def rotate(path: Path, *, max_bytes: int, mode: int, lock_name: str) -> bool:
    """Rename ``path`` to ``<path>.1`` if it is a regular file over ``max_bytes``; True if so.

    Under an exclusive ``flock`` on ``lock_name`` in the same folder, and checked again once it
    is held: another process may have rotated meanwhile.
    """
    lfd = open_regular(path.with_name(lock_name), os.O_RDWR | os.O_CREAT, mode)
    try:
        fcntl.flock(lfd, fcntl.LOCK_EX)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size <= max_bytes:
            return False
        os.replace(path, path.with_name(path.name + ".1"))
        return True
    finally:
        os.close(lfd)  # closing drops the flock
