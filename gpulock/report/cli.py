"""``gpulock report``: read a state folder's event log, write the page (or the summary)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gpulock.cli import Parser, UsageError, parse_since, run_command
from gpulock.core.errors import GpulockError
from gpulock.report.builder import build
from gpulock.report.model import ReportData
from gpulock.report.page import render_html
from gpulock.report.summaries import summary, summary_lines

EX_OK = 0
EPOCH_FLOOR = 1e9  # a bare --since number this large is an epoch time (2001-09-09), not an age


def write_report(
    state_dir: Path,
    out_path: Path,
    *,
    since_wall: float | None = None,
    now_wall: float | None = None,
) -> ReportData:
    """Read the state folder's log, write the page to ``out_path`` atomically, return the data.

    Raises GpulockError (with a hint) when ``out_path`` cannot be written.
    """
    from gpulock.core import events
    from gpulock.core.statefile import atomic_write

    now = time.time() if now_wall is None else now_wall
    data = build(events.read(state_dir), now_wall=now, since_wall=since_wall)
    page = render_html(data, source=str(state_dir), generated_wall=now)
    target = Path(out_path).absolute()
    try:
        atomic_write(target, page.encode(), mode=0o644)
    except OSError as e:
        raise GpulockError(
            f"cannot write {target}: {e.strerror or e}",
            hint="give --out a file in a folder you can write to",
        ) from None
    return data


DESCRIPTION = """\
Write one self-contained HTML page (no network, no external files) from the state folder's
event log: a timeline of who held each GPU (waits in light, cut-short holds hatched, timeouts,
evictions, kills and governor levels marked), the queue length and the VRAM claimed over time
per GPU, and tables per holder (runs, waits p50/p99, timeouts, time held), per agent, per
route tier and per model."""

EPILOG = """\
examples:
  gpulock report --out gpu.html                 the whole log
  gpulock report --since 2h --out - > gpu.html  the last two hours, to standard output
  gpulock report --json                         the summary as JSON, no page
exit codes: 0 ok, 1 error (unusable state folder, unwritable --out), 2 usage."""


def build_parser(prog: str = "gpulock report") -> argparse.ArgumentParser:
    p = Parser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", metavar="FILE", help="write the page here; '-' for standard output")
    p.add_argument(
        "--since",
        metavar="WHEN",
        help="only from this moment: a duration ago (10m, 2h, 1d), an epoch time "
        "(1795214127) or an ISO time (2026-11-20T07:00)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the summary (totals and tables) as JSON"
    )
    p.add_argument("--config", metavar="FILE", help="config file (default: the usual lookup)")
    p.add_argument(
        "--state-dir", metavar="DIR", help="state folder (default: $GPULOCK_STATE_DIR, config)"
    )
    return p


def since_wall_of(text: str, now_wall: float) -> float:
    """``--since``: an epoch time (a bare number >= 1e9), else a duration ago or an ISO time."""
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None and math.isfinite(number) and number >= EPOCH_FLOOR:
        return number
    return parse_since(text, now_wall)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_main, argv)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.out is None and not args.json:
        raise UsageError(
            "say where to write the report: --out FILE, or --out - for standard output",
            hint="gpulock report --out gpu.html  (or --json for the summary alone)",
        )
    if args.out == "-" and args.json:
        raise UsageError("--out - and --json both want standard output: choose one")
    now = time.time()
    since = since_wall_of(args.since, now) if args.since else None
    from gpulock.core import events
    from gpulock.core.settings import load

    settings = load(args.config, args.state_dir, create=False)
    if args.out not in (None, "-"):
        data = write_report(settings.state_dir, Path(args.out), since_wall=since, now_wall=now)
    else:
        data = build(events.read(settings.state_dir), now_wall=now, since_wall=since)
    if args.json:
        print(json.dumps(summary(data), indent=2))
    elif args.out == "-":
        sys.stdout.write(render_html(data, source=str(settings.state_dir), generated_wall=now))
        sys.stdout.flush()
    else:
        print("\n".join(summary_lines(data)))
        print(f"wrote {Path(args.out).absolute()}")
    return EX_OK
