"""The ``gpulock`` command: ``main(argv) -> exit code``.

Exit codes: 0 ok; 1 error; 2 usage (bad flag or value); 75 (EX_TEMPFAIL) the GPU could not be
had in time, so cron simply tries again next run; ``run`` otherwise returns its command's code
(126 not executable, 127 not found, 128+N killed by signal N).

The library raises; this module maps errors to ``error:``/``hint:`` lines and exit codes and
never shows a traceback for a user's mistake.  Commands of the packages above gpulock
(``governor``, ``route``, ``fleet``, ``agent``) are found through the ``gpulock.commands``
entry-point group and imported only when they run, so the lock package never imports them and
``gpulock run`` stays light.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any, NoReturn

from gpulock.core.errors import GpulockError, LockTimeout
from gpulock.core.units import format_duration, format_size, parse_duration, parse_size

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


def _size(text: str) -> int:
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


def _index(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a GPU index like 0 or 1, got {text!r}")
    return int(text)


def _gpu_set(text: str) -> int | str | tuple[int, ...]:
    """``--gpu``: an index, a set (``0,2``) or ``any``."""
    from gpulock.core.units import parse_gpus

    try:
        return parse_gpus(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a GPU index like 0, a set like 0,2, or any, got {text!r}"
        ) from None


def _gpu_count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of GPUs like 2, got {text!r}")
    return int(text)


def _ticket_number(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a ticket number like 12, got {text!r}")
    return int(text)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="config file (default: the usual lookup)")
    p.add_argument(
        "--state-dir", metavar="DIR", help="state folder (default: $GPULOCK_STATE_DIR, config)"
    )


class _CommandsFormatter(argparse.HelpFormatter):
    """Room for the longest command name (``heartbeat``), so that every summary starts on
    its command's line."""

    def __init__(self, prog: str, width: int | None = None) -> None:
        super().__init__(prog, max_help_position=16, width=width)
        self._action_max_length = 14


