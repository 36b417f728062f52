"""The toolkit every ``gpulock`` command is built with, built-in or a package's.

``run_command(command, argv)`` runs a command as every gpulock command runs: a user's mistake
(``UsageError``, exit 2, or a ``GpulockError``) becomes ``error:``/``hint:`` lines, or one JSON
object on stdout with ``--json`` (``report``), never a traceback.  ``Parser`` is argparse whose
usage errors are ``UsageError``; the ``*_arg`` functions are its ``type=``s for sizes,
durations, GPU indices and sets, each refusing a bad value as a usage error.  ``gpulock.cli``
names all of it, the door the packages above the lock's side use (docs/code-layout.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from gpulock.core.errors import GpulockError, LockTimeout
from gpulock.core.units import parse_duration, parse_size

EX_OK, EX_ERROR, EX_USAGE, EX_TEMPFAIL = 0, 1, 2, 75
EX_NOEXEC, EX_NOTFOUND = 126, 127


class UsageError(Exception):
    """A mistake in how the command was called (exit 2)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors become UsageError (exit 2, no traceback)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, hint=f"{self.prog} --help")

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # argparse drops a '--' given as an option's value ('--lease=--') and hands the option
        # an empty list, past its type= check: refuse it here as the usage error it is.
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            self.error(f"argument {'/'.join(action.option_strings)}: expected one argument")
        return super()._get_values(action, arg_strings)


def size_arg(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a size above 0, got {text!r}")
    return n


def duration_arg(text: str) -> float:
    """An argparse ``type=`` for durations (``30s``, ``5m``): a bad one is a usage error."""
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def index_arg(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a GPU index like 0 or 1, got {text!r}")
    return int(text)


def gpu_set_arg(text: str) -> int | str | tuple[int, ...]:
    """``--gpu``: an index, a set (``0,2``) or ``any``."""
    from gpulock.core.units import parse_gpus

    try:
        return parse_gpus(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None  # parse_gpus names the value


def common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="config file (default: the usual lookup)")
    p.add_argument(
        "--state-dir", metavar="DIR", help="state folder (default: $GPULOCK_STATE_DIR, config)"
    )


def report(e: UsageError | GpulockError, *, as_json: bool = False) -> int:
    """Print ``error:`` (and ``hint:``) for a user's mistake; return its exit code.

    With ``as_json`` (the command line asked for ``--json``) the error is one JSON object on
    stdout instead, so a script reading the output gets JSON whatever happened::

        {"error": {"message": "...", "hint": "..." | null, "type": "UnknownTask",
                   "exit_code": 2}}

    Shared by the commands that packages add (``gpulock governor``...), so every command
    speaks and exits alike.
    """
    if isinstance(e, UsageError):
        code = EX_USAGE
    elif isinstance(e, LockTimeout):
        code = EX_TEMPFAIL
    else:
        code = getattr(e, "exit_code", EX_ERROR)  # RunError: 126/127, like a shell
    if as_json:
        print_json(
            {
                "error": {
                    "message": str(e),
                    "hint": e.hint,
                    "type": type(e).__name__,
                    "exit_code": code,
                }
            }
        )
        return code
    _say("error", str(e))
    if e.hint:
        _say("hint", e.hint)
    return code


def wants_json(argv: Sequence[str]) -> bool:
    """Whether a command line asks for JSON: ``--json`` before any ``--`` (what follows it is
    a command's own arguments, as in ``gpulock run -- tool --json``)."""
    args = list(argv)
    ours = args[: args.index("--")] if "--" in args else args
    return "--json" in ours


def print_json(doc: Any) -> None:
    """One JSON document on stdout (values JSON cannot hold are written as text)."""
    print(json.dumps(doc, indent=2, default=str), flush=True)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While it lasts, what this process and its children write to stdout goes to stderr, so
    that a ``--json`` command's stdout carries its JSON document alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_command(command: Callable[[list[str]], int], argv: Sequence[str] | None = None) -> int:
    """Run one command's ``command(argv)`` as every gpulock command runs: the exit code it
    returns; a user's mistake as ``error:``/``hint:`` lines (a JSON object with ``--json``) and
    its exit code (``report``);
    Ctrl-C before the command took over signals as 130; a reader that left the pipe
    (``gpulock history | head``) as a quiet 0, never a traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return command(args)
    except (UsageError, GpulockError) as e:
        return report(e, as_json=wants_json(args))
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EX_OK


def _say(kind: str, text: str) -> None:
    print(f"{kind}: {text}", file=sys.stderr, flush=True)


def settings_of(args: argparse.Namespace, *, create: bool = True) -> Any:
    """The config and state folder; ``create=False`` for commands that only read the state, so
    a mistyped folder is an error (``NoStateDir``), never an empty world in a new folder."""
    from gpulock.core.settings import load

    return load(args.config, args.state_dir, create=create)


def check_gpu(settings: Any, gpu: int) -> None:
    """A ``--gpu`` this machine does not have is a usage error naming the GPUs it has."""
    from gpulock.core.devices import check_gpu

    check_gpu(gpu, settings.config)


def parse_since(text: str, now_wall: float) -> float:
    """``10m`` (ago) or an ISO-8601 time -> epoch seconds."""
    try:
        return now_wall - parse_duration(text)
    except ValueError:
        pass
    from datetime import datetime

    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise UsageError(
            f"--since: expected a duration like 10m or a time like 2026-11-20T07:00, got {text!r}"
        ) from None
