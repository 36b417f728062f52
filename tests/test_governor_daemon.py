"""The governor with real processes: the command, the daemon, its probes and its hands.

Resident models are owned by real child processes (``tests/resident_child.py``) on a simulated
12 GiB GPU, so "used memory" is what the live residents declare and an eviction frees it end to
end.  ``gpulock governor`` runs as a user runs it (``python -m gpulock governor``, a fresh
interpreter).  Every wait has a deadline and says what it waited for; nothing sleeps and hopes.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import GPULOCK, Cli, Result, assert_clean_error
from procs import Child, World, alive, wait_until

from gpulock.core import devices, level
from gpulock.core.events import read as read_events
from gpulock.governor import effects as effects_mod
from gpulock.governor.daemon import AlreadyRunning, Governor
from gpulock.governor.effects import Effects
from gpulock.governor.model import Action, GovernorConfig, Snapshot, State
from gpulock.governor.probes import Probe, parse_psi
from gpulock.residents.registry import Registry

GiB = 1024**3
CHILD = Path(__file__).with_name("resident_child.py")
WAIT_S = 15.0  # "it eventually happens", on a busy 2-core machine
WATCHDOG = "watchdog: {threshold: 50%, min_idle: 0s, hysteresis: 5%}\n"


# --- owners of resident models -----------------------------------------------------------------


class Owner:
    """A ``resident_child.py`` process and its audit file."""

    def __init__(self, child: Child, audit: Path) -> None:
        self.child = child
        self.audit = audit
        self.ids: dict[str, str] = {}
        self.pid = 0  # the resident owner's pid (under `gpulock run`, not the child's)

    def lines(self) -> list[tuple[str, str, dict[str, Any]]]:
        try:
            text = self.audit.read_text()
        except FileNotFoundError:
            return []
        return [
            (kind, name, json.loads(extra))
            for kind, name, extra in (line.split(" ", 2) for line in text.splitlines())
        ]

    def wait(self, kind: str, name: str = "-") -> dict[str, Any]:
        def found() -> list[dict[str, Any]]:
            if self.child.proc.poll() is not None:
                raise AssertionError(f"owner exited\n{self.child.stderr()}")
            return [x for k, n, x in self.lines() if k == kind and n == name][:1]

        return wait_until(found, WAIT_S, lambda: f"{kind} {name} in {self.lines()}")[0]

    def unloaded(self) -> list[str]:
        return [n for k, n, _ in self.lines() if k == "unloaded"]


def start_owner(
    world: World, name: str, *specs: dict[str, Any], prefix: tuple[str, ...] = ()
) -> Owner:
    """Start an owner of ``specs`` (optionally under ``gpulock run``); return once registered."""
    audit = world.root / f"{name}.audit"
    opts = json.dumps({"audit": str(audit), "residents": [{"weights_mb": 1, **s} for s in specs]})
    child = Child(world, name, [*prefix, sys.executable, str(CHILD), opts])
    world.children.append(child)
    owner = Owner(child, audit)
    ready = owner.wait("ready")
    owner.ids, owner.pid = ready["ids"], ready["pid"]
    return owner


@pytest.fixture
def sim(world: World, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> World:
    """A simulated 12 GiB GPU for this process, the owners and the CLI; the watchdog config."""
    monkeypatch.setenv(devices.SIMULATE_ENV, "12GiB")
    cli.simulate = "12GiB"
    world.config.write_text(WATCHDOG)
    return world


def fleet(world: World) -> dict[str, Owner]:
    """9 GiB of 12 in use (75 %): idle-a 4 GiB (idle longest), pinned 2 GiB, idle-b 1 GiB,
    busy 2 GiB inside ``use()``.  Under a 50 % threshold with 5 % hysteresis the watchdog must
    evict idle-a alone: it is first in cost order, and 5 GiB (42 %) is under 45 %."""
    first = start_owner(
        world,
        "first",
        {"name": "idle-a", "bytes": "4GiB"},
        {"name": "pinned", "bytes": "2GiB", "policy": "pinned"},
    )
    second = start_owner(
        world, "second", {"name": "idle-b", "bytes": "1GiB"}, {"name": "busy", "bytes": "2GiB"}
    )
    second.child.send("use busy")
    second.wait("entered", "busy")
    return {"first": first, "second": second}


def names(world: World) -> list[str]:
    return sorted(r.name for r in Registry(world.settings(), create=False).records(clean=False))


def governor(cli: Cli, world: World, *args: str) -> Result:
    return cli.run("governor", "--config", str(world.config), *args)


# --- the watchdog, end to end through the command ------------------------------------------------


def test_once_evicts_idle_models_in_cost_order_until_under_threshold(sim: World, cli: Cli) -> None:
    owners = fleet(sim)
    r = governor(cli, sim, "--once")
    assert r.code == 0, r.describe()
    assert r.stderr == "", r.describe()

    evicts = sim.events("evict")
    assert [(e["name"], e["outcome"]) for e in evicts] == [("idle-a", "freed")], evicts
    assert evicts[0]["freed_bytes"] == 4 * GiB
    assert evicts[0]["reason"].startswith("governor evict: gpu0 75% used > 50%"), evicts[0]
    assert owners["first"].unloaded() == ["idle-a"]
    assert owners["second"].unloaded() == []
    assert names(sim) == ["busy", "idle-b", "pinned"]

    (why,) = sim.events("governor")
    assert why["action"] == "evict" and why["outcome"] == "freed" and why["name"] == "idle-a"
    assert why["evidence"]["vram.gpu0"] == 0.75
    assert why["evidence"]["vram.gpu0.threshold"] == 0.95

    pub = level.read_raw(sim.settings())
    assert pub is not None and pub.level == "normal"
    assert pub.signals["gpus"][0]["used_bytes"] == 9 * GiB  # what the pass measured
    assert pub.thresholds["threshold"] == 0.5 and pub.thresholds["hysteresis"] == 0.05
    assert pub.interval_s == 60.0
    assert level.read(sim.settings()) is None  # --once has exited: its word no longer counts

    again = governor(cli, sim, "--once")  # 5 GiB (42 %): under the threshold, nothing to do
    assert again.code == 0, again.describe()
    assert len(sim.events("evict")) == 1
    assert names(sim) == ["busy", "idle-b", "pinned"]


def test_dry_run_prints_and_changes_nothing(sim: World, cli: Cli) -> None:
    owners = fleet(sim)
    r = governor(cli, sim, "--dry-run", "--once")
    assert r.code == 0, r.describe()
    lines = r.stdout.splitlines()
    # The decision first (level, signals against thresholds), then one line per action.
    assert lines[0] == "level: normal (unchanged)", r.describe()
    assert lines[1] == "gpu0: 9.0 GiB used of 12.0 GiB (75%), threshold 50%; 4 resident model(s)"
    assert lines[2].startswith("host: memory pressure some "), lines
    assert lines[3] == "actions: 1", lines
    assert len(lines) == 5, r.describe()
    ida = owners["first"].ids["idle-a"]
    assert lines[4].startswith(
        f"would evict idle-a ({ida}) on gpu0: 9.0 GiB used > 6.0 GiB (50%) at "
    ), lines
    assert lines[4].endswith(", 4.0 GiB") and "; idle " in lines[4], lines
    assert names(sim) == ["busy", "idle-a", "idle-b", "pinned"]
    assert owners["first"].unloaded() == [] and owners["second"].unloaded() == []
    assert sim.events() == [e for e in sim.events() if e["event"] == "resident"]
    assert not (sim.state / "governor.json").exists()
    assert not (sim.state / "governor.lock").exists()


def test_dry_run_with_nothing_to_do_still_says_what_it_saw(sim: World, cli: Cli) -> None:
    start_owner(sim, "small", {"name": "tiny", "bytes": "3GiB"})  # 25 %: under the threshold
    r = governor(cli, sim, "--dry-run", "--once")
    assert (r.code, r.stderr) == (0, ""), r.describe()
    assert r.stdout.splitlines()[:2] == [
        "level: normal (unchanged)",
        "gpu0: 3.0 GiB used of 12.0 GiB (25%), threshold 50%; 1 resident model(s)",
    ], r.describe()
    assert r.stdout.splitlines()[-1] == "actions: none", r.describe()

    r = governor(cli, sim, "--dry-run", "--once", "--json")
    assert (r.code, r.stderr) == (0, ""), r.describe()
    d = r.json()
    assert (d["dry_run"], d["level"], d["level_before"], d["actions"]) == (
        True, "normal", "normal", []
    )  # fmt: skip
    (gpu,) = d["signals"]["gpus"]
    assert (gpu["used_bytes"], gpu["total_bytes"], gpu["residents"]) == (3 * GiB, 12 * GiB, 1)
    assert d["thresholds"]["threshold"] == 0.5 and "psi_some_avg10" in d["signals"], d
    assert not (sim.state / "governor.json").exists()


def test_bad_config_names_file_line_and_key(world: World, cli: Cli) -> None:
    world.config.write_text("watchdog:\n  interval: 60s\n  threshold: lots\n")
    r = governor(cli, world, "--once")
    assert_clean_error(r, 1)
    assert f"error: {world.config}:3: watchdog.threshold: " in r.stderr, r.describe()
    usage = governor(cli, world, "--bogus")
    assert_clean_error(usage, 2)


def test_a_percentage_over_100_is_a_config_error(world: World, cli: Cli) -> None:
    world.config.write_text("watchdog:\n  threshold: 150%\n")
    r = governor(cli, world, "--once")
    assert_clean_error(r, 1)
    assert f"error: {world.config}:2: watchdog.threshold: " in r.stderr, r.describe()


# --- the signals it reads ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "some avg10=1.25 avg60=0.50 avg300=0.10 total=12345\n"
            "full avg10=0.31 avg60=0.00 avg300=0.00 total=678\n",
            (1.25, 0.31),
        ),
        ("some avg10=7.00 avg60=2.00 avg300=1.00 total=1\n", (7.0, None)),  # no "full" line
        ("full avg10=2.50 avg60=0 avg300=0 total=0\nsome avg10=3.5 total=9\n", (3.5, 2.5)),
        ("some avg10=abc avg60=0.00\nfull avg10=0.00\n", (None, 0.0)),
        ("some avg10=-1 avg60=0\n", (None, None)),  # not a share of time
        ("some avg60=0.00 total=0\n", (None, None)),  # no avg10
        ("garbage\n\x00\xff", (None, None)),
        ("", (None, None)),
        (None, (None, None)),  # the file could not be read
    ],
)
def test_parse_psi(text: str | None, expected: tuple[float | None, float | None]) -> None:
    assert parse_psi(text) == expected


def test_probe_reads_this_machines_pressure_and_swap(world: World) -> None:
    psi = Path("/proc/pressure/memory")
    if not psi.exists():
        pytest.skip("this kernel has no PSI (/proc/pressure/memory): built without it or too old")
    probe = Probe(world.settings())
    first = probe.collect(time.time())
    text = psi.read_text()
    assert first.psi_some_avg10 is not None and 0 <= first.psi_some_avg10 <= 100, text
    if "full" in text:
        assert first.psi_full_avg10 is not None and 0 <= first.psi_full_avg10 <= 100, text
    assert first.swap_bytes_per_s is None  # one sample is no rate
    second = probe.collect(time.time())
    assert isinstance(second.swap_bytes_per_s, float) and second.swap_bytes_per_s >= 0
    assert second.oom_reports == 0


# --- the daemon ----------------------------------------------------------------------------------


def start_daemon(cli: Cli, world: World, name: str = "governor") -> Any:
    proc = cli.start([*GPULOCK, "governor", "--config", str(world.config)], name)

    def published() -> level.Published | None:
        if proc.popen.poll() is not None:
            raise AssertionError(f"the governor exited ({proc.popen.returncode})\n{proc.output()}")
        pub = level.read(world.settings())
        return pub if pub is not None and pub.pid == proc.pid else None

    wait_until(published, WAIT_S, lambda: f"the governor's word\n{proc.output()}")
    return proc


def test_daemon_publishes_stops_on_sigterm_and_runs_once_per_folder(world: World, cli: Cli) -> None:
    world.config.write_text("watchdog: {interval: 0.2s}\n")
    proc = start_daemon(cli, world)
    settings = world.settings()

    seen: set[float] = set()

    def written_again() -> bool:
        pub = level.read(settings)
        if pub is not None:
            seen.add(pub.updated_wall)
        return len(seen) >= 3

    wait_until(written_again, WAIT_S, "governor.json written on three passes")

    second = governor(cli, world)
    assert_clean_error(second, 1)
    assert f"pid {proc.pid}" in second.stderr, second.describe()
    beside = governor(cli, world, "--dry-run", "--once")  # a dry run may run beside it
    assert beside.code == 0, beside.describe()

    os.kill(proc.pid, signal.SIGTERM)
    code = proc.wait(30)  # its loop waits on an Event: it stops at once, not after a pass
    assert code == 0, proc.output()
    # It says when it starts and when it stops (the journal of a service keeps both).
    said = proc.err.read_text().splitlines()
    assert said[0].startswith(f"gpulock governor: started for {world.state} (pid {proc.pid}, ")
    assert said[-1] == "gpulock governor: stopped by SIGTERM", said
    assert level.read(settings) is None  # its claim went with it

    # A governor that dies hard leaves governor.json behind, and it no longer counts.
    proc = start_daemon(cli, world, "killed")
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(5) == -signal.SIGKILL
    raw = level.read_raw(settings)
    assert raw is not None and raw.pid == proc.pid
    assert level.read(settings) is None
    assert level.current(settings) == "normal"


def test_already_running_names_the_pid(world: World) -> None:
    settings = world.settings()
    with Governor(settings, GovernorConfig()) as first:
        assert first is not None
        with pytest.raises(AlreadyRunning) as info:
            Governor(settings, GovernorConfig()).open()
    assert info.value.pid == os.getpid()
    assert f"pid {os.getpid()}" in str(info.value) and info.value.hint
    with Governor(settings, GovernorConfig()):  # free again once the first closed
        assert level.claim_path(settings).exists()


def test_leaving_freeze_rings_the_head_waiter(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter held back by the freeze looks again the moment the level comes down.

    Its timed re-checks (the safety one, the freeze word going stale) are pushed past the
    test's deadline, so a grant at all can only come from the governor's doorbell.
    """
    monkeypatch.setenv("GPULOCK_SAFETY_RECHECK_S", "3600")
    script = iter(["freeze", "normal"])

    def decide(snap: Snapshot, state: State, cfg: GovernorConfig, now: float) -> Any:
        new = next(script)
        act = Action(kind="level", level=new, reason="scripted", evidence={"vram.gpu0": 0.5})
        return [act], State(level=new, level_since_wall=now)

    gov = Governor(world.settings(), GovernorConfig(interval_s=30), decide=decide)
    with gov:
        gov.tick(time.time())  # freeze
        waiter = world.queued("waiter")  # first in line, yet it waits
        (wait,) = world.events("wait", ticket=waiter.seq)
        assert wait["reason"] == "the governor froze new GPU admissions", wait
        gov.tick(time.time())  # normal: rings the head waiter
        assert gov.effects.rung == [(0, waiter.seq)]
        world.wait_record("grant", "waiter", timeout_s=60)
    levels = [(e["event"], e["from_level"], e["level"]) for e in world.events()
              if e["event"].endswith("escalate")]  # fmt: skip
    assert levels == [("escalate", "normal", "freeze"), ("deescalate", "freeze", "normal")]
    assert world.events("escalate")[0]["evidence"] == {"vram.gpu0": 0.5}


