"""The governor's loop: one instance per state folder, one pass per interval.

::

    snapshot = probe.collect(now)                        # gpulock.governor.probes
    actions, state = decide(snapshot, state, config, now)  # gpulock.governor.policy (pure)
    effects.apply(actions, snapshot, config)             # gpulock.governor.effects
    effects.publish(state.level, ...)                    # <state>/governor.json

``tick(now_wall)`` is one pass and returns the seconds until the next; ``run(stop)`` repeats it
until ``stop`` (a ``threading.Event``, set by SIGTERM in the CLI) is set, waiting on the Event,
so a stop acts at once.  Every collaborator comes in through the constructor.

One governor per state folder: ``open()`` takes an exclusive, non-blocking ``flock`` on
``<state>/governor.lock`` for the daemon's life (a second one fails with ``AlreadyRunning``,
naming the pid that runs), then creates ``<state>/governor.fifo``, the claim that makes its
published level count (``gpulock.core.level``): when the governor dies, however it dies, the kernel
drops the claim and every reader falls back to ``normal``.  The lock comes first because
creating the claim replaces the FIFO at that path.  A dry run publishes nothing, so it takes
neither and may run beside the real governor.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from gpulock import arbiter
from gpulock.core import claim, level, safejson, statefile
from gpulock.core.errors import GpulockError, StateDirError
from gpulock.core.prewarm import options as prewarm_options
from gpulock.core.settings import Settings
from gpulock.governor.effects import Effects
from gpulock.governor.model import LEVELS, GovernorConfig, Snapshot, State
from gpulock.governor.policy import decide as policy_decide
from gpulock.governor.policy import threshold_in_force
from gpulock.governor.probes import Probe

LOCK_FILE = "governor.lock"
DEFAULT: Any = object()  # "the real one", for constructor arguments where None means "none"


def prewarm_wait_s(settings: Settings) -> float:
    """How long a ``--once`` pass waits for its pre-warms: at most their lead."""
    return prewarm_options(settings.config).lead_s


Decide = Callable[[Snapshot, State, GovernorConfig, float], tuple[list[Any], State]]


class AlreadyRunning(GpulockError):
    """Another governor already runs for this state folder."""

    def __init__(self, pid: int | None, since: float | None, state_dir: str = "") -> None:
        self.pid = pid
        self.since = since
        self.state_dir = state_dir
        who = f"pid {pid}" if pid is not None else "a process whose pid it did not record"
        when = ""
        if since:
            when = f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}"
        where = f" for {state_dir}" if state_dir else ""
        super().__init__(
            f"a governor already runs{where}: {who}{when}",
            hint="one per state folder; stop that one first, or use --dry-run beside it",
        )


class Governor:
    """Collect, decide, act, publish; ``tick`` is one pass, ``run`` the loop around it."""

    def __init__(
        self,
        settings: Settings,
        config: GovernorConfig,
        *,
        probe: Probe | None = None,
        effects: Effects | None = None,
        decide: Decide = policy_decide,
        clock: Callable[[], float] = time.time,
        after_pass: Callable[[], None] | None = None,
        prewarm: Any = DEFAULT,
    ) -> None:
        """``prewarm``: what warms models needed soon (``gpulock.arbiter.Prewarmer`` unless a
        dry run; None: nothing)."""
        self.settings = settings
        self.after_pass = after_pass  # e.g. rewrite the metrics textfile (gpulock.metrics)
        self.config = config
        self.probe = probe or Probe(settings)
        self.effects = effects or Effects(settings)
        self.decide = decide
        self.clock = clock
        if prewarm is DEFAULT:
            prewarm = None if self.effects.dry_run else arbiter.Prewarmer(settings, clock=clock)
        self.prewarm = prewarm
        self.state = State(level="normal", level_since_wall=clock())
        self.last_results: list[dict[str, Any]] = []
        self.last_snapshot: Snapshot | None = None  # what the last pass measured
        self.last_level_before = self.state.level  # the level the last pass started from
        self._lock_fd: int | None = None
        self._claim_fd: int | None = None

    # --- life ----------------------------------------------------------------------------------

    @property
    def dry_run(self) -> bool:
        return self.effects.dry_run

    def open(self) -> None:
        """Become the state folder's governor (AlreadyRunning if another one is)."""
        if self.dry_run or self._lock_fd is not None:
            return
        path = self.settings.state_dir / LOCK_FILE
        me = json.dumps({"pid": os.getpid(), "since_wall": self.clock()}).encode() + b"\n"
        fd = statefile.take_instance_lock(
            path, self.settings.file_mode, me, what="the governor lock"
        )
        if fd is None:
            pid, since = _who_runs(path, self.settings)
            raise AlreadyRunning(pid, since, str(self.settings.state_dir))
        try:
            os.fchmod(fd, self.settings.file_mode)
            self._claim_fd = claim.create(level.claim_path(self.settings), self.settings.file_mode)
            self.state = resume(self.settings, self.config, self.clock(), self.state)
        except BaseException:
            os.close(fd)  # drops the flock
            raise
        self._lock_fd = fd

    def close(self) -> None:
        """Give up the claim (the published level stops counting) and then the lock."""
        if self.prewarm is not None:
            self.prewarm.stop()
        if self._claim_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(level.claim_path(self.settings))  # ours: the flock guards the path
            os.close(self._claim_fd)
            self._claim_fd = None
            if self.effects.published == "freeze":
                self.effects.ring_waiters()  # the freeze ends with us: let waiters look again
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Governor:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- passes --------------------------------------------------------------------------------

    def tick(self, now_wall: float) -> float:
        """One pass at ``now_wall``; the seconds until the next pass starts."""
        snapshot = self.probe.collect(now_wall)
        self.last_snapshot, self.last_level_before = snapshot, self.state.level
        actions, self.state = self.decide(snapshot, self.state, self.config, now_wall)
        self.last_results = self.effects.apply(actions, snapshot, self.config)
        self.effects.publish(
            self.state.level,
            self.state.level_since_wall,
            signals_of(snapshot),
            thresholds_of(self.config, snapshot),
            self.config.interval_s,
            now_wall=now_wall,
            memory=remember(self.state),
        )
        self._prewarm(snapshot, now_wall)
        if self.after_pass is not None:
            self.after_pass()
        spent = self.clock() - now_wall
        return min(max(self.config.interval_s - spent, 0.0), self.config.interval_s)

    def _prewarm(self, snapshot: Snapshot, now_wall: float) -> None:
        """Warm what foresight says is needed soon (``gpulock.core.prewarm``), after this pass's
        evictions: never a reason for the pass to fail."""
        if self.prewarm is None:
            return
        free: dict[int, int | None] = {}
        for g in snapshot.gpus:
            if g.total_bytes is None or g.used_bytes is None:
                free[g.index] = None
                continue
            reserve = self.settings.config.reserve_bytes(g.total_bytes)
            free[g.index] = max(g.total_bytes - g.used_bytes - reserve, 0)
        try:
            self.prewarm.tick(now_wall, resident={r.name for r in snapshot.residents},
                              free_bytes=free)  # fmt: skip
        except Exception as e:  # a pre-warm is a nicety: the governor keeps watch without it
            print(f"gpulock governor: pre-warm failed: {e!r}", file=sys.stderr, flush=True)
            self.settings.emit("governor-error", error=f"prewarm: {e!r}"[:500])

    def once(self) -> list[dict[str, Any]]:
        """One pass now; what was done.  What it started warming ends before it returns (a
        pass from cron is a process that exits after)."""
        self.tick(self.clock())
        if self.prewarm is not None:
            self.prewarm.wait(prewarm_wait_s(self.settings))
        return self.last_results

    def run(self, stop: threading.Event) -> None:
        """Pass after pass until ``stop`` is set.  A failing pass is reported, not fatal."""
        while not stop.is_set():
            try:
                delay = self.tick(self.clock())
            except Exception as e:  # the next pass may well succeed: a daemon keeps watch
                print(f"gpulock governor: pass failed: {e!r}", file=sys.stderr, flush=True)
                if not self.dry_run:
                    self.settings.emit("governor-error", error=repr(e)[:500])
                delay = self.config.interval_s
            stop.wait(delay)


