"""``gpulock pool --need SIZE [--max N] [--min 1] [--gpu N] [--retries 3] [--name NAME]
[--timeout T] -- CMD [ARGS...]``: the command line of ``gpulock.pool.supervisor``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gpulock.cli import Parser, UsageError, duration_arg, run_command


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_pool, argv)


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {text!r}")
    return int(text)


def _retries(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number of 0 or more, got {text!r}")
    return int(text)


def build_parser() -> Parser:
    from gpulock.cli import _common, _index, _size

    p = Parser(
        prog="gpulock pool",
        description=(
            "Run as many workers of CMD as the GPU's line admits, each holding its own ticket "
            "with --need SIZE: while fewer than --max run, one more ticket waits in line and a "
            "worker starts when it is granted.  A worker that exits 0 has done its share: no "
            "new worker starts and the pool ends when the others have.  A failed worker is "
            "replaced (with back-off) up to --retries failures in a row.  Workers get "
            "GPULOCK_POOL_WORKER (index) and GPULOCK_POOL_SIZE besides what 'gpulock run' sets."
        ),
        usage="gpulock pool --need SIZE [options] -- CMD [ARG...]",
        epilog="exit codes as 'gpulock run': 75 when no worker was granted within --timeout",
    )
    p.add_argument("--need", type=_size, metavar="SIZE", help="VRAM each worker uses, e.g. 8.9GiB")
    p.add_argument(
        "--max",
        type=_count,
        metavar="N",
        help="at most N workers (default: as many as the GPU's size could ever hold)",
    )
    p.add_argument(
        "--min",
        type=_count,
        default=1,
        metavar="N",
        help="start the first workers only once N tickets are granted together (default 1)",
    )
    p.add_argument("--gpu", type=_index, help="GPU index (default: config default_gpu, else 0)")
    p.add_argument(
        "--retries",
        type=_retries,
        default=3,
        metavar="N",
        help="replace up to N failed workers in a row, then stop (default 3)",
    )
    p.add_argument("--name", help="the pool's name in status and history (default: CMD's name)")
    p.add_argument(
        "--timeout",
        type=duration_arg,
        metavar="T",
        help="give up (exit 75) if no worker is granted within T (30, 90s, 5m)",
    )
    _common(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD [ARG...]")
    return p


def _pool(argv: list[str]) -> int:
    from gpulock.core.settings import load
    from gpulock.core.units import format_size
    from gpulock.pool import supervisor
    from gpulock.runner import resolve

    args = build_parser().parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("missing command to run", hint="gpulock pool --need SIZE -- CMD [ARG...]")
    if args.need is None:
        raise UsageError(
            "--need is required: each worker's VRAM decides how many fit",
            hint="gpulock pool --need 8.9GiB -- CMD [ARG...]",
        )
    if args.max is not None and args.min > args.max:
        raise UsageError(f"--min {args.min} is above --max {args.max}")
    settings = load(args.config, args.state_dir)
    resolve(command)  # 127/126 before queueing for nothing
    max_workers = args.max or supervisor.max_for(settings, args.gpu, args.need)
    if args.min > max_workers:
        raise UsageError(
            f"--min {args.min} workers of {format_size(args.need)} can never fit together "
            f"(at most {max_workers})"
        )
    spec = supervisor.PoolSpec(
        command=tuple(command),
        need_bytes=args.need,
        max_workers=max_workers,
        min_workers=args.min,
        retries=args.retries,
        gpu=args.gpu,
        name=args.name,
        timeout_s=args.timeout,
    )
    return supervisor.run_pool(settings, spec)