def build_parser(commands: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The built-in commands' parser; ``commands`` (name -> summary) lists the installed
    packages' too, for ``--help`` (they parse their own arguments)."""
    parser = Parser(
        prog="gpulock",
        description="A fair, crash-safe line in front of each GPU for fleets of small agents.",
        formatter_class=_CommandsFormatter,
        epilog=(
            "exit codes: 0 ok, 1 error, 2 usage, 75 GPU busy past --timeout (try again later); "
            "'run' returns its command's code.  'gpulock COMMAND --help' tells more of each."
        ),
    )
    parser.add_argument("--version", action="version", version=f"gpulock {_version()}")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=Parser)

    p = sub.add_parser(
        "run",
        help="run a command holding a GPU",
        description=(
            "Wait in line for the GPU, then run CMD (no shell) with CUDA_VISIBLE_DEVICES set "
            "to the GPUs granted (with CUDA_DEVICE_ORDER=PCI_BUS_ID, and GPULOCK_GPUS listing "
            "them).  The GPU stays claimed until CMD and its children end, even if this "
            "process is killed.  SIGINT, SIGTERM, SIGHUP, SIGQUIT and SIGUSR1/2 are forwarded "
            "to CMD.  Exits with CMD's code, or 75 when the GPU could not be had within "
            "--timeout."
        ),
        usage="gpulock run [options] -- CMD [ARG...]",
    )
    p.add_argument(
        "--gpu",
        type=_gpu_set,
        metavar="GPU",
        help="GPU index, a set (0,2) or any: granted whichever of the set can take it first "
        "(default: config default_gpu, else 0)",
    )
    p.add_argument(
        "--gpus",
        type=_gpu_count,
        metavar="N",
        help="N GPUs at once, all or nothing (of --gpu's set, else of every GPU)",
    )
    p.add_argument(
        "--need",
        type=_size,
        metavar="SIZE",
        help="VRAM this job uses, e.g. 6GiB: jobs whose needs fit share the GPU "
        "(default: exclusive)",
    )
    p.add_argument(
        "--timeout",
        type=duration_arg,
        metavar="S",
        help="give up after waiting this long (30, 90s, 5m) and exit 75 (default: wait for ever)",
    )
    p.add_argument("--name", help="name shown in status and history (default: CMD's name)")
    p.add_argument(
        "--lease",
        type=duration_arg,
        metavar="S",
        help="CMD counts as hung if it holds longer than this without 'gpulock heartbeat'",
    )
    p.add_argument(
        "--prefetch",
        action="append",
        default=[],
        metavar="PATH",
        help="a file CMD will load (a model): read into the page cache while waiting in line "
        "(repeat for several; see prefetch: in the config)",
    )
    _common(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD [ARG...]")

    p = sub.add_parser(
        "status",
        help="show holders and waiters of every GPU",
        description="Holders and waiters of each GPU in queue order, with stale marks.",
    )
    p.add_argument("--json", action="store_true", help="print the documented JSON object")
    p.add_argument(
        "--watch",
        type=duration_arg,
        nargs="?",
        const=1.0,
        metavar="S",
        help="redraw every S seconds (default 1) until Ctrl-C",
    )
    _common(p)

    p = sub.add_parser(
        "break",
        help="remove dead tickets, end hung holders (owner or root)",
        description=(
            "Remove a ticket whose owner is gone, or end a hung holder (SIGTERM, grace, "
            "SIGKILL; verified by pid and start time) and remove its ticket.  Only the "
            "ticket's owner or root may do this."
        ),
        usage="gpulock break (TICKET [--force] | --stale) [--grace S] [--json]",
    )
    p.add_argument("ticket", nargs="?", type=_ticket_number, help="ticket number (see status)")
    p.add_argument("--stale", action="store_true", help="every dead or hung ticket")
    p.add_argument("--force", action="store_true", help="with a TICKET: end it even if healthy")
    p.add_argument("--grace", type=duration_arg, metavar="S", help="SIGTERM to SIGKILL delay")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    _common(p)

    p = sub.add_parser(
        "history",
        help="print the event log",
        description="Events from the state folder's log: wait, acquire, release, timeout, ...",
    )
    p.add_argument(
        "--since",
        metavar="WHEN",
        help="only events newer than this: a duration ago (10m, 2h) or an ISO time",
    )
    p.add_argument("--gpu", type=_index, help="only this GPU (a multi-GPU ticket's too)")
    p.add_argument("--event", action="append", metavar="KIND", help="only these kinds")
    p.add_argument("--limit", type=int, metavar="N", help="only the last N events")
    p.add_argument("--json", action="store_true", help='print {"events": [...]}')
    _common(p)

    p = sub.add_parser(
        "heartbeat",
        help="renew a holder's lease (for commands under 'gpulock run --lease')",
        description="Show that the holder is alive: renews the lease of TICKET "
        "(default: $GPULOCK_TICKET, set by 'gpulock run').",
    )
    p.add_argument("ticket", nargs="?", type=_ticket_number)
    _common(p)

    p = sub.add_parser(
        "evict",
        help="ask the owner of a resident model to unload it",
        description=(
            "Ask the process that keeps model NAME (or resident ID) in VRAM to unload it at a "
            "safe point (never during a call), then check that the GPU's memory came back. "
            "Pinned models are refused unless --force.  Exit 0 when every match was unloaded."
        ),
    )
    p.add_argument("target", metavar="NAME|ID", help="model name or resident id (see status)")
    p.add_argument("--gpu", type=_index, help="only residents on this GPU")
    p.add_argument(
        "--timeout",
        type=duration_arg,
        default=10.0,
        metavar="S",
        help="how long the owner may take to reach a safe point (default 10 s); "
        "unloading gets 5 s more before the answer counts as missing",
    )
    p.add_argument("--force", action="store_true", help="evict pinned models too")
    p.add_argument("--tenant", metavar="T", help="only models of tenant T (see gpulock tenants)")
    p.add_argument("--json", action="store_true", help='print {"results": [...]}')
    _common(p)

    p = sub.add_parser(
        "tenants",
        help="the model servers in the config (tenants) and the models they hold",
        description=(
            "Ask every tenant in the config (in parallel, briefly) what it holds: reachable or "
            "not (and why), the kind it says it is, its models with state, size, last use and "
            "whether one is serving a request."
        ),
    )
    p.add_argument("--json", action="store_true", help='print {"tenants": [...]}')
    _common(p)

    _pool_parser(sub)
    sub.add_parser("help", help="list every command, including those of installed packages")
    for name, summary in (commands or {}).items():
        if name not in sub.choices:  # a package may not shadow a built-in command
            sub.add_parser(name, help=summary, add_help=False)
    return parser


def _version() -> str:
    from gpulock import __version__  # not importlib.metadata: 20 ms on every command

    return __version__


def _plugins() -> dict[str, Any]:
    from gpulock.commands import plugins

    return plugins()


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


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_dispatch, argv)


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


