"""Running one agent the cron-safe way: one instance, bounded waits, checkpoints, a JSON log.

``run_agent(spec, ...)`` is what ``python -m gpulock.agents run NAME`` (and ``gpulock agent run``)
does:

1. takes ``<state>/agents/<name>/run.lock`` with a non-blocking ``flock``: while a run of the
   agent is alive, another start logs a skip and returns 75 (the kernel drops the lock when the
   run dies, however it dies, so a crash never wedges the agent);
2. calls the agent with a ``Context`` (``gpulock.agents.context``) and ``$GPULOCK_AGENT`` set to its
   name (the router's accounting); the agent's waits (``ctx.gpu()``, ``ctx.model()``) are
   bounded by the timeout, and one that runs out (``gpulock.LockTimeout``,
   ``gpulock.AdmissionRefused``, ``router.NoModelAvailable``) is a skip (75), not an error:
   cron tries again at the next run and nothing piles up;
3. SIGTERM and SIGINT unwind the agent like Ctrl-C (``finally`` blocks run, the GPU is released,
   the checkpoint stays) and the run returns 128 + the signal number;
4. writes a ``start`` and an ``end`` record to ``<state>/agents/<name>/log.jsonl`` and one
   ``agent`` event to the shared ``events.jsonl``.

Exit codes: 0 done; 1 the agent raised (the traceback is in the log, stderr gets one ``error:``
line); 75 skipped (already running, the GPU or a model could not be had in time, or the agent
raised ``SystemExit(75)`` itself); 128+N stopped by signal N.  A skip prints nothing unless
stderr is a terminal: cron mails any output.

Log records (``gpulock.agents.logs``) are JSON lines: ``ts``, ``agent``, ``pid``, ``level``, ``msg``
and the fields given in ``extra=``; the ``end`` record (``"event": "end"``) adds ``outcome``
(ok, skip, error, killed), ``reason``, ``duration_s`` and ``exit_code``.  The file is rotated
to ``log.jsonl.1`` past 1 MiB.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Final, TextIO

# Context and the JSON log live in their own modules; their names stay importable from here,
# where agents and tests have always found them.
from gpulock.agents.context import AGENTS_DIR as AGENTS_DIR
from gpulock.agents.context import Context as Context
from gpulock.agents.context import agent_dir as agent_dir
from gpulock.agents.logs import LOG_MAX_BYTES as LOG_MAX_BYTES
from gpulock.agents.logs import LOG_NAME as LOG_NAME
from gpulock.agents.logs import JsonLineHandler as JsonLineHandler
from gpulock.agents.logs import RunLogger as RunLogger
from gpulock.agents.logs import append_line as append_line
from gpulock.agents.logs import open_run_log
from gpulock.agents.spec import AgentSpec
from gpulock.core import children
from gpulock.core.errors import GpulockError, StateDirError
from gpulock.core.settings import Settings, load
from gpulock.core.statefile import read_small, take_instance_lock
from gpulock.core.units import format_duration

__all__ = ["EX_ERROR", "EX_OK", "EX_SKIP", "Context", "Stopped", "agent_dir", "run_agent"]

EX_OK, EX_ERROR, EX_SKIP = 0, 1, 75
LOCK_NAME: Final = "run.lock"
# Whose model calls these are, for the router's accounting (gpulock.router.select reads it): set for
# the run, so that an agent calling router.get_model() itself, or a program it starts, is
# counted under the agent's name rather than "python".
AGENT_ENV: Final = "GPULOCK_AGENT"
# Set by the leader of a pooled agent (@agent(workers=...)) for its workers: the agent's name.
POOL_ENV: Final = "GPULOCK_AGENT_POOL"

# Errors that mean "not now" rather than "broken", by (package, class name): matched by name
# so that catching them does not import the router (or gpulock's resident machinery).
SKIP_ERRORS: Final = frozenset(
    {
        ("gpulock", "LockTimeout"),
        ("gpulock", "AdmissionRefused"),
        ("gpulock.router", "NoModelAvailable"),
    }
)


def skip_reason(exc: BaseException) -> str | None:
    """Why ``exc`` makes the run a skip (its message), or None when it is a real failure."""
    for cls in type(exc).__mro__:
        for package, name in SKIP_ERRORS:
            module = cls.__module__
            if cls.__name__ == name and (module == package or module.startswith(package + ".")):
                return str(exc) or cls.__name__
    return None


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT reached a run: the agent unwinds as from Ctrl-C.

    A KeyboardInterrupt, so that an agent's ``except Exception`` does not swallow it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Signals:
    """SIGTERM/SIGINT raise Stopped in the main thread until the run's own wrap-up starts."""

    def __init__(self) -> None:
        self.finishing = False
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        if self.finishing:
            return  # the end record is being written; we exit in a moment anyway
        raise Stopped(signum)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; the caller's handlers apply
        for s in (signal.SIGTERM, signal.SIGINT):
            self._previous[s] = signal.signal(s, self._handler)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


