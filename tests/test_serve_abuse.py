"""``gpulock serve`` against rude requests, over real sockets to a live server: every refusal is
a 4xx in the API's own shape (never a 500, never a traceback in the log), and the server goes
on serving.

The module's server routes ``chat`` to an OpenAI-shaped stand-in upstream that answers at once
(``router_servers.FaultServer``), so what is tested is the door, not a model.  Its limits are
the defaults (``max_body`` 8 MiB, ``max_header`` 16 KiB) but ``read_timeout``, which is short
here so that the slow-client cases end quickly.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ollama
import pytest
from router_servers import FaultServer
from serve_server import GatewayProc, stand_in_gateway
from serve_wire import closed_by_peer, connect, exchange, request_bytes, responses

READ_TIMEOUT_S = 3.0
MSG = [{"role": "user", "content": "hello"}]
OK = {"model": "chat", "messages": MSG}


@pytest.fixture(scope="module")
def upstream() -> Iterator[FaultServer]:
    s = FaultServer(mode="ok").start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, upstream: FaultServer
) -> Iterator[GatewayProc]:
    root = tmp_path_factory.mktemp("abuse")
    g = stand_in_gateway(root, upstream.base_url, f"{{read_timeout: {READ_TIMEOUT_S}s}}")
    try:
        yield g.start()
    finally:
        g.stop()


@pytest.fixture(autouse=True)
def no_traceback(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test of this module: the log has no traceback and the server still serves."""
    yield
    if "gateway" in request.fixturenames:
        g: GatewayProc = request.getfixturevalue("gateway")
        assert "Traceback" not in g.output(), g.output()
        assert g.request("POST", "/v1/chat/completions", OK).status == 200


def post(g: GatewayProc, path: str, body: Any) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return g.request("POST", path, raw=raw)


# --- bodies that do not fit ----------------------------------------------------------------------

OPENAI_BAD = [
    ({"model": "chat", "messages": 5}, "messages", "'messages'"),
    ({**OK, "max_tokens": -1}, "max_tokens", "'max_tokens'"),
    ({**OK, "temperature": "hot"}, "temperature", "'temperature'"),
    ({**OK, "stream": "yes"}, "stream", "'stream'"),
    ({**OK, "n": 1000}, "n", "'n' must be 1"),
    ({"model": "chat", "messages": [{"role": "user", "content": [1, 2]}]}, "messages", "content"),
    ({"model": None, "messages": MSG}, "model", "'model' is required"),
    ({"model": "chat", "messages": [{"content": "no role"}]}, "messages", "'role'"),
    ({**OK, "stop": [1]}, "stop", "'stop'"),
    ({**OK, "stream_options": 3}, "stream_options", "stream_options"),
]


@pytest.mark.parametrize(("body", "param", "needle"), OPENAI_BAD)
def test_openai_bodies_that_do_not_fit_are_400_naming_the_key(
    gateway: GatewayProc, body: dict[str, Any], param: str, needle: str
) -> None:
    r = post(gateway, "/v1/chat/completions", body)
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and needle in err["message"], err


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "chat", "prompt": {"a": 1}}),
        ("/v1/completions", {"model": "chat", "prompt": "x", "max_tokens": 0}),
        ("/v1/embeddings", {"model": "chat", "input": [1, 2]}),
        ("/v1/embeddings", {"model": "chat", "input": "x", "encoding_format": "hex"}),
    ],
)
def test_the_other_openai_endpoints_check_their_shapes_too(
    gateway: GatewayProc, path: str, body: dict[str, Any]
) -> None:
    r = post(gateway, path, body)
    assert r.status == 400 and r.json()["error"]["type"] == "invalid_request_error", r.body


OLLAMA_BAD = [
    ("/api/chat", {"model": "chat", "messages": 5}),
    ("/api/chat", {**OK, "options": {"num_predict": "many"}}),
    ("/api/chat", {**OK, "options": {"temperature": "hot"}}),
    ("/api/chat", {**OK, "options": 7}),
    ("/api/chat", {**OK, "stream": "yes"}),
    ("/api/chat", {"model": "chat", "messages": [{"role": "user", "content": [1, 2]}]}),
    ("/api/chat", {"model": None, "messages": MSG}),
    ("/api/generate", {"model": "chat", "prompt": 5}),
    ("/api/generate", {"model": "chat", "prompt": "x", "raw": "yes"}),
    ("/api/embed", {"model": "chat", "input": [1]}),
    ("/api/embeddings", {"model": "chat", "prompt": 1}),
    ("/api/show", {"model": 5}),
]


@pytest.mark.parametrize(("path", "body"), OLLAMA_BAD)
def test_ollama_bodies_that_do_not_fit_are_400_in_ollamas_shape(
    gateway: GatewayProc, path: str, body: dict[str, Any]
) -> None:
    r = post(gateway, path, body)
    assert r.status == 400, r.body
    assert list(r.json()) == ["error"] and isinstance(r.json()["error"], str)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/api/generate"])