def _who_runs(path: Path, settings: Settings) -> tuple[int | None, float | None]:
    """The running governor's pid and start, from the lock file or else its governor.json."""
    try:
        obj = safejson.loads(statefile.read_small(path, 4096) or b"null")
    except (OSError, ValueError, StateDirError):
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("pid"), int):
        since = obj.get("since_wall")
        return obj["pid"], float(since) if isinstance(since, int | float) else None
    pub = level.read_raw(settings)  # it took the lock but had not written it yet
    return (pub.pid, None) if pub is not None else (None, None)


# --- what governor.json says -------------------------------------------------------------------


def signals_of(snapshot: Snapshot) -> dict[str, Any]:
    """The measured signals, as published (None: unknown)."""
    gpus = []
    for g in snapshot.gpus:
        frac = g.used_bytes / g.total_bytes if g.used_bytes is not None and g.total_bytes else None
        res = [r for r in snapshot.residents if r.gpu == g.index]
        frags = [
            r.torch_reserved_bytes - r.torch_allocated_bytes
            for r in res
            if r.torch_reserved_bytes is not None and r.torch_allocated_bytes is not None
        ]
        gpus.append(
            {
                "index": g.index,
                "total_bytes": g.total_bytes,
                "used_bytes": g.used_bytes,
                "used_fraction": None if frac is None else round(frac, 4),
                "registered_bytes": sum(r.bytes or 0 for r in res),
                "fragmentation_bytes": sum(frags) if frags else None,
                "residents": len(res),
            }
        )
    return {
        "gpus": gpus,
        "psi_some_avg10": snapshot.psi_some_avg10,
        "psi_full_avg10": snapshot.psi_full_avg10,
        "swap_bytes_per_s": (
            None if snapshot.swap_bytes_per_s is None else round(snapshot.swap_bytes_per_s, 1)
        ),
        "oom_reports": snapshot.oom_reports,
        "oom_kills": snapshot.oom_kills,
        "local_minutes": snapshot.local_minutes,
    }