def _dispatch(argv: list[str]) -> int:
    builtin = {*_HANDLERS, "help"}
    if argv and not argv[0].startswith("-") and argv[0] not in builtin:
        plugins = _plugins()
        plugin = plugins.get(argv[0])
        if plugin is None:
            from gpulock.core.errors import known_hint

            known = sorted(builtin | set(plugins))
            raise UsageError(
                f"unknown command {argv[0]!r}", hint=known_hint(argv[0], known, "commands")
            )
        func: Callable[[list[str]], int] = plugin.load()
        return func(argv[1:])
    listing = not argv or argv[0] in ("help", "-h", "--help")
    if listing:  # only then: reading the packages' summaries is no cost for `gpulock run`
        from gpulock.commands import summaries

        parser = build_parser(summaries())
    else:
        parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None or args.cmd == "help":
        parser.print_help()
        return EX_OK if args.cmd == "help" else EX_USAGE
    handler: Callable[[argparse.Namespace], int] = _HANDLERS[args.cmd]
    return handler(args)


def _settings(args: argparse.Namespace, *, create: bool = True) -> Any:
    """The config and state folder; ``create=False`` for commands that only read the state, so
    a mistyped folder is an error (``NoStateDir``), never an empty world in a new folder."""
    from gpulock.core.settings import load

    return load(args.config, args.state_dir, create=create)


def _check_gpu(settings: Any, gpu: int) -> None:
    """A ``--gpu`` this machine does not have is a usage error naming the GPUs it has."""
    from gpulock.core.devices import check_gpu

    check_gpu(gpu, settings.config)


# --- run -----------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from gpulock import runner

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("missing command to run", hint="gpulock run [options] -- CMD [ARG...]")
    settings = _settings(args)
    if args.prefetch:
        from gpulock.lock.prefetch import check_paths

        try:
            args.prefetch = list(check_paths(args.prefetch))
        except GpulockError as e:
            raise UsageError(f"--prefetch: {e}", hint=e.hint) from None
    return runner.run(
        settings,
        command,
        gpu=args.gpu,
        gpus=args.gpus,
        need=args.need,
        timeout=args.timeout,
        name=args.name,
        lease=args.lease,
        prefetch=args.prefetch,
    )


# --- status --------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    from gpulock import status
    from gpulock.core.sections import check_sections, line

    settings = _settings(args, create=False)
    # The sections status does not read itself (serve:, router:...), checked once by the
    # parts that read them: a typo there is seen now, not when that service next starts.
    problems = [line(e) for e in check_sections(settings.config)[0]]
    if args.watch is None:
        snap = status.snapshot(settings) | {"config_problems": problems}
        print(json.dumps(snap, indent=2) if args.json else status.render(snap))
        return EX_OK
    interval = max(args.watch, 0.1)
    try:
        while True:
            snap = status.snapshot(settings) | {"config_problems": problems}
            text = json.dumps(snap) if args.json else status.render(snap)
            if sys.stdout.isatty() and not args.json:
                sys.stdout.write("\x1b[H\x1b[2J")  # home + clear: redraw in place
                stamp = time.strftime("%H:%M:%S")
                text = f"gpulock status - {stamp} - every {interval:g} s, Ctrl-C to stop\n{text}"
            print(text, flush=True)
            time.sleep(interval)  # a display refresh, not a lock wait
    except KeyboardInterrupt:
        return EX_OK


