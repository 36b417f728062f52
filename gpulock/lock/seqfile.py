"""The sequence file, ``<state>/.seq``: the last ticket number handed out, and the short
``flock`` on it (the sequence mutex) under which every ticket is numbered and published.

The number taken under the mutex is the queue order, fixed at arrival.  The mutex is held for
microseconds, so only a stopped process can stall it: a wait for it keeps the caller's
deadline (``flock_until``).  Orphan FIFOs are removed under it too (``gpulock.lock.queuedir``),
so no ticket can be re-creating the same path meanwhile.  A reader that only wants to know how
far the numbers go (``last_issued``) reads the file without the mutex.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

from gpulock.core.errors import LockTimeout, StateDirError
from gpulock.core.statefile import open_regular


def open_seq(path: Path, mode: int) -> int:
    """Open (or create, with exactly ``mode`` whatever the umask) the sequence file.

    Refuses a symlink, a folder or a FIFO in its place, and explains a file the group's other
    members cannot open, with a StateDirError naming the file and its mode (never a traceback).
    """
    try:
        return open_regular(path, os.O_RDWR | os.O_CREAT, mode)
    except PermissionError as e:
        try:
            st = os.lstat(path)
            found = f"mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}, gid {st.st_gid}"
        except OSError:
            found = f"cannot create it in {path.parent}"
        raise StateDirError(
            str(path),
            f"cannot open it: {e.strerror} ({found}; needs {mode:04o})",
            hint=f"chmod {mode:o} {path}" if found.startswith("mode") else None,
        ) from None
    except OSError as e:
        raise StateDirError(str(path), f"cannot open it: {e.strerror or e}") from None


def flock_until(fd: int, deadline: float | None, gpu: int) -> None:
    """The sequence mutex is held for microseconds; only a stopped process can stall it."""
    if deadline is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    start = time.monotonic()
    pause = 0.0005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now = time.monotonic()
            if now >= deadline:
                raise LockTimeout(gpu, now - start) from None
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 0.05)


def read_last(fd: int) -> int:
    """The last number handed out, read through the open sequence file (0: none yet)."""
    raw = os.pread(fd, 32, 0).strip()
    return int(raw) if raw.isdigit() else 0


def write_last(fd: int, seq: int) -> None:
    """Record ``seq`` as the last number handed out (under the mutex)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{seq}\n".encode(), 0)


def last_issued(state_dir: Path) -> int | None:
    """The last number handed out, read without the mutex; None if the file cannot tell."""
    try:
        fd = open_regular(state_dir / ".seq", os.O_RDONLY)
        try:
            raw = os.pread(fd, 32, 0).strip()
        finally:
            os.close(fd)
        return int(raw) if raw.isdigit() else None
    except (OSError, StateDirError):
        return None
