"""``gpulock fleet FLEET.yaml``: run many agents on their schedules, each run its own process.

Also ``python -m agents.fleet``.  The file's format is in ``agents.fleetfile``.  APScheduler 3
decides when; every run is a subprocess (no shell, its own session and process group) whose
output is appended to ``<log_dir>/<name>.log`` and whose end is an event in the state folder::

    {"event": "fleet-run", "agent": "digest", "pid": 4711, "exit": 0, "duration_s": 3.2,
     "outcome": "ok"}          # ok (0) | skip (75) | error | killed (signal, or the fleet's stop)
                               # not started at all: "pid": null, "exit": 127/126/1, "error": why
    {"event": "fleet-missed", "agent": "digest", "reason": "running" | "late",
     "scheduled_wall": ...}    # a fire dropped: the last run still going, or past misfire_grace
    {"event": "fleet-start", "pid": ..., "file": ..., "agents": 5}
    {"event": "fleet-stop", "pid": ..., "reason": "SIGTERM" | "SIGINT" | "duration",
     "killed": 0}

Stopping (SIGTERM, SIGINT, or the end of ``--for``): no new run starts; running ones get
``fleet.grace`` to finish, then SIGTERM to their process group, ``TERM_WAIT_S`` later SIGKILL.
A second signal cuts the grace short.  A requested stop exits 0: systemd and cron asked for it.
Whatever a stopped run left in its process group is SIGKILLed once the run has exited.

One fleet runs a given fleet file at a time (a lock in ``<state>/fleet/``).  ``--once NAME`` runs
one agent now, its output on the terminal, and exits with its code; ``--dry-run`` prints the
next run times and commands.

APScheduler is imported only inside functions here, so ``import agents`` stays light.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any, Final

from agents import fleetfile
from agents.fleetfile import FleetFile, JobSpec
from gpulock.cli import Parser, UsageError, report
from gpulock.errors import GpulockError
from gpulock.units import format_duration, parse_duration

if TYPE_CHECKING:
    from gpulock.settings import Settings

__all__ = [
    "RunResult",
    "Runner",
    "Wakeup",
    "build_parser",
    "exit_code",
    "main",
    "make_trigger",
    "next_fires",
    "outcome",
]

EX_OK, EX_ERROR, EX_USAGE, EX_TEMPFAIL = 0, 1, 2, 75
EX_NOEXEC, EX_NOTFOUND = 126, 127
TERM_WAIT_S: Final = 2.0  # after SIGTERM to a run's process group, before SIGKILL
REAP_WAIT_S: Final = 2.0  # after SIGKILL, for the run's thread to record it
LOG_MAX_BYTES: Final = 10 * 1024 * 1024  # a run's log is rotated (one .1 kept) past this
DRY_RUN_FIRES: Final = 3
STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)
INSTALL_HINT: Final = "pip install 'gpulock[scheduler]'"

EPILOG = """\
exit codes: 0 stopped by SIGTERM/SIGINT or at the end of --for, or --dry-run done; with --once,
the agent's own code (0 done, 1 error, 75 skipped, 128+N killed by signal N); 1 error (bad
fleet file, unusable state folder, this file's fleet already running, APScheduler missing);
2 usage.  Each run's output: <log_dir>/<name>.log (default <state>/fleet/).  Each run's end: a
'fleet-run' event (gpulock history --event fleet-run)."""


# --- pure decisions ----------------------------------------------------------------------------


def exit_code(returncode: int) -> int:
    """Popen's returncode as a shell reports it: -N (killed by signal N) -> 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def outcome(code: int, *, stopped: bool) -> str:
    """``ok`` | ``skip`` | ``error`` | ``killed`` for a run that exited ``code`` (shell style).

    ``stopped``: the fleet signalled it while stopping, so whatever it exited with, it did not
    finish.  128+N is what a runtime wrapper returns when its agent was killed by signal N.
    """
    if stopped or 128 < code <= 128 + 64:
        return "killed"
    if code == EX_OK:
        return "ok"
    if code == EX_TEMPFAIL:
        return "skip"
    return "error"


