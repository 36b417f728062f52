"""``gpulock cluster``: the fleet, read from the cluster's Redis (one row a host).

Found by ``gpulock`` through the ``gpulock.commands`` entry point (``cluster``); the ``redis``
client is imported only when it runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence

from gpulock.cli import Parser, print_json, run_command
from gpulock.core.errors import GpulockError
from gpulock.core.units import parse_usd

DESCRIPTION = """\
Show every live host of the cluster (config: cluster:): its gateway, heartbeat age, governor
level, each GPU's total and free memory, holders, waiters and a newcomer's wait estimate, and
its warm candidates.  Read from the cluster's Redis; a host silent for 3 heartbeats is gone."""

EPILOG = """\
exit codes: 0 shown; 1 error (no cluster: section, bad config, Redis unreachable: the reason is
named, never the password)."""


def build_parser(prog: str = "gpulock cluster") -> argparse.ArgumentParser:
    p = Parser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--config", metavar="FILE", help="config file (default: the usual lookup)")
    p.add_argument("--state-dir", metavar="DIR", help="state folder (default: as gpulock's)")
    return p


def _router_budget(section: object) -> float | None:
    """``router.daily_budget`` as written (the router validates it; a bad one shows none)."""
    value = section.get("daily_budget") if isinstance(section, Mapping) else None
    try:
        return None if value is None else parse_usd(value)
    except ValueError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_main, argv)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from gpulock.cluster import config as cluster_config
    from gpulock.cluster import cooldowns, report, spend
    from gpulock.cluster.fleet import fleet_object, render, spend_entry
    from gpulock.cluster.store import Store
    from gpulock.core.settings import load

    settings = load(args.config, args.state_dir)
    cc = cluster_config.load(settings.config)
    if cc is None:
        where = settings.config.path or "the config"
        raise GpulockError(
            f"no cluster: section in {where}",
            hint="cluster: {redis: redis://HOST:6379/0} (see docs/cluster.md)",
        )
    store = Store(cc)
    try:
        raw = store.hosts()
        cooling = cooldowns.cooling_peers(cooldowns.read(store))
        now = time.time()
        shared = spend.spent(store, now_wall=now)
    finally:
        store.close()
    reports = [r for r in (report.parse(o) for o in raw) if r is not None]
    obj = fleet_object(
        reports, me=cc.host, redis_ok=True, problem=None, now_wall=now, cooling=cooling
    )
    budget = _router_budget(settings.config.section("router"))
    obj["spend"] = spend_entry(shared, budget, spend.day(now))
    if args.json:
        print_json(obj)
    else:
        print(render(obj), file=sys.stdout)
    return 0