# --- force-evict and force_kill -------------------------------------------------------------------


def force_evict(owner: Owner, model: str, gib: int) -> Action:
    return Action(
        kind="force-evict",
        reason="level force-evict: gpu0 signals over their thresholds",
        gpu=0,
        resident=owner.ids[model],
        name=model,
        bytes=gib * GiB,
        level=None,
        evidence={"vram.gpu0": 0.99, "vram.gpu0.threshold": 0.95},
    )


def in_background(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def sigterm_pending(pid: int) -> bool:
    """SIGTERM is queued for ``pid`` (a stopped process cannot act on it)."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    pending = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))


def test_force_kill_terms_then_kills_a_stopped_owner(sim: World) -> None:
    owner = start_owner(sim, "stuck", {"name": "stuck", "bytes": "2GiB"})
    os.kill(owner.pid, signal.SIGSTOP)  # alive, holds its claim, answers nothing
    cfg = GovernorConfig(force_kill=True, grace_s=0.5)
    fx = Effects(sim.settings())
    snap = Snapshot(now_wall=time.time(), local_minutes=0)

    worker, out = in_background(lambda: fx.apply([force_evict(owner, "stuck", 2)], snap, cfg))
    wait_until(lambda: sigterm_pending(owner.pid), WAIT_S, "SIGTERM sent to the stopped owner")
    assert alive(owner.pid)  # SIGTERM alone does not end a stopped process
    worker.join(WAIT_S)

    (res,) = out[0]
    assert res["outcome"] == "no-answer" and res["kill"]["outcome"] == "killed", res
    assert owner.child.wait_exit() == -signal.SIGKILL
    kills = sim.events("kill")
    assert [k["signal"] for k in kills] == ["SIGTERM", "SIGKILL"], kills
    assert kills[1]["ts"] - kills[0]["ts"] >= 0.5  # the grace between them
    assert kills[0]["pid"] == owner.pid and kills[0]["resident"] == owner.ids["stuck"]
    assert kills[0]["evidence"]["vram.gpu0"] == 0.99
    (why,) = sim.events("governor")
    assert why["action"] == "force-evict" and why["kill"]["outcome"] == "killed"
    assert names(sim) == []  # the dead owner's record was cleaned


def test_force_kill_never_kills_an_owner_that_holds_a_gpu_ticket(sim: World) -> None:
    run = (sys.executable, "-m", "gpulock", "run", "--gpu", "0", "--name", "holder", "--")
    owner = start_owner(sim, "holder", {"name": "held", "bytes": "2GiB"}, prefix=run)

    def holds() -> bool:
        return any(t.child_pid == owner.pid and t.holding for t in sim.tickets().values())

    wait_until(holds, WAIT_S, "the owner's ticket, holding, with it as the command")
    os.kill(owner.pid, signal.SIGSTOP)
    cfg = GovernorConfig(force_kill=True, grace_s=0.3)
    fx = Effects(sim.settings())
    snap = Snapshot(now_wall=time.time(), local_minutes=0)
    (res,) = fx.apply([force_evict(owner, "held", 2)], snap, cfg)
    assert res["outcome"] == "no-answer", res
    assert res["kill"] == {"outcome": "not-killed", "detail": "its process holds a GPU ticket"}
    assert sim.events("kill") == []
    assert alive(owner.pid) and not sigterm_pending(owner.pid)
    assert names(sim) == ["held"]


def test_dry_run_effects_describe_force_evict_and_levels(world: World) -> None:
    out = io.StringIO()
    fx = Effects(world.settings(), dry_run=True, out=out)
    fx.level = "evict-idle"
    snap = Snapshot(now_wall=1000.0, local_minutes=14 * 60 + 5)
    acts = [
        Action(kind="level", level="force-evict", reason="over threshold for 3 passes: vram.gpu0"),
        Action(kind="force-evict", reason="level force-evict: gpu0 over", gpu=0, resident="1-2-3",
               name="qwen", bytes=6 * GiB),
    ]  # fmt: skip
    res = fx.apply(acts, snap, GovernorConfig(force_kill=True, grace_s=10))
    assert [r["outcome"] for r in res] == ["dry-run", "dry-run"]
    assert out.getvalue().splitlines() == [
        "would escalate evict-idle -> force-evict: over threshold for 3 passes: vram.gpu0",
        "would force-evict qwen (1-2-3) on gpu0: level force-evict: gpu0 over at 14:05; 6.0 GiB;"
        " SIGTERM, then SIGKILL, if it ignores it for 10 s",
    ]
    assert fx.publish("force-evict", 1000.0, {}, {}, 60.0) is None
    assert list(read_events(world.state)) == []
    assert not (world.state / "governor.json").exists()
    assert effects_mod._ago(42 * 60 + 5) == "42m" and effects_mod._ago(3900) == "1h05m"


def test_swap_rate_and_oom_baseline(world: World) -> None:
    counters = iter([(0, 0), (1000, 3000)])
    ticks = iter([10.0, 12.0])
    probe = Probe(world.settings(), psi_reader=lambda: None, swap_reader=lambda: next(counters),
                  clock=lambda: next(ticks))  # fmt: skip
    a = probe.collect(0.0)
    b = probe.collect(2.0)
    assert (a.psi_some_avg10, a.psi_full_avg10, a.swap_bytes_per_s) == (None, None, None)
    assert b.swap_bytes_per_s == 2000.0
    assert probe._new_ooms({"x": 2}) == 2 and probe._new_ooms({"x": 3, "y": 1}) == 2
    assert list(read_events(world.state)) == []


def test_once_from_cron_carries_the_ladder_on(tmp_path: Path) -> None:
    """Each --once pass resumes the ladder where the last one left it, so cron can climb."""
    from gpulock.core import level
    from gpulock.core.settings import load
    from gpulock.governor import daemon
    from gpulock.governor.model import GovernorConfig, State

    settings = load(None, tmp_path / "state")
    config = GovernorConfig(interval_s=60, cooldown_s=300)
    now = 1_000_000.0
    state = State(level="reduce", level_since_wall=now - 120, over=(("psi_some", 2),))
    level.write(
        settings,
        level.Published("reduce", now - 120, now - 60, 60, 1, memory=daemon.remember(state)),
    )
    assert daemon.resume(settings, config, now, State()) == state
    # too old to matter: a fresh start
    assert daemon.resume(settings, config, now + 10_000, State()) == State()
