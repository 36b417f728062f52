"""One exception tree for the whole project.

::

    GpulockError                      base: every error gpulock raises on purpose
    ├── ConfigError (ValueError)      a config file is malformed: carries file, line, key
    ├── StateDirError                 the state folder is unsafe or unusable
    │   └── NoStateDir                    a reader found no state folder (it never makes one)
    └── LockError
        ├── LockTimeout (TimeoutError)  the GPU could not be had in time
        ├── NeedTooLarge (ValueError)   a need that can never fit the GPU
        ├── NoSuchGpu (ValueError)      a GPU index this machine does not have (exit 2)
        ├── TooFewGpus (ValueError)     more GPUs at once than the set asked for has (exit 2)
        └── NotPermitted (PermissionError)  breaking or killing someone else's ticket

Every error carries its fields as attributes, pickles across processes (``__reduce__`` rebuilds
it from its fields) and may carry a ``hint``: one line that tells the user what to do next.  The
CLI prints ``error: <str(exc)>`` and ``hint: <exc.hint>``; an uncaught one's traceback shows the
hint as a note (``hint: ...`` under the message); the library never exits the process.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class GpulockError(Exception):
    """Base class for errors raised by gpulock on purpose."""

    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if hint is not None:
            self.hint = hint
            # A traceback shows an exception's notes: a library user who does not catch it
            # sees what to do (the known names, the command to run), as a CLI user does.
            self.add_note(f"hint: {hint}")

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.__dict__.copy()))


def _rebuild(cls: type[GpulockError], fields: dict[str, Any]) -> GpulockError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, fields.get("message", ""))
    exc.__dict__.update(fields)
    return exc


class ConfigError(GpulockError, ValueError):
    """A configuration file (or value) is wrong.  ``str()`` reads ``file:line: key: problem``."""

    def __init__(
        self,
        problem: str,
        *,
        file: str | None = None,
        line: int | None = None,
        key: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.problem = problem
        self.file = file
        self.line = line
        self.key = key
        where = ""
        if file is not None:
            where = f"{file}:{line}: " if line is not None else f"{file}: "
        what = f"{key}: " if key else ""
        super().__init__(f"{where}{what}{problem}", hint=hint)


class StateDirError(GpulockError):
    """The state folder cannot be used safely (symlink, world-writable, foreign owner, NFS...)."""

    def __init__(self, path: str, reason: str, *, hint: str | None = None) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"state folder {path}: {reason}", hint=hint)


class NoStateDir(StateDirError):
    """A command that only reads the state folder (``status``, ``history``...) found none: it
    never creates one, so a mistyped ``--state-dir`` is an error, not an empty world."""

    def __init__(self, path: str, *, hint: str | None = None) -> None:
        self.path = path
        self.reason = "does not exist"
        GpulockError.__init__(self, f"state folder {path} does not exist", hint=hint)


class LockError(GpulockError):
    """Something went wrong taking, holding or breaking a GPU lock."""


class LockTimeout(LockError, TimeoutError):
    """The GPU could not be had within ``timeout``; the ticket has left the queue cleanly."""

    def __init__(
        self,
        gpu: int,
        waited_s: float,
        holder_pid: int | None = None,
        holder_name: str | None = None,
        *,
        queue_ahead: int = 0,
        gpus: tuple[int, ...] = (),
        count: int = 1,
    ) -> None:
        self.gpu = gpu
        self.waited_s = waited_s
        self.holder_pid = holder_pid
        self.holder_name = holder_name
        self.queue_ahead = queue_ahead
        self.gpus = tuple(gpus) or (gpu,)  # the set it waited for (a set ticket's)
        self.count = count  # how many of them at once
        held_by = ""
        if holder_pid is not None:
            held_by = f" (held by pid {holder_pid}"
            held_by += f", {holder_name!r})" if holder_name else ")"
        ahead = f", {queue_ahead} ahead in the queue" if queue_ahead else ""
        what = f"gpu{gpu} busy"
        if len(self.gpus) > 1 or count > 1:
            from gpulock.core.units import format_gpus

            many = f"{count} of " if count > 1 else "any of "
            what = f"{many}{format_gpus(self.gpus)} busy"
        super().__init__(f"{what} after {waited_s:.1f} s{held_by}{ahead}", hint="gpulock status")


class NeedTooLarge(LockError, ValueError):
    """A ``need`` larger than the GPU can ever grant (its memory less the reserve)."""

    def __init__(self, gpu: int, need_bytes: int, budget_bytes: int) -> None:
        from gpulock.core.units import format_size

        self.gpu = gpu
        self.need_bytes = need_bytes
        self.budget_bytes = budget_bytes
        super().__init__(
            f"need {format_size(need_bytes)} can never fit gpu{gpu}: "
            f"{format_size(budget_bytes)} is its memory less the reserve",
            hint="ask for less, or lower 'reserve' in the config",
        )


class NoSuchGpu(LockError, ValueError):
    """A GPU index this machine (or its ``simulate:`` GPUs) does not have: a usage error.

    ``known`` are the indices it has, ``source`` where that came from (``simulated`` or
    ``NVIDIA``, as ``devices.known_gpus`` says).  The CLI exits 2 (``exit_code``), as for any
    other bad argument.
    """

    exit_code = 2

    def __init__(self, gpu: int, known: tuple[int, ...], source: str) -> None:
        self.gpu = gpu
        self.known = tuple(known)
        self.source = source
        have = ", ".join(f"gpu{i}" for i in self.known) or "none"
        count = f"{len(self.known)} {source} GPU" + ("" if len(self.known) == 1 else "s")
        super().__init__(
            f"gpu{gpu} does not exist: this machine has {count}: {have}",
            hint=(
                "check --gpu, the config's default_gpu, and simulate: or $GPULOCK_SIMULATE"
                if source == "simulated"
                else "check --gpu and the config's default_gpu; nvidia-smi -L lists the GPUs"
            ),
        )


class TooFewGpus(LockError, ValueError):
    """More GPUs at once (``--gpus N``) than the set asked for has: a usage error (exit 2)."""

    exit_code = 2

    def __init__(self, count: int, gpus: tuple[int, ...], why: str) -> None:
        self.count = count
        self.gpus = tuple(gpus)
        self.why = why
        have = ", ".join(f"gpu{i}" for i in self.gpus) or "none"
        super().__init__(
            f"{count} GPUs at once cannot be had: {why} ({have})",
            hint="ask for fewer with --gpus, or for a larger set with --gpu any or --gpu 0,1,...",
        )


class NotPermitted(LockError, PermissionError):
    """Only a ticket's owner (same uid) or root may break or kill it."""

    def __init__(self, ticket: int, owner_uid: int, action: str = "break") -> None:
        self.ticket = ticket
        self.owner_uid = owner_uid
        self.action = action
        super().__init__(
            f"cannot {action} ticket {ticket}: it belongs to uid {owner_uid}",
            hint="only the ticket's owner or root may do that",
        )


def known_hint(name: object, known: Iterable[str], what: str = "known keys") -> str:
    """The hint for an unknown name, alike everywhere (a config key, a command, a file, a
    policy): ``did you mean 'listen'? known keys: listen, max_queue``, the guess only when one
    is close."""
    import difflib

    names = list(known)
    close = difflib.get_close_matches(str(name), names, n=1)
    guess = f"did you mean {close[0]!r}? " if close else ""
    return f"{guess}{what}: {', '.join(names)}"


def show_value(value: Any) -> str:
    """A value as the user wrote it in YAML, for 'got ...' in error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return repr(value)
