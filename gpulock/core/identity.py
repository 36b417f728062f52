"""Who owns a ticket, and safe ways to signal that owner.

Liveness itself is not decided here: a ticket is alive while the kernel still holds its FIFO
open (see ``gpulock.lock.lease``).  What this module adds is identity for humans and for the
cases the kernel cannot answer: pid + start time (+ boot id, + pid namespace) name one process
uniquely, so a pid that was reused by another program never counts as the owner and is never
signalled.

Start times are read from ``/proc/<pid>/stat`` (field 22, clock ticks since boot), the same
number psutil reads, without psutil's 20 ms import on the path of every ``gpulock run``.
"""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True, slots=True)
class Identity:
    """One process, named so that a reused pid cannot pass for it."""

    pid: int
    start_ticks: int | None  # /proc/<pid>/stat starttime; None where /proc cannot say
    boot_id: str | None
    pidns: str | None  # e.g. "pid:[4026531836]": pids only compare inside one namespace
    uid: int
    user: str
    host: str


def stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (index 0 is field 3, the state), or None if the
    process does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    return data[data.rfind(b")") + 2 :].split()


def _stat_int(pid: int, index: int) -> int | None:
    fields = stat_fields(pid)
    try:
        return int(fields[index]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it does not exist."""
    return _stat_int(pid, 19)  # field 22 overall


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` (0 for init), or None if it is gone."""
    return _stat_int(pid, 1)  # field 4 overall


def ancestors(pid: int | None = None, limit: int = 256) -> list[int]:
    """Pids of the ancestors of ``pid`` (default: this process), nearest first."""
    out: list[int] = []
    cur = os.getpid() if pid is None else pid
    while len(out) < limit:
        ppid = parent_pid(cur)
        if not ppid or ppid == cur:
            break
        out.append(ppid)
        cur = ppid
    return out


@cache
def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def pid_namespace(pid: int | str = "self") -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def current() -> Identity:
    """The identity of this process."""
    pid = os.getpid()
    uid = os.geteuid()
    return Identity(
        pid=pid,
        start_ticks=start_ticks(pid),
        boot_id=boot_id(),
        pidns=pid_namespace(),
        uid=uid,
        user=user_name(uid),
        host=socket.gethostname(),
    )


def pid_exists(pid: int) -> bool:
    """Is there a process ``pid`` (anyone's: another user's counts)?  Not which one it is:
    for that, ``same_process`` with its start time."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's (EPERM): it exists
    return True


def same_process(pid: int, ticks: int | None, boot: str | None, pidns: str | None) -> bool:
    """True only on proof that ``pid`` here and now is the process that was recorded.

    Fails closed: another boot, another pid namespace, a missing start time or a different one
    all say "not the same", so a reused pid is never mistaken for the owner.
    """
    if ticks is None or pidns is None or pidns != pid_namespace():
        return False
    if boot is not None and boot != boot_id():
        return False
    return start_ticks(pid) == ticks


def may_signal(owner_uid: int) -> bool:
    """Only a ticket's owner or root may kill its process."""
    euid = os.geteuid()
    return euid == 0 or euid == owner_uid


def signal_exact(pid: int, ticks: int | None, pidns: str | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the recorded process; True if sent.

    Opens a pidfd first and checks the start time after, so the process verified is the one
    signalled: if the pid is reused between the two steps, the check fails instead of hitting
    a stranger.
    """
    if ticks is None or pidns is None or pidns != pid_namespace():
        return False
    try:
        pidfd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return False
    try:
        if start_ticks(pid) != ticks:
            return False
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except ProcessLookupError:
            return False
        return True
    finally:
        os.close(pidfd)