def test_invalid_utf8_and_deep_nesting_are_400(gateway: GatewayProc, path: str) -> None:
    r = post(gateway, path, b'{"model": "chat", "messages": [{"role": "user", "content": "\xff"}]}')
    assert r.status == 400 and "UTF-8" in r.body.decode(), r.body
    deep = b"[" * 10_000 + b"]" * 10_000  # 20 KB: json.loads would recurse 10,000 deep
    r = post(gateway, path, deep)
    assert r.status == 400 and "nests deeper" in r.body.decode(), r.body
    deep_inside = b'{"model": "chat", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert post(gateway, path, deep_inside).status == 400


def test_a_7_mb_prompt_inside_max_body_is_served(gateway: GatewayProc) -> None:
    body = {"model": "chat", "messages": [{"role": "user", "content": "x" * (7 << 20)}]}
    r = post(gateway, "/v1/chat/completions", body)
    assert r.status == 200, r.body[:300]
    r = post(gateway, "/api/chat", {**body, "stream": False})
    assert r.status == 200, r.body[:300]


NINE_MIB = b'{"model": "chat", "prompt": "' + b"x" * (9 << 20) + b'"}'


@pytest.mark.parametrize("path", ["/v1/completions", "/api/generate"])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_max_body_gets_a_413_the_client_reads(
    gateway: GatewayProc, path: str, chunked: bool
) -> None:
    if chunked:
        pieces = [NINE_MIB[i : i + (1 << 16)] for i in range(0, len(NINE_MIB), 1 << 16)]
        data = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        raw = request_bytes("POST", path, data, {"Transfer-Encoding": "chunked"})
        raw = raw.replace(b"Content-Length: %d\r\n" % len(data), b"")
    else:
        raw = request_bytes("POST", path, NINE_MIB)
    with connect(gateway.port) as s:
        s.sendall(raw)  # all of it: a reset would lose the answer
        (r,) = responses(s)
        assert r.status == 413, r.body
        assert "serve.max_body" in r.body.decode()
        assert r.headers["connection"] == "close"
        assert closed_by_peer(s)
    if path.startswith("/api/"):
        assert isinstance(r.json()["error"], str)
    else:
        assert r.json()["error"]["code"] == "body_too_large"


@pytest.mark.parametrize("path", ["/v1/completions", "/api/generate"])
def test_a_body_announced_over_max_body_is_answered_413_while_the_client_waits(
    gateway: GatewayProc, path: str
) -> None:
    """9 MiB announced, 64 KiB sent, then the client waits (for a 100 Continue it did not ask
    for, say): it hears the 413 at once, not a 408 at the read timeout; and one that goes on
    sending after all still reads it (the rest is drained behind the answer)."""
    raw = request_bytes("POST", path, NINE_MIB)
    head_end = raw.index(b"\r\n\r\n") + 4
    with connect(gateway.port) as s:
        s.sendall(raw[: head_end + (64 << 10)])
        f = s.makefile("rb")
        status = f.readline()
        assert status.startswith(b"HTTP/1.1 413 "), status
        s.sendall(raw[head_end + (64 << 10) :])  # the rest after all: no reset, no loss
        assert closed_by_peer(s)
    with connect(gateway.port) as s:
        s.sendall(raw[: head_end + (64 << 10)])
        (r,) = responses(s)  # the whole answer, body included, while the client sends no more
        assert r.status == 413 and "serve.max_body" in r.body.decode(), r.body


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_expect_100_continue(gateway: GatewayProc, path: str) -> None:
    body = json.dumps(OK).encode()
    with connect(gateway.port) as s:
        s.sendall(request_bytes("POST", path, b"", {"Expect": "100-continue",
                                "Content-Length": str(len(body))}))  # fmt: skip
        assert s.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(body)
        (r,) = responses(s)
        assert r.status == 200, r.body
    # Too large to take: 413 at once, before the client sends its body.
    head = {"Expect": "100-continue", "Content-Length": str(9 << 20)}
    with connect(gateway.port) as s:
        s.sendall(request_bytes("POST", "/api/chat", b"", head))
        (r,) = responses(s)
        assert r.status == 413 and isinstance(r.json()["error"], str)