def classify(exc: BaseException | None) -> tuple[str, str | None, int]:
    """How a run ended: (outcome, reason, exit code), from what the agent raised."""
    if exc is None:
        return "ok", None, EX_OK
    if isinstance(exc, Stopped):
        return "killed", signal.Signals(exc.signum).name, 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return "killed", "SIGINT", 128 + signal.SIGINT
    if isinstance(exc, SystemExit):
        if exc.code is None or exc.code == 0:
            return "ok", None, EX_OK
        code = exc.code if isinstance(exc.code, int) else EX_ERROR
        if code == EX_SKIP:  # the agent's own "try again later": as quiet as any other skip
            return "skip", f"the agent exited {EX_SKIP}", EX_SKIP
        return "error", f"exit {exc.code}", code
    reason = skip_reason(exc)
    if reason is not None:
        return "skip", reason, EX_SKIP
    if isinstance(exc, GpulockError):  # written for people already: no class name needed
        return "error", str(exc), EX_ERROR
    return "error", f"{type(exc).__name__}: {exc}", EX_ERROR


_END_LEVEL: Final = {
    "ok": logging.INFO,
    "skip": logging.WARNING,
    "error": logging.ERROR,
    "killed": logging.WARNING,
}


def run_agent(
    spec: AgentSpec,
    *,
    args: Sequence[str] = (),
    out: Path | None = None,
    timeout_s: float | None = None,
    settings: Settings | None = None,
    stderr: TextIO | None = None,
    verbose: bool = False,
) -> int:
    """Run one agent once (see the module docstring); return the exit code.

    ``timeout_s`` overrides the agent's ``timeout``.  Call it from the main thread for
    SIGTERM/SIGINT to stop the agent cleanly.
    """
    settings = settings if settings is not None else load()
    err = stderr if stderr is not None else sys.stderr
    limit_s = spec.timeout_s if timeout_s is None else timeout_s
    folder = agent_dir(settings, spec.name)
    log, handlers = open_run_log(spec.name, folder, settings.file_mode, verbose, err)
    started = time.monotonic()
    signals = _Signals()
    lock_fd: int | None = None
    worker = pool_worker(spec)
    ctx: Context | None = None
    failure: BaseException | None = None
    outcome: tuple[str, str | None, int]
    try:
        try:
            signals.install()
            log.info(
                "start",
                extra={
                    "event": "start",
                    "inputs": list(args),
                    "out": None if out is None else str(out),
                    "timeout_s": limit_s,
                },
            )
            lock_fd = (
                None
                if worker is not None  # the pool's leader holds the run lock for its workers
                else take_instance_lock(
                    folder / LOCK_NAME,
                    settings.file_mode,
                    f"{os.getpid()}\n".encode(),  # for the skip's "already running (pid N)"
                    what="the run lock",
                )
            )
            if lock_fd is None and worker is None:
                pid = _holder_pid(folder / LOCK_NAME)
                outcome = ("skip", f"already running (pid {pid or '?'})", EX_SKIP)
            else:
                ctx = Context(
                    spec,
                    settings=settings,
                    args=args,
                    out=out,
                    timeout_s=limit_s,
                    log=log,
                    stderr=err,
                    pool_worker=worker,
                )
                previous_agent = os.environ.get(AGENT_ENV)
                os.environ[AGENT_ENV] = spec.name
                try:
                    if spec.workers is not None and worker is None:
                        _lead_pool(spec, ctx, limit_s)
                    else:
                        spec.func(ctx)
                except BaseException as e:  # every ending is logged and made an exit code
                    failure = e
                finally:
                    _restore_env(AGENT_ENV, previous_agent)
                outcome = classify(failure)
        except (Stopped, StateDirError) as e:
            # A signal before the agent ran, or an unusable run lock or agent folder: still one
            # end record, so that `show` does not take the run for one killed without a trace.
            failure = e
            outcome = classify(e)
        signals.finishing = True
        if ctx is not None:
            ctx.close()
        _finish(spec, settings, log, err, outcome, failure, time.monotonic() - started, folder)
    finally:
        signals.restore()
        if lock_fd is not None:
            os.close(lock_fd)  # closing drops the flock: the next run may start
        for h in handlers:
            log.removeHandler(h)
            h.close()
    return outcome[2]


