"""``gpulock run``, ``pool``, ``status``, ``break`` and ``heartbeat``: the commands of the line.

Each takes the arguments ``gpulock.cli``'s parser made and returns the exit code: a command
that waits in line and runs (one, or a pool of workers), the look at every line, the repair
of a dead or hung ticket, and a holder's proof of life.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

from gpulock.cli_kit import EX_ERROR, EX_OK, UsageError, settings_of
from gpulock.core.errors import GpulockError
from gpulock.core.units import format_size


def _command_of(args: argparse.Namespace, usage: str) -> list[str]:
    """The command after ``--`` (argparse keeps the ``--`` in a REMAINDER); a usage error
    naming ``usage`` when there is none."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("missing command to run", hint=usage)
    return command


def cmd_run(args: argparse.Namespace) -> int:
    from gpulock import runner

    command = _command_of(args, "gpulock run [options] -- CMD [ARG...]")
    settings = settings_of(args)
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


def cmd_pool(args: argparse.Namespace) -> int:
    from gpulock.pool import supervisor
    from gpulock.runner import resolve

    command = _command_of(args, "gpulock pool --need SIZE -- CMD [ARG...]")
    if args.need is None:
        raise UsageError("--need is required: each worker's VRAM decides how many fit")
    if args.max is not None and args.min > args.max:
        raise UsageError(f"--min {args.min} is above --max {args.max}")
    settings = settings_of(args)
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


def cmd_status(args: argparse.Namespace) -> int:
    from gpulock import status
    from gpulock.core.sections import check_sections, line

    settings = settings_of(args, create=False)
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


def cmd_break(args: argparse.Namespace) -> int:
    from gpulock.lock import repair

    if (args.ticket is None) == (not args.stale):
        raise UsageError("give a TICKET or --stale (one of them)", hint="gpulock break --help")
    if args.stale and args.force:
        raise UsageError(
            "--force ends a healthy holder, so it takes one TICKET, not --stale",
            hint="gpulock status shows the tickets; gpulock break --force TICKET",
        )
    settings = settings_of(args, create=False)
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
    settings = settings_of(args, create=False)
    found = repair.find_all(settings, seq)  # a multi-GPU holder: its copy on each GPU
    if not found:
        raise GpulockError(f"no ticket {seq} in {settings.state_dir}", hint="gpulock status")
    for qdir, tf in found:
        if not identity.may_signal(tf.ticket.uid):
            raise NotPermitted(seq, tf.ticket.uid, action="renew")
        os.utime(qdir.ticket_path(seq))
    return EX_OK


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "pool": cmd_pool,
    "status": cmd_status,
    "break": cmd_break,
    "heartbeat": cmd_heartbeat,
}
