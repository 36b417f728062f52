"""Real local HTTP servers for the router's cloud tier: llama.cpp's own server, and a faulty one.

``LlamaServer`` runs ``python -m llama_cpp.server`` on the tiny model, on a free port of
127.0.0.1, in its own process group; ``start()`` returns once ``/v1/models`` answers (with a
deadline), ``stop()`` kills the group.  It speaks the OpenAI API for real (completions, chat,
streaming, usage), and with ``api_key=`` it refuses requests without that key: what proves a
key set in the environment actually travels to the server.

``FaultServer`` is a stdlib ``http.server`` in a thread of the test process that answers what
the test sets in ``mode``: ``429`` (with ``Retry-After`` when ``retry_after`` is set), ``500``,
``hang`` (no answer until the server stops, or ``hang_s``), ``ok`` (a well-formed OpenAI
completion or chat answer with usage, for "a success clears the cooldown"; streamed as
server-sent events when asked, with a usage chunk only when ``stream_options.include_usage``
asks for one, as OpenAI does), ``break`` (a stream that drops after its first piece),
``stall`` (a stream that sends its first piece, then nothing until the server stops or
``hang_s``).  Its
error bodies echo the request's ``Authorization`` header, as a careless proxy would, so that a
test can show the key never reaches the router's messages even when a server sends it back.
``hits`` lists every request (path, authorization header, body), so tests count what reached it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from procs import wait_until

START_S = 30.0  # the server imports uvicorn and loads the model: ~1 s, more on a busy machine


def log_tail(log: Path, chars: int = 4000) -> str:
    """The end of a test server's log, for an assertion's message."""
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def kill_group(proc: subprocess.Popen[bytes] | None, wait_s: float = 10.0) -> None:
    """SIGKILL a test server's process group (started with ``start_new_session``) and reap it."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _answers(url: str, headers: dict[str, str]) -> bool:
    req = urllib.request.Request(url, headers=headers)  # noqa: S310 (http://127.0.0.1 only)
    try:
        with urllib.request.urlopen(req, timeout=1.0) as r:  # noqa: S310
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class LlamaServer:
    """``python -m llama_cpp.server`` on the tiny model (see the module doc)."""

    model: Path
    log: Path
    api_key: str | None = None
    n_ctx: int = 256
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    chat_format: str | None = None  # e.g. chatml-function-calling: a server that calls tools

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> LlamaServer:
        for _attempt in range(3):  # a free port can be taken between the probe and the bind
            self.port = free_port()
            argv = [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(self.model),
                "--n_ctx",
                str(self.n_ctx),
                "--n_gpu_layers",
                "0",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ]
            if self.api_key:
                argv += ["--api_key", self.api_key]
            if self.chat_format:
                argv += ["--chat_format", self.chat_format]
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            proc = self.proc

            def up(proc: subprocess.Popen[bytes] = proc, headers: dict[str, str] = headers) -> str:
                if proc.poll() is not None:
                    return "exited"
                return "up" if _answers(f"{self.base_url}/models", headers) else ""

            state = wait_until(up, START_S, lambda: f"llama_cpp.server\n{self.output()}")
            if state == "up":
                return self
        raise AssertionError(f"llama_cpp.server would not start\n{self.output()}")

    def output(self) -> str:
        return log_tail(self.log)

    def stop(self) -> None:
        kill_group(self.proc, 5.0)


@dataclass
class Hit:
    path: str
    authorization: str | None
    body: dict[str, Any]


