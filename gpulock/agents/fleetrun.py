"""One fleet run: its subprocess, its log, its ``fleet-run`` event; and ending runs on a stop.

Every run is a subprocess (no shell, its own session and process group) whose output is
appended to ``<log_dir>/<name>.log`` and whose end is an event in the state folder::

    {"event": "fleet-run", "agent": "digest", "pid": 4711, "exit": 0, "duration_s": 3.2,
     "outcome": "ok"}          # ok (0) | skip (75) | error | killed (signal, or the fleet's stop)
                               # not started at all: "pid": null, "exit": 127/126/1, "error": why

Stopping (``Runner.drain``): no new run starts; running ones get ``fleet.grace`` to finish, then
SIGTERM to their process group, ``TERM_WAIT_S`` later SIGKILL.  A second signal cuts the grace
short.  Whatever a stopped run left in its process group is SIGKILLed once the run has exited.
Signals reach the main thread through ``Wakeup``, a self-pipe.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any, Final

from gpulock.agents.fleetplan import JobSpec
from gpulock.core import logfile
from gpulock.core.errors import StateDirError
from gpulock.core.statefile import open_regular
from gpulock.core.units import format_duration

if TYPE_CHECKING:
    from gpulock.core.settings import Settings

__all__ = [
    "EX_ERROR",
    "EX_NOEXEC",
    "EX_NOTFOUND",
    "EX_OK",
    "EX_TEMPFAIL",
    "EX_USAGE",
    "LOG_MAX_BYTES",
    "REAP_WAIT_S",
    "STOP_SIGNALS",
    "TERM_WAIT_S",
    "RunResult",
    "Runner",
    "Wakeup",
    "exit_code",
    "outcome",
    "shell_words",
]

EX_OK, EX_ERROR, EX_USAGE, EX_TEMPFAIL = 0, 1, 2, 75
EX_NOEXEC, EX_NOTFOUND = 126, 127
TERM_WAIT_S: Final = 2.0  # after SIGTERM to a run's process group, before SIGKILL
REAP_WAIT_S: Final = 2.0  # after SIGKILL, for the run's thread to record it
LOG_MAX_BYTES: Final = 10 * 1024 * 1024  # a run's log is rotated (one .1 kept) past this
STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)


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
            except (OSError, StateDirError) as exc:
                return None, None, (EX_ERROR, f"cannot open {spec.log_path}: {_why(exc)}")
            log.write(f"=== {_stamp()} {spec.name}: {shell_words(spec.command)}\n".encode())
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


def _why(exc: OSError | StateDirError) -> str:
    if isinstance(exc, StateDirError):
        return exc.reason
    return exc.strerror or str(exc)


def _stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _open_log(path: Path, mode: int) -> IO[bytes]:
    """``path`` opened for appending (so a run's output follows the last), rotated by size.

    Opened as every state file is (``open_regular``): a symlink, a folder or a FIFO in its
    place is a StateDirError, not followed and not waited on (with the runner's lock held, a
    FIFO would stop the whole fleet, its stop included); a new log gets exactly ``mode``.
    """
    # gpulock.core.logfile rotates it, as it does the event log and the agents' run logs (under
    # a short flock beside it: a run and the runner's next run of that agent never both do).
    try:
        logfile.rotate(path, max_bytes=LOG_MAX_BYTES, mode=mode, lock_name=".log.lock")
    except (OSError, StateDirError):
        pass  # a bad lock file costs the rotation, never the run: the log itself is checked next
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    return os.fdopen(fd, "ab")


def shell_words(argv: Sequence[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in argv)
