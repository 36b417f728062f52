"""An agent run's JSON log: ``<state>/agents/<name>/log.jsonl``, one JSON line per record.

Records carry ``ts``, ``agent``, ``pid``, ``level``, ``msg`` and the fields given in ``extra=``
(any key, ``name`` included: ``RunLogger``), and ``exc`` with the traceback of a failure.  Each
line is one ``write()`` on ``O_APPEND``; the file is rotated to ``log.jsonl.1`` past 1 MiB.
Writing never raises: a full disk must not turn a good run into a failed one.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, TextIO

from gpulock.core import logfile
from gpulock.core.errors import GpulockError

LOG_NAME: Final = "log.jsonl"
LOG_MAX_BYTES: Final = 1024 * 1024

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
    """Append ``data`` with one write; past ``max_bytes``, rotate the file to ``<path>.1``.

    ``gpulock.core.logfile`` does it, as for the event log: a symlink, a folder or a FIFO in the
    log's or its rotation lock's place raises StateDirError instead of being followed or
    hanging the run; a new log gets exactly ``mode``, 0o660 included.
    """
    logfile.append(path, data, mode=mode, max_bytes=max_bytes, lock_name=".log.lock")


class _EchoFormatter(logging.Formatter):
    """The ``-v`` echo: a user's mistake (a GpulockError: no input, ``--out`` naming a file)
    is its message, as without ``-v``; only a bug in an agent shows its traceback.  The log
    file keeps every traceback."""

    def format(self, record: logging.LogRecord) -> str:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, GpulockError):
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return super().format(record)


def open_run_log(
    name: str, folder: Path, mode: int, verbose: bool, stderr: TextIO
) -> tuple[logging.Logger, list[logging.Handler]]:
    """A fresh logger for one run of ``name``, writing to ``folder/log.jsonl`` (and ``stderr``
    when ``verbose``); the caller removes and closes the handlers when the run ends."""
    log = RunLogger(f"gpulock.agents.run.{name}")  # not in logging's registry: one per run
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False  # the root logger's handlers would print under cron
    handlers: list[logging.Handler] = [JsonLineHandler(folder / LOG_NAME, name, mode=mode)]
    if verbose:
        echo = logging.StreamHandler(stderr)
        echo.setFormatter(_EchoFormatter(f"{name}: %(levelname)s: %(message)s"))
        handlers.append(echo)
    for h in handlers:
        log.addHandler(h)
    return log, handlers
