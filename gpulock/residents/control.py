"""The control socket between a resident model's owner and whoever asks it to let go.

One JSON object per line each way: a request (``{"op": "evict", "id": ..., "force": ...,
"timeout_s": ...}``) and its answer.  The socket lives in the 0700 state folder and the owner
also checks its peer's credentials; paths too long for ``AF_UNIX`` (108 bytes) are reached
through ``/proc/self/fd``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any

from gpulock.core import safejson


def _short(path: Path) -> tuple[str, int | None]:
    """A path the kernel accepts for AF_UNIX (108 bytes): via /proc/self/fd when too long."""
    if len(os.fsencode(path)) < 100:
        return str(path), None
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    return f"/proc/self/fd/{dfd}/{path.name}", dfd


def listen(path: Path) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    where, dfd = _short(path)
    try:
        s.bind(where)
        os.chmod(path, 0o600)
        s.listen(16)
    finally:
        if dfd is not None:
            os.close(dfd)
    return s


def ask(path: Path, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    where, dfd = _short(path)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(where)
            send(s, request)
            line = recv_line(s)
    finally:
        if dfd is not None:
            os.close(dfd)
    if not line:
        # The owner hung up without a word: it is exiting, or was killed mid-answer.  The
        # caller treats it like any failed connection, never as a crash of its own.
        raise OSError("the owner closed the connection without answering")
    try:
        reply = safejson.loads(line)  # another user's owner may answer '[[[[...'
    except ValueError:
        raise OSError("malformed answer") from None
    if not isinstance(reply, dict):
        raise OSError("malformed answer")
    return reply


def send(s: socket.socket, obj: dict[str, Any]) -> None:
    s.sendall(json.dumps(obj).encode() + b"\n")


def recv_line(s: socket.socket, limit: int = 1 << 16) -> bytes:
    buf = b""
    while b"\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > limit:
            raise OSError("answer too long")
    return buf.split(b"\n", 1)[0]


def requester_left(conn: socket.socket) -> bool:
    """True when the requester hung up (it gave up: no-answer); its request is void then."""
    import select

    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLRDHUP)
    gone = select.POLLHUP | select.POLLRDHUP | select.POLLERR
    return any(ev & gone for _, ev in poller.poll(0))


def peer_may_ask(conn: socket.socket, owner_uid: int) -> bool:
    """Only the same user or root may ask (the folder's mode already keeps others out)."""
    import struct

    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", raw)
    except OSError:
        return False
    return uid in (0, owner_uid)
