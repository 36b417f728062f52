"""The exporter's edges: the collector, the exposition bytes, the textfile, the HTTP listener.

``StateCollector(settings)`` is a ``prometheus_client`` collector: each ``collect()`` reads the
state as it is now (``gpulock.status.snapshot``) and the counters caught up with the event log
(``gpulock.metrics.cursor``), and yields fresh families; nothing is kept in global metric
objects, so a scrape shows exactly the state at scrape time.  Another daemon (``gpulock
serve``) mounts it on its own port with ``registry(settings)`` (a ``CollectorRegistry`` for
``prometheus_client.make_wsgi_app`` / ``make_asgi_app``) or answers with
``exposition(settings)`` and ``CONTENT_TYPE``.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from gpulock.core.errors import GpulockError
from gpulock.core.settings import Settings
from gpulock.metrics.config import Listen
from gpulock.metrics.cursor import EventCounters
from gpulock.metrics.families import families

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the text format generate_latest writes
TEXTFILE_MODE = 0o644  # node_exporter usually runs as its own user: it must read the file


class StateCollector:
    """Families built from a state folder at each scrape (see the module doc)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.counters = EventCounters(settings)
        self._lock = threading.Lock()  # the HTTP server answers scrapes in threads

    def prime(self) -> None:
        """Catch the counters up with the event log now (a first look at a big log takes
        seconds: a daemon does it at start, so that its first scrape need not)."""
        with self._lock:
            self.counters.current()

    def collect(self) -> Iterator[Metric]:
        from gpulock import status

        with self._lock:
            tally = self.counters.current()
            snap = status.snapshot(self.settings)
        yield from families(snap, tally)


def registry(settings: Settings, collector: StateCollector | None = None) -> CollectorRegistry:
    """A registry holding only this state folder's collector (no process or GC metrics)."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector or StateCollector(settings))
    return reg


def exposition(settings: Settings, collector: StateCollector | None = None) -> bytes:
    """The text exposition (``CONTENT_TYPE``) of the state folder now."""
    from prometheus_client import generate_latest

    return generate_latest(registry(settings, collector))


def write_textfile(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` for node_exporter's textfile collector, atomically.

    The temporary file sits in the same folder (a rename cannot cross filesystems) under a
    name node_exporter does not read (it reads ``*.prom`` only), so a scrape never sees half
    a file.  GpulockError with a hint when the folder cannot be written.
    """
    folder = path.parent
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    tmp = folder / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        fd = os.open(tmp, flags, TEXTFILE_MODE)
    except OSError as e:
        hint = (
            f"create it (mkdir -p {folder}) or name another file"
            if e.errno == errno.ENOENT
            else f"check who may write {folder} (ls -ld {folder})"
        )
        raise GpulockError(
            f"cannot write the metrics textfile {path}: {e.strerror or e}", hint=hint
        ) from None
    try:
        try:
            os.fchmod(fd, TEXTFILE_MODE)  # the umask masked open's mode
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise GpulockError(
            f"cannot write the metrics textfile {path}: {e.strerror or e}",
            hint=f"check the folder {folder} (space, permissions, a folder at that name)",
        ) from None


class Listener:
    """What every metrics listener shares: where it listens, and how it stops."""

    _server: WSGIServer
    _thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class MetricsServer(Listener):
    """``/metrics`` over HTTP in a daemon thread (prometheus_client's WSGI server)."""

    def __init__(
        self, settings: Settings, listen: Listen, collector: StateCollector | None = None
    ) -> None:
        from prometheus_client import start_http_server

        reg = registry(settings, collector)
        try:
            server, thread = start_http_server(listen.port, listen.host, reg)
        except OSError as e:
            raise GpulockError(
                f"cannot serve metrics on {listen}: {e.strerror or e}",
                hint="metrics.listen / --metrics-listen: pick a free port (ss -ltnp)",
            ) from None
        self._server = server
        self._thread = thread
        self.host = listen.host
        self.port = server.server_port