# --- break ---------------------------------------------------------------------------------


def cmd_break(args: argparse.Namespace) -> int:
    from gpulock.lock import repair

    if (args.ticket is None) == (not args.stale):
        raise UsageError("give a TICKET or --stale (one of them)", hint="gpulock break --help")
    if args.stale and args.force:
        raise UsageError(
            "--force ends a healthy holder, so it takes one TICKET, not --stale",
            hint="gpulock status shows the tickets; gpulock break --force TICKET",
        )
    settings = _settings(args, create=False)
    if args.stale:
        results = repair.break_stale(settings, grace_s=args.grace)
    else:
        results = [repair.break_ticket(settings, args.ticket, force=args.force, grace_s=args.grace)]
    if args.json:
        print(json.dumps({"results": [asdict(r) for r in results]}, indent=2))
    elif not results:
        print("nothing stale")
    else:
        for r in results:
            print(f"ticket {r.ticket} (gpu{r.gpu}): {r.action}: {r.detail}")
    return EX_ERROR if any(r.action == "skipped" for r in results) else EX_OK


# --- history -------------------------------------------------------------------------------


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


def cmd_history(args: argparse.Namespace) -> int:
    from gpulock.core import events

    since = parse_since(args.since, time.time()) if args.since else None
    settings = _settings(args, create=False)
    kinds = set(args.event or ())
    logged = list(events.read(settings.state_dir, since_wall=since))
    known = set(events.KINDS) | {e["event"] for e in logged}  # a plugin's kinds too
    for kind in sorted(kinds - known):
        from gpulock.core.errors import known_hint

        raise UsageError(
            f"--event: no event kind {kind!r}", hint=known_hint(kind, sorted(known), "kinds")
        )
    if args.gpu is not None and all(args.gpu not in _gpus_of(e) for e in logged):
        _check_gpu(settings, args.gpu)  # a GPU of the past may be asked about, a typo not
    selected = [
        e
        for e in logged
        if (args.gpu is None or args.gpu in _gpus_of(e)) and (not kinds or e["event"] in kinds)
    ]
    if args.limit is not None:
        selected = selected[-args.limit :] if args.limit > 0 else []
    if args.json:
        print(json.dumps({"events": selected}, indent=2))
        return EX_OK
    for line in history_lines(selected):
        print(line)
    return EX_OK


_SHOWN = {"ts", "event", "gpu", "ticket", "pid", "name", "granted", "gpu_set"}


def _gpus_of(e: dict[str, Any]) -> tuple[int, ...]:
    """The GPUs an event is about: a multi-GPU holder's all, a set ticket's set, else its
    ``gpu`` (none for an event of no GPU)."""
    for key in ("granted", "gpu_set", "gpus"):
        v = e.get(key)
        if isinstance(v, list) and v and all(isinstance(g, int) for g in v):
            return tuple(v)
    return (e["gpu"],) if isinstance(e.get("gpu"), int) else ()


def _gpu_cell(e: dict[str, Any]) -> str:
    """history's GPU column: ``gpu0``; ``gpus 0,2`` for a multi-GPU holder or a set ticket."""
    from gpulock.core.units import format_gpus

    gpus = _gpus_of(e)
    return format_gpus(gpus) if gpus else "-"


_WHO_MAX = 32  # a longer name shifts its own line's details, not every column


def history_lines(selected: Sequence[dict[str, Any]]) -> list[str]:
    """``gpulock history``'s lines, columns as wide as the widest value shown (an event kind
    like ``gateway-request`` does not push its line's columns out of step)."""
    rows = [_history_row(e) for e in selected]
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(1, 4)]
    who_w = min(max(len(r[4]) for r in rows), _WHO_MAX)
    out = []
    for stamp, kind, gpu, ticket, who, details in rows:
        line = f"{stamp}  {kind:<{widths[0]}}  {gpu:<{widths[1]}}  {ticket:>{widths[2]}}  "
        out.append((line + f"{who:<{who_w}}  {details}").rstrip())
    return out


