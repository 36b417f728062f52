"""Prometheus metrics: the queue, VRAM, residents, governor and router, from the state folder.

A view, not a second source of truth: gauges are read from the live state at each scrape
(``status.snapshot``), counters and histograms are folded from the event log through a cursor
persisted in ``<state>/metrics/`` so they stay monotonic across restarts of whichever process
serves them.  Modules: ``specs`` (every metric: name, help, labels), ``tally`` (events ->
counters, pure), ``cursor`` (the log read incrementally, the persisted tally), ``families``
((snapshot, tally) -> metric families, pure), ``collector`` (the collector, the exposition,
the textfile, the HTTP listener), ``config`` (the ``metrics:`` section), ``cli``
(``gpulock metrics``).

``prometheus-client`` is the optional extra ``metrics``; nothing here is imported by
``import gpulock`` or ``gpulock run``, and this package's own import loads none of it.
"""

from __future__ import annotations

from gpulock.core.errors import GpulockError
from gpulock.core.extras import install_hint


def require_client() -> None:
    """Raise a GpulockError naming the extra when prometheus_client is not installed."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise GpulockError(
            "metrics need the prometheus-client package, which is not installed",
            hint=install_hint("metrics"),
        ) from None
