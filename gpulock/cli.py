"""The ``gpulock`` command: ``main(argv) -> exit code``.

Exit codes: 0 ok; 1 error; 2 usage (bad flag or value); 75 (EX_TEMPFAIL) the GPU could not be
had in time, so cron simply tries again next run; ``run`` otherwise returns its command's code
(126 not executable, 127 not found, 128+N killed by signal N).

Here is the grammar (every built-in command's flags and help texts) and the dispatch; the
handlers live by what they serve (``gpulock.cli_line``: run, pool, status, break, heartbeat;
``gpulock.cli_history``; ``gpulock.cli_models``: evict, tenants), each imported only when its
command runs.  The library raises; the toolkit (``gpulock.cli_kit``, named here for every
command to use) maps errors to ``error:``/``hint:`` lines and exit codes and never shows a
traceback for a user's mistake.  Commands of the packages above gpulock (``governor``,
``route``, ``fleet``, ``agent``) are found through the ``gpulock.commands`` entry-point group
and imported only when they run, so the lock package never imports them and ``gpulock run``
stays light.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

# The toolkit is gpulock.cli_kit's; the packages above the lock's side, and the plugins of
# docs/code-layout.md, reach it here, through the door named gpulock.cli.
from gpulock.cli_kit import (
    EX_ERROR,
    EX_NOEXEC,
    EX_NOTFOUND,
    EX_OK,
    EX_TEMPFAIL,
    EX_USAGE,
    Parser,
    UsageError,
    common_args,
    duration_arg,
    gpu_set_arg,
    index_arg,
    parse_since,
    print_json,
    report,
    run_command,
    size_arg,
    stdout_to_stderr,
    wants_json,
)

__all__ = [
    "EX_ERROR",
    "EX_NOEXEC",
    "EX_NOTFOUND",
    "EX_OK",
    "EX_TEMPFAIL",
    "EX_USAGE",
    "Parser",
    "UsageError",
    "build_parser",
    "duration_arg",
    "main",
    "parse_since",
    "print_json",
    "report",
    "run_command",
    "stdout_to_stderr",
    "wants_json",
]


def _gpu_count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of GPUs like 2, got {text!r}")
    return int(text)


def _ticket_number(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a ticket number like 12, got {text!r}")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {text!r}")
    return int(text)


def _retries(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number of 0 or more, got {text!r}")
    return int(text)


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

    _run_parser(sub)
    _status_parser(sub)
    _break_parser(sub)
    _history_parser(sub)
    _heartbeat_parser(sub)
    _evict_parser(sub)
    _tenants_parser(sub)
    _pool_parser(sub)
    sub.add_parser("help", help="list every command, including those of installed packages")
    for name, summary in (commands or {}).items():
        if name not in sub.choices:  # a package may not shadow a built-in command
            sub.add_parser(name, help=summary, add_help=False)
    return parser


def _run_parser(sub: Any) -> None:
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
        type=gpu_set_arg,
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
        type=size_arg,
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
    common_args(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD [ARG...]")


def _status_parser(sub: Any) -> None:
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
    common_args(p)


def _break_parser(sub: Any) -> None:
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
    common_args(p)


def _history_parser(sub: Any) -> None:
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
    p.add_argument("--gpu", type=index_arg, help="only this GPU (a multi-GPU ticket's too)")
    p.add_argument("--event", action="append", metavar="KIND", help="only these kinds")
    p.add_argument("--limit", type=int, metavar="N", help="only the last N events")
    p.add_argument("--json", action="store_true", help='print {"events": [...]}')
    common_args(p)


def _heartbeat_parser(sub: Any) -> None:
    p = sub.add_parser(
        "heartbeat",
        help="renew a holder's lease (for commands under 'gpulock run --lease')",
        description="Show that the holder is alive: renews the lease of TICKET "
        "(default: $GPULOCK_TICKET, set by 'gpulock run').",
    )
    p.add_argument("ticket", nargs="?", type=_ticket_number)
    common_args(p)


def _evict_parser(sub: Any) -> None:
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
    p.add_argument("--gpu", type=index_arg, help="only residents on this GPU")
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
    common_args(p)


def _tenants_parser(sub: Any) -> None:
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
    common_args(p)


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
    p.add_argument(
        "--need", type=size_arg, metavar="SIZE", help="VRAM each worker uses, e.g. 8.9GiB"
    )
    p.add_argument(
        "--max", type=_count, metavar="N", help="at most N workers (default: all that fit)"
    )
    p.add_argument(
        "--min", type=_count, default=1, metavar="N",
        help="start the first workers only once N tickets are granted together (default 1)",
    )  # fmt: skip
    p.add_argument(
        "--gpu",
        type=gpu_set_arg,
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
    common_args(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD [ARG...]")


def _version() -> str:
    from gpulock import __version__  # not importlib.metadata: 20 ms on every command

    return __version__


def _plugins() -> dict[str, Any]:
    from gpulock.commands import plugins

    return plugins()


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_dispatch, argv)


def _dispatch(argv: list[str]) -> int:
    builtin = {*_BUILTIN, "help"}
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
    return _handler(args.cmd)(args)


# The built-in commands, in --help's order (their handlers: _handler).
_BUILTIN = ("run", "status", "break", "history", "heartbeat", "evict", "tenants", "pool")


def _handler(cmd: str) -> Callable[[argparse.Namespace], int]:
    """The built-in command's handler: only its own module is imported, so ``gpulock run``
    loads neither history's nor eviction's code."""
    if cmd == "history":
        from gpulock.cli_history import cmd_history

        return cmd_history
    if cmd in ("evict", "tenants"):
        from gpulock.cli_models import HANDLERS as models

        return models[cmd]
    from gpulock.cli_line import HANDLERS as line

    return line[cmd]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