def _history_row(e: dict[str, Any]) -> tuple[str, str, str, str, str, str]:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["ts"]))
    gpu = _gpu_cell(e)
    ticket = str(e["ticket"]) if e.get("ticket") is not None else "-"
    # Agents' and the fleet's events name their agent; the lock's name their holder.
    label_key = "name" if "name" in e else "agent"
    who = f"{e.get(label_key, '')}[{e.get('pid', '')}]" if "pid" in e else ""
    if not who and isinstance(e.get("name"), str):
        who = e["name"]  # no pid to show (a tenant's model): the name all the same
    details: list[str] = []
    for k, v in e.items():
        # Nothing to say (None, ""): a refused request has no task, tier or model.
        if k in _SHOWN or v is None or v == "" or (who and k == label_key):
            continue
        _details(details, k, v, 0)
    return stamp, str(e["event"]), gpu, ticket, who, " ".join(details)


def _details(out: list[str], key: str, v: Any, depth: int) -> None:
    """``key=value`` for history, readably: a mapping as ``key.sub=value`` (a governor's
    ``evidence``, a route's ``model``), a list of plain values comma-joined, sizes and
    durations in units; never a Python repr."""
    if isinstance(v, dict) and depth < 4:
        for sub, sv in v.items():
            if sv is not None and sv != "":
                _details(out, f"{key}.{sub}", sv, depth + 1)
        return
    out.append(f"{key}={_value(key, v)}")


def _value(key: str, v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if key.endswith("_s") and isinstance(v, int | float):
        return format_duration(v)
    if key.endswith("_bytes") and isinstance(v, int):
        return format_size(v)
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, int | str):
        return str(v)
    if isinstance(v, list) and all(isinstance(x, int | float | str) for x in v):
        return ",".join(_value(key, x) for x in v) or "[]"
    return json.dumps(v, separators=(",", ":"), default=str)


# --- heartbeat -----------------------------------------------------------------------------


def cmd_heartbeat(args: argparse.Namespace) -> int:
    from gpulock.core import identity
    from gpulock.core.errors import NotPermitted
    from gpulock.lock import repair
    from gpulock.lock.inherit import ENV_TICKET

    seq = args.ticket
    if seq is None:
        spec = os.environ.get(ENV_TICKET, "")
        _, _, tail = spec.partition(":")
        if not tail.isdigit():
            raise UsageError(
                "no TICKET given and $GPULOCK_TICKET is not set",
                hint="run this inside 'gpulock run', or pass the ticket number",
            )
        seq = int(tail)
    settings = _settings(args, create=False)
    found = repair.find_all(settings, seq)  # a multi-GPU holder: its copy on each GPU
    if not found:
        raise GpulockError(f"no ticket {seq} in {settings.state_dir}", hint="gpulock status")
    for qdir, tf in found:
        if not identity.may_signal(tf.ticket.uid):
            raise NotPermitted(seq, tf.ticket.uid, action="renew")
        os.utime(qdir.ticket_path(seq))
    return EX_OK


# --- evict ---------------------------------------------------------------------------------


def cmd_evict(args: argparse.Namespace) -> int:
    from gpulock.core.errors import known_hint
    from gpulock.residents import eviction, registry

    settings = _settings(args)  # a tenant's models need no state folder
    if args.gpu is not None:
        _check_gpu(settings, args.gpu)
    matches = eviction.find(settings, args.target, gpu=args.gpu, tenant=args.tenant)
    if not matches:
        known = sorted({r.id if r.tenant else r.name for r in registry.all_records(settings)})
        raise GpulockError(
            f"no resident model {args.target!r}"
            + (f" on gpu{args.gpu}" if args.gpu is not None else "")
            + (f" in tenant {args.tenant}" if args.tenant is not None else ""),
            hint=(
                known_hint(args.target, known, "resident models") if known else "none is registered"
            ),
        )
    results = [
        eviction.evict(settings, r, force=args.force, timeout_s=args.timeout) for r in matches
    ]
    if args.json:
        print(json.dumps({"results": [asdict(r) for r in results]}, indent=2))
    else:
        for r in results:
            pid = f", pid {r.pid}" if r.pid is not None else ""  # a tenant's server: unknown
            print(f"{r.name} ({r.id}{pid}, gpu{r.gpu}): {r.outcome}: {r.detail}")
    return EX_OK if all(r.ok for r in results) else EX_ERROR


