"""A real Prometheus server (Debian's ``prometheus`` package) scrapes a running governor.

Prometheus runs on 127.0.0.1 with a temporary config and storage folder and a 1 s scrape
interval; its HTTP query API must come to show the queue of real ``gpulock run`` jobs while
they wait, and an eviction's counter once ``gpulock evict`` has freed a resident model.
Skipped, with the reason, where the package is not installed (``make test`` installs it as
root).
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import GPULOCK, Cli, Proc, wait_until
from metrics_helpers import start_owner
from procs import World

from gpulock.core import devices

pytest.importorskip("prometheus_client", reason="the 'metrics' extra is not installed")

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="the prometheus server is not installed (Debian's 'prometheus' package; "
        "'make test' installs it when it runs as root)",
    ),
]
DEADLINE_S = 60.0  # Prometheus starts, scrapes every second and evaluates: give it time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 (127.0.0.1)
            body = json.loads(resp.read())
    except OSError:
        return []  # not up yet
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def scalar(base: str, expr: str) -> float | None:
    rows = query(base, expr)
    return float(rows[0]["value"][1]) if len(rows) == 1 else None


def start_prometheus(cli: Cli, root: Path, target: str) -> tuple[Proc, str]:
    config = root / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: gpulock\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = free_port()
    assert PROMETHEUS is not None
    proc = cli.start(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        "prometheus",
    )
    return proc, f"http://127.0.0.1:{port}"


def test_prometheus_scrapes_the_queue_and_an_eviction(
    world: World, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(devices.SIMULATE_ENV, "24GiB")
    cli.simulate = "24GiB"
    world.config.write_text("watchdog: {interval: 1s}\n")
    gov = cli.start(
        [*GPULOCK, "governor", "--config", str(world.config), "--metrics-listen", "127.0.0.1:0"],
        "governor",
    )

    def url() -> str | None:
        for line in gov.err.read_text().splitlines():
            if "metrics on " in line:
                return line.rsplit(" ", 1)[-1]
        if gov.popen.poll() is not None:
            raise AssertionError(f"the governor exited\n{gov.output()}")
        return None

    target = urllib.parse.urlsplit(wait_until(url, "the governor's metrics URL")).netloc
    prom, base = start_prometheus(cli, world.root, target)

    def up() -> bool:
        if prom.popen.poll() is not None:
            raise AssertionError(f"prometheus exited\n{prom.output()}")
        return scalar(base, 'up{job="gpulock"}') == 1

    wait_until(up, lambda: f"Prometheus to scrape the governor\n{prom.output()}", DEADLINE_S)

    holder = cli.hold("holder")
    cli.start_run("w1", cmd=["true"])
    cli.start_run("w2", cmd=["true"])
    wait_until(
        lambda: scalar(base, 'gpulock_queue_waiters{gpu="0"}') == 2,
        lambda: f"Prometheus to see 2 waiters\n{query(base, 'gpulock_queue_waiters')}",
        DEADLINE_S,
    )
    assert scalar(base, 'gpulock_queue_holders{gpu="0"}') == 1

    start_owner(world, "owner", {"name": "idle-a", "bytes": "4GiB"})
    evictions = 'sum(gpulock_evictions_total{reason="request",outcome="freed"})'
    assert scalar(base, evictions) in (None, 0.0)
    r = cli.run("evict", "idle-a")
    assert r.code == 0, r.describe()
    wait_until(
        lambda: scalar(base, evictions) == 1,
        lambda: f"Prometheus to count the eviction\n{query(base, 'gpulock_evictions_total')}",
        DEADLINE_S,
    )

    holder.release()
    wait_until(
        lambda: scalar(base, 'gpulock_queue_waiters{gpu="0"}') == 0,
        "Prometheus to see the line drained",
        DEADLINE_S,
    )
    assert scalar(base, 'gpulock_grants_total{gpu="0",owner="holder"}') == 1
    prom.popen.send_signal(signal.SIGTERM)
    gov.popen.send_signal(signal.SIGTERM)
    assert gov.wait() == 0, gov.output()
