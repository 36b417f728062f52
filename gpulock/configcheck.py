"""``gpulock config check``: validate every section of the config file now, with the validator
of the part that reads it, instead of when that part next starts (at 3 a.m., under systemd).

The checking is ``gpulock.core.sections``; this is its command.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from gpulock.cli import EX_ERROR, EX_OK, Parser, UsageError, print_json, run_command
from gpulock.core.errors import ConfigError, known_hint
from gpulock.core.sections import check, line


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_config, argv)


DESCRIPTION = """\
Check the config file now: gpulock's own keys, and every other section (router, routes,
watchdog, governor, serve, cluster, agents, metrics, prefetch, prewarm, eviction) with the
validator of the part of gpulock that reads it, so a typo in serve: shows up today, not when
the service next starts.  Each problem is one line, file:line: key: what, with a hint ("did
you mean ...?") under it: every wrong top-level key or value, and the first problem of each
section."""

EPILOG = """\
exit codes: 0 no problem (or no config file: every default applies); 1 a problem (or the file
cannot be read); 2 usage."""


def build_parser(prog: str = "gpulock config") -> argparse.ArgumentParser:
    p = Parser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{prog} check [--config FILE] [--json]",
    )
    p.add_argument("action", metavar="check", help="the one action: check")
    p.add_argument("--config", metavar="FILE", help="the config file (default: the usual lookup)")
    p.add_argument("--json", action="store_true", help='print {"file", "ok", "problems": [...]}')
    return p


def _config(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.action != "check":
        raise UsageError(
            f"unknown action {args.action!r}", hint=known_hint(args.action, ["check"], "actions")
        )
    done = check(args.config)
    if args.json:
        print_json(
            {
                "file": None if done.path is None else str(done.path),
                "ok": not done.problems,
                "sections": list(done.sections),
                "problems": [_problem(e) for e in done.problems],
            }
        )
        return EX_ERROR if done.problems else EX_OK
    if done.path is None:
        print("no config file: every default applies (see 'gpulock config check --help')")
        return EX_OK
    for e in done.problems:
        print(line(e))
        if e.hint:
            print(f"  hint: {e.hint}")
    if done.problems:
        n = len(done.problems)
        print(f"{done.path}: {n} problem{'s' if n != 1 else ''}")
        return EX_ERROR
    checked = ", ".join(done.sections) if done.sections else "no other section"
    print(f"{done.path}: ok (gpulock's keys, {checked})")
    return EX_OK


def _problem(e: ConfigError) -> dict[str, Any]:
    return {
        "file": e.file,
        "line": e.line,
        "key": e.key,
        "problem": e.problem,
        "hint": e.hint,
        "message": line(e),
    }
