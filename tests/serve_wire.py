"""Raw HTTP/1.x on a socket, for the requests the official clients never send: pipelined
requests, half-sent headers, bodies over the limit, a byte a second, HTTP/1.0.

``responses(sock)`` reads the answers one after another from one buffered reader (so two
pipelined answers are both read), with ``http.client``'s parser.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

TIMEOUT_S = 60.0


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class _Kept:
    """The shared reader, which ``HTTPResponse`` may not close (the next answer follows)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def close(self) -> None:
        pass


class _Sock:
    """What ``http.client.HTTPResponse`` reads from: our one shared reader."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = _Kept(f)

    def makefile(self, mode: str) -> _Kept:
        return self.f


def connect(port: int, timeout: float = TIMEOUT_S) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def request_bytes(
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    version: str = "HTTP/1.1",
) -> bytes:
    head = f"{method} {path} {version}\r\nHost: 127.0.0.1\r\n"
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if body or method == "POST":
        hdrs.setdefault("Content-Length", str(len(body)))
    head += "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    return head.encode() + b"\r\n" + body


def responses(sock: socket.socket, n: int = 1, method: str = "POST") -> Iterator[Answer]:
    f = sock.makefile("rb")
    for _ in range(n):
        r = http.client.HTTPResponse(_Sock(f), method=method)  # type: ignore[arg-type]
        r.begin()
        yield Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())


def exchange(port: int, data: bytes, n: int = 1) -> list[Answer]:
    """Send ``data`` as is, read ``n`` answers."""
    with connect(port) as s:
        s.sendall(data)
        return list(responses(s, n))


def closed_by_peer(sock: socket.socket) -> bool:
    """The server closed the connection (reads EOF, or a reset)."""
    try:
        while True:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
