"""The governor's host counters from ``/proc/vmstat``: swap traffic and kernel OOM kills.

No psutil: the counters are read from the file, pages times the page size the kernel says.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from gpulock.core.settings import load
from gpulock.governor.model import GovernorConfig, GpuSignals, ResidentView, Snapshot, State
from gpulock.governor.policy import decide, readings
from gpulock.governor.probes import Probe, VmStat, page_bytes, parse_vmstat, read_vmstat

VMSTAT = """nr_free_pages 123456
pswpin 10
pswpout 30
oom_kill 2
pgfault 99
"""


@pytest.mark.parametrize("page", [4096, 16384, 65536])
def test_parse_vmstat_counts_pages_of_the_kernels_size(page: int) -> None:
    assert parse_vmstat(VMSTAT, page) == VmStat(10 * page, 30 * page, 2)


@pytest.mark.parametrize("text", [None, "", "pswpin x\npswpout -1\noom_kill\n", "garbage"])
def test_parse_vmstat_garbage_or_missing_is_unknown_never_zero(text: str | None) -> None:
    assert parse_vmstat(text, 4096) == VmStat(None, None, None)


def test_this_machine_has_the_counters_and_the_page_size_is_asked() -> None:
    assert page_bytes() == os.sysconf("SC_PAGE_SIZE")
    vm = parse_vmstat(read_vmstat(), page_bytes())
    if not Path("/proc/vmstat").exists():
        pytest.skip("no /proc/vmstat here")
    assert vm.swap_in_bytes is not None and vm.swap_out_bytes is not None


def test_probe_reads_swap_rate_and_oom_kills_from_vmstat(tmp_path: Path) -> None:
    texts = iter(
        [
            "pswpin 0\npswpout 0\noom_kill 5\n",
            "pswpin 1\npswpout 3\noom_kill 5\n",
            "pswpin 1\npswpout 3\noom_kill 7\n",
        ]
    )
    ticks = iter([10.0, 12.0, 14.0])
    probe = Probe(
        load(None, tmp_path / "state"),
        psi_reader=lambda: None,
        vmstat_reader=lambda: next(texts),
        clock=lambda: next(ticks),
    )
    a, b, c = probe.collect(0.0), probe.collect(2.0), probe.collect(4.0)
    assert (a.swap_bytes_per_s, a.oom_kills) == (None, None)  # first pass: a baseline
    assert b.swap_bytes_per_s == 4 * page_bytes() / 2 and b.oom_kills == 0
    assert c.oom_kills == 2


def snap(kills: int | None, *, at: float = 1000.0) -> Snapshot:
    idle = ResidentView("r1", "idle-model", 0, 4242, "persistent", 2 << 30, False, 0.0)
    return Snapshot(
        now_wall=at,
        local_minutes=600,
        gpus=(GpuSignals(0, 24 << 30, 4 << 30),),
        residents=(idle,),
        oom_kills=kills,
    )


def test_one_kernel_oom_kill_sends_the_ladder_to_evict_idle_at_once() -> None:
    config = GovernorConfig(samples=3)
    actions, state = decide(snap(1), State(), config, 1000.0)
    assert state.level == "evict-idle"
    (level,) = [a for a in actions if a.kind == "level"]
    assert level.level == "evict-idle" and "OOM killer ran 1 time" in level.reason
    assert level.evidence["oom_kill"] == 1.0 and level.evidence["oom_kill.threshold"] == 1.0
    # The idle model goes on the same pass: evict-idle acts on a host-wide signal at once.
    assert [a.name for a in actions if a.kind == "evict"] == ["idle-model"]


def test_oom_kills_never_push_past_evict_idle_and_unknown_does_nothing() -> None:
    config = GovernorConfig(samples=3)
    higher = State(level="force-evict", level_since_wall=0.0)
    _, state = decide(snap(3), higher, config, 1000.0)
    assert state.level == "force-evict"  # not lowered, not raised by this signal alone
    _, state = decide(snap(None), State(), config, 1000.0)
    assert state.level == "normal"
    _, state = decide(snap(0), State(), config, 1000.0)
    assert state.level == "normal"


def test_oom_kill_is_one_of_the_published_signals() -> None:
    from gpulock.governor import daemon

    names = {r.key for r in readings(snap(0), GovernorConfig())}
    assert "oom_kill" in names
    assert daemon.signals_of(snap(2))["oom_kills"] == 2
    thresholds = daemon.thresholds_of(GovernorConfig(), replace(snap(0), oom_kills=None))
    assert thresholds["oom_kills"] == 1