@dataclass
class FaultServer:
    """An OpenAI-shaped server that fails as told (see the module doc)."""

    mode: str = "500"
    retry_after: str | None = None
    hang_s: float = 30.0
    hits: list[Hit] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def start(self) -> FaultServer:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the test reads hits

            def do_GET(self) -> None:
                outer._answer(self, {})

            def do_POST(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                try:
                    body = json.loads(self.rfile.read(n) or b"{}")
                except ValueError:
                    body = {}
                outer._answer(self, body if isinstance(body, dict) else {})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self

    def stop(self) -> None:
        self._stop.set()  # hanging handlers return now
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def count(self, path_end: str = "") -> int:
        return sum(1 for h in self.hits if h.path.endswith(path_end))

    def _answer(self, h: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        auth = h.headers.get("authorization")
        self.hits.append(Hit(h.path, auth, body))
        mode = self.mode
        if mode == "hang":
            self._stop.wait(self.hang_s)
            mode = "500"
        if mode in ("ok", "break", "stall") and body.get("stream"):
            self._stream(
                h,
                body,
                broken=mode == "break",
                stall=self._stop if mode == "stall" else None,
                stall_s=self.hang_s,
            )
            return
        if mode == "ok":
            self._send(h, 200, _ok_answer(h.path, body))
            return
        status = {"429": 429, "400": 400}.get(mode, 500)
        # A careless server that echoes the request's credentials in its error body.
        err = {"error": {"message": f"failing as told; you sent {auth}", "type": "test"}}
        headers = {"Retry-After": self.retry_after} if status == 429 and self.retry_after else {}
        self._send(h, status, err, headers)

    @staticmethod
    def _stream(
        h: BaseHTTPRequestHandler,
        body: dict[str, Any],
        *,
        broken: bool,
        stall: threading.Event | None = None,
        stall_s: float = 0.0,
    ) -> None:
        """Server-sent events: two pieces, then usage only when asked (as OpenAI does);
        ``broken``: the connection drops after the first piece; ``stall``: after the first
        piece nothing more comes until the event is set (or ``stall_s``)."""
        chat = h.path.endswith("/chat/completions")
        chunks: list[dict[str, Any]] = []
        for piece in ("fi", "ne"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                choice["delta"] = {"content": piece}
            else:
                choice["text"] = piece
            chunks.append(_chunk(chat, [choice]))
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**_chunk(chat, []), "usage": _usage()})
        data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
        data += b"data: [DONE]\n\n"
        try:
            h.send_response(200)
            h.send_header("content-type", "text/event-stream")
            h.send_header("content-length", str(len(data)))
            h.end_headers()
            if broken:
                first = b"data: " + json.dumps(chunks[0]).encode() + b"\n\n"
                h.wfile.write(first)
                h.wfile.flush()
                h.close_connection = True
                h.connection.shutdown(socket.SHUT_RDWR)  # the rest never comes
                return
            if stall is not None:
                h.wfile.write(b"data: " + json.dumps(chunks[0]).encode() + b"\n\n")
                h.wfile.flush()
                stall.wait(stall_s)
                return
            h.wfile.write(data)
        except OSError:
            pass

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler,
        status: int,
        obj: dict[str, Any],
        headers: dict[str, str] | None = None,
    ) -> None:
        data = json.dumps(obj).encode()
        try:
            h.send_response(status)
            h.send_header("content-type", "application/json")
            h.send_header("content-length", str(len(data)))
            for k, v in (headers or {}).items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(data)
        except OSError:
            pass  # the client gave up (a timeout): nobody to answer


OK_TOKENS_IN = 11
OK_TOKENS_OUT = 3


def _usage() -> dict[str, int]:
    return {
        "prompt_tokens": OK_TOKENS_IN,
        "completion_tokens": OK_TOKENS_OUT,
        "total_tokens": OK_TOKENS_IN + OK_TOKENS_OUT,
    }


def _chunk(chat: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": "fault", "object": kind, "created": 0, "model": "fault", "choices": choices}


def _ok_answer(path: str, body: dict[str, Any]) -> dict[str, Any]:
    usage = _usage()
    model = str(body.get("model", "fault"))
    if path.endswith("/embeddings"):
        inputs = body.get("input")
        n = len(inputs) if isinstance(inputs, list) else 1
        data = [{"object": "embedding", "index": i, "embedding": [0.5, -0.5]} for i in range(n)]
        return {"object": "list", "data": data, "model": model, "usage": usage}
    if path.endswith("/chat/completions"):
        return {
            "id": "chatcmpl-fault",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "fine"},
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        }
    return {
        "id": "cmpl-fault",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "text": "fine", "finish_reason": "stop", "logprobs": None}],
        "usage": usage,
    }
