"""``/metrics`` over HTTP behind bearer keys (``metrics.api_keys_env``).

The open listener (``collector.MetricsServer``) is for loopback; a listener on any other
address needs keys, and then every request needs ``Authorization: Bearer KEY`` (else 401 with
``WWW-Authenticate: Bearer``).  Prometheus sends it with a scrape config's
``authorization: {type: Bearer, credentials_file: ...}``.  Keys are compared in constant time
and appear in no log line: the request handler logs nothing.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from gpulock.core.apikeys import bearer_ok
from gpulock.core.errors import GpulockError
from gpulock.core.settings import Settings
from gpulock.metrics.collector import Listener, StateCollector, registry
from gpulock.metrics.config import Listen

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
UNAUTHORIZED = b"401 Unauthorized: send the header Authorization: Bearer <key>\n"


def require_bearer(app: WsgiApp, keys: Sequence[str]) -> WsgiApp:
    """``app`` answering only requests that carry one of ``keys``; 401 for the rest."""
    wanted = tuple(keys)

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if bearer_ok(environ.get("HTTP_AUTHORIZATION"), wanted):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("Content-Length", str(len(UNAUTHORIZED))),
                ("WWW-Authenticate", 'Bearer realm="gpulock metrics"'),
            ],
        )
        return [UNAUTHORIZED]

    return guarded


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing: a request line is no one's business on stderr."""


class _Threading(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up the governor's exit


class KeyedMetricsServer(Listener):
    """Like ``collector.MetricsServer``, with every request checked for a bearer key."""

    def __init__(
        self,
        settings: Settings,
        listen: Listen,
        keys: Sequence[str],
        collector: StateCollector | None = None,
    ) -> None:
        if not keys:
            raise ValueError("KeyedMetricsServer needs at least one key")
        from prometheus_client import make_wsgi_app

        app = require_bearer(make_wsgi_app(registry(settings, collector)), keys)
        try:
            family = socket.getaddrinfo(
                listen.host, listen.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0][0]

            class Server(_Threading):
                address_family = family

            self._server = make_server(listen.host, listen.port, app, Server, handler_class=_Quiet)
        except OSError as e:
            raise GpulockError(
                f"cannot serve metrics on {listen}: {e.strerror or e}",
                hint="metrics.listen / --metrics-listen: pick a free port (ss -ltnp)",
            ) from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="gpulock-metrics", daemon=True
        )
        self._thread.start()
        self.host = listen.host
        self.port = self._server.server_port