@dataclass(frozen=True, slots=True)
class RunResult:
    agent: str
    pid: int | None  # None: the command could not be started
    exit: int
    duration_s: float
    outcome: str


# --- waking the main thread --------------------------------------------------------------------


class Wakeup:
    """A self-pipe: signal handlers and finished runs write a byte, the main thread selects.

    The handler only ``os.write``s, which cannot deadlock the way setting a threading.Event
    from a handler can (the handler runs in the main thread, possibly while that thread holds
    the Event's lock).  A byte > 0 is a signal number; 0 says "a run ended, look again".
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        os.set_blocking(self._r, False)
        self._previous: dict[int, Any] = {}

    def poke(self, value: int = 0) -> None:
        try:
            os.write(self._w, bytes([value]))
        except (BlockingIOError, OSError):
            pass  # full: the reader will wake anyway

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.poke(signum)

    def install(self) -> None:
        for s in STOP_SIGNALS:
            self._previous[s] = signal.signal(s, self._on_signal)

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass

    def wait(self, timeout_s: float | None) -> int | None:
        """Wait up to ``timeout_s`` (None: for ever) for a byte; the first signal number seen."""
        ready, _, _ = select.select([self._r], [], [], None if timeout_s is None else timeout_s)
        if not ready:
            return None
        try:
            data = os.read(self._r, 512)
        except BlockingIOError:
            return None
        return next((b for b in data if b), None)


# --- running agents ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Running:
    proc: subprocess.Popen[bytes]
    stopped: bool = False  # the fleet signalled it while stopping


class Runner:
    """Starts runs and ends them: the one owner of the fleet's child processes.

    ``run`` is called from the scheduler's pool threads (or ``--once``'s); ``drain`` from the
    main thread when the fleet stops.
    """

    def __init__(
        self,
        settings: Settings,
        wakeup: Wakeup,
        *,
        out: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.wakeup = wakeup
        self.out = out or sys.stdout
        self.clock = clock
        self._lock = threading.Lock()
        self._running: dict[int, _Running] = {}
        self._stopping = False

    # -- one run --

    def run(self, spec: JobSpec, *, to_terminal: bool = False) -> RunResult | None:
        """Run ``spec``'s command to its end; None when the fleet is stopping (nothing started)."""
        log: IO[bytes] | None = None
        try:
            with self._lock:  # one decision with drain(): either it starts and is seen, or not
                if self._stopping:
                    return None
                started = self.clock()
                log, proc, problem = self._start(spec, to_terminal)
            if proc is None:
                assert problem is not None
                result = RunResult(spec.name, None, problem[0], 0.0, "error")
            else:
                returncode = proc.wait()
                with self._lock:
                    entry = self._running.pop(proc.pid)
                if entry.stopped:
                    # What it started in its group must not outlive the fleet's stop either
                    # (the group's id stays reserved while any member is left).
                    _killpg(proc.pid, signal.SIGKILL)
                code = exit_code(returncode)
                duration_s = round(self.clock() - started, 3)
                result = RunResult(
                    spec.name, proc.pid, code, duration_s, outcome(code, stopped=entry.stopped)
                )
            self._record(result, log, None if problem is None else problem[1])
            return result
        finally:
            if log is not None:
                log.close()
            self.wakeup.poke()

    def _start(
        self, spec: JobSpec, to_terminal: bool
    ) -> tuple[IO[bytes] | None, subprocess.Popen[bytes] | None, tuple[int, str] | None]:
        """Open the log and start the command (lock held): (log, process, (exit, problem))."""
        log = None
        if not to_terminal:
            try:
                log = _open_log(spec.log_path, self.settings.file_mode)
            except OSError as exc:
                return None, None, (EX_ERROR, f"cannot open {spec.log_path}: {_why(exc)}")
            log.write(f"=== {_stamp()} {spec.name}: {_shell_words(spec.command)}\n".encode())
            log.flush()
        try:
            proc = subprocess.Popen(
                list(spec.command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT if log is not None else None,
                env=dict(spec.env),
                # Its own session: the terminal's Ctrl-C reaches the fleet only, and the fleet
                # ends the run and whatever it started with one killpg.
                start_new_session=True,
            )
        except OSError as exc:
            code = EX_NOTFOUND if isinstance(exc, FileNotFoundError) else EX_NOEXEC
            return log, None, (code, f"cannot start {spec.command[0]}: {_why(exc)}")
        self._running[proc.pid] = _Running(proc)
        return log, proc, None

    def _record(self, r: RunResult, log: IO[bytes] | None, problem: str | None) -> None:
        fields: dict[str, Any] = {"error": problem} if problem else {}
        self.settings.emit(
            "fleet-run",
            agent=r.agent,
            pid=r.pid,
            exit=r.exit,
            duration_s=r.duration_s,
            outcome=r.outcome,
            **fields,
        )
        line = f"{r.agent}: {r.outcome} (exit {r.exit}, {format_duration(r.duration_s)}"
        line += f", pid {r.pid})" if r.pid is not None else f": {problem})"
        if log is not None:
            log.write(f"=== {_stamp()} {line}\n".encode())
        self.say(line, prefix="")

    # -- stopping --

    def running(self) -> list[int]:
        with self._lock:
            return list(self._running)

    def drain(self, grace_s: float) -> int:
        """Start nothing more; give running runs ``grace_s``, then SIGTERM, then SIGKILL.

        Returns how many runs had to be signalled.  Called from the main thread only.
        """
        with self._lock:
            self._stopping = True
        if not self._wait_idle(grace_s, cut_by_signal=True):
            return 0
        signalled = self._signal_all(signal.SIGTERM)
        if self._wait_idle(TERM_WAIT_S):
            self._signal_all(signal.SIGKILL)
            self._wait_idle(REAP_WAIT_S)
        return signalled

    def _wait_idle(self, timeout_s: float, *, cut_by_signal: bool = False) -> bool:
        """Wait until no run is left (False) or ``timeout_s`` passes (True: some are left)."""
        deadline = self.clock() + timeout_s
        while self.running():
            left = deadline - self.clock()
            if left <= 0:
                return True
            if self.wakeup.wait(left) is not None and cut_by_signal:
                self.say("second stop signal: not waiting for the grace")
                return True
        return False

    def _signal_all(self, sig: signal.Signals) -> int:
        with self._lock:
            entries = list(self._running.values())
            for e in entries:
                e.stopped = True
                # poll() is None while the run is unreaped, so its pid (= its process group)
                # still names it; Popen's wait lock makes the window after reaping microseconds.
                if e.proc.poll() is None:
                    _killpg(e.proc.pid, sig)
        if entries:
            self.say(f"{sig.name} to {len(entries)} run(s): pids {[e.proc.pid for e in entries]}")
        return len(entries)

    def say(self, text: str, *, prefix: str = "fleet: ") -> None:
        """One stamped line on ``out`` (the journal, when run as a service)."""
        with self._lock:
            self.out.write(f"{_stamp()} {prefix}{text}\n")
            self.out.flush()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _open_log(path: Path, mode: int) -> IO[bytes]:
    """``path`` opened for appending (so a run's output follows the last), rotated by size."""
    try:
        if path.stat().st_size > LOG_MAX_BYTES:
            os.replace(path, path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, mode)
    return os.fdopen(fd, "ab")


# --- APScheduler (imported here only) ----------------------------------------------------------


def _require_apscheduler() -> None:
    try:
        import apscheduler
    except ImportError:
        raise GpulockError(
            "the fleet runner needs APScheduler 3, which is not installed", hint=INSTALL_HINT
        ) from None
    version = str(getattr(apscheduler, "__version__", "3"))
    if not version.startswith("3."):
        raise GpulockError(
            f"the fleet runner needs APScheduler 3.x, found {version}",
            hint="pip install 'apscheduler>=3.10,<4'",
        )


def make_trigger(spec: JobSpec, *, jitter: bool = True) -> Any:
    """The APScheduler trigger of ``spec`` (its jitter left out with ``jitter=False``)."""
    from apscheduler.triggers.combining import OrTrigger
    from apscheduler.triggers.cron import CronTrigger
    from apscheduler.triggers.interval import IntervalTrigger

    j = spec.jitter_s if jitter and spec.jitter_s > 0 else None
    t = spec.trigger
    if t.every_s is not None:
        return IntervalTrigger(seconds=t.every_s, jitter=j)
    if len(t.cron) == 1:
        return CronTrigger(**t.cron[0].kwargs(), jitter=j)
    return OrTrigger([CronTrigger(**f.kwargs()) for f in t.cron], jitter=j)


def next_fires(trigger: Any, now: datetime, n: int = DRY_RUN_FIRES) -> list[datetime]:
    """The next ``n`` fire times of ``trigger`` after ``now`` (an aware datetime)."""
    out: list[datetime] = []
    previous = None
    while len(out) < n:
        fire = trigger.get_next_fire_time(previous, previous or now)
        if fire is None:
            break
        out.append(fire)
        previous = fire
    return out


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


# --- the modes ---------------------------------------------------------------------------------


def _claim(settings: Settings, fleet: FleetFile) -> int:
    """Hold a lock for this fleet file (until exit), so two fleets never run its agents twice."""
    from gpulock import state

    folder = state.ensure_subdir(settings.state_dir, "fleet", group=settings.group)
    digest = hashlib.sha256(str(fleet.path.absolute()).encode()).hexdigest()[:12]
    path = folder / f".fleet-{digest}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, settings.file_mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise GpulockError(
            f"a fleet already runs {fleet.path} (pid {holder})",
            hint=f"stop it first (kill {holder}), or run another fleet file",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _make_dirs(jobs: Sequence[JobSpec], settings: Settings) -> None:
    from gpulock import state

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


def run_once(settings: Settings, fleet: FleetFile, spec: JobSpec) -> int:
    """Run one agent now, its output on this terminal; exit with its code."""
    wakeup = Wakeup()
    runner = Runner(settings, wakeup, out=sys.stderr)
    result: list[RunResult | None] = []

    def target() -> None:
        try:
            result.append(runner.run(spec, to_terminal=True))
        finally:
            wakeup.poke()  # after the append: the loop below sees it

    thread = threading.Thread(target=target, name="gpulock-fleet-once")
    wakeup.install()
    try:
        thread.start()
        while not result and thread.is_alive():
            if wakeup.wait(None) is not None:
                runner.say(f"stopping {spec.name}: waiting up to {fleet.options.grace_s:g} s")
                runner.drain(fleet.options.grace_s)
                break
        thread.join()
    finally:
        runner.drain(0.0)
        wakeup.close()
    done = result[0] if result else None
    return done.exit if done is not None else EX_ERROR


def dry_run(fleet: FleetFile, jobs: Sequence[JobSpec], state_dir: Path, *, as_json: bool) -> int:
    """Print each agent's next run times (before jitter) and command; start nothing."""
    now = datetime.now().astimezone()  # aware, local: triggers convert it to their zone
    fires = {
        spec.name: next_fires(make_trigger(spec, jitter=False), now) if spec.enabled else []
        for spec in jobs
    }
    if as_json:
        rows = [
            {
                "name": spec.name,
                "enabled": spec.enabled,
                "trigger": spec.trigger.text,
                "jitter_s": spec.jitter_s,
                "next_runs": [f.isoformat() for f in fires[spec.name]],
                "command": list(spec.command),
                "log": str(spec.log_path),
            }
            for spec in jobs
        ]
        doc = {"file": str(fleet.path), "state_dir": str(state_dir), "agents": rows}
        print(json.dumps(doc, indent=2))
        return EX_OK
    print(f"{fleet.path}: {len(jobs)} agent(s), state {state_dir} (dry run: nothing runs)")
    for spec in jobs:
        print(f"\n{spec.name}  {spec.trigger.text}" + ("" if spec.enabled else "  (disabled)"))
        if spec.enabled:
            stamps = ", ".join(f.strftime("%a %Y-%m-%d %H:%M:%S") for f in fires[spec.name])
            jitter = f", each + up to {spec.jitter_s:g} s jitter" if spec.jitter_s else ""
            print(f"  next:    {stamps}{jitter}")
        print(f"  command: {_shell_words(spec.command)}")
        print(f"  log:     {spec.log_path}")
    return EX_OK


def _shell_words(argv: Sequence[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in argv)


# --- the command -------------------------------------------------------------------------------


def _duration_arg(text: str) -> float:
    try:
        seconds = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"expected a duration above 0, got {text!r}")
    return seconds


def build_parser(prog: str = "gpulock fleet") -> argparse.ArgumentParser:
    p = Parser(
        prog=prog,
        description=(
            "Run the agents of FLEET.yaml on their schedules (APScheduler), each run its own "
            "process: one at a time per agent, at most fleet.max_parallel at once, late fires "
            "coalesced.  On SIGTERM/SIGINT it starts nothing more, gives running agents "
            "fleet.grace, then SIGTERM, then SIGKILL."
        ),
        epilog=EPILOG,
    )
    p.add_argument("fleet_file", metavar="FLEET.yaml", help="the fleet file")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--dry-run",
        action="store_true",
        help="print each agent's next 3 run times and command; run nothing",
    )
    mode.add_argument("--once", metavar="NAME", help="run agent NAME now, exit with its code")
    mode.add_argument(
        "--for",
        dest="for_s",
        type=_duration_arg,
        metavar="DURATION",
        help="run for this long (30s, 2h), then stop as on SIGTERM",
    )
    p.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    p.add_argument("--config", metavar="FILE", help="gpulock config file (default: the usual)")
    p.add_argument(
        "--state-dir", metavar="DIR", help="state folder (default: $GPULOCK_STATE_DIR, config)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(args_list)
    except (UsageError, GpulockError) as e:
        return report(e)
    except KeyboardInterrupt:  # Ctrl-C before the handlers were set (reading the files)
        return 128 + signal.SIGINT


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.json and not args.dry_run:
        raise UsageError("--json goes with --dry-run", hint="gpulock fleet FILE --dry-run --json")
    _require_apscheduler()
    fleet = fleetfile.read(args.fleet_file)
    fleetfile.check_schedules(fleet)
    if args.dry_run:
        from gpulock import state
        from gpulock.config import load_config

        if args.state_dir:
            state_dir = Path(args.state_dir).expanduser().absolute()
        else:
            state_dir = state.resolve_state_dir(load_config(args.config))
        jobs = fleetfile.plan(fleet, state_dir=state_dir, environ=os.environ, python=sys.executable)
        return dry_run(fleet, jobs, state_dir, as_json=args.json)
    if args.once is not None and fleet.agent(args.once) is None:
        raise UsageError(
            f"no agent {args.once!r} in {fleet.path}",
            hint="agents: " + ", ".join(a.name for a in fleet.agents),
        )
    from gpulock.settings import load

    settings = load(args.config, args.state_dir)
    jobs = fleetfile.plan(
        fleet, state_dir=settings.state_dir, environ=os.environ, python=sys.executable
    )
    if args.once is not None:
        return run_once(settings, fleet, next(j for j in jobs if j.name == args.once))
    return serve(settings, fleet, jobs, for_s=args.for_s)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
