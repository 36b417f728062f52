"""``gpulock metrics`` and the governor's exporter, end to end, against a scripted scenario.

Real ``gpulock run`` jobs hold and wait on a simulated 24 GiB GPU, a real owner process keeps
resident models, ``gpulock evict`` evicts one, ``gpulock governor --once`` climbs a level; the
exposition is then read back with prometheus_client's own parser and ``promtool check
metrics``, and its values are compared with what the scenario did.
"""

from __future__ import annotations

import io
import signal
import socket
import stat
import urllib.request
from pathlib import Path

import pytest
from cli_helpers import GPULOCK, Cli, assert_clean_error, wait_until
from metrics_helpers import Samples, parse, promtool_check, start_owner, value
from procs import World

from gpulock.core import devices

pytest.importorskip("prometheus_client", reason="the 'metrics' extra is not installed")

GiB = 1024**3


@pytest.fixture
def sim(world: World, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> World:
    """One simulated 24 GiB GPU for the CLI and the resident owners."""
    monkeypatch.setenv(devices.SIMULATE_ENV, "24GiB")
    cli.simulate = "24GiB"
    return world


def metrics(cli: Cli, world: World, *args: str) -> Samples:
    r = cli.run("metrics", "--config", str(world.config), *args)
    assert r.code == 0, r.describe()
    assert r.stderr == "", r.describe()
    promtool_check(r.stdout)
    return parse(r.stdout)


def counters(samples: Samples) -> Samples:
    return {k: v for k, v in samples.items() if k[0].endswith(("_total", "_count", "_bucket"))}


def test_a_scripted_scenario_reads_back_exactly(sim: World, cli: Cli) -> None:
    textfile = sim.root / "textfile" / "gpulock.prom"
    textfile.parent.mkdir()
    sim.config.write_text(
        f"governor: {{samples: 1, vram_pressure: 10%}}\nmetrics: {{textfile: {textfile}}}\n"
    )
    holder = cli.hold("holder")
    cli.start_run("w1", cmd=["true"])
    cli.start_run("w2", cmd=["true"])
    wait_until(
        lambda: sum(e["state"] == "waiting" for e in cli.entries()) == 2,
        lambda: f"two waiters\n{cli.describe()}",
    )
    late = cli.run("run", "--name", "impatient", "--timeout", "0.2", "--", "true")
    assert late.code == 75, late.describe()
    start_owner(
        sim,
        "owner",
        {"name": "idle-a", "bytes": "4GiB"},
        {"name": "pinned", "bytes": "2GiB", "policy": "pinned"},
    )
    # 6 GiB of 24 (25 %) is over governor.vram_pressure 10 %: one pass climbs to "reduce".
    gov = cli.run("governor", "--config", str(sim.config), "--once")
    assert gov.code == 0, gov.describe()
    ev = cli.run("evict", "idle-a", "--config", str(sim.config))
    assert ev.code == 0, ev.describe()

    m = metrics(cli, sim)
    assert value(m, "gpulock_queue_holders", gpu="0") == 1
    assert value(m, "gpulock_queue_waiters", gpu="0") == 2
    oldest = value(m, "gpulock_queue_oldest_wait_seconds", gpu="0")
    assert oldest is not None and oldest > 0
    assert value(m, "gpulock_grants_total", gpu="0", owner="holder") == 1
    assert value(m, "gpulock_timeouts_total", gpu="0", owner="impatient") == 1
    assert value(m, "gpulock_wait_seconds_count", gpu="0") == 1
    assert value(m, "gpulock_evictions_total", reason="request", outcome="freed", tenant="") == 1
    assert value(m, "gpulock_evicted_bytes_total", reason="request", tenant="") == 4 * GiB
    assert value(m, "gpulock_governor_escalations_total", level="reduce") == 1
    assert value(m, "gpulock_governor_up") == 0  # --once has exited: its word no longer counts
    assert value(m, "gpulock_governor_threshold", signal="used_fraction") == 0.1
    assert value(m, "gpulock_gpu_memory_total_bytes", gpu="0") == 24 * GiB
    assert value(m, "gpulock_gpu_memory_used_bytes", gpu="0") == 2 * GiB
    assert value(m, "gpulock_gpu_memory_reserved_bytes", gpu="0") == pytest.approx(2.4 * GiB, 1)
    resident = {"gpu": "0", "model": "pinned", "tenant": "", "policy": "pinned"}
    (owner_label,) = [dict(k[1])["owner"] for k in m if k[0] == "gpulock_resident_bytes"]
    assert value(m, "gpulock_resident_bytes", owner=owner_label, **resident) == 2 * GiB
    assert value(m, "gpulock_resident_models", gpu="0", tenant="") == 1  # idle-a is gone

    # The governor's pass wrote the textfile: node_exporter's format, readable by it.
    tf = textfile.read_text()
    promtool_check(tf)
    assert value(parse(tf), "gpulock_governor_escalations_total", level="reduce") == 1
    assert stat.S_IMODE(textfile.stat().st_mode) == 0o644
    assert [p.name for p in textfile.parent.iterdir()] == ["gpulock.prom"]  # no temp left

    holder.release()
    assert holder.wait() == 0
    wait_until(lambda: not cli.entries(), lambda: f"the line to drain\n{cli.describe()}")
    after = metrics(cli, sim)
    assert value(after, "gpulock_queue_holders", gpu="0") == 0
    assert value(after, "gpulock_queue_waiters", gpu="0") == 0
    assert value(after, "gpulock_wait_seconds_count", gpu="0") == 3
    assert value(after, "gpulock_hold_seconds_count", gpu="0") == 3
    before = counters(m)
    assert all(after[k] >= v for k, v in before.items()), "a counter went down"


def test_the_exposition_passes_promtool(sim: World, cli: Cli) -> None:
    holder = cli.hold("holder", "--need", "6GiB")
    start_owner(sim, "owner", {"name": "m", "bytes": "1GiB"})
    r = cli.run("metrics")
    assert r.code == 0, r.describe()
    promtool_check(r.stdout, required=True)
    holder.release()


def test_textfile_is_written_atomically_and_bad_paths_are_clean_errors(
    world: World, cli: Cli
) -> None:
    folder = world.root / "collector"
    folder.mkdir()
    target = folder / "gpulock.prom"
    cli.state.mkdir(mode=0o700)
    r = cli.run("metrics", "--textfile", str(target))
    assert r.code == 0 and r.stdout == "", r.describe()
    promtool_check(target.read_text())
    first = target.stat().st_ino
    r = cli.run("metrics", "--textfile", str(target))
    assert r.code == 0, r.describe()
    assert target.stat().st_ino != first  # replaced by a rename, never rewritten in place
    assert sorted(p.name for p in folder.iterdir()) == ["gpulock.prom"]

    not_prom = cli.run("metrics", "--textfile", str(folder / "gpulock.txt"))
    assert_clean_error(not_prom, 2)
    assert "*.prom" in not_prom.stderr
    missing = cli.run("metrics", "--textfile", str(world.root / "nope" / "gpulock.prom"))
    assert_clean_error(missing, 1)
    assert "hint: create it" in missing.stderr, missing.describe()


def test_a_bad_metrics_section_names_file_line_and_key(world: World, cli: Cli) -> None:
    world.config.write_text("metrics:\n  listen: somewhere\n")
    for args in (["metrics"], ["governor", "--once"]):
        r = cli.run(*args, "--config", str(world.config))
        assert_clean_error(r, 1)
        assert f"error: {world.config}:2: metrics.listen: " in r.stderr, r.describe()
    world.config.write_text("metrics:\n  listn: 127.0.0.1:9464\n")
    r = cli.run("metrics", "--config", str(world.config))
    assert_clean_error(r, 1)
    assert "metrics.listn" in r.stderr and "known keys: listen, textfile, api_keys_env" in r.stderr
    world.config.write_text("# nothing\n")
    usage = cli.run("governor", "--once", "--metrics-listen", "127.0.0.1:http")
    assert_clean_error(usage, 2)
    assert "--metrics-listen" in usage.stderr


def test_the_governor_serves_metrics_over_http_until_stopped(sim: World, cli: Cli) -> None:
    # 4 GiB of 24 (17 %) is over vram_pressure 10 %: the first pass climbs to "reduce".
    # The exclusive holder must not clear the resident whose memory makes the pressure.
    sim.config.write_text(
        "watchdog: {interval: 1s}\ngovernor: {samples: 1, vram_pressure: 10%, cooldown: 1h}\n"
        "exclusive_clears_residents: false\n"
    )
    start_owner(sim, "owner", {"name": "m", "bytes": "4GiB"})
    holder = cli.hold("holder")
    gov = cli.start(
        [*GPULOCK, "governor", "--config", str(sim.config), "--metrics-listen", "127.0.0.1:0"],
        "governor",
    )
    url = wait_until(lambda: _url(gov.err), lambda: f"the metrics URL\n{gov.output()}")
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")

    def scrape() -> Samples:
        with urllib.request.urlopen(url, timeout=30) as resp:  # noqa: S310 (a 127.0.0.1 URL)
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            text: str = resp.read().decode()
        promtool_check(text)
        return parse(text)

    def at_reduce() -> Samples | None:
        got = scrape()
        return got if value(got, "gpulock_governor_level_index") == 1 else None

    m = wait_until(at_reduce, lambda: f"the live governor at level reduce\n{gov.output()}")
    assert value(m, "gpulock_governor_up") == 1
    assert value(m, "gpulock_governor_level", level="reduce") == 1
    assert value(m, "gpulock_governor_level", level="normal") == 0
    assert value(m, "gpulock_governor_signal", signal="used_fraction", gpu="0") == pytest.approx(
        4 / 24, abs=1e-3
    )
    assert value(m, "gpulock_queue_holders", gpu="0") == 1
    holder.release()
    assert holder.wait() == 0
    gov.popen.send_signal(signal.SIGTERM)
    assert gov.wait() == 0, gov.output()


def _url(err: Path) -> str | None:
    for line in err.read_text().splitlines():
        if "metrics on " in line:
            return line.rsplit(" ", 1)[-1]
    return None


def test_a_textfile_the_governor_cannot_write_is_reported_once_and_never_fatal(
    world: World, cli: Cli
) -> None:
    target = world.root / "later" / "gpulock.prom"
    world.config.write_text(f"metrics: {{textfile: {target}}}\n")
    r = cli.run("governor", "--config", str(world.config), "--once")
    assert r.code == 0, r.describe()
    assert r.stderr.count("cannot write the metrics textfile") == 1, r.describe()

    from gpulock.metrics.exporter import Exporter

    err = io.StringIO()
    exporter = Exporter(world.settings(), listen=None, textfile=target, err=err)
    for _ in range(3):
        exporter.after_pass()
    assert err.getvalue().count("cannot write the metrics textfile") == 1, err.getvalue()
    assert "hint: create it" in err.getvalue()
    target.parent.mkdir()
    exporter.after_pass()
    assert parse(target.read_text())  # written once the folder exists
    assert err.getvalue().count("\n") == 1


def test_a_dry_run_leaves_the_configured_listener_and_textfile_to_the_real_governor(
    world: World, cli: Cli
) -> None:
    target = world.root / "gpulock.prom"
    with socket.socket() as taken:  # the real governor's port, say
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        world.config.write_text(f"metrics: {{listen: '127.0.0.1:{port}', textfile: {target}}}\n")
        r = cli.run("governor", "--config", str(world.config), "--dry-run", "--once")
        assert r.code == 0, r.describe()
        assert not target.exists()
        real = cli.run("governor", "--config", str(world.config), "--once")
        assert_clean_error(real, 1)
        assert f"cannot serve metrics on 127.0.0.1:{port}" in real.stderr, real.describe()