# --- tenants -------------------------------------------------------------------------------


def cmd_tenants(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not settings.config.tenants:
        if args.json:
            print(json.dumps({"tenants": []}, indent=2))
        else:
            print("no tenants configured (add a 'tenants:' list to the config; see the README)")
        return EX_OK
    from gpulock.residents import registry
    from gpulock.tenants import survey

    entries = registry.tenant_entries(settings)
    print(json.dumps({"tenants": entries}, indent=2) if args.json else survey.render(entries))
    return EX_OK


# --- pool (gpulock.pool) --------------------------------------------------------------------


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {text!r}")
    return int(text)


def _retries(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number of 0 or more, got {text!r}")
    return int(text)


def _pool_parser(sub: Any) -> None:
    p = sub.add_parser(
        "pool",
        help="run as many workers of a command as the GPU's memory admits",
        description=(
            "Run as many workers of CMD as the GPU's line admits, each holding its own ticket "
            "with --need SIZE: while fewer than --max run, one more ticket waits in line and a "
            "worker starts when it is granted.  A worker that exits 0 has done its share: no "
            "new worker starts and the pool ends when the others have.  A failed worker is "
            "replaced (with back-off) up to --retries failures in a row.  Workers get "
            "GPULOCK_POOL_WORKER (index) and GPULOCK_POOL_SIZE besides what 'run' sets."
        ),
        usage="gpulock pool --need SIZE [options] -- CMD [ARG...]",
        epilog="exit codes as 'gpulock run': 75 when no worker was granted within --timeout",
    )
    p.add_argument("--need", type=_size, metavar="SIZE", help="VRAM each worker uses, e.g. 8.9GiB")
    p.add_argument(
        "--max", type=_count, metavar="N", help="at most N workers (default: all that fit)"
    )
    p.add_argument(
        "--min", type=_count, default=1, metavar="N",
        help="start the first workers only once N tickets are granted together (default 1)",
    )  # fmt: skip
    p.add_argument(
        "--gpu",
        type=_gpu_set,
        metavar="GPU",
        help="GPU index, a set (0,2) or any: each worker on whichever GPU admits it "
        "(default: config default_gpu, else 0)",
    )
    p.add_argument(
        "--retries", type=_retries, default=3, metavar="N",
        help="replace up to N failed workers in a row, then stop (default 3)",
    )  # fmt: skip
    p.add_argument("--name", help="the pool's name in status and history (default: CMD's name)")
    p.add_argument(
        "--timeout", type=duration_arg, metavar="T",
        help="give up (exit 75) if no worker is granted within T (30, 90s, 5m)",
    )  # fmt: skip
    _common(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD [ARG...]")


def cmd_pool(args: argparse.Namespace) -> int:
    from gpulock.pool import supervisor
    from gpulock.runner import resolve

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("missing command to run", hint="gpulock pool --need SIZE -- CMD [ARG...]")
    if args.need is None:
        raise UsageError("--need is required: each worker's VRAM decides how many fit")
    if args.max is not None and args.min > args.max:
        raise UsageError(f"--min {args.min} is above --max {args.max}")
    settings = _settings(args)
    resolve(command)  # 127/126 before queueing for nothing
    max_workers = args.max or supervisor.max_for(settings, args.gpu, args.need)
    if args.min > max_workers:
        raise UsageError(
            f"--min {args.min}: at most {max_workers} workers of {format_size(args.need)} fit"
        )
    spec = supervisor.PoolSpec(
        tuple(command), args.need, max_workers, args.min, args.retries, args.gpu, args.name,
        args.timeout,
    )  # fmt: skip
    return supervisor.run_pool(settings, spec)


_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "pool": cmd_pool,
    "evict": cmd_evict,
    "tenants": cmd_tenants,
    "run": cmd_run,
    "status": cmd_status,
    "break": cmd_break,
    "history": cmd_history,
    "heartbeat": cmd_heartbeat,
}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
