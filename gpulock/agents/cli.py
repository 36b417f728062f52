"""``gpulock agent`` (also ``python -m gpulock.agents``): run one agent, list them, show one.

::

    gpulock agent run NAME [INPUT...] [--out PATH] [--timeout DUR] [--module MOD]...
    gpulock agent list [--json]
    gpulock agent show NAME [--json]

Exit codes of ``run``: 0 done; 1 the agent raised (traceback in its log, one ``error:`` line on
stderr); 2 usage (unknown agent, bad arguments, an agent module that cannot be imported); 75
skipped (already running, or the GPU or a model could not be had before the timeout; nothing
is printed unless stderr is a terminal, so cron mails nothing); 128+N stopped by signal N (the
checkpoint is kept).  ``list`` and ``show``: 0, 1 (bad config), 2 (usage).

Found by ``gpulock`` through the ``gpulock.commands`` entry point; ``main(argv) -> exit code``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpulock.cli import Parser, UsageError, duration_arg, print_json, run_command, stdout_to_stderr
from gpulock.core.errors import known_hint
from gpulock.core.units import format_duration, format_size

if TYPE_CHECKING:
    from gpulock.agents.spec import AgentSpec
    from gpulock.core.settings import Settings

EX_OK, EX_USAGE = 0, 2

EPILOG = """\
exit codes: 0 done; 1 the agent raised (traceback in <state>/agents/NAME/log.jsonl); 2 usage
(unknown agent, bad arguments, an agent module that cannot be imported); 75 skipped: already
running, the GPU or a model could not be had before --timeout, or the agent exited 75 itself
(silent unless stderr is a terminal: cron tries again at the next run); 128+N stopped by signal
N (checkpoint kept).

Agents are found in gpulock.agents.examples, the config's agents.modules, $GPULOCK_AGENT_MODULES
(comma-separated) and --module (a dotted module name or a path to a .py file)."""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--module",
        action="append",
        default=[],
        metavar="MOD",
        help="also import agents from MOD: a dotted module name or a .py file (repeatable)",
    )
    p.add_argument("--config", metavar="FILE", help="config file (default: the usual lookup)")
    p.add_argument(
        "--state-dir", metavar="DIR", help="state folder (default: $GPULOCK_STATE_DIR, config)"
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="say how agents were found; echo the log"
    )


def build_parser(prog: str = "gpulock agent") -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = Parser(
        prog=prog,
        description="Run cron-safe agents: one instance at a time, bounded waits that become\n"
        "a skip (exit 75), checkpointed batches that resume after a kill, a JSON log per agent.",
        epilog=EPILOG,
        formatter_class=raw,
    )
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=Parser)

    p = sub.add_parser(
        "run",
        help="run one agent once (what a cron line does)",
        description="Run agent NAME once.  INPUTs reach it as ctx.inputs (paths) and ctx.args,\n"
        "--out as ctx.out.  Another run of NAME still alive makes this one a skip (75).",
        epilog=EPILOG,
        formatter_class=raw,
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument("inputs", nargs="*", metavar="INPUT")
    p.add_argument("--out", metavar="PATH", help="where the agent writes its result (ctx.out)")
    p.add_argument(
        "--timeout",
        type=duration_arg,
        metavar="DUR",
        help="bound the waits for the GPU and models (30s, 10m); past it the run is skipped "
        "with exit 75 (default: the agent's own timeout, else none)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print how the run ended as one JSON object (the agent's own output goes to stderr)",
    )
    _common(p)

    p = sub.add_parser("list", help="list the agents found", description="List the agents.")
    p.add_argument("--json", action="store_true", help='print {"agents": [...]}')
    _common(p)

    p = sub.add_parser(
        "show",
        help="show one agent, its checkpoint and last run",
        description="Show agent NAME: its declaration, its batch checkpoint and its last run.",
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _common(p)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parse_args``, with ``run``'s INPUTs taken wherever they stand after NAME.

    argparse fills a ``nargs="*"`` positional once, at its first chance: in ``run NAME
    --module M ~/notes`` that is before ``--module``, so ``~/notes`` was left over and refused
    ("unrecognized arguments"), though a cron line is as likely written that way as any other.
    Left-over words that are not options are INPUTs, in their order; a left-over option is
    still an error.
    """
    args, extra = parser.parse_known_args(argv)
    if args.cmd == "run" and "--" not in argv:
        args.inputs += [x for x in extra if not x.startswith("-")]
        extra = [x for x in extra if x.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None, *, prog: str = "gpulock agent") -> int:
    return run_command(lambda args: _main(args, prog), argv)


