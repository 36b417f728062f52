"""Running one agent the cron-safe way: one instance, bounded waits, checkpoints, a JSON log.

``run_agent(spec, ...)`` is what ``python -m agents run NAME`` (and ``gpulock agent run``) does:

1. takes ``<state>/agents/<name>/run.lock`` with a non-blocking ``flock``: while a run of the
   agent is alive, another start logs a skip and returns 75 (the kernel drops the lock when the
   run dies, however it dies, so a crash never wedges the agent);
2. calls the agent with a ``Context``; the agent's waits (``ctx.gpu()``, ``ctx.model()``) are
   bounded by the timeout, and one that runs out (``gpulock.LockTimeout``,
   ``gpulock.AdmissionRefused``, ``router.NoModelAvailable``) is a skip (75), not an error:
   cron tries again at the next run and nothing piles up;
3. SIGTERM and SIGINT unwind the agent like Ctrl-C (``finally`` blocks run, the GPU is released,
   the checkpoint stays) and the run returns 128 + the signal number;
4. writes a ``start`` and an ``end`` record to ``<state>/agents/<name>/log.jsonl`` and one
   ``agent`` event to the shared ``events.jsonl``.

Exit codes: 0 done; 1 the agent raised (the traceback is in the log, stderr gets one ``error:``
line); 75 skipped (already running, or the GPU or a model could not be had in time); 128+N
stopped by signal N.  A skip prints nothing unless stderr is a terminal: cron mails any output.

Log records are JSON lines: ``ts``, ``agent``, ``pid``, ``level``, ``msg`` and the fields given
in ``extra=``; the ``end`` record (``"event": "end"``) adds ``outcome`` (ok, skip, error,
killed), ``reason``, ``duration_s`` and ``exit_code``.  The file is rotated to ``log.jsonl.1``
past 1 MiB.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Final, TextIO, TypeVar

from agents import checkpoint
from agents.progress import ProgressBar, wanted
from agents.spec import AgentError, AgentSpec
from gpulock.errors import GpulockError, StateDirError
from gpulock.lock import Lease, acquire
from gpulock.settings import Settings, load
from gpulock.state import ensure_subdir, read_small
from gpulock.units import format_duration

if TYPE_CHECKING:
    from router.model import Model

__all__ = ["EX_ERROR", "EX_OK", "EX_SKIP", "Context", "Stopped", "agent_dir", "run_agent"]

T = TypeVar("T")

EX_OK, EX_ERROR, EX_SKIP = 0, 1, 75
AGENTS_DIR: Final = "agents"
LOCK_NAME: Final = "run.lock"
LOG_NAME: Final = "log.jsonl"
LOG_MAX_BYTES: Final = 1024 * 1024

# Errors that mean "not now" rather than "broken", by (top package, class name): matched by
# name so that catching them does not import the router (or gpulock's resident machinery).
SKIP_ERRORS: Final = frozenset(
    {("gpulock", "LockTimeout"), ("gpulock", "AdmissionRefused"), ("router", "NoModelAvailable")}
)


def agent_dir(settings: Settings, name: str) -> Path:
    """``<state>/agents/<name>/``, created like the state folder (0700, or 2770 shared)."""
    base = ensure_subdir(settings.state_dir, AGENTS_DIR, group=settings.group)
    return ensure_subdir(base, name, group=settings.group)


def skip_reason(exc: BaseException) -> str | None:
    """Why ``exc`` makes the run a skip (its message), or None when it is a real failure."""
    for cls in type(exc).__mro__:
        if (cls.__module__.partition(".")[0], cls.__name__) in SKIP_ERRORS:
            return str(exc) or cls.__name__
    return None


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT reached a run: the agent unwinds as from Ctrl-C.

    A KeyboardInterrupt, so that an agent's ``except Exception`` does not swallow it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# --- the JSON log ----------------------------------------------------------------------------

# Attributes every LogRecord has: anything else on a record came from ``extra=``.
_RECORD_ATTRS: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "extra_fields",
}


class RunLogger(logging.Logger):
    """A Logger whose ``extra=`` may use any key, ``name`` and ``args`` included.

    A plain Logger refuses keys that clash with LogRecord's own attributes (KeyError); an
    agent writing ``extra={"name": model.name}`` should get a log line, not a failed run.  The
    fields ride on the record as ``extra_fields``.
    """

    def makeRecord(  # logging names it so
        self,
        name: str,
        level: int,
        fn: str,
        lno: int,
        msg: object,
        args: Any,
        exc_info: Any,
        func: str | None = None,
        extra: Mapping[str, object] | None = None,
        sinfo: str | None = None,
    ) -> logging.LogRecord:
        record = super().makeRecord(name, level, fn, lno, msg, args, exc_info, func, None, sinfo)
        record.extra_fields = dict(extra or {})
        return record


class JsonLineHandler(logging.Handler):
    """Appends each record as one JSON line (one ``write()`` on ``O_APPEND``), rotated by size.

    Never raises: a full disk must not turn a good run into a failed one.
    """

    def __init__(
        self, path: Path, agent: str, *, mode: int = 0o600, max_bytes: int = LOG_MAX_BYTES
    ) -> None:
        super().__init__()
        self.path = path
        self.agent = agent
        self.mode = mode
        self.max_bytes = max_bytes

    def line(self, record: logging.LogRecord) -> bytes:
        data: dict[str, Any] = {
            "ts": round(record.created, 6),
            "agent": self.agent,
            "pid": record.process or os.getpid(),
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
        }
        extra = dict(getattr(record, "extra_fields", None) or {})
        extra.update((k, v) for k, v in vars(record).items() if k not in _RECORD_ATTRS)
        for key, value in extra.items():
            data.setdefault(str(key), value)  # ts, agent, pid, level and msg are the runtime's
        if record.exc_info and record.exc_info[1] is not None:
            data["exc"] = "".join(traceback.format_exception(record.exc_info[1])).rstrip()
        return (json.dumps(data, default=str, separators=(",", ":")) + "\n").encode()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            append_line(self.path, self.line(record), mode=self.mode, max_bytes=self.max_bytes)
        except Exception:
            pass  # see the class docstring


def append_line(path: Path, data: bytes, *, mode: int, max_bytes: int) -> None:
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, mode)
    try:
        os.write(fd, data)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size <= max_bytes:
        return
    # Under a short flock, so that two runs (a run and a skip) never rotate at once.
    lfd = os.open(path.with_name(".log.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
    try:
        fcntl.flock(lfd, fcntl.LOCK_EX)
        if os.stat(path).st_size > max_bytes:
            os.replace(path, path.with_name(path.name + ".1"))
    finally:
        os.close(lfd)


def _logger(
    name: str, folder: Path, mode: int, verbose: bool, stderr: TextIO
) -> tuple[logging.Logger, list[logging.Handler]]:
    log = RunLogger(f"agents.run.{name}")  # not in logging's registry: one per run
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False  # the root logger's handlers would print under cron
    handlers: list[logging.Handler] = [JsonLineHandler(folder / LOG_NAME, name, mode=mode)]
    if verbose:
        echo = logging.StreamHandler(stderr)
        echo.setFormatter(logging.Formatter(f"{name}: %(levelname)s: %(message)s"))
        handlers.append(echo)
    for h in handlers:
        log.addHandler(h)
    return log, handlers


# --- the context -----------------------------------------------------------------------------


class Context:
    """What an agent's function gets: its inputs, log, clock, GPU, models and batches.

    ``inputs`` are the positional arguments after NAME as paths, ``args`` the same as text;
    ``out`` is ``--out``.  ``remaining_s()`` is what is left of the timeout, which bounds every
    wait the runtime does for the agent.
    """

    def __init__(
        self,
        spec: AgentSpec,
        *,
        settings: Settings,
        args: Sequence[str] = (),
        out: Path | None = None,
        timeout_s: float | None = None,
        log: logging.Logger | None = None,
        stderr: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.task = spec.task
        self.args = list(args)
        self.inputs = [Path(a) for a in self.args]
        self.out = out
        self.settings = settings
        self.state_dir = settings.state_dir
        self.agent_dir = agent_dir(settings, spec.name)
        self.timeout_s = timeout_s
        self.log = log if log is not None else logging.getLogger(f"agents.run.{spec.name}")
        self._stderr = stderr if stderr is not None else sys.stderr
        self._clock = clock
        self._started = clock()
        self._models: dict[tuple[str, str | None], Model] = {}
        self._flush_hooks: list[Callable[[], object]] = []
        self._bars: list[ProgressBar] = []

    @property
    def checkpoint_path(self) -> Path:
        return self.agent_dir / checkpoint.CHECKPOINT_NAME

    def remaining_s(self) -> float | None:
        """Seconds left of the timeout (never below 0); None when there is no timeout."""
        if self.timeout_s is None:
            return None
        return max(0.0, self.timeout_s - (self._clock() - self._started))

    def model(self, task: str | None = None, *, prefer: str | None = None) -> Model:
        """The router's Model for ``task`` (default: the agent's), loaded once per run.

        Waits at most ``remaining_s()``; ``router.NoModelAvailable`` then makes the run a skip.
        ``flush()`` unloads every model handed out here; the next call reloads it.
        """
        chosen = task or self.task
        if not chosen:
            raise AgentError(
                f"agent {self.name!r} has no task, so ctx.model() cannot choose a model",
                hint="declare one, @agent(..., task='summarize'), or ask ctx.model('summarize')",
            )
        key = (chosen, prefer)
        found = self._models.get(key)
        if found is not None:
            return found
        from router import get_model  # here: most cron runs that import agents need no model

        model = get_model(
            chosen,
            deadline=self.remaining_s(),
            prefer=prefer,
            agent=self.name,
            config=self.settings.config,  # the run's --config and --state-dir, not the lookup
            state_dir=str(self.settings.state_dir),
        )
        self._models[key] = model
        self.on_flush(model.unload)
        return model

    def gpu(self, need: int | str | None = None) -> Lease:
        """Wait (at most ``remaining_s()``) for the agent's GPU; use as ``with ctx.gpu():``.

        ``need`` defaults to the agent's ``need`` (None: the whole GPU).  LockTimeout, when
        the wait runs out, makes the run a skip.
        """
        return acquire(
            gpu=self.spec.gpu,
            need=need if need is not None else self.spec.need_bytes,
            timeout=self.remaining_s(),
            name=self.name,
            config=self.settings.config,
            state_dir=self.settings.state_dir,
        )

    def on_flush(self, hook: Callable[[], object]) -> None:
        """Call ``hook()`` at every ``flush()`` (for things to drop every N items)."""
        self._flush_hooks.append(hook)

    def flush(self) -> None:
        """Unload every model handed out by ``model()`` and call the ``on_flush`` hooks.

        The runtime calls it after every ``flush_every`` items of a batch.
        """
        self.log.debug("flush", extra={"hooks": len(self._flush_hooks)})
        for hook in list(self._flush_hooks):
            hook()

    def batch(self, items: Iterable[T], *, key: Callable[[T], str] | None = None) -> Iterator[T]:
        """Iterate ``items`` with a checkpoint: a run killed half-way resumes where it stopped.

        ``key(item)`` (default ``str(item)``) names an item in the checkpoint.  An item counts
        as done when the loop asks for the next one (or ends normally); items done in an
        earlier run are skipped.  The checkpoint is removed once the loop ends normally.
        One checkpointed batch per run.
        """
        listed = list(items)
        name_of: Callable[[T], str] = key if key is not None else str
        keys = [name_of(item) for item in listed]
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"batch key must be text, got {k!r} from key={key!r}")
        path = self.checkpoint_path
        try:
            resumed = checkpoint.resumed(path, keys)
        except checkpoint.CheckpointError as e:
            self.log.warning(
                f"ignoring checkpoint {path}: {e}; starting the batch over",
                extra={"checkpoint": str(path)},
            )
            resumed = set()
        skipped = sum(1 for k in keys if k in resumed)
        if skipped:
            self.log.info(
                f"resuming: {skipped} of {len(listed)} done",
                extra={"done": skipped, "total": len(listed)},
            )
        bar = ProgressBar(
            self._stderr, self.name, len(listed), skipped, enabled=wanted(self._stderr)
        )
        self._bars.append(bar)
        every = self.spec.flush_every

        def finished(count: int) -> None:
            bar.update(skipped + count)
            if every and count % every == 0:
                self.flush()

        bar.start()
        return checkpoint.checkpointed(
            listed,
            keys,
            resumed,
            path=path,
            agent=self.name,
            mode=self.settings.file_mode,
            finished=finished,
            ended=bar.close,
        )

    def close(self) -> None:
        """End any progress line (a batch left by an exception leaves its bar open)."""
        for bar in self._bars:
            bar.close()


# --- one run ---------------------------------------------------------------------------------


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
    log, handlers = _logger(spec.name, folder, settings.file_mode, verbose, err)
    started = time.monotonic()
    signals = _Signals()
    lock_fd: int | None = None
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
            lock_fd = _take_run_lock(folder / LOCK_NAME, settings.file_mode)
            if lock_fd is None:
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
                )
                try:
                    spec.func(ctx)
                except BaseException as e:  # every ending is logged and made an exit code
                    failure = e
                outcome = classify(failure)
        except Stopped as e:  # a signal before the agent ran: still one end record
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


def _take_run_lock(path: Path, mode: int) -> int | None:
    """Hold ``path`` with a non-blocking flock and write our pid in it; None when it is busy."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        raise StateDirError(
            str(path), f"cannot open the run lock: {e.strerror or e}", hint="gpulock status"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the skip's "already running (pid N)"
    except OSError:
        pass
    return fd


def _holder_pid(path: Path) -> int | None:
    try:
        text = (read_small(path, 64) or b"").decode().strip()
    except Exception:  # gone, a symlink, garbage: the skip's message just lacks the pid
        return None
    return int(text) if text.isdigit() else None
