"""Serving a fleet: APScheduler fires the runs until SIGTERM/SIGINT or the end of ``--for``.

APScheduler 3 decides when (``coalesce``, ``max_instances=1``, ``misfire_grace_time``), in a
thread of its own, so that the main thread keeps the signals; ``gpulock.agents.fleetrun.Runner``
does
each run and ends them on a stop.  Besides each run's ``fleet-run`` event::

    {"event": "fleet-missed", "agent": "digest", "reason": "running" | "late",
     "scheduled_wall": ...}    # a fire dropped: the last run still going, or past misfire_grace
    {"event": "fleet-start", "pid": ..., "file": ..., "agents": 5}
    {"event": "fleet-stop", "pid": ..., "reason": "SIGTERM" | "SIGINT" | "duration",
     "killed": 0}

A requested stop exits 0: systemd and cron asked for it.  One fleet runs a given fleet file at a
time (a lock in ``<state>/fleet/``).  APScheduler is imported only inside functions here.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gpulock.agents.fleetfile import FleetFile
from gpulock.agents.fleetplan import JobSpec
from gpulock.agents.fleetrun import EX_OK, Runner, Wakeup
from gpulock.agents.schedules import make_trigger
from gpulock.core.errors import GpulockError, StateDirError
from gpulock.core.units import format_duration

if TYPE_CHECKING:
    from gpulock.core.settings import Settings

__all__ = ["serve"]


# --- APScheduler (imported inside functions only) ----------------------------------------------


def _scheduler(runner: Runner, fleet: FleetFile, jobs: Sequence[JobSpec]) -> Any:
    import logging

    from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED
    from apscheduler.executors.pool import ThreadPoolExecutor
    from apscheduler.schedulers.blocking import BlockingScheduler

    # Its own warnings repeat what the fleet-missed events say; real failures still show.
    log = logging.getLogger("apscheduler")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("fleet: apscheduler: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.ERROR)
    log.propagate = False

    options = fleet.options
    scheduler = BlockingScheduler(
        executors={"default": ThreadPoolExecutor(max_workers=options.max_parallel)},
        job_defaults={
            "coalesce": True,  # fires missed while the fleet was busy or down: one run, not many
            "max_instances": 1,  # an agent never overlaps itself
            "misfire_grace_time": options.misfire_grace_s,
        },
    )

    def on_missed(event: Any) -> None:
        times = getattr(event, "scheduled_run_times", None) or [event.scheduled_run_time]
        runner.settings.emit(
            "fleet-missed",
            agent=event.job_id,
            reason="running" if event.code == EVENT_JOB_MAX_INSTANCES else "late",
            scheduled_wall=round(times[-1].timestamp(), 3),
        )

    scheduler.add_listener(on_missed, EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES)
    for spec in jobs:
        if spec.enabled:
            scheduler.add_job(
                runner.run, make_trigger(spec), args=(spec,), id=spec.name, name=spec.name
            )
    return scheduler


# --- serving -----------------------------------------------------------------------------------


def _claim(settings: Settings, fleet: FleetFile) -> int:
    """Hold a lock for this fleet file (until exit), so two fleets never run its agents twice."""
    from gpulock.core import state, statefile

    folder = state.ensure_subdir(settings.state_dir, "fleet", group=settings.group)
    digest = hashlib.sha256(str(fleet.path.absolute()).encode()).hexdigest()[:12]
    path = folder / f".fleet-{digest}.lock"
    me = f"{os.getpid()}\n".encode()
    fd = statefile.take_instance_lock(path, settings.file_mode, me, what="the fleet's lock")
    if fd is None:
        try:
            holder = (statefile.read_small(path, 64) or b"").decode(errors="replace").strip() or "?"
        except (OSError, StateDirError):
            holder = "?"
        raise GpulockError(
            f"a fleet already runs {fleet.path} (pid {holder})",
            hint=f"stop it first (kill {holder}), or run another fleet file",
        )
    return fd


def _make_dirs(jobs: Sequence[JobSpec], settings: Settings) -> None:
    from gpulock.core import state

    default = settings.state_dir / "fleet"
    for folder in {j.log_path.parent for j in jobs}:
        if folder == default:
            state.ensure_subdir(settings.state_dir, "fleet", group=settings.group)
        else:
            try:
                folder.mkdir(parents=True, exist_ok=True, mode=0o770 if settings.group else 0o700)
            except OSError as exc:
                raise GpulockError(
                    f"cannot create the log folder {folder}: {exc.strerror or exc}",
                    hint="fix fleet.log_dir in the fleet file",
                ) from None


class _SchedulerThread:
    """``BlockingScheduler.start()`` in a thread of its own, so the main thread keeps the signals.

    A failure in the scheduler's thread is raised again by ``check`` in the main thread.
    """

    def __init__(self, scheduler: Any, wakeup: Wakeup) -> None:
        from apscheduler.events import EVENT_SCHEDULER_STARTED

        self.scheduler = scheduler
        self._wakeup = wakeup
        self._started = threading.Event()
        self._failure: list[BaseException] = []
        scheduler.add_listener(lambda _e: self._started.set(), EVENT_SCHEDULER_STARTED)
        self._thread = threading.Thread(target=self._loop, name="gpulock-fleet-scheduler")

    def _loop(self) -> None:
        try:
            self.scheduler.start()  # blocks in this thread until shutdown()
        except BaseException as e:
            self._failure.append(e)
        finally:
            self._started.set()
            self._wakeup.poke()

    def start(self) -> None:
        self._thread.start()
        self._started.wait()  # shutdown() before start() would be lost, and the loop run on
        self.check()

    def check(self) -> None:
        if self._failure:
            raise self._failure[0]

    def stop(self) -> None:
        """No new fires; runs already handed to the pool keep their threads."""
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)


def _wait_for_stop(wakeup: Wakeup, thread: _SchedulerThread, for_s: float | None) -> str:
    """Block until SIGTERM/SIGINT (its name) or the end of ``for_s`` (``duration``)."""
    deadline = None if for_s is None else time.monotonic() + for_s
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return "duration"
        sig = wakeup.wait(left)
        if sig is not None:
            return signal.Signals(sig).name
        thread.check()


def serve(
    settings: Settings, fleet: FleetFile, jobs: Sequence[JobSpec], *, for_s: float | None
) -> int:
    """Run the fleet until SIGTERM/SIGINT or ``for_s`` seconds, then stop cleanly."""
    enabled = [j for j in jobs if j.enabled]
    lock_fd = _claim(settings, fleet)
    _make_dirs(enabled, settings)
    wakeup = Wakeup()
    runner = Runner(settings, wakeup)
    thread = _SchedulerThread(_scheduler(runner, fleet, jobs), wakeup)
    wakeup.install()
    try:
        thread.start()
        disabled = len(jobs) - len(enabled)
        runner.say(
            f"{len(enabled)} agent(s) from {fleet.path}"
            + (f" ({disabled} disabled)" if disabled else "")
            + f"; state {settings.state_dir}"
            + (f"; for {format_duration(for_s)}" if for_s is not None else "")
        )
        settings.emit(
            "fleet-start", pid=os.getpid(), file=str(fleet.path.absolute()), agents=len(enabled)
        )
        reason = _wait_for_stop(wakeup, thread, for_s)
        runner.say(
            f"stopping ({reason}): {len(runner.running())} run(s) going, waiting up to "
            f"{format_duration(fleet.options.grace_s)}"
        )
        thread.stop()
        killed = runner.drain(fleet.options.grace_s)
        thread.join(5.0)
        settings.emit("fleet-stop", pid=os.getpid(), reason=reason, killed=killed)
        runner.say(f"stopped ({reason})")
        return EX_OK
    finally:
        thread.stop()
        runner.drain(0.0)  # after an unexpected error too: no run may outlive the fleet
        wakeup.close()
        os.close(lock_fd)
