"""What a daemon runs to export metrics: the HTTP listener and the textfile after each pass.

``gpulock governor`` builds one from ``metrics.listen`` / ``--metrics-listen`` and
``metrics.textfile``: ``start()`` opens the listener and says where on ``err`` (behind
bearer ``keys`` when given, ``gpulock.metrics.keyed``; off loopback only with keys),
``after_pass()`` rewrites the textfile (a failure is reported once per distinct message, never
fatal: the governor's pass matters more than its metrics), ``close()`` stops the listener.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from gpulock.core.errors import GpulockError
from gpulock.core.settings import Settings
from gpulock.metrics.collector import MetricsServer, StateCollector, exposition, write_textfile
from gpulock.metrics.config import Listen, listen_keys

if TYPE_CHECKING:
    from gpulock.metrics.keyed import KeyedMetricsServer


class Exporter:
    def __init__(
        self,
        settings: Settings,
        *,
        listen: Listen | None,
        textfile: Path | None,
        err: TextIO,
        name: str = "gpulock governor",
        keys: Sequence[str] = (),
    ) -> None:
        self.settings = settings
        self.listen = listen
        self.textfile = textfile
        self.err = err
        self.name = name
        self.collector = StateCollector(settings)
        self.keys = tuple(keys)  # never printed
        self.server: MetricsServer | KeyedMetricsServer | None = None
        self._last_error: str | None = None

    def start(self) -> None:
        if self.listen is not None and not self.keys:
            listen_keys(self.listen, None)  # the house rule, whoever builds the exporter
        threading.Thread(target=self._prime, name="gpulock-metrics-prime", daemon=True).start()
        if self.listen is not None and self.server is None:
            if self.keys:
                from gpulock.metrics.keyed import KeyedMetricsServer

                self.server = KeyedMetricsServer(
                    self.settings, self.listen, self.keys, self.collector
                )
            else:
                self.server = MetricsServer(self.settings, self.listen, self.collector)
            print(f"{self.name}: metrics on {self.server.url}", file=self.err, flush=True)

    def _prime(self) -> None:
        try:
            self.collector.prime()
        except Exception as e:  # a scrape will say it again; the governor must go on
            print(f"{self.name}: metrics: {e!r}", file=self.err, flush=True)

    def after_pass(self) -> None:
        if self.textfile is None:
            return
        try:
            write_textfile(self.textfile, exposition(self.settings, self.collector))
        except GpulockError as e:
            text = f"{self.name}: {e}" + (f" (hint: {e.hint})" if e.hint else "")
            if text != self._last_error:
                print(text, file=self.err, flush=True)
            self._last_error = text
        else:
            self._last_error = None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
