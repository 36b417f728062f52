"""An OpenAI-shaped upstream that breaks the wire as told, written byte by byte on a socket.

Modes: ``short-body`` (a JSON answer whose Content-Length promises more than is sent, then the
connection closes), ``bad-sse`` (a stream whose first event is not JSON), ``bad-sse-late`` (one
good piece, then an event that is not JSON), ``hang`` (reads the request, never answers),
``stream-then-wait`` (one good piece, then nothing: the test kills the process).

Imported: ``RawUpstream(mode).start()`` serves from a thread.  Run as a script
(``python tests/raw_upstream.py MODE``): serves in this process and prints its port, so a test
can kill it mid-stream.
"""

from __future__ import annotations

import json
import socket
import sys
import threading

GOOD = {
    "id": "c",
    "object": "chat.completion.chunk",
    "created": 0,
    "model": "raw",
    "choices": [{"index": 0, "delta": {"content": "fi"}, "finish_reason": None}],
}


class RawUpstream:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.hits = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> RawUpstream:
        threading.Thread(target=self.serve, daemon=True).start()
        return self

    def serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.one, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()

    def one(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                more = conn.recv(65536)
                if not more:
                    return
                data += more
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                (int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
                 if k.strip().lower() == b"content-length"),
                0,
            )  # fmt: skip
            while len(body) < length:
                body += conn.recv(65536)
            self.hits += 1
            self.answer(conn)

    def answer(self, conn: socket.socket) -> None:
        mode = self.mode
        if mode == "hang":
            self.stop.wait(60)
            return
        if mode == "short-body":
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500\r\n"
                b'\r\n{"id": "x", "choices": ['
            )
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        good = b"data: " + json.dumps(GOOD).encode() + b"\n\n"
        if mode == "bad-sse":
            conn.sendall(b"data: {not json at all\n\n")
        elif mode == "bad-sse-late":
            conn.sendall(good + b"data: {not json at all\n\n")
        elif mode == "stream-then-wait":
            conn.sendall(good)
            self.stop.wait(60)


if __name__ == "__main__":
    up = RawUpstream(sys.argv[1])
    print(up.port, flush=True)
    up.serve()