# --- the HTTP layer ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_a_20_kb_header_is_431_in_the_apis_shape(gateway: GatewayProc, path: str) -> None:
    body = json.dumps(OK).encode()
    with connect(gateway.port) as s:
        s.sendall(request_bytes("POST", path, body, {"X-Big": "a" * 20_000}))
        (r,) = responses(s)
        assert r.status == 431, r.body
        assert "serve.max_header" in r.body.decode()
        assert closed_by_peer(s)
    err = r.json()["error"]
    assert isinstance(err, str) if path.startswith("/api/") else err["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_http_1_0_is_answered_and_closed(gateway: GatewayProc, path: str) -> None:
    body = json.dumps({**OK, "stream": False}).encode()
    with connect(gateway.port) as s:
        s.sendall(request_bytes("POST", path, body, version="HTTP/1.0"))
        (r,) = responses(s)
        assert r.status == 200, r.body
        obj = r.json()
        text = (
            obj["message"]["content"]
            if "message" in obj
            else obj["choices"][0]["message"]["content"]
        )
        assert text == "fine"
        assert closed_by_peer(s)


def test_pipelined_requests_are_answered_in_order(gateway: GatewayProc) -> None:
    a = request_bytes("POST", "/v1/chat/completions", json.dumps(OK).encode())
    b = request_bytes("POST", "/api/chat", json.dumps({**OK, "stream": False}).encode())
    c = request_bytes("GET", "/health")
    first, second, third = exchange(gateway.port, a + b + c, n=3)
    assert first.status == 200 and first.json()["object"] == "chat.completion"
    assert second.status == 200 and second.json()["done"] is True
    assert third.status == 200 and third.json()["status"] == "ok"


def test_garbage_instead_of_http_is_a_400_not_a_crash(gateway: GatewayProc) -> None:
    (r,) = exchange(gateway.port, b"\x16\x03\x01\x02\x00 not http at all\r\n\r\n")
    assert r.status == 400 and "error" in r.json()


# --- slow clients ---------------------------------------------------------------------------------


def answered(sock: socket.socket) -> bool:
    """Something (an answer, or the close) is waiting to be read on ``sock``, without blocking."""
    ready, _, _ = select.select([sock], [], [], 0)
    return bool(ready)


def test_slow_headers_and_bodies_are_closed_after_read_timeout(gateway: GatewayProc) -> None:
    silent = connect(gateway.port)  # connects, says nothing
    slow_head = connect(gateway.port)
    slow_head.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
    slow_body = connect(gateway.port)
    slow_body.sendall(request_bytes("POST", "/api/chat", b"{", {"Content-Length": "100"}))
    try:
        # Meanwhile a normal request is served: it does not wait behind them, so the slow ones
        # are all still open, unanswered, when its answer comes.
        assert gateway.request("POST", "/v1/chat/completions", OK).status == 200
        assert not any(answered(s) for s in (silent, slow_head, slow_body))
        (r,) = responses(slow_head)
        assert r.status == 408 and "serve.read_timeout" in r.json()["error"]["message"]
        (r,) = responses(slow_body)
        assert r.status == 408 and "serve.read_timeout" in r.json()["error"]
        assert closed_by_peer(slow_body)
        assert closed_by_peer(silent)
    finally:
        for s in (silent, slow_head, slow_body):
            s.close()


# --- what an Ollama app asks before a chat ------------------------------------------------------


def test_ollama_client_show_and_the_refused_model_file_endpoints(gateway: GatewayProc) -> None:
    c = ollama.Client(host=gateway.url)
    shown = c.show("chat")
    assert shown.modelinfo is not None
    arch = shown.modelinfo["general.architecture"]
    assert shown.modelinfo[f"{arch}.context_length"] == 2048  # the route's n_ctx default
    assert shown.details is not None
    with pytest.raises(ollama.ResponseError) as e:
        c.show("nope")
    assert e.value.status_code == 404 and "chat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.pull("chat")
    assert e.value.status_code == 404 and "routes" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.delete("chat")
    assert e.value.status_code == 404 and "does not delete" in e.value.error
    assert gateway.request("HEAD", "/api/tags").status == 200


# --- starting -----------------------------------------------------------------------------------


def test_a_port_in_use_is_an_error_before_any_listening_line(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        p = subprocess.run(
            [sys.executable, "-m", "gpulock", "serve", "--listen", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
            env=_env(tmp_path),
        )
    finally:
        taken.close()
    assert p.returncode == 1, p.stderr
    assert f"error: 127.0.0.1:{port} is already in use" in p.stderr
    assert "hint:" in p.stderr and "--listen" in p.stderr
    assert "listening on" not in p.stderr and "Errno" not in p.stderr


def test_no_routes_is_said_at_start(tmp_path: Path) -> None:
    g = GatewayProc(tmp_path / "serve.log", env=_env(tmp_path))
    g.start()
    try:
        assert "no routes are configured" in g.output()
        assert "examples/tiny.yaml" in g.output()
    finally:
        g.stop()


def _env(tmp_path: Path) -> dict[str, str]:
    import os

    config = tmp_path / "empty.yaml"
    config.write_text("simulate: 24GiB\n")
    return {
        **os.environ,
        "GPULOCK_CONFIG": str(config),
        "GPULOCK_STATE_DIR": str(tmp_path / "state"),
    }