def pool_worker(spec: AgentSpec) -> int | None:
    """This process's index among the workers of ``spec``'s pool, or None (not one of them)."""
    from gpulock.pool import ENV_WORKER  # light: not the supervisor (asyncio)

    index = os.environ.get(ENV_WORKER, "")
    if os.environ.get(POOL_ENV) != spec.name or not index.isdigit():
        return None
    return int(index)


def _lead_pool(spec: AgentSpec, ctx: Context, limit_s: float | None) -> None:
    """Run the agent's batch in ``spec.workers`` processes: this same command line, each a
    worker of a ``gpulock pool`` holding the GPU with the agent's ``need``."""
    from gpulock.agents import poolbatch
    from gpulock.pool import supervisor

    assert spec.need_bytes is not None  # the decorator requires need= with workers=
    settings = ctx.settings
    poolbatch.prepare(ctx.checkpoint_path, spec.name, mode=settings.file_mode)
    most = spec.workers if isinstance(spec.workers, int) else None
    pool = supervisor.PoolSpec(
        command=children.again(),  # the run again, as a worker
        need_bytes=spec.need_bytes,
        max_workers=most or supervisor.max_for(settings, spec.gpu, spec.need_bytes),
        gpu=spec.gpu,
        name=spec.name,
        timeout_s=limit_s,
    )
    previous = os.environ.get(POOL_ENV)
    os.environ[POOL_ENV] = spec.name
    try:
        rc = supervisor.run_pool(settings, pool)
    finally:
        _restore_env(POOL_ENV, previous)
    if rc != 0:  # the pool returns non-zero only when stopped by a signal: 128 + N
        raise Stopped(rc - 128)
    poolbatch.finish(ctx.checkpoint_path)


def _finish(
    spec: AgentSpec,
    settings: Settings,
    log: logging.Logger,
    err: TextIO,
    outcome: tuple[str, str | None, int],
    failure: BaseException | None,
    duration_s: float,
    folder: Path,
) -> None:
    kind, reason, code = outcome
    if kind == "ok":
        text = f"done in {format_duration(duration_s)}"
    elif kind == "killed":
        text = f"killed by {reason}"
    else:
        text = f"{'skipped' if kind == 'skip' else 'failed'}: {reason}"
    log.log(
        _END_LEVEL[kind],
        text,
        exc_info=failure if kind == "error" else None,
        extra={
            "event": "end",
            "outcome": kind,
            "reason": reason,
            "duration_s": round(duration_s, 6),
            "exit_code": code,
        },
    )
    settings.emit(
        "agent",
        agent=spec.name,
        outcome=kind,
        reason=reason,
        duration_s=round(duration_s, 6),
        pid=os.getpid(),
        exit_code=code,
    )
    if kind == "error":
        _say(err, "error", f"agent {spec.name!r} failed: {reason}")
        hint = getattr(failure, "hint", None)
        _say(err, "hint", hint if isinstance(hint, str) else f"traceback in {folder / LOG_NAME}")
    elif kind != "ok" and _is_tty(err):  # a skip or a stop: only a person at a terminal is told
        _say(err, spec.name, text)


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _say(err: TextIO, kind: str, text: str) -> None:
    try:
        print(f"{kind}: {text}", file=err, flush=True)
    except (OSError, ValueError):
        pass


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _holder_pid(path: Path) -> int | None:
    try:
        text = (read_small(path, 64) or b"").decode().strip()
    except Exception:  # gone, a symlink, garbage: the skip's message just lacks the pid
        return None
    return int(text) if text.isdigit() else None
