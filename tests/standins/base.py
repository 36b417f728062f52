"""The shared part of the stand-ins: a threaded HTTP server on a free port of 127.0.0.1.

A subclass implements ``handle(method, path, query, body) -> (status, payload)``; a payload
that is bytes or str goes out as is, anything else as JSON.  ``hold`` is an Event a test
clears to keep a "generation" in flight (it never waits more than 30 s), ``hits`` lists
every request.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class NdJson(list[Any]):
    """A streamed answer: one JSON object per line (Ollama's ``stream: true``)."""


class Sse(list[Any]):
    """A streamed answer as server-sent events (OpenAI's ``stream: true``): ``data: {json}`` a
    chunk, then ``data: [DONE]``."""


class StandIn:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.hits: list[tuple[str, str, Any]] = []
        self.last_headers: dict[str, str] = {}
        self.hold = threading.Event()
        self.hold.set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _do(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw
                parts = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(parts.query))
                with outer.lock:
                    outer.hits.append((method, self.path, body))
                    outer.last_headers = dict(self.headers)
                status, payload = outer.handle(method, parts.path, query, body)
                if isinstance(payload, NdJson):
                    data = "".join(json.dumps(x) + "\n" for x in payload).encode()
                    ctype = "application/x-ndjson"
                elif isinstance(payload, Sse):
                    data = "".join(f"data: {json.dumps(x)}\n\n" for x in payload).encode()
                    data += b"data: [DONE]\n\n"
                    ctype = "text/event-stream"
                elif isinstance(payload, bytes | str):
                    data = payload.encode() if isinstance(payload, str) else payload
                    ctype = "text/plain"
                else:
                    data = json.dumps(payload).encode()
                    ctype = "application/json"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._do("GET")

            def do_POST(self) -> None:
                self._do("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        raise NotImplementedError

    def start(self) -> StandIn:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()

    def later(self, delay_s: float, fn: Any) -> None:
        """Run ``fn`` after ``delay_s`` in a thread: what a server does after it answered."""
        t = threading.Timer(delay_s, fn)
        t.daemon = True
        t.start()

    def generating(self) -> None:
        """One request in flight: returns when the test sets ``hold`` (30 s at most)."""
        self.hold.wait(30)