def _main(argv: list[str], prog: str) -> int:
    parser = build_parser(prog)
    args = _parse(parser, argv)
    if args.cmd is None:
        parser.print_help(sys.stderr)
        return EX_USAGE
    from gpulock.agents import registry
    from gpulock.core.config import load_config

    config = load_config(args.config)
    notes = registry.load(args.module, config=config)
    if args.verbose:
        for note in notes:
            print(f"debug: {note}", file=sys.stderr)
    if args.cmd == "list":
        return _list(args.json)
    spec = _find(args.name)
    from gpulock.core.settings import load

    settings = load(config, args.state_dir)
    if args.cmd == "show":
        return _show(spec, settings, args.json)
    from gpulock.agents.runtime import run_agent

    def run() -> int:
        return run_agent(
            spec,
            args=args.inputs,
            out=Path(args.out) if args.out else None,
            timeout_s=args.timeout,
            settings=settings,
            verbose=args.verbose,
        )

    if not args.json:
        return run()
    with stdout_to_stderr():
        code = run()
    print_json(_run_json(spec.name, settings, code))
    return code


def _find(name: str) -> AgentSpec:
    from gpulock.agents.spec import get, registered

    spec = get(name)
    if spec is not None:
        return spec
    known = [s.name for s in registered()]
    if known:
        raise UsageError(f"unknown agent {name!r}", hint=known_hint(name, known, "known agents"))
    raise UsageError(
        f"unknown agent {name!r}: no agents found",
        hint="name their module with --module MOD, $GPULOCK_AGENT_MODULES or the config's "
        "agents.modules",
    )


