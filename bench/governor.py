"""The governor: how fast it reacts, what one pass costs, and what it does to a day of agents.

Run: ``.venv/bin/python bench/governor.py [--seed N] [--no-real] [--json FILE]``  (~5-10 s)

(a) Reaction time from a pressure onset to the first action.  A REPLAY through the pure
    ``gpulock.governor.policy.decide``: passes every ``interval``, a GPU jumping from 50 % to 97 %
    used at an onset placed at 10 phases between two passes; the time to the first ``level``
    action and to the first eviction, for samples 1/3/5 and intervals 1/10/60 s.  Two
    eviction paths: models used half a minute before every pass (the watchdog's ``min_idle``
    protects them, only the ladder's ``evict-idle`` takes them) and models idle for an hour
    (the watchdog takes them at its next pass).  Then once for real: ``python -m gpulock.governor``
    with a 1 s interval on a simulated GPU, real owner processes, onset = an owner registering
    a big model; first level read from ``governor.json``, first eviction = the owner's unload
    callback running (skipped with a note if the daemon is not there or fails).
(b) CPU cost (``time.process_time``) of one ``decide`` pass with 50 residents on 2 GPUs, quiet
    and at its busiest (both GPUs over, host pressure, force-evict); target well under 50 ms.
    And of one ``Probe.collect`` with 50 residents registered by 5 real owner processes on 2
    simulated GPUs (``GPULOCK_SIMULATE``, a temp ``GPULOCK_STATE_DIR``).
(c) A day of a synthetic fleet, simulated minute by minute (no processes, no GPU): 40 agents
    on cron-like schedules, each loading one of 16 models (1-6 GiB, persistent residents) on a
    12 GiB GPU when it runs and using it for a few minutes.  Each minute the agents start and
    end runs, then (governor on) ``decide`` gets a Snapshot and its evictions are applied.
    A load that does not fit is an OOM: the run fails (cron tries again at its next run).
    Columns: governor off; on with 85 % by day and 40 % from 22:00 to 06:00; on with 85 % all
    day.  Neither side simulates gpulock's "room for a waiter" (``make_room``), which would
    save some of those loads on both sides.

Prints a table per part and a final ``summary:`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpulock.governor.model import (  # noqa: E402
    LEVELS,
    GovernorConfig,
    GpuSignals,
    ResidentView,
    ScheduleWindow,
    Snapshot,
    State,
)
from gpulock.governor.policy import decide, threshold_in_force  # noqa: E402

GiB = 1024**3
MiB = 1024**2
BASE = 1_700_000_000.0  # wall time of the replays' first pass
PHASES = 10
TARGET_DECIDE_MS = 50.0


# --- (a) reaction time, replayed -----------------------------------------------------------------


def reaction_scene(t: float, onset: float, path: str) -> Snapshot:
    """24 GiB GPU: two idle 6 GiB models; from ``onset`` an 11.3 GiB job in use (97 %)."""
    last_used = t - 30.0 if path == "ladder" else BASE - 3600.0
    rs = [
        ResidentView(f"r{i}", f"r{i}", 0, 100 + i, "persistent", 6 * GiB, False, last_used)
        for i in (1, 2)
    ]
    used = 12 * GiB
    if t >= onset:
        job = int(11.3 * GiB)
        rs.append(ResidentView("job", "job", 0, 200, "persistent", job, True, t, True))
        used += job
    return Snapshot(
        now_wall=t,
        local_minutes=15 * 60,
        gpus=(GpuSignals(0, 24 * GiB, used),),
        residents=tuple(rs),
    )


def replay_reaction(samples: int, interval: float, path: str) -> tuple[list[float], list[float]]:
    """Seconds from onset to the first level action and to the first eviction, per phase."""
    config = GovernorConfig(interval_s=interval, samples=samples)
    to_level, to_evict = [], []
    for j in range(PHASES):
        onset = BASE + 10 * interval + (j + 0.5) / PHASES * interval
        state = State(level_since_wall=BASE)
        first_level = first_evict = None
        for k in range(10 + 4 * samples + 4):
            t = BASE + k * interval
            actions, state = decide(reaction_scene(t, onset, path), state, config, t)
            for a in actions:
                if a.kind == "level" and first_level is None:
                    first_level = t - onset
                if a.kind in ("evict", "force-evict") and first_evict is None:
                    first_evict = t - onset
            if first_level is not None and first_evict is not None:
                break
        to_level.append(float("nan") if first_level is None else first_level)
        to_evict.append(float("nan") if first_evict is None else first_evict)
    return to_level, to_evict


def part_a(figures: dict[str, Any]) -> None:
    print("\n(a) reaction time from a pressure onset to the first action")
    print(
        "    REPLAY through gpulock.governor.policy.decide (not the daemon): passes every interval,"
    )
    print(f"    the GPU jumps 50 % -> 97 % at {PHASES} onsets spread between two passes;")
    print("    seconds, mean / max over the onsets.  Watchdog 85 %, vram_pressure 95 %.")
    head = (
        f"    {'samples':>7} {'interval':>8}  {'first level':>15}  "
        f"{'first evict, ladder':>20}  {'first evict, watchdog':>22}"
    )
    print(head)
    print(
        f"    {'':>7} {'':>8}  {'':>15}  {'(models used 30 s ago)':>20}  {'(models idle 1 h)':>22}"
    )
    rows = []
    for samples in (1, 3, 5):
        for interval in (1.0, 10.0, 60.0):
            lv, ev_l = replay_reaction(samples, interval, "ladder")
            _, ev_w = replay_reaction(samples, interval, "watchdog")

            def cell(xs: list[float]) -> str:
                return f"{statistics.fmean(xs):6.1f} / {max(xs):6.1f}"

            print(
                f"    {samples:>7} {interval:>7.0f}s  {cell(lv):>15}  {cell(ev_l):>20}  "
                f"{cell(ev_w):>22}"
            )
            rows.append(
                {
                    "samples": samples,
                    "interval_s": interval,
                    "level_s": lv,
                    "evict_ladder_s": ev_l,
                    "evict_watchdog_s": ev_w,
                }
            )
    print("    expected: level = wait for the next pass + (samples-1) intervals; ladder eviction")
    print("    = wait + (2*samples-1) intervals (reduce first, then evict-idle); watchdog = wait.")
    figures["reaction_replay"] = rows


# --- (a) reaction time, for real -----------------------------------------------------------------

OWNER = textwrap.dedent(
    """
    import json, sys, time
    from gpulock.residents import owner as R
    specs = json.loads(sys.argv[1])
    weights, handles = {}, []
    def unloader(name):
        def unload(model):
            weights.pop(name, None)
            print(f"unloaded {name} {time.time():.6f}", flush=True)
        return unload
    for name, size, gpu in specs:
        weights[name] = bytearray(1 << 16)
        handles.append(R.resident(name, model=weights[name], bytes=size, gpu=gpu,
                                  unload=unloader(name)))
    print(f"ready {time.time():.6f}", flush=True)
    time.sleep(3600)
    """
)


class Owner:
    """A real process owning resident models; reports its registration and unloads."""

    def __init__(self, env: dict[str, str], specs: list[tuple[str, str, int]]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OWNER, json.dumps(specs)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        line = self.readline(15.0)
        if line is None or not line.startswith("ready "):
            self.stop()
            raise RuntimeError(f"owner did not start: {line!r}")
        self.ready_wall = float(line.split()[1])

    def readline(self, timeout_s: float) -> str | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self.proc.stdout.readline().strip()
        self.lines.append(line)
        return line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def real_reaction(tmp: Path, trial: int) -> dict[str, float]:
    """One onset with the real daemon: seconds to the first level and to the first unload."""
    from gpulock.core import level
    from gpulock.core.settings import load

    state = tmp / f"real-{trial}"
    cfg = tmp / f"real-{trial}.yaml"
    cfg.write_text(
        "watchdog: {interval: 1s, threshold: 85%, min_idle: 0s, hysteresis: 5%}\n"
        "governor: {samples: 1, vram_pressure: 95%, cooldown: 5m}\n"
    )
    env = dict(os.environ, GPULOCK_STATE_DIR=str(state), GPULOCK_SIMULATE="24GiB")
    env.update(GPULOCK_CONFIG=str(cfg), PYTHONPATH=str(REPO))
    env.pop("GPULOCK_TICKET", None)
    settings = load(str(cfg), state)
    owners: list[Owner] = []
    log = (tmp / f"real-{trial}.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpulock.governor", "--config", str(cfg), "--state-dir", str(state)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        owners.append(Owner(env, [("idle-4g", "4GiB", 0)]))
        deadline = time.monotonic() + 15
        while level.read_raw(settings) is None:  # its first pass is done
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"governor did not publish: {Path(log.name).read_text()}")
            time.sleep(0.01)
        time.sleep(0.3 + 0.2 * trial)  # onsets at different phases of the 1 s interval
        big = Owner(env, [("big-19g", "19GiB", 0)])  # 23 of 24 GiB: 96 %
        owners.append(big)
        onset = big.ready_wall
        first_level = first_evict = None
        deadline = time.monotonic() + 15
        while (first_level is None or first_evict is None) and time.monotonic() < deadline:
            pub = level.read_raw(settings)
            if first_level is None and pub is not None and pub.level != "normal":
                first_level = pub.since_wall - onset
            line = owners[0].readline(0.005)
            if first_evict is None and line and line.startswith("unloaded "):
                first_evict = float(line.split()[2]) - onset
        if first_level is None or first_evict is None:
            raise RuntimeError(
                f"no reaction within 15 s (level {first_level}, evict {first_evict})"
            )
        return {"level_s": first_level, "evict_s": first_evict}
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        for o in owners:
            o.stop()
        log.close()


def part_a_real(tmp: Path, figures: dict[str, Any], skip: bool) -> str:
    print("\n    for real: python -m gpulock.governor, interval 1s, samples 1, min_idle 0s;")
    print("    simulated 24 GiB GPU, an owner holding an idle 4 GiB model; onset = another owner")
    print("    registers 19 GiB")
    print(
        "    (96 %); first level = since_wall in governor.json, first evict = the unload callback"
    )
    if skip:
        print("    skipped (--no-real)")
        return "real daemon skipped"
    if (
        not (REPO / "gpulock" / "governor" / "daemon.py").exists()
        or not (REPO / "gpulock" / "governor" / "cli.py").exists()
    ):
        print("    skipped: gpulock/governor/daemon.py or gpulock/governor/cli.py is not there yet")
        return "real daemon not there"
    results = []
    try:
        for trial in range(3):
            results.append(real_reaction(tmp, trial))
    except Exception as e:
        print(f"    skipped: the real run failed: {e!r}"[:600])
        return "real daemon failed"
    for i, r in enumerate(results):
        print(
            f"    trial {i + 1}: first level {r['level_s']:.3f} s, first evict {r['evict_s']:.3f} s"
        )
    figures["reaction_real"] = results
    ev = [r["evict_s"] for r in results]
    return f"real daemon (1 s interval) first evict {statistics.fmean(ev):.2f} s mean"


# --- (b) CPU cost of a pass ----------------------------------------------------------------------


def fifty_residents(now: float) -> tuple[ResidentView, ...]:
    rng = random.Random(50)
    out = []
    for i in range(50):
        policy = ("persistent", "persistent", "cold-start", "pinned")[i % 4]
        out.append(
            ResidentView(
                id=f"id-{i}",
                name=f"model-{i}",
                gpu=i % 2,
                pid=1000 + i // 10,
                policy=policy,
                bytes=int(rng.uniform(0.2, 1.5) * GiB),
                in_use=i % 5 == 0,
                last_used_wall=now - rng.uniform(0, 7200),
                owner_holds_lock=i % 10 == 0,
                torch_allocated_bytes=GiB if i % 3 == 0 else None,
                torch_reserved_bytes=int(1.2 * GiB) if i % 3 == 0 else None,
            )
        )
    return tuple(out)


def time_decide(snapshot: Snapshot, state: State, config: GovernorConfig, n: int) -> float:
    """CPU seconds per pass."""
    c0 = time.process_time()
    for _ in range(n):
        decide(snapshot, state, config, snapshot.now_wall)
    return (time.process_time() - c0) / n


def part_b(tmp: Path, figures: dict[str, Any]) -> tuple[float, str]:
    print("\n(b) CPU cost of one pass (time.process_time)")
    now = BASE
    rs = fifty_residents(now)
    config = GovernorConfig(unregistered_bytes=GiB)
    quiet = Snapshot(
        now, 900, (GpuSignals(0, 24 * GiB, 8 * GiB), GpuSignals(1, 24 * GiB, 9 * GiB)), rs
    )
    busy = Snapshot(
        now,
        180,
        (GpuSignals(0, 24 * GiB, 23 * GiB), GpuSignals(1, 24 * GiB, 24 * GiB)),
        rs,
        psi_some_avg10=40.0,
        psi_full_avg10=9.0,
        swap_bytes_per_s=1e9,
        oom_reports=3,
    )
    n = 3000
    q = time_decide(quiet, State(), config, n)
    acts, _ = decide(busy, State(level="force-evict"), config, now)
    b = time_decide(busy, State(level="force-evict"), config, n)
    worst = max(q, b)
    verdict = "PASS" if worst * 1000 < TARGET_DECIDE_MS else "FAIL"
    print(f"    decide, 50 residents on 2 GPUs, nothing over:         {q * 1e6:8.1f} us CPU/pass")
    print(
        f"    decide, 50 residents, both GPUs over, force-evict:     {b * 1e6:8.1f} us CPU/pass"
        f"  ({len(acts)} actions)"
    )
    print(f"    target < {TARGET_DECIDE_MS:.0f} ms: {verdict} ({n} passes each)")
    figures["decide_cpu_s"] = {"quiet": q, "busy": b, "busy_actions": len(acts)}
    probe_note = probe_cost(tmp, figures)
    verdict = "PASS" if verdict == "PASS" else "FAILED"
    target = f"decide target < {TARGET_DECIDE_MS:.0f} ms CPU/pass"
    return worst, f"decide {worst * 1e6:.0f} us CPU/pass ({verdict}: {target}); {probe_note}"


def probe_cost(tmp: Path, figures: dict[str, Any]) -> str:
    if not (REPO / "gpulock" / "governor" / "probes.py").exists():
        print("    Probe.collect: skipped, gpulock/governor/probes.py is not there yet")
        return "Probe.collect not measured"
    try:
        from gpulock.core.settings import load
        from gpulock.governor.probes import Probe
    except Exception as e:
        print(f"    Probe.collect: skipped, import failed: {e!r}")
        return "Probe.collect not measured"
    state = tmp / "probe"
    cfg = tmp / "probe.yaml"
    cfg.write_text("{}\n")
    env = dict(os.environ, GPULOCK_STATE_DIR=str(state), GPULOCK_SIMULATE="24GiB,24GiB")
    env.update(GPULOCK_CONFIG=str(cfg), PYTHONPATH=str(REPO))
    env.pop("GPULOCK_TICKET", None)
    saved = {k: os.environ.get(k) for k in ("GPULOCK_SIMULATE", "GPULOCK_STATE_DIR")}
    os.environ.update(GPULOCK_SIMULATE="24GiB,24GiB", GPULOCK_STATE_DIR=str(state))
    owners: list[Owner] = []
    try:
        settings = load(str(cfg), state)
        for o in range(5):
            owners.append(Owner(env, [(f"o{o}-m{i}", "300MiB", i % 2) for i in range(10)]))
        probe = Probe(settings)
        c0, w0 = time.process_time(), time.perf_counter()
        snap = probe.collect(time.time())
        first_cpu, first_wall = time.process_time() - c0, time.perf_counter() - w0
        n = 100
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            snap = probe.collect(time.time())
        cpu, wall = (time.process_time() - c0) / n, (time.perf_counter() - w0) / n
        d = time_decide(snap, State(), GovernorConfig(), 1000)
    except Exception as e:
        print(f"    Probe.collect: skipped, it failed: {e!r}"[:600])
        return "Probe.collect failed"
    finally:
        for ow in owners:
            ow.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    print(
        f"    Probe.collect, {len(snap.residents)} residents of 5 owner processes, 2 simulated GPUs"
    )
    print(f"      per pass ({n} passes): {cpu * 1000:.2f} ms CPU, {wall * 1000:.2f} ms wall")
    print(f"      first pass: {first_cpu * 1000:.1f} ms CPU, {first_wall * 1000:.1f} ms wall")
    print(f"      decide on its snapshot: {d * 1e6:.0f} us CPU")
    figures["probe"] = {"residents": len(snap.residents), "cpu_s": cpu, "wall_s": wall}
    return f"Probe.collect {cpu * 1000:.1f} ms CPU / {wall * 1000:.1f} ms wall"


# --- (c) a day of agents -------------------------------------------------------------------------

TOTAL = 12 * GiB
BACKGROUND = GiB // 2  # the desktop, a CUDA context nobody registered
NIGHT = ScheduleWindow(22 * 60, 6 * 60, 0.40)


@dataclass
class Run:
    agent: str
    model: str
    start: int  # minute of the day
    end: int  # exclusive


@dataclass
class Model:
    name: str
    bytes: int
    loaded: bool = False
    users: int = 0  # runs using it now
    last_used_min: float = 0.0


def make_day(seed: int, n_agents: int = 40, n_models: int = 16) -> tuple[dict[str, int], list[Run]]:
    """Models (name -> bytes) and every run of the day, sorted by start."""
    rng = random.Random(seed)
    models = {f"m{i:02d}": int(round(rng.uniform(1, 6) * 2) / 2 * GiB) for i in range(n_models)}
    names = sorted(models)
    runs: list[Run] = []
    kinds = ["chat"] * 14 + ["hourly"] * 12 + ["batch"] * 6 + ["nightly"] * 8
    for a in range(n_agents):
        kind = kinds[a % len(kinds)]
        agent, model = f"{kind}-{a:02d}", rng.choice(names)
        starts: list[tuple[int, int]] = []
        if kind == "chat":  # office hours, every 30-60 minutes, 1-3 minutes long
            period, dur = rng.randint(30, 60), rng.randint(1, 3)
            starts = [(m, dur) for m in range(8 * 60 + rng.randrange(period), 20 * 60, period)]
        elif kind == "hourly":
            period, dur = 60, rng.randint(2, 5)
            starts = [(m, dur) for m in range(rng.randrange(60), 1440, period)]
        elif kind == "batch":  # every 3-6 hours, longer
            period, dur = rng.randint(180, 360), rng.randint(5, 15)
            starts = [(m, dur) for m in range(rng.randrange(period), 1440, period)]
        else:  # nightly: 2-4 long runs between 22:00 and 06:00
            picks = sorted(rng.sample(range(0, 480, 40), rng.randint(2, 4)))
            starts = [((22 * 60 + p) % 1440, rng.randint(10, 25)) for p in picks]
        runs += [Run(agent, model, m, min(m + d, 1440)) for m, d in starts]
    runs.sort(key=lambda r: (r.start, r.agent))
    return models, runs


@dataclass
class DayResult:
    runs: int = 0
    ok: int = 0
    warm: int = 0  # found the model loaded
    loads: int = 0  # cold starts
    oom: int = 0  # loads that did not fit: the run failed
    oom_minutes: int = 0
    unloads: int = 0
    by_watchdog: int = 0
    by_ladder: int = 0
    peak: int = 0
    used_sum: float = 0.0
    over_threshold_minutes: int = 0
    level_minutes: Counter[str] = field(default_factory=Counter)
    level_changes: int = 0
    cpu_s: float = 0.0


def simulate_day(
    models_spec: dict[str, int], runs: list[Run], config: GovernorConfig | None
) -> DayResult:
    """Minute by minute; ``config`` None: no governor.  Thresholds counted with the night window."""
    models = {n: Model(n, b) for n, b in models_spec.items()}
    used = BACKGROUND
    out = DayResult(runs=len(runs))
    state = State()
    by_start: dict[int, list[Run]] = {}
    by_end: dict[int, list[Run]] = {}
    for r in runs:
        by_start.setdefault(r.start, []).append(r)
    watch = config or GovernorConfig(schedule=(NIGHT,))
    for minute in range(1440):
        for r in by_end.pop(minute, []):
            m = models[r.model]
            m.users -= 1
            m.last_used_min = minute
        oom_now = False
        for r in by_start.get(minute, []):
            m = models[r.model]
            if m.loaded:
                out.warm += 1
            elif used + m.bytes <= TOTAL:
                m.loaded, used = True, used + m.bytes
                out.loads += 1
            else:
                out.oom += 1
                oom_now = True
                continue
            out.ok += 1
            m.users += 1
            m.last_used_min = minute
            by_end.setdefault(r.end, []).append(r)
        out.oom_minutes += oom_now
        out.peak = max(out.peak, used)
        out.used_sum += used
        if used > threshold_in_force(watch, minute) * TOTAL:
            out.over_threshold_minutes += 1
        if config is not None:
            now = BASE + minute * 60 + 30  # the pass, half a minute after the agents moved
            views = tuple(
                ResidentView(
                    id=m.name,
                    name=m.name,
                    gpu=0,
                    pid=1,
                    policy="persistent",
                    bytes=m.bytes,
                    in_use=m.users > 0,
                    last_used_wall=now if m.users else BASE + m.last_used_min * 60,
                    owner_holds_lock=m.users > 0,  # an agent holds the GPU while it runs
                )
                for m in models.values()
                if m.loaded
            )
            snap = Snapshot(now, minute, (GpuSignals(0, TOTAL, used),), views)
            c0 = time.process_time()
            actions, new_state = decide(snap, state, config, now)
            out.cpu_s += time.process_time() - c0
            out.level_changes += new_state.level != state.level
            state = new_state
            for a in actions:
                if a.kind in ("evict", "force-evict") and a.resident in models:
                    m = models[a.resident]
                    if m.loaded and m.users == 0:  # an idle owner answers at once
                        m.loaded, used = False, used - m.bytes
                        out.unloads += 1
                        if a.reason.startswith("level "):
                            out.by_ladder += 1
                        else:
                            out.by_watchdog += 1
        out.level_minutes[state.level] += 1
    return out


def part_c(seed: int, figures: dict[str, Any]) -> str:
    models, runs = make_day(seed)
    sizes = sorted(b / GiB for b in models.values())
    print("\n(c) a day of 40 agents on a 12 GiB GPU: a minute-by-minute SIMULATION (no processes)")
    print(
        f"    {len(models)} models of {sizes[0]:.1f}-{sizes[-1]:.1f} GiB "
        f"(sum {sum(sizes):.0f} GiB), persistent residents; {len(runs)} runs (seed {seed});"
    )
    print("    0.5 GiB used by nobody registered")
    demand = [
        sum(models[m] for m in {r.model for r in runs if r.start <= minute < r.end}) + BACKGROUND
        for minute in range(1440)
    ]
    print(
        f"    demand, were every run to get its model: mean {statistics.fmean(demand) / GiB:.1f} "
        f"GiB, peak {max(demand) / GiB:.1f} GiB,"
    )
    print(
        f"    above 12 GiB in {sum(d > TOTAL for d in demand)} minutes (no policy can serve those)"
    )
    print("    a load that does not fit is an OOM: that run fails (no retry); min_idle 10m,")
    print(
        "    hysteresis 5 %, samples 3, cooldown 5m, vram_pressure 95 %; evictions take effect at"
    )
    print("    once (idle owners); freeze would hold loads back, not simulated; room-for-a-waiter")
    print("    (gpulock's make_room at admission) not simulated on either side")
    cols = {
        "governor off": None,
        "on, 85%/40% night": GovernorConfig(threshold=0.85, schedule=(NIGHT,)),
        "on, 85% all day": GovernorConfig(threshold=0.85),
    }
    res = {k: simulate_day(models, runs, c) for k, c in cols.items()}
    width = 19

    def row(label: str, fn: Any) -> None:
        print(f"    {label:<38}" + "".join(f"{fn(r):>{width}}" for r in res.values()))

    print(f"    {'':<38}" + "".join(f"{k:>{width}}" for k in res))
    row("runs", lambda r: r.runs)
    row("  completed", lambda r: r.ok)
    row("  found their model loaded (warm)", lambda r: r.warm)
    row("  failed: load did not fit (OOM)", lambda r: r.oom)
    row("loads (cold starts)", lambda r: r.loads)
    row("unloads (all by eviction)", lambda r: r.unloads)
    row("  evictions by the watchdog", lambda r: r.by_watchdog)
    row("  evictions by the ladder", lambda r: r.by_ladder)
    row("peak VRAM", lambda r: f"{r.peak / GiB:.1f} GiB {r.peak / TOTAL:.0%}")
    row("mean VRAM", lambda r: f"{r.used_sum / 1440 / GiB:.1f} GiB")
    row("minutes a load did not fit (>100 %)", lambda r: r.oom_minutes)
    row("minutes above the threshold in force *", lambda r: r.over_threshold_minutes)
    row("level changes", lambda r: r.level_changes)
    row(
        "minutes at reduce / evict-idle / above",
        lambda r: (
            f"{r.level_minutes['reduce']} / {r.level_minutes['evict-idle']} / "
            f"{sum(r.level_minutes[lv] for lv in LEVELS[3:])}"
        ),
    )
    row("decide CPU for the day", lambda r: f"{r.cpu_s * 1000:.0f} ms")
    print("    * each column's own threshold; for governor off, 85 % with 40 % at night")
    figures["day"] = {
        k: {
            "runs": r.runs,
            "ok": r.ok,
            "warm": r.warm,
            "oom": r.oom,
            "loads": r.loads,
            "unloads": r.unloads,
            "by_watchdog": r.by_watchdog,
            "by_ladder": r.by_ladder,
            "peak_bytes": r.peak,
            "oom_minutes": r.oom_minutes,
            "over_threshold_minutes": r.over_threshold_minutes,
            "level_minutes": dict(r.level_minutes),
        }
        for k, r in res.items()
    }
    off, on = res["governor off"], res["on, 85%/40% night"]
    return (
        f"day sim OOM-failed runs {off.oom} off -> {on.oom} on, cold starts {off.loads} -> "
        f"{on.loads}, evictions {on.unloads}, minutes over threshold "
        f"{off.over_threshold_minutes} -> {on.over_threshold_minutes}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seed", type=int, default=7, help="the synthetic day of (c)")
    ap.add_argument("--no-real", action="store_true", help="skip the real daemon in (a)")
    ap.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    args = ap.parse_args()
    figures: dict[str, Any] = {}
    started = time.perf_counter()
    print(
        f"governor benchmark: python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    with tempfile.TemporaryDirectory(prefix="gpulock-bench-governor-") as tmp_name:
        tmp = Path(tmp_name)
        part_a(figures)
        real = part_a_real(tmp, figures, args.no_real)
        worst, cost = part_b(tmp, figures)
    day = part_c(args.seed, figures)
    rows = {(r["samples"], r["interval_s"]): r for r in figures["reaction_replay"]}
    d = rows[(3, 60.0)]
    print(f"\n(done in {time.perf_counter() - started:.1f} s)")
    print(
        f"\nsummary: replay, samples 3 / 60 s: first level {statistics.fmean(d['level_s']):.0f} s,"
        f" ladder eviction {statistics.fmean(d['evict_ladder_s']):.0f} s, watchdog eviction "
        f"{statistics.fmean(d['evict_watchdog_s']):.0f} s after onset (mean); {real}; {cost}; "
        f"{day}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str))
    return 0 if worst * 1000 < TARGET_DECIDE_MS else 1


if __name__ == "__main__":
    sys.exit(main())
