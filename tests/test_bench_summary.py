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