def thresholds_of(config: GovernorConfig, snapshot: Snapshot) -> dict[str, Any]:
    """The thresholds in force this pass, as published."""
    return {
        "threshold": threshold_in_force(config, snapshot.local_minutes),
        "hysteresis": config.hysteresis,
        "min_idle_s": config.min_idle_s,
        "vram_pressure": config.vram_pressure,
        "fragmentation_bytes": config.fragmentation_bytes,
        "unregistered_bytes": config.unregistered_bytes,
        "psi_some": config.psi_some,
        "psi_full": config.psi_full,
        "swap_bytes_per_s": config.swap_bytes_per_s,
        "oom_reports": config.oom_reports,
        "oom_kills": config.oom_kills,
        "samples": config.samples,
        "cooldown_s": config.cooldown_s,
    }


def remember(state: State) -> dict[str, Any]:
    """What the next governor (or the next ``--once`` from cron) needs to carry on."""
    return {
        "level": state.level,
        "level_since_wall": state.level_since_wall,
        "over": [list(x) for x in state.over],
        "clear_since_wall": state.clear_since_wall,
    }


def resume(settings: Settings, config: GovernorConfig, now_wall: float, default: State) -> State:
    """The ladder where the last governor left it, if it wrote recently enough to matter.

    Without this a governor run from cron (``--once`` every few minutes) would start each
    pass at ``normal`` and its ladder could never climb.  A word older than a cooldown (plus
    three intervals) is history, not state: then the ladder starts afresh.
    """
    pub = level.read_raw(settings)
    if pub is None or not pub.memory:
        return default
    if now_wall - pub.updated_wall > config.cooldown_s + 3 * config.interval_s:
        return default
    m = pub.memory
    try:
        lvl = str(m["level"])
        if lvl not in LEVELS:
            return default
        over = tuple((str(k), int(n)) for k, n in m.get("over", []))
        clear = m.get("clear_since_wall")
        return State(
            level=lvl,
            level_since_wall=float(m.get("level_since_wall", now_wall)),
            over=over,
            clear_since_wall=None if clear is None else float(clear),
        )
    except (KeyError, TypeError, ValueError):
        return default
