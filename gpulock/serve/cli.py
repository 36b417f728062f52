"""``gpulock serve``: one OpenAI- and Ollama-compatible endpoint in front of every model.

Found by ``gpulock`` through the ``gpulock.commands`` entry point (``serve``); Starlette, uvicorn
and httptools (the ``serve`` extra) are imported only here, when the server starts.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from gpulock.cli import Parser, run_command
from gpulock.core.errors import GpulockError
from gpulock.core.extras import install_hint
from gpulock.serve import config as serve_config

if TYPE_CHECKING:
    from gpulock.core.settings import Settings
    from gpulock.serve.dispatch import Dispatcher

DESCRIPTION = """\
Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models) and
the Ollama API (/api/chat, /api/generate, /api/embed, /api/embeddings, /api/show, /api/tags,
/api/ps, /api/version) for every task and model of the route table (config: routes:).  A
request for a GPU model waits in the same per-GPU line as `gpulock run` jobs, under the name of
its X-Gpulock-Agent header.
Also GET /gpulock/status (as `gpulock status --json`), GET /health, GET /metrics and
GET /openapi.json (the OpenAPI 3.1 document of all of these)."""

EPILOG = """\
Listening on anything but loopback needs API keys: serve.api_keys_env names the environment
variable that holds them (comma- or whitespace-separated); every request then sends
Authorization: Bearer KEY.  SIGTERM or Ctrl-C stops it cleanly: requests waiting for a GPU are
answered 503, running ones finish (5 s at most), tickets are released, the host leaves its
cluster, and it prints "gpulock serve: stopped (SIGTERM)".  exit codes: 0 stopped; 1 error
(bad config: file, line and key are named; or the address is already in use); 2 usage (bad
--listen or --port, or a non-loopback address without keys)."""


def build_parser(prog: str = "gpulock serve") -> argparse.ArgumentParser:
    p = Parser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=f"address to listen on (default: serve.listen, else {serve_config.DEFAULT_LISTEN}); "
        "a bare PORT means 127.0.0.1:PORT",
    )
    p.add_argument(
        "--port",
        metavar="PORT",
        help="the port alone, on serve.listen's host (else 127.0.0.1)",
    )
    p.add_argument("--config", metavar="FILE", help="config file (default: the usual lookup)")
    p.add_argument("--state-dir", metavar="DIR", help="state folder (default: as gpulock's)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_main, argv)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from gpulock.core.settings import load

    settings = load(args.config, args.state_dir)
    sc = serve_config.load(settings.config)
    host, port = sc.host, sc.port
    if args.listen:
        host, port = serve_config.parse_listen(args.listen)
    if args.port is not None:
        if args.listen:
            raise serve_config.ListenError(
                "--listen and --port both name the port: give one of them",
                hint="--listen HOST:PORT, or --port PORT on serve.listen's host",
            )
        port = serve_config.parse_port(args.port)
    keys = serve_config.read_keys(sc)
    if not serve_config.is_loopback(host):
        if sc.api_keys_env is None:
            raise serve_config.ListenError(
                f"refusing to listen on {host}:{port} without API keys",
                hint="set serve.api_keys_env to the NAME of a variable holding the keys, "
                "or listen on 127.0.0.1",
            )
        if not keys:
            raise serve_config.ListenError(
                f"refusing to listen on {host}:{port}: ${sc.api_keys_env} holds no key",
                hint=f"export {sc.api_keys_env}=... (one or more keys, comma-separated)",
            )
    elif sc.api_keys_env is not None and not keys:
        raise serve_config.ListenError(
            f"serve.api_keys_env names {sc.api_keys_env}, which holds no key",
            hint=f"export {sc.api_keys_env}=... or remove serve.api_keys_env",
        )
    try:
        import httptools  # noqa: F401  (the parser of serve's client to its upstreams)
        import uvicorn
    except ImportError as e:
        raise GpulockError(
            f"gpulock serve needs its extra ({e})", hint=install_hint("serve")
        ) from None
    from gpulock.router.routes import load_table
    from gpulock.serve.app import build_app
    from gpulock.serve.dispatch import Dispatcher
    from gpulock.serve.line import Line
    from gpulock.serve.protocol import protocol

    # Bound before anything says "listening" or joins a cluster: a taken port is an error.
    sock = bind(host, port)
    fewer_arenas()
    table = load_table(settings.config)
    dispatcher = Dispatcher(settings, table, Line(settings, sc.max_queue))
    halt_cluster = _join_cluster(settings, dispatcher)

    async def shutdown() -> None:
        if halt_cluster is not None:
            halt_cluster()
        await dispatcher.shutdown()

    app = build_app(
        settings,
        dispatcher,
        keys=keys,
        max_body=sc.max_body_bytes,
        read_timeout=sc.read_timeout_s,
        on_shutdown=shutdown,
    )
    logging.basicConfig(level=logging.INFO, format="gpulock serve: %(message)s")
    print(
        f"gpulock serve: listening on http://{_url_host(host)}:{port} "
        f"({len(table.tasks)} tasks; keys {'required' if keys else 'off'})",
        file=sys.stderr,
        flush=True,
    )
    if not table.tasks:
        print(
            "gpulock serve: no routes are configured, so every model name is answered 404; "
            "add a routes: section (see examples/tiny.yaml) or pass --config examples/tiny.yaml",
            file=sys.stderr,
            flush=True,
        )
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,  # an access log line per request; Authorization is never logged
        lifespan="on",
        proxy_headers=False,  # nothing here reads X-Forwarded-*: not parsed per request
        # asyncio's own loop, whatever else is installed: uvicorn would take uvloop where it
        # finds it, and with it a cluster host kept a request it should have sent to an idle
        # peer (tests/test_cluster_serve.py, reproduced with the code before issue 31 too).
        # It saved about 5 % of the gateway's CPU: not worth an untested loop.
        loop="asyncio",
        timeout_graceful_shutdown=5,
        http=protocol(max_header=sc.max_header_bytes, read_timeout=sc.read_timeout_s),
    )
    server = stopping_server(uvicorn, config, dispatcher.line.stop)
    server.run(sockets=[sock])
    if server.stopped_by is not None:
        print(f"gpulock serve: stopped ({server.stopped_by})", file=sys.stderr, flush=True)
    return 0


def stopping_server(uvicorn: Any, config: Any, stop_line: Callable[[], None]) -> Any:
    """A uvicorn server that stops cleanly on SIGINT and SIGTERM, and says so.

    uvicorn re-raises the signal it stopped on once it has shut down, so the process dies of
    it (exit 130, 143) after all.  Here a stop asked for is a stop done: the requests waiting
    for a place in the line are answered (503, ``gpulock.serve.line.Stopping``), those running
    may finish (``timeout_graceful_shutdown``), then the app's shutdown releases what it holds
    and withdraws this host from its cluster, and ``gpulock serve`` exits 0, having printed
    ``gpulock serve: stopped (SIGTERM)``.  A second Ctrl-C forces the exit, as uvicorn's does.
    """

    class Server(uvicorn.Server):  # type: ignore[misc]
        stopped_by: str | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            before = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.stopped_by is None:
                self.stopped_by = signal.Signals(sig).name
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            stop_line()
            await super().shutdown(sockets)

    return Server(config)


def _join_cluster(settings: Settings, dispatcher: Dispatcher) -> Callable[[], None] | None:
    """With a ``cluster:`` section: publish this host and route across hosts (the ``redis``
    client and the cluster package are imported only then)."""
    from gpulock.cluster import config as cluster_config

    cc = cluster_config.load(settings.config)
    if cc is None:
        return None
    from gpulock.cluster.store import _client_module
    from gpulock.serve.cluster_link import ClusterLink

    _client_module()  # a missing extra fails here, with the pip command, not at the first beat
    link = ClusterLink(settings, cc, dispatcher)
    dispatcher.cluster = link
    link.heartbeat.tick()  # the first beat before the first request: peers are known at once
    return link.start()


class PortInUse(GpulockError):
    """The listen address is taken (another gpulock serve, or Ollama on its port)."""

    exit_code = 1


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now, so that a taken port is reported before the server
    says it listens (uvicorn would print its own ``[Errno 98]`` and exit 3)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it a kept-alive client waits ~40 ms (Nagle and delayed ACKs) for each answer.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        where = f"{_url_host(host)}:{port}"
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(
                f"{where} is already in use",
                hint=f"stop what listens there (ss -ltnp 'sport = :{port}'), "
                "or pick another address with --listen HOST:PORT or serve.listen",
            ) from None
        raise PortInUse(f"cannot listen on {where}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def fewer_arenas(n: int = 2) -> None:
    """At most ``n`` glibc malloc arenas (unless ``MALLOC_ARENA_MAX`` says otherwise).

    llama.cpp calls and blocking probes run in worker threads, and glibc gives threads their
    own arenas (up to 8 per core), which it seldom hands back: measured in
    tests/test_serve_rude_clients.py, the resident size grew by a third over each of the first
    waves of 300 requests with the default, and stayed within a few % with 2."""
    if "MALLOC_ARENA_MAX" in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-8, n)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass  # not glibc (musl has no arenas to bound)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
