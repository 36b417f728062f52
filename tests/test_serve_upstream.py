"""serve's client to its upstreams (``gpulock.serve.upstream``), against real sockets.

A small HTTP/1.1 server per test, written byte by byte on a socket in a thread (so each test
says exactly what goes on the wire: kept-alive answers, chunked ones, ones that end with their
connection, silences, a connection closed while idle, TLS with a throwaway CA); the client
under test runs on asyncio's loop in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import wait_until

from gpulock.serve.upstream import Client, Timeouts, UpstreamError

Answer = Callable[[socket.socket, int], bool]  # (connection, request number) -> keep it open?


class Wire:
    """A server that reads each request whole and hands the connection to ``answer``."""

    def __init__(self, answer: Answer, tls: ssl.SSLContext | None = None) -> None:
        self.answer = answer
        self.tls = tls
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.requests: list[bytes] = []
        self.release = threading.Event()  # what a test's answer waits on, set at the end
        threading.Thread(target=self._serve, daemon=True).start()

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/v1/chat/completions"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        if self.tls is not None:
            try:
                conn = self.tls.wrap_socket(conn, server_side=True)
            except (ssl.SSLError, OSError):
                conn.close()
                return
        with conn, contextlib.suppress(OSError):  # a client that left: nothing to answer
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                head, _, data = data.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(data) < length:
                    data += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + data[:length])
                data = data[length:]
                if not self.answer(conn, len(self.requests)):
                    return

    def close(self) -> None:
        self.release.set()
        self.sock.close()


@pytest.fixture
def wires() -> Iterator[list[Wire]]:
    made: list[Wire] = []
    yield made
    for w in made:
        w.close()


def serve(wires: list[Wire], answer: Answer, tls: ssl.SSLContext | None = None) -> Wire:
    w = Wire(answer, tls)
    wires.append(w)
    return w


def kept_alive(body: bytes) -> Answer:
    def answer(conn: socket.socket, _n: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        return True

    return answer


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


T = Timeouts(total_s=30.0, connect_s=10.0)


async def post(client: Client, url: str, t: Timeouts = T) -> tuple[int, bytes]:
    async with await client.post(url, b"{}", {"Authorization": "Bearer k"}, t) as r:
        return r.status, await r.read()


def on_loop(*calls: Callable[[Client], Any]) -> list[Any]:
    """Each of ``calls`` (given one client) awaited in turn on one event loop, as serve's are:
    what each returned, or the UpstreamError it raised."""

    async def go() -> list[Any]:
        c, out = Client(), []
        for call in calls:
            try:
                out.append(await call(c))
            except UpstreamError as e:
                out.append(e)
        await c.close()
        return out

    return asyncio.run(asyncio.wait_for(go(), 60))


def kind(e: Any) -> str:
    assert isinstance(e, UpstreamError), e
    return e.kind


def test_answers_one_after_another_share_one_kept_alive_connection(wires: list[Wire]) -> None:
    w = serve(wires, kept_alive(b'{"ok":1}'))

    async def five() -> list[bytes]:
        c = Client()
        out = []
        for _ in range(5):
            async with await c.post(w.url(), b'{"a":1}', {"Authorization": "Bearer k"}, T) as r:
                assert r.status == 200 and r.headers["content-length"] == "8"
                out.append(await r.read())
        await c.close()
        return out

    assert asyncio.run(five()) == [b'{"ok":1}'] * 5
    assert (w.connections, len(w.requests)) == (1, 5)
    first = w.requests[0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:%d\r\n" % w.port in first
    assert b"\r\nContent-Length: 7\r\n" in first and first.endswith(b'\r\n\r\n{"a":1}')
    assert b"\r\nAuthorization: Bearer k\r\n" in first


def test_a_chunked_answer_and_one_that_ends_with_its_connection_are_read_whole(
    wires: list[Wire],
) -> None:
    def chunked(conn: socket.socket, _n: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        conn.sendall(chunk(b"hello"))
        conn.sendall(chunk(b" world") + chunk(b""))
        return True

    def until_close(conn: socket.socket, _n: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        return False

    w, w2 = serve(wires, chunked), serve(wires, until_close)
    urls = (w.url(), w.url(), w2.url(), w2.url())
    assert on_loop(*[lambda c, u=u: post(c, u) for u in urls]) == [
        (200, b"hello world"), (200, b"hello world"), (200, b"all of it"), (200, b"all of it")
    ]  # fmt: skip
    assert w.connections == 1  # kept alive after a chunked answer too
    assert w2.connections == 2  # that server closes: a new connection each time


def test_lines_are_handed_on_as_they_come(wires: list[Wire]) -> None:
    got_first = threading.Event()

    def sse(conn: socket.socket, _n: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        conn.sendall(chunk(b"data: one\n\ndata"))  # a line and a half
        got_first.wait(30)  # the rest only once the client has the first line
        conn.sendall(chunk(b": two\n\n[x]") + chunk(b""))
        return True

    w = serve(wires, sse)

    async def read() -> list[bytes]:
        c = Client()
        out = []
        async with await c.post(w.url(), b"{}", {}, T) as r:
            async for line in r.lines():
                out.append(line)
                got_first.set()
        return out

    assert asyncio.run(read()) == [b"data: one\n", b"\n", b"data: two\n", b"\n", b"[x]"]


def test_silence_past_read_s_is_a_timeout_a_steady_trickle_is_not(wires: list[Wire]) -> None:
    def trickle(conn: socket.socket, _n: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        for b in b"slow.":
            conn.sendall(bytes([b]))
            w.release.wait(0.05)
        return True

    def stall(conn: socket.socket, _n: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nst")
        w2.release.wait(60)  # until the test ends
        return False

    w, w2 = serve(wires, trickle), serve(wires, stall)
    w3 = serve(wires, lambda conn, n: not w3.release.wait(60))  # no head at all
    ok, stalled, silent = on_loop(
        lambda c: post(c, w.url(), Timeouts(total_s=30, read_s=5.0)),
        lambda c: post(c, w2.url(), Timeouts(total_s=30, read_s=0.3)),
        lambda c: post(c, w3.url(), Timeouts(total_s=0.3)),
    )
    assert ok == (200, b"slow.")
    assert kind(stalled) == kind(silent) == "timeout"


def test_a_connection_the_server_closed_while_idle_is_not_used_again(wires: list[Wire]) -> None:
    def then_close(conn: socket.socket, _n: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return False  # closed right after, as a server's keep-alive timeout does

    w = serve(wires, then_close)

    async def twice() -> list[tuple[int, bytes]]:
        c = Client()
        out = []
        for _ in range(2):
            async with await c.post(w.url(), b"{}", {}, T) as r:
                out.append((r.status, await r.read()))
            # The server's close reaches this loop: the idle connection is seen dead.
            idle = next(iter(c._idle.values()))
            while idle and idle[0].transport is not None:
                await asyncio.sleep(0.01)
        return out

    assert asyncio.run(asyncio.wait_for(twice(), 30)) == [(200, b"ok")] * 2
    assert w.connections == 2


def test_an_answer_cut_short_and_a_refused_connection_are_connection_errors(
    wires: list[Wire],
) -> None:
    def short(conn: socket.socket, _n: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nnot fifty")
        return False

    w = serve(wires, short)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there

    def not_http(conn: socket.socket, _n: int) -> bool:
        conn.sendall(b"SSH-2.0-OpenSSH\r\n\r\n")
        return False

    garbage = serve(wires, not_http)
    cut, refused, not_http = on_loop(
        lambda c: post(c, w.url()),
        lambda c: post(c, f"http://127.0.0.1:{port}/v1"),
        lambda c: post(c, garbage.url()),
    )
    assert (kind(cut), kind(refused), kind(not_http)) == ("connection", "connection", "protocol")


def test_a_header_value_with_a_line_break_adds_no_header(wires: list[Wire]) -> None:
    w = serve(wires, kept_alive(b"{}"))

    async def go() -> None:
        await Client().post(w.url(), b"{}", {"Authorization": "Bearer k\r\nX-Evil: 1"}, T)

    with pytest.raises(UpstreamError) as e:
        asyncio.run(go())
    assert e.value.kind == "protocol"
    assert w.requests == []


def test_tls_with_the_systems_authorities_and_a_stranger_refused(
    wires: list[Wire], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_cluster_tls import make_certs

    certs = make_certs(tmp_path / "certs")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs.cert, certs.key)
    w = serve(wires, kept_alive(b'{"tls":true}'), tls=ctx)
    monkeypatch.setenv("SSL_CERT_FILE", str(certs.ca))  # what the system trusts, here
    assert on_loop(lambda c: post(c, w.url("https"))) == [(200, b'{"tls":true}')]
    monkeypatch.setenv("SSL_CERT_FILE", str(certs.other_ca))
    (e,) = on_loop(lambda c: post(c, w.url("https")))
    assert kind(e) == "connection" and "CERTIFICATE_VERIFY_FAILED" in str(e)
    wait_until(lambda: w.connections == 2, 10.0, "the refused handshake")


def test_an_answer_larger_than_the_buffer_is_read_whole_and_the_connection_kept(
    wires: list[Wire],
) -> None:
    # Many of the socket's reads (and past 1 MiB unread, the socket paused until taken).
    body = bytes(range(256)) * (3 << 12)  # 3 MiB
    w = serve(wires, kept_alive(body))
    assert on_loop(lambda c: post(c, w.url()), lambda c: post(c, w.url())) == [(200, body)] * 2
    assert w.connections == 1