def _list(as_json: bool) -> int:
    from gpulock.agents.spec import registered

    specs = registered()
    if as_json:
        print(json.dumps({"agents": [s.as_dict() for s in specs]}, indent=2))
        return EX_OK
    if not specs:
        print("no agents found (add --module MOD, $GPULOCK_AGENT_MODULES or agents.modules)")
        return EX_OK
    rows = [("NAME", "TASK", "SCHEDULE", "TIMEOUT", "NEED", "DESCRIPTION")]
    for s in specs:
        rows.append(
            (
                s.name,
                s.task or "-",
                s.schedule or "-",
                format_duration(s.timeout_s) if s.timeout_s is not None else "-",
                format_size(s.need_bytes) if s.need_bytes is not None else "-",
                s.description,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        line = "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[5]
        print(line.rstrip())
    return EX_OK


def _show(spec: AgentSpec, settings: Settings, as_json: bool) -> int:
    from gpulock.agents import checkpoint
    from gpulock.agents.runtime import AGENTS_DIR, LOG_NAME

    folder = settings.state_dir / AGENTS_DIR / spec.name
    try:
        found = checkpoint.load(folder / checkpoint.CHECKPOINT_NAME)
        progress: dict[str, Any] | None = (
            None if found is None else {"done": len(found.done), "total": found.total}
        )
    except checkpoint.CheckpointError as e:
        progress = {"error": str(e)}
    data = {
        **spec.as_dict(),
        "state": str(folder),
        "checkpoint": progress,
        "last_run": _last_run(folder / LOG_NAME),
    }
    if as_json:
        print(json.dumps(data, indent=2))
        return EX_OK
    for key, value in data.items():
        if key == "last_run" and isinstance(value, dict):
            code = value.get("exit_code")
            value = f"{value.get('outcome')} ({value.get('msg')}), pid {value.get('pid')}" + (
                "" if code is None else f", exit {code}"
            )
        elif key == "checkpoint" and isinstance(value, dict):
            value = value.get("error") or f"{value['done']} of {value['total']} done"
        elif key == "timeout_s" and value is not None:
            value = format_duration(value)
        elif key == "need_bytes" and value is not None:
            value = format_size(value)
        label = _LABELS.get(key, key.replace("_", " "))
        print(f"{label}: {'-' if value is None or value == '' else value}")
    return EX_OK


_LABELS = {"timeout_s": "timeout", "need_bytes": "need", "last_run": "last run"}
LOG_TAIL_BYTES = 2 * 1024 * 1024  # of each log generation: more than one rotated at 1 MiB holds


def _run_json(name: str, settings: Settings, code: int) -> dict[str, Any]:
    """``agent run --json``: this process's run, from the end record it just logged."""
    from gpulock.agents.runtime import AGENTS_DIR, LOG_NAME

    log = settings.state_dir / AGENTS_DIR / name / LOG_NAME
    end = _last_run(log, pid=os.getpid()) or {}
    return {
        "agent": name,
        "outcome": end.get("outcome"),
        "reason": end.get("reason"),
        "exit_code": code,
        "duration_s": end.get("duration_s"),
        "log": str(log),
    }


def _last_run(log: Path, *, pid: int | None = None) -> dict[str, Any] | None:
    """The newest run in an agent's log: its ``end`` record, or its ``start`` made into one.

    A run that never wrote its end (SIGKILL, the OOM killer, a power cut) would otherwise hide
    behind the run before it: its start record comes back with ``outcome`` ``running`` (the
    process is still there) or ``died``.  The rotated generation is read too.  ``pid``: only
    that process's run.
    """
    from gpulock.core.errors import StateDirError
    from gpulock.core.statefile import read_tail

    records: list[dict[str, Any]] = []
    for path in (log.with_name(log.name + ".1"), log):  # oldest first
        try:
            # The tail only: a log is rotated at 1 MiB, but a planted one may be any size; a
            # symlink or a FIFO in its place is skipped, never followed or waited on.
            data = read_tail(path, LOG_TAIL_BYTES)
        except (OSError, StateDirError):
            continue
        for raw in (data or b"").splitlines():
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError):
                continue
            if (
                isinstance(record, dict)
                and record.get("event") in ("start", "end")
                and (pid is None or record.get("pid") == pid)
            ):
                records.append(record)
    ended: dict[object, dict[str, Any]] = {}  # pid -> its newest end, newer than the scan
    for record in reversed(records):
        pid = record.get("pid")
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
        if record["event"] == "end":
            ended.setdefault(pid, record)
            continue
        end = ended.get(pid)
        if end is not None:
            return end
        return _unfinished(record)
    return next(iter(ended.values()), None)  # ends without starts: an older log's format


def _unfinished(start: dict[str, Any]) -> dict[str, Any]:
    """A start record without its end, as the ``end`` record ``show`` would have printed."""
    pid, raw_ts = start.get("pid"), start.get("ts")
    ts = float(raw_ts) if isinstance(raw_ts, int | float) and not isinstance(raw_ts, bool) else None
    try:
        when = "?" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    except (OverflowError, OSError, ValueError):  # NaN, or a time no clock wrote
        ts, when = None, "?"
    if isinstance(pid, int) and ts is not None and _running_since(pid, ts):
        outcome, text = "running", f"since {when}"
    else:
        outcome = "died"
        text = f"started {when}, no end record: killed by SIGKILL or the OOM killer, or a crash"
    return {**start, "msg": text, "outcome": outcome, "reason": text, "exit_code": None}


def _running_since(pid: int, ts: float) -> bool:
    """Whether ``pid`` is alive and started before ``ts`` (not a later process reusing it)."""
    from gpulock.core.identity import start_ticks

    ticks = start_ticks(pid)
    if ticks is None:
        return False
    try:
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return True  # alive; when it started cannot be told
    started_wall = time.time() - (uptime_s - ticks / os.sysconf("SC_CLK_TCK"))
    return started_wall <= ts + 5.0  # ticks are coarse; a reused pid starts after the record
