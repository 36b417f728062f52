"""Which processes serve a port: ``/proc/net/tcp{,6}`` -> socket inode -> ``/proc/PID/fd``.

A tenant is known by its URL, not its pid.  On a real GPU the truth about its memory is NVML's
per-process figure, so the listening port is turned into the pids that hold it (and a
llama-server router child's own port into that child's pid).  Processes of other users are
invisible without root: their pids are simply not found (unknown, never a guess).
"""

from __future__ import annotations

import os
import urllib.parse

LISTEN = "0A"


def port_of(url: str | None) -> int | None:
    if not url:
        return None
    parts = urllib.parse.urlsplit(url)
    try:
        return parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None


def listening_inodes(port: int, root: str = "/proc") -> set[str]:
    found: set[str] = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{root}/net/{name}", encoding="ascii", errors="replace") as f:
                next(f, None)  # the header line
                for line in f:
                    cols = line.split()
                    if len(cols) < 10 or cols[3] != LISTEN:
                        continue
                    _, _, hexport = cols[1].rpartition(":")
                    try:
                        if int(hexport, 16) == port:
                            found.add(cols[9])
                    except ValueError:
                        continue
        except OSError:
            continue
    return found


def pids_on_port(port: int | None, root: str = "/proc") -> tuple[int, ...]:
    """Pids holding a listening socket on ``port`` (this user's, or everyone's as root)."""
    if port is None:
        return ()
    inodes = {f"socket:[{i}]" for i in listening_inodes(port, root)}
    if not inodes:
        return ()
    pids = []
    for entry in os.scandir(root):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(f"{root}/{entry.name}/fd")
        except OSError:
            continue  # gone, or not ours to look at
        for fd in fds:
            try:
                if os.readlink(f"{root}/{entry.name}/fd/{fd}") in inodes:
                    pids.append(int(entry.name))
                    break
            except OSError:
                continue
    return tuple(sorted(pids))
