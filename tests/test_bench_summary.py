"""A benchmark's ``summary:`` line names the target it missed, not only that one was missed."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from cli_helpers import REPO


def bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_lock_handoffs_summary_names_the_missed_target() -> None:
    lh = bench("lock_handoff")
    plan = lh.Plan(1, 1, 1, 1, 1, 1, 0.1, (10, 500), 1, 1, 1, 1, 1, 1)
    targets = [
        lh.Target("1-waiter handoff p50 <= 2 ms", True, "handoff p50"),
        lh.Target("queue-16 handoff p50 within 3x of flock's", False, "queue-16 vs flock"),
        lh.Target("status with 100 tickets <= 50 ms of its own work (p50)", None, "status"),
    ]
    line = lh.summary({}, plan, targets)
    verdict = line.rsplit("; ", 2)[-2:]
    assert verdict == [
        "FAILED: queue-16 handoff p50 within 3x of flock's",
        "not judged: status with 100 tickets <= 50 ms of its own work (p50)",
    ], line


def test_make_bench_runs_every_benchmark_of_bench() -> None:
    """``make bench`` runs each ``bench/*.py`` (the docs cite their figures): a new benchmark
    left out of the target fails here."""
    import re

    makefile = (REPO / "Makefile").read_text()
    target = re.search(r"^bench:.*\n((?:\t.*\n)+)", makefile, flags=re.M)
    assert target is not None, "no bench: target in the Makefile"
    run = set(re.findall(r"bench/([\w-]+\.py)", target.group(1)))
    scripts = {p.name for p in (REPO / "bench").glob("*.py")}
    assert scripts - run == set(), f"add to the Makefile's bench target: {sorted(scripts - run)}"
    assert run - scripts == set(), f"the bench target runs missing files: {sorted(run - scripts)}"
